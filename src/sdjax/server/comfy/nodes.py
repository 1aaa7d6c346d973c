"""ComfyUI node semantics on sdjax: a checked workflow (`graph.Graph`) planned into sdjax generations.

`plan(graph, ctx)` evaluates the nodes the outputs depend on into symbolic values (a model with its LoRAs, a CLIP
with its LoRAs and clip skip, a conditioning, a latent that is empty / an encoded image / an inpainting pair, an image
that is pixels or the result of a sampler) and turns each KSampler into one `GenerationRequest`: text-to-image
from an EmptyLatentImage, image-to-image from VAEEncode, inpainting from VAEEncodeForInpaint or SetLatentNoiseMask.
A second KSampler on a first pass's latent (through LatentUpscale(By) "bilinear", or "nearest-exact" at whole-number
ratios, or at the same size) is A1111's hires fix of that generation (`recipes.Hires`: its steps, denoise, sampler).
SamplerCustomAdvanced (with RandomNoise, a BasicGuider or CFGGuider, KSamplerSelect and BasicScheduler) and
SamplerCustom are the same generation as a KSampler with those settings; SplitSigmas' low_sigmas on an encoded image
start it later (`comfy.custom`). CLIPTextEncodeFlux and CLIPTextEncodeSD3 give each text encoder its own text, and
ConditioningZeroOut as the negative is zero negative embeddings (`comfy.inputs`); both travel to the family's
conditioning as `GenerationRequest.conditioning` options (`_options`). The loaders of a model's parts (UNETLoader,
CLIPLoader, DualCLIPLoader, TripleCLIPLoader; `comfy.loaders`) give the served model's parts when they name them.
The requests run through the server's batcher like any other API's. What does not map is refused with a node error
naming the node and input (`graph.NodeError`), never skipped:

- a KSampler fed by a decoded and re-encoded image (pixel-space second passes), a third pass, a second pass with
  another model, prompts, cfg or seed than the first, or whose first pass is decoded too (sdjax keeps only the
  final images); LatentUpscale(By) of an encoded image; VAEDecode of a latent no sampler made;
- two sampling stages (KSamplerAdvanced's end_at_step with leftover noise, SplitSigmas' high_sigmas, then a sampler
  adding no noise) that are not the one-stage run (`comfy.custom`: another sampler, prompts or cfg in the second
  stage, a sampler with a history or noise of its own); KSamplerAdvanced's end_at_step without leftover noise;
  ConditioningZeroOut as the positive prompt, or as the negative at cfg > 1 on a model of another family than Flux
  and SD 3; ConditioningCombine of two different conditionings (ComfyUI averages two predictions) and
  ConditioningSetTimestepRange other than 0..1 (a conditioning for some steps only), where the model evaluates them,
  except a negative handed over at one step (`comfy.custom._negative_switch`: `metadata.NegativeSwitch`);
- denoise < 1 on an empty latent; a sampler or scheduler sdjax lacks; positive and negative with different CLIP
  settings or ControlNets; a checkpoint, LoRA, VAE or ControlNet the server does not have;
- a UNETLoader or CLIP loader that does not name the served model's parts (`comfy.loaders`: sdjax loads a model's
  parts together and cannot swap them per prompt); EmptySD3LatentImage on a model with 4 latent channels.

Step rules: a KSampler with `steps` s and `denoise` d on an image runs ComfyUI's s steps at the end of an
`int(s / d)`-step schedule; sdjax writes that as A1111's img2img rule (`policy.a1111_start_step`: total steps T and
a strength that makes it run s of them). KSamplerAdvanced's `start_at_step` k runs steps k.. of its schedule.

Seeds: ComfyUI draws noise with torch's RNG, sdjax with JAX's (`fold_in(PRNGKey(seed), 0)`), so no seed gives
ComfyUI's image; the same seed gives the same sdjax image. Seeds above 2**32 - 1 are taken modulo 2**32 (sdjax's
seeds are A1111's 32-bit ones); image `i` of a batch uses `seed + i`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from PIL import Image, ImageFilter

from sdjax.infotext import CONDITIONING_KEYS
from sdjax.metadata import SEED_MAX, GenerationRequest
from sdjax.server.comfy import loaders
from sdjax.server.comfy.custom import CustomSampling, sampler_of
from sdjax.server.comfy.graph import Graph, Node, NodeError, failed_validation
from sdjax.server.comfy.inputs import ENCODER_OPTIONS, Inputs, mask_image
from sdjax.server.comfy.values import (
    Clip,
    Cond,
    Context,
    Guider,
    Latent,
    Model,
    Output,
    Pick,
    Pixels,
    Plan,
    Sigmas,
    Stage,
)
from sdjax.server.schemas import FieldError, check_common

__all__ = ["Context", "Plan", "plan"]


def plan(graph: Graph, ctx: Context) -> Plan:
    """The generations and outputs of `graph`; raises `graph.PromptError` listing every node that cannot run."""
    planner = _Planner(graph, ctx)
    outputs, errors = [], {}
    for out in graph.outputs:
        try:
            outputs.append(planner.output(graph.nodes[out]))
        except NodeError as e:
            errors.setdefault(e.node_id, []).append(e.item)
    if errors:
        raise failed_validation(graph, errors)
    order = list(dict.fromkeys(n for o in graph.outputs for n in graph.upstream(o)))
    return Plan(planner.stages, outputs, order)


class _Planner(Inputs, CustomSampling):
    def __init__(self, graph: Graph, ctx: Context):
        self.graph, self.ctx = graph, ctx
        self.stages: list[Stage] = []
        self.cache: dict[tuple[str, int], Any] = {}

    def value(self, node: Node, name: str) -> Any:
        """The value of a linked input."""
        link = node.link(name)
        if link is None:
            return None
        if link not in self.cache:
            source = self.graph.nodes[link[0]]
            method = getattr(self, f"n_{source.class_type}")
            result = method(source, node.inputs)
            self.cache.update({(source.id, i): v for i, v in enumerate(result)})
        return self.cache[link]

    def output(self, node: Node) -> Output:
        pixels = self.value(node, "images")
        if node.class_type == "SaveImage":
            return Output(node.id, "output", node.inputs.get("filename_prefix", "ComfyUI"), pixels)
        return Output(node.id, "temp", "ComfyUI_temp", pixels)

    # ------------------------------------------------------------------ latents
    def n_EmptyLatentImage(self, node: Node, _) -> tuple:
        w, h = int(node.inputs["width"]) // 8 * 8, int(node.inputs["height"]) // 8 * 8
        return (Latent("empty", w, h, int(node.inputs["batch_size"]), node=node.id),)

    def n_EmptySD3LatentImage(self, node: Node, _) -> tuple:
        """EmptyLatentImage for the 16-channel models (SD 3, Flux): the same txt2img latent."""
        channels = loaders.latent_channels(self.ctx.pipeline)
        if channels != 16:
            raise NodeError(node.id, "node_not_supported", f"EmptySD3LatentImage makes the 16-channel latents of SD 3 "
                            f"and Flux; the served model's have {channels} channels: use EmptyLatentImage")  # fmt: skip
        return self.n_EmptyLatentImage(node, _)

    def n_VAEEncode(self, node: Node, _) -> tuple:
        image = self._pixels_in(node, "pixels")
        return (self._encoded(node, image, None),)

    def n_VAEEncodeForInpaint(self, node: Node, _) -> tuple:
        image = self._pixels_in(node, "pixels")
        mask = mask_image(self.value(node, "mask"), image.size)
        grow = int(node.inputs["grow_mask_by"])
        if grow > 0:  # ComfyUI dilates the mask by a grow x grow square before filling
            mask = mask.filter(ImageFilter.MaxFilter(grow | 1))
        binary = np.asarray(mask) >= 128
        arr = np.asarray(image).copy()
        arr[binary] = 128  # ComfyUI fills the masked pixels with grey (0.5) before encoding
        return (self._encoded(node, Image.fromarray(arr), Image.fromarray((binary * 255).astype(np.uint8))),)

    def n_SetLatentNoiseMask(self, node: Node, _) -> tuple:
        latent = self.value(node, "samples")
        if latent.kind != "image":
            raise NodeError(
                node.id,
                "node_not_supported",
                "samples: a noise mask is served on an encoded image (VAEEncode)",
                "samples",
            )
        mask = mask_image(self.value(node, "mask"), latent.image.size)
        return (dataclasses.replace(latent, mask=mask, node=node.id),)

    def n_LatentUpscale(self, node: Node, _) -> tuple:
        latent = self._upscalable(node)
        w, h = int(node.inputs["width"]), int(node.inputs["height"])
        if w == 0 and h == 0:
            return (latent,)
        w = w or round(latent.width * h / latent.height)
        h = h or round(latent.height * w / latent.width)
        if node.inputs["crop"] != "disabled" and w * latent.height != h * latent.width:
            raise NodeError(node.id, "node_not_supported", "crop: cropping to another aspect ratio is not served",
                            "crop")  # fmt: skip
        return (self._resized(node, latent, w // 8 * 8, h // 8 * 8),)

    def n_LatentUpscaleBy(self, node: Node, _) -> tuple:
        latent = self._upscalable(node)
        s = float(node.inputs["scale_by"])
        # ComfyUI rounds the latent size: round(w / 8 * s) latent pixels
        return (self._resized(node, latent, round(latent.width / 8 * s) * 8, round(latent.height / 8 * s) * 8),)

    def _upscalable(self, node: Node) -> Latent:
        latent = self.value(node, "samples")
        if latent.kind == "empty" or (latent.kind == "sampled" and not latent.second):
            return latent
        raise NodeError(node.id, "node_not_supported", f"{node.class_type}: sdjax resizes an empty latent (it sets "
                        "the size) or a first pass's latent (the hires fix); not an encoded image or a second "
                        "pass", "samples")  # fmt: skip

    def _resized(self, node: Node, latent: Latent, w: int, h: int) -> Latent:
        if latent.kind == "empty":
            return dataclasses.replace(latent, width=w, height=h, node=node.id)
        method = node.inputs["upscale_method"]
        integral = w % latent.width == 0 and h % latent.height == 0
        if method == "bilinear":
            upscaler = "latent"
        elif method == "nearest-exact" and integral:  # equals torch's legacy nearest (A1111's) at integer ratios
            upscaler = "latent-nearest"
        else:
            raise NodeError(node.id, "node_not_supported", f"upscale_method: {method!r} is not served for the "
                            "hires fix; use 'bilinear' (or 'nearest-exact' at a whole-number scale)",
                            "upscale_method")  # fmt: skip
        return Latent("upscaled", w, h, latent.batch, node=node.id, stage=latent.stage, upscaler=upscaler)

    def _pixels_in(self, node: Node, name: str) -> Image.Image:
        pixels = self.value(node, name)
        if pixels.arrays is None:
            raise NodeError(
                node.id,
                "node_not_supported",
                f"{name}: encoding a generated image (a second pass) is not served; encode a loaded image (LoadImage)",
                name,
            )
        if len(pixels.arrays) != 1:
            raise NodeError(node.id, "node_not_supported", f"{name}: one image per encode", name)
        return Image.fromarray(pixels.arrays[0])

    def _encoded(self, node: Node, image: Image.Image, mask: Image.Image | None) -> Latent:
        # ComfyUI's VAEEncode centre-crops the pixels to multiples of 8
        w, h = image.width // 8 * 8, image.height // 8 * 8
        if w < 8 or h < 8:
            raise NodeError(node.id, "invalid_input_type", "pixels: the image is smaller than 8x8", "pixels")
        left, top = (image.width % 8) // 2, (image.height % 8) // 2
        image = image.crop((left, top, left + w, top + h))
        mask = mask.crop((left, top, left + w, top + h)) if mask is not None else None
        return Latent("image", w, h, 1, image=image, mask=mask, vae=self.value(node, "vae"), node=node.id)

    # ------------------------------------------------------------------ sampling and decoding
    def n_VAEDecode(self, node: Node, _) -> tuple:
        latent, vae = self.value(node, "samples"), self.value(node, "vae")
        if latent.kind == "partial":
            raise NodeError(node.id, "node_not_supported", f"samples: the latent of node {latent.node} holds leftover "
                            "noise for a second sampler; sdjax runs the two stages as one generation and decodes only "
                            "its end", "samples")  # fmt: skip
        if latent.kind != "sampled":
            raise NodeError(
                node.id,
                "node_not_supported",
                "samples: sdjax decodes what a KSampler made; this latent was not sampled",
                "samples",
            )
        stage = self.stages[latent.stage]
        if not latent.second:
            if stage.second_pass:
                raise NodeError(node.id, "node_not_supported", "samples: the first pass's images are not kept when "
                                f"a second pass (node {stage.second_pass}) follows", "samples")  # fmt: skip
            stage.first_decoded = node.id
        if stage.vae_fixed and vae.name != stage.request.vae:
            raise NodeError(
                node.id,
                "node_not_supported",
                "vae: decoding with another VAE than the one that encoded "
                "(or decoded) this sampler's latent is not served",
                "vae",
            )
        stage.request = dataclasses.replace(stage.request, vae=vae.name)
        stage.vae_fixed = True
        return (Pixels(stage=latent.stage),)

    def n_KSampler(self, node: Node, _) -> tuple:
        latent = self.value(node, "latent_image")
        steps, denoise = int(node.inputs["steps"]), float(node.inputs["denoise"])
        if latent.kind == "upscaled" or (latent.kind == "sampled" and not latent.second):
            latent = dataclasses.replace(latent, kind="upscaled", upscaler=latent.upscaler or "latent")
            if denoise <= 0:
                raise NodeError(node.id, "value_smaller_than_min", "denoise: 0 changes nothing", "denoise")
            return self._second_pass(node, latent, int(node.inputs["seed"]), steps, denoise, "seed")
        if latent.kind == "empty" and denoise < 1:
            raise NodeError(
                node.id,
                "node_not_supported",
                "denoise: below 1 needs an image latent (VAEEncode); on an empty latent it is not served",
                "denoise",
            )
        total, strength = steps, None
        if latent.kind == "image":
            if denoise <= 0:
                raise NodeError(node.id, "value_smaller_than_min", "denoise: 0 changes nothing", "denoise")
            total = int(steps / denoise)  # ComfyUI: the last `steps` of an int(steps / denoise)-step schedule
            strength = min((steps - 0.5) / total, 1.0)
        return self._stage(node, latent, int(node.inputs["seed"]), total, strength)

    def n_KSamplerAdvanced(self, node: Node, _) -> tuple:
        """KSampler with `noise_seed`, run over steps `start_at_step..end_at_step` of its `steps`-step schedule: the
        custom sampling path (`comfy.custom`) with that window, so that `end_at_step` with leftover noise and
        `add_noise` "disable" from the same step are the two stages it serves."""
        latent = self.value(node, "latent_image")
        steps, start, end = (int(node.inputs[n]) for n in ("steps", "start_at_step", "end_at_step"))
        add_noise = node.inputs["add_noise"] == "enable"
        if end < steps and node.inputs["return_with_leftover_noise"] != "enable":
            raise NodeError(node.id, "node_not_supported", f"end_at_step: stopping at step {end} of {steps} without "
                            "return_with_leftover_noise jumps from there to a clean image (ComfyUI sets the last "
                            "sigma to 0); not served: use end_at_step >= steps, or return_with_leftover_noise "
                            "'enable' for a second sampler", "end_at_step")  # fmt: skip
        if start >= min(end, steps):
            raise NodeError(node.id, "value_bigger_than_max", "start_at_step: must be below steps and end_at_step",
                            "start_at_step")  # fmt: skip
        if latent.kind == "upscaled" or (latent.kind == "sampled" and not latent.second):
            latent = dataclasses.replace(latent, kind="upscaled", upscaler=latent.upscaler or "latent")
            for bad, name in ((start > 0, "start_at_step"), (end < steps, "end_at_step"), (not add_noise, "add_noise")):
                if bad:
                    raise NodeError(node.id, "node_not_supported", f"{name}: a hires pass is served from step 0 to "
                                    "the end with added noise (or with KSampler's denoise)", name)  # fmt: skip
            return self._second_pass(node, latent, int(node.inputs["noise_seed"]), steps, 1.0, "noise_seed")
        model, positive, negative = (self.value(node, n) for n in ("model", "positive", "negative"))
        guider = Guider(model, positive, negative, float(node.inputs["cfg"]), node.id)
        sigmas = Sigmas(model, node.inputs["scheduler"], steps, 1.0, node.id, start=start,
                        stop=end if end < steps else None, split=node.id, split_field="start_at_step")  # fmt: skip
        noise = Pick(int(node.inputs["noise_seed"]) if add_noise else None, node.id)
        return self._custom(node, noise, guider, Pick(node.inputs["sampler_name"], node.id), sigmas, latent)[:1]

    def _stage(self, node: Node, latent: Latent, seed: int, steps: int, strength: float | None, seed_field="seed",
               custom: tuple[Guider, str, dict[str, str]] | None = None):  # fmt: skip
        """One generation: a KSampler's (its model, prompts, cfg, sampler) or, with `custom`, a SamplerCustomAdvanced's
        (its guider, sampler string and the fields naming its steps, cfg and sampler on the nodes that set them)."""
        if latent.kind == "partial":
            raise NodeError(node.id, "node_not_supported", f"latent_image: it holds the leftover noise of node "
                            f"{latent.node} (a first stage); a sampler that adds no noise continues it over the rest "
                            "of that schedule (KSamplerAdvanced, SamplerCustom, SamplerCustomAdvanced + DisableNoise), "
                            f"not {node.class_type}", "latent_image")  # fmt: skip
        if latent.kind == "sampled":
            raise NodeError(
                node.id,
                "node_not_supported",
                "latent_image: a third pass (sampling a second pass's latent) is not served",
                "latent_image",
            )
        if custom is None:
            model, positive, negative = (self.value(node, n) for n in ("model", "positive", "negative"))
            custom = (Guider(model, positive, negative, float(node.inputs["cfg"]), node.id), _sampler(node), {})
        guider, sampler, fields = custom
        switch = None
        if guider.cfg > 1 and guider.negative.parts:  # SD 3's example: another negative from a step on
            name_node = fields.get("sampler", f"{node.id}:").partition(":")[0]
            name = self.graph.nodes[name_node].inputs["sampler_name"]
            guider, switch = self._negative_switch(guider, latent, sampler, steps, name)
        model, positive, negative = guider.model, guider.positive, guider.negative
        options = self._options(guider)
        if positive.clip != negative.clip and not negative.zero:  # (errors name the guider, which has the prompts)
            raise NodeError(
                guider.node,
                "node_not_supported",
                "negative: positive and negative prompts must use the same CLIP (same LoRAs and CLIP Set Last Layer)",
                "negative",
            )
        if positive.control != negative.control:
            raise NodeError(
                guider.node,
                "node_not_supported",
                "negative: ControlNets must condition both prompts (one ControlNetApplyAdvanced)",
                "negative",
            )
        self._shift_size(model, latent)
        vae = latent.vae.name if latent.vae is not None else ""
        request = GenerationRequest(
            prompt=positive.text,
            negative_prompt=negative.text,  # (a zeroed one's is "")
            num_images=latent.batch,
            seed=seed % (SEED_MAX + 1),
            steps=steps,
            guidance_scale=guider.cfg,
            width=latent.width,
            height=latent.height,
            sampler=sampler,
            model=self.ctx.model_name,
            clip_skip=positive.clip.clip_skip,
            distilled_guidance=positive.guidance,
            control=positive.control,
            vae=vae or "",
            prompt_syntax=_syntax(self.ctx.pipeline, positive.text, negative.text),
            conditioning=options,
            negative_switch=switch,
        )
        if latent.kind == "image":
            request = dataclasses.replace(
                request, init_image=latent.image, denoising_strength=strength, mask_image=latent.mask
            )
        self._check(node, request, latent, positive, negative, fields)
        self._check_control(guider, request)
        loras = self._loras(self.graph.nodes[guider.node], model, positive.clip)
        if loras:
            request = dataclasses.replace(request, loras=loras, lora_hashes=self.ctx.networks.lora_hashes(loras))
        inputs = (model, positive, negative, guider.cfg, seed)
        self.stages.append(Stage(node.id, request, vae_fixed=latent.kind == "image", inputs=inputs))
        return (Latent("sampled", latent.width, latent.height, latent.batch, node=node.id, stage=len(self.stages) - 1),)

    def _check_control(self, guider: Guider, r: GenerationRequest) -> None:
        """The generation's ControlNets checked as the library will run them (the task and output size their family
        allows, e.g. SD 3 nets: text-to-image within their position table), refused naming the guider's prompt."""
        if not r.control:
            return
        from sdjax import planning
        from sdjax.server.controlnet import check_units

        prompts = "conditioning" if self.graph.nodes[guider.node].class_type == "BasicGuider" else "positive"
        task = planning.task_name(r.init_image, r.mask_image)
        try:
            check_units(
                self.ctx.pipeline, r.control, width=r.width, height=r.height, task=task, field=lambda k: prompts
            )
        except FieldError as e:
            raise NodeError(guider.node, "node_not_supported", f"{prompts}: {e.detail_message}", prompts) from None

    def _options(self, guider: Guider) -> tuple[tuple[str, Any], ...]:
        """The family conditioning options of a guider's prompts (`GenerationRequest.conditioning`): the encoders'
        own texts (`inputs.ENCODER_OPTIONS`) and, for a zeroed negative that CFG evaluates, `zero_negative`."""
        from sdjax.server.schemas.common import check_text

        family, (positive, negative) = loaders.family(self.ctx.pipeline), (guider.positive, guider.negative)
        prompts = "conditioning" if self.graph.nodes[guider.node].class_type == "BasicGuider" else "positive"
        cfg = guider.cfg > 1  # sdjax evaluates the negative only then (ComfyUI skips it at cfg 1)
        _one_conditioning(positive)
        if cfg:
            _one_conditioning(negative)
        if positive.zero:
            raise NodeError(guider.node, "node_not_supported", f"{prompts}: zero conditioning (ConditioningZeroOut) "
                            "is served as the negative prompt only", prompts)  # fmt: skip
        if negative.zero and cfg and family not in ("flux", "sd3"):
            raise NodeError(guider.node, "node_not_supported", "negative: zero conditioning (ConditioningZeroOut) "
                            f"with cfg > 1 is served on Flux.1 and SD 3 models; the served model is "
                            f"{loaders.title(family)} (at cfg 1 the negative is unused; an empty prompt is not zero "
                            "conditioning)", "negative")  # fmt: skip
        names = ENCODER_OPTIONS.get(family or "", {})
        out: list[tuple[str, Any]] = []
        for cond, prefix in [(positive, "")] + ([(negative, "negative_")] if cfg else []):
            for encoder, text in cond.texts:
                try:
                    check_text(f"{cond.text_node}:{encoder}", text)
                except FieldError as e:
                    raise NodeError(cond.text_node, "invalid_input_type", f"{encoder}: {e.detail_message}",
                                    encoder) from None  # fmt: skip
                out.append((prefix + names[encoder], text))
        if negative.zero and cfg:
            out.append(("zero_negative", True))
        order = list(CONDITIONING_KEYS)  # the infotext's order: a request read back from its PNG is equal
        return tuple(sorted(out, key=lambda item: order.index(item[0])))

    def _second_pass(self, node: Node, latent: Latent, seed: int, steps: int, denoise: float, seed_field: str):
        """A KSampler on an upscaled first-pass latent: A1111's hires fix on the first pass's generation, which
        runs ComfyUI's `steps` steps of an `int(steps / denoise)`-step schedule (`recipes.Hires.window`)."""
        from sdjax.pipelines.recipes import Hires
        from sdjax.server.schemas import _check_hires  # the A1111 API's checks of the second pass

        first = self.stages[latent.stage]
        model, positive, negative = (self.value(node, n) for n in ("model", "positive", "negative"))
        self._shift_size(model, latent)
        problems = [
            (first.request.init_image is not None, "latent_image", "the hires fix follows a text-to-image pass"),
            (bool(first.second_pass), "latent_image", f"node {first.second_pass} already samples this latent"),
            (bool(first.first_decoded), "latent_image", f"the first pass's images are decoded (node "
             f"{first.first_decoded}); they are not kept when a second pass follows"),
            (bool(first.request.control), "positive", "ControlNet does not run with the hires fix"),
            (first.request.negative_switch is not None, "negative", "a negative handed over at a step "
             "(ConditioningSetTimestepRange) does not run with the hires fix"),
            ((model, positive, negative) != first.inputs[:3], "positive", "the second pass must use the first "
             "pass's model, LoRAs and prompts"),
            (float(node.inputs["cfg"]) != first.inputs[3], "cfg", "the second pass must use the first pass's cfg"),
            (seed != first.inputs[4], seed_field, f"must equal the first pass's seed ({first.inputs[4]}): sdjax "
             "draws the second pass's noise from it"),
        ]  # fmt: skip
        for bad, name, message in problems:
            if bad:
                raise NodeError(node.id, "node_not_supported", f"{name}: {message}", name)
        sampler = _sampler(node)
        hires = Hires(resize=(latent.width, latent.height), upscaler=latent.upscaler, steps=steps, strength=denoise,
                      sampler=None if sampler == first.request.sampler else sampler)  # fmt: skip
        request = dataclasses.replace(first.request, hires=hires)
        try:
            _check_hires(request, self.ctx.pipeline, self.ctx.limits)
            check_common(self.ctx.pipeline, self.ctx.limits, fields={"sampler": f"{node.id}:sampler_name"},
                         num_images=1, steps=hires.window(steps)[0], width=latent.width, height=latent.height,
                         guidance_scale=request.guidance_scale, sampler=sampler, prompt=request.prompt,
                         negative_prompt=request.negative_prompt)  # fmt: skip
        except FieldError as e:
            name = e.field.partition(":")[2] or "steps"
            raise NodeError(node.id, "invalid_input_type", e.detail_message, name) from None
        except Exception as e:  # the budget (APIError over_budget) names no field
            raise NodeError(node.id, "invalid_input_type", str(e), "steps") from None
        first.request, first.second_pass = request, node.id
        return (Latent("sampled", latent.width, latent.height, latent.batch, node=node.id, stage=latent.stage,
                       second=True),)  # fmt: skip

    def _check(self, node: Node, r: GenerationRequest, latent: Latent, positive: Cond, negative: Cond,
               named: dict[str, str]) -> None:  # fmt: skip
        fields = (
            dict(
                num_images=f"{latent.node}:batch_size",
                steps=f"{node.id}:steps",
                guidance_scale=f"{node.id}:cfg",
                width=f"{latent.node}:width",
                height=f"{latent.node}:height",
                size=f"{latent.node}:width",
                sampler=f"{node.id}:sampler_name",
                prompt=f"{positive.text_node}:text",
                negative_prompt=f"{negative.text_node}:text",
            )
            | named
        )
        try:
            check_common(
                self.ctx.pipeline,
                self.ctx.limits,
                fields=fields,
                num_images=r.num_images,
                steps=r.steps,
                width=r.width,
                height=r.height,
                guidance_scale=r.guidance_scale,
                sampler=r.sampler,
                prompt=r.prompt,
                negative_prompt=r.negative_prompt,
            )
        except FieldError as e:
            nid, _, name = e.field.partition(":")
            raise NodeError(nid, "invalid_input_type", f"{name}: {e.detail_message}", name) from None
        except Exception as e:  # the budget (APIError over_budget) names no field
            raise NodeError(node.id, "invalid_input_type", str(e), "steps") from None

    def _loras(self, node: Node, model: Model, clip: Clip) -> tuple:
        """The LoRAs of the model and CLIP paths as sdjax's (name, weight | (text encoders, UNet)), loaded and
        checked against the served model by `Networks` (the `<lora:name:te:unet>` reading of the A1111 API)."""
        names = list(dict.fromkeys([n for n, _ in model.loras] + [n for n, _ in clip.loras]))
        if not names:
            return ()
        unet, te = dict(model.loras), dict(clip.loras)
        tags = " ".join(f"<lora:{n}:{te.get(n, 0.0):g}:{unet.get(n, 0.0):g}>" for n in names)
        try:
            found = self.ctx.networks.prompt_loras(self.ctx.pipeline, {"lora_name": tags})
        except FieldError as e:
            raise NodeError(node.id, "value_not_in_list", e.detail_message, "model") from None
        return tuple((n, s[0] if isinstance(s, tuple) and s[0] == s[1] else s) for n, s in found)


def _one_conditioning(cond: Cond) -> None:
    """A conditioning the model evaluates must be one for every step: not ConditioningCombine's pair of two (ComfyUI
    averages their predictions), nor a ConditioningSetTimestepRange other than 0..1 (ComfyUI uses it at some steps
    only; a pair of ranges swaps the conditioning at the step where the boundary's sigma falls)."""
    ranged = [c for c in (cond.parts or (cond,)) if c.span != (0.0, 1.0)]
    if ranged:
        c = ranged[0]
        rest = (
            f"ComfyUI swaps the two conditionings combined by node {cond.parts_node} at the step where that "
            "percent's sigma falls"
            if cond.parts
            else "ComfyUI leaves it out at the other steps"
        )
        span = f"{c.span[0]:g}..{c.span[1]:g}"
        raise NodeError(c.span_node, "node_not_supported", f"start: ConditioningSetTimestepRange {span} conditions "
                        f"part of the schedule; {rest}. sdjax runs one conditioning at every step of a generation and "
                        "cannot change it between steps: use the range 0..1", "start")  # fmt: skip
    if cond.parts:
        raise NodeError(cond.parts_node, "node_not_supported", "conditioning_2: ComfyUI runs the model on each "
                        "conditioning and averages the two predictions; sdjax runs one conditioning per prompt, "
                        "so it combines only equal conditionings (whose average is either)",
                        "conditioning_2")  # fmt: skip


def _sampler(node: Node) -> str:
    """A KSampler's (sampler_name, scheduler) -> the sdjax sampler string (`custom.sampler_of`)."""
    return sampler_of(node.inputs["sampler_name"], node.inputs["scheduler"], node.id, node.id)


def _syntax(pipeline: Any, *texts: str) -> str:
    from sdjax.server.schemas import _a1111_syntax  # the A1111 API's reading of emphasis (ComfyUI's is alike)

    return _a1111_syntax(pipeline, *texts)
