"""Model configs: frozen dataclasses whose fields are exactly the diffusers/transformers `config.json` keys.

`config_from_dict` builds one from a parsed `config.json`. Keys the dataclass does not know are reported by
name: bookkeeping keys written by the libraries themselves (`_class_name`, `_diffusers_version`, ...) are
dropped quietly, every other unknown key raises, because a key we ignore is an architecture we get wrong.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# Keys that describe how a file was written, not the architecture.
BOOKKEEPING_KEYS = frozenset(
    {
        "_class_name",
        "_diffusers_version",
        "_name_or_path",
        "_commit_hash",
        "_use_default_values",
        "transformers_version",
        "architectures",
        "model_type",
        "torch_dtype",
        "dtype",
    }
)


class ConfigError(ValueError):
    """A config file that does not describe a model sdjax can build."""


def config_from_dict(cls: type[T], raw: dict[str, Any], *, source: str, ignore: frozenset[str] = frozenset()) -> T:
    """Build the frozen config `cls` from `raw`, naming `source` (a file or component) in every error.

    Lists become tuples so configs stay hashable (they are static arguments under `jit`). `ignore` names
    keys this model accepts but does not use (documented at the call site).
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in raw if k not in fields and k not in BOOKKEEPING_KEYS and k not in ignore)
    if unknown:
        raise ConfigError(
            f"{source}: unknown config key(s) {unknown} for {cls.__name__}; sdjax does not build "
            f"this architecture (known keys: {sorted(fields)})"
        )
    kwargs = {k: _freeze(v) for k, v in raw.items() if k in fields}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: invalid config for {cls.__name__}: {e}") from e


def read_json(path: str | Path) -> dict[str, Any]:
    """Read a JSON file, naming it in the error when it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value
