"""`sdjax generate`'s options checked and turned into a `metadata.GenerationRequest`: the image-to-image, inpainting,
outpainting and hires settings, the ControlNet units with their control maps, A1111's sampler + schedule, and the
pipeline's defaults; each bad option is a usage error (exit 2) naming it, before anything compiles."""

from __future__ import annotations

from typing import Any

import typer

from sdjax import infotext, metadata


def _task_options(
    pipe,
    *,
    image,
    strength,
    mask,
    mask_blur,
    only_masked,
    outpaint,
    resize_mode,
    hires_scale,
    hires_strength,
    hires_steps,
    hires_upscaler,
    width,
    height,
) -> dict[str, Any]:
    """The image-to-image, inpainting, outpainting and hires settings of `generate` as `GenerationRequest` fields
    (plus the resolved width/height), checked before anything loads or compiles."""
    from sdjax.core import images as image_lib

    out: dict[str, Any] = {"width": width, "height": height}
    if image is None:
        for flag, given in (
            ("--mask", mask is not None),
            ("--outpaint", outpaint is not None),
            ("--only-masked", only_masked is not None),
        ):
            if given:
                raise typer.BadParameter("needs --image", param_hint=flag)
        if hires_scale is not None:
            from sdjax.pipelines.recipes import Hires

            try:
                out["hires"] = Hires(
                    scale=hires_scale, strength=hires_strength, steps=hires_steps, upscaler=hires_upscaler
                )
            except ValueError as e:
                raise typer.BadParameter(str(e), param_hint="--hires-*") from None
        return out
    if hires_scale is not None:
        raise typer.BadParameter(
            "the hires fix is a text-to-image option; leave out --image", param_hint="--hires-scale"
        )
    try:
        init = image_lib.load_image(str(image), "--image").convert("RGB")
        mask_im = image_lib.load_image(str(mask), "--mask") if mask is not None else None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--image/--mask") from None
    if outpaint is not None:
        if mask_im is not None:
            raise typer.BadParameter("--outpaint makes its own mask; leave out --mask", param_hint="--outpaint")
        try:
            sides = [int(v) for v in outpaint.split(",")]
            if len(sides) != 4:
                raise ValueError
        except ValueError:
            raise typer.BadParameter(
                f"{outpaint!r} is not four comma-separated ints L,T,R,B", param_hint="--outpaint"
            ) from None
        try:
            init, mask_im = image_lib.outpaint_canvas(init, *sides)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--outpaint") from None
    if mask_im is not None and mask_im.size != init.size:
        raise typer.BadParameter(
            f"the mask is {mask_im.size[0]}x{mask_im.size[1]} but the image is {init.size[0]}x{init.size[1]}",
            param_hint="--mask",
        )
    if width is None and height is None:
        width, height = init.size
    elif width is None or height is None:
        raise typer.BadParameter(
            "with --image give both --width and --height, or neither (the image's size)", param_hint="--width/--height"
        )
    out.update(
        width=width,
        height=height,
        init_image=init,
        mask_image=mask_im,
        denoising_strength=strength,
        resize_mode=resize_mode,
    )
    if mask_im is not None:
        out.update(mask_blur=mask_blur, inpaint_full_res_padding=only_masked)
    return out


def _per_unit(values, n: int, option: str, default):
    if not values:
        return [default] * n
    if len(values) == 1:
        return list(values) * n
    if len(values) != n:
        raise typer.BadParameter(f"give one value, or one per --controlnet ({n}); got {len(values)}", param_hint=option)
    return list(values)


def _control_units(models, images, modules, scales, starts, ends) -> tuple:
    """--controlnet and its options -> `metadata.ControlUnit`s with their control maps (checked before loading)."""
    models, images = list(models or ()), list(images or ())
    if not models:
        if images or modules or scales or starts or ends:
            raise typer.BadParameter("control options need --controlnet", param_hint="--controlnet")
        return ()
    if len(images) != len(models):
        raise typer.BadParameter(
            f"give one --control-image per --controlnet ({len(models)}); got {len(images)}",
            param_hint="--control-image",
        )
    import numpy as np
    from PIL import Image

    from sdjax import preprocess

    n = len(models)
    modules = _per_unit(modules, n, "--control-preprocess", "none")
    scales = _per_unit(scales, n, "--control-scale", 1.0)
    starts = _per_unit(starts, n, "--control-start", 0.0)
    ends = _per_unit(ends, n, "--control-end", 1.0)
    units = []
    for model, path, module, scale, start, end in zip(models, images, modules, scales, starts, ends, strict=True):
        if not 0 <= start < end <= 1:
            raise typer.BadParameter(f"need 0 <= start < end <= 1, got {start} and {end}", param_hint="--control-start")
        try:
            pre = preprocess.get_preprocessor(module)
        except (KeyError, ValueError) as e:
            raise typer.BadParameter(str(e.args[0] if e.args else e), param_hint="--control-preprocess") from None
        try:
            with Image.open(path) as im:
                source = np.asarray(im.convert("RGB"))
        except (OSError, ValueError) as e:
            raise typer.BadParameter(f"{path}: not a readable image ({e})", param_hint="--control-image") from None
        try:
            control_map = pre(source)
        except (ValueError, ImportError) as e:
            raise typer.BadParameter(f"{module}: {e}", param_hint="--control-preprocess") from None
        units.append(metadata.ControlUnit(model, pre.name, float(scale), float(start), float(end), control_map))
    return tuple(units)


def _a1111_sampler(sampler: str, schedule: str) -> str:
    """--sampler + --schedule as one sampler string, with A1111's meaning of "Automatic"."""
    try:
        return infotext.a1111_sampler(sampler, schedule)
    except infotext.SamplerChoiceError as e:
        raise typer.BadParameter(str(e), param_hint=f"--{e.field}") from None


def _request(
    pipe, *, prompt, negative_prompt, model, sampler, steps, guidance_scale, width, height, seed, num_images, **task
) -> metadata.GenerationRequest:
    """Resolve defaults from the pipeline and check everything before anything compiles."""
    import random

    dh, dw = pipe.default_size
    if guidance_scale is None:  # the face's default CFG scale: A1111's 7.5; Forge's 1 for guidance-distilled Flux
        guidance_scale = getattr(pipe, "cfg_scale_default", 7.5)
    request = metadata.GenerationRequest(
        prompt=prompt,
        negative_prompt=negative_prompt,
        num_images=num_images,
        seed=random.SystemRandom().randrange(metadata.SEED_MAX + 1) if seed == -1 else seed,
        steps=steps or pipe.default_steps,
        guidance_scale=guidance_scale,
        width=width or dw,
        height=height or dh,
        sampler=sampler or pipe.default_sampler,
        model=infotext.model_label(model),
        **task,
    )
    texts = [prompt, negative_prompt]
    if request.loras:  # the <lora:...> tags were resolved; the text encoder reads the rest
        texts = metadata.strip_lora_tags(texts, request.loras)
    for hint, kwargs in (
        ("--sampler", dict(sampler=request.sampler)),
        ("--steps", dict(steps=request.steps)),
        ("--width/--height", dict(height=request.height, width=request.width)),
        ("PROMPT", dict(prompts=[texts[0]], negative_prompts=[texts[1]])),
    ):
        try:
            pipe.validate(**kwargs)
        except (ValueError, KeyError) as e:
            raise typer.BadParameter(str(e.args[0] if e.args else e), param_hint=hint) from None
    return request
