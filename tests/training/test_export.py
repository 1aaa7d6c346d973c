"""Export: sdjax params -> a diffusers folder that sdjax reads back identically and diffusers/transformers load
with no missing or unexpected keys."""

import json

import jax
import numpy as np
import pytest
import reference
from flax.traverse_util import flatten_dict

from sdjax.models.clip import CLIPTextConfig, CLIPTextModel
from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel
from sdjax.models.vae import AutoencoderKL, AutoencoderKLConfig
from sdjax.training import export
from sdjax.training.train import SCHEDULER

TEXT = CLIPTextConfig.from_dict(reference.CLIP_SD1)
UNET = UNet2DConditionConfig(**reference.UNET_SD1)
VAE = AutoencoderKLConfig(**reference.VAE)


def _random_params(shapes, seed):
    leaves, tree = jax.tree_util.tree_flatten(shapes)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_unflatten(tree, [rng.standard_normal(s.shape).astype(np.float32) for s in leaves])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    params = {
        "text_encoder": _random_params(CLIPTextModel.init_params_shape(TEXT), 0),
        "unet": _random_params(UNet2DConditionModel.init_params_shape(UNET), 1),
        "vae": _random_params(AutoencoderKL.init_params_shape(VAE), 2),
    }
    out = export.export_pipeline(
        tmp_path_factory.mktemp("exported"),
        text_config=TEXT,
        unet_config=UNET,
        vae_config=VAE,
        scheduler_config=SCHEDULER,
        params=params,
    )
    return out, params


def test_torch_key_names():
    assert (
        export.path_to_torch_key(("down_blocks_0", "resnets_1", "conv1", "kernel"))
        == "down_blocks.0.resnets.1.conv1.weight"
    )
    assert export.path_to_torch_key(("time_embedding", "linear_1", "bias")) == "time_embedding.linear_1.bias"
    assert export.path_to_torch_key(("attn1", "to_out_0", "kernel")) == "attn1.to_out.0.weight"
    assert export.path_to_torch_key(("ff", "net_0", "proj", "kernel")) == "ff.net.0.proj.weight"
    assert export.path_to_torch_key(("conv_norm_out", "scale")) == "conv_norm_out.weight"
    with pytest.raises(export.ExportError, match="unknown leaf"):
        export.path_to_torch_key(("x", "running_mean"))


def test_layouts_are_pytorch_ones():
    sd = export.params_to_state_dict(
        {
            "lin": {"kernel": np.zeros((3, 5))},
            "conv": {"kernel": np.zeros((3, 3, 2, 7))},
            "emb": {"embedding": np.zeros((10, 4))},
        }
    )
    assert sd["lin.weight"].shape == (5, 3)
    assert sd["conv.weight"].shape == (7, 2, 3, 3)
    assert sd["emb.weight"].shape == (10, 4)


def test_round_trip_through_the_sdjax_loader_is_exact(exported):
    from sdjax import StableDiffusionPipeline

    folder, params = exported
    pipe, loaded = StableDiffusionPipeline.from_pretrained(str(folder))
    for name in ("text_encoder", "unet", "vae"):
        want, got = flatten_dict(params[name]), flatten_dict(jax.device_get(loaded[name]))
        assert set(want) == set(got), name
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=f"{name}/{'/'.join(k)}")
    assert pipe.unet.config == UNET and pipe.vae.config == VAE and pipe.text_encoder.config == TEXT
    assert type(getattr(pipe.scheduler, "origin", pipe.scheduler)).__name__ == "DPMSolverMultistep"
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"


def test_diffusers_and_transformers_load_the_folder_without_missing_or_unexpected_keys(exported):
    import torch
    from diffusers import AutoencoderKL as TorchVAE
    from diffusers import StableDiffusionPipeline
    from diffusers import UNet2DConditionModel as TorchUNet
    from transformers import CLIPTextModel as TorchCLIP

    folder, params = exported
    for cls, sub in ((TorchUNet, "unet"), (TorchVAE, "vae")):
        _, info = cls.from_pretrained(folder / sub, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (sub, info)
    _, info = TorchCLIP.from_pretrained(folder / "text_encoder", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info

    pipe = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None)
    assert type(pipe.scheduler).__name__ == "DPMSolverMultistepScheduler"
    # The weights diffusers loaded are the exported ones, in PyTorch layout.
    w = pipe.unet.state_dict()["down_blocks.0.resnets.0.conv1.weight"]
    k = params["unet"]["down_blocks_0"]["resnets_0"]["conv1"]["kernel"]
    np.testing.assert_array_equal(w.numpy(), k.transpose(3, 2, 0, 1))
    emb = pipe.text_encoder.get_input_embeddings().weight
    np.testing.assert_array_equal(
        emb.detach().numpy(), params["text_encoder"]["text_model"]["embeddings"]["token_embedding"]["embedding"]
    )
    assert torch.is_tensor(w)


def test_tokenizer_folder_gives_transformers_ids(exported):
    from transformers import CLIPTokenizer as TorchTokenizer

    from sdjax.text.tokenizer import CLIPTokenizer

    folder, _ = exported
    prompts = ["a small green triangle in the top left on a white background", "", "Red CIRCLE, center!!"]
    ours = CLIPTokenizer.from_folder(folder / "tokenizer")(prompts)
    theirs = TorchTokenizer.from_pretrained(folder / "tokenizer")(
        prompts, padding="max_length", max_length=77, truncation=True
    ).input_ids
    np.testing.assert_array_equal(ours, np.asarray(theirs))
