"""arfuse: fuse all-reduce -> residual add -> RMSNorm (-> quant) in tensor-parallel graphs.

The Python package of the Rust library arfuse (built from `crates/python`):

- `Target` (`Target.preset(name)`, `Target.from_toml(text)`, `Target(sm=..., ...)`): the
  machine, the all-reduce group and the engine settings a plan is made for.
- `plan(target, hidden_sizes)` -> `Plan`: backend and reason, workspace bytes (arfuse's
  and FlashInfer's), the dispatch by token range.
- `lower(graph, target)` -> `Lowered`: an arfuse JSON graph, a torch.export
  `ExportedProgram` (or its JSON / `.pt2` file) lowered; `Lowered.report` is a dict
  whose `str()` is the report table.
- `arfuse.torch.FusionPass(target)`: the torch.compile (inductor post-grad) pass; import
  `arfuse.torch` for it (needs torch).

Every error is an `ArfuseError`: `LoadError` (a graph that cannot be read), `TargetError`
(a wrong target), `LowerError` (no lowering), each with the node, tensor or field it
names as attributes.
"""

from ._arfuse import (
    CONTRACT_NAME,
    ArfuseError,
    DispatchRange,
    LoadError,
    LowerError,
    Plan,
    Target,
    TargetError,
    __version__,
    plan,
)
from ._api import Lowered, Report, lower

__all__ = [
    "CONTRACT_NAME",
    "ArfuseError",
    "DispatchRange",
    "LoadError",
    "LowerError",
    "Lowered",
    "Plan",
    "Report",
    "Target",
    "TargetError",
    "__version__",
    "lower",
    "plan",
]
