"""Two-stage ComfyUI workflows on sdjax (`server.comfy.custom`) and ConditioningSetTimestepRange.

A first sampler that stops at step k (SplitSigmas' high_sigmas, KSamplerAdvanced's end_at_step with leftover
noise) and a second that adds no noise and runs steps k.. of the same schedule are, for a sampler whose step reads
only the current latent and its two sigmas (euler), the one-stage run: sdjax plans them as that one generation.
The planner's request is checked against the one-stage workflow's, and the one-stage image against the two stages
run apart through the Python API (stage 1: model calls [0, k) returning latents; stage 2: [k, n) from them, no
noise added). What would mean another image (a sampler with a history or noise of its own, stages with other
settings, a conditioning swapped between steps by ConditioningSetTimestepRange) is refused by node."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from fake_pipeline import FakePipeline
from test_comfy_api import default_workflow

from sdjax.server.comfy import graph, nodes
from sdjax.server.schemas import Limits

STEPS = 4


def plan(pipe, wf: dict, name: str = "fake-model", uploads: dict | None = None):
    ctx = nodes.Context(pipe, Limits(), (name,), name, (uploads or {}).get)
    return nodes.plan(graph.parse({"prompt": wf}), ctx)


def request(pipe, wf: dict, name: str = "fake-model"):
    (stage,) = plan(pipe, wf, name).stages
    return stage.request


def refusal(pipe, wf: dict, node: str, input_name: str, *words: str, name: str = "fake-model") -> dict:
    with pytest.raises(graph.PromptError) as e:
        plan(pipe, wf, name)
    body = e.value.body()
    assert body["error"]["type"] == "prompt_outputs_failed_validation", body
    (error,) = body["node_errors"][node]["errors"]
    assert error["extra_info"].get("input_name") == input_name, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


def custom(k: int | None, sampler: str = "euler", ckpt: str = "fake-model", cfg: float = 6.0, size: int = 64,
           steps: int = STEPS) -> dict:  # fmt: skip
    """SamplerCustomAdvanced over the whole schedule (`k` None), or two of them split by SplitSigmas at step `k`:
    the first with RandomNoise on high_sigmas, the second with DisableNoise on low_sigmas and the first's latent."""
    wf = default_workflow(ckpt=ckpt, size=size)
    del wf["3"]
    wf.update({
        "20": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler}},
        "21": {"class_type": "BasicScheduler", "inputs": {"model": ["4", 0], "scheduler": "normal", "steps": steps,
                                                          "denoise": 1.0}},
        "23": {"class_type": "RandomNoise", "inputs": {"noise_seed": 5}},
        "24": {"class_type": "DisableNoise", "inputs": {}},
        "25": {"class_type": "CFGGuider", "inputs": {"model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                                                     "cfg": cfg}},
    })  # fmt: skip
    if k is None:
        wf["30"] = {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["23", 0], "guider": ["25", 0],
                    "sampler": ["20", 0], "sigmas": ["21", 0], "latent_image": ["5", 0]}}  # fmt: skip
        wf["8"]["inputs"]["samples"] = ["30", 0]
        return wf
    wf.update({
        "22": {"class_type": "SplitSigmas", "inputs": {"sigmas": ["21", 0], "step": k}},
        "30": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["23", 0], "guider": ["25", 0],
               "sampler": ["20", 0], "sigmas": ["22", 0], "latent_image": ["5", 0]}},
        "31": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["24", 0], "guider": ["25", 0],
               "sampler": ["20", 0], "sigmas": ["22", 1], "latent_image": ["30", 0]}},
    })  # fmt: skip
    wf["8"]["inputs"]["samples"] = ["31", 0]
    return wf


def advanced(k: int | None, latent: list | None = None) -> dict:
    """KSamplerAdvanced over the whole schedule, or two of them handing over at step `k` (ComfyUI's two-sampler
    pattern: end_at_step k with return_with_leftover_noise, then start_at_step k with add_noise disabled)."""
    wf = default_workflow()
    common = {
        "model": ["4", 0],
        "noise_seed": 5,
        "steps": STEPS,
        "cfg": 6.0,
        "sampler_name": "euler",
        "scheduler": "normal",
        "positive": ["6", 0],
        "negative": ["7", 0],
        "latent_image": latent or ["5", 0],
    }
    wf["3"] = {"class_type": "KSamplerAdvanced", "inputs": {**common, "add_noise": "enable", "start_at_step": 0,
               "end_at_step": 10000 if k is None else k, "return_with_leftover_noise": "enable"}}  # fmt: skip
    if k is not None:
        wf["12"] = {
            "class_type": "KSamplerAdvanced",
            "inputs": {
                **common,
                "add_noise": "disable",
                "start_at_step": k,
                "end_at_step": 10000,
                "return_with_leftover_noise": "disable",
                "latent_image": ["3", 0],
            },
        }
        wf["8"]["inputs"]["samples"] = ["12", 0]  # fmt: skip
    return wf


# ---------------------------------------------------------------------------------------------- planning
def test_two_stages_are_the_one_stage_generation():
    pipe = FakePipeline()
    one = request(pipe, custom(None))
    for k in (1, 2, 3):
        p = plan(pipe, custom(k))
        (stage,) = p.stages
        assert stage.request == one and stage.node_id == "31"  # progress and the output are the second sampler's
        assert set(p.order) >= {"30", "31"}  # the first stage "executes" too
    # KSamplerAdvanced's hand-off and SamplerCustom's add_noise false are the same generation
    assert request(pipe, advanced(2)) == request(pipe, advanced(None)) == one
    wf = custom(2)
    for nid, sigmas, latent, add in (("30", ["22", 0], ["5", 0], True), ("31", ["22", 1], ["30", 0], False)):
        wf[nid] = {"class_type": "SamplerCustom", "inputs": {"model": ["4", 0], "add_noise": add, "noise_seed": 5,
                   "cfg": 6.0, "positive": ["6", 0], "negative": ["7", 0], "sampler": ["20", 0], "sigmas": sigmas,
                   "latent_image": latent}}  # fmt: skip
    assert request(pipe, wf) == one
    # heun, dpm_2 and ddim restart as cleanly (a step reads the latent and two sigmas only)
    for sampler in ("heun", "dpm_2", "ddim"):
        assert request(pipe, custom(2, sampler)) == request(pipe, custom(None, sampler))


def test_two_stages_on_an_encoded_image():
    """The first stage samples an encoded image (img2img): the pair is the one-stage img2img generation."""
    import io

    from PIL import Image

    pipe = FakePipeline()
    buf = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 90, np.uint8)).save(buf, format="PNG")
    uploads = {"in.png": buf.getvalue()}
    extra = {"10": {"class_type": "LoadImage", "inputs": {"image": "in.png"}},
             "11": {"class_type": "VAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["4", 2]}}}  # fmt: skip
    two, one = advanced(2, ["11", 0]), advanced(None, ["11", 0])
    two.update(extra)
    one.update(extra)
    (a,) = plan(pipe, two, uploads=uploads).stages
    (b,) = plan(pipe, one, uploads=uploads).stages
    assert a.request == b.request and a.request.init_image is not None


def test_two_stage_refusals():
    pipe = FakePipeline()
    # a sampler with a history: ComfyUI's second stage restarts it, another image than the one-stage run
    refusal(pipe, custom(2, "dpmpp_2m"), "20", "sampler_name", "history", "euler")
    refusal(pipe, custom(2, "euler_ancestral"), "20", "sampler_name", "noise of its")
    wf = custom(2)
    wf["31"]["inputs"]["noise"] = ["23", 0]  # the second stage adds noise
    refusal(pipe, wf, "31", "noise", "leftover noise of node 30", "add none")
    wf = custom(2)
    wf["26"] = {"class_type": "SplitSigmas", "inputs": {"sigmas": ["21", 0], "step": 3}}
    wf["31"]["inputs"]["sigmas"] = ["26", 1]  # stage 2 from step 3, stage 1 stopped at 2
    refusal(pipe, wf, "26", "step", "meet")
    wf = custom(2)
    wf["27"] = {"class_type": "CFGGuider", "inputs": {"model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                                                      "cfg": 7.0}}  # fmt: skip
    wf["31"]["inputs"]["guider"] = ["27", 0]
    refusal(pipe, wf, "27", "cfg", "one generation")
    wf["27"]["inputs"].update(cfg=6.0, negative=["6", 0])
    refusal(pipe, wf, "27", "negative", "one generation")
    wf = custom(2)
    wf["28"] = {"class_type": "BasicScheduler", "inputs": {"model": ["4", 0], "scheduler": "karras", "steps": STEPS,
                                                           "denoise": 1.0}}  # fmt: skip
    wf["29"] = {"class_type": "SplitSigmas", "inputs": {"sigmas": ["28", 0], "step": 2}}
    wf["31"]["inputs"]["sigmas"] = ["29", 1]
    refusal(pipe, wf, "31", "sigmas", "rest of the first stage's schedule")
    wf = custom(2)
    wf["20b"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "heun"}}
    wf["31"]["inputs"]["sampler"] = ["20b", 0]
    refusal(pipe, wf, "20b", "sampler_name", "one sampler")
    wf = custom(2)  # a KSampler on the first stage's latent
    wf["31"] = {"class_type": "KSampler", "inputs": {**default_workflow()["3"]["inputs"], "latent_image": ["30", 0]}}
    refusal(pipe, wf, "31", "latent_image", "leftover noise of node 30")
    wf = custom(2)  # decoding the first stage
    wf["8"]["inputs"]["samples"] = ["30", 0]
    refusal(pipe, wf, "8", "samples", "leftover noise")
    wf = custom(2)  # no noise added to an empty latent
    wf["31"]["inputs"]["latent_image"] = ["5", 0]
    refusal(pipe, wf, "31", "noise", "leftover noise")
    # KSamplerAdvanced stopping early without leftover noise jumps to a clean image (ComfyUI's force_full_denoise)
    wf = advanced(2)
    wf["3"]["inputs"]["return_with_leftover_noise"] = "disable"
    refusal(pipe, wf, "3", "end_at_step", "return_with_leftover_noise")
    wf = advanced(2)
    wf["12"]["inputs"]["start_at_step"] = 3
    refusal(pipe, wf, "12", "start_at_step", "meet")


# ---------------------------------------------------------------------------------------------- timestep ranges
def sd3_negative(wf: dict, boundary: float = 0.1) -> dict:
    """The negative of ComfyUI's SD 3 example: the negative prompt for the first `boundary` of the schedule, zero
    conditioning after (ConditioningCombine of two ConditioningSetTimestepRange)."""
    wf = copy.deepcopy(wf)
    wf.update({
        "40": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["7", 0]}},
        "41": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["40", 0], "start": boundary,
                                                                        "end": 1.0}},
        "42": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["7", 0], "start": 0.0,
                                                                        "end": boundary}},
        "43": {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["41", 0],
                                                               "conditioning_2": ["42", 0]}},
    })  # fmt: skip
    wf["3"]["inputs"]["negative"] = ["43", 0]
    return wf


def test_conditioning_set_timestep_range():
    pipe = FakePipeline()
    plain = default_workflow()
    whole = copy.deepcopy(plain)  # 0..1: every step, the conditioning itself
    whole["44"] = {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["7", 0], "start": 0.0,
                                                                            "end": 1.0}}  # fmt: skip
    whole["3"]["inputs"]["negative"] = ["44", 0]
    assert request(pipe, whole) == request(pipe, plain)
    # the SD 3 example's negative hands over at a step: served with euler on text-to-image (the numbers: below);
    # other samplers, and a model without a schedule to place the boundary on, are refused naming the range node
    wf = sd3_negative(plain)
    wf["3"]["inputs"]["sampler_name"] = "dpmpp_2m"
    refusal(pipe, wf, "41", "start", "ConditioningSetTimestepRange", "at 0.1 of the schedule", "'euler'")
    refusal(pipe, sd3_negative(plain), "41", "start", "no sampler schedule")
    # two ranges that leave a gap are no hand-over: ComfyUI swaps (and drops) conditionings at steps
    gap = sd3_negative(plain)
    gap["41"]["inputs"]["start"] = 0.3
    error = refusal(pipe, gap, "41", "start", "ConditioningSetTimestepRange", "0.3..1", "swaps")
    assert "node 43" in error["message"]
    # at cfg 1 ComfyUI never evaluates the negative: served, as the plain cfg-1 generation
    low = sd3_negative(plain)
    low["3"]["inputs"]["cfg"] = 1.0
    plain["3"]["inputs"]["cfg"] = 1.0
    assert request(pipe, low).negative_prompt == ""
    plain["7"]["inputs"]["text"] = ""
    assert request(pipe, low) == request(pipe, plain)
    # a positive conditioning for part of the schedule only; an empty range
    part = copy.deepcopy(whole)
    part["44"]["inputs"].update(start=0.5)
    part["3"]["inputs"].update(positive=["44", 0], negative=["7", 0])
    refusal(pipe, part, "44", "start", "0.5..1", "leaves it out")
    part["44"]["inputs"].update(start=0.7, end=0.2)
    refusal(pipe, part, "44", "start", "below end")
    # two different conditionings combined without ranges: ComfyUI's average, refused at the combine
    both = copy.deepcopy(plain)
    both["3"]["inputs"]["cfg"] = 6.0
    both["45"] = {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["6", 0],
                                                                  "conditioning_2": ["7", 0]}}  # fmt: skip
    both["3"]["inputs"]["negative"] = ["45", 0]
    refusal(pipe, both, "45", "conditioning_2", "averages")


# ---------------------------------------------------------------------------------------------- the numbers
@pytest.fixture(scope="module")
def embedded():
    import jax

    from sdjax import cli

    pipe = cli.load_pipeline(None, "float32")
    pipe.devices = jax.devices()[:1]
    return pipe


def test_two_stage_euler_equals_the_stages_run_apart(embedded):
    """The generation sdjax runs for two euler stages split at step k (the one-stage run) equals the two stages run
    apart through the Python API: model calls [0, k) returning latents that keep their noise, then [k, n) from those
    latents with no noise added (ComfyUI's DisableNoise)."""
    from sdjax import planning
    from sdjax.core.tasks.base import sampler_timesteps, window
    from sdjax.metadata import generate_images
    from sdjax.policy import DIFFUSERS

    pipe, k, size = embedded, 2, 64
    r = request(pipe, custom(k, ckpt="embedded", size=size), "embedded")
    assert r == request(pipe, custom(None, ckpt="embedded", size=size), "embedded")
    server = generate_images(pipe, r.images())[0]  # what the server runs for this plan

    sampler = pipe._sampler(r.sampler)
    assert sampler.order == 1
    t = sampler_timesteps(sampler, r.steps)
    cutoff = int(np.floor(t[k - 1]))  # denoising_end keeps the calls whose timestep is >= this: the first k
    assert t[k] < cutoff <= t[k - 1]
    end = 1.0 - cutoff / sampler.num_train_timesteps
    assert window(sampler, r.steps, denoising_end=end) == (0, k)
    args = ([r.prompt], [r.negative_prompt], [r.seed], [0], [r.guidance_scale])
    common = dict(steps=r.steps, height=size, width=size, sampler=r.sampler)
    plan_args = dict(height=size, width=size, count=1, steps=r.steps, policy=DIFFUSERS)
    task = planning.plan_task(pipe, planning.TaskInputs(denoising_end=end), **plan_args)
    latents = pipe.generate_arrays(*args, task=task, output="latents", **common)
    # (denoising_start only switches the added noise off; start_step puts the start at step k)
    task = planning.plan_task(pipe, planning.TaskInputs(image=latents, denoising_start=0.5, start_step=k), **plan_args)
    apart = pipe.generate_arrays(*args, task=task, output="float", **common)[0]
    whole = pipe.generate_arrays(*args, output="float", **common)[0]
    err = float(np.abs(apart - whole).max())
    print(f"two stages apart vs the one-stage run: max |diff| {err:.2e}")
    assert err < 1e-5  # two programs: their fusions round differently
    np.testing.assert_allclose(server.astype(np.float32), np.round(apart * 255), atol=1)


def two_negatives(wf: dict, boundary: float) -> dict:
    """A negative handed over at `boundary`: "blurry" for the first part of the schedule, "text, watermark" (node
    7) after (ConditioningSetTimestepRange of each, ConditioningCombine)."""
    wf = copy.deepcopy(wf)
    wf.update({
        "46": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry, dark", "clip": ["4", 1]}},
        "41": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["7", 0], "start": boundary,
                                                                        "end": 1.0}},
        "42": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["46", 0], "start": 0.0,
                                                                        "end": boundary}},
        "43": {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["41", 0],
                                                               "conditioning_2": ["42", 0]}},
    })  # fmt: skip
    wf["3"]["inputs"]["negative"] = ["43", 0]
    return wf


def staged(pipe, r, k: int, negatives: tuple[str, str], size: int, late: dict | None = None) -> np.ndarray:
    """Stage 1 (model calls [0, k), negative A, latents out) then stage 2 ([k, n) from those latents, no noise,
    negative B) through the Python API: what a negative handed over at step k means for euler."""
    from sdjax import planning
    from sdjax.core.tasks.base import sampler_timesteps, window
    from sdjax.policy import DIFFUSERS

    sampler = pipe._sampler(r.sampler)
    t = sampler_timesteps(sampler, r.steps)
    end = 1.0 - min(int(np.floor(t[k - 1])), sampler.num_train_timesteps - 1) / sampler.num_train_timesteps
    assert window(sampler, r.steps, denoising_end=end) == (0, k)
    common = dict(steps=r.steps, height=size, width=size, sampler=r.sampler, **dict(r.conditioning))
    plan_args = dict(height=size, width=size, count=1, steps=r.steps, policy=DIFFUSERS)
    task = planning.plan_task(pipe, planning.TaskInputs(denoising_end=end), **plan_args)
    args = ([r.seed], [0], [r.guidance_scale])
    latents = pipe.generate_arrays([r.prompt], [negatives[0]], *args, task=task, output="latents", **common)
    task = planning.plan_task(pipe, planning.TaskInputs(image=latents, denoising_start=0.5, start_step=k), **plan_args)
    common.update(late or {})
    return pipe.generate_arrays([r.prompt], [negatives[1]], *args, task=task, output="float", **common)[0]


def test_negative_handed_over_at_a_step(embedded):
    """ComfyUI's percent -> sigma rule on a variance-preserving model: percent b is the training sigma at timestep
    999 (1 - b), so the steps whose timestep lies above it use the early negative. The server's generation equals
    the two stages run apart with those negatives, and the PNG's parameters carry the hand-over."""
    from sdjax import infotext, metadata
    from sdjax.core.tasks.base import sampler_timesteps

    pipe, size, boundary = embedded, 64, 0.3
    wf = two_negatives(custom_ksampler(), boundary)
    r = request(pipe, wf, "embedded")
    t = sampler_timesteps(pipe._sampler(r.sampler), r.steps)
    k = int((t > 999 * (1 - boundary)).sum())  # the hand computation
    assert 0 < k < r.steps
    assert r.negative_switch == metadata.NegativeSwitch(k, "text, watermark")
    assert r.negative_prompt == "blurry, dark" and r.conditioning == ()
    server = metadata.generate_images(pipe, r.images())[0]
    want = staged(pipe, r, k, ("blurry, dark", "text, watermark"), size)
    np.testing.assert_allclose(server.astype(np.float32), np.round(want * 255), atol=1)
    one = staged(pipe, r, k, ("blurry, dark", "blurry, dark"), size)
    assert np.abs(one - want).max() > 1e-3  # the second negative changes the image
    (im,) = r.images()
    back = metadata.parameters_from_text(infotext.read_parameters(infotext.png_bytes(server, im.infotext())))
    assert back == im


def custom_ksampler() -> dict:
    """The default workflow on the embedded model: KSampler euler / normal, 4 steps, cfg 6, 64 x 64."""
    wf = default_workflow(ckpt="embedded", size=64)
    wf["3"]["inputs"].update(cfg=6.0, sampler_name="euler", scheduler="normal", steps=STEPS)
    return wf


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    import jax
    import sd3_reference
    import t5_reference

    from sdjax import cli

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    folder = tmp_path_factory.mktemp("models") / "sd3.5-tiny"
    sd3_reference.sd3_pipeline(tokenizer_dir=tok).save_pretrained(folder, safe_serialization=True)
    pipe = cli.load_pipeline(str(folder), "float32")
    pipe.devices = jax.devices()[:1]
    return pipe


def test_sd3_example_negative(sd3):
    """ComfyUI's SD 3 example negative (the negative prompt for the first 10% of the schedule, zero conditioning
    after) on a tiny SD 3: percent b is sigma shift (1 - b) / (1 + (shift - 1)(1 - b)); the steps above it use the
    negative prompt, the rest zero negative embeddings."""
    from test_comfy_families import TRIPLE, sd3_workflow

    from sdjax import metadata
    from sdjax.core.tasks.base import sampler_timesteps

    pipe, size, steps = sd3, 32, 6
    wf = sd3_workflow(TRIPLE, seed=3, size=size)
    wf["3"]["inputs"].update(steps=steps, cfg=4.5, sampler_name="euler", scheduler="simple")
    negative = wf["3"]["inputs"]["negative"]
    wf.update({
        "70": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": negative}},
        "71": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["70", 0], "start": 0.1,
                                                                        "end": 1.0}},
        "72": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": negative, "start": 0.0,
                                                                        "end": 0.1}},
        "73": {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["71", 0],
                                                               "conditioning_2": ["72", 0]}},
    })  # fmt: skip
    wf["3"]["inputs"]["negative"] = ["73", 0]
    r = request(pipe, wf, "sd3.5-tiny")
    shift = float(pipe.scheduler.config["shift"])
    sigma_b = shift * 0.9 / (1 + (shift - 1) * 0.9)
    sigmas = sampler_timesteps(pipe._sampler(r.sampler), steps) / 1000.0
    k = int((sigmas > sigma_b).sum())
    assert 0 < k < steps, (sigmas, sigma_b)
    assert r.negative_switch == metadata.NegativeSwitch(k, "", (("zero_negative", True),))
    server = metadata.generate_images(pipe, r.images())[0]
    text = wf[negative[0]]["inputs"]["text"]
    want = staged(pipe, r, k, (text, ""), size, late={"zero_negative": [True]})
    print(f"SD 3 example negative: hand-over at step {k} of {steps}")
    np.testing.assert_allclose(server.astype(np.float32), np.round(want * 255), atol=1)
    plain = staged(pipe, r, k, (text, text), size)
    assert np.abs(plain - want).max() > 1e-3  # zero conditioning after the hand-over changes the image
    # the served workflow: the batcher runs the same two generations; the PNG carries the hand-over
    from server_helpers import client, live_server
    from test_comfy_families import close, run

    from sdjax import infotext

    with live_server(pipe, model_name="sd3.5-tiny", warm=False, max_batch=1) as s, client(s.url, timeout=300) as c:
        got = run(c, wf)
        entry = c.get("/history").json()
        (image,) = next(iter(entry.values()))["outputs"]["9"]["images"]
        png = c.get("/view", params=image).content
    close(got, server)  # (the server's program also hands latents to its previews: it rounds differently)
    raw = infotext.parse_parameters(infotext.read_parameters(png))
    assert raw["Negative switch at step"] == str(k) and raw["Zero negative after switch"] == "True"
