"""ComfyUI's custom sampling nodes (`comfy_extras.nodes_custom_sampler`) and model-sampling nodes as sdjax generations,
a mixin of the planner (`comfy.nodes`): the Flux example's `RandomNoise` + `BasicGuider` (or `CFGGuider`) +
`KSamplerSelect` + `BasicScheduler` + `SamplerCustomAdvanced` is the generation a KSampler with the same seed, cfg,
sampler, scheduler, steps and denoise makes (BasicGuider: the positive prompt alone at cfg 1, i.e. no CFG).

- `SamplerCustomAdvanced` samples an empty latent (txt2img) or an encoded image (img2img, inpainting: BasicScheduler's
  `denoise` d runs the last `steps` of an `int(steps / d)`-step schedule, as KSampler's); its `denoised_output` is
  its `output` (the final step's prediction of a sampler that ends at sigma 0). A second pass (hires fix) through it
  is refused: KSampler serves that. `SamplerCustom` is the same with its own seed and cfg (CFGGuider's); its
  `add_noise` false continues a first stage (below). KSamplerAdvanced (`comfy.nodes`) takes this path too, its
  `start_at_step` / `end_at_step` as the split.
- `SplitSigmas` at `step` k: `low_sigmas` (the schedule from step k) on an encoded image is img2img from step k, as
  KSamplerAdvanced's `start_at_step`; sampling an empty latent from k > 0 is refused.
- Two stages: a sampler on `high_sigmas` (or KSamplerAdvanced with `end_at_step` k and `return_with_leftover_noise`)
  stops at step k and leaves noise in its latent; a second sampler that adds none (`DisableNoise`, SamplerCustom's
  `add_noise` false, KSamplerAdvanced's `add_noise` "disable") continues it over `low_sigmas` (`start_at_step` k).
  ComfyUI's second stage restarts its sampler at step k from the first one's latent: for a sampler whose step reads
  only the current latent and the two sigmas it moves between (`HANDOFF_SAMPLERS`: euler, heun, dpm_2, ddim) that is
  the one-stage run of the whole schedule, which is what sdjax runs (one generation; the two stages must share the
  model, prompts, cfg, sampler and schedule, and meet at one step). Samplers with a history (dpmpp_2m, lms, uni_pc,
  ...: ComfyUI's second stage starts it afresh at step k) or noise of their own per step (ancestral, SDE: ComfyUI's
  second stage draws it from another seed) would mean another image than the one-stage run: refused by name, as
  are two stages with different settings (ComfyUI runs them; sdjax's one generation cannot swap them at step k).
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
from sdjax.server.comfy.values import Cond, Guider, Handoff, Latent, Model, Pick, Sigmas

# ComfyUI samplers whose step reads only the current latent and its two sigmas: two stages split at step k are the
# one-stage run (no history to restart, no noise of their own to draw)
HANDOFF_SAMPLERS = ("euler", "heun", "dpm_2", "ddim")


class CustomSampling:
    """The planner's custom sampling nodes (`self.value`, `self.ctx`, `self._stage` come from the planner)."""

    ctx: Any

    def value(self, node: Node, name: str) -> Any:
        raise NotImplementedError

    def _stage(self, *args, **kwargs) -> tuple:
        raise NotImplementedError

    def n_RandomNoise(self, node: Node, _) -> tuple:
        return (Pick(int(node.inputs["noise_seed"]), node.id),)

    def n_DisableNoise(self, node: Node, _) -> tuple:
        """No noise added: the sampler continues a latent that holds a first stage's leftover noise."""
        return (Pick(None, node.id),)

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
        model, positive, negative = (self.value(node, n) for n in ("model", "positive", "negative"))
        guider = Guider(model, positive, negative, float(node.inputs["cfg"]), node.id)
        noise = Pick(int(node.inputs["noise_seed"]) if node.inputs["add_noise"] else None, node.id)
        return self._custom(node, noise, guider, *(self.value(node, n) for n in ("sampler", "sigmas", "latent_image")))

    def n_SamplerCustomAdvanced(self, node: Node, _) -> tuple:
        noise, guider, pick, sigmas, latent = (
            self.value(node, n) for n in ("noise", "guider", "sampler", "sigmas", "latent_image")
        )
        return self._custom(node, noise, guider, pick, sigmas, latent)

    def _custom(self, node: Node, noise: Pick, guider: Guider, pick: Pick, sigmas: Sigmas, latent: Latent) -> tuple:
        """SamplerCustom(Advanced)'s (and KSamplerAdvanced's) generation: the schedule's steps `start..` of
        `int(steps / denoise)`; a first stage (sigmas that stop early) or the second stage that continues it."""
        noise_field = "add_noise" if node.class_type != "SamplerCustomAdvanced" else "noise"
        if sigmas.start >= sigmas.last:
            raise NodeError(node.id, "node_not_supported", f"sigmas: SplitSigmas (node {sigmas.split}) leaves no step "
                            "to run", "sigmas")  # fmt: skip
        if latent.kind == "partial" or noise.value is None:
            return self._second_stage(node, noise, guider, pick, sigmas, latent, noise_field)
        self._check_run(node, guider, sigmas, latent)
        if sigmas.last < sigmas.steps:  # a first stage: nothing runs until a second sampler continues it
            handoff = Handoff(node.id, noise, guider, pick, sigmas, latent)
            out = Latent("partial", latent.width, latent.height, latent.batch, vae=latent.vae, node=node.id,
                         handoff=handoff)  # fmt: skip
            return out, out
        return self._run(node, noise, guider, pick, sigmas, latent)

    def _second_stage(self, node: Node, noise: Pick, guider: Guider, pick: Pick, sigmas: Sigmas, latent: Latent,
                      noise_field: str) -> tuple:  # fmt: skip
        """A sampler that adds no noise continuing a first stage's latent: the one-stage run of both (see the
        module docstring), or a node error naming what keeps it from being that run."""
        first = latent.handoff

        def refuse(nid: str, field: str, message: str):
            raise NodeError(nid, "node_not_supported", f"{field}: {message}", field)

        if first is None:
            refuse(node.id, noise_field, "no noise is added, so the latent must hold a first sampler's leftover "
                   "noise (SplitSigmas' high_sigmas, or KSamplerAdvanced with return_with_leftover_noise); this one "
                   "does not")  # fmt: skip
        if noise.value is not None:
            refuse(node.id, noise_field, f"the latent holds the leftover noise of node {first.node}; the sampler that "
                   "continues it must add none (DisableNoise, add_noise false / disable)")  # fmt: skip
        high = first.sigmas
        if sigmas.schedule != high.schedule:
            refuse(node.id, "sigmas", "the second stage must sample the rest of the first stage's schedule (node "
                   f"{first.node}: {high.scheduler}, {high.steps} steps, denoise {high.denoise})")  # fmt: skip
        if sigmas.start != high.last:
            refuse(sigmas.split or node.id, sigmas.split_field, f"the second stage starts at step {sigmas.start}; the "
                   f"first (node {first.node}) stopped at step {high.last}: they must meet at one step")  # fmt: skip
        if sigmas.last < sigmas.steps:
            stop_field = "end_at_step" if node.class_type == "KSamplerAdvanced" else sigmas.split_field
            refuse(sigmas.split or node.id, stop_field, "the second stage stops before the schedule's end "
                   "(a third stage is not served)")  # fmt: skip
        if guider != first.guider:
            names = ("cfg", "positive", "negative", "model")
            differs = [n for n in names if getattr(guider, n) != getattr(first.guider, n)]
            refuse(guider.node, differs[0], "the two stages must "
                   f"sample with one model, prompts and cfg (node {first.node}'s): sdjax runs them as one "
                   "generation, which cannot change them at the step they meet")  # fmt: skip
        if pick.value != first.pick.value:
            refuse(pick.node, "sampler_name", f"the two stages must use one sampler ({first.pick.value!r}, node "
                   f"{first.pick.node})")  # fmt: skip
        if pick.value not in HANDOFF_SAMPLERS:
            refuse(pick.node, "sampler_name", f"{pick.value!r} keeps a history between steps or draws noise of its "
                   "own; ComfyUI's second stage restarts it at the step the stages meet, which is another image "
                   f"than sdjax's one-stage run; two stages are served with {list(HANDOFF_SAMPLERS)}")  # fmt: skip
        whole = dataclasses.replace(high, stop=None)
        return self._run(node, first.noise, first.guider, first.pick, whole, first.source)

    def _check_run(self, node: Node, guider: Guider, sigmas: Sigmas, latent: Latent) -> None:
        if sigmas.model != guider.model:
            raise NodeError(node.id, "node_not_supported", "sigmas: BasicScheduler's model must be the guider's (the "
                            "same LoRAs and model sampling)", "sigmas")  # fmt: skip
        if latent.kind in ("upscaled", "sampled"):
            raise NodeError(node.id, "node_not_supported", "latent_image: a second pass on a sampler's latent (the "
                            f"hires fix) is served with KSampler, not {node.class_type}",
                            "latent_image")  # fmt: skip
        if latent.kind == "empty" and sigmas.denoise < 1:
            raise NodeError(sigmas.node, "node_not_supported", "denoise: below 1 needs an image latent (VAEEncode); "
                            "on an empty latent it is not served", "denoise")  # fmt: skip
        if latent.kind == "empty" and sigmas.start > 0:
            raise NodeError(sigmas.split, "node_not_supported", f"{sigmas.split_field}: sampling from step > 0 needs "
                            "an image latent (VAEEncode); on an empty latent it is not served",
                            sigmas.split_field)  # fmt: skip

    def _run(self, node: Node, noise: Pick, guider: Guider, pick: Pick, sigmas: Sigmas, latent: Latent) -> tuple:
        """One generation: the schedule's steps `sigmas.start..` (the end) sampled from `latent`."""
        total, strength = sigmas.steps, None
        if latent.kind == "image":
            total = int(sigmas.steps / sigmas.denoise)  # BasicScheduler: the last `steps` of this schedule
            first = total - sigmas.steps + sigmas.start  # the first step run (A1111's img2img rule reaches it)
            strength = min((total - first - 0.5) / total, 1.0)
        sampler = sampler_of(pick.value, sigmas.scheduler, pick.node, sigmas.node)
        fields = {"steps": f"{sigmas.node}:steps", "guidance_scale": f"{guider.node}:cfg",
                  "sampler": f"{pick.node}:sampler_name"}  # fmt: skip
        seed_field = "noise" if noise.node != node.id else "noise_seed"
        (out,) = self._stage(node, latent, noise.value, total, strength, seed_field, custom=(guider, sampler, fields))
        return out, out

    # ------------------------------------------------------------------ timestep ranges
    def _negative_switch(self, guider: Guider, latent: Latent, sampler: str, steps: int, name: str) -> tuple:
        """A negative that is ConditioningCombine of two ConditioningSetTimestepRange partitioning the schedule at
        one percent b (SD 3's example): `(guider, switch)` with the early part (0..b) as the guider's negative and
        a `metadata.NegativeSwitch` to the late part (b..1) at the first step whose sigma is below the boundary's.

        ComfyUI's rule (`comfy.samplers`): a conditioning with percents (start, end) counts at a model call of sigma
        s when `percent_to_sigma(end) <= s <= percent_to_sigma(start)`; the model's sampling maps a percent p to
        `shift (1 - p) / (1 + (shift - 1)(1 - p))` (flow models with a fixed shift: SD 3) or to the training sigma
        at timestep `999 (1 - p)` (variance-preserving models; sigma grows with the timestep, so sdjax's timesteps
        are compared). Served for text-to-image with `euler` (one model call per step, no history: the two runs
        split at that step are ComfyUI's one run); else refused naming the range node. Other negatives: unchanged."""
        from sdjax.metadata import NegativeSwitch

        parts = guider.negative.parts
        if len(parts) != 2 or any(c.parts for c in parts):
            return guider, None
        early, late = sorted(parts, key=lambda c: c.span)
        b = early.span[1]
        if not (early.span[0] == 0.0 and late.span == (b, 1.0)):
            return guider, None  # (refused as a combination of two conditionings)

        def refuse(message: str):
            raise NodeError(late.span_node, "node_not_supported", f"start: ConditioningSetTimestepRange hands the "
                            f"negative over at {b:g} of the schedule; {message}", "start")  # fmt: skip

        if latent.kind != "empty" or guider.positive.control:
            refuse("sdjax runs that switch with text-to-image only (an empty latent, no ControlNet)")
        if name != "euler":
            refuse(f"sdjax runs it as two generations split at that step, which is ComfyUI's one run for 'euler' "
                   f"only (one model call per step, no history); not with {name!r}")  # fmt: skip
        above = self._steps_above(sampler, steps, b, refuse)
        k = int(above.sum())

        def whole(c: Cond) -> Cond:  # the part, now used at every step of its generation
            return dataclasses.replace(c, span=(0.0, 1.0), span_node="", parts=())

        if k in (0, steps):  # the boundary falls outside the schedule: one negative at every step
            return dataclasses.replace(guider, negative=whole(early if k else late)), None
        positive = guider.positive
        if (late.clip != positive.clip and not late.zero) or late.control != positive.control:
            refuse("the negative from there must use the positive prompt's CLIP and ControlNets")
        family = loaders.family(self.ctx.pipeline)
        if late.zero and family not in ("flux", "sd3"):
            refuse(f"zero conditioning as the negative is served on Flux.1 and SD 3 (not {loaders.title(family)})")
        from sdjax.infotext import CONDITIONING_KEYS
        from sdjax.server.comfy.inputs import ENCODER_OPTIONS
        from sdjax.server.schemas import FieldError
        from sdjax.server.schemas.common import check_text

        for encoder, text in (("text", late.text), *late.texts):
            try:
                check_text(f"{late.text_node}:{encoder}", text)
            except FieldError as e:
                raise NodeError(late.text_node, "invalid_input_type", f"{encoder}: {e.detail_message}",
                                encoder) from None  # fmt: skip
        names = ENCODER_OPTIONS.get(family or "", {})
        options = [("negative_" + names[encoder], text) for encoder, text in late.texts]
        options += [("zero_negative", True)] if late.zero else []
        order = list(CONDITIONING_KEYS)
        options.sort(key=lambda item: order.index(item[0]))
        switch = NegativeSwitch(k, late.text, tuple(options))
        return dataclasses.replace(guider, negative=whole(early)), switch

    def _steps_above(self, sampler: str, steps: int, percent: float, refuse) -> Any:
        """Which of the `steps` model calls of `sampler` lie above ComfyUI's sigma of `percent` (a bool array);
        `refuse(message)` where a call lies on it (ComfyUI then averages both conditionings) or the model's
        sampling is one sdjax does not map (Flux's shift by image size)."""
        import numpy as np

        from sdjax.core.tasks.base import sampler_timesteps

        pipe = self.ctx.pipeline
        if not hasattr(pipe, "_sampler"):
            refuse("the served pipeline has no sampler schedule to place the boundary on")
        s = pipe._sampler(sampler)
        t = np.asarray(sampler_timesteps(s, steps), np.float64)
        if len(t) != steps:
            refuse(f"the sampler makes {len(t)} model calls for {steps} steps")
        family = loaders.family(pipe)
        config = dict(getattr(getattr(pipe, "scheduler", None), "config", None) or {})
        if family in ("sd3", "flux"):
            if config.get("use_dynamic_shifting") or "shift" not in config:
                refuse(f"{loaders.title(family)}'s schedule shifts by the image size; sdjax maps ComfyUI's percents "
                       "to sigmas for a fixed shift only")  # fmt: skip
            shift, x = float(config["shift"]), 1.0 - percent
            value, mine = shift * x / (1 + (shift - 1) * x), t / s.num_train_timesteps  # sigmas
        else:
            value, mine = 999.0 * (1.0 - percent), t  # timesteps (the training sigma grows with them)
        if np.any(np.abs(mine - value) < 1e-6):
            refuse("a step falls on the boundary, where ComfyUI averages the two negatives")
        return mine > value

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
        flow_only = _flow_only_pair(defs.SAMPLERS[name], defs.SCHEDULERS[scheduler])
        if flow_only is not None:  # no variance-preserving form; Flux and SD 3 run it in the k-diffusion form
            return flow_only
        raise NodeError(scheduler_node, "value_not_in_list", f"scheduler: {scheduler!r} with {name!r}: {e}",
                        "scheduler") from None  # fmt: skip
    except a1111.UnsupportedSamplerError as e:
        raise NodeError(name_node, "value_not_in_list", f"sampler_name: {e}", "sampler_name") from None


def _flow_only_pair(label: str, schedule_label: str) -> str | None:
    """An A1111 (sampler, schedule) pair only the flow families run ("Euler a" with Karras sigmas:
    `samplers.a1111.FLOW_KDIFFUSION`) as one sampler string, else None. A variance-preserving model's pipeline
    refuses the string when the request is checked, naming the pair."""
    from sdjax.samplers import a1111, schedules

    try:
        schedule = schedules.find_schedule(schedule_label)
    except schedules.UnknownScheduleError:
        return None
    _, served = a1111.FLOW_KDIFFUSION.get(label, (None, ()))
    return f"{label} {schedule.label}" if schedule.name in served else None
