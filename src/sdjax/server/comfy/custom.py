"""ComfyUI's custom sampling nodes (`comfy_extras.nodes_custom_sampler`) and model-sampling nodes as sdjax generations,
a mixin of the planner (`comfy.nodes`): the Flux example's `RandomNoise` + `BasicGuider` (or `CFGGuider`) +
`KSamplerSelect` + `BasicScheduler` + `SamplerCustomAdvanced` is the generation a KSampler with the same seed, cfg,
sampler, scheduler, steps and denoise makes (BasicGuider: the positive prompt alone at cfg 1, i.e. no CFG).

- `SamplerCustomAdvanced` samples an empty latent (txt2img) or an encoded image (img2img, inpainting: BasicScheduler's
  `denoise` d runs the last `steps` of an `int(steps / d)`-step schedule, as KSampler's); its `denoised_output` is
  its `output` (the final step's prediction of a sampler that ends at sigma 0). A second pass (hires fix) through it
  is refused: KSampler serves that. `SamplerCustom` is the same with its own seed and cfg (CFGGuider's); its
  `add_noise` false (sampling another sampler's noisy latent) is refused.
- `SplitSigmas` at `step` k: `low_sigmas` (the schedule from step k) on an encoded image is img2img from step k, as
  KSamplerAdvanced's `start_at_step`; `high_sigmas` end before the schedule's last sigma and leave noise for a second
  sampler (`add_noise` off): that two-stage hand-off is refused by name, as is sampling an empty latent from k > 0.
- `ModelSamplingFlux` is accepted when its `base_shift` and `max_shift` are the served Flux model's (its scheduler's
  dynamic shifting) and its `width` x `height` are the sampled latent's size: sdjax computes the shift from the
  image's size, which is what the node computes from its width and height. `ModelSamplingSD3` is accepted when its
  `shift` is the served SD 3 model's. Other values change the schedule sdjax has no way to take per prompt: refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sdjax.server.comfy import defs, loaders
from sdjax.server.comfy.graph import Node, NodeError
from sdjax.server.comfy.values import Cond, Guider, Latent, Model, Pick, Sigmas


class CustomSampling:
    """The planner's custom sampling nodes (`self.value`, `self.ctx`, `self._stage` come from the planner)."""

    ctx: Any

    def value(self, node: Node, name: str) -> Any:
        raise NotImplementedError

    def _stage(self, *args, **kwargs) -> tuple:
        raise NotImplementedError

    def n_RandomNoise(self, node: Node, _) -> tuple:
        return (Pick(int(node.inputs["noise_seed"]), node.id),)

    def n_KSamplerSelect(self, node: Node, _) -> tuple:
        return (Pick(node.inputs["sampler_name"], node.id),)

    def n_BasicScheduler(self, node: Node, _) -> tuple:
        steps, denoise = int(node.inputs["steps"]), float(node.inputs["denoise"])
        if denoise <= 0:
            raise NodeError(node.id, "value_smaller_than_min", "denoise: 0 changes nothing", "denoise")
        return (Sigmas(self.value(node, "model"), node.inputs["scheduler"], steps, denoise, node.id),)

    def n_BasicGuider(self, node: Node, _) -> tuple:
        positive = self.value(node, "conditioning")
        negative = Cond("", positive.clip, positive.text_node, positive.control)  # unused at cfg 1
        return (Guider(self.value(node, "model"), positive, negative, 1.0, node.id),)

    def n_CFGGuider(self, node: Node, _) -> tuple:
        model, positive, negative = (self.value(node, n) for n in ("model", "positive", "negative"))
        return (Guider(model, positive, negative, float(node.inputs["cfg"]), node.id),)

    def n_SplitSigmas(self, node: Node, _) -> tuple:
        sigmas = self.value(node, "sigmas")
        cut = min(sigmas.start + int(node.inputs["step"]), sigmas.last)  # ComfyUI: sigmas[:step + 1], sigmas[step:]
        return (dataclasses.replace(sigmas, stop=cut, split=node.id),
                dataclasses.replace(sigmas, start=cut, split=node.id))  # fmt: skip

    def n_SamplerCustom(self, node: Node, _) -> tuple:
        if not node.inputs["add_noise"]:
            raise NodeError(node.id, "node_not_supported", "add_noise: false samples a latent that holds another "
                            "sampler's leftover noise (a two-stage hand-off); not served", "add_noise")  # fmt: skip
        model, positive, negative = (self.value(node, n) for n in ("model", "positive", "negative"))
        guider = Guider(model, positive, negative, float(node.inputs["cfg"]), node.id)
        noise = Pick(int(node.inputs["noise_seed"]), node.id)
        return self._custom(node, noise, guider, *(self.value(node, n) for n in ("sampler", "sigmas", "latent_image")))

    def n_SamplerCustomAdvanced(self, node: Node, _) -> tuple:
        noise, guider, pick, sigmas, latent = (
            self.value(node, n) for n in ("noise", "guider", "sampler", "sigmas", "latent_image")
        )
        return self._custom(node, noise, guider, pick, sigmas, latent)

    def _custom(self, node: Node, noise: Pick, guider: Guider, pick: Pick, sigmas: Sigmas, latent: Latent) -> tuple:
        """SamplerCustom(Advanced)'s generation: the schedule's steps `start..` of `int(steps / denoise)`."""
        if sigmas.last < sigmas.steps:
            raise NodeError(node.id, "node_not_supported", f"sigmas: SplitSigmas' high_sigmas (node {sigmas.split}) "
                            f"stop at step {sigmas.last} of {sigmas.steps} and leave noise for a second sampler; that "
                            "two-stage hand-off is not served (sample the whole schedule, or low_sigmas from an "
                            "encoded image)", "sigmas")  # fmt: skip
        if sigmas.start >= sigmas.last:
            raise NodeError(node.id, "node_not_supported", f"sigmas: SplitSigmas (node {sigmas.split}) leaves no step "
                            "to run", "sigmas")  # fmt: skip
        if sigmas.model != guider.model:
            raise NodeError(node.id, "node_not_supported", "sigmas: BasicScheduler's model must be the guider's (the "
                            "same LoRAs and model sampling)", "sigmas")  # fmt: skip
        if latent.kind in ("upscaled", "sampled"):
            raise NodeError(node.id, "node_not_supported", "latent_image: a second pass on a sampler's latent (the "
                            f"hires fix) is served with KSampler, not {node.class_type}",
                            "latent_image")  # fmt: skip
        total, strength = sigmas.steps, None
        if latent.kind == "empty" and sigmas.denoise < 1:
            raise NodeError(sigmas.node, "node_not_supported", "denoise: below 1 needs an image latent (VAEEncode); "
                            "on an empty latent it is not served", "denoise")  # fmt: skip
        if latent.kind == "empty" and sigmas.start > 0:
            raise NodeError(sigmas.split, "node_not_supported", "step: sampling from step > 0 needs an image latent "
                            "(VAEEncode); on an empty latent it is not served", "step")  # fmt: skip
        if latent.kind == "image":
            total = int(sigmas.steps / sigmas.denoise)  # BasicScheduler: the last `steps` of this schedule
            first = total - sigmas.steps + sigmas.start  # the first step run (A1111's img2img rule reaches it)
            strength = min((total - first - 0.5) / total, 1.0)
        sampler = sampler_of(pick.value, sigmas.scheduler, pick.node, sigmas.node)
        fields = {"steps": f"{sigmas.node}:steps", "guidance_scale": f"{guider.node}:cfg",
                  "sampler": f"{pick.node}:sampler_name"}  # fmt: skip
        seed_field = "noise_seed" if node.class_type == "SamplerCustom" else "noise"
        (out,) = self._stage(node, latent, noise.value, total, strength, seed_field, custom=(guider, sampler, fields))
        return out, out

    # ------------------------------------------------------------------ model sampling
    def n_ModelSamplingFlux(self, node: Node, _) -> tuple:
        config = self._flow_config(node, "flux", "max_shift")
        for name in ("max_shift", "base_shift"):
            served = config.get(name) if config.get("use_dynamic_shifting") else None
            if served is None or abs(float(node.inputs[name]) - float(served)) > 1e-6:
                raise NodeError(node.id, "value_not_in_list", f"{name}: {node.inputs[name]} is not the served model's "
                                f"dynamic shifting ({served}); sdjax samples with its own schedule", name)  # fmt: skip
        size = (node.id, int(node.inputs["width"]), int(node.inputs["height"]))
        return (dataclasses.replace(self.value(node, "model"), shift_size=size),)

    def n_ModelSamplingSD3(self, node: Node, _) -> tuple:
        config = self._flow_config(node, "sd3", "shift")
        if abs(float(node.inputs["shift"]) - float(config.get("shift", 0.0))) > 1e-6:
            raise NodeError(node.id, "value_not_in_list", f"shift: {node.inputs['shift']} is not the served SD 3 "
                            f"model's ({config.get('shift')}); sdjax samples with its own schedule",
                            "shift")  # fmt: skip
        return (self.value(node, "model"),)

    def _flow_config(self, node: Node, family: str, field: str) -> dict:
        served = loaders.family(self.ctx.pipeline)
        config = dict(getattr(getattr(self.ctx.pipeline, "scheduler", None), "config", None) or {})
        if served != family or "shift" not in config:
            raise NodeError(node.id, "node_not_supported", f"{node.class_type} sets the schedule of "
                            f"{loaders.title(family)}; the served model ({self.ctx.model_name!r}) is "
                            f"{loaders.title(served)}", field)  # fmt: skip
        return config

    def _shift_size(self, model: Model, latent: Latent) -> None:
        """A ModelSamplingFlux's size must be the sampled latent's (sdjax's shift follows the image size)."""
        if model.shift_size is None:
            return
        node, w, h = model.shift_size
        if (w, h) != (latent.width, latent.height):
            raise NodeError(node, "value_not_in_list", f"width: {w}x{h} sets Flux's schedule shift for that size; "
                            f"sdjax shifts by the sampled latent's size ({latent.width}x{latent.height}): give "
                            "ModelSamplingFlux the latent's width and height", "width")  # fmt: skip


def sampler_of(name: str, scheduler: str, name_node: str, scheduler_node: str) -> str:
    """ComfyUI's (sampler_name, scheduler) -> the sdjax sampler string; node errors naming either input."""
    from sdjax.samplers import a1111, schedules

    if name not in defs.SAMPLERS:
        why = "has no sdjax equivalent" if name in defs.UNSUPPORTED_SAMPLERS else "is unknown"
        raise NodeError(name_node, "value_not_in_list", f"sampler_name: {name!r} {why}; served: {list(defs.SAMPLERS)}",
                        "sampler_name")  # fmt: skip
    if scheduler not in defs.SCHEDULERS:
        raise NodeError(scheduler_node, "value_not_in_list", f"scheduler: {scheduler!r} is unknown; served: "
                        f"{list(defs.SCHEDULERS)}", "scheduler")  # fmt: skip
    try:
        return a1111.canonical(defs.SAMPLERS[name], defs.SCHEDULERS[scheduler])
    except (schedules.UnknownScheduleError, schedules.UnsupportedScheduleError) as e:
        raise NodeError(scheduler_node, "value_not_in_list", f"scheduler: {scheduler!r} with {name!r}: {e}",
                        "scheduler") from None  # fmt: skip
    except a1111.UnsupportedSamplerError as e:
        raise NodeError(name_node, "value_not_in_list", f"sampler_name: {e}", "sampler_name") from None
