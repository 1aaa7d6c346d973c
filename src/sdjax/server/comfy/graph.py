"""An API-format ComfyUI workflow, parsed and checked before anything runs.

The body of `POST /prompt` is `{"prompt": {node_id: {"class_type", "inputs", "_meta"?}}, "client_id"?,
"extra_data"?, "front"?, "number"?}`. An input is a widget value or a link `[node_id, output_index]`. `parse`
checks what ComfyUI's `execution.validate_prompt` checks, in its error shape (HTTP 400)::

    {"error": {"type", "message", "details", "extra_info"},
     "node_errors": {node_id: {"errors": [{"type", "message", "details", "extra_info"}], "dependent_outputs": [...],
                               "class_type": ...}}}

with ComfyUI's error types (`invalid_prompt`, `prompt_no_outputs`, `prompt_outputs_failed_validation`;
per input `required_input_missing`, `bad_linked_input`, `return_type_mismatch`, `invalid_input_type`,
`value_not_in_list`, `value_smaller_than_min`, `value_bigger_than_max`) and one of sdjax's: `dependency_cycle` (ComfyUI
finds a cycle only while executing). A class_type sdjax does not run is `invalid_prompt` naming it, with a node
error of type `node_not_supported`. Unlike ComfyUI, a workflow with any invalid output is refused as a whole
(ComfyUI runs the valid outputs and reports the others): nothing is skipped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from sdjax.server.comfy import preview
from sdjax.server.comfy.defs import NODES, Dynamic, NodeDef

LINK_TYPES = frozenset(
    {"MODEL", "CLIP", "VAE", "CONDITIONING", "LATENT", "IMAGE", "MASK", "CONTROL_NET", "NOISE", "GUIDER", "SAMPLER",
     "SIGMAS"}
)  # fmt: skip


def error_item(kind: str, message: str, details: str = "", **extra: Any) -> dict[str, Any]:
    if "received_value" in extra:
        extra["received_value"] = _echo(extra["received_value"])
    return {"type": kind, "message": message, "details": details, "extra_info": extra}


def _echo(value: Any) -> Any:
    """A received value as strict JSON can carry it back (Infinity and NaN are read, not written), cut to 200
    characters."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)[:200]
    return value if len(text) <= 200 else text[:200]


class PromptError(Exception):
    """A workflow refused before it runs: `body()` is ComfyUI's 400 body."""

    def __init__(self, error: dict[str, Any], node_errors: dict[str, Any] | None = None):
        super().__init__(error["message"])
        self.error = error
        self.node_errors = node_errors or {}

    def body(self) -> dict[str, Any]:
        return {"error": self.error, "node_errors": self.node_errors}


class NodeError(Exception):
    """One node's input cannot run here (raised while planning; collected into `node_errors`)."""

    def __init__(self, node_id: str, kind: str, message: str, input_name: str | None = None, details: str = ""):
        super().__init__(message)
        self.node_id = node_id
        extra = {"input_name": input_name} if input_name else {}
        self.item = error_item(kind, message, details or (input_name or ""), **extra)


def failed_validation(graph: Graph, errors: dict[str, list[dict]]) -> PromptError:
    """`prompt_outputs_failed_validation` with each failing node's errors and the outputs depending on it."""
    node_errors = {}
    for node_id, items in errors.items():
        node_errors[node_id] = {
            "errors": items,
            "dependent_outputs": [o for o in graph.outputs if node_id in graph.upstream(o)],
            "class_type": graph.nodes[node_id].class_type if node_id in graph.nodes else None,
        }
    details = "; ".join(f"{nid}: {items[0]['message']}" for nid, items in errors.items())
    return PromptError(
        error_item("prompt_outputs_failed_validation", "Prompt outputs failed validation", details), node_errors
    )


@dataclasses.dataclass
class Node:
    id: str
    class_type: str
    inputs: dict[str, Any]  # widget values (checked, converted) and links (node_id, output_index)
    title: str = ""

    @property
    def spec(self) -> NodeDef:
        return NODES[self.class_type]

    def link(self, name: str) -> tuple[str, int] | None:
        value = self.inputs.get(name)
        return value if isinstance(value, tuple) else None


@dataclasses.dataclass
class Graph:
    nodes: dict[str, Node]
    outputs: list[str]  # output node ids, in the workflow's order
    client_id: str | None = None
    extra_data: dict[str, Any] = dataclasses.field(default_factory=dict)
    raw: dict[str, Any] = dataclasses.field(default_factory=dict)  # the prompt as sent (for /history, the PNGs)

    def upstream(self, node_id: str) -> list[str]:
        """`node_id` and every node it depends on, dependencies first (a topological order)."""
        seen: dict[str, None] = {}
        visiting: set[str] = set()
        stack = [(node_id, False)]
        while stack:
            nid, expanded = stack.pop()
            if nid in seen or nid not in self.nodes:
                continue
            if expanded:
                seen[nid] = None
                continue
            if nid in visiting:  # a cycle (reported by parse)
                continue
            visiting.add(nid)
            stack.append((nid, True))
            stack.extend((d, False) for d in reversed(_deps(self, nid)))
        return list(seen)


def _invalid(message: str, details: str = "") -> PromptError:
    return PromptError(error_item("invalid_prompt", message, details))


def parse(body: Any) -> Graph:
    """The checked workflow of a `POST /prompt` body; raises `PromptError` (see the module docstring)."""
    if not isinstance(body, dict):
        raise _invalid("the body must be a JSON object with a 'prompt'", type(body).__name__)
    prompt = body.get("prompt")
    if not isinstance(prompt, dict) or not prompt:
        raise _invalid("'prompt' must be a non-empty object of nodes {id: {class_type, inputs}} (API format)")
    client_id = body.get("client_id")
    if client_id is not None and not isinstance(client_id, str):
        raise _invalid("'client_id' must be a string")
    extra = body.get("extra_data") or {}
    if not isinstance(extra, dict):
        raise _invalid("'extra_data' must be an object")
    if (problem := preview.check_method(extra)) is not None:
        raise _invalid(problem)
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str):
            raise _invalid(f"node {node_id!r} has no 'class_type'", f"Node ID '#{node_id}'")
        if not isinstance(node.get("inputs", {}), dict):
            raise _invalid(f"node {node_id!r}: 'inputs' must be an object", f"Node ID '#{node_id}'")
    unknown = {nid: n["class_type"] for nid, n in prompt.items() if n["class_type"] not in NODES}
    if unknown:
        nid, ct = next(iter(unknown.items()))
        node_errors = {
            i: {
                "errors": [
                    error_item(
                        "node_not_supported",
                        f"sdjax does not run {c!r} nodes",
                        f"Node ID '#{i}'",
                        supported=sorted(NODES),
                    )
                ],
                "dependent_outputs": [],
                "class_type": c,
            }
            for i, c in unknown.items()
        }
        raise PromptError(
            error_item("invalid_prompt", f"Cannot execute because node {ct} does not exist.", f"Node ID '#{nid}'"),
            node_errors,
        )
    graph = Graph({}, [], client_id, extra, prompt)
    errors: dict[str, list[dict]] = {}
    for node_id, raw in prompt.items():
        node, items = _check_node(str(node_id), raw, prompt)
        graph.nodes[str(node_id)] = node
        if items:
            errors[str(node_id)] = items
    graph.outputs = [nid for nid, n in graph.nodes.items() if n.spec.output_node]
    if not graph.outputs:
        raise PromptError(error_item("prompt_no_outputs", "Prompt has no outputs", "add a SaveImage or PreviewImage"))
    for nid in _cycle(graph):
        errors.setdefault(nid, []).append(
            error_item("dependency_cycle", "the node depends on its own output (a cycle in the graph)", nid)
        )
    used = {n for o in graph.outputs for n in graph.upstream(o)}
    errors = {nid: items for nid, items in errors.items() if nid in used or nid in graph.outputs}
    if errors:
        raise failed_validation(graph, errors)
    return graph


def _check_node(node_id: str, raw: dict[str, Any], prompt: dict[str, Any]) -> tuple[Node, list[dict]]:
    spec = NODES[raw["class_type"]]
    given = raw.get("inputs", {})
    inputs: dict[str, Any] = {}
    items: list[dict] = []
    for name, (kind, options) in [*spec.required.items(), *spec.optional.items()]:
        required = name in spec.required
        if name not in given or given[name] is None:
            if required:
                items.append(error_item("required_input_missing", "Required input is missing", name, input_name=name))
            continue
        value = given[name]
        if isinstance(kind, str) and kind in LINK_TYPES:
            link, problem = _check_link(value, kind, prompt)
            if problem:
                items.append(dict(problem, extra_info={"input_name": name, "received_value": _echo(value)}))
            else:
                inputs[name] = link
            continue
        if isinstance(value, list):
            items.append(
                error_item(
                    "invalid_input_type",
                    f"{name}: a link where sdjax takes a value",
                    name,
                    input_name=name,
                    received_value=value,
                )
            )
            continue
        converted, problem = _check_value(name, value, kind, options)
        if problem:
            items.append(problem)
        else:
            inputs[name] = converted
    meta = raw.get("_meta")
    title = meta.get("title", "") if isinstance(meta, dict) else ""
    return Node(node_id, spec.name, inputs, str(title)), items


def _check_link(value: Any, kind: str, prompt: dict[str, Any]) -> tuple[tuple[str, int] | None, dict | None]:
    if not (
        isinstance(value, list) and len(value) == 2 and isinstance(value[1], int) and not isinstance(value[1], bool)
    ):
        return None, error_item("bad_linked_input", "Bad linked input, must be a length-2 list of [string, int]")
    source, index = str(value[0]), value[1]
    if source not in prompt:
        return None, error_item("bad_linked_input", f"the link names node {source!r}, which is not in the prompt")
    other = prompt[source]
    source_spec = NODES.get(other.get("class_type"))
    if source_spec is None:
        return None, error_item("bad_linked_input", f"the link names node {source!r} of an unknown class")
    if not 0 <= index < len(source_spec.outputs):
        return None, error_item(
            "bad_linked_input", f"node {source!r} ({source_spec.name}) has no output {index}", str(source)
        )
    received = source_spec.outputs[index][0]
    if received != kind:
        return None, error_item(
            "return_type_mismatch",
            "Return type mismatch between linked nodes",
            f"received_type({received}) mismatch input_type({kind})",
        )
    return (source, index), None


def _check_value(name: str, value: Any, kind: Any, options: dict[str, Any]) -> tuple[Any, dict | None]:
    def bad(kind_: str, message: str) -> tuple[None, dict]:
        return None, error_item(kind_, message, f"{name}", input_name=name, received_value=value)

    if isinstance(kind, list):
        if value not in kind:
            return bad("value_not_in_list", f"Value not in list: {name}: {value!r} not in {kind}")
        return value, None
    if isinstance(kind, Dynamic):  # checked by the planner, which knows the server's lists
        if not isinstance(value, str):
            return bad("invalid_input_type", f"{name}: expected a name, got {type(value).__name__}")
        return value, None
    if kind == "STRING":
        if not isinstance(value, str):
            return bad("invalid_input_type", f"{name}: expected a string, got {type(value).__name__}")
        return value, None
    if kind == "BOOLEAN":
        if not isinstance(value, bool):
            return bad("invalid_input_type", f"{name}: expected true or false")
        return value, None
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
        if not math.isfinite(number):
            raise ValueError
        if kind == "INT":
            if number != int(number):
                raise ValueError
            number = int(value) if isinstance(value, int) else int(number)
    except (TypeError, ValueError, OverflowError):
        return bad("invalid_input_type", f"Failed to convert an input value to a {kind} value: {name}, {value!r}")
    if "min" in options and number < options["min"]:
        return bad("value_smaller_than_min", f"Value {number} smaller than min of {options['min']}: {name}")
    if "max" in options and number > options["max"]:
        return bad("value_bigger_than_max", f"Value {number} bigger than max of {options['max']}: {name}")
    return number, None


def _cycle(graph: Graph) -> list[str]:
    """The nodes of one dependency cycle, or [] (iterative DFS: a long chain does not hit Python's recursion limit)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for start in graph.nodes:
        if state.get(start):
            continue
        stack = [(start, iter(_deps(graph, start)))]
        path = [start]
        state[start] = 1
        while stack:
            nid, deps = stack[-1]
            nxt = next(deps, None)
            if nxt is None:
                state[nid] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(_deps(graph, nxt))))
                path.append(nxt)
    return []


def _deps(graph: Graph, node_id: str) -> list[str]:
    return [v[0] for v in graph.nodes[node_id].inputs.values() if isinstance(v, tuple) and v[0] in graph.nodes]
