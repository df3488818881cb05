"""The FX front end of `arfuse.torch.FusionPass`: one walk over a post-grad FX graph that
hands arfuse's importer compact Python lists instead of JSON text.

`walk(gm)` reads each node's op, target, arguments and the dtype and sizes of its
FakeTensor values (`node.meta["val"]`), and nothing else: no torch serializer, no private
torch API that can assert. A node arfuse does not model is never an error here; the
importer keeps it opaque. What a node becomes in the lists (docs/fx-graph-format.md,
"The compact form"):

- a `placeholder` holding a tensor: a graph input; one holding a symbolic int, a script
  object or anything else: nothing (its readers see a non-tensor argument);
- a `call_function`: one node with its target (`aten.add.Tensor`,
  `higher_order.auto_functionalized`, `_operator.getitem`, ...), its arguments named by
  the op's schema (positional ones too; an `auto_functionalized` node's op is argument
  `_op`, a string) and one output per tensor of its value; the outputs of a node whose
  value is a tuple are named after the `getitem` nodes that read them, and those
  `getitem` nodes are not listed;
- `get_attr`, `call_module`, `call_method`: a node with target `<op>:<target>`, kept
  opaque;
- `output`: the graph's outputs (the tensors among them).

Argument values are tagged tuples `(name, kind, value)` with `kind` one of the `K_*`
constants below: a tensor is named by the node (or `getitem`) that produced it, a
symbolic int is its expression (`"s72"`, `"2*s72"`), a dtype is torch.export's
`ScalarType` code, and any other Python object is its type name (kind `K_OTHER`).
"""

from __future__ import annotations

import operator
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

# Argument kinds (the Rust side, `arfuse_import::fx`, reads the same numbers).
K_TENSOR = 0  # value: tensor name
K_TENSORS = 1  # value: list of tensor names or None
K_NONE = 2
K_INT = 3
K_FLOAT = 4
K_BOOL = 5
K_STR = 6
K_INTS = 7  # value: list of ints
K_FLOATS = 8
K_SYM = 9  # value: a symbolic int's expression
K_SYMS = 10  # value: list of ints and expressions
K_DTYPE = 11  # value: ScalarType code
K_BOOLS = 12
K_OTHER = 13  # value: the object's type name

# torch.export's ScalarType codes (torch/_export/serde/schema.py), which the importer
# maps to arfuse dtypes; any other dtype is code 0 and is typed opaque by the importer.
_DTYPE_CODES: Dict[torch.dtype, int] = {
    torch.uint8: 1,
    torch.int8: 2,
    torch.int16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.complex32: 9,
    torch.complex64: 10,
    torch.complex128: 11,
    torch.bool: 12,
    torch.bfloat16: 13,
}
for _name, _code in (
    ("float8_e4m3fn", 29),
    ("float8_e5m2", 30),
    ("float8_e4m3fnuz", 31),
    ("float8_e5m2fnuz", 32),
    ("float8_e8m0fnu", 33),
    ("uint16", 28),
    ("uint32", 34),
    ("uint64", 35),
):
    if hasattr(torch, _name):
        _DTYPE_CODES[getattr(torch, _name)] = _code

_GETITEM = operator.getitem
_TENSOR = torch.Tensor
_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)
_LAYOUT_NAMES = {torch.strided: "strided"}


class Walked:
    """The lists `walk` returns, in the order the Rust importer takes them."""

    __slots__ = ("names", "targets", "args", "outputs", "modules", "inputs", "graph_outputs", "symbols")

    def __init__(self) -> None:
        self.names: List[str] = []
        self.targets: List[str] = []
        self.args: List[list] = []
        # Per node: list of (tensor name, dtype code, sizes) for its tensor outputs,
        # plus the count of its non-tensor outputs.
        self.outputs: List[Tuple[list, int]] = []
        self.modules: List[Optional[str]] = []
        # Graph inputs: (name, dtype code, sizes).
        self.inputs: List[tuple] = []
        self.graph_outputs: List[str] = []
        # Symbol ranges: (name, min or None, max or None).
        self.symbols: List[tuple] = []


def _fqn(dynamo_path: str) -> str:
    """A dynamo module path as a module FQN: `L['self'].model.layers[0].mlp` ->
    `model.layers.0.mlp`."""
    p = re.sub(r"^L\['self'\]\.?", "", dynamo_path)
    p = re.sub(r"\[(\d+)\]", r".\1", p)
    p = re.sub(r"\['([^']+)'\]", r".\1", p)
    p = re.sub(r"(^|\.)_(modules|parameters|buffers)(?=\.)", "", p)
    return p.strip(".")


# Sympy expressions as text, by expression: printing one takes about 20 us, and a graph
# repeats the same few (every activation is `[s72, H]`).
_EXPR_TEXT: Dict[Any, str] = {}


def _sym_text(d: Any) -> str:
    """A symbolic int's expression as text (`s72`, `2*s72`)."""
    node = getattr(d, "node", None)
    try:
        expr = node.expr
    except Exception:  # noqa: BLE001 (no shape environment: print it directly)
        return str(d)
    text = _EXPR_TEXT.get(expr)
    if text is None:
        if len(_EXPR_TEXT) > 4096:
            _EXPR_TEXT.clear()
        text = _EXPR_TEXT[expr] = str(d)
    return text


def _sizes(t: torch.Tensor) -> list:
    return [d if type(d) is int else _sym_text(d) for d in t.shape]


def _target_name(target: Any) -> str:
    name = _TARGET_NAMES.get(target)
    if name is None:
        name = _TARGET_NAMES[target] = _target_text(target)
    return name


_TARGET_NAMES: Dict[Any, str] = {}


def _target_text(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # aten.add.Tensor
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or "?"
    return f"{module}.{getattr(target, '__qualname__', None) or getattr(target, '__name__', repr(target))}"


class _Encoder:
    """One walk's state: the name each producing FX node's value has as a tensor."""

    def __init__(self) -> None:
        # FX node -> tensor name (a node whose value is one tensor), or a list of
        # names by output index (a node whose value is a tuple).
        self.tensor_of: Dict[torch.fx.Node, Any] = {}
        self.arg_names: Dict[Any, Tuple[str, ...]] = {}
        self.modules: Dict[str, str] = {}

    def names_for(self, target: Any, n: int) -> Tuple[str, ...]:
        names = self.arg_names.get(target)
        if names is None or len(names) < n:
            schema = getattr(target, "_schema", None)
            if schema is not None:
                names = tuple(a.name for a in schema.arguments)
            else:
                names = ()
            if len(names) < n:
                names = names + tuple(f"arg{i}" for i in range(len(names), n))
            self.arg_names[target] = names
        return names

    def value(self, name: str, v: Any) -> tuple:
        """One argument as `(name, kind, value)`."""
        if isinstance(v, torch.fx.Node):
            t = self.tensor_of.get(v)
            if isinstance(t, str):
                return (name, K_TENSOR, t)
            val = v.meta.get("val")
            if isinstance(val, _SYM_TYPES):
                return (name, K_SYM, _sym_text(val))
            if isinstance(val, (int, float, bool)):
                return self.value(name, val)
            return (name, K_OTHER, type(val).__name__)
        if v is None:
            return (name, K_NONE, None)
        tv = type(v)
        if tv is bool:
            return (name, K_BOOL, v)
        if tv is int:
            return (name, K_INT, v)
        if tv is float:
            return (name, K_FLOAT, v)
        if tv is str:
            return (name, K_STR, v)
        if isinstance(v, (list, tuple)):
            return self.sequence(name, v)
        if isinstance(v, torch.dtype):
            return (name, K_DTYPE, _DTYPE_CODES.get(v, 0))
        if isinstance(v, _SYM_TYPES):
            return (name, K_SYM, _sym_text(v))
        if isinstance(v, torch._ops.OpOverload):
            return (name, K_STR, str(v))
        if isinstance(v, torch.device):
            return (name, K_STR, str(v))
        if isinstance(v, torch.layout):
            return (name, K_STR, _LAYOUT_NAMES.get(v, str(v)))
        if isinstance(v, torch.memory_format):
            return (name, K_STR, str(v).replace("torch.", ""))
        return (name, K_OTHER, tv.__name__)

    def sequence(self, name: str, v: Any) -> tuple:
        if not v:
            return (name, K_INTS, [])
        kinds = set()
        for x in v:
            if isinstance(x, torch.fx.Node):
                kinds.add("tensor" if isinstance(self.tensor_of.get(x), str) else "sym")
            elif x is None:
                kinds.add("none")
            else:
                kinds.add(type(x))
        if kinds <= {"tensor", "none"}:
            return (name, K_TENSORS, [self.tensor_of[x] if x is not None else None for x in v])
        if kinds == {int}:
            return (name, K_INTS, list(v))
        if kinds <= {int, "sym"} or kinds <= {int, torch.SymInt}:
            return (name, K_SYMS, [x if type(x) is int else self._sym(x) for x in v])
        if kinds <= {float, int}:
            return (name, K_FLOATS, [float(x) for x in v])
        if kinds == {bool}:
            return (name, K_BOOLS, list(v))
        return (name, K_OTHER, "list")

    @staticmethod
    def _sym(x: Any) -> str:
        if isinstance(x, torch.fx.Node):
            return _sym_text(x.meta.get("val"))
        return _sym_text(x)

    def module(self, node: torch.fx.Node) -> Optional[str]:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            return None
        try:
            path = next(reversed(stack.values()))[0]
        except (StopIteration, TypeError, IndexError):
            return None
        fqn = self.modules.get(path)
        if fqn is None:
            fqn = self.modules[path] = _fqn(str(path))
        return fqn or None


def _symbols(graph: torch.fx.Graph) -> list:
    shape_env = None
    for n in graph.nodes:
        v = n.meta.get("val")
        fm = getattr(v, "fake_mode", None)
        if fm is not None and fm.shape_env is not None:
            shape_env = fm.shape_env
            break
    if shape_env is None:
        return []

    def bound(v: Any) -> Optional[int]:
        try:
            i = int(v)
        except Exception:  # noqa: BLE001 (sympy's infinities raise AttributeError)
            return None
        return i if abs(i) < 2**62 else None

    return [(str(s), bound(r.lower), bound(r.upper)) for s, r in shape_env.var_to_range.items()]


def walk(graph: torch.fx.Graph) -> Walked:
    """The compact form of `graph` (see the module documentation). Never raises for a
    node it does not understand; raises only on a broken graph (a node whose argument is
    not in the graph)."""
    out = Walked()
    enc = _Encoder()
    # Tuple-valued nodes: their tensor outputs are named by the getitems reading them.
    getitem_name: Dict[Tuple[torch.fx.Node, int], str] = {}
    for n in graph.nodes:
        if n.target is _GETITEM and n.op == "call_function":
            src, k = n.args[0], n.args[1]
            if isinstance(src, torch.fx.Node) and type(k) is int:
                getitem_name.setdefault((src, k), n.name)
    for n in graph.nodes:
        op = n.op
        val = n.meta.get("val")
        if op == "placeholder":
            if isinstance(val, _TENSOR):
                enc.tensor_of[n] = n.name
                out.inputs.append((n.name, _DTYPE_CODES.get(val.dtype, 0), _sizes(val)))
            continue
        if op == "output":
            res = n.args[0] if n.args else ()
            for r in res if isinstance(res, (list, tuple)) else (res,):
                t = enc.tensor_of.get(r) if isinstance(r, torch.fx.Node) else None
                if isinstance(t, str):
                    out.graph_outputs.append(t)
            continue
        target = n.target
        if op == "call_function" and target is _GETITEM:
            src, k = n.args[0], n.args[1]
            names = enc.tensor_of.get(src) if isinstance(src, torch.fx.Node) else None
            if isinstance(names, list) and type(k) is int and 0 <= k < len(names) and names[k]:
                # The output this getitem names (a second getitem of the same output
                # reads the same tensor).
                enc.tensor_of[n] = names[k]
                continue
        # Outputs.
        tensors: list = []
        others = 0
        if isinstance(val, _TENSOR):
            tensors.append((n.name, _DTYPE_CODES.get(val.dtype, 0), _sizes(val)))
            enc.tensor_of[n] = n.name
        elif isinstance(val, (list, tuple)):
            names = []
            for k, v in enumerate(val):
                if isinstance(v, _TENSOR):
                    name = getitem_name.get((n, k)) or f"{n.name}__{k}"
                    tensors.append((name, _DTYPE_CODES.get(v.dtype, 0), _sizes(v)))
                    names.append(name)
                else:
                    others += 1
                    names.append(None)
            enc.tensor_of[n] = names
        else:
            others = 1
        # Target and arguments.
        if op == "call_function":
            name = _target_name(target)
            args = n.args
            if name.startswith("higher_order.auto_functionalized"):
                encoded = [("_op", K_STR, _target_name(args[0]) if args else "?")]
                encoded.extend(enc.value(k, v) for k, v in n.kwargs.items())
            else:
                names_ = enc.names_for(target, len(args))
                encoded = [enc.value(names_[i], a) for i, a in enumerate(args)]
                encoded.extend(enc.value(k, v) for k, v in n.kwargs.items())
        else:
            name = f"{op}:{target}"
            encoded = [enc.value(f"arg{i}", a) for i, a in enumerate(n.args)]
            encoded.extend(enc.value(k, v) for k, v in n.kwargs.items())
        out.names.append(n.name)
        out.targets.append(name)
        out.args.append(encoded)
        out.outputs.append((tensors, others))
        out.modules.append(enc.module(n))
    out.symbols = _symbols(graph)
    return out
