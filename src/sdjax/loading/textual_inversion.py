"""Textual-inversion embeddings (Gal et al. 2022, "An Image is Worth One Word") from `.safetensors` files.

An embedding is one or more new token vectors for a text encoder's token-embedding table. The files read here:

- A1111 / kohya: `emb_params` `(n, D)`; the trigger word is the file's stem (A1111 names embeddings by file).
- SDXL (A1111 / kohya): `clip_l` `(n, 768)` for `text_encoder` and `clip_g` `(n, 1280)` for `text_encoder_2`.
- diffusers `learned_embeds.safetensors`: one entry `{token: (D,) or (n, D)}`; the trigger word is its key.
- `torch.save` pickles (`.pt`, `.bin`; A1111's `{"string_to_param": {"*": (n, D)}, ...}`, trigger: the file's
  stem, or one of the layouts above), only with `allow_pickle=True`, read by `safe_pickle`'s restricted unpickler.

`token=` overrides the trigger word. A multi-vector embedding (n > 1) becomes the tokens `token, token_1, ...,
token_{n-1}`, and a prompt's `token` is expanded to all of them, as diffusers' `load_textual_inversion` and
`maybe_convert_prompt` do. `add_to_encoder` appends the rows to a text encoder's params; the pipeline side
(tokenizer, module config) is `pipelines.textual_inversion`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.loading import files, safe_pickle

SDXL_KEYS = {"clip_l": "text_encoder", "clip_g": "text_encoder_2"}


class TextualInversionError(ValueError):
    """An embedding file that cannot be used with this model (names the file)."""


@dataclasses.dataclass(frozen=True)
class Embedding:
    """`vectors` `(n, D)` float32 per text-encoder component, triggered by `token`."""

    token: str
    vectors: Mapping[str, np.ndarray]
    source: str

    @property
    def num_vectors(self) -> int:
        return int(next(iter(self.vectors.values())).shape[0])

    @property
    def tokens(self) -> list[str]:
        """The tokens added for it: `token`, then `token_1` ... for the other vectors."""
        return [self.token] + [f"{self.token}_{i}" for i in range(1, self.num_vectors)]


def _read_pickle(path: Path, allow_pickle: bool) -> dict[str, Any]:
    if path.suffix not in (".pt", ".bin", ".pth"):
        raise TextualInversionError(f"{path}: embeddings are .safetensors (or .pt / .bin pickles), not {path.suffix!r}")
    if not allow_pickle:
        raise TextualInversionError(
            f"{path}: a pickled embedding; pass allow_pickle=True to read it with sdjax's restricted unpickler (it "
            f"runs no code), or convert it to safetensors"
        )
    try:
        obj = safe_pickle.read_torch_object(path)
    except (safe_pickle.PickleFormatError, safe_pickle.UnsafePickleError) as e:
        raise TextualInversionError(str(e)) from e
    if isinstance(obj, np.ndarray):  # a bare tensor
        return {"emb_params": obj}
    if isinstance(obj, dict) and isinstance(obj.get("string_to_param"), dict) and "*" in obj["string_to_param"]:
        return {"emb_params": obj["string_to_param"]["*"]}  # A1111
    if isinstance(obj, dict) and all(isinstance(v, np.ndarray) for v in obj.values()):
        return obj
    raise TextualInversionError(f"{path}: not a textual-inversion embedding (a {type(obj).__name__})")


def read_embedding(path: str | Path, *, token: str | None = None, allow_pickle: bool = False) -> Embedding:
    """Read an embedding file (see the module docstring); `vectors` keyed by the component they belong to."""
    path = Path(path)
    if not path.is_file():
        raise TextualInversionError(f"textual-inversion embedding not found: {path}")
    if path.suffix == ".safetensors":
        tensors: Mapping[str, Any] = files.read_safetensors(path)
    else:
        tensors = _read_pickle(path, allow_pickle)
    keys = sorted(tensors)
    if "emb_params" in tensors:
        vectors, default = {"text_encoder": tensors["emb_params"]}, path.stem
    elif set(SDXL_KEYS) & set(keys):
        if set(keys) != set(SDXL_KEYS):
            raise TextualInversionError(f"{path}: an SDXL embedding needs both clip_l and clip_g; it has {keys}")
        vectors, default = {SDXL_KEYS[k]: tensors[k] for k in keys}, path.stem
    elif len(keys) == 1:
        vectors, default = {"text_encoder": tensors[keys[0]]}, keys[0]
    else:
        raise TextualInversionError(
            f"{path}: not a textual-inversion embedding: expected emb_params (A1111), clip_l + clip_g (SDXL) or one "
            f"{{token: tensor}} entry (diffusers); found {len(keys)} keys such as {keys[:5]}"
        )
    out: dict[str, np.ndarray] = {}
    for component, value in vectors.items():
        v = np.asarray(value, np.float32)
        v = v[None] if v.ndim == 1 else v
        if v.ndim != 2 or v.shape[0] < 1:
            raise TextualInversionError(f"{path}: embedding for {component} has shape {value.shape}; want (n, D)")
        out[component] = v
    if len({v.shape[0] for v in out.values()}) > 1:
        raise TextualInversionError(f"{path}: clip_l and clip_g hold different numbers of vectors")
    token = default if token is None else token
    if not isinstance(token, str) or not token.strip() or token != token.strip():
        raise TextualInversionError(f"{path}: token={token!r} must be a non-empty word without surrounding spaces")
    return Embedding(token=token, vectors=out, source=str(path))


def check_fits(embedding: Embedding, hidden_sizes: Mapping[str, int]) -> None:
    """Every component the embedding needs exists and has its width; raises naming the file otherwise."""
    absent = sorted(set(embedding.vectors) - set(hidden_sizes))
    if absent:
        raise TextualInversionError(
            f"{embedding.source}: the embedding is for {', '.join(sorted(embedding.vectors))}, but this model's text "
            f"encoders are {', '.join(sorted(hidden_sizes))}; it was made for another base model"
        )
    if (
        "text_encoder" in hidden_sizes
        and "text_encoder_2" in hidden_sizes
        and set(embedding.vectors) != set(hidden_sizes)
    ):
        raise TextualInversionError(
            f"{embedding.source}: an SDXL model needs an embedding with clip_l and clip_g (one per text encoder); "
            f"this one has a single vector set (an SD 1.x/2.x embedding?)"
        )
    for component, v in embedding.vectors.items():
        if v.shape[1] != hidden_sizes[component]:
            raise TextualInversionError(
                f"{embedding.source}: vectors of width {v.shape[1]} for {component}, whose token embeddings have "
                f"width {hidden_sizes[component]}; the embedding was made for another base model"
            )


TOKEN_EMBEDDING = ("text_model", "embeddings", "token_embedding", "embedding")


def add_to_encoder(params: Mapping[str, Any], rows: np.ndarray) -> dict[str, Any]:
    """A text encoder's params with `rows` `(n, D)` appended to its token-embedding table (a new dict; the table
    keeps its dtype and device)."""
    node = params
    for k in TOKEN_EMBEDDING[:-1]:
        node = node[k]
    table = node[TOKEN_EMBEDDING[-1]]
    if isinstance(table, jax.Array):
        grown = jnp.concatenate([table, jax.device_put(jnp.asarray(rows, table.dtype), table.sharding)])
    else:
        grown = np.concatenate([np.asarray(table), rows.astype(np.asarray(table).dtype)])
    return _replace(params, TOKEN_EMBEDDING, grown)


def _replace(tree: Mapping[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = dict(tree)
    out[path[0]] = value if len(path) == 1 else _replace(tree[path[0]], path[1:], value)
    return out
