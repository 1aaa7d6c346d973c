"""A base install (`pip install sdjax`, no extras) gives a working command line, and every third-party package the
base modules import is a declared base dependency."""

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Packages that only optional extras (or the tests) bring in: a base install must work without them (pydantic
# is not among them: typer itself depends on it).
NOT_IN_BASE = [
    "fastapi",
    "uvicorn",
    "starlette",
    "prometheus_client",
    "optax",
    "torch",
    "diffusers",
    "transformers",
    "cv2",
    "ray",
    "libtpu",
]

SCRIPT = textwrap.dedent("""
    import importlib.abc, importlib.metadata, json, sys

    BLOCKED = set(json.loads(sys.argv[1]))

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked: not a base dependency)")
            return None

    sys.meta_path.insert(0, Block())
    import sdjax, sdjax.cli, sdjax.core, sdjax.loading, sdjax.pipelines, sdjax.samplers  # noqa: E401
    from typer.testing import CliRunner

    runner = CliRunner()
    results = {args: runner.invoke(sdjax.cli.app, args.split()) for args in
               ("--help", "generate --help", "pnginfo --help", "serve")}
    dists = importlib.metadata.packages_distributions()
    used = sorted({d for m in list(sys.modules) for d in dists.get(m.split(".")[0], []) if "." not in m})
    print(json.dumps({"codes": {k: r.exit_code for k, r in results.items()},
                      "serve": results["serve"].output, "used": used}))
""")


def _run():
    import json

    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(NOT_IN_BASE)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_works_without_extras_and_serve_says_what_to_install():
    out = _run()
    assert out["codes"]["--help"] == 0 and out["codes"]["generate --help"] == 0 and out["codes"]["pnginfo --help"] == 0
    assert out["codes"]["serve"] == 2
    assert "pip install 'sdjax[serve]'" in out["serve"]


def _module_level_imports(path: Path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:  # module level only: imports inside functions serve optional features
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_module_level_import_of_the_base_modules_is_a_base_dependency():
    """Static check: what `src/sdjax` imports at module level (outside the server and training packages, which
    belong to the `serve` and `train` extras) is the standard library, sdjax, or a declared base dependency."""
    import importlib.metadata
    import re

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in declared}
    dists = importlib.metadata.packages_distributions()
    undeclared = {}
    for path in (ROOT / "src" / "sdjax").rglob("*.py"):
        rel = path.relative_to(ROOT / "src" / "sdjax").parts
        if rel[0] in ("server", "training") or (rel[0] == "finetune" and rel[-1] != "cli.py"):  # `train` extra
            continue
        for mod in _module_level_imports(path):
            if mod in sys.stdlib_module_names or mod in ("sdjax", "__future__"):
                continue
            found = {d.lower().replace("_", "-") for d in dists.get(mod, [mod])}
            if not found & names:
                undeclared.setdefault(mod, []).append("/".join(rel))
    assert not undeclared, f"imported at module level but not a base dependency: {undeclared}"
