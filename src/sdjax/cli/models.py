"""The weight options of `sdjax generate` (`--models-dir`, `--model`, `--vae`, `--embedding`, `--lora`,
`<lora:...>` prompt tags, `--clip-skip`) resolved to files before any model loads, as AUTOMATIC1111 users name them.

Each option takes a path (a file or folder that exists wins) or a name in the models directory
(`sdjax.models_dir`); `--model` and `--vae` also take a Hugging Face Hub id. A name that is not found, or that would
leave the directory, is a usage error (exit 2) naming the option, with close matches.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import typer

from sdjax.models_dir import HashCache, ModelsDir

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclasses.dataclass(frozen=True)
class Weights:
    """What `generate` loads and what its infotext says about it."""

    model: str | None  # a folder, file or Hub id for `load_pipeline`; None: the embedded model
    model_label: str | None  # infotext "Model" (None: `infotext.model_label(model)`)
    model_file: Path | None  # a single-file checkpoint (hashed for "Model hash")
    vae: str | None
    vae_label: str  # infotext "VAE": A1111 writes the VAE's file name
    embeddings: tuple[Path, ...]
    loras: tuple[tuple[Path, float | tuple[float, float]], ...]  # (file, scale): --lora options and prompt tags
    tags: tuple[
        tuple[str, float | tuple[float, float]], ...
    ]  # the prompt's <lora:name:w> tags (they stay in the infotext)
    tag_files: tuple[tuple[str, Path], ...] = ()  # (tag name, file) for the infotext's "Lora hashes"


def open_models_dir(models_dir: Path | None) -> ModelsDir | None:
    if models_dir is None:
        return None
    try:
        return ModelsDir(models_dir)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--models-dir") from None


def parse_lora_spec(spec: str) -> tuple[str, float]:
    """`NAME_OR_FILE[:SCALE]` -> (name, scale); a path holding ':' (C:\\...) without a scale keeps its colon."""
    name, sep, scale = spec.rpartition(":")
    if not sep or not name:
        return spec, 1.0
    try:
        return name, float(scale)
    except ValueError:
        return spec, 1.0


def _existing(text: str) -> Path | None:
    p = Path(text).expanduser()
    return p if p.exists() else None


def _from_dir(md: ModelsDir | None, kind: str, name: str, option: str) -> Path | None:
    """The entry's path; None when there is no models directory (or it has no folder of `kind`)."""
    if md is None or md.folder(kind) is None:
        return None
    try:
        return md.resolve(kind, name).path
    except (ValueError, LookupError) as e:
        raise typer.BadParameter(str(e.args[0] if e.args else e), param_hint=option) from None


def resolve_model(md: ModelsDir | None, model: str | None) -> tuple[str | None, str | None, Path | None]:
    """`--model` -> (what to load, infotext label or None, single file or None)."""
    if model is None:
        return None, None, None
    from sdjax.models.presets import ALIASES

    path = _existing(model)
    if path is None and md is not None and model not in ALIASES:
        try:
            entry = md.resolve("checkpoint", model)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--model") from None
        except LookupError as e:
            folder = md.folder("checkpoint")
            first = model.replace("\\", "/").split("/")[0]
            if _HUB_ID.match(model) and folder is not None and not (folder / first).is_dir():
                return model, None, None  # a Hub id
            raise typer.BadParameter(str(e.args[0]), param_hint="--model") from None
        label = entry.name if entry.is_folder else entry.short_name
        return str(entry.path), label.rsplit("/", 1)[-1], None if entry.is_folder else entry.path
    if path is not None and path.is_file():
        return model, None, path
    return model, None, None


def resolve_vae(md: ModelsDir | None, vae: str | None) -> tuple[str | None, str]:
    """`--vae` -> (what to load, infotext "VAE")."""
    if vae is None:
        return None, ""
    path = _existing(vae) or _from_dir(md, "vae", vae, "--vae")
    if path is not None:
        return str(path), path.name
    if _HUB_ID.match(vae):
        return vae, vae
    where = "" if md is not None else " (names are looked up with --models-dir)"
    raise typer.BadParameter(f"no VAE file or folder {vae!r}{where}", param_hint="--vae")


def resolve_embedding(md: ModelsDir | None, name: str) -> Path:
    path = _existing(name) or _from_dir(md, "embedding", name, "--embedding")
    if path is None or not path.is_file():
        where = "" if md is not None else " (names are looked up with --models-dir)"
        raise typer.BadParameter(f"no embedding file {name!r}{where}", param_hint="--embedding")
    return path


def resolve_lora(md: ModelsDir | None, lora_dir: Path | None, name: str, option: str) -> Path:
    """A LoRA file from a path, `--lora-dir` or the models directory's `Lora/`."""
    from sdjax.loading import lora as lora_lib

    path = _existing(name)
    if path is None and lora_dir is not None:
        found = [c for c in (lora_dir / f"{name}.safetensors", lora_dir / name) if c.is_file()]
        path = found[0] if found else None
    if path is None and md is not None and md.folder("lora") is not None:
        return _from_dir(md, "lora", name, option)
    try:
        return lora_lib.resolve_lora_path(path or name, ())
    except lora_lib.LoraError as e:
        where = [str(d) for d in (lora_dir, md and md.folder("lora")) if d]
        raise typer.BadParameter(f"{e}{f'; looked in {where}' if where else ''}", param_hint=option) from None


def take_lora_tags(text: str, hint: str) -> list[tuple[str, float | tuple[float, float]]]:
    """A1111's `<lora:name:weight>` / `<lora:name:te:unet>` tags of a prompt -> (name, scale) (the prompt keeps
    them); other tags are refused."""
    from sdjax.text import prompt_syntax

    try:
        _, tags = prompt_syntax.extract_networks(text or "")
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=hint) from None
    other = [t for t in tags if t.kind != "lora"]
    if other:
        raise typer.BadParameter(f"<{other[0].kind}:{other[0].name}>: only LoRA tags are supported", param_hint=hint)
    return [(t.name, t.lora_scale) for t in tags]


def resolve_weights(
    *,
    models_dir: Path | None,
    model: str | None,
    vae: str | None,
    embeddings: list[str] | None,
    loras: list[str] | None,
    lora_dir: Path | None,
    prompt: str,
    negative_prompt: str,
    a1111_syntax: bool,
) -> Weights:
    """Every weight option of `generate` resolved and checked (exit 2 naming the option) before anything loads."""
    if lora_dir is not None and not lora_dir.is_dir():
        raise typer.BadParameter(f"{lora_dir} is not a folder", param_hint="--lora-dir")
    md = open_models_dir(models_dir)
    target, label, model_file = resolve_model(md, model)
    vae_target, vae_label = resolve_vae(md, vae)
    files = tuple(resolve_embedding(md, e) for e in embeddings or ())
    specs = [(*parse_lora_spec(s), "--lora") for s in loras or ()]
    tags: list[tuple[str, float | tuple[float, float]]] = []
    if a1111_syntax:
        for text, hint in ((prompt, "PROMPT"), (negative_prompt, "--negative-prompt")):
            found = take_lora_tags(text, hint)
            tags += found
            specs += [(name, w, hint) for name, w in found]
    lora_files = tuple((resolve_lora(md, lora_dir, name, option), scale) for name, scale, option in specs)
    tag_files = tuple((name, path) for (name, _, option), (path, _) in zip(specs, lora_files) if option != "--lora")
    return Weights(target, label, model_file, vae_target, vae_label, files, lora_files, tuple(tags), tag_files)


def model_hash(weights: Weights, hashes: HashCache | None = None) -> str:
    """A1111's "Model hash" of a single-file checkpoint (the first 10 hex digits of its SHA-256); "" otherwise."""
    if weights.model_file is None:
        return ""
    return (hashes or HashCache()).sha256(weights.model_file)[:10]


def check_clip_skip(pipe, clip_skip: int) -> None:
    """`--clip-skip` against the model's text encoder(s): 1 (the last layer) up to their number of layers."""
    layers = [
        enc.config.num_hidden_layers
        for enc in (getattr(pipe, "text_encoder", None), getattr(pipe, "text_encoder_2", None))
        if enc is not None and hasattr(enc.config, "num_hidden_layers")  # CLIP towers (not Flux's T5)
    ]
    if layers and not 1 <= clip_skip <= min(layers):
        raise typer.BadParameter(
            f"{clip_skip} is outside 1..{min(layers)} (1: the last layer; this text encoder has {min(layers)})",
            param_hint="--clip-skip",
        )
