"""One FX graph as arfuse's importer reads it: torch.export's ExportedProgram JSON schema.

A torch.compile pass (inductor's post-grad stage) sees a `torch.fx.GraphModule` whose
nodes carry FakeTensor metadata (`node.meta["val"]`). This module serializes exactly
what the importer needs from it - nodes, targets, arguments, FakeTensor dtypes and
sizes, symbol ranges, module paths, parameter names - with torch's own graph
serializer (`torch._export.serde.serialize.GraphModuleSerializer`), into the envelope
of a serialized ExportedProgram. The op mapping stays in the Rust importer, shared with
torch.export graphs. The format is documented in docs/fx-graph-format.md.

Nothing here changes the graph: `nn_module_stack` entries are rewritten (dynamo writes
`L['self'].m.layers[0]` paths and class objects; the schema wants `m.layers.0` and type
names) and the metadata the importer does not read (`UNREAD_METADATA`: stack traces) is
taken off for the serializer, and both are put back afterwards.
"""

from __future__ import annotations

import json
import re

import torch

FORMAT = "arfuse-fx"
FORMAT_VERSION = 1

# Node metadata the importer does not read, left out of the file (a stack trace is about
# two thirds of a post-grad node's JSON): taken off for the serializer, put back after.
UNREAD_METADATA = ("stack_trace", "from_node")


def _fqn(dynamo_path: str) -> str:
    """A dynamo path as a module FQN: `L['self'].m.model.layers[0].mlp` and
    `L['self']._modules['m']._modules['layers']._modules['0']._parameters['weight']`
    -> `m.model.layers.0.mlp`, `m.layers.0.weight`."""
    p = re.sub(r"^L\['self'\]\.?", "", dynamo_path)
    p = re.sub(r"\[(\d+)\]", r".\1", p)
    p = re.sub(r"\['([^']+)'\]", r".\1", p)
    p = re.sub(r"(^|\.)_(modules|parameters|buffers)(?=\.)", "", p)
    return p.strip(".")


def parameter_fqn(dynamo_source: str) -> str | None:
    """The FQN of a dynamo graph input that is a parameter or buffer of the module
    (`L['self']...`), or None for a user input (`L['input_ids']`)."""
    if not dynamo_source.startswith("L['self']"):
        return None
    return _fqn(dynamo_source) or None


def _type_name(t) -> str:
    if isinstance(t, str):
        return t
    return f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', str(t))}"


def _bound(v):
    """A range bound as the schema writes it: an int, or None when unbounded."""
    try:
        i = int(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return i if abs(i) < 2**62 else None


def _range_constraints(gm: torch.fx.GraphModule) -> dict:
    shape_env = None
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        fm = getattr(v, "fake_mode", None)
        if fm is not None and fm.shape_env is not None:
            shape_env = fm.shape_env
            break
    if shape_env is None:
        return {}
    out = {}
    for sym, r in shape_env.var_to_range.items():
        out[str(sym)] = {"min_val": _bound(r.lower), "max_val": _bound(r.upper)}
    return out


def serialize(
    gm: torch.fx.GraphModule,
    parameter_names: dict[str, str] | None = None,
    stage: str = "",
) -> bytes:
    """The graph module as ExportedProgram-schema JSON (UTF-8 bytes).

    `parameter_names` maps placeholder names to the parameter or buffer FQN they hold
    (`m.model.layers.0.input_layernorm.weight`); other placeholders are user inputs.
    `stage` names where the pass ran (recorded under `arfuse_fx`, which the importer
    ignores)."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import GraphModuleSerializer, _dataclass_to_dict
    from torch.export.graph_signature import ExportGraphSignature

    parameter_names = parameter_names or {}
    saved = {}
    for n in gm.graph.nodes:
        kept = {k: n.meta.pop(k) for k in UNREAD_METADATA if k in n.meta}
        stack = n.meta.get("nn_module_stack")
        if stack:
            kept["nn_module_stack"] = stack
            n.meta["nn_module_stack"] = {
                k: (_fqn(path), _type_name(ty)) for k, (path, ty) in stack.items()
            }
        if kept:
            saved[n] = kept
    try:
        ser = GraphModuleSerializer(ExportGraphSignature(input_specs=[], output_specs=[]), [])
        graph = ser.serialize_graph(gm)
    finally:
        for n, kept in saved.items():
            n.meta.update(kept)
    input_specs = []
    for n in gm.graph.nodes:
        if n.op != "placeholder" or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        fqn = parameter_names.get(n.name)
        if fqn is None:
            input_specs.append({"user_input": {"arg": {"as_tensor": {"name": n.name}}}})
        else:
            input_specs.append(
                {"parameter": {"arg": {"name": n.name}, "parameter_name": fqn}}
            )
    doc = {
        "graph_module": {
            "graph": _dataclass_to_dict(graph),
            "signature": {"input_specs": input_specs, "output_specs": []},
            "module_call_graph": [],
            "metadata": {},
        },
        "opset_version": {"aten": 10},
        "range_constraints": _range_constraints(gm),
        "schema_version": {
            "major": schema.SCHEMA_VERSION[0],
            "minor": schema.SCHEMA_VERSION[1],
        },
        "verifiers": [],
        "torch_version": torch.__version__,
        "arfuse_fx": {"format": FORMAT, "version": FORMAT_VERSION, "stage": stage},
    }
    return json.dumps(doc, separators=(",", ":")).encode()
