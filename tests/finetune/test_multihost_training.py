"""`sdjax train lora|dreambooth|textual-inversion` over two processes (`jax.distributed`, gloo collectives on CPU,
2 devices each) against one process with 4 devices: the same global batch split over 4 devices either way, so the
same losses and the same trained values; each process opens only the images of its own rows of every batch
(DreamBooth's [instance; class] batch: process 0's devices hold the instance rows, process 1's the class rows);
only process 0 writes the outputs (the four runs made by one launch: `launched`). Plus what several processes
refuse."""

import numpy as np
import pytest
from multihost_launch import one_and_two, read_loads, read_losses, worst_tensor
from PIL import Image
from safetensors.numpy import load_file

from sdjax.finetune import data as data_lib
from sdjax.finetune import distributed

STEPS, BATCH = 2, 4
# 32 px, the least the tiny model takes (latents of 4 x 4, 2 x 2 in the UNet's lower block), training the 64 px images
# of the fixtures: the rows, losses and trained values compared are as distinct at any size; with one bucket (32, 32)
# of step 32 (the default step, 64, would make the bucket 64 x 64) or, where the command has no --bucket-step, none
ARGS = [
    "--steps",
    str(STEPS),
    "--rank",
    "2",
    "--batch-size",
    str(BATCH),
    "--resolution",
    "32",
    "--bucket-step",
    "32",
    "--lr",
    "1e-3",
    "--seed",
    "3",
]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    rng = np.random.default_rng(1)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(root / f"s{i}.png")
        (root / f"s{i}.txt").write_text(f"a shape, colour {i}")
    return root


def _halves(loaded: list[str], steps: int, size: int) -> list[list[str]]:
    """Per process, the decodes of its rows [p * size / 2, (p + 1) * size / 2) of each of the one-process run's
    batches (`loaded`: `size` decodes a batch, in row order)."""
    half = size // 2
    return [[loaded[s * size + r] for s in range(steps) for r in range(p * half, p * half + half)] for p in (0, 1)]


@pytest.mark.parametrize("cached", [False, True], ids=["images", "cache-latents"])
def test_two_processes_train_as_one_process_with_their_devices(launched, images, cached):
    folder = launched["cache-latents" if cached else "images"]

    # what each process decoded: with images, rows [2p, 2p + 2) of each of the one-process run's batches (process
    # p's two devices hold the batch's p-th half); with a latent cache, every image once, while the cache is built
    loaded = read_loads(folder / "loads-one.txt")
    names = sorted(p.name for p in images.glob("*.png"))
    if cached:
        assert loaded == names
        expected = [names, names]
    else:
        assert len(loaded) == STEPS * BATCH and sorted(loaded[:BATCH]) == names
        expected = _halves(loaded, STEPS, BATCH)
    for p in (0, 1):
        print(f"process {p} decoded {read_loads(folder / f'loads-{p}.txt')}")
        assert read_loads(folder / f"loads-{p}.txt") == expected[p], p

    ref, got = read_losses(folder / "one-run"), read_losses(folder / "two-run")
    print(f"losses: one process {ref}, two processes {got}")
    assert len(got) == 2 and np.allclose(got, ref, rtol=1e-5, atol=0)
    a, b = load_file(str(folder / "one.safetensors")), load_file(str(folder / "two.safetensors"))
    assert any(np.abs(v).max() > 0 for k, v in b.items() if "lora_up" in k)
    worst = worst_tensor(a, b)
    print(f"LoRA tensors: worst relative L2 difference {worst:.2e}")
    assert worst < 1e-3, worst
    # one writer: the loss log has each update once, and the checkpoints are one set (orbax, written together)
    assert sorted(p.name for p in (folder / "two-run" / "checkpoints").iterdir()) == ["2"]


@pytest.fixture(scope="module")
def classes(tmp_path_factory):
    """A full class folder (4 images: drawing class images is refused over several processes)."""
    root = tmp_path_factory.mktemp("class-shapes")
    rng = np.random.default_rng(2)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(root / f"c{i}.png")
    return root


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """Images of which only two have captions: the others train on object templates chosen by their row."""
    root = tmp_path_factory.mktemp("bare-shapes")
    rng = np.random.default_rng(4)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(root / f"b{i}.png")
    for i in range(2):
        (root / f"b{i}.txt").write_text(f"a <shape> in colour {i}")
    return root


# rows of a global micro-batch: DreamBooth with prior preservation, 2 instance + 2 class rows; textual inversion, 4
_ROWS = {"dreambooth": 4, "textual-inversion": 4}


def _trainer_args(command: str, images, classes, bare) -> list[str]:
    """The arguments of a DreamBooth run with prior preservation or of a textual-inversion run."""
    common = ["--steps", str(STEPS), "--resolution", "32", "--lr", "1e-3", "--seed", "3"]
    if command == "dreambooth":
        args = ["--instance-data", str(images), "--instance-prompt", "a photo of sks shape", "--rank", "2"]
        args += ["--class-data", str(classes), "--class-prompt", "a photo of a shape", "--num-class-images", "4"]
        return [*common, *args, "--batch-size", "2"]
    args = ["--data", str(bare), "--token", "<shape>", "--init-word", "shape", "--vectors", "2", "--no-bucketing"]
    return [*common, *args, "--batch-size", "4"]


@pytest.fixture(scope="module")
def launched(sd1_dir, images, classes, bare, tmp_path_factory):
    """The four runs of this file's two-process tests (a LoRA from images, a LoRA from cached latents, DreamBooth,
    textual inversion), each on one process and on two (`one_and_two`), made by one launch: each process runs the
    four one after the other (started, JAX and sdjax imported, `jax.distributed` joined once, not four times); a
    run's files in its own folder, by case."""
    lora = ["--model", str(sd1_dir), "--data", str(images), *ARGS]
    runs = {
        "images": ("lora", lora),
        "cache-latents": ("lora", [*lora, "--cache-latents"]),
        **{c: (c, ["--model", str(sd1_dir), *_trainer_args(c, images, classes, bare)]) for c in _ROWS},
    }
    folders = {case: tmp_path_factory.mktemp(case) for case in runs}
    one_and_two([(command, args, folders[case]) for case, (command, args) in runs.items()])
    return folders


@pytest.mark.parametrize("command", ["dreambooth", "textual-inversion"])
def test_dreambooth_and_textual_inversion_over_two_processes(launched, command):
    """Each process decodes only its own rows of every batch (a DreamBooth batch is [instance; class]: process 0's
    devices hold the instance rows, process 1's the class rows; a textual-inversion row keeps the template of its
    row in the whole batch), and the run's losses and trained values are the one-process run's."""
    folder, size = launched[command], _ROWS[command]

    loaded = read_loads(folder / "loads-one.txt")
    assert len(loaded) == STEPS * size
    expected = _halves(loaded, STEPS, size)
    decoded = [read_loads(folder / f"loads-{p}.txt") for p in (0, 1)]
    print(f"{command}: one process decoded {loaded}; the two processes {decoded}")
    assert decoded == expected and [len(d) for d in decoded] == [STEPS * size // 2] * 2
    if command == "dreambooth":  # the instance rows on process 0, the class rows on process 1
        assert all(n.startswith("s") for n in decoded[0]) and all(n.startswith("c") for n in decoded[1])

    ref, got = read_losses(folder / "one-run"), read_losses(folder / "two-run")
    worst_loss = max(abs(a - b) / abs(a) for a, b in zip(ref, got, strict=True))
    a, b = load_file(str(folder / "one.safetensors")), load_file(str(folder / "two.safetensors"))
    start = load_file(str(folder / "one-run" / "init.safetensors")) if command != "dreambooth" else None
    worst = worst_tensor(a, b)
    print(f"{command}: losses {ref} vs {got} (worst relative {worst_loss:.1e}); trained tensors {worst:.1e}")
    assert len(got) == STEPS and worst_loss <= 1e-6
    assert worst < 1e-3, worst
    if start is not None:  # the rows moved (the comparison is not of two untrained copies)
        assert worst_tensor(start, b) > 1e-3
    assert sorted(p.name for p in (folder / "two-run" / "checkpoints").iterdir()) == [str(STEPS)]


def test_a_process_rows_are_those_rows_of_the_whole_batch(images):
    """`Sampler.load(step, rows)` (what one process of several opens) equals those rows of the whole batch: the
    same images, crops, flips and captions."""
    cfg = data_lib.DataConfig(resolution=64, flip=True, caption_dropout=0.3, shuffle_tags=True)
    sampler = data_lib.Sampler(data_lib.scan(images, cfg), cfg, 4, seed=3)
    for step in range(4):
        whole = sampler.load(step)
        for rows in ([0, 1], [2, 3], [3]):
            part = sampler.load(step, rows)
            np.testing.assert_array_equal(part["pixels"], whole["pixels"][rows])
            np.testing.assert_array_equal(part["time_ids"], whole["time_ids"][rows])
            assert part["captions"] == [whole["captions"][r] for r in rows]
            assert part["paths"] == [whole["paths"][r] for r in rows]
            assert sampler.plan(step, rows) == [sampler.plan(step)[r] for r in rows]
    with pytest.raises(IndexError, match=r"rows \[4\] of a micro-batch of 4 examples"):
        sampler.load(0, [1, 4])


def test_several_processes_refuse_validation_images(monkeypatch):
    monkeypatch.setattr(distributed, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="validation images are not supported .* over 2 processes"):
        distributed.check_supported(validation=True)
    distributed.check_supported(validation=False)


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(coordinator="127.0.0.1:1"), "go together"),
        (dict(coordinator="127.0.0.1:1", num_processes=2, process_id=2), r"process id 2 must lie in \[0, 2\)"),
    ],
)
def test_bad_host_settings_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        distributed.initialize(**args)
