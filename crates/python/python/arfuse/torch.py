"""arfuse inside torch.compile.

- `FusionPass(target)`: a `torch._inductor.custom_graph_pass.CustomGraphPass` for
  `torch._inductor.config.post_grad_custom_post_pass`. It serializes the post-grad FX
  graph (`arfuse.fx_json`, docs/fx-graph-format.md: nodes, targets, arguments,
  FakeTensor metadata; the op mapping is the Rust importer's), lowers it for the target,
  and rewrites the graph so that each fused site is one call of
  `torch.ops.arfuse.fused_allreduce_rms_norm` (`arfuse::splice` says what to change).
- `torch.ops.arfuse.fused_allreduce_rms_norm(input, residual, weight, group_name, eps,
  weight_bias, norm_round_twice, quant) -> (norm, residual_out, quant_out, scale)`: the
  fused all-reduce -> (residual add ->) RMSNorm (-> per-token FP8 quant) op. CPU
  kernel: all-gathers every rank's input over the process group `group_name`
  (torch.distributed) and computes arfuse's rounding contract on them in Rust (clause 1
  sums in rank order from +0.0 in f32; torch.distributed's own sum, e.g. gloo's, uses
  another order and rounds at every step). A fake kernel for compilation. CUDA: not
  built in this package; the CUDA entry raises.
- `torch.ops.arfuse.quant_fp8_per_token(input) -> (quant, scale)`: dynamic per-token
  FP8 quant (contract clause 4, the fused op's epilogue): e4m3 values and f32 scales
  `[..., 1]`. The importer reads it as the IR's `quant_fp8_per_token`, so a model that
  calls it after an RMSNorm gets the quant epilogue fused.

Importing this module registers the ops. Inference only (no autograd formulas).
"""

import hashlib
import json
import operator
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import _arfuse, fx_json
from ._api import Report

__all__ = ["FusionPass", "fused_allreduce_rms_norm", "quant_fp8_per_token"]

# The fused op's outputs, in order (the IR's output names).
OUTPUTS = ("norm", "residual", "quant", "scale")
# Quant epilogues the CPU kernel computes (the IR's `quant.kind`).
CPU_QUANT_KINDS = ("none", "fp8_per_token")

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

_ns, _quant_name, _ = _arfuse.QUANT_FP8_PER_TOKEN_OP.split(".")
_QUANT_OP_NAME = f"{_ns}::{_quant_name}"


def _dtype_name(what: str, t: torch.Tensor) -> str:
    name = _DTYPES.get(t.dtype)
    if name is None:
        raise ValueError(f"arfuse: {what} has dtype {t.dtype}; bfloat16, float16 or float32 expected")
    return name


def _check_cpu(what: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"arfuse: {what} is on {t.device}; this kernel runs on the CPU")


def _outputs_like(input: torch.Tensor, quant: str) -> Tuple[torch.Tensor, ...]:
    norm = torch.empty_like(input, memory_format=torch.contiguous_format)
    res = torch.empty_like(input, memory_format=torch.contiguous_format)
    if quant == "fp8_per_token":
        q = torch.empty(input.shape, dtype=torch.float8_e4m3fn, device=input.device)
        s = torch.empty(tuple(input.shape[:-1]) + (1,), dtype=torch.float32, device=input.device)
    else:
        q = torch.empty((0,), dtype=torch.float8_e4m3fn, device=input.device)
        s = torch.empty((0,), dtype=torch.float32, device=input.device)
    return norm, res, q, s


def _check_quant(quant: str) -> None:
    if quant not in CPU_QUANT_KINDS:
        raise ValueError(f"arfuse: quant {quant!r} is not one of {CPU_QUANT_KINDS}")


def _gather_ranks(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every rank's `x`, in rank order: `[world, *x.shape]` (a one-rank group needs no
    collective)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"arfuse.fused_allreduce_rms_norm: process group {group_name!r} needs an "
            "initialised torch.distributed"
        )
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group_name)
    world = dist.get_world_size(pg)
    out = torch.empty((world,) + tuple(x.shape), dtype=x.dtype)
    if world == 1:
        out[0].copy_(x)
    else:
        dist.all_gather(list(out.unbind(0)), x, group=pg)
    return out


@torch.library.custom_op("arfuse::fused_allreduce_rms_norm", mutates_args=(), device_types="cpu")
def fused_allreduce_rms_norm(
    input: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    group_name: str,
    eps: float,
    weight_bias: float,
    norm_round_twice: bool,
    quant: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused op on this rank (see the module documentation). `input` `[..., H]`,
    `residual` like `input` (or None), `weight` `[H]` (the activation dtype, or f32).
    Returns (norm, residual_out, quant_out, scale): norm and residual_out like input;
    for quant `fp8_per_token`, e4m3 values like input and f32 scales `[..., 1]`, else
    two empty tensors."""
    _check_quant(quant)
    dtype = _dtype_name("input", input)
    _check_cpu("input", input)
    hidden = input.shape[-1] if input.dim() > 0 else 0
    x = input.contiguous()
    w = weight.contiguous()
    _check_cpu("weight", w)
    if w.numel() != hidden:
        raise ValueError(f"arfuse: weight has {w.numel()} elements, the hidden size is {hidden}")
    r = None
    if residual is not None:
        _check_cpu("residual", residual)
        if residual.dtype != input.dtype or residual.numel() != input.numel():
            raise ValueError(
                f"arfuse: residual {residual.dtype}{list(residual.shape)} does not match "
                f"input {input.dtype}{list(input.shape)}"
            )
        r = residual.contiguous()
    ranks = _gather_ranks(x, group_name)
    norm, res, q, s = _outputs_like(input, quant)
    _arfuse._fused_allreduce_rms_norm_cpu(
        dtype,
        ranks.data_ptr(),
        ranks.shape[0],
        x.numel(),
        hidden,
        0 if r is None else r.data_ptr(),
        w.data_ptr(),
        _dtype_name("weight", w),
        float(eps),
        float(weight_bias),
        bool(norm_round_twice),
        quant,
        norm.data_ptr(),
        res.data_ptr(),
        q.data_ptr() if quant != "none" else 0,
        s.data_ptr() if quant != "none" else 0,
    )
    return norm, res, q, s


@fused_allreduce_rms_norm.register_kernel("cuda")
def _fused_cuda(input, residual, weight, group_name, eps, weight_bias, norm_round_twice, quant):
    raise NotImplementedError(
        "arfuse.fused_allreduce_rms_norm: the CUDA kernel is not built into this package "
        "(arfuse's CUDA kernels run through the Rust crate arfuse-runtime, which the "
        "Python package does not link yet); run the model on the CPU, or compile without "
        "arfuse.torch.FusionPass"
    )


@fused_allreduce_rms_norm.register_fake
def _fused_fake(input, residual, weight, group_name, eps, weight_bias, norm_round_twice, quant):
    _check_quant(quant)
    return _outputs_like(input, quant)


@torch.library.custom_op(_QUANT_OP_NAME, mutates_args=(), device_types="cpu")
def quant_fp8_per_token(input: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 quant (contract clause 4): `input` `[..., H]` (bf16, f16 or
    f32) -> (e4m3 values like input, f32 scales `[..., 1]`)."""
    dtype = _dtype_name("input", input)
    _check_cpu("input", input)
    x = input.contiguous()
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(tuple(x.shape[:-1]) + (1,), dtype=torch.float32)
    if x.numel() > 0:
        _arfuse._quant_fp8_per_token_cpu(
            dtype, x.data_ptr(), x.numel(), x.shape[-1], q.data_ptr(), s.data_ptr()
        )
    return q, s


@quant_fp8_per_token.register_fake
def _quant_fake(input):
    q = torch.empty(input.shape, dtype=torch.float8_e4m3fn, device=input.device)
    s = input.new_empty(tuple(input.shape[:-1]) + (1,), dtype=torch.float32)
    return q, s


_SOURCES_DIGEST: Optional[str] = None


def _sources_digest() -> str:
    """SHA-256 of the files that decide what the pass does: this module, the FX
    serializer and the extension module (the importer, rewrite and policy are in it)."""
    global _SOURCES_DIGEST
    if _SOURCES_DIGEST is None:
        h = hashlib.sha256()
        for path in (__file__, fx_json.__file__, _arfuse.__file__):
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        _SOURCES_DIGEST = h.hexdigest()
    return _SOURCES_DIGEST


class FusionPass(CustomGraphPass):
    """The torch.compile pass: `torch._inductor.config.post_grad_custom_post_pass =
    FusionPass(target)`.

    On each post-grad graph it imports the graph, lowers it for `target` (`group`,
    `all_reduce_ops` as for `arfuse.lower`) and replaces each fused site by one call of
    `torch.ops.arfuse.fused_allreduce_rms_norm`; `reports` holds one `Report` per graph
    it ran on (a graph served from inductor's FX graph cache is not passed again).
    `on_error`: `"raise"` (default) raises the `ArfuseError`, failing the compilation;
    `"skip"` leaves that graph unchanged and records the error in `errors`.

    Sites whose epilogue the CPU kernel does not compute (static FP8, per-token-group
    FP8, NVFP4) are left unfused, with a warning in the report. The model must be
    compiled with `torch._dynamo.config.specialize_float = True` (an RMSNorm eps is
    otherwise an f64 graph input, which arfuse's IR has no type for;
    docs/fx-graph-format.md)."""

    def __init__(
        self,
        target: _arfuse.Target,
        *,
        group: Optional[str] = None,
        all_reduce_ops: Iterable[str] = (),
        on_error: str = "raise",
    ) -> None:
        if not isinstance(target, _arfuse.Target):
            raise TypeError(f"target must be an arfuse.Target, not {type(target).__name__}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        self.target = target
        self.group = group
        self.all_reduce_ops: List[str] = list(all_reduce_ops)
        self.on_error = on_error
        self.reports: List[Report] = []
        self.errors: List[_arfuse.ArfuseError] = []

    def uuid(self) -> str:
        """Identifies what the pass does to a graph, for inductor's FX graph cache: the
        arfuse version, the pass's sources and extension, the target and the options.
        Equal for equal passes of one build; changes with any of them."""
        h = hashlib.sha256()
        for part in (
            "arfuse.torch.FusionPass",
            _arfuse.__version__,
            _sources_digest(),
            self.target.to_toml(),
            json.dumps(
                {"group": self.group, "all_reduce_ops": self.all_reduce_ops, "on_error": self.on_error},
                sort_keys=True,
            ),
        ):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:
            raise ValueError("arfuse.torch.FusionPass: the graph has no owning GraphModule")
        try:
            data = fx_json.serialize(gm, {}, "post")
            report_json, table, splice_json, _notes = _arfuse._fx_lower(
                data, self.target, self.group, self.all_reduce_ops
            )
        except _arfuse.ArfuseError as e:
            if self.on_error == "raise":
                raise
            self.errors.append(e)
            return
        splice = json.loads(splice_json)
        report = Report(json.loads(report_json), table)
        left = apply_splice(graph, splice)
        if left:
            report["warnings"].extend(left)
            report._table = table + "".join(f"warning: {w}\n" for w in left)
        graph.lint()
        self.reports.append(report)


def _fake_mode(graph: torch.fx.Graph):
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    mode = torch._guards.detect_fake_mode(vals)
    if mode is None:
        raise ValueError("arfuse.torch.FusionPass: the graph's nodes carry no FakeTensor metadata")
    return mode


def _view_sizes(v: torch.fx.Node) -> Any:
    """Sizes for a reshape to the shape of FX node `v`: a view's own sizes argument, else
    its static sizes with -1 for its one symbolic dimension."""
    if v.target in (
        torch.ops.aten.view.default,
        torch.ops.aten.reshape.default,
        torch.ops.aten._unsafe_view.default,
    ):
        return v.args[1]
    shape = v.meta["val"].shape
    sizes = [d if isinstance(d, int) else -1 for d in shape]
    if sizes.count(-1) > 1:
        raise ValueError(f"{v.name}: a view to {list(shape)} has more than one symbolic size")
    return sizes


def apply_splice(graph: torch.fx.Graph, splice: Dict[str, Any]) -> List[str]:
    """Applies `arfuse::splice`'s result (JSON form) to `graph`: one fused call per site,
    readers redirected, dead chains erased. Returns a warning per site left unfused."""
    nodes = {n.name: n for n in graph.nodes}
    mode = _fake_mode(graph)
    left: List[str] = [f"{s['fused_node']} left unfused: {s['reason']}" for s in splice["skipped"]]
    outs: List[Optional[List[torch.fx.Node]]] = []
    for site in splice["sites"]:
        try:
            outs.append(_splice_site(graph, site, nodes, outs, mode))
        except (ValueError, KeyError) as e:
            outs.append(None)
            left.append(f"{site['fused_node']} left unfused: {e}")
    _erase_dead(graph, set(splice["removed"]))
    return left


def _splice_site(
    graph: torch.fx.Graph,
    site: Dict[str, Any],
    nodes: Dict[str, torch.fx.Node],
    outs: Sequence[Optional[List[torch.fx.Node]]],
    mode,
) -> List[torch.fx.Node]:
    """Inserts one site's fused call; returns its outputs (one per IR output)."""
    attrs = site["attrs"]
    quant = attrs["quant"]["kind"]
    if quant not in CPU_QUANT_KINDS:
        raise ValueError(f"the CPU kernel does not compute the {quant} epilogue")
    args: List[torch.fx.Node] = []
    for inp in site["inputs"]:
        if "tensor" in inp:
            args.append(nodes[inp["tensor"]])
        else:
            ref = inp["site"]
            prev = outs[ref["site"]]
            if prev is None:
                raise ValueError(f"it reads site {ref['site']}, which is left unfused")
            args.append(prev[ref["output"]])
    x = args[0]
    residual = args[1] if attrs["residual"] else None
    weight = args[2] if attrs["residual"] else args[1]
    position = {n: i for i, n in enumerate(graph.nodes)}
    latest = max(args, key=lambda n: position[n])
    call_args = (
        x,
        residual,
        weight,
        attrs["group"],
        float(attrs["eps"]),
        float(attrs.get("weight_bias", 0.0)),
        attrs.get("norm_rounding", "once") == "twice",
        quant,
    )
    op = torch.ops.arfuse.fused_allreduce_rms_norm.default
    with mode:
        vals = op(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in call_args])
    with graph.inserting_after(latest):
        call = graph.call_function(op, call_args)
    call.meta["val"] = vals
    stack = x.meta.get("nn_module_stack")
    if stack is not None:
        call.meta["nn_module_stack"] = stack
    getitems: List[torch.fx.Node] = []
    prev_node = call
    for k in range(len(OUTPUTS)):
        with graph.inserting_after(prev_node):
            g = graph.call_function(operator.getitem, (call, k))
        g.meta["val"] = vals[k]
        getitems.append(g)
        prev_node = g
    ports = [getitems[OUTPUTS.index(o)] for o in attrs["outputs"]]
    for port, out in zip(site["outputs"], ports):
        for name in port["replaces"]:
            nodes[name].replace_all_uses_with(out)
        for name in port["views"]:
            v = nodes[name]
            sizes = _view_sizes(v)
            with graph.inserting_before(v):
                r = graph.call_function(torch.ops.aten.reshape.default, (out, sizes))
            r.meta["val"] = v.meta["val"]
            v.replace_all_uses_with(r)
    return ports


def _erase_dead(graph: torch.fx.Graph, removed: set) -> None:
    """Erases, last first, the nodes of `removed` that no reader is left for, and the
    multi-output nodes whose every getitem was erased."""
    orphans = set()
    for n in reversed(list(graph.nodes)):
        if n.users:
            continue
        if n.name in removed or n in orphans:
            if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node):
                orphans.add(n.args[0])
            graph.erase_node(n)
