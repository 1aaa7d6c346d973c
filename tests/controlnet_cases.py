"""Test helpers for ControlNet generation: tiny torch ControlNets that fit the tiny UNets of tests/reference.py,
and control maps."""

import contextlib

import numpy as np
import reference
import torch


def torch_controlnet(unet, seed: int):
    """`ControlNetModel.from_unet(unet)` with random zero convs and norms (tests/models/test_controlnet.py)."""
    from diffusers import ControlNetModel

    reference.seed_everything(seed)
    model = ControlNetModel.from_unet(unet).eval()
    g = torch.Generator().manual_seed(seed + 100)
    zero_init = [*model.controlnet_down_blocks, model.controlnet_mid_block, model.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for layer in zero_init:
            layer.weight.copy_(0.3 * torch.randn(layer.weight.shape, generator=g))
            layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=g))
        for layer in model.controlnet_cond_embedding.blocks:
            layer.weight.mul_(3.0)
    reference.perturb_norms(model, seed)
    return model


def control_images(seed: int) -> list:
    """Two control maps (edges-like: white rectangles on black), 80x72 so that they get resized to 64x64."""
    from PIL import Image

    r = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        a = np.zeros((72, 80, 3), np.uint8)
        for _ in range(6):
            y, x = r.integers(0, 60), r.integers(0, 70)
            a[y : y + r.integers(2, 12), x : x + r.integers(2, 12)] = 255
        out.append(Image.fromarray(a))
    return out


@contextlib.contextmanager
def one_torch_thread():
    """PyTorch on one thread while the block runs (the previous count after). The tiny reference pipelines run
    a few hundred small ops; with two intra-op threads on a busy 2-core machine (CI runs two test workers), each
    op's thread hand-off costs more than the op: measured here 8-25 s of CPU for one 5-step ControlNet
    pipeline call instead of 0.25 s on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
