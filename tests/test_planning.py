"""The task planner (`sdjax.planning`): the same inputs under diffusers' and A1111's policies, hand-computed
step rules, the checks, and that the Python API and the faces' executor both plan through it."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from sdjax import metadata, planning
from sdjax.pipelines.auto import load_pipeline
from sdjax.policy import A1111, DIFFUSERS, a1111_start_step


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(None)[0]


def _image(value: int = 128):
    return Image.fromarray(np.full((64, 64, 3), value, np.uint8))


def _mask():
    m = np.zeros((64, 64), np.uint8)
    m[16:48, 16:48] = 255
    return Image.fromarray(m)


@pytest.mark.parametrize("steps, strength, first", [(20, 0.75, 4), (20, 1.0, 0), (10, 0.3, 6), (50, 0.5, 24)])
def test_a1111_step_rule_by_hand(steps, strength, first):
    # A1111 runs int(min(s, 0.999) * steps) + 1 steps at the end of the schedule
    assert a1111_start_step(steps, strength) == first
    assert steps - first == int(min(strength, 0.999) * steps) + 1


def test_the_two_policies_differ_only_in_their_fields(pipe):
    img2img = planning.TaskInputs(image=_image())
    inpaint = planning.TaskInputs(image=_image(), mask_image=_mask())
    kw = dict(height=64, width=64, count=2, steps=20)

    ours = planning.plan_task(pipe, img2img, policy=DIFFUSERS, **kw)
    faces = planning.plan_task(pipe, img2img, policy=A1111, **kw)
    assert ours.spec.name == faces.spec.name == "img2img"
    assert ours.strength == pipe.default_strength["img2img"] == 0.8 and ours.start_step is None
    assert faces.strength == 0.75 and faces.start_step == a1111_start_step(20, 0.75) == 4
    np.testing.assert_array_equal(ours.arrays["image"], faces.arrays["image"])  # the same image arrays

    ours = planning.plan_task(pipe, inpaint, policy=DIFFUSERS, **kw)
    faces = planning.plan_task(pipe, inpaint, policy=A1111, **kw)
    assert ours.spec.name == faces.spec.name == "inpaint"
    assert ours.strength == pipe.default_strength["inpaint"] == 1.0 and faces.strength == 0.75
    assert ours.finish is None and faces.finish is not None  # A1111 pastes the original back; diffusers does not

    given = planning.TaskInputs(image=_image(), strength=0.5)
    assert planning.plan_task(pipe, given, policy=DIFFUSERS, **kw).strength == 0.5
    assert planning.plan_task(pipe, given, policy=A1111, **kw).start_step == a1111_start_step(20, 0.5)


@pytest.mark.parametrize(
    "inputs, message",
    [
        (planning.TaskInputs(mask_image="m.png"), "mask_image= needs image="),
        (planning.TaskInputs(strength=0.5), "strength= and denoising_start= need image="),
        (planning.TaskInputs(image=[_image(), _image(), _image()]), "image: got 3 for 2 images"),
    ],
)
def test_bad_task_inputs_are_named(pipe, inputs, message):
    with pytest.raises(ValueError, match=message):
        planning.plan_task(pipe, inputs, height=64, width=64, count=2, steps=20, policy=DIFFUSERS)


def test_the_a1111_rule_needs_the_step_count(pipe):
    with pytest.raises(ValueError, match="needs the step count"):
        planning.plan_task(
            pipe, planning.TaskInputs(image=_image()), height=64, width=64, count=1, steps=None, policy=A1111
        )


def test_task_names_agree_with_the_requests():
    assert planning.task_name(None, None) == "txt2img"
    assert planning.task_name("a", None) == "img2img" and planning.task_name("a", "m") == "inpaint"
    request = metadata.GenerationRequest(prompt="x", init_image=_image(), mask_image=_mask())
    assert {im.task for im in request.images()} == {"inpaint"}


def test_the_python_api_and_the_faces_plan_through_one_function(pipe, monkeypatch):
    calls = []
    real = planning.plan_task

    def spy(pipe_, inputs, **kw):
        calls.append((inputs.task, kw["policy"].name))
        return real(pipe_, inputs, **kw)

    monkeypatch.setattr(planning, "plan_task", spy)
    pipe.generate("a red circle", image=_image(), steps=2, output_type="np")
    request = metadata.GenerationRequest(
        prompt="a red circle", steps=2, width=64, height=64, sampler=pipe.default_sampler, init_image=_image()
    )
    metadata.generate_images(pipe, request.images())
    assert calls == [("img2img", "diffusers"), ("img2img", "a1111")]


def test_the_hires_pass_is_planned_with_its_own_first_step(pipe, monkeypatch):
    from sdjax.pipelines.recipes import Hires, hires_arrays

    seen = []
    real = planning.plan_task

    def spy(pipe_, inputs, **kw):
        task = real(pipe_, inputs, **kw)
        seen.append((inputs.task, inputs.start_step, task.start_step, kw["steps"]))
        return task

    monkeypatch.setattr(planning, "plan_task", spy)
    hires = Hires(scale=1.5, strength=0.5, steps=2)
    out = hires_arrays(pipe, ["a red circle"], [""], [1], [0], [7.5], steps=2, height=64, width=64, hires=hires)
    total, start = hires.window(2)
    assert out.shape == (1, 96, 96, 3)
    assert seen == [("img2img", start, start, total)]  # the hires rule's step, not A1111's img2img rule
    assert (total, start) == (4, 2)  # int(2 / min(0.5, 0.999)) = 4 steps, the last 2 of them run
