"""Abstract params trees kept on disk, so that a new process loads a model without tracing it again.

A model's `init_params_shape(config)` traces its Flax `init` under `jax.eval_shape`: on 2 CPU cores about 3 s for
SD 1.5's three models and 5-7 s for SDXL's four, against ~0.02 s to read them back. `cached(model_cls, config,
trace)` returns what `trace()` returns, read from a JSON file when an earlier process wrote one under the same key:

- the model class (module and name) and every field of its config dataclass (`repr`),
- the sha256 of the source of the model's module and of every sdjax module it imports, transitively, lazy imports
  included (found by reading the source text, so a docstring naming a module only widens the set),
- the jax, jaxlib and flax versions and `jax_enable_x64`.

So editing a model, a layer it uses, or upgrading flax changes the key and the tree is traced again; files of old
keys stay behind (a few hundred KiB at most) and are never read. A file that cannot be read, does not parse, or holds
another key is ignored and written again; writes go to a temporary file moved into place, so a reader never sees
half a file. A tree that does not survive the round trip exactly (a leaf that is not a plain `ShapeDtypeStruct`,
a container other than a dict) is returned as traced and not written.

Where: `$SDJAX_SHAPE_CACHE` if set (`0` / `off` / `false` / `no` turn the cache off), else
`$XDG_CACHE_HOME/sdjax/shapes`, else `~/.cache/sdjax/shapes`. A folder that cannot be created or written turns the
cache off for that call, with a debug log line; loading never fails because of it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

logger = logging.getLogger(__name__)

ENV = "SDJAX_SHAPE_CACHE"
FORMAT = 1  # bumped when the file layout changes
_OFF = {"0", "off", "false", "no"}
_PACKAGE = Path(__file__).resolve().parents[1]  # src/sdjax
_FROM = re.compile(r"^\s*from\s+(sdjax(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]*)", re.MULTILINE)
_IMPORT = re.compile(r"^\s*import\s+(sdjax(?:\.\w+)*)", re.MULTILINE)


def cache_dir() -> Path | None:
    """The folder the trees are kept in, or None when `$SDJAX_SHAPE_CACHE` turns the cache off."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF else Path(value).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "sdjax" / "shapes"


def _module_file(name: str) -> Path | None:
    """The source file of sdjax module `name` (a package's `__init__.py`), or None if there is none."""
    rel = Path(*name.split(".")[1:])
    for candidate in (_PACKAGE / rel.with_suffix(".py"), _PACKAGE / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(text: str) -> set[str]:
    """The sdjax modules a source text imports (`from sdjax.a import b` also yields `sdjax.a.b` where b is one)."""
    names = set(_IMPORT.findall(text))
    for package, what in _FROM.findall(text):
        names.add(package)
        for item in what.strip("()").replace("\n", " ").split(","):
            item = item.split("#")[0].strip().split(" as ")[0].strip()
            if item.isidentifier():
                names.add(f"{package}.{item}")
    return names


@functools.cache
def source_digest(module: str) -> str | None:
    """sha256 over the source of `module` and of the sdjax modules it imports, transitively; None when `module`
    has no source file (defined interactively)."""
    first = getattr(sys.modules.get(module), "__file__", None)
    if first is None:
        return None
    todo, seen, files = [Path(first).resolve()], set(), []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_bytes()
        files.append((path, text))
        for name in _imported(text.decode("utf-8", "replace")):
            found = _module_file(name)
            if found is not None:
                todo.append(found)
    h = hashlib.sha256()
    for path, text in sorted(files):
        rel = path.relative_to(_PACKAGE).as_posix() if path.is_relative_to(_PACKAGE) else path.name
        h.update(f"{rel}\0{len(text)}\0".encode())
        h.update(text)
    return h.hexdigest()


def cache_key(model_cls: type, config: Any) -> dict | None:
    """What the tree of `model_cls` built from `config` depends on (module doc), or None when that cannot be told
    (a config that is not a dataclass, a model without a source file): such trees are not cached."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return None
    source = source_digest(model_cls.__module__)
    if source is None:
        return None
    fields = {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config)}
    return {
        "format": FORMAT,
        "model": f"{model_cls.__module__}.{model_cls.__qualname__}",
        "config": f"{type(config).__module__}.{type(config).__qualname__}",
        "fields": fields,
        "source": source,
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__,  # jaxlib comes with jax: not a dependency of its own
        "flax": flax.__version__,
        "x64": bool(jax.config.jax_enable_x64),
    }


def _encode(tree: Any) -> list | None:
    """The leaves of a nested dict of `ShapeDtypeStruct`s as `[path, shape, dtype, weak_type]` rows, or None when
    the tree has anything else in it (it is then not cached)."""
    if not isinstance(tree, dict):
        return None
    rows = []
    for path, leaf in flatten_dict(tree).items():
        if type(leaf) is not jax.ShapeDtypeStruct or leaf.sharding is not None:
            return None
        if not all(isinstance(p, str) for p in path):
            return None
        rows.append([list(path), list(leaf.shape), jnp.dtype(leaf.dtype).name, bool(leaf.weak_type)])
    return rows


def _decode(rows: list) -> dict:
    return unflatten_dict(
        {
            tuple(path): jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), weak_type=weak)
            for path, shape, dtype, weak in rows
        }
    )


def _same(a: Any, b: Any) -> bool:
    """Equal trees: same structure (dict key order aside, as jax sorts it), same paths, shapes, dtypes, weak types."""
    fa, fb = flatten_dict(a), flatten_dict(b)
    if fa.keys() != fb.keys() or jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):
        return False
    return all(
        x.shape == fb[k].shape and x.dtype == fb[k].dtype and x.weak_type == fb[k].weak_type for k, x in fa.items()
    )


def file_for(model_cls: type, key: dict, folder: Path) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return folder / f"{model_cls.__name__}-{digest}.json"


def _read(path: Path, key: dict) -> dict | None:
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            return None
        return _decode(data["leaves"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:  # corrupt or foreign: traced and written again
        logger.debug("shape cache: ignoring %s (%s: %s)", path, type(e).__name__, e)
        return None


def _write(path: Path, key: dict, rows: list) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "leaves": rows}, f, separators=(",", ":"))
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        logger.debug("shape cache: cannot write %s (%s)", path, e)


def cached(model_cls: type, config: Any, trace: Callable[[], Any]) -> Any:
    """`trace()` (the abstract params tree of `model_cls` built from `config`), read from disk when a file of the
    same key exists, else traced and written (module doc). Each call returns a new tree."""
    folder = cache_dir()
    key = None if folder is None else cache_key(model_cls, config)
    if key is None:
        return trace()
    path = file_for(model_cls, key, folder)
    tree = _read(path, key)
    if tree is not None:
        return tree
    tree = trace()
    rows = _encode(tree)
    if rows is not None and _same(_decode(rows), tree):
        _write(path, key, rows)
    return tree
