"""softmax -> topk: pick tokens from the logits, never from the full probability tensor.

The rewrite (dim d is the softmax dim and must be the dim the selection reduces):

    p = softmax(s, d)          # s = logits, maybe upcast and divided by a positive temperature
    v, i = topk(p, k, d)       # or max(p, d), argmax(p, d), argmin, min, topk(largest=False)

becomes, for k = 1 (largest; argmin for smallest):

    i = argmax(x, d, keepdim)                  # x = the logits before upcasts and temperature
    v = 1 / sum(exp(s - max(s)))               # only if v is read; float32 inside, cast like p
                                               # log_softmax: v = -log(sum(exp(s - max(s))))
                                               # probs="ones": v = 1 (0 for log_softmax)

and for k > 1:

    i = topk(x, k, d).indices
    v = exp(s[i] - max(s)) / sum(exp(s - max(s)))   # = exp(s[i] - logsumexp(s)), float32 inside

so the probability tensor is never materialised. Values go through the same casts as the original
probabilities did before the selection, so their dtype and rounding match.

Legality, checked node by node (each refusal is reported with its reason, the graph left unchanged):
  * the selection reduces exactly the softmax dim (both normalised by rank);
  * k is a Python int (not a tensor, not a symbolic size) and 1 <= k <= size of that dim when known;
  * between logits and softmax only upcasts (exact, order-preserving) and multiplications or divisions
    by a positive Python constant (a temperature) are looked through; a tensor or negative temperature
    would flip or hide the order, so it is refused;
  * between softmax and selection only floating-point casts (the values replay them);
  * topk(sorted=False) with k > 1 is refused: its order is unspecified, a rewrite could permute it;
  * every user of the selection is a getitem (values or indices).
The softmax itself stays when anything else reads it.

Results differ from the unrewritten graph only where DESIGN.md allows: rows holding NaN or +inf, and
ties that rounding creates between logits and probabilities (softmax in fp16/bf16, temperature
division): argmax then returns the true maximum of the logits; exact ties resolve to the first index
in both.

Both compiler levels are matched by one description of the rewrite (`_Match`):
  * Dynamo graphs (torch IR): torch.softmax / F.softmax / Tensor.softmax / log_softmax spellings,
    `dtype=`, casts, temperature, topk / max / min / argmax / argmin in every spelling;
  * Inductor post-grad ATen graphs, where softmax is decomposed into amax, sub, exp, sum, div (and
    Inductor's temperature form `where(finite, (x - max)/t, x/t - max(x/t))`), defaults dropped.
The ATen form reuses the graph's own exp-sum nodes for the values, so they are bit-identical there.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.fx
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensor
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from draftfuse.kernels import selection_kernels_available  # registers torch.ops.draftfuse.*
from draftfuse.passes._report import PassReport, PassResult, Refusal, Rewrite, copy_graph_module, user_location

log = logging.getLogger(__name__)
aten = torch.ops.aten
prims = torch.ops.prims

Probs = Literal["exact", "ones"]
Lowering = Literal["torch", "kernels", "auto"]
PASS_NAME = "softmax_topk"


# --------------------------------------------------------------------------------------------------
# Rules as data: how each spelling names its arguments. The matcher below is generic over them.
# A target is a callable (call_function) or a method name (call_method).

_SOFTMAX_SPELLINGS: dict[Any, tuple[tuple[str, ...], bool]] = {
    # target: (parameter names in positional order, is log_softmax)
    torch.softmax: (("input", "dim", "dtype"), False),
    torch.special.softmax: (("input", "dim", "dtype"), False),
    F.softmax: (("input", "dim", "_stacklevel", "dtype"), False),
    "softmax": (("input", "dim", "dtype"), False),
    torch.log_softmax: (("input", "dim", "dtype"), True),
    torch.special.log_softmax: (("input", "dim", "dtype"), True),
    F.log_softmax: (("input", "dim", "_stacklevel", "dtype"), True),
    "log_softmax": (("input", "dim", "dtype"), True),
    aten._softmax.default: (("input", "dim", "half_to_float"), False),
    aten._log_softmax.default: (("input", "dim", "half_to_float"), True),
    aten.softmax.int: (("input", "dim", "dtype"), False),
    aten.log_softmax.int: (("input", "dim", "dtype"), True),
}

# Selections: (parameter names, kind). kind "topk" returns (values, indices) with k kept along dim;
# "max"/"min" return (values, indices) reduced; "argmax"/"argmin" return indices only.
_SELECTION_SPELLINGS: dict[Any, tuple[tuple[str, ...], str]] = {
    torch.topk: (("input", "k", "dim", "largest", "sorted"), "topk"),
    "topk": (("input", "k", "dim", "largest", "sorted"), "topk"),
    aten.topk.default: (("input", "k", "dim", "largest", "sorted"), "topk"),
    torch.max: (("input", "dim", "keepdim"), "max"),
    "max": (("input", "dim", "keepdim"), "max"),
    aten.max.dim: (("input", "dim", "keepdim"), "max"),
    torch.min: (("input", "dim", "keepdim"), "min"),
    "min": (("input", "dim", "keepdim"), "min"),
    aten.min.dim: (("input", "dim", "keepdim"), "min"),
    torch.argmax: (("input", "dim", "keepdim"), "argmax"),
    "argmax": (("input", "dim", "keepdim"), "argmax"),
    aten.argmax.default: (("input", "dim", "keepdim"), "argmax"),
    torch.argmin: (("input", "dim", "keepdim"), "argmin"),
    "argmin": (("input", "dim", "keepdim"), "argmin"),
    aten.argmin.default: (("input", "dim", "keepdim"), "argmin"),
}
_SELECTION_DEFAULTS = {"dim": -1, "largest": True, "sorted": True, "keepdim": False}

_FLOAT_METHOD_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}

# Multiplications and divisions of a tensor (first argument) by something: what factor they apply.
# A zero divisor gives NaN, which the legality check refuses like any factor that is not positive.
def _reciprocal(c: float) -> float:
    return 1.0 / c if c else float("nan")


def _same(c: float) -> float:
    return c


_SCALES: dict[Any, Callable[[float], float]] = {
    operator.truediv: _reciprocal, torch.div: _reciprocal, torch.true_divide: _reciprocal,
    "div": _reciprocal, "true_divide": _reciprocal, aten.div.Tensor: _reciprocal, aten.div.Scalar: _reciprocal,
    operator.mul: _same, torch.mul: _same, "mul": _same, aten.mul.Tensor: _same, aten.mul.Scalar: _same,
}  # fmt: skip
_COMMUTATIVE = {operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar}


def _target_key(node: torch.fx.Node) -> Any:
    return node.target if node.op in ("call_function", "call_method") else None


def _bind(node: torch.fx.Node, names: Sequence[str]) -> dict[str, Any] | None:
    """Positional and keyword arguments of `node` by parameter name; None if they do not fit."""
    if len(node.args) > len(names):
        return None
    bound = dict(zip(names, node.args))
    for key, value in node.kwargs.items():
        if key not in names or key in bound:
            return None  # an unknown keyword (out=, rounding_mode=...) is not understood
        bound[key] = value
    return bound


def _val(node: Any) -> torch.Tensor | None:
    """The fake tensor a node carries (Dynamo: example_value, ATen: val)."""
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("val", node.meta.get("example_value"))
    return value if isinstance(value, torch.Tensor) else None


def _normalise_dim(dim: Any, rank: int | None) -> int | None:
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return None
        dim = dim[0]
    if not isinstance(dim, int) or isinstance(dim, bool) or rank is None:
        return None
    if not -max(rank, 1) <= dim < max(rank, 1):
        return None
    return dim % max(rank, 1)


def _as_cast(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.dtype] | None:
    """(input, dtype) if `node` only converts a tensor's dtype."""
    key = _target_key(node)
    if key in _FLOAT_METHOD_CASTS and len(node.args) == 1 and not node.kwargs:
        return node.args[0], _FLOAT_METHOD_CASTS[key]
    if key in ("to", "type") and len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs:
        return node.args[0], node.args[1]
    if key == "to" and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.args[0], node.kwargs["dtype"]
    if key is prims.convert_element_type.default:
        return node.args[0], node.args[1]
    if key is aten._to_copy.default and set(node.kwargs) <= {"dtype"} and len(node.args) == 1 and "dtype" in node.kwargs:
        return node.args[0], node.kwargs["dtype"]
    return None


def _is_upcast(src: torch.dtype | None, dst: torch.dtype) -> bool:
    """Converting src to dst keeps every value exactly (so order and ties are kept)."""
    if src is None or not src.is_floating_point or not dst.is_floating_point:
        return False
    return src == dst or (torch.finfo(dst).bits > torch.finfo(src).bits and torch.finfo(dst).max >= torch.finfo(src).max)


def _as_scale(node: torch.fx.Node) -> tuple[torch.fx.Node, Any] | None:
    """(input, factor) if `node` multiplies or divides a tensor; the factor is a Node when not constant."""
    key = _target_key(node)
    if key not in _SCALES or len(node.args) != 2 or node.kwargs:
        return None  # rounding_mode= and friends are not scalings
    tensor, other = node.args
    if key in _COMMUTATIVE and not isinstance(tensor, torch.fx.Node):
        tensor, other = other, tensor  # 2.0 * x
    if not isinstance(tensor, torch.fx.Node):
        return None  # c / x is not a scaling of x
    if isinstance(other, torch.fx.Node):
        return tensor, other
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return tensor, _SCALES[key](float(other))
    return None


class _Refuse(Exception):
    """Internal: a near-match that must not be rewritten; the message is the reason."""


# --------------------------------------------------------------------------------------------------
# The shared description of one rewrite.


@dataclasses.dataclass
class _Selection:
    node: torch.fx.Node
    kind: str  # topk | max | min | argmax | argmin
    input: torch.fx.Node
    dim: Any
    k: Any
    largest: bool
    keepdim: bool
    sorted: bool


@dataclasses.dataclass
class _Match:
    selection: _Selection
    dim: int  # normalised
    k: int
    log: bool  # log_softmax
    logits: torch.fx.Node  # what the indices are taken from (upcasts and temperature peeled)
    softmax_out: torch.fx.Node  # the node whose value is the probabilities (before the casts below)
    prob_dtype: torch.dtype  # dtype of softmax_out
    prob_casts: list[torch.dtype]  # casts between softmax and selection, in order
    parts: _SoftmaxParts  # where the values come from
    scaled: bool  # a temperature was looked through between logits and softmax
    matched: list[torch.fx.Node]  # nodes of the original pattern, for the report and clean-up


class _SoftmaxParts:
    """The pieces of softmax(s) that the values need: z = s - max(s) and sum(exp(z)), float32 inside.

    On a Dynamo graph they are emitted next to the selection; on a post-grad ATen graph the
    decomposed softmax already computes them and they are reused as they are.
    """

    def __init__(self, emit: _Emitter, scores: torch.fx.Node | None, dim: int, *, scores_dtype=None, z=None, sum_exp=None, log_sum=None):
        self.emit, self.scores, self.dim, self.scores_dtype = emit, scores, dim, scores_dtype
        self._z, self._sum_exp, self._log_sum = z, sum_exp, log_sum

    def z(self) -> torch.fx.Node:
        if self._z is None:
            s = self.scores
            if self.scores_dtype not in (None, self.emit.dtype_of(s)):  # softmax(x, dtype=d) computes on x.to(d)
                s = self.emit.call("cast", s, self.scores_dtype)
            s = self.emit.to_compute_dtype(s)
            self._z = self.emit.call("sub", s, self.emit.call("amax", s, self.dim, True))
        return self._z

    def sum_exp(self) -> torch.fx.Node:
        if self._sum_exp is None:
            self._sum_exp = self.emit.call("sum", self.emit.call("exp", self.z()), self.dim, True)
        return self._sum_exp

    def log_sum(self) -> torch.fx.Node:
        if self._log_sum is None:
            self._log_sum = self.emit.call("log", self.sum_exp())
        return self._log_sum


# --------------------------------------------------------------------------------------------------
# Emitters: the same few operations, spelled for each level. New nodes carry fake values (so later
# passes and Inductor see shapes and dtypes) and the selection's stack trace (provenance).


class _Emitter:
    level: str
    meta_key: str
    ops: dict[str, Callable]

    def __init__(self, graph: torch.fx.Graph, origin: torch.fx.Node):
        self.graph = graph
        self.origin = origin  # the selection being replaced: new nodes take its stack trace
        self.cursor = origin  # new nodes go after this one, in order; the caller moves it

    def _fake(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """The new node's fake value, computed from its inputs' fake values (None when they have none)."""
        inputs: list[torch.fx.Node] = []
        torch.fx.node.map_arg((args, kwargs), inputs.append)
        values = [a.meta.get(self.meta_key) for a in inputs]
        # The inputs' own fake mode: inside a compile the tracing context holds another one.
        # (a constant such as full() has no tensor inputs: the selection's fake mode serves)
        leaves = torch.utils._pytree.tree_leaves([*values, self.origin.meta.get(self.meta_key)])
        fake_mode = next((v.fake_mode for v in leaves if isinstance(v, FakeTensor)), None)
        if fake_mode is None or any(v is None for v in values):
            return None
        fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda a: a.meta[self.meta_key])
        with fake_mode:
            return fn(*fake_args, **fake_kwargs)

    def _node(self, op: str, target: Any, fn: Callable, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
        kwargs = kwargs or {}
        with self.graph.inserting_after(self.cursor):
            node = self.graph.create_node(op, target, args, kwargs)
        self.cursor = node
        value = self._fake(fn, args, kwargs)
        if value is not None:
            node.meta[self.meta_key] = value
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in self.origin.meta:
                node.meta[key] = self.origin.meta[key]
        node.meta["draftfuse_provenance"] = f"{PASS_NAME}: replaces {self.origin.name}"
        return node

    def call(self, name: str, *args: Any) -> torch.fx.Node:
        raise NotImplementedError

    def dtype_of(self, node: torch.fx.Node) -> torch.dtype | None:
        value = node.meta.get(self.meta_key)
        return value.dtype if isinstance(value, torch.Tensor) else None

    def to_compute_dtype(self, node: torch.fx.Node) -> torch.fx.Node:
        """float32 for half types and float32, float64 for float64: the precision softmax computes in."""
        dtype = self.dtype_of(node)
        target = torch.float64 if dtype == torch.float64 else torch.float32
        return node if dtype == target else self.call("cast", node, target)


class _TorchEmitter(_Emitter):
    """Dynamo graphs: torch functions and Tensor methods, as a user would write them."""

    level, meta_key = "dynamo", "example_value"

    def call(self, name: str, *args: Any) -> torch.fx.Node:
        if name == "cast":
            x, dtype = args
            return self._node("call_method", "to", lambda t, d: t.to(d), (x, dtype))
        if name == "getitem":
            return self._node("call_function", operator.getitem, operator.getitem, args)
        fn, kw = {
            "argmax": (torch.argmax, ("dim", "keepdim")),
            "argmin": (torch.argmin, ("dim", "keepdim")),
            "topk": (torch.topk, ("k", "dim", "largest", "sorted")),
            "amax": (torch.amax, ("dim", "keepdim")),
            "sum": (torch.sum, ("dim", "keepdim")),
            "sub": (torch.sub, ()),
            "div": (torch.div, ()),
            "exp": (torch.exp, ()),
            "log": (torch.log, ()),
            "neg": (torch.neg, ()),
            "reciprocal": (torch.reciprocal, ()),
            "gather": (torch.gather, ("dim", "index")),
            "squeeze": (torch.squeeze, ("dim",)),
            "unsqueeze": (torch.unsqueeze, ("dim",)),
            "argmax_prob": (torch.ops.draftfuse.argmax_prob.default, ("log",)),
            "topk_prob": (torch.ops.draftfuse.topk_prob.default, ("k", "log")),
            "ones_like": (torch.ones_like, ()),
            "zeros_like": (torch.zeros_like, ()),
        }[name]
        positional = args[: len(args) - len(kw)]
        kwargs = dict(zip(kw, args[len(args) - len(kw) :]))
        if name in ("ones_like", "zeros_like"):
            positional, kwargs = args[:1], {"dtype": args[1]}
        return self._node("call_function", fn, fn, positional, kwargs)


class _AtenEmitter(_Emitter):
    """Post-grad graphs: ATen overloads with every argument given, as Inductor expects."""

    level, meta_key = "aten", "val"

    def _static_shape(self, node: torch.fx.Node) -> list[int]:
        return [int(size) for size in node.meta["val"].shape]  # _values checks _has_static_shape first

    def _like(self, node: torch.fx.Node, dtype: torch.dtype) -> dict:
        device = node.meta["val"].device
        return {"dtype": dtype, "layout": torch.strided, "device": device, "pin_memory": False}

    def call(self, name: str, *args: Any) -> torch.fx.Node:
        spelled = {
            "cast": lambda x, d: (prims.convert_element_type.default, (x, d)),
            "getitem": lambda x, i: (operator.getitem, (x, i)),
            "argmax": lambda x, d, kd: (aten.argmax.default, (x, d, kd)),
            "argmin": lambda x, d, kd: (aten.argmin.default, (x, d, kd)),
            "topk": lambda x, k, d, lg, s: (aten.topk.default, (x, k, d, lg, s)),
            "amax": lambda x, d, kd: (aten.amax.default, (x, [d], kd)),
            "sum": lambda x, d, kd: (aten.sum.dim_IntList, (x, [d], kd)),
            "sub": lambda a, b: (aten.sub.Tensor, (a, b)),
            "div": lambda a, b: (aten.div.Tensor, (a, b)),
            "exp": lambda x: (aten.exp.default, (x,)),
            "log": lambda x: (aten.log.default, (x,)),
            "neg": lambda x: (aten.neg.default, (x,)),
            "reciprocal": lambda x: (aten.reciprocal.default, (x,)),
            "gather": lambda x, d, i: (aten.gather.default, (x, d, i)),
            "squeeze": lambda x, d: (aten.squeeze.dim, (x, d)),
            "unsqueeze": lambda x, d: (aten.unsqueeze.default, (x, d)),
            "argmax_prob": lambda x, lg: (torch.ops.draftfuse.argmax_prob.default, (x, lg)),
            "topk_prob": lambda x, k, lg: (torch.ops.draftfuse.topk_prob.default, (x, k, lg)),
            # post-grad graphs are decomposed: full_like is gone, full is what Inductor lowers
            "ones_like": lambda x, dt: (aten.full.default, (self._static_shape(x), 1.0), self._like(x, dt)),
            "zeros_like": lambda x, dt: (aten.full.default, (self._static_shape(x), 0.0), self._like(x, dt)),
        }[name](*args)
        target, targs = spelled[0], spelled[1]
        kwargs = spelled[2] if len(spelled) > 2 else {}
        return self._node("call_function", target, target, targs, kwargs)


# --------------------------------------------------------------------------------------------------
# Recognisers: graph -> _Match (or _Refuse with a reason). One per level for the softmax itself;
# the selection, the casts and the temperature are recognised the same way at both levels.


def _as_selection(node: torch.fx.Node) -> _Selection | None:
    spelling = _SELECTION_SPELLINGS.get(_target_key(node))
    if spelling is None:
        return None
    names, kind = spelling
    bound = _bind(node, names)
    if bound is None or not isinstance(bound.get("input"), torch.fx.Node):
        return None
    if kind in ("max", "min") and "dim" not in bound:
        return None  # full reduction: not a selection along a dim
    if kind in ("max", "min") and isinstance(bound["dim"], torch.fx.Node):
        return None  # torch.max(a, b) is elementwise
    get = lambda name: bound.get(name, _SELECTION_DEFAULTS.get(name))  # noqa: E731
    if kind in ("argmax", "argmin") and get("dim") is None:
        return None  # argmax over the flattened tensor
    return _Selection(
        node=node, kind=kind, input=bound["input"], dim=get("dim"),
        k=bound.get("k", 1), largest=get("largest") if kind == "topk" else kind in ("max", "argmax"),
        keepdim=True if kind == "topk" else get("keepdim"), sorted=get("sorted") if kind == "topk" else True,
    )  # fmt: skip


def _peel_casts_after_softmax(sel: _Selection) -> tuple[torch.fx.Node, list[torch.dtype], list[torch.fx.Node]]:
    """Walk from the selection's input back through float casts; returns (node, casts in order, cast nodes)."""
    node, casts, cast_nodes = sel.input, [], []
    while (cast := _as_cast(node)) is not None:
        src, dtype = cast
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise _Refuse(f"cast to {dtype} between softmax and selection changes the order")
        casts.insert(0, dtype)
        cast_nodes.append(node)
        node = src
    return node, casts, cast_nodes


def _peel_logits(scores: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """From the softmax input back to the logits through exact upcasts and positive constant scales."""
    node, peeled = scores, []
    while True:
        if (cast := _as_cast(node)) is not None:
            src, dtype = cast
            src_val = _val(src)
            if not _is_upcast(src_val.dtype if src_val is not None else None, dtype):
                return node, peeled  # a downcast may merge values: select on what softmax saw
            peeled.append(node)
            node = src
        elif (scale := _as_scale(node)) is not None:
            src, factor = scale
            if isinstance(factor, torch.fx.Node):
                raise _Refuse(f"temperature {factor.name} is a tensor whose sign is not known")
            if not factor > 0:  # also refuses NaN
                raise _Refuse(f"temperature factor {factor} is not positive")
            peeled.append(node)
            node = src
        else:
            return node, peeled


def _match_dynamo_softmax(node: torch.fx.Node, emit: _Emitter) -> tuple[torch.fx.Node, int, bool, _SoftmaxParts] | None:
    """softmax spelled as one call: (scores, dim, log, parts)."""
    spelling = _SOFTMAX_SPELLINGS.get(_target_key(node))
    if spelling is None:
        return None
    names, is_log = spelling
    bound = _bind(node, names)
    if bound is None or not isinstance(bound.get("input"), torch.fx.Node):
        raise _Refuse(f"{node.name}: softmax arguments not understood")
    scores = bound["input"]
    if bound.get("dim") is None:
        raise _Refuse(f"{node.name}: softmax without an explicit dim")
    val = _val(scores)
    dim = _normalise_dim(bound["dim"], val.dim() if val is not None else None)
    if dim is None:
        raise _Refuse(f"{node.name}: softmax dim {bound['dim']!r} is not a known constant")
    dtype = bound.get("dtype")
    if dtype is not None and val is not None and not _is_upcast(val.dtype, dtype):
        raise _Refuse(f"{node.name}: softmax dtype={dtype} is narrower than its input {val.dtype}")
    return scores, dim, is_log, _SoftmaxParts(emit, scores, dim, scores_dtype=dtype)


def _match_aten_softmax(node: torch.fx.Node, emit: _Emitter) -> tuple[torch.fx.Node, int, bool, _SoftmaxParts] | None:
    """Decomposed softmax: div(exp(z), sum(exp(z), [d], True)) or log_softmax: sub(z, log(sum(exp(z))))
    with z = sub(s, amax(s, [d], True)) or Inductor's temperature form where(c, z1, z2)."""
    if _target_key(node) is aten.div.Tensor:
        numerator, denominator = node.args
        is_log = False
        exp = numerator
        if not (_is_call(exp, aten.exp.default) and _is_call(denominator, aten.sum.dim_IntList)):
            return None
        if denominator.args[0] is not exp:
            return None
        sum_node, log_node = denominator, None
    elif _target_key(node) is aten.sub.Tensor and _is_call(node.args[1], aten.log.default):
        is_log = True
        log_node = node.args[1]
        sum_node = log_node.args[0]
        if not _is_call(sum_node, aten.sum.dim_IntList) or not _is_call(sum_node.args[0], aten.exp.default):
            return None
        exp = sum_node.args[0]
        if exp.args[0] is not node.args[0]:
            return None
    else:
        return None
    z = exp.args[0]
    if len(sum_node.args) < 3 or sum_node.args[2] is not True:
        return None
    val = _val(z)
    dim = _normalise_dim(sum_node.args[1], val.dim() if val is not None else None)
    if dim is None:
        raise _Refuse(f"{node.name}: softmax reduces {sum_node.args[1]!r}, not one known dim")
    scores = _max_subtracted_input(z, dim)
    if scores is None:
        raise _Refuse(f"{node.name}: exp input {z.name} is not recognised as s - max(s)")
    return scores, dim, is_log, _SoftmaxParts(emit, None, dim, z=z, sum_exp=sum_node, log_sum=log_node)


def _is_call(node: Any, target: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _max_subtracted_input(z: torch.fx.Node, dim: int) -> torch.fx.Node | None:
    """The tensor s in z = s - amax(s, [dim], True), seen through Inductor's temperature rewrite."""
    if _is_call(z, aten.sub.Tensor):
        s, row_max = z.args
        if _is_call(row_max, aten.amax.default) and row_max.args[0] is s and _normalise_dim(row_max.args[1], _rank(s)) == dim:
            return s
        return None
    if _is_call(z, aten.div.Tensor):
        # (x - max(x)) / t: for t > 0, z's order is x's order and its max is still 0 (exp(0) = 1)
        divisor = z.args[1]
        if isinstance(divisor, torch.fx.Node):
            raise _Refuse(f"temperature {divisor.name} is a tensor whose sign is not known")
        if not (isinstance(divisor, (int, float)) and divisor > 0):
            raise _Refuse(f"temperature {divisor} is not positive")
        return _max_subtracted_input(z.args[0], dim)
    if _is_call(z, aten.where.self):
        # Inductor rewrites softmax(x / t) as where(all finite, (x - max(x)) / t, x / t - max(x / t)):
        # both branches are an order-preserving function of the same logits, with row maximum 0.
        a, b = (_max_subtracted_input(branch, dim) for branch in z.args[1:])
        if a is None or b is None:
            return None
        base_a, _ = _peel_logits(a)
        base_b, _ = _peel_logits(b)
        return b if base_a is base_b else None
    return None


def _rank(node: Any) -> int | None:
    val = _val(node)
    return val.dim() if val is not None else None


def _is_softmax(node: Any, level: str) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if level == "dynamo":
        return _target_key(node) in _SOFTMAX_SPELLINGS
    try:
        return _match_aten_softmax(node, _AtenEmitter(node.graph, node)) is not None
    except _Refuse:
        return True


def _mutation_between(first: torch.fx.Node, last: torch.fx.Node) -> torch.fx.Node | None:
    """An in-place op strictly between two nodes of a Dynamo graph (these graphs are not functional)."""
    node = first.next
    while node is not last and node.op != "root":
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op in ("call_method", "call_function") and isinstance(name, str):
            if (name.endswith("_") and not name.startswith("__")) or node.target is operator.setitem:
                return node
        node = node.next
    return None


def _match(sel: _Selection, emit: _Emitter) -> _Match | None:
    """The rewrite for one selection node; None if its input is no softmax; _Refuse for near-matches."""
    probs_node, casts, cast_nodes = _peel_casts_after_softmax(sel)
    recognise = _match_dynamo_softmax if emit.level == "dynamo" else _match_aten_softmax
    found = recognise(probs_node, emit)
    if found is None:
        behind = [a for a in probs_node.args if _is_softmax(a, emit.level)]
        if probs_node.op != "placeholder" and behind:
            raise _Refuse(f"{probs_node.name} ({probs_node.target}) between softmax and selection is not understood")
        return None
    scores, sm_dim, is_log, parts = found
    sel_dim = _normalise_dim(sel.dim, _rank(sel.input))
    if sel_dim is None:
        raise _Refuse(f"selection dim {sel.dim!r} is not a known constant")
    if sel_dim != sm_dim:
        raise _Refuse(f"softmax over dim {sm_dim} but selection over dim {sel_dim}")
    k = sel.k
    if isinstance(k, torch.fx.Node) or isinstance(k, torch.SymInt) or not isinstance(k, int) or isinstance(k, bool):
        raise _Refuse(f"k={k} is not a known constant")
    size = _val(sel.input).shape[sel_dim] if _val(sel.input) is not None else None
    if k < 1 or (isinstance(size, int) and k > size):
        raise _Refuse(f"k={k} is outside 1..{size}")
    if sel.kind == "topk" and k > 1 and not sel.sorted:
        raise _Refuse("topk(sorted=False): its order is unspecified, a rewrite could permute it")
    for user in sel.node.users:
        if sel.kind in ("argmax", "argmin"):
            break
        if not (_is_call(user, operator.getitem) and user.args[1] in (0, 1)):
            raise _Refuse(f"selection result used as a whole by {user.name}")
    logits, peeled = _peel_logits(scores)
    if emit.level == "dynamo" and (mutated := _mutation_between(logits, probs_node)) is not None:
        raise _Refuse(f"in-place {mutated.name} between logits {logits.name} and softmax {probs_node.name}")
    prob_val = _val(probs_node)
    if prob_val is None or _val(logits) is None:
        raise _Refuse("no tensor metadata on the graph (capture with Dynamo or run ShapeProp first)")
    return _Match(
        selection=sel, dim=sel_dim, k=k, log=is_log, logits=logits, softmax_out=probs_node,
        prob_dtype=prob_val.dtype, prob_casts=casts, parts=parts, scaled=any(_as_scale(n) for n in peeled),
        matched=[sel.node, *cast_nodes, probs_node, *peeled],
    )  # fmt: skip


def _values(m: _Match, emit: _Emitter, index_keepdim: torch.fx.Node | None, probs: Probs) -> torch.fx.Node:
    """The probabilities (or log-probabilities) the selection returned, without the probability tensor."""
    sel, parts = m.selection, m.parts
    keep = sel.keepdim
    if m.k == 1 and probs == "ones" and _has_static_shape(index_keepdim):
        # greedy chains that never read the probabilities: the constant the caller asked for
        value = emit.call("zeros_like" if m.log else "ones_like", index_keepdim, m.prob_dtype)
    elif m.k == 1 and sel.largest:
        # the row maximum of z = s - max(s) is exactly 0 and exp(0) = 1, so p_max = 1 / sum(exp(z))
        value = emit.call("neg", parts.log_sum()) if m.log else emit.call("reciprocal", parts.sum_exp())
    else:
        picked = emit.call("gather", parts.z(), m.dim, index_keepdim)
        if m.log:
            value = emit.call("sub", picked, parts.log_sum())
        else:
            value = emit.call("div", emit.call("exp", picked), parts.sum_exp())
    if m.k == 1 and not keep:
        value = emit.call("squeeze", value, m.dim)
    if emit.dtype_of(value) != m.prob_dtype:
        value = emit.call("cast", value, m.prob_dtype)
    for dtype in m.prob_casts:  # replay the casts the probabilities went through
        value = emit.call("cast", value, dtype)
    return value


def _has_static_shape(node: torch.fx.Node) -> bool:
    # a constant of a symbolic shape would need the size nodes: exact values are cheap enough there
    value = _val(node)
    return value is not None and all(isinstance(size, int) for size in value.shape)


def _kernel_choice(m: _Match, wants_values: bool, lowering: Lowering) -> tuple[bool, str]:
    """Whether to select with draftfuse's kernels (torch.ops.draftfuse.*), and if not, why."""
    if lowering == "torch":
        return False, ""
    logits = _val(m.logits)
    reasons = [
        (m.dim != logits.dim() - 1, "the kernels reduce the last dim"),
        (not m.selection.largest, "the kernels select the largest"),
        # the kernels' probabilities are softmax(logits): a temperature in between would change them
        (wants_values and m.scaled, "values under a temperature"),
        (wants_values and m.prob_dtype == torch.float64, "the kernels' probabilities are float32"),
        (lowering == "auto" and not selection_kernels_available(logits.device, logits.dtype, m.k, logits.stride(-1) == 1),
         f"no kernel for {logits.dtype} k={m.k} on {logits.device.type} (needs CUDA, Triton, k <= 16)"),
    ]  # fmt: skip
    why = [reason for failed, reason in reasons if failed]
    return not why, "; ".join(why)


def _select_with_kernel(m: _Match, emit: _Emitter, wants_values: bool, probs: Probs):
    """(index, values or None) from one draftfuse selection op, which reads the logits once."""
    sel = m.selection
    if m.k == 1:  # argmax_prob reduces the dim away: put it back for topk and keepdim=True
        out = emit.call("argmax_prob", m.logits, m.log)
        index = emit.call("getitem", out, 0)
        index = emit.call("unsqueeze", index, m.dim) if sel.keepdim else index
        if not wants_values:
            return index, None
        prob = emit.call("getitem", out, 1)
        prob = emit.call("unsqueeze", prob, m.dim) if sel.keepdim else prob
    else:
        out = emit.call("topk_prob", m.logits, m.k, m.log)
        index = emit.call("getitem", out, 1)
        if not wants_values:
            return index, None
        prob = emit.call("getitem", out, 0)
    if m.k == 1 and probs == "ones":
        prob = emit.call("zeros_like" if m.log else "ones_like", index, torch.float32)
    if emit.dtype_of(prob) != m.prob_dtype:
        prob = emit.call("cast", prob, m.prob_dtype)
    for dtype in m.prob_casts:  # replay the casts the probabilities went through
        prob = emit.call("cast", prob, dtype)
    return index, prob


def _apply(m: _Match, emit: _Emitter, probs: Probs, lowering: Lowering, erased: set[torch.fx.Node]) -> Rewrite:
    """Rewrite one match in place; the nodes it erases are added to `erased`."""
    sel = m.selection
    graph = sel.node.graph
    getitems = {0: [], 1: []}
    for user in list(sel.node.users):
        if sel.kind not in ("argmax", "argmin"):
            getitems[user.args[1]].append(user)
    wants_values = bool(getitems[0])
    use_kernel, why_not = _kernel_choice(m, wants_values, lowering)
    value = None
    if use_kernel:
        index, value = _select_with_kernel(m, emit, wants_values, probs)
        op = "draftfuse.argmax_prob" if m.k == 1 else "draftfuse.topk_prob"
        rule = f"{'log_' if m.log else ''}softmax+{sel.kind}(k={m.k}) -> {op}"
    elif m.k == 1:
        pick = "argmax" if sel.largest else "argmin"
        needs_keepdim_index = wants_values and (probs == "ones" or not sel.largest)
        if sel.keepdim or not needs_keepdim_index:
            index = index_keepdim = emit.call(pick, m.logits, m.dim, sel.keepdim)
        else:  # the values gather along dim: take the index with the dim kept, then drop it
            index_keepdim = emit.call(pick, m.logits, m.dim, True)
            index = emit.call("squeeze", index_keepdim, m.dim)
        rule = f"{'log_' if m.log else ''}softmax+{sel.kind}(k=1) -> {pick}"
    else:
        topk = emit.call("topk", m.logits, m.k, m.dim, sel.largest, True)
        index = index_keepdim = emit.call("getitem", topk, 1)
        rule = f"{'log_' if m.log else ''}softmax+topk(k={m.k}) -> topk(logits)"
    detail = f"dim={m.dim}, logits={m.logits.name}"
    if sel.kind in ("argmax", "argmin"):
        sel.node.replace_all_uses_with(index)
    else:
        for user in getitems[1]:
            user.replace_all_uses_with(index)
        if wants_values:
            value = value if use_kernel else _values(m, emit, index_keepdim, probs)
            for user in getitems[0]:
                user.replace_all_uses_with(value)
            source = "the kernel" if use_kernel else "exp-sum"
            exact = "ones" if (probs == "ones" and m.k == 1) else ("log-probs" if m.log else "probs") + f" from {source}"
            detail += f", values={exact}"
    if why_not:
        detail += f", torch form: {why_not}"
    # Erase what the rewrite replaced, one node at a time and only once unused: Dynamo graphs are not
    # functional (in-place calls look pure to FX), so graph-wide dead-code elimination is unsafe there.
    for node in [*getitems[0], *getitems[1], *m.matched]:
        if not node.users and node.op != "placeholder":
            graph.erase_node(node)
            erased.add(node)
    counters["draftfuse"][f"{PASS_NAME}.{'k1' if m.k == 1 else 'topk'}"] += 1
    return Rewrite(rule, tuple(n.name for n in m.matched if n.op != "placeholder"), detail)


def _level(graph: torch.fx.Graph) -> str:
    # Dynamo records fake values as "example_value", AOT and Inductor as "val"
    return "dynamo" if any("example_value" in n.meta for n in graph.nodes) else "aten"


def _rewrite_graph(graph: torch.fx.Graph, *, probs: Probs, lowering: Lowering, level: str) -> PassReport:
    report = PassReport(PASS_NAME)
    emitter_cls = _AtenEmitter if level == "aten" else _TorchEmitter
    parts_by_softmax: dict[torch.fx.Node, _SoftmaxParts] = {}
    erased: set[torch.fx.Node] = set()
    for node in list(graph.nodes):
        if node in erased:  # replaced by an earlier rewrite (getitems of a selection, say)
            continue
        sel = _as_selection(node)
        if sel is None:
            continue
        try:
            match = _match(sel, emitter_cls(graph, node))
        except _Refuse as refusal:
            report.refusals.append(Refusal(node.name, str(refusal), user_location(node)))
            continue
        if match is None:
            continue
        # New nodes go right after the softmax (after those of earlier rewrites of the same softmax):
        # on a Dynamo graph the logits may be written in place later, and the softmax is where they
        # held the values the selection saw. Rewrites of one softmax share its exp-sum nodes.
        if match.softmax_out not in parts_by_softmax:
            match.parts.emit.cursor = match.softmax_out
            parts_by_softmax[match.softmax_out] = match.parts
        match.parts = parts_by_softmax[match.softmax_out]
        emit = match.parts.emit
        emit.origin = node
        report.rewrites.append(_apply(match, emit, probs, lowering, erased))
    if level == "aten":
        graph.eliminate_dead_code()  # post-grad graphs are functional: safe here, and only here
    if probs == "ones":
        report.notes.append('probs="ones": k = 1 values are the constant 1 (0 for log_softmax)')
    return report


def rewrite_softmax_topk(gm: torch.fx.GraphModule, *, probs: Probs = "exact", lowering: Lowering = "torch") -> PassResult:
    """Rewrite every softmax -> topk/max/argmax selection of `gm` to select on the logits.

    Works on Dynamo graphs and on ATen graphs (detected from the graph). Returns a new GraphModule
    (`gm` is untouched) and a report of each rewrite and each refused near-match. Never raises on a
    graph it does not understand: such a graph comes back unchanged.
    """
    _check_options(probs, lowering)
    new_gm = copy_graph_module(gm)
    level = _level(new_gm.graph)
    logging_graphs = log.isEnabledFor(logging.INFO)  # printing a graph costs time: only when shown
    if logging_graphs:
        log.info("%s: %s graph before:\n%s", PASS_NAME, level, new_gm.print_readable(print_output=False))
    report = _rewrite_graph(new_gm.graph, probs=probs, lowering=lowering, level=level)
    new_gm.graph.lint()
    new_gm.recompile()
    if logging_graphs:
        log.info("%s\n%s graph after:\n%s", report, level, new_gm.print_readable(print_output=False))
    return PassResult(new_gm, report)


def _check_options(probs: str, lowering: str) -> None:
    if probs not in ("exact", "ones"):
        raise ValueError(f'draftfuse: probs must be "exact" or "ones", not {probs!r}')
    if lowering not in ("torch", "kernels", "auto"):
        raise ValueError(f'draftfuse: lowering must be "torch", "kernels" or "auto", not {lowering!r}')


class SoftmaxTopkPostGradPass(CustomGraphPass):
    """The same rewrite on Inductor's post-grad ATen graph, for `post_grad_custom_pre_pass`.

    Its uuid covers this file and every option, so the FX graph cache keys on them; on a cache hit
    Inductor does not call the pass at all, so `last_report` is then None.
    """

    def __init__(self, probs: Probs = "exact", lowering: Lowering = "torch") -> None:
        _check_options(probs, lowering)
        self.probs, self.lowering = probs, lowering
        self.last_report: PassReport | None = None

    def __call__(self, graph: torch.fx.Graph) -> None:
        log.info("%s: post-grad graph before:\n%s", PASS_NAME, graph)
        self.last_report = _rewrite_graph(graph, probs=self.probs, lowering=self.lowering, level="aten")
        graph.lint()
        log.info("%s\npost-grad graph after:\n%s", self.last_report, graph)

    def uuid(self) -> Any:
        return (get_hash_for_files((__file__,)), self.probs, self.lowering)
