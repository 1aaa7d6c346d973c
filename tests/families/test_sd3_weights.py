"""SD 3 / 3.5 single files (`families.sd3.weights`, `StableDiffusion3Pipeline.from_single_file`): a tiny diffusers SD 3
written in Stability AI's single-file layout (`model.diffusion_model.*` reference MMDiT keys, `text_encoders.clip_l /
clip_g / t5xxl.transformer.*`, `first_stage_model.*` LDM VAE) gives the image of its diffusers folder; the separate
encoder files too; files of the wrong family are refused naming the file.

The file is made here by inverting diffusers' conversion (fused qkv, (shift, scale) halves, LDM VAE names), and
diffusers' own `convert_sd3_transformer_checkpoint_to_diffusers` must turn it back into the model's state dict: the
test's writer is checked against diffusers, the loader against the writer.
"""

from __future__ import annotations

import numpy as np
import pytest
import sd3_reference
import t5_reference
import torch

from sdjax.families.flux import weights as flux_weights
from sdjax.families.sd3 import weights
from sdjax.families.sd3.pipeline import StableDiffusion3Pipeline
from sdjax.loading import ldm_keys
from sdjax.models.vae import AutoencoderKLConfig

SIZE, STEPS, MAX_SEQ = 32, 2, 24
PROMPT = ["a red circle on a blue background"]


def reference_transformer_keys(sd: dict, num_layers: int) -> dict:
    """diffusers SD3Transformer2DModel state dict -> the reference (sd3_impls / single-file) layout."""
    sd = dict(sd)
    out = {}

    def swap(x):
        half = x.shape[0] // 2
        return torch.cat([x[half:], x[:half]])

    fixed = {
        "pos_embed.proj": "x_embedder.proj",
        "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
        "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
        "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
        "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
        "context_embedder": "context_embedder",
        "proj_out": "final_layer.linear",
    }
    out["pos_embed"] = sd.pop("pos_embed.pos_embed")
    for leaf in ("weight", "bias"):
        for d, s in fixed.items():
            out[f"{s}.{leaf}"] = sd.pop(f"{d}.{leaf}")
        out[f"final_layer.adaLN_modulation.1.{leaf}"] = swap(sd.pop(f"norm_out.linear.{leaf}"))
    for i in range(num_layers):
        d, s = f"transformer_blocks.{i}", f"joint_blocks.{i}"
        for leaf in ("weight", "bias"):
            for attn, block, names in (
                ("attn", "x_block.attn", ("to_q", "to_k", "to_v")),
                ("attn", "context_block.attn", ("add_q_proj", "add_k_proj", "add_v_proj")),
                ("attn2", "x_block.attn2", ("to_q", "to_k", "to_v")),
            ):
                if f"{d}.{attn}.{names[0]}.{leaf}" in sd:
                    out[f"{s}.{block}.qkv.{leaf}"] = torch.cat([sd.pop(f"{d}.{attn}.{n}.{leaf}") for n in names])
            for src, dst in (
                ("attn.to_out.0", "x_block.attn.proj"),
                ("attn2.to_out.0", "x_block.attn2.proj"),
                ("attn.to_add_out", "context_block.attn.proj"),
                ("norm1.linear", "x_block.adaLN_modulation.1"),
                ("ff.net.0.proj", "x_block.mlp.fc1"),
                ("ff.net.2", "x_block.mlp.fc2"),
                ("ff_context.net.0.proj", "context_block.mlp.fc1"),
                ("ff_context.net.2", "context_block.mlp.fc2"),
            ):
                if f"{d}.{src}.{leaf}" in sd:
                    out[f"{s}.{dst}.{leaf}"] = sd.pop(f"{d}.{src}.{leaf}")
            x = sd.pop(f"{d}.norm1_context.linear.{leaf}")
            out[f"{s}.context_block.adaLN_modulation.1.{leaf}"] = swap(x) if i == num_layers - 1 else x
        for src, dst in (
            ("attn.norm_q", "x_block.attn.ln_q"),
            ("attn.norm_k", "x_block.attn.ln_k"),
            ("attn.norm_added_q", "context_block.attn.ln_q"),
            ("attn.norm_added_k", "context_block.attn.ln_k"),
            ("attn2.norm_q", "x_block.attn2.ln_q"),
            ("attn2.norm_k", "x_block.attn2.ln_k"),
        ):
            if f"{d}.{src}.weight" in sd:
                out[f"{s}.{dst}.weight"] = sd.pop(f"{d}.{src}.weight")
    assert not sd, f"unconverted: {sorted(sd)[:5]}"
    return out


def ldm_vae_keys(vae) -> dict:
    config = AutoencoderKLConfig.from_dict(dict(vae.config))
    out = {}
    for k, v in vae.state_dict().items():
        source = ldm_keys.vae_source(k, config)
        out[source.key] = v[..., None, None] if source.transform == "squeeze" else v
    return out


def write(path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()}, str(path))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The config folder (seed 0), the folder of another tiny SD 3 (seed 1) and its single file with everything."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    root = tmp_path_factory.mktemp("sd3-files")
    folders = {}
    for seed in (0, 1):
        pipe = sd3_reference.sd3_pipeline(seed=seed, tokenizer_dir=tok)
        folders[seed] = root / f"folder-{seed}"
        pipe.save_pretrained(folders[seed], safe_serialization=True)
    transformer = pipe.transformer.state_dict()
    reference = reference_transformer_keys(transformer, pipe.transformer.config.num_layers)
    back = convert_sd3_transformer_checkpoint_to_diffusers(dict(reference))  # diffusers' own reading of the layout
    assert set(back) == set(transformer) and all(torch.equal(back[k], transformer[k]) for k in transformer)
    parts = {
        "model.diffusion_model.": reference,
        weights.CLIP_L_PREFIX: pipe.text_encoder.state_dict(),
        weights.CLIP_G_PREFIX: pipe.text_encoder_2.state_dict(),
        weights.T5_PREFIX: pipe.text_encoder_3.state_dict(),
        weights.VAE_PREFIX: ldm_vae_keys(pipe.vae),
    }
    files = {"all": root / "sd3_tiny.safetensors", "mmdit": root / "sd3_tiny_mmdit.safetensors"}
    write(files["all"], {p + k: v for p, d in parts.items() for k, v in d.items()})
    write(files["mmdit"], {"model.diffusion_model." + k: v for k, v in reference.items()})
    for name, prefix in (("clip_l", weights.CLIP_L_PREFIX), ("clip_g", weights.CLIP_G_PREFIX)):
        files[name] = root / f"{name}.safetensors"
        write(files[name], dict(parts[prefix]))  # transformers names, no prefix (ComfyUI's clip_l/clip_g files)
    files["t5"] = root / "t5xxl.safetensors"
    write(files["t5"], dict(parts[weights.T5_PREFIX]))
    return folders, files


def _image(pipe, params):
    out = pipe.generate(
        PROMPT, steps=STEPS, height=SIZE, width=SIZE, seed=4, params=params, max_sequence_length=MAX_SEQ,
        output_type="np", negative_prompt="blurry",
    )  # fmt: skip
    return np.asarray(out, np.float32)


def test_a_single_file_gives_its_folders_image(models):
    folders, files = models
    want = _image(*StableDiffusion3Pipeline.from_pretrained(str(folders[1])))
    other = _image(*StableDiffusion3Pipeline.from_pretrained(str(folders[0])))
    assert np.abs(want - other).max() > 1e-2  # the config folder's own weights give another image
    pipe, params = StableDiffusion3Pipeline.from_single_file(str(files["all"]), config=str(folders[0]))
    assert np.abs(_image(pipe, params) - want).max() <= 1e-6
    # the MMDiT alone with the separate encoder files; the VAE (and nothing else) then comes from the config folder
    pipe, params = StableDiffusion3Pipeline.from_single_file(
        str(files["mmdit"]), config=str(folders[1]), clip_l=str(files["clip_l"]), clip_g=str(files["clip_g"]),
        t5=str(files["t5"]),
    )  # fmt: skip
    assert np.abs(_image(pipe, params) - want).max() <= 1e-6


def test_the_conversion_table_is_diffusers(models):
    """The loader's lazy state dict equals diffusers' conversion of the same file, tensor by tensor."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    _, files = models
    raw = load_file(str(files["mmdit"]))
    theirs = convert_sd3_transformer_checkpoint_to_diffusers(dict(raw))
    ours = weights.sd3_transformer_state_dict(weights.transformer_part(weights.read_file(files["mmdit"])))
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        np.testing.assert_array_equal(np.asarray(ours[k], np.float32), v.float().numpy(), err_msg=k)


def test_files_of_the_other_family_are_refused_by_name(models, tmp_path):
    _, files = models
    with pytest.raises(flux_weights.FluxWeightsError, match=r"sd3_tiny\.safetensors.*Stable Diffusion 3"):
        flux_weights.load_flux_transformer_file(files["all"], dtype=np.float32)
    flux = tmp_path / "flux1-tiny.safetensors"
    names = ("img_in.weight", "double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight")
    write(flux, {k: torch.zeros(4, 4) for k in names})
    with pytest.raises(weights.SD3WeightsError, match=r"flux1-tiny\.safetensors.*Flux\.1"):
        weights.load_sd3_transformer(weights.read_file(flux), source=str(flux), dtype=np.float32, config={})
    folders, _ = models
    with pytest.raises(weights.SD3WeightsError, match=r"flux1-tiny\.safetensors"):
        StableDiffusion3Pipeline.from_single_file(str(flux), config=str(folders[0]))
    with pytest.raises(Exception, match="no-such-clip"):
        StableDiffusion3Pipeline.from_single_file(
            str(files["mmdit"]), config=str(folders[0]), clip_l=str(tmp_path / "no-such-clip.safetensors")
        )
    with pytest.raises(weights.SD3WeightsError, match=r"t5xxl\.safetensors.*T5"):  # a T5 file given as CLIP-G
        StableDiffusion3Pipeline.from_single_file(str(files["mmdit"]), config=str(folders[0]), clip_g=str(files["t5"]))


def test_load_pipeline_and_the_cli_tell_an_sd3_file_by_its_tensors(models, tmp_path):
    """`sdjax.load_pipeline(file, config=folder)` (what `sdjax generate --model FILE --config FOLDER` calls) picks
    SD 3 from the file's tensor names, as it picks Flux.1 (`families.FAMILIES` rows' `single_file`); without the
    folder it is refused naming the file and what to give."""
    from PIL import Image
    from typer.testing import CliRunner

    from sdjax import cli, infotext
    from sdjax.families import family_of_file
    from sdjax.pipelines import load_pipeline

    folders, files = models
    assert family_of_file(str(files["all"])).name == "sd3"
    assert family_of_file(str(files["mmdit"])).name == "sd3"
    assert family_of_file(str(files["t5"])) is None  # an encoder file is no model
    with pytest.raises(
        ValueError, match=r"sd3_tiny\.safetensors: a Stable Diffusion 3 / 3\.5 transformer file.*config="
    ):
        load_pipeline(str(files["all"]))
    pipe, params = load_pipeline(str(files["all"]), config=str(folders[0]))
    assert isinstance(pipe, StableDiffusion3Pipeline)
    want = _image(*StableDiffusion3Pipeline.from_pretrained(str(folders[1])))
    assert np.abs(_image(pipe, params) - want).max() <= 1e-6
    args = [
        "generate",
        "a cat",
        "--model",
        str(files["all"]),
        "--steps",
        "2",
        "--width",
        str(SIZE),
        "--height",
        str(SIZE),
    ]
    ok = CliRunner().invoke(cli.app, [*args, "--config", str(folders[0]), "--out", str(tmp_path / "b")])
    assert ok.exit_code == 0, ok.output
    (png,) = (tmp_path / "b").glob("*.png")
    with Image.open(png) as im:  # the CLI's default CFG scale is the family's (7), not the UNet families' 7.5
        assert float(infotext.parse_parameters(im.info["parameters"])["CFG scale"]) == 7.0
    # the MMDiT alone with the encoders as separate files (--clip-l, --clip-g, --t5): the same image as the folder
    separate = ["--clip-l", str(files["clip_l"]), "--clip-g", str(files["clip_g"]), "--t5", str(files["t5"])]
    args[3] = str(files["mmdit"])
    for out, extra in (("c", []), ("d", separate)):
        ok = CliRunner().invoke(cli.app, [*args, "--config", str(folders[1]), *extra, "--out", str(tmp_path / out)])
        assert ok.exit_code == 0, ok.output
    (c,), (d,) = (sorted((tmp_path / out).glob("*.png")) for out in "cd")
    assert c.read_bytes() == d.read_bytes()
    # an encoder file the family does not take is refused by name
    flux = tmp_path / "flux1-tiny.safetensors"
    names = ("img_in.weight", "double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight")
    write(flux, {k: torch.zeros(4, 4) for k in names})
    with pytest.raises(ValueError, match=r"clip_g=.*clip_g\.safetensors.*Flux\.1 model has no such encoder file"):
        load_pipeline(str(flux), config=str(folders[0]), clip_g=str(files["clip_g"]))
