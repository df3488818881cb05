"""Stubs of the extension module `arfuse._arfuse` (crates/python/src)."""

from typing import Any, List, Optional, Sequence, Tuple

__version__: str
CONTRACT_NAME: str
QUANT_FP8_PER_TOKEN_OP: str

class ArfuseError(Exception):
    """Base class of every error arfuse raises."""

    kind: str

class LoadError(ArfuseError):
    """A graph could not be read."""

    node: Optional[str]
    tensor: Optional[str]
    location: Optional[str]
    problems: List[Tuple[str, str]]

class TargetError(ArfuseError):
    """A target (or a hidden size planned on it) is wrong."""

    field: Optional[str]
    value: Optional[str]
    reason: Optional[str]

class LowerError(ArfuseError):
    """The lowering gave no graph."""

    node: Optional[str]
    problems: List[Tuple[str, str]]

class Target:
    """The machine, the all-reduce group and the engine settings a plan is made for.
    Every count is of the tensor-parallel (all-reduce) group; the fields and their
    defaults are those of the TOML format (README, `arfuse_policy::Target`): a keyword
    left out (or None) gets the TOML default from the same code, so
    `multicast_all_ranks` defaults to true on "nvswitch" and "nvlink-fabric"."""

    def __init__(
        self,
        *,
        sm: int,
        world_size: int,
        gpus_per_node: int,
        interconnect: str,
        max_batched_tokens: int,
        group_nodes: Optional[int] = None,
        multicast_all_ranks: Optional[bool] = None,
        dtype: Optional[str] = None,
        capture_sizes: Optional[Sequence[int]] = None,
        compile_range_boundaries: Optional[Sequence[int]] = None,
        num_speculative_tokens: Optional[int] = None,
        deterministic: Optional[bool] = None,
        unfused_all_reduce: Optional[str] = None,
        requested_backend: Optional[str] = None,
        kernels: Optional[str] = None,
        max_bytes_override: Optional[int] = None,
    ) -> None: ...
    @staticmethod
    def preset(name: str) -> Target: ...
    @staticmethod
    def from_toml(text: str) -> Target: ...
    @staticmethod
    def preset_names() -> List[str]: ...
    def to_toml(self) -> str: ...
    def __reduce__(self) -> Tuple[Any, Tuple[str]]: ...
    @property
    def sm(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def group_nodes(self) -> int: ...
    @property
    def gpus_per_node(self) -> int: ...
    @property
    def multicast_all_ranks(self) -> bool: ...
    @property
    def interconnect(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def max_batched_tokens(self) -> int: ...
    @property
    def capture_sizes(self) -> List[int]: ...
    @property
    def compile_range_boundaries(self) -> List[int]: ...
    @property
    def num_speculative_tokens(self) -> int: ...
    @property
    def deterministic(self) -> bool: ...
    @property
    def unfused_all_reduce(self) -> str: ...
    @property
    def requested_backend(self) -> str: ...
    @property
    def kernels(self) -> str: ...
    @property
    def max_bytes_override(self) -> Optional[int]: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class DispatchRange:
    """Token counts `lo..=hi` run with `strategy` (`one-shot`, `two-shot`, `unfused`)."""

    @property
    def lo(self) -> int: ...
    @property
    def hi(self) -> int: ...
    @property
    def strategy(self) -> str: ...
    @property
    def required_bytes(self) -> int: ...
    @property
    def available_bytes(self) -> int: ...
    @property
    def reason(self) -> str: ...

class Plan:
    """A verified plan: backend, workspace (bytes per rank) and the dispatch by token
    count. `str(plan)` is the policy's summary."""

    @property
    def backend(self) -> Optional[str]: ...
    @property
    def reason(self) -> str: ...
    @property
    def kernels(self) -> str: ...
    @property
    def batch_invariant(self) -> bool: ...
    @property
    def max_token_num(self) -> int: ...
    @property
    def workspace_bytes(self) -> Optional[int]: ...
    @property
    def lamport_buffer_bytes(self) -> Optional[int]: ...
    @property
    def flashinfer_workspace_bytes(self) -> Optional[int]: ...
    @property
    def hidden_sizes(self) -> List[int]: ...
    @property
    def dispatch(self) -> List[DispatchRange]: ...
    def dispatch_for(self, hidden: int) -> List[DispatchRange]: ...
    @property
    def notes(self) -> List[str]: ...
    def to_json(self) -> str: ...

def plan(target: Target, hidden_sizes: Sequence[int]) -> Plan: ...
def _lower(
    data: bytes,
    target: Target,
    group: Optional[str] = None,
    all_reduce_ops: Sequence[str] = ...,
    shared_hidden_sizes: Sequence[int] = ...,
) -> Tuple[str, str, str, List[str]]: ...
def _fx_lower(
    data: bytes,
    target: Target,
    group: Optional[str] = None,
    all_reduce_ops: Sequence[str] = ...,
) -> Tuple[str, str, str, List[str]]: ...
def _fx_lower_graph(
    graph: Any,
    target: Target,
    group: Optional[str] = None,
    all_reduce_ops: Sequence[str] = ...,
    opaque_ops: Sequence[Tuple[str, str]] = ...,
) -> Tuple[str, str, str, List[str]]: ...
def _fx_graph_json(graph: Any) -> str: ...
def _fused_allreduce_rms_norm_cpu(
    dtype: str,
    ranks: int,
    world: int,
    numel: int,
    hidden: int,
    residual: int,
    weight: int,
    weight_dtype: str,
    eps: float,
    weight_bias: float,
    norm_round_twice: bool,
    norm_f32_sum: bool,
    quant: str,
    norm_out: int,
    residual_out: int,
    quant_out: Tuple[int, int],
    scale_out: Tuple[int, int],
    scale_in: int,
) -> None: ...
def _quant_cpu(
    quant: str,
    dtype: str,
    x: int,
    numel: int,
    hidden: int,
    quant_out: Tuple[int, int],
    scale_out: Tuple[int, int],
    scale_in: int,
) -> None: ...

CALL_TOKENS: int
OP_QUANTS: List[str]
SCALE_INPUT_QUANTS: List[str]
FP8_GROUP_SIZE: int
NVFP4_BLOCK: int
NVFP4_TILE_ROWS: int
NVFP4_TILE_COLS: int

class _HostRanks:
    """One rank's workspace of the fused op on the host device, shared with the other
    processes of a group (created collectively by the constructor)."""

    def __init__(
        self,
        group: Any,
        dtype: str,
        hidden: int,
        max_bytes: Optional[int] = None,
        timeout_ms: Optional[int] = None,
    ) -> None: ...
    @property
    def bytes_per_rank(self) -> int: ...
    def run(
        self,
        x: int,
        residual: int,
        weight: int,
        weight_dtype: str,
        numel: int,
        eps: float,
        weight_bias: float,
        norm_round_twice: bool,
        norm_f32_sum: bool,
        quant: str,
        norm_out: int,
        residual_out: int,
        quant_out: Tuple[int, int],
        scale_out: Tuple[int, int],
        scale_in: int,
        call_tag: int,
    ) -> None: ...

class _CudaRanks:
    """One rank's workspace of the fused op on a CUDA GPU, shared with the other
    processes of a group over CUDA IPC (created collectively, outside any capture)."""

    def __init__(
        self,
        group: Any,
        dtype: str,
        hidden: int,
        device: int,
        stream: int,
        timeout_ms: Optional[int] = None,
    ) -> None: ...
    def run(
        self,
        x: int,
        residual: int,
        weight: int,
        weight_dtype: str,
        numel: int,
        eps: float,
        weight_bias: float,
        norm_round_twice: bool,
        norm_f32_sum: bool,
        quant: str,
        norm_out: int,
        residual_out: int,
        quant_out: Tuple[int, int],
        scale_out: Tuple[int, int],
        scale_in: int,
        call_tag: int,
        stream: int,
    ) -> None: ...
