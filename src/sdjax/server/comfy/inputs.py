"""The ComfyUI nodes that feed the samplers (`comfy.nodes`): loaders (checkpoint, LoRA, VAE, ControlNet; those of a
model's parts, UNETLoader and the CLIP loaders, are `comfy.loaders`), conditioning (text, clip skip, Flux guidance,
ControlNet) and images and masks (LoadImage, LoadImageMask, ImageScale), as a mixin of the planner: each
`n_<class_type>` returns the node's outputs as `comfy.values`, or raises a `graph.NodeError`.

Conditioning beyond one prompt text:

- `CLIPTextEncodeFlux` (Flux.1): `clip_l` is CLIP-L's text, `t5xxl` T5's (sdjax's `prompt_2`), `guidance` dev's
  distilled guidance (FluxGuidance's; schnell's transformer ignores it, as in ComfyUI).
- `CLIPTextEncodeSD3` (SD 3 / 3.5): `clip_l`, `clip_g` and `t5xxl` are each encoder's text (sdjax's prompt,
  `prompt_2`, `prompt_3`). With `empty_padding` "empty_prompt" an empty text is the empty prompt's encoding, as
  sdjax encodes it; with "none" ComfyUI leaves an empty T5 text (or both CLIP texts empty) out of the token
  sequence, which sdjax's fixed-length encoders cannot do: refused (an empty CLIP text beside a non-empty one is
  padded with the empty prompt by ComfyUI too, and served).
- `ConditioningZeroOut`: zero embeddings and pooled output (ComfyUI zeroes the tensors; the guidance and ControlNets
  stay). As the negative at cfg > 1 it is the family's `zero_negative` option (Flux, SD 3; `comfy.nodes`); at cfg 1
  the negative is never evaluated, so it is served on every model.
- `ConditioningCombine`: ComfyUI runs the model once per conditioning and averages the predictions; sdjax runs one
  conditioning per prompt, so it serves the combination of two equal conditionings (whose average is either) and
  refuses others by name.
- `ConditioningSetTimestepRange`: the conditioning counts only at the steps whose sigma lies between the sigmas of
  its `start` and `end` percents (ComfyUI: `percent_to_sigma` of the model's sampling; a step at sigma s uses it when
  `sigma(end) <= s <= sigma(start)`, and the conditionings active at a step are averaged). (0, 1) is every step: the
  conditioning itself. A pair of negatives meeting at one percent (the SD 3 example's: the negative prompt for the
  first 10% of the schedule, zero conditioning after) is a negative handed over at a step (`comfy.custom`'s
  `_negative_switch`); other ranges are refused by name (`comfy.nodes`).
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from sdjax.metadata import ControlUnit
from sdjax.server.comfy import loaders
from sdjax.server.comfy.graph import Node, NodeError
from sdjax.server.comfy.values import Clip, Cond, Model, Pixels, Vae
from sdjax.server.schemas import FieldError

# family -> ComfyUI's name of each encoder that reads a text of its own -> the family's conditioning option
ENCODER_OPTIONS = {"flux": {"t5xxl": "prompt_2"}, "sd3": {"clip_g": "prompt_2", "t5xxl": "prompt_3"}}

_RESAMPLE = {
    "nearest-exact": Image.NEAREST,
    "bilinear": Image.BILINEAR,
    "area": Image.BOX,
    "bicubic": Image.BICUBIC,
    "lanczos": Image.LANCZOS,
}


class Inputs(loaders.Loaders):
    """The planner's loader, conditioning and image nodes (`self.value`, `self.ctx` come from the planner)."""

    ctx: Any

    def value(self, node: Node, name: str) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ loaders
    def n_CheckpointLoaderSimple(self, node: Node, _) -> tuple:
        self._served(node, "ckpt_name")
        return Model(), Clip(), Vae(self.ctx.default_vae)

    def _served(self, node: Node, field: str) -> None:
        name = node.inputs[field].strip().replace("\\", "/")
        stem = name.rsplit("/", 1)[-1]
        names = {n.lower() for n in self.ctx.model_names}
        if not ({name.lower(), stem.lower(), stem.rsplit(".", 1)[0].lower()} & names):
            raise NodeError(
                node.id,
                "value_not_in_list",
                f"{field}: {name!r} is not the served model; sdjax serves one model at a time "
                f"({self.ctx.model_names[0]!r}; switch with POST /sdapi/v1/options)",
                field,
            )

    def n_VAELoader(self, node: Node, _) -> tuple:
        """A VAE of the VAE folder; or, by a name of `loaders.served_vae_names` the folder does not have, the served
        model's own (the VAE CheckpointLoaderSimple gives)."""
        name = node.inputs["vae_name"]
        own = loaders.served_vae_names(self.ctx.pipeline)
        md = getattr(self.ctx.networks, "md", None)
        in_folder = md is not None and md.folder("vae") is not None and _has(md, "vae", name)
        if name.strip().replace("\\", "/").rsplit("/", 1)[-1] in own and not in_folder:
            return (Vae(self.ctx.default_vae),)
        also = f"; the served model's own VAE: {own}" if own else ""
        if self.ctx.networks is None:
            raise NodeError(node.id, "value_not_in_list", f"vae_name: this server has no VAE folder{also}", "vae_name")
        try:
            return (Vae(self.ctx.networks.vae(self.ctx.pipeline, name, "vae_name")),)
        except FieldError as e:
            raise NodeError(node.id, "value_not_in_list", e.message + also, "vae_name") from None

    def n_LoraLoader(self, node: Node, _) -> tuple:
        model, clip = self.value(node, "model"), self.value(node, "clip")
        name = self._lora_name(node)
        return (
            Model(_add(model.loras, name, node.inputs["strength_model"])),
            dataclasses.replace(clip, loras=_add(clip.loras, name, node.inputs["strength_clip"])),
        )

    def n_LoraLoaderModelOnly(self, node: Node, _) -> tuple:
        model = self.value(node, "model")
        return (Model(_add(model.loras, self._lora_name(node), node.inputs["strength_model"])),)

    def _lora_name(self, node: Node) -> str:
        name = node.inputs["lora_name"]
        if any(c in name for c in ":<>") or not name.strip():
            raise NodeError(node.id, "value_not_in_list", f"lora_name: {name!r} is not a LoRA name", "lora_name")
        md = getattr(self.ctx.networks, "md", None)
        try:
            if md is None:
                raise LookupError("this server has no Lora/ folder (start it with --models-dir)")
            return md.resolve("lora", name).stem
        except (ValueError, LookupError) as e:
            raise NodeError(
                node.id, "value_not_in_list", f"lora_name: {e.args[0] if e.args else e}", "lora_name"
            ) from None

    def n_ControlNetLoader(self, node: Node, _) -> tuple:
        name = node.inputs["control_net_name"]
        key = name.rsplit("/", 1)[-1]
        key = key.removesuffix(".safetensors") if key not in self.ctx.controlnets else key
        if key not in self.ctx.controlnets:
            raise NodeError(
                node.id,
                "value_not_in_list",
                f"control_net_name: {name!r} is not served; served: {sorted(self.ctx.controlnets)} (--controlnet-dir)",
                "control_net_name",
            )
        return (str(self.ctx.controlnets[key]),)

    # ------------------------------------------------------------------ conditioning
    def n_CLIPSetLastLayer(self, node: Node, _) -> tuple:
        from sdjax.server.models_api import clip_skip_setting

        clip = self.value(node, "clip")
        try:
            skip = clip_skip_setting(-int(node.inputs["stop_at_clip_layer"]), self.ctx.pipeline, "stop_at_clip_layer")
        except FieldError as e:
            raise NodeError(node.id, "value_bigger_than_max", e.message, "stop_at_clip_layer") from None
        return (dataclasses.replace(clip, clip_skip=skip),)

    def n_CLIPTextEncode(self, node: Node, _) -> tuple:
        return (Cond(node.inputs["text"], self.value(node, "clip"), node.id),)

    def n_FluxGuidance(self, node: Node, _) -> tuple:
        if getattr(self.ctx.pipeline, "distilled_guidance_scale", None) is None:
            raise NodeError(
                node.id,
                "node_not_supported",
                "FluxGuidance: the served model has no distilled guidance (Flux dev has)",
                "guidance",
            )
        return (dataclasses.replace(self.value(node, "conditioning"), guidance=float(node.inputs["guidance"])),)

    def n_CLIPTextEncodeFlux(self, node: Node, _) -> tuple:
        self._family_node(node, "flux", "CLIPTextEncodeFlux encodes Flux.1's CLIP-L and T5 texts")
        text = node.inputs["clip_l"]
        texts = _own_texts(text, {"t5xxl": node.inputs["t5xxl"]})
        return (Cond(text, self.value(node, "clip"), node.id, guidance=float(node.inputs["guidance"]), texts=texts),)

    def n_CLIPTextEncodeSD3(self, node: Node, _) -> tuple:
        self._family_node(node, "sd3", "CLIPTextEncodeSD3 encodes SD 3's CLIP-L, CLIP-G and T5 texts")
        clip_l, clip_g, t5 = (node.inputs[n] for n in ("clip_l", "clip_g", "t5xxl"))
        served = loaders.encoders(self.ctx.pipeline)
        dropped = None
        if node.inputs["empty_padding"] == "none" and not clip_l and not clip_g:
            dropped = ("clip_l", "both CLIP texts are")
        elif node.inputs["empty_padding"] == "none" and not t5 and "t5xxl" in served:
            dropped = ("t5xxl", "t5xxl is")
        if dropped:
            raise NodeError(node.id, "node_not_supported", f"{dropped[0]}: with empty_padding 'none' and {dropped[1]} "
                            "empty, ComfyUI leaves those tokens out of the sequence; sdjax encodes every encoder's "
                            "padded tokens: use empty_padding 'empty_prompt' (an empty text is the empty prompt) or "
                            "give a text", dropped[0])  # fmt: skip
        texts = _own_texts(clip_l, {"clip_g": clip_g, **({"t5xxl": t5} if "t5xxl" in served else {})})
        return (Cond(clip_l, self.value(node, "clip"), node.id, texts=texts),)

    def _family_node(self, node: Node, family: str, what: str) -> None:
        served = loaders.family(self.ctx.pipeline)
        if served != family:
            raise NodeError(node.id, "node_not_supported", f"{what}; the served model ({self.ctx.model_name!r}) is "
                            f"{loaders.title(served)}: use CLIPTextEncode", "clip")  # fmt: skip

    def n_ConditioningZeroOut(self, node: Node, _) -> tuple:
        """Zero embeddings: the text no longer matters (two zeroed conditionings are equal), the rest stays."""
        cond = self.value(node, "conditioning")
        return (dataclasses.replace(cond, text="", texts=(), zero=True, text_node=node.id),)

    def n_ConditioningSetTimestepRange(self, node: Node, _) -> tuple:
        """The conditioning with ComfyUI's step range (it replaces a range set before); checked where it is used."""
        start, end = float(node.inputs["start"]), float(node.inputs["end"])
        if start >= end:
            raise NodeError(node.id, "value_bigger_than_max", f"start: {start} must be below end ({end}); the "
                            "conditioning would count at no step", "start")  # fmt: skip
        cond = self.value(node, "conditioning")
        if (start, end) == (0.0, 1.0):
            return (dataclasses.replace(cond, span=(0.0, 1.0), span_node=""),)
        return (dataclasses.replace(cond, span=(start, end), span_node=node.id),)

    def n_ConditioningCombine(self, node: Node, _) -> tuple:
        """Two equal conditionings are either; two others are kept as the pair ComfyUI averages, which the sampler
        refuses where the model evaluates it (`comfy.nodes`: at cfg 1 a negative is never evaluated)."""
        first, second = self.value(node, "conditioning_1"), self.value(node, "conditioning_2")
        if first == second:
            return (first,)
        return (dataclasses.replace(first, parts=(first, second), parts_node=node.id),)

    def n_ControlNetApplyAdvanced(self, node: Node, _) -> tuple:
        positive, negative = self.value(node, "positive"), self.value(node, "negative")
        net, pixels = self.value(node, "control_net"), self.value(node, "image")
        if pixels.arrays is None:
            raise NodeError(
                node.id,
                "node_not_supported",
                "image: a control image must be loaded (LoadImage), not generated in the same prompt",
                "image",
            )
        start, end = float(node.inputs["start_percent"]), float(node.inputs["end_percent"])
        if not start < end:
            raise NodeError(
                node.id, "value_bigger_than_max", "start_percent must be below end_percent", "start_percent"
            )
        from sdjax.pipelines.controlnet import control_spec

        try:
            control_spec(self.ctx.pipeline, [net], None)  # loads (cached on the pipeline) and checks the family
        except (ValueError, KeyError, OSError) as e:
            raise NodeError(node.id, "node_not_supported", str(e.args[0] if e.args else e), "control_net") from None
        unit = ControlUnit(net, "none", float(node.inputs["strength"]), start, end, pixels.arrays[0])
        return (
            dataclasses.replace(positive, control=(*positive.control, unit)),
            dataclasses.replace(negative, control=(*negative.control, unit)),
        )

    # ------------------------------------------------------------------ images and masks
    def n_LoadImage(self, node: Node, _) -> tuple:
        im = self._open(node)
        rgb = np.asarray(im.convert("RGB"))[None]
        if "A" in im.getbands():
            mask = 1.0 - np.asarray(im.getchannel("A"), np.float32) / 255.0
        else:
            mask = np.zeros((64, 64), np.float32)  # ComfyUI's empty mask
        return Pixels(rgb), mask

    def n_LoadImageMask(self, node: Node, _) -> tuple:
        im = self._open(node)
        channel = node.inputs["channel"]
        band = {"alpha": "A", "red": "R", "green": "G", "blue": "B"}[channel]
        if band not in im.getbands():
            im = im.convert("RGBA")
        if band not in im.getbands():
            return (np.zeros((64, 64), np.float32),)
        mask = np.asarray(im.getchannel(band), np.float32) / 255.0
        return (1.0 - mask if band == "A" else mask,)

    def _open(self, node: Node) -> Image.Image:
        name = node.inputs["image"]
        data = self.ctx.read_input(name)
        if data is None:
            raise NodeError(
                node.id, "value_not_in_list", f"image: no uploaded image {name!r} (POST /upload/image)", "image"
            )
        try:
            im = Image.open(io.BytesIO(data))
            if im.width * im.height > self.ctx.limits.max_image_pixels:
                raise ValueError(f"{im.width}x{im.height} pixels exceed {self.ctx.limits.max_image_pixels}")
            im = ImageOps.exif_transpose(im)
            im.load()
        except Exception as e:  # any decoding failure is this input's problem
            raise NodeError(
                node.id, "invalid_input_type", f"image: {name!r} is not a readable image: {e}", "image"
            ) from None
        return im

    def n_ImageScale(self, node: Node, _) -> tuple:
        pixels = self.value(node, "image")
        w, h = int(node.inputs["width"]), int(node.inputs["height"])
        method, crop = _RESAMPLE[node.inputs["upscale_method"]], node.inputs["crop"] == "center"
        limit = self.ctx.limits.max_image_pixels
        if max(w, 1) * max(h, 1) > limit:
            raise NodeError(node.id, "value_bigger_than_max", f"width x height: {w}x{h} is over the server's "
                            f"{limit} pixels per image", "width")  # fmt: skip

        def scale(arrays: np.ndarray) -> np.ndarray:
            return np.stack([np.asarray(_resize(Image.fromarray(a), w, h, method, crop, limit)) for a in arrays])

        if pixels.arrays is not None:
            return (Pixels(scale(pixels.arrays)),)
        return (dataclasses.replace(pixels, ops=(*pixels.ops, scale)),)


def _own_texts(text: str, others: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The encoders' texts that differ from the prompt (the others read the prompt, as CLIPTextEncode's do)."""
    return tuple((name, t) for name, t in others.items() if t != text)


def _has(md: Any, kind: str, name: str) -> bool:
    try:
        md.resolve(kind, name)
    except (ValueError, LookupError):
        return False
    return True


def _add(loras: tuple, name: str, strength: float) -> tuple:
    """A LoRA applied again adds its strength (ComfyUI patches the weights twice)."""
    weights = dict(loras)
    weights[name] = weights.get(name, 0.0) + float(strength)
    return tuple(weights.items())


def mask_image(mask: np.ndarray, size: tuple[int, int]) -> Image.Image:
    """A MASK (floats, 1 = repaint) as a PIL "L" image of `size` (ComfyUI resizes masks bilinearly)."""
    im = Image.fromarray(np.clip(np.round(np.asarray(mask) * 255), 0, 255).astype(np.uint8))
    return im if im.size == size else im.resize(size, Image.BILINEAR)


def _resize(im: Image.Image, w: int, h: int, method: int, crop: bool, limit: int) -> Image.Image:
    """ComfyUI's `common_upscale`: 0 keeps the aspect ratio; "center" crops to the target's aspect first."""
    if w == 0 and h == 0:
        return im
    w = w or max(1, round(im.width * h / im.height))
    h = h or max(1, round(im.height * w / im.width))
    if w * h > limit:
        raise ValueError(f"ImageScale: {w}x{h} is over the server's {limit} pixels per image")
    if crop:
        old, new = im.width / im.height, w / h
        if old > new:
            cw = round(im.height * new)
            x = (im.width - cw) // 2
            im = im.crop((x, 0, x + cw, im.height))
        elif old < new:
            ch = round(im.width / new)
            y = (im.height - ch) // 2
            im = im.crop((0, y, im.width, y + ch))
    return im.resize((w, h), method)
