"""The ComfyUI nodes sdjax runs, described as ComfyUI describes them (`GET /object_info`), and ComfyUI's sampler and
scheduler names mapped to sdjax's.

Each `NodeDef` lists its inputs in ComfyUI's shape: `(type, options)` where `type` is a link type ("MODEL", "CLIP",
"LATENT", ...), a widget type ("INT", "FLOAT", "STRING", "BOOLEAN") or a list of choices (a combo). Combos whose
choices depend on the server (checkpoints, LoRAs, uploaded images, samplers) are `Dynamic` and filled in from a
`Choices` when `/object_info` is asked; the planner (`comfy.nodes`) checks their values with a message naming the
choices. `graph.validate` checks everything else of a workflow against these definitions before anything runs.

Sampler names (ComfyUI's `KSampler.SAMPLERS`) map to AUTOMATIC1111's labels, scheduler names to A1111's schedule
labels; the pair becomes one sdjax sampler string through `samplers.a1111.canonical` (the mapping the A1111 API
uses), so "dpmpp_2m" + "karras" is the sampler A1111 calls "DPM++ 2M Karras". ComfyUI samplers without an sdjax
equivalent are listed in `UNSUPPORTED_SAMPLERS` and refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MAX_RESOLUTION = 16384
SEED_MAX_COMFY = 0xFFFFFFFFFFFFFFFF

# ComfyUI sampler name -> A1111 label (sdjax.samplers.a1111). The *_gpu variants differ in ComfyUI only in where
# the noise is drawn.
SAMPLERS: dict[str, str] = {
    "euler": "Euler",
    "euler_ancestral": "Euler a",
    "heun": "Heun",
    "dpm_2": "DPM2",
    "dpm_2_ancestral": "DPM2 a",
    "lms": "LMS",
    "dpmpp_2s_ancestral": "DPM++ 2S a",
    "dpmpp_sde": "DPM++ SDE",
    "dpmpp_sde_gpu": "DPM++ SDE",
    "dpmpp_2m": "DPM++ 2M",
    "dpmpp_2m_sde": "DPM++ 2M SDE",
    "dpmpp_2m_sde_gpu": "DPM++ 2M SDE",
    "dpmpp_2m_sde_heun": "DPM++ 2M SDE Heun",
    "dpmpp_2m_sde_heun_gpu": "DPM++ 2M SDE Heun",
    "dpmpp_3m_sde": "DPM++ 3M SDE",
    "dpmpp_3m_sde_gpu": "DPM++ 3M SDE",
    "ddpm": "DDPM",
    "lcm": "LCM",
    "deis": "DEIS",
    "ddim": "DDIM",
    "uni_pc": "UniPC",
}
# ComfyUI samplers sdjax does not run (no diffusers equivalent), refused by name.
UNSUPPORTED_SAMPLERS = (
    "euler_cfg_pp", "euler_ancestral_cfg_pp", "heun_pp2", "dpm_fast", "dpm_adaptive", "dpmpp_2s_ancestral_cfg_pp",
    "dpmpp_2m_cfg_pp", "ipndm", "ipndm_v", "res_multistep", "res_multistep_cfg_pp", "res_multistep_ancestral",
    "res_multistep_ancestral_cfg_pp", "gradient_estimation", "gradient_estimation_cfg_pp", "er_sde", "seeds_2",
    "seeds_3", "sa_solver", "sa_solver_pece", "uni_pc_bh2",
)  # fmt: skip
# ComfyUI scheduler name -> A1111 schedule label (sdjax.samplers.schedules).
SCHEDULERS: dict[str, str] = {
    "simple": "Simple",
    "sgm_uniform": "SGM Uniform",
    "karras": "Karras",
    "exponential": "Exponential",
    "ddim_uniform": "DDIM",
    "beta": "Beta",
    "normal": "Normal",
    "linear_quadratic": "Linear quadratic",  # no sdjax equivalent: refused by the schedule lookup
    "kl_optimal": "KL Optimal",
}


@dataclasses.dataclass(frozen=True)
class Dynamic:
    """A combo whose choices come from the server: `kind` names the list in `Choices`."""

    kind: str


@dataclasses.dataclass(frozen=True)
class NodeDef:
    name: str
    category: str
    required: dict[str, tuple[Any, dict[str, Any]]]
    outputs: tuple[tuple[str, str], ...] = ()  # (type, name)
    optional: dict[str, tuple[Any, dict[str, Any]]] = dataclasses.field(default_factory=dict)
    output_node: bool = False
    display_name: str = ""
    description: str = ""

    def input_spec(self, name: str) -> tuple[Any, dict[str, Any]] | None:
        return self.required.get(name) or self.optional.get(name)


def _int(default: int, lo: int, hi: int, step: int = 1, **extra) -> tuple[str, dict]:
    return "INT", {"default": default, "min": lo, "max": hi, "step": step, **extra}


def _float(default: float, lo: float, hi: float, step: float = 0.01, **extra) -> tuple[str, dict]:
    return "FLOAT", {"default": default, "min": lo, "max": hi, "step": step, **extra}


def _combo(choices, **extra) -> tuple[Any, dict]:
    return choices, extra


def _link(kind: str) -> tuple[str, dict]:
    return kind, {}


_LATENT_METHODS = ["nearest-exact", "bilinear", "area", "bicubic", "bislerp"]
_IMAGE_METHODS = ["nearest-exact", "bilinear", "area", "bicubic", "lanczos"]
_SIZE = dict(lo=16, hi=MAX_RESOLUTION, step=8)
_TEXT = ("STRING", {"multiline": True, "dynamicPrompts": True})
_SAMPLING = {
    "model": _link("MODEL"),
    "seed": _int(0, 0, SEED_MAX_COMFY, control_after_generate=True),
    "steps": _int(20, 1, 10000),
    "cfg": _float(8.0, 0.0, 100.0, 0.1, round=0.01),
    "sampler_name": _combo(Dynamic("sampler")),
    "scheduler": _combo(Dynamic("scheduler")),
    "positive": _link("CONDITIONING"),
    "negative": _link("CONDITIONING"),
    "latent_image": _link("LATENT"),
}


def _defs() -> dict[str, NodeDef]:
    k = _SAMPLING
    nodes = [
        NodeDef("CheckpointLoaderSimple", "loaders", {"ckpt_name": _combo(Dynamic("checkpoint"))},
                (("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")), display_name="Load Checkpoint"),
        NodeDef("UNETLoader", "advanced/loaders",
                {"unet_name": _combo(Dynamic("unet")), "weight_dtype": _combo(Dynamic("weight_dtype"))},
                (("MODEL", "MODEL"),), display_name="Load Diffusion Model"),
        NodeDef("CLIPLoader", "advanced/loaders",
                {"clip_name": _combo(Dynamic("clip")), "type": _combo(Dynamic("clip_type:CLIPLoader"))},
                (("CLIP", "CLIP"),), optional={"device": _combo(["default", "cpu"], advanced=True)},
                display_name="Load CLIP"),
        NodeDef("DualCLIPLoader", "advanced/loaders",
                {"clip_name1": _combo(Dynamic("clip")), "clip_name2": _combo(Dynamic("clip")),
                 "type": _combo(Dynamic("clip_type:DualCLIPLoader"))},
                (("CLIP", "CLIP"),), optional={"device": _combo(["default", "cpu"], advanced=True)},
                display_name="DualCLIPLoader"),
        NodeDef("TripleCLIPLoader", "advanced/loaders",
                {"clip_name1": _combo(Dynamic("clip")), "clip_name2": _combo(Dynamic("clip")),
                 "clip_name3": _combo(Dynamic("clip"))},
                (("CLIP", "CLIP"),), display_name="TripleCLIPLoader",
                description="[Recipes]\n\nsd3: clip-l, clip-g, t5"),
        NodeDef("VAELoader", "loaders", {"vae_name": _combo(Dynamic("vae"))}, (("VAE", "VAE"),),
                display_name="Load VAE"),
        NodeDef("LoraLoader", "loaders",
                {"model": _link("MODEL"), "clip": _link("CLIP"), "lora_name": _combo(Dynamic("lora")),
                 "strength_model": _float(1.0, -100.0, 100.0), "strength_clip": _float(1.0, -100.0, 100.0)},
                (("MODEL", "MODEL"), ("CLIP", "CLIP")), display_name="Load LoRA"),
        NodeDef("LoraLoaderModelOnly", "loaders",
                {"model": _link("MODEL"), "lora_name": _combo(Dynamic("lora")),
                 "strength_model": _float(1.0, -100.0, 100.0)},
                (("MODEL", "MODEL"),), display_name="LoraLoaderModelOnly"),
        NodeDef("CLIPTextEncode", "conditioning",
                {"text": _TEXT, "clip": _link("CLIP")},
                (("CONDITIONING", "CONDITIONING"),), display_name="CLIP Text Encode (Prompt)"),
        NodeDef("CLIPTextEncodeFlux", "advanced/conditioning/flux",
                {"clip": _link("CLIP"), "clip_l": _TEXT, "t5xxl": _TEXT, "guidance": _float(3.5, 0.0, 100.0, 0.1)},
                (("CONDITIONING", "CONDITIONING"),), display_name="CLIPTextEncodeFlux"),
        NodeDef("CLIPTextEncodeSD3", "advanced/conditioning",
                {"clip": _link("CLIP"), "clip_l": _TEXT, "clip_g": _TEXT, "t5xxl": _TEXT,
                 "empty_padding": _combo(["none", "empty_prompt"])},
                (("CONDITIONING", "CONDITIONING"),), display_name="CLIPTextEncodeSD3"),
        NodeDef("ConditioningZeroOut", "advanced/conditioning", {"conditioning": _link("CONDITIONING")},
                (("CONDITIONING", "CONDITIONING"),), display_name="ConditioningZeroOut"),
        NodeDef("ConditioningCombine", "conditioning",
                {"conditioning_1": _link("CONDITIONING"), "conditioning_2": _link("CONDITIONING")},
                (("CONDITIONING", "CONDITIONING"),), display_name="Conditioning (Combine)"),
        NodeDef("ConditioningSetTimestepRange", "advanced/conditioning",
                {"conditioning": _link("CONDITIONING"), "start": _float(0.0, 0.0, 1.0, 0.001),
                 "end": _float(1.0, 0.0, 1.0, 0.001)},
                (("CONDITIONING", "CONDITIONING"),), display_name="ConditioningSetTimestepRange"),
        NodeDef("CLIPSetLastLayer", "conditioning",
                {"clip": _link("CLIP"), "stop_at_clip_layer": _int(-1, -24, -1)}, (("CLIP", "CLIP"),),
                display_name="CLIP Set Last Layer"),
        NodeDef("FluxGuidance", "advanced/conditioning/flux",
                {"conditioning": _link("CONDITIONING"), "guidance": _float(3.5, 0.0, 100.0, 0.1)},
                (("CONDITIONING", "CONDITIONING"),), display_name="FluxGuidance"),
        NodeDef("EmptyLatentImage", "latent",
                {"width": _int(512, **_SIZE), "height": _int(512, **_SIZE), "batch_size": _int(1, 1, 4096)},
                (("LATENT", "LATENT"),), display_name="Empty Latent Image"),
        NodeDef("EmptySD3LatentImage", "latent/sd3",
                {"width": _int(1024, 16, MAX_RESOLUTION, 16), "height": _int(1024, 16, MAX_RESOLUTION, 16),
                 "batch_size": _int(1, 1, 4096)},
                (("LATENT", "LATENT"),), display_name="EmptySD3LatentImage"),
        NodeDef("KSampler", "sampling", {**k, "denoise": _float(1.0, 0.0, 1.0)}, (("LATENT", "LATENT"),),
                display_name="KSampler"),
        NodeDef("KSamplerAdvanced", "sampling",
                {"model": k["model"], "add_noise": _combo(["enable", "disable"]),
                 "noise_seed": k["seed"], "steps": k["steps"], "cfg": k["cfg"], "sampler_name": k["sampler_name"],
                 "scheduler": k["scheduler"], "positive": k["positive"], "negative": k["negative"],
                 "latent_image": k["latent_image"], "start_at_step": _int(0, 0, 10000),
                 "end_at_step": _int(10000, 0, 10000), "return_with_leftover_noise": _combo(["disable", "enable"])},
                (("LATENT", "LATENT"),), display_name="KSampler (Advanced)"),
        NodeDef("RandomNoise", "sampling/custom_sampling/noise", {"noise_seed": k["seed"]}, (("NOISE", "NOISE"),),
                display_name="RandomNoise"),
        NodeDef("DisableNoise", "sampling/custom_sampling/noise", {}, (("NOISE", "NOISE"),),
                display_name="DisableNoise"),
        NodeDef("KSamplerSelect", "sampling/custom_sampling/samplers", {"sampler_name": k["sampler_name"]},
                (("SAMPLER", "SAMPLER"),), display_name="KSamplerSelect"),
        NodeDef("BasicScheduler", "sampling/custom_sampling/schedulers",
                {"model": k["model"], "scheduler": k["scheduler"], "steps": k["steps"],
                 "denoise": _float(1.0, 0.0, 1.0)},
                (("SIGMAS", "SIGMAS"),), display_name="BasicScheduler"),
        NodeDef("BasicGuider", "sampling/custom_sampling/guiders",
                {"model": k["model"], "conditioning": _link("CONDITIONING")}, (("GUIDER", "GUIDER"),),
                display_name="BasicGuider"),
        NodeDef("CFGGuider", "sampling/custom_sampling/guiders",
                {"model": k["model"], "positive": k["positive"], "negative": k["negative"], "cfg": k["cfg"]},
                (("GUIDER", "GUIDER"),), display_name="CFGGuider"),
        NodeDef("SamplerCustomAdvanced", "sampling/custom_sampling",
                {"noise": _link("NOISE"), "guider": _link("GUIDER"), "sampler": _link("SAMPLER"),
                 "sigmas": _link("SIGMAS"), "latent_image": k["latent_image"]},
                (("LATENT", "output"), ("LATENT", "denoised_output")), display_name="SamplerCustomAdvanced"),
        NodeDef("SamplerCustom", "sampling/custom_sampling",
                {"model": k["model"], "add_noise": ("BOOLEAN", {"default": True}), "noise_seed": k["seed"],
                 "cfg": k["cfg"], "positive": k["positive"], "negative": k["negative"], "sampler": _link("SAMPLER"),
                 "sigmas": _link("SIGMAS"), "latent_image": k["latent_image"]},
                (("LATENT", "output"), ("LATENT", "denoised_output")), display_name="SamplerCustom"),
        NodeDef("SplitSigmas", "sampling/custom_sampling/sigmas",
                {"sigmas": _link("SIGMAS"), "step": _int(0, 0, 10000)},
                (("SIGMAS", "high_sigmas"), ("SIGMAS", "low_sigmas")), display_name="SplitSigmas"),
        NodeDef("ModelSamplingFlux", "advanced/model",
                {"model": k["model"], "max_shift": _float(1.15, 0.0, 100.0), "base_shift": _float(0.5, 0.0, 100.0),
                 "width": _int(1024, 16, MAX_RESOLUTION, 8), "height": _int(1024, 16, MAX_RESOLUTION, 8)},
                (("MODEL", "MODEL"),), display_name="ModelSamplingFlux"),
        NodeDef("ModelSamplingSD3", "advanced/model", {"model": k["model"], "shift": _float(3.0, 0.0, 100.0)},
                (("MODEL", "MODEL"),), display_name="ModelSamplingSD3"),
        NodeDef("VAEDecode", "latent", {"samples": _link("LATENT"), "vae": _link("VAE")}, (("IMAGE", "IMAGE"),),
                display_name="VAE Decode"),
        NodeDef("VAEEncode", "latent", {"pixels": _link("IMAGE"), "vae": _link("VAE")}, (("LATENT", "LATENT"),),
                display_name="VAE Encode"),
        NodeDef("VAEEncodeForInpaint", "latent/inpaint",
                {"pixels": _link("IMAGE"), "vae": _link("VAE"), "mask": _link("MASK"),
                 "grow_mask_by": _int(6, 0, 64)},
                (("LATENT", "LATENT"),), display_name="VAE Encode (for Inpainting)"),
        NodeDef("SetLatentNoiseMask", "latent/inpaint", {"samples": _link("LATENT"), "mask": _link("MASK")},
                (("LATENT", "LATENT"),), display_name="Set Latent Noise Mask"),
        NodeDef("LatentUpscale", "latent",
                {"samples": _link("LATENT"), "upscale_method": _combo(_LATENT_METHODS),
                 "width": _int(512, 0, MAX_RESOLUTION, 8), "height": _int(512, 0, MAX_RESOLUTION, 8),
                 "crop": _combo(["disabled", "center"])},
                (("LATENT", "LATENT"),), display_name="Upscale Latent"),
        NodeDef("LatentUpscaleBy", "latent",
                {"samples": _link("LATENT"), "upscale_method": _combo(_LATENT_METHODS),
                 "scale_by": _float(1.5, 0.01, 8.0)},
                (("LATENT", "LATENT"),), display_name="Upscale Latent By"),
        NodeDef("LoadImage", "image", {"image": _combo(Dynamic("image"), image_upload=True)},
                (("IMAGE", "IMAGE"), ("MASK", "MASK")), display_name="Load Image"),
        NodeDef("LoadImageMask", "mask",
                {"image": _combo(Dynamic("image"), image_upload=True),
                 "channel": _combo(["alpha", "red", "green", "blue"])},
                (("MASK", "MASK"),), display_name="Load Image (as Mask)"),
        NodeDef("ImageScale", "image/upscaling",
                {"image": _link("IMAGE"), "upscale_method": _combo(_IMAGE_METHODS),
                 "width": _int(512, 0, MAX_RESOLUTION), "height": _int(512, 0, MAX_RESOLUTION),
                 "crop": _combo(["disabled", "center"])},
                (("IMAGE", "IMAGE"),), display_name="Upscale Image"),
        NodeDef("SaveImage", "image",
                {"images": _link("IMAGE"), "filename_prefix": ("STRING", {"default": "ComfyUI"})},
                output_node=True, display_name="Save Image"),
        NodeDef("PreviewImage", "image", {"images": _link("IMAGE")}, output_node=True, display_name="Preview Image"),
        NodeDef("ControlNetLoader", "loaders", {"control_net_name": _combo(Dynamic("controlnet"))},
                (("CONTROL_NET", "CONTROL_NET"),), display_name="Load ControlNet Model"),
        NodeDef("ControlNetApplyAdvanced", "conditioning/controlnet",
                {"positive": _link("CONDITIONING"), "negative": _link("CONDITIONING"),
                 "control_net": _link("CONTROL_NET"), "image": _link("IMAGE"),
                 "strength": _float(1.0, 0.0, 10.0), "start_percent": _float(0.0, 0.0, 1.0, 0.001),
                 "end_percent": _float(1.0, 0.0, 1.0, 0.001)},
                (("CONDITIONING", "positive"), ("CONDITIONING", "negative")), optional={"vae": _link("VAE")},
                display_name="Apply ControlNet"),
    ]  # fmt: skip
    return {n.name: n for n in nodes}


NODES: dict[str, NodeDef] = _defs()


def object_info(node: NodeDef, choices: dict[str, list[str]]) -> dict[str, Any]:
    """ComfyUI's `/object_info` entry of `node`, with the dynamic combos filled from `choices` (kind -> names)."""

    def render(spec: dict[str, tuple[Any, dict]]) -> dict[str, list]:
        out = {}
        for name, (kind, options) in spec.items():
            if isinstance(kind, Dynamic):
                kind = list(choices.get(kind.kind, []))
            out[name] = [kind, dict(options)] if options else [kind]
        return out

    return {
        "input": {"required": render(node.required), **({"optional": render(node.optional)} if node.optional else {})},
        "input_order": {
            "required": list(node.required),
            **({"optional": list(node.optional)} if node.optional else {}),
        },
        "output": [t for t, _ in node.outputs],
        "output_is_list": [False] * len(node.outputs),
        "output_name": [n for _, n in node.outputs],
        "name": node.name,
        "display_name": node.display_name or node.name,
        "description": node.description,
        "python_module": "nodes",
        "category": node.category,
        "output_node": node.output_node,
        "deprecated": False,
        "experimental": False,
    }
