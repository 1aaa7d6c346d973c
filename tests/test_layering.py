"""The layout shows the architecture: lower layers never import upper ones, and no import cycle exists between
sdjax's modules (module-level imports; lazy imports inside functions may only reach downwards or sideways)."""

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "sdjax"

# Layer of each top-level module or package of sdjax (lower imports nothing higher).
LAYERS = {
    "config": 0,
    "rng": 0,
    "precision": 0,
    "policy": 0,  # the faces' (A1111) defaults, apart from diffusers' per-pipeline ones
    "quant": 1,  # weight quantization: a params transformation and a module wrapper (jax, flax, qwix)
    "runtime": 0,
    "compilation_cache": 0,
    "isolated": 0,
    "ops": 1,
    "models": 2,
    "samplers": 2,
    "text": 2,
    "preprocess": 2,
    "loading": 3,
    "parallel": 3,
    "core": 4,
    # model families: a folder each (conditioning, denoiser adapter, pipeline); they build on the core and loading
    "families": 5,
    "pipelines": 5,
    "planning": 5,  # the task planner (core tasks + policy), which the pipelines and metadata call
    "metadata": 6,
    "infotext": 6,  # the A1111 text format and PNG chunk (metadata's requests write and read it)
    "models_dir": 6,
    "bench": 6,
    "aot": 6,
    "aot_report": 6,
    "finetune": 6,  # `sdjax train`: the CLI registers its sub-app; the runtime never imports it
    "cli": 7,
    "server": 7,
    "__init__": 8,
    # tooling outside the runtime path: may import the library, never imported by it
    "training": 9,
    "evaluation": 9,
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        name = "sdjax." + ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(path: Path, modules: dict[str, Path], *, module_level: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level else list(ast.walk(tree))
    deps = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("sdjax"):
            subs = {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
            deps |= subs if len(subs) == len(node.names) else {node.module} | subs
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name.startswith("sdjax")}
    return {d for d in deps if d in modules}


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    assert top in LAYERS, f"{module}: add its top-level name to LAYERS in this test"
    return LAYERS[top]


def test_no_module_imports_a_higher_layer():
    modules = _modules()
    bad = []
    for name, path in modules.items():
        if name == "sdjax":
            continue
        for dep in _imports(path, modules, module_level=False):
            if dep == "sdjax" or dep.split(".")[1] == name.split(".")[1]:
                continue
            if _layer(dep) > _layer(name):
                bad.append(f"{name} (layer {_layer(name)}) imports {dep} (layer {_layer(dep)})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(p, modules, module_level=True) - {m} for m, p in modules.items()}
    sys.setrecursionlimit(10000)
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
