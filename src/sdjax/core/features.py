"""The program's features (`protocols.Feature`): their checks, params and input arrays, in one place.

A program holds a tuple of features (`ProgramSpec.features`). Everything the generator does with them goes through
here, so that the generation, AOT compiles and the guide API treat any number of features alike:

- `check`: the features of one spec are `Feature`s with distinct names and distinct params keys;
- `params_keys` / `with_params`: the params entries the features read, and the params of a call with each
  request's params put under its feature's key;
- `example_inputs` / `request_inputs`: the features' input arrays (zeros for compiling ahead, or a call's own)
  merged into one dict. An input key is owned by one feature: a key given by two features, or by a feature and
  the program's own inputs (`taken`), is an error naming both, raised before anything is compiled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sdjax.core.protocols import Feature, FeatureRequest


def check(features: Sequence[Any]) -> tuple[Feature, ...]:
    """`features` as a tuple, each checked to be a `Feature` whose name and params key no other one has."""
    out = tuple(features)
    names: dict[str, int] = {}
    keys: dict[str, str] = {}
    for i, f in enumerate(out):
        if not isinstance(f, Feature):
            raise TypeError(
                f"features[{i}] is a {type(f).__name__}, not a core.protocols.Feature (it needs name, params_key, "
                f"hook and example_inputs)"
            )
        if not isinstance(f.name, str) or not f.name or not isinstance(f.params_key, str) or not f.params_key:
            raise ValueError(f"features[{i}]: name and params_key must be non-empty strings")
        if f.name in names:
            raise ValueError(f"two features are named {f.name!r} (features[{names[f.name]}] and features[{i}])")
        if f.params_key in keys:
            raise ValueError(
                f"features {keys[f.params_key]!r} and {f.name!r} both read params[{f.params_key!r}]: give each "
                f"feature its own params key"
            )
        names[f.name] = i
        keys[f.params_key] = f.name
    return out


def params_keys(features: Sequence[Feature], components: Sequence[str] = ()) -> tuple[str, ...]:
    """The params entries `features` read (in order); a key that is one of the model's `components` is refused
    (a feature's params are its own entry, never a model component's)."""
    out = []
    for f in features:
        if f.params_key in components:
            raise ValueError(
                f"the {f.name} feature's params_key {f.params_key!r} is a component of the model; a feature reads "
                f"its own params entry"
            )
        out.append(f.params_key)
    return tuple(out)


def with_params(params: dict, requests: Sequence[FeatureRequest]) -> dict:
    """`params` plus each request's params under its feature's key (a list is taken as a tuple, so that the
    program's params tree, and with it the compile key, does not depend on which sequence type a caller used)."""
    out = dict(params)
    for r in requests:
        p = r.params
        out[r.spec.params_key] = tuple(p) if isinstance(p, list) else p
    return out


def example_inputs(
    features: Sequence[Feature],
    *,
    batch: int,
    height: int,
    width: int,
    calls: int,
    taken: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The zero input arrays of `features` for a program of `batch` images of `height` x `width` and `calls` model
    calls, merged (see the module docstring for collisions with each other and with `taken`)."""
    parts = [(f.name, f.example_inputs(batch=batch, height=height, width=width, calls=calls)) for f in features]
    return _merge(parts, taken or {})


def request_inputs(
    features: Sequence[Feature],
    requests: Sequence[FeatureRequest],
    *,
    start: int,
    end: int,
    calls: int,
    taken: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The input arrays of one call's `requests`, which must be the program's `features` in order, for the window
    `[start, end)` of `calls` model calls, merged (see the module docstring)."""
    specs = tuple(r.spec for r in requests)
    if specs != tuple(features):
        raise ValueError(
            f"the feature requests {[s.name for s in specs]} are not the program's features "
            f"{[f.name for f in features]}"
        )
    return _merge([(r.spec.name, r.arrays(start=start, end=end, calls=calls)) for r in requests], taken or {})


def _merge(parts: Sequence[tuple[str, Mapping[str, Any]]], taken: Mapping[str, Any]) -> dict[str, Any]:
    owner: dict[str, str] = {}
    out: dict[str, Any] = {}
    for name, arrays in parts:
        for key, value in arrays.items():
            if key in taken:
                raise ValueError(
                    f"the {name} feature's input {key!r} is already one of the program's inputs; a feature's input "
                    f"arrays need keys of their own"
                )
            if key in owner:
                raise ValueError(
                    f"the features {owner[key]!r} and {name!r} both give the input {key!r}; a feature's input "
                    f"arrays need keys of their own"
                )
            owner[key] = name
            out[key] = value
    return out
