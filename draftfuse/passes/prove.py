"""Integer index arithmetic of a functional ATen graph as exact expressions, and proofs of equality.

`Expressions(graph)` writes the elementwise value of each integer node as a sympy expression over
symbols, one symbol per leaf node (an input, or a value not translated), with the range of each
symbol. Integer tensors wrap around in their dtype, so an expression E of a node of dtype d means
"the value is E modulo 2**bits(d)", and "exactly E" where the ranges prove E fits d. Then:

  * +, -, * and negation are exact modulo 2**bits: a node computed by them from operands of its own
    dtype translates as it is, wrapped or not, since two expressions sympy proves identical are then
    equal modulo 2**bits: equal values. An operand of a narrower dtype is sign-extended first, which
    is its expression only if that operand provably fits its own dtype;
  * a cast to a narrower or equal dtype keeps the expression (truncation respects the ring); a cast to
    a wider one needs its operand to fit its own dtype;
  * clamp, maximum/minimum, floor division and modulo by a positive constant decide by the operands'
    true values: they translate only when every operand provably fits its own dtype and the result's
    (torch converts each operand to the result's dtype first: a 0-d int64 limit of 2**32 - 1 is -1 to
    an int32 tensor, and `x % 300` divides a uint8 tensor by 44);
  * everything else, bool tensors (their arithmetic saturates) and floating point (not associative)
    are leaves. Operands must have the result's shape or one element, so that one symbol always stands
    for the element at the same index. There is no equality from printing: each leaf is its own symbol.
Symbolic sizes are int64. The proof compares expressions of two nodes of the same dtype only.

Ranges come from dtypes, the ShapeEnv (symbolic sizes), producers (`arange(start, end)` when it fits its
dtype; indices chosen along a dim of size n are in [0, n - 1]; a view or copy has its source's range when
the source fits its dtype, not after a narrowing cast), and the caller
(`draftfuse::assume_range` on an input, which fold() puts there for `value_ranges`).

`prove_equal(a, b, ranges)`: first decide each max/min/modulo/floor division the ranges decide
(Max(s - 1, 0) is s - 1 for s >= 1), then the difference must cancel exactly (equal), or be a nonzero
constant (always different); anything else is not proven. A sympy error in a decision raises
ProofError: not proven, and the report says so.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._sympy.functions import FloorDiv, Max, Min, PythonMod
from torch.utils._sympy.value_ranges import ValueRangeError, ValueRanges, bound_sympy

from draftfuse.graph.selection import as_selection
from draftfuse.graph.values import Node, fake, fake_tensor, is_integer, same_sizes

aten = torch.ops.aten
prims = torch.ops.prims

_ADD = {aten.add.Tensor, aten.add.Scalar}
_SUB = {aten.sub.Tensor, aten.sub.Scalar}
_MUL = {aten.mul.Tensor, aten.mul.Scalar}
_CLAMPS = {
    aten.clamp.default: ("input", "min", "max"), aten.clamp.Tensor: ("input", "min", "max"),
    aten.clamp_min.default: ("input", "min"), aten.clamp_min.Tensor: ("input", "min"),
    aten.clamp_max.default: ("input", "max"), aten.clamp_max.Tensor: ("input", "max"),
}  # fmt: skip
# Ops that keep each element's value but move it to another index: the result is a leaf whose range
# is the source's.
_REARRANGE = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.permute.default,
    aten.slice.Tensor, aten.select.int, aten.alias.default, aten.t.default, aten.clone.default,
}  # fmt: skip


class ProofError(Exception):
    """sympy failed on a decision (comparisons it cannot make): the proof is not made."""


def dtype_range(dtype: torch.dtype) -> ValueRanges:
    info = torch.iinfo(dtype)
    return ValueRanges(info.min, info.max)


INT64 = dtype_range(torch.int64)


def bound(expr: sympy.Expr, ranges: Mapping[sympy.Symbol, ValueRanges]) -> ValueRanges | None:
    try:
        return bound_sympy(expr, dict(ranges))
    except Exception:  # sympy cannot bound it: nothing is known
        return None


class Expressions:
    """The elementwise values of the integer nodes of a functional graph, with the ranges of their symbols."""

    def __init__(self, graph: torch.fx.Graph, assumed: Mapping[Node, ValueRanges] | None = None) -> None:
        self.assumed = dict(assumed or {})  # node -> range its elements lie in (declared by the caller)
        self.memo: dict[Node, sympy.Expr | None] = {}
        self.leaf_nodes: dict[sympy.Symbol, Node] = {}
        self.ranges: dict[sympy.Symbol, ValueRanges] = {}
        self.narrowed: set[sympy.Symbol] = set()  # symbols whose range says more than their dtype
        self.names: dict[Node, str] = {}  # the caller's names of inputs, for reports
        self.undecided: dict[Node, sympy.Expr] = {}  # decisions left as leaves: operands may have wrapped
        shape_envs = {getattr(getattr(fake(n), "fake_mode", None), "shape_env", None) for n in graph.nodes}
        shape_envs |= {fake(n).node.shape_env for n in graph.nodes if isinstance(fake(n), torch.SymInt)}
        for shape_env in shape_envs - {None}:
            # Sizes and symbolic scalars are int64 in torch: a fact the ShapeEnv leaves unbounded. A float
            # symbol (a Python float under dynamic=True, nn.Embedding's norm_type) is no integer: left out.
            ints = {s: r for s, r in shape_env.var_to_range.items() if not r.is_float}
            self.ranges.update({s: r & INT64 for s, r in ints.items()})
            self.narrowed.update(ints)

    def of(self, node: Node) -> sympy.Expr | None:
        """The node's value at each element; None if it is not an integer."""
        if node not in self.memo:
            self.memo[node] = self._translate(node)
        return self.memo[node]

    def _translate(self, node: Node) -> sympy.Expr | None:
        value = fake(node)
        if isinstance(value, torch.SymInt):
            return value.node.expr
        if not is_integer(value):
            return None
        expr = self._arithmetic(node, value) if node.op == "call_function" else None
        return self._leaf(node, value.dtype) if expr is None else expr

    def exact(self, arg: Any, within: torch.dtype | None = None) -> bool:
        """Whether `arg`'s expression provably fits its dtype (no value wrapped around) and the dtype `within`
        if given: the result's, which torch converts a tensor operand or a Python int to (a clamp bound of -1 is
        255 to uint8; a size that does not fit makes torch raise)."""
        if isinstance(arg, int) and within is not None:
            return ValueRanges(arg, arg).issubset(dtype_range(within))
        value = fake(arg)
        if not isinstance(arg, Node) or isinstance(value, torch.SymInt):
            return True  # a constant, or a size: what it is (torch raises where one does not fit the dtype)
        expr = self.of(arg)
        found = bound(expr, self.ranges) if expr is not None else None
        dtypes = [value.dtype] + ([within] if within is not None else [])
        return found is not None and all(found.issubset(dtype_range(d)) for d in dtypes)

    def _leaf(self, node: Node, dtype: torch.dtype) -> sympy.Symbol:
        symbol = sympy.Symbol(node.name, integer=True)
        self.leaf_nodes[symbol] = node
        known = self.assumed.get(node) or self._produced_range(node)
        self.ranges[symbol] = dtype_range(dtype) if known is None else dtype_range(dtype) & known
        if known is not None:
            self.narrowed.add(symbol)
        return symbol

    def _produced_range(self, node: Node) -> ValueRanges | None:
        """What the producer says about a value: arange(start, end), indices chosen along a dim, or the
        range of the values a view or copy rearranges."""
        target = node.target
        if target is prims.iota.default and node.kwargs.get("step", 1) == 1:
            length, start = self._scalar(node.args[0]), self._scalar(node.kwargs.get("start", 0))
            if length is None or start is None:
                return None
            low, high = bound(start, self.ranges), bound(start + length - 1, self.ranges)
            return self._fitting(node, low, high)
        if target in (aten.arange.default, aten.arange.start) and not node.kwargs.get("step"):
            start, end = (0, node.args[0]) if target is aten.arange.default else node.args[:2]
            start, end = self._scalar(start), self._scalar(end)
            if start is None or end is None:
                return None
            low, high = bound(start, self.ranges), bound(end - 1, self.ranges)
            return self._fitting(node, low, high)
        if target in _REARRANGE and isinstance(node.args[0], Node):
            source = self.of(node.args[0])  # its values, unless they wrapped (a narrowing cast before the view)
            return bound(source, self.ranges) if source is not None and self.exact(node.args[0]) else None
        chooser = node.args[0] if node.target is operator.getitem else node
        selection = as_selection(chooser) if isinstance(chooser, Node) else None
        if selection is None or (node.target is operator.getitem and node.args[1] != selection.index_item):
            return None
        scores = fake_tensor(selection.input)
        if scores is None or scores.dim() == 0 or not isinstance(selection.dim, int):
            return None
        size = scores.shape[selection.dim]
        size = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
        upper = bound(size - 1, self.ranges)
        return ValueRanges(0, upper.upper) if upper is not None else None

    @staticmethod
    def _fitting(node: Node, low: ValueRanges | None, high: ValueRanges | None) -> ValueRanges | None:
        """[low, high] of a counting producer (arange, iota), if it fits the node's dtype: past it the
        values wrap (arange(200, dtype=int8) holds -56 .. -1 too), and only the dtype's range holds."""
        if low is None or high is None:
            return None
        value = fake(node)
        try:
            found = ValueRanges(low.lower, high.upper)
        except ValueRangeError:  # an empty arange: [start, start - 1], no value to bound
            return None
        return found if value is not None and found.issubset(dtype_range(value.dtype)) else None

    def _scalar(self, arg: Any) -> sympy.Expr | None:
        if isinstance(arg, bool):
            return None
        if isinstance(arg, int):
            return sympy.Integer(arg)
        value = fake(arg)
        if isinstance(value, torch.SymInt):
            return value.node.expr
        return None

    def _operand(self, arg: Any, result: torch.Tensor) -> sympy.Expr | None:
        """An operand's expression as the result's dtype sees it; None when it does not translate, or
        when a narrower dtype, sign-extended, may have wrapped."""
        scalar = self._scalar(arg)
        if scalar is not None or not isinstance(arg, Node):
            return scalar
        value = fake_tensor(arg)
        if not is_integer(value):
            return None
        if not (same_sizes(value.shape, result.shape) or statically_known_true(value.numel() == 1)):
            return None  # broadcast across dims: one symbol would stand for different elements
        widened = torch.iinfo(value.dtype).bits < torch.iinfo(result.dtype).bits
        if widened and not self.exact(arg):
            return None
        return self.of(arg)

    def _arithmetic(self, node: Node, value: torch.Tensor) -> sympy.Expr | None:
        target, args, kwargs = node.target, list(node.args), dict(node.kwargs)

        undecided = False

        def operands(*items: Any, decides: bool = False) -> list[sympy.Expr] | None:
            nonlocal undecided
            exprs = [self._operand(a, value) for a in items]
            if any(e is None for e in exprs):
                return None
            if decides and not all(self.exact(a, value.dtype) for a in items):
                undecided = True  # the decision needs true values, and one may have wrapped (or will, converted)
            return exprs

        expr = self._decision_or_ring(target, args, kwargs, operands, value.dtype)
        if undecided:
            self.undecided[node] = expr  # what it would be: kept for the report, not used in proofs
            return None
        return expr

    def _decision_or_ring(self, target: Any, args: list, kwargs: dict, operands: Any, dtype: torch.dtype) -> sympy.Expr | None:

        if target in _ADD | _SUB and len(args) == 2 and set(kwargs) <= {"alpha"}:
            alpha = kwargs.get("alpha", 1)
            ops = operands(*args) if isinstance(alpha, int) and not isinstance(alpha, bool) else None
            if ops is None:
                return None
            return ops[0] + alpha * ops[1] if target in _ADD else ops[0] - alpha * ops[1]
        if target in _MUL and len(args) == 2 and not kwargs:
            ops = operands(*args)
            return None if ops is None else ops[0] * ops[1]
        if target is aten.neg.default and len(args) == 1:
            ops = operands(args[0])
            return None if ops is None else -ops[0]
        if target in (aten.maximum.default, aten.minimum.default) and len(args) == 2:
            ops = operands(*args, decides=True)
            return None if ops is None else (Max if target is aten.maximum.default else Min)(*ops)
        if target in _CLAMPS:
            names = _CLAMPS[target]
            bound_args = dict(zip(names, args)) | kwargs
            if set(bound_args) - set(names) or len(args) > len(names):
                return None
            ops = operands(*(bound_args.get(n) for n in names if bound_args.get(n) is not None), decides=True)
            if ops is None:
                return None
            expr, limits = ops[0], iter(ops[1:])
            if bound_args.get("min") is not None:
                expr = Max(expr, next(limits))
            if bound_args.get("max") is not None:
                expr = Min(expr, next(limits))
            return expr
        floor = target is aten.floor_divide.default or (target is aten.div.Tensor_mode and kwargs.get("rounding_mode") == "floor")
        if floor or target in (aten.remainder.Scalar, aten.remainder.Tensor):
            divisor = args[1] if len(args) == 2 else None
            if not isinstance(divisor, int) or isinstance(divisor, bool) or divisor <= 0:
                return None  # a positive constant divisor: then torch's floor and modulo are sympy's
            if not ValueRanges(divisor, divisor).issubset(dtype_range(dtype)):
                return None  # torch converts it to the dtype first: uint8 % 300 is % 44
            ops = operands(args[0], decides=True)
            return None if ops is None else (FloorDiv(ops[0], divisor) if floor else PythonMod(ops[0], divisor))
        if target in (prims.convert_element_type.default, aten._to_copy.default) and isinstance(args[0], Node):
            if kwargs.keys() - {"dtype"} or not is_integer(fake(args[0])):
                return None
            ops = operands(args[0])  # narrower or equal: the same modulo the result; wider: only if it fits
            return None if ops is None else ops[0]
        if target in (aten.clone.default, aten.alias.default) and len(args) == 1:
            ops = operands(args[0])  # the same value when the shape is the same (else a leaf)
            return None if ops is None else ops[0]
        if target is aten.full.default and len(args) == 2:
            return self._scalar(args[1])  # every element is the fill value (an int or a symbolic size)
        if target is aten.scalar_tensor.default and len(args) == 1:
            return self._scalar(args[0])
        return None


def _decide(expr: sympy.Expr, ranges: Mapping) -> sympy.Expr:
    """`expr` with every max/min/modulo/floor division that the value ranges decide replaced by its result."""
    if not expr.args:
        return expr
    expr = expr.func(*(_decide(a, ranges) for a in expr.args))
    if isinstance(expr, (Max, Min, sympy.Max, sympy.Min)):
        is_max = isinstance(expr, (Max, sympy.Max))
        result, *others = expr.args
        for other in others:
            diff = bound(sympy.expand(result - other), ranges)
            if diff is not None and diff.lower >= 0:
                result = result if is_max else other
            elif diff is not None and diff.upper <= 0:
                result = other if is_max else result
            else:
                return expr
        return result
    if isinstance(expr, (PythonMod, FloorDiv)) and expr.args[1].is_Integer and expr.args[1] > 0:
        found = bound(expr.args[0], ranges)
        if found is not None and found.lower >= 0 and found.upper < expr.args[1]:
            return expr.args[0] if isinstance(expr, PythonMod) else sympy.Integer(0)
    return expr


def prove_equal(a: sympy.Expr, b: sympy.Expr, ranges: Mapping[sympy.Symbol, ValueRanges]) -> tuple[bool | None, sympy.Expr]:
    """(True, 0) if a == b for all values of their symbols within `ranges`; (False, a - b) if they
    always differ; (None, a - b) if neither is proven. Raises ProofError when sympy fails."""
    try:
        diff = sympy.expand(_decide(a, ranges) - _decide(b, ranges))
    except (TypeError, ValueError, RecursionError) as error:  # e.g. Max of arguments sympy cannot compare
        raise ProofError(f"{type(error).__name__}: {error}") from error
    if diff == 0:
        return True, diff
    if diff.is_number:  # a nonzero constant, also modulo 2**bits (|diff| is small)
        return False, diff
    return None, diff
