"""`arfuse.lower`, `arfuse.Lowered`, `arfuse.Report`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Sequence, Union

from . import _arfuse


class Report(dict):
    """What a lowering did, as a dict (the Rust `Report` in its JSON form: `group`,
    `target`, `workspaces`, `all_reduces_seen`, `all_reduces_fused`, `by_pattern`,
    `sites` (one per all-reduce: `name`, `fused`, `pattern`, `backend`, `dispatch`,
    `workspace_bytes`, `reason`, ...), `unknown_collectives`, `warnings`, `notes`,
    `runner`). `str(report)` is the table `cargo xtask lower` prints."""

    def __init__(self, data: dict, table: str) -> None:
        super().__init__(data)
        self._table = table

    def __str__(self) -> str:
        return self._table

    @property
    def site_names(self) -> List[str]:
        """Every site's name (`<all-reduce module> -> <norm module>`), in graph order."""
        return [s["name"] for s in self["sites"]]


@dataclass(frozen=True)
class Lowered:
    """The result of `lower`: the lowered graph (arfuse JSON text, docs/graph-format.md),
    the report, and the importer's notes (what it dropped, forwarded or assumed)."""

    graph: str
    report: Report
    notes: List[str] = field(default_factory=list)

    def graph_dict(self) -> dict:
        """The lowered graph parsed (`json.loads(self.graph)`)."""
        return json.loads(self.graph)


GraphInput = Union[str, bytes, bytearray, memoryview, "os.PathLike[str]", Any]


def _graph_bytes(graph: GraphInput) -> bytes:
    """The bytes of a graph given as text, bytes, a path or an ExportedProgram."""
    if isinstance(graph, (bytes, bytearray, memoryview)):
        return bytes(graph)
    if isinstance(graph, str):
        if graph.lstrip().startswith("{"):
            return graph.encode("utf-8")
        with open(graph, "rb") as f:
            return f.read()
    if isinstance(graph, os.PathLike):
        with open(os.fspath(graph), "rb") as f:
            return f.read()
    if type(graph).__name__ == "ExportedProgram" and type(graph).__module__.startswith("torch"):
        from torch._export.serde.serialize import serialize

        return serialize(graph).exported_program
    raise TypeError(
        "graph must be JSON text (str), bytes, a path (str or os.PathLike) or a "
        f"torch.export.ExportedProgram, not {type(graph).__name__}"
    )


def lower(
    graph: GraphInput,
    target: _arfuse.Target,
    *,
    group: Optional[str] = None,
    all_reduce_ops: Iterable[str] = (),
    shared_hidden_sizes: Sequence[int] = (),
) -> Lowered:
    """Lowers a graph for `target`: every all-reduce -> (residual add ->) RMSNorm
    (-> quant) chain the target's plan fuses becomes one fused node with its plan.

    `graph`: arfuse JSON or torch.export JSON text (a `str` starting with `{`), the bytes
    of any format arfuse reads (arfuse JSON, torch.export JSON, `.pt2`, gzip-compressed
    JSON), a path (`str` or `os.PathLike`) to such a file, or a
    `torch.export.ExportedProgram`. `group`: the layers' tensor-parallel group (default:
    inferred). `all_reduce_ops`: a framework's own all-reduce ops, `NAME[=GROUP]`
    (`vllm.all_reduce`). `shared_hidden_sizes`: hidden sizes (elements) of other graphs
    sharing the workspace.

    Raises `LoadError` (unreadable graph), `TargetError` (wrong target or hidden size),
    `LowerError` (no lowering), each naming the node or field."""
    data = _graph_bytes(graph)
    graph_json, report_json, table, notes = _arfuse._lower(
        data, target, group, list(all_reduce_ops), [int(h) for h in shared_hidden_sizes]
    )
    return Lowered(graph=graph_json, report=Report(json.loads(report_json), table), notes=notes)
