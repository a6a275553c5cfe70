"""The forms a softmax's input takes between the logits and the softmax, shared by both levels: dtype
casts, scales by a constant or a tensor, and the walk back through them (`peel_scaled_logits`); and
`Softmax`, the description of a softmax that each level's recogniser (recognise.py) returns.

The walk goes back from the softmax's input to the logits by exact upcasts, positive constant scales
and one tensor temperature constant along the softmax dim (the order is then that of x * sign(1 / t)).
It stops, and the selection reads the value there as computed (exact, only more bytes), at anything
else: a downcast, a negative factor, an integer product (it wraps around), a second tensor or one that
varies along the dim, or a step the caller's write test refuses (match.py: a value written in place
before the softmax).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch

from draftfuse.graph.values import Node, fake_tensor, target_key

aten = torch.ops.aten
prims = torch.ops.prims
HALF = (torch.float16, torch.bfloat16)
# what torch's topk and argmax select on, on the CPU and CUDA (not bool, uint16/32/64, float8): the
# logits are peeled back to a tensor of one of these only
SELECTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


_FLOAT_METHOD_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


def _reciprocal(c: float) -> float:
    return 1.0 / c if c else float("nan")  # a zero divisor: NaN, refused like any factor that is not positive


def _same(c: float) -> float:
    return c


# Multiplications and divisions of a tensor (first argument) by something: the factor they apply.
_SCALES: dict[Any, Any] = {
    operator.truediv: _reciprocal, torch.div: _reciprocal, torch.true_divide: _reciprocal,
    "div": _reciprocal, "true_divide": _reciprocal, aten.div.Tensor: _reciprocal, aten.div.Scalar: _reciprocal,
    operator.mul: _same, torch.mul: _same, "mul": _same, aten.mul.Tensor: _same, aten.mul.Scalar: _same,
}  # fmt: skip
_COMMUTATIVE = {operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar}


def _is_round_to(key: Any) -> bool:
    """Whether `key` is draftfuse::round_to (emit.py): a cast this pass emits, exact like any other."""
    return isinstance(key, torch._ops.OpOverload) and key._schema.name == "draftfuse::round_to"


def as_cast(node: Node) -> tuple[Node, torch.dtype] | None:
    """(input, dtype) if `node` only converts a tensor's dtype."""
    key = target_key(node)
    if key in _FLOAT_METHOD_CASTS and len(node.args) == 1 and not node.kwargs:
        return node.args[0], _FLOAT_METHOD_CASTS[key]
    if key in ("to", "type") and len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs:
        return node.args[0], node.args[1]
    if key == "to" and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.args[0], node.kwargs["dtype"]
    if key is prims.convert_element_type.default or _is_round_to(key):
        return node.args[0], node.args[1]
    if key is aten._to_copy.default and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.args[0], node.kwargs["dtype"]
    return None


def is_upcast(src: torch.dtype | None, dst: Any) -> bool:
    """Converting src to dst keeps every value exactly (so order and ties are kept)."""
    if src is None or not isinstance(dst, torch.dtype) or not src.is_floating_point or not dst.is_floating_point:
        return False
    return src == dst or (torch.finfo(dst).bits > torch.finfo(src).bits and torch.finfo(dst).max >= torch.finfo(src).max)


def as_scale(node: Node) -> tuple[Node, Any] | None:
    """(input, factor) if `node` multiplies or divides a tensor; the factor is a Node when not constant."""
    key = target_key(node)
    if key not in _SCALES or len(node.args) != 2 or node.kwargs:
        return None  # rounding_mode= and friends are not scalings
    tensor, other = node.args
    if key in _COMMUTATIVE and (not isinstance(tensor, Node) or _broadcast_onto(tensor, other, node)):
        tensor, other = other, tensor  # 2.0 * x, or s * x: the factor is the one the product broadcasts
    if not isinstance(tensor, Node):
        return None  # c / x is not a scaling of x
    if isinstance(other, Node):
        return tensor, other
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return tensor, _SCALES[key](float(other))
    return None


def _broadcast_onto(first: Node, second: Any, product: Node) -> bool:
    """Whether `first` is broadcast onto `second` (a Node of the product's shape, which `first` lacks)."""
    a, b, out = fake_tensor(first), fake_tensor(second) if isinstance(second, Node) else None, fake_tensor(product)
    return a is not None and b is not None and out is not None and a.shape != out.shape and b.shape == out.shape


@dataclasses.dataclass
class TensorScale:
    """A temperature held in a tensor: the softmax reads x / t (or x * s), t constant along the dim."""

    node: Node  # t or s
    op: str  # "div" or "mul"
    at: Node  # the division or multiplication


@dataclasses.dataclass
class Softmax:
    """A softmax as the graph computes it. ATen graphs also give the pieces the values reuse."""

    node: Node  # its value is the probabilities (log-probabilities)
    scores: Node  # the softmax input (Dynamo), or s in z = s - max(s) (ATen)
    dim: int
    log: bool
    dtype: torch.dtype | None = None  # softmax(x, dtype=d) computes on x.to(d)
    scale: float = 1.0  # ATen: z = scale * (s - max(s)), a temperature applied after the subtraction
    temperature: TensorScale | None = None  # ATen: z = (s - max(s)) / t in Inductor's signed form, t a tensor
    z: Node | None = None  # ATen: s - max(s), as the graph has it
    sum_exp: Node | None = None
    log_sum: Node | None = None


def peel_logits(scores: Node) -> tuple[Node, list[Node], float]:
    """From the softmax input back to the logits through exact upcasts and positive constant scales:
    (logits, the nodes peeled, the product of the factors). It stops at a tensor temperature."""
    logits, peeled, factor, _ = peel_scaled_logits(scores, None)
    return logits, peeled, factor


def peel_scaled_logits(
    scores: Node, dim: int | None, may_peel: Callable[[Node], bool] | None = None
) -> tuple[Node, list[Node], float, TensorScale | None]:
    """peel_logits, looking also through one tensor temperature (`x / t`, `x * s`) when `dim` (the
    softmax dim) is given and t is constant along it: the selection then follows the sign of t.

    The walk stops at the first node it cannot look through, which the selection then reads as computed
    (exact, only more bytes than the logits): a downcast, a non-positive factor, an integer product, a
    second tensor or one that varies along the dim, or a step `may_peel(node)` refuses (a write in place)."""
    node, peeled, factor, tensor = scores, [], 1.0, None
    while True:
        cast = as_cast(node)
        step = cast or as_scale(node)
        source = fake_tensor(step[0]) if step is not None and isinstance(step[0], Node) else None
        if source is None or source.dtype not in SELECTABLE or (may_peel is not None and not may_peel(node)):
            return node, peeled, factor, tensor  # the selection reads this node (topk of bool or float8: none)
        if cast is not None:
            if not is_upcast(source.dtype, cast[1]):
                return node, peeled, factor, tensor  # a downcast may merge values: select on what softmax saw
        else:
            src, by = step
            product = fake_tensor(node)
            if product is None or not product.dtype.is_floating_point:
                return node, peeled, factor, tensor  # an integer product wraps around (int8 100 * 2 is -56)
            if isinstance(by, Node):
                if dim is None or tensor is not None or not row_constant(by, node, dim):
                    return node, peeled, factor, tensor
                tensor = TensorScale(by, "div" if target_key(node) in _DIVISIONS else "mul", node)
            elif not by > 0:  # also NaN
                return node, peeled, factor, tensor
            else:
                factor *= by
        peeled.append(node)
        node = step[0]


_DIVISIONS = {key for key, factor in _SCALES.items() if factor is _reciprocal}


def row_constant(scale: Node, scaled: Node, dim: int) -> bool:
    """Whether `scale` broadcasts along `dim` (one value per row, or one in all) without changing the
    scaled tensor's shape: otherwise it reweighs the entries of a row, not the row."""
    value, result = fake_tensor(scale), fake_tensor(scaled)
    if value is None or result is None or value.dim() > result.dim():
        return False
    offset = result.dim() - value.dim()
    return dim < offset or value.shape[dim - offset] == 1
