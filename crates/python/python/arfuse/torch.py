"""arfuse inside torch.compile.

- `FusionPass(target)`: a `torch._inductor.custom_graph_pass.CustomGraphPass` for
  `torch._inductor.config.post_grad_custom_post_pass`. It walks the post-grad FX graph
  once, in Rust (nodes, targets, arguments, FakeTensor dtypes and sizes, into the
  importer's compact form, docs/fx-graph-format.md; the op mapping is the importer's),
  lowers it for the target, and
  rewrites the graph so that each fused site is one call of
  `torch.ops.arfuse.fused_allreduce_rms_norm` (`arfuse::splice` says what to change).
- `torch.ops.arfuse.fused_allreduce_rms_norm(input, residual, weight, group_name, eps,
  weight_bias, norm_round_twice, norm_f32_sum, quant, call_tag=0, scale_in=None) ->
  (norm, residual_out, quant_out, scale)`: the fused all-reduce -> (residual add ->)
  RMSNorm (-> quant) op, with every quant epilogue the kernels have (`OP_QUANTS`). CPU
  kernel: arfuse's own fused kernels (kernels/, compiled for the CPU: the runtime's
  host device) run on every rank of the process group `group_name`
  (torch.distributed) over a workspace in shared memory that the ranks create together
  on the first call (one per group, dtype and hidden size, kept for the life of the
  process); they sum in rank order from +0.0 in f32 (contract clause 1;
  torch.distributed's own sum, e.g. gloo's, uses another order and rounds at every
  step). A failed call (a rank that times out, dies or calls with another T or another
  site) raises on every rank and resets the workspace. Groups of a size the kernels are
  not built for (1, or W outside 2, 4, 8, 16) are computed by the reference contract
  from an all-gather. A fake kernel for compilation. CUDA tensors: the same kernels
  through the runtime's CUDA device on torch's current stream, the workspace over CUDA
  IPC, made on the first call before any graph capture (written, not yet run on a GPU).
- `torch.ops.arfuse.quant_fp8_per_token(input) -> (quant, scale)`: dynamic per-token
  FP8 quant (contract clause 4, the fused op's epilogue): e4m3 values and f32 scales
  `[..., 1]`. The importer reads it as the IR's `quant_fp8_per_token`, so a model that
  calls it after an RMSNorm gets the quant epilogue fused.

Importing this module registers the ops. Inference only (no autograd formulas).
"""

import atexit
import gc
import hashlib
import json
import operator
import os
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import _arfuse
from ._api import Report

__all__ = ["FusionPass", "fused_allreduce_rms_norm", "quant_fp8_per_token", "register_group_resolver"]

# The fused op's outputs, in order (the IR's output names).
OUTPUTS = ("norm", "residual", "quant", "scale")
# The fused op's quant epilogues (its `quant` argument): the IR's quant kind, and
# `kind:scale_layout` for the forms with a scale layout (`fp8_per_token_group:packed_ue8m0`,
# `nvfp4:swizzled_128x4`, ...). Every epilogue the kernels have.
OP_QUANTS = tuple(_arfuse.OP_QUANTS)

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


# The dtypes of the empty quant data and scale outputs of a quant without them.
_ABSENT_DTYPES = (torch.float8_e4m3fn, torch.float32)


def _quant_specs(quant: str, shape: Sequence[Any]):
    """(sizes, dtype, strides or None for contiguous) of the quant data and the scale
    outputs of `quant` for an input of `shape` `[..., H]` (sizes may be symbolic), in
    the kernels' layouts (`arfuse_runtime::check::quant_bytes_of`):
    - FP8 data: e4m3 like the input; NVFP4 data: uint8 `[..., H/2]` (two e2m1 values
      per byte, the first in the low nibble);
    - `fp8_per_token` scales: f32 `[..., 1]`; `fp8_static`: none (the scale is an input);
    - per-token-group scales (groups of `FP8_GROUP_SIZE`): f32 `[..., H/128]` for
      `f32_row_major` and `f32_row_major_ue8m0`; for `packed_ue8m0` int32 `[T, ceil(G/4)]`
      column-major with a column stride of `round_up(T, 4)` (vLLM's and DeepGEMM's);
    - NVFP4 block scales (blocks of `NVFP4_BLOCK`): e4m3 `[..., H/16]` for `linear`,
      `[round_up(T, 128), round_up(H/16, 4)]` for `swizzled_128x4` (128x4 tiles).
    None for an output the quant does not write (the op returns an empty e4m3 data or
    f32 scale tensor there)."""
    lead, h = tuple(shape[:-1]), shape[-1]
    kind, _, layout = quant.partition(":")
    fp8 = (tuple(shape), torch.float8_e4m3fn, None)
    if kind == "none":
        return None, None
    if kind == "fp8_static":
        return fp8, None
    if kind == "fp8_per_token":
        return fp8, (lead + (1,), torch.float32, None)
    tokens: Any = 1
    for d in lead:
        tokens = tokens * d
    if kind == "fp8_per_token_group":
        groups = h // _arfuse.FP8_GROUP_SIZE
        if layout == "packed_ue8m0":
            words = (groups + 3) // 4
            return fp8, ((tokens, words), torch.int32, (1, (tokens + 3) // 4 * 4))
        return fp8, (lead + (groups,), torch.float32, None)
    data = (lead + (h // 2,), torch.uint8, None)
    cols = h // _arfuse.NVFP4_BLOCK
    if layout == "linear":
        return data, (lead + (cols,), torch.float8_e4m3fn, None)
    rows_tile, cols_tile = _arfuse.NVFP4_TILE_ROWS, _arfuse.NVFP4_TILE_COLS
    rows = (tokens + rows_tile - 1) // rows_tile * rows_tile
    return data, ((rows, (cols + cols_tile - 1) // cols_tile * cols_tile), torch.float8_e4m3fn, None)


def _outputs_like(input: torch.Tensor, quant: str) -> Tuple[torch.Tensor, ...]:
    norm = torch.empty_like(input, memory_format=torch.contiguous_format)
    res = torch.empty_like(input, memory_format=torch.contiguous_format)
    specs = _quant_specs(quant, input.shape)
    q, s = (_empty_of(spec, absent, input.device) for spec, absent in zip(specs, _ABSENT_DTYPES))
    return norm, res, q, s


def _empty_of(spec, absent: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of a `_quant_specs` entry (an empty one of `absent` for None)."""
    if spec is None:
        return torch.empty((0,), dtype=absent, device=device)
    sizes, dtype, strides = spec
    if strides is None:
        return torch.empty(sizes, dtype=dtype, device=device)
    return torch.empty_strided(sizes, strides, dtype=dtype, device=device)


def _buffer(t: torch.Tensor) -> Tuple[int, int]:
    """(address, bytes spanned) of an output the kernels write; (0, 0) when empty."""
    if t.numel() == 0:
        return (0, 0)
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return (t.data_ptr(), span * t.element_size())


def _check_quant(quant: str) -> None:
    if quant not in OP_QUANTS:
        raise ValueError(f"arfuse: quant {quant!r} is not one of {OP_QUANTS}")


def _scale_input(quant: str, scale_in: Optional[torch.Tensor], input: torch.Tensor) -> int:
    """The address of the checked f32 scale input (static FP8 dequant scale, NVFP4
    global scale), 0 for a quant without one."""
    if quant not in _arfuse.SCALE_INPUT_QUANTS:
        if scale_in is not None:
            raise ValueError(f"arfuse: quant {quant!r} takes no scale_in")
        return 0
    if scale_in is None:
        raise ValueError(f"arfuse: quant {quant!r} needs scale_in (an f32 tensor of one element)")
    if scale_in.dtype != torch.float32 or scale_in.numel() != 1 or scale_in.device != input.device:
        raise ValueError(
            f"arfuse: scale_in is {scale_in.dtype}{list(scale_in.shape)} on {scale_in.device}; "
            f"one float32 element on {input.device} expected"
        )
    return scale_in.data_ptr()


_GROUP_RESOLVERS: List[Any] = []


def register_group_resolver(resolver) -> None:
    """Adds `resolver(group_name) -> ProcessGroup | None`, asked (newest first) for the
    process group of a fused op's `group_name` before torch.distributed's own group
    names: an engine whose graphs name its own groups (vLLM's `tp:0`) registers one
    (`arfuse.vllm` does). Registering the same resolver twice keeps one."""
    if resolver not in _GROUP_RESOLVERS:
        _GROUP_RESOLVERS.insert(0, resolver)


def _process_group(group_name: str):
    for resolve in _GROUP_RESOLVERS:
        pg = resolve(group_name)
        if pg is not None:
            return pg
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _process_group_of(group_name: str):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"arfuse.fused_allreduce_rms_norm: process group {group_name!r} needs an "
            "initialised torch.distributed"
        )
    return _process_group(group_name)


def _gather_ranks(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every rank's `x`, in rank order: `[world, *x.shape]` (a one-rank group needs no
    collective)."""
    pg = _process_group_of(group_name)
    world = dist.get_world_size(pg)
    out = torch.empty((world,) + tuple(x.shape), dtype=x.dtype)
    if world == 1:
        out[0].copy_(x)
    else:
        dist.all_gather(list(out.unbind(0)), x, group=pg)
    return out


def _op_inputs(input, residual, weight, quant: str, device: str):
    """The fused op's checked inputs: (dtype name, H, input, residual or None, weight),
    contiguous, every tensor on `device` (`cpu` or `cuda`)."""
    _check_quant(quant)
    dtype = _dtype_name("input", input)
    hidden = input.shape[-1] if input.dim() > 0 else 0
    tensors = [("input", input), ("weight", weight)] + ([("residual", residual)] if residual is not None else [])
    for what, t in tensors:
        if t.device.type != device:
            raise ValueError(f"arfuse: {what} is on {t.device}; this kernel runs on {device}")
    if input.device.type == "cuda" and any(t.device != input.device for _, t in tensors):
        raise ValueError("arfuse: input, residual and weight are on different devices")
    x = input.contiguous()
    w = weight.contiguous()
    if w.numel() != hidden:
        raise ValueError(f"arfuse: weight has {w.numel()} elements, the hidden size is {hidden}")
    r = None
    if residual is not None:
        if residual.dtype != input.dtype or residual.numel() != input.numel():
            raise ValueError(
                f"arfuse: residual {residual.dtype}{list(residual.shape)} does not match "
                f"input {input.dtype}{list(input.shape)}"
            )
        r = residual.contiguous()
    return dtype, hidden, x, r, w


def _run_args(x, r, w, eps, weight_bias, norm_round_twice, norm_f32_sum, quant, outs, scale: int) -> Tuple[Any, ...]:
    """The arguments of `_HostRanks.run` and `_CudaRanks.run` up to the call tag: the
    checked inputs' and the outputs' (norm, residual, quant, scale) addresses."""
    norm, res, q, s = outs
    return (
        x.data_ptr(),
        0 if r is None else r.data_ptr(),
        w.data_ptr(),
        _dtype_name("weight", w),
        x.numel(),
        float(eps),
        float(weight_bias),
        bool(norm_round_twice),
        bool(norm_f32_sum),
        quant,
        norm.data_ptr(),
        res.data_ptr(),
        _buffer(q),
        _buffer(s),
        scale,
    )


# World sizes arfuse's kernels are built for (arfuse_abi::WORLD_SIZES).
KERNEL_WORLD_SIZES = (2, 4, 8, 16)


class _TorchGroup:
    """The runtime's view of a torch.distributed process group: rank, world size and an
    all-gather of bytes (`all_gather_object`, so any backend the group has works)."""

    def __init__(self, pg) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)

    def all_gather(self, mine: bytes) -> List[bytes]:
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, bytes(mine), group=self.pg)
        return out


# One workspace per (group name, dtype, hidden size), created on the first call and
# freed at exit.
_HOST_RANKS: Dict[Tuple[str, str, int], Any] = {}


def _host_ranks(group_name: str, pg, dtype: str, hidden: int):
    key = (group_name, dtype, hidden)
    ws = _HOST_RANKS.get(key)
    if ws is None:
        max_bytes = os.environ.get("ARFUSE_HOST_MAX_BYTES")
        timeout_ms = os.environ.get("ARFUSE_HOST_TIMEOUT_MS")
        ws = _arfuse._HostRanks(
            _TorchGroup(pg),
            dtype,
            hidden,
            None if not max_bytes else int(max_bytes),
            None if not timeout_ms else int(timeout_ms),
        )
        _HOST_RANKS[key] = ws
    return ws


@atexit.register
def _free_workspaces() -> None:
    _HOST_RANKS.clear()
    _CUDA_RANKS.clear()


@torch.library.custom_op("arfuse::fused_allreduce_rms_norm", mutates_args=(), device_types="cpu")
def fused_allreduce_rms_norm(
    input: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    group_name: str,
    eps: float,
    weight_bias: float,
    norm_round_twice: bool,
    norm_f32_sum: bool,
    quant: str,
    call_tag: int = 0,
    scale_in: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused op on this rank (see the module documentation). `input` `[..., H]`,
    `residual` like `input` (or None), `weight` `[H]` (the activation dtype, or f32).
    `norm_round_twice`: the norm rounds `h * r` to the activation dtype before the
    weight multiply; `norm_f32_sum`: it normalises the unrounded f32 sum of the
    all-reduce output and the residual (vLLM's native `fused_add_rms_norm`).
    `quant`: one of `OP_QUANTS`; `scale_in`: for `fp8_static` the f32 dequant scale,
    for NVFP4 the f32 global scale (one element, on the input's device), else None.
    `call_tag`: the site of this call (the pass numbers its sites); every rank's call
    carries it, and ranks that run different sites in one call stop with an error.
    Returns (norm, residual_out, quant_out, scale): norm and residual_out like input;
    the quant data and scales in the layouts `_quant_specs` gives (two empty tensors
    without a quant)."""
    dtype, hidden, x, r, w = _op_inputs(input, residual, weight, quant, "cpu")
    scale = _scale_input(quant, scale_in, input)
    norm, res, q, s = _outputs_like(input, quant)
    pg = _process_group_of(group_name)
    if dist.get_world_size(pg) in KERNEL_WORLD_SIZES and x.numel() > 0:
        run = _run_args(x, r, w, eps, weight_bias, norm_round_twice, norm_f32_sum, quant, (norm, res, q, s), scale)
        _host_ranks(group_name, pg, dtype, hidden).run(*run, int(call_tag))
        return norm, res, q, s
    ranks = _gather_ranks(x, group_name)
    if x.numel() == 0:
        return norm, res, q, s
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
        bool(norm_f32_sum),
        quant,
        norm.data_ptr(),
        res.data_ptr(),
        _buffer(q),
        _buffer(s),
        scale,
    )
    return norm, res, q, s


# One CUDA workspace per (group name, dtype, hidden size, device), created on the
# first call outside a capture and freed at exit.
_CUDA_RANKS: Dict[Tuple[str, str, int, int], Any] = {}


@fused_allreduce_rms_norm.register_kernel("cuda")
def _fused_cuda(
    input, residual, weight, group_name, eps, weight_bias, norm_round_twice, norm_f32_sum, quant, call_tag=0, scale_in=None
):
    """The fused op on CUDA tensors: arfuse's kernels through the runtime's CUDA device
    on torch's current stream, the ranks' workspaces mapped over CUDA IPC (or fabric
    handles across an NVLink domain). The workspace
    and the kernels are made on the first call, which must come before any CUDA graph
    capture (an engine's warm-up run); a captured call only launches. NOT YET RUN ON A
    GPU."""
    dtype, hidden, x, r, w = _op_inputs(input, residual, weight, quant, "cuda")
    scale = _scale_input(quant, scale_in, input)
    norm, res, q, s = _outputs_like(input, quant)
    pg = _process_group_of(group_name)
    world = dist.get_world_size(pg)
    if world not in KERNEL_WORLD_SIZES:
        raise NotImplementedError(
            f"arfuse.fused_allreduce_rms_norm: a group of {world} ranks on CUDA; the kernels "
            f"are built for {KERNEL_WORLD_SIZES}"
        )
    stream = torch.cuda.current_stream(input.device).cuda_stream
    key = (group_name, dtype, hidden, input.device.index)
    ws = _CUDA_RANKS.get(key)
    if ws is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "arfuse.fused_allreduce_rms_norm: the first call on a group must come before "
                "CUDA graph capture (its workspace is created collectively, outside capture)"
            )
        timeout_ms = os.environ.get("ARFUSE_HOST_TIMEOUT_MS")
        ws = _arfuse._CudaRanks(
            _TorchGroup(pg), dtype, hidden, input.device.index, stream, None if not timeout_ms else int(timeout_ms)
        )
        _CUDA_RANKS[key] = ws
    if x.numel() > 0:
        run = _run_args(x, r, w, eps, weight_bias, norm_round_twice, norm_f32_sum, quant, (norm, res, q, s), scale)
        ws.run(*run, int(call_tag), stream)
    return norm, res, q, s


@fused_allreduce_rms_norm.register_fake
def _fused_fake(
    input, residual, weight, group_name, eps, weight_bias, norm_round_twice, norm_f32_sum, quant, call_tag=0, scale_in=None
):
    _check_quant(quant)
    return _outputs_like(input, quant)


@torch.library.custom_op(_QUANT_OP_NAME, mutates_args=(), device_types="cpu")
def quant_fp8_per_token(input: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 quant (contract clause 4): `input` `[..., H]` (bf16, f16 or
    f32) -> (e4m3 values like input, f32 scales `[..., 1]`)."""
    _check_cpu("input", input)
    return _quant_reference(input, "fp8_per_token")


def _quant_reference(x: torch.Tensor, quant: str, scale_in: Optional[torch.Tensor] = None):
    """(quant data, scales) of the rounding contract's quant (clause 4) of the CPU
    tensor `x` `[..., H]`, in the fused op's layouts (`_quant_specs`): what the fused
    op's kernels write for `quant` after an RMSNorm whose output is `x`."""
    _check_quant(quant)
    x = x.contiguous()
    dtype = _dtype_name("input", x)
    scale = _scale_input(quant, scale_in, x)
    _, _, q, s = _outputs_like(x, quant)
    if x.numel() > 0 and quant != "none":
        _arfuse._quant_cpu(quant, dtype, x.data_ptr(), x.numel(), x.shape[-1], _buffer(q), _buffer(s), scale)
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
        for path in (__file__, _arfuse.__file__):
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        _SOURCES_DIGEST = h.hexdigest()
    return _SOURCES_DIGEST


class FusionPass(CustomGraphPass):
    """The torch.compile pass: `torch._inductor.config.post_grad_custom_post_pass =
    FusionPass(target)`.

    On each post-grad graph it imports the graph, lowers it for `target` (`group`,
    `all_reduce_ops` as for `arfuse.lower`; `opaque_ops`: `(op, reason)` pairs the
    importer keeps opaque, with the reason in the report's notes) and replaces each fused site by one call of
    `torch.ops.arfuse.fused_allreduce_rms_norm`; `reports` holds one `Report` per graph
    it ran on (a graph served from inductor's FX graph cache is not passed again).
    `on_error`: `"raise"` (default) raises the error, failing the compilation; `"skip"`
    leaves that graph unchanged whatever goes wrong (an `ArfuseError` or any other
    exception), records the error in `errors` and warns once per pass.

    Every quant epilogue the kernels have is fused (static FP8 reads the quant's scale
    tensor as the op's `scale_in`). The model must be
    compiled with `torch._dynamo.config.specialize_float = True` (an RMSNorm eps is
    otherwise an f64 graph input, which arfuse's IR has no type for;
    docs/fx-graph-format.md).

    The pass pickles (its target as TOML; `reports` and `errors` are not kept), as an
    engine that sends its compilation config to worker processes needs."""

    def __init__(
        self,
        target: _arfuse.Target,
        *,
        group: Optional[str] = None,
        all_reduce_ops: Iterable[str] = (),
        opaque_ops: Iterable[Tuple[str, str]] = (),
        on_error: str = "raise",
    ) -> None:
        if not isinstance(target, _arfuse.Target):
            raise TypeError(f"target must be an arfuse.Target, not {type(target).__name__}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        self.target = target
        self.group = group
        self.all_reduce_ops: List[str] = list(all_reduce_ops)
        self.opaque_ops: List[Tuple[str, str]] = [tuple(o) for o in opaque_ops]
        self.on_error = on_error
        self.reports: List[Report] = []
        self.errors: List[BaseException] = []

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["reports"] = []
        state["errors"] = []
        return state

    def uuid(self) -> str:
        """Identifies what the pass does to a graph, for inductor's FX graph cache: the
        arfuse version, the pass's sources and extension, the target and the options.
        Equal for equal passes of one build; changes with any of them."""
        h = hashlib.sha256()
        for part in (
            type(self).__module__ + "." + type(self).__qualname__,
            _arfuse.__version__,
            _sources_digest(),
            self._target_key(),
            json.dumps(self._options(), sort_keys=True),
        ):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def _target_key(self) -> str:
        """The target's part of `uuid`."""
        return self.target.to_toml()

    def _options(self) -> Dict[str, Any]:
        """The options that change what the pass does (part of `uuid`)."""
        return {
            "group": self.group,
            "all_reduce_ops": self.all_reduce_ops,
            "opaque_ops": self.opaque_ops,
            "on_error": self.on_error,
        }

    def __call__(self, graph: torch.fx.Graph) -> None:
        try:
            self.reports.append(self.lower_graph(graph))
        except Exception as e:  # noqa: BLE001 (on_error="skip": nothing reaches the compiler)
            if self.on_error == "raise":
                raise
            if not self.errors:
                warnings.warn(
                    f"arfuse: a graph was left unfused ({type(e).__name__}: {e}); "
                    "later errors of this pass are recorded in its `errors` without a warning",
                    RuntimeWarning,
                    stacklevel=2,
                )
            self.errors.append(e)

    def lower_graph(self, graph: torch.fx.Graph) -> Report:
        """Lowers and splices one graph; returns its report. Raises on any failure, with
        the graph unchanged (every site is planned before the graph is touched)."""
        # The walk and the rewrite make tens of thousands of short-lived objects that form
        # no cycles; the collections they would start scan the compiler's whole heap.
        collecting = gc.isenabled()
        gc.disable()
        try:
            report_json, table, splice_json, _notes = _arfuse._fx_lower_graph(
                graph, self.target, self.group, self.all_reduce_ops, self.opaque_ops
            )
            report = Report(json.loads(report_json), table)
            left = apply_splice(graph, json.loads(splice_json))
        finally:
            if collecting:
                gc.enable()
        if left:
            report["warnings"].extend(left)
            report._table = table + "".join(f"warning: {w}\n" for w in left)
        return report


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


class _Planned:
    """One site, resolved against the graph before anything changes."""

    __slots__ = ("site", "args", "call_args", "anchor", "ports", "x", "all_reduce")

    def __init__(self, site, args, call_args, anchor, ports, x, all_reduce) -> None:
        self.site = site
        # Per fused input: an FX node, or (earlier site index, output index).
        self.args = args
        self.call_args = call_args
        # The original node after which the call goes (the latest input).
        self.anchor = anchor
        # Per written output: (replaced nodes, [(view node, sizes)]).
        self.ports = ports
        self.x = x
        # The FX nodes holding the all-reduce's value (the node, or the getitem
        # reading it from a tuple): the splice erases them.
        self.all_reduce = all_reduce


def apply_splice(graph: torch.fx.Graph, splice: Dict[str, Any]) -> List[str]:
    """Applies `arfuse::splice`'s result (JSON form) to `graph`: one fused call per site,
    readers redirected, dead chains erased. Returns a warning per site left unfused.

    Every site is resolved first (names, epilogue, view sizes); a site that cannot be is
    left unfused, with the sites reading it. Only then is the graph changed."""
    order = {}
    nodes = {}
    for i, n in enumerate(graph.nodes):
        order[n] = i
        nodes[n.name] = n
    left: List[str] = [f"{s['fused_node']} left unfused: {s['reason']}" for s in splice["skipped"]]
    planned: List[Optional[_Planned]] = []
    for site in splice["sites"]:
        try:
            planned.append(_plan_site(site, nodes, order, planned))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            planned.append(None)
            left.append(f"{site['fused_node']} left unfused: {e}")
    removed = set(splice["removed"])
    vals = None
    if any(p is not None for p in planned):
        # Every erased node may lend its value when every site is spliced (a skipped
        # site keeps its chain, whose nodes are then not erased).
        pool = [nodes[name] for name in removed if name in nodes] if all(planned) and not left else []
        vals = _Vals(graph, removed, pool)
    outs: List[Optional[List[torch.fx.Node]]] = []
    tail: Dict[torch.fx.Node, torch.fx.Node] = {}
    for tag, p in enumerate(planned):
        outs.append(None if p is None else _insert_site(graph, p, outs, tail, vals, tag))
    _erase_dead(graph, removed)
    return left


def _sizes_key(t: torch.Tensor) -> Tuple[Any, ...]:
    """A tensor's sizes with each symbolic one as its sympy expression (`SymInt.node.expr`,
    after the shape environment's replacements): hashable and compared structurally,
    without adding a guard (comparing symbolic sizes would) or printing the expression."""
    return tuple(d if type(d) is int else d.node.expr for d in t.shape)


def _fake_empty(mode, shape, dtype, device, strides=None) -> torch.Tensor:
    """A FakeTensor of `mode`, contiguous unless `strides` are given: a meta tensor
    wrapped directly (about a tenth of the time of `torch.empty` under the mode with
    symbolic sizes), or, should the wrapper refuse, the same made under the mode."""
    if strides is None:
        contiguous = []
        step: Any = 1
        for d in reversed(shape):
            contiguous.append(step)
            step = step * d
        strides = tuple(reversed(contiguous))
    try:
        from torch._subclasses.fake_tensor import FakeTensor

        meta = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
        return FakeTensor(mode, meta, device)
    except Exception:  # noqa: BLE001 (a torch without that constructor: the slow way)
        with mode:
            return torch.empty_strided(shape, strides, dtype=dtype, device=device)


class _Vals:
    """The FakeTensor values (`meta["val"]`) of the fused calls of one graph, made
    without a fake tensor per output where it can (one with symbolic sizes takes up to a
    millisecond to make): an output takes the value of a node the splice erases (the
    node it replaces, the all-reduce, or, when every site is spliced, any erased node of
    its type), each value lent once, so that no two live nodes share a tensor; any other
    output is made (`_fake_empty`); the unwritten quant outputs of every site share one
    empty pair (nothing reads them)."""

    def __init__(self, graph: torch.fx.Graph, removed: set, pool: List[torch.fx.Node]) -> None:
        self.mode = _fake_mode(graph)
        self.removed = removed
        self._empty: Dict[Any, Tuple[torch.Tensor, torch.Tensor]] = {}
        # Values of erased nodes by (sizes, dtype), each lent once.
        self._pool: Dict[Tuple[Any, Any], List[torch.Tensor]] = {}
        for n in pool:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                self._pool.setdefault((_sizes_key(v), v.dtype), []).append(v)
        self._used: set = set()

    def _donor(self, n: torch.fx.Node, xv: torch.Tensor, same_dtype: bool) -> Optional[torch.Tensor]:
        """`n`'s value when the splice erases `n`, no site took it yet, and it has x's
        sizes (and dtype)."""
        v = n.meta.get("val")
        if (
            n.name in self.removed
            and isinstance(v, torch.Tensor)
            and id(v) not in self._used
            and (not same_dtype or v.dtype == xv.dtype)
            # Compared as expressions: comparing symbolic sizes would add guards.
            and _sizes_key(v) == _sizes_key(xv)
        ):
            self._used.add(id(v))
            return v
        return None

    def _lend(self, xv: torch.Tensor) -> Optional[torch.Tensor]:
        bucket = self._pool.get((_sizes_key(xv), xv.dtype), [])
        while bucket:
            v = bucket.pop()
            if id(v) not in self._used:
                self._used.add(id(v))
                return v
        return None

    def for_site(self, p: "_Planned", quant: str) -> Tuple[torch.Tensor, ...]:
        xv = p.x.meta["val"]
        got: Dict[str, torch.Tensor] = {}
        for output, replaced, _ in p.ports:
            for n in replaced:
                v = self._donor(n, xv, output in ("norm", "residual"))
                if v is not None:
                    got[output] = v
                    break
        # The all-reduce's value has x's type: it stands in for norm or residual.
        spare = [v for v in (self._donor(n, xv, True) for n in p.all_reduce) if v is not None]
        shape, dtype, device = tuple(xv.shape), xv.dtype, xv.device
        for name in ("norm", "residual"):
            if name not in got:
                v = spare.pop() if spare else self._lend(xv)
                got[name] = v if v is not None else _fake_empty(self.mode, shape, dtype, device)
        if device not in self._empty:
            self._empty[device] = tuple(_fake_empty(self.mode, (0,), d, device) for d in _ABSENT_DTYPES)
        specs = _quant_specs(quant, shape)
        for name, spec, empty in zip(("quant", "scale"), specs, self._empty[device]):
            if name not in got:
                got[name] = empty if spec is None else _fake_empty(self.mode, spec[0], spec[1], device, spec[2])
        return tuple(got[name] for name in OUTPUTS)


def _fake_mode(graph: torch.fx.Graph):
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    mode = torch._guards.detect_fake_mode(vals)
    if mode is None:
        raise ValueError("arfuse.torch.FusionPass: the graph's nodes carry no FakeTensor metadata")
    return mode


def _op_quant(q: Dict[str, Any]) -> str:
    """The op's name (`OP_QUANTS`) of a fused node's quant attribute (the IR's
    `FusedQuant`: `kind`, and `group_size` and `scale_layout` where it has them)."""
    kind = q["kind"]
    group = q.get("group_size")
    if group is not None and group != _arfuse.FP8_GROUP_SIZE:
        raise ValueError(f"the kernels quantise groups of {_arfuse.FP8_GROUP_SIZE} elements, not {group}")
    name = kind if "scale_layout" not in q else f"{kind}:{q['scale_layout']}"
    if name not in OP_QUANTS:
        raise ValueError(f"the fused op has no {name} epilogue")
    return name


def _plan_site(
    site: Dict[str, Any],
    nodes: Dict[str, torch.fx.Node],
    order: Dict[torch.fx.Node, int],
    planned: Sequence[Optional[_Planned]],
) -> _Planned:
    """Resolves one site's inputs, outputs and views; raises if any is missing."""
    attrs = site["attrs"]
    quant = _op_quant(attrs["quant"])
    args: List[Any] = []
    anchor: Optional[torch.fx.Node] = None
    for inp in site["inputs"]:
        if "tensor" in inp:
            n = nodes[inp["tensor"]]
            args.append(n)
            cand = n
        else:
            ref = inp["site"]
            prev = planned[ref["site"]]
            if prev is None:
                raise ValueError(f"it reads site {ref['site']}, which is left unfused")
            args.append((ref["site"], ref["output"]))
            cand = prev.anchor
        if anchor is None or order[cand] > order[anchor]:
            anchor = cand
    if anchor is None:
        raise ValueError("a site without inputs")
    x = args[0]
    if not isinstance(x, torch.fx.Node):
        raise ValueError("its all-reduce input is another site's output")
    call_args = (
        attrs["group"],
        float(attrs["eps"]),
        float(attrs.get("weight_bias", 0.0)),
        attrs.get("norm_rounding", "once") == "twice",
        attrs.get("norm_input", "residual") == "f32_sum",
        quant,
    )
    ports = []
    for port in site["outputs"]:
        replaced = [nodes[name] for name in port["replaces"]]
        views = [(nodes[name], _view_sizes(nodes[name])) for name in port["views"]]
        ports.append((port["output"], replaced, views))
    ar = nodes.get(site["all_reduce"])
    all_reduce = [] if ar is None else [ar] + [u for u in ar.users if u.target is operator.getitem]
    return _Planned(site, args, call_args, anchor, ports, x, all_reduce)


def _insert_site(
    graph: torch.fx.Graph,
    p: _Planned,
    outs: Sequence[Optional[List[torch.fx.Node]]],
    tail: Dict[torch.fx.Node, torch.fx.Node],
    site_vals: _Vals,
    call_tag: int,
) -> List[torch.fx.Node]:
    """Inserts one planned site's call (tagged `call_tag`, its index in the splice)
    after the nodes already inserted at its anchor; returns its outputs (one per written
    output)."""
    ins = []
    for a in p.args:
        if isinstance(a, torch.fx.Node):
            ins.append(a)
        else:
            prev = outs[a[0]]
            assert prev is not None  # planned only when the site it reads was
            ins.append(prev[a[1]])
    residual = p.site["attrs"]["residual"]
    # The fused node's inputs: x, the residual (when it has one), the weight, then the
    # scale input of a quant that takes one.
    x, rest = ins[0], ins[1:]
    res = rest.pop(0) if residual else None
    weight = rest.pop(0)
    group, eps, weight_bias, twice, f32_sum, quant = p.call_args
    call_args: Tuple[Any, ...] = (x, res, weight, group, eps, weight_bias, twice, f32_sum, quant, call_tag)
    if rest:
        call_args += (rest[0],)
    op = torch.ops.arfuse.fused_allreduce_rms_norm.default
    vals = site_vals.for_site(p, quant)
    after = tail.get(p.anchor, p.anchor)
    with graph.inserting_after(after):
        call = graph.call_function(op, call_args)
    call.meta["val"] = vals
    stack = x.meta.get("nn_module_stack")
    if stack is not None:
        call.meta["nn_module_stack"] = stack
    getitems: Dict[str, torch.fx.Node] = {}
    last = call
    for output, _, _ in p.ports:
        k = OUTPUTS.index(output)
        with graph.inserting_after(last):
            g = graph.call_function(operator.getitem, (call, k))
        g.meta["val"] = vals[k]
        getitems[output] = last = g
    tail[p.anchor] = last
    result = []
    for output, replaced, views in p.ports:
        out = getitems[output]
        for n in replaced:
            n.replace_all_uses_with(out)
        for v, sizes in views:
            with graph.inserting_before(v):
                r = graph.call_function(torch.ops.aten.reshape.default, (out, sizes))
            r.meta["val"] = v.meta["val"]
            v.replace_all_uses_with(r)
        result.append(out)
    return result


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
