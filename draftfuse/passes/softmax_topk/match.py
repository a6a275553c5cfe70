"""Recognising softmax -> selection, and deciding whether it may be rewritten: graph -> `Match` or a
refusal (`Refuse`, with the reason). One description serves both levels; each level has its own
recogniser for the softmax itself:

  * Dynamo graphs: one call (torch.softmax, F.softmax with dtype=, Tensor.softmax, log_softmax forms);
  * post-grad ATen graphs, softmax decomposed: div(exp(z), sum(exp(z), [d], True)) or
    log_softmax sub(z, log(sum(exp(z), [d], True))), with z = s - amax(s, [d], True) (keepdim checked:
    without it the subtraction broadcasts along another dim), z scaled by a positive constant, or
    Inductor's temperature form where(all_finite(s'), (s - amax(s)) / t, s' - amax(s')) with s' = s / t
    (the mask and both branches' scales checked).

What the selection reads: the rewrite selects right after the softmax, from the softmax's input looked
through back to the logits (peel_scaled_logits) by exact upcasts, positive constant scales and one
tensor temperature constant along the dim (the order is then that of x * sign(1 / t)). The walk stops,
and the selection reads the value there as computed (exact, only more bytes), at anything else: a
downcast, a negative factor, a second tensor, or a step whose value or inputs (its source, a temperature
tensor) are written in place before the softmax (`x = x.float(); x.div_(t)`: the softmax reads x
divided, so the selection does too; draftfuse.graph.effects says what may write a value, through any
view). Later writes to the logits do not matter.

Legality, besides the shapes (selection dim = softmax dim, 1 <= k <= size, a known constant k):
  * between the softmax and the selection only float casts (the rewritten values replay them);
  * effects: nothing writes the probabilities (or any view of them) between the softmax and the
    selection;
  * nothing changes torch's global state (grad mode, autocast: `with torch.no_grad()` around the topk)
    from the first op looked through to the selection: the rewrite computes the values where the softmax
    is, under its grad mode and dtype policy, which must be the selection's;
  * largest selections only: the smallest probabilities underflow to exactly 0 in floating point, and
    the original then returns the first of those zeros, not the smallest logit;
  * topk(sorted=False) with k > 1 is refused: its order is unspecified;
  * the selection's result is read through getitem only.
`half` marks a match whose selection reads fp16/bf16 probabilities: there, close logits can round to
equal probabilities and the original returns the lower index of such a tie (option half_probs).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from draftfuse.graph.effects import Effects
from draftfuse.graph.selection import Selection, bind
from draftfuse.graph.values import Node, fake_tensor, is_call, normalise_dim, rank, target_key, user_location
from draftfuse.passes.driver import Refuse

aten = torch.ops.aten
prims = torch.ops.prims
HALF = (torch.float16, torch.bfloat16)
# what torch's topk and argmax select on, on the CPU and CUDA (not bool, uint16/32/64, float8): the
# logits are peeled back to a tensor of one of these only
SELECTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
# torch 2.11's Inductor computes topk(x, k, dim) over a dim other than the last (or over a permuted view)
# from x as written by later in-place writes of the graph: topk(x, 3, 0), then x[..., 2] = v and x.neg_(),
# gave the indices of the written x (a clone of x before the topk did not help; 2.13 is right). Such a
# rewrite is refused there: the softmax read a tensor of its own.
_TOPK_MISSES_LATER_WRITES = torch.torch_version.TorchVersion(torch.__version__) < (2, 13)


# Rules as data: how each spelling names its arguments. target: (parameter names, is log_softmax).
SOFTMAX_SPELLINGS: dict[Any, tuple[tuple[str, ...], bool]] = {
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


def as_cast(node: Node) -> tuple[Node, torch.dtype] | None:
    """(input, dtype) if `node` only converts a tensor's dtype."""
    key = target_key(node)
    if key in _FLOAT_METHOD_CASTS and len(node.args) == 1 and not node.kwargs:
        return node.args[0], _FLOAT_METHOD_CASTS[key]
    if key in ("to", "type") and len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs:
        return node.args[0], node.args[1]
    if key == "to" and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.args[0], node.kwargs["dtype"]
    if key is prims.convert_element_type.default:
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
class Softmax:
    """A softmax as the graph computes it. ATen graphs also give the pieces the values reuse."""

    node: Node  # its value is the probabilities (log-probabilities)
    scores: Node  # the softmax input (Dynamo), or s in z = s - max(s) (ATen)
    dim: int
    log: bool
    dtype: torch.dtype | None = None  # softmax(x, dtype=d) computes on x.to(d)
    scale: float = 1.0  # ATen: z = scale * (s - max(s)), a temperature applied after the subtraction
    z: Node | None = None  # ATen: s - max(s), as the graph has it
    sum_exp: Node | None = None
    log_sum: Node | None = None


@dataclasses.dataclass
class Match:
    selection: Selection
    softmax: Softmax
    dim: int  # normalised
    k: int
    logits: Node  # what the indices are taken from (upcasts and temperature peeled)
    prob_dtype: torch.dtype  # dtype of the softmax's value
    prob_casts: list[torch.dtype]  # casts between softmax and selection, in order
    read_dtype: torch.dtype  # the dtype of the probabilities the selection reads (the half one they were rounded to)
    half: bool  # the selection reads probabilities rounded to fp16/bf16 on the way (upcast after or not)
    matched: list[Node]  # nodes of the original pattern, for the report and clean-up
    peeled: list[Node]  # the casts and temperatures looked through from the softmax back to the logits
    factor: float = 1.0  # the constant temperature factors, multiplied
    tensor_scale: TensorScale | None = None  # a temperature tensor (the selection follows its sign)
    written_by: Node | None = None  # the first in-place write to the logits or their inputs before the softmax

    @property
    def log(self) -> bool:
        return self.softmax.log

    @property
    def needs_grad(self) -> bool:
        """Whether autograd records the probabilities (a draft run with grad enabled, through the logits or a
        temperature tensor): the kernels have no backward, constant values would detach them from it, and a
        localised gather's backward is not the original's."""
        sources = [self.selection.input, self.logits] + ([self.tensor_scale.node] if self.tensor_scale is not None else [])
        return any(getattr(fake_tensor(node), "requires_grad", False) for node in sources)


def _peel_casts_after_softmax(sel: Selection) -> tuple[Node, list[torch.dtype], list[Node]]:
    """Walk from the selection's input back through float casts: (node, casts in order, cast nodes)."""
    node, casts, cast_nodes = sel.input, [], []
    while (cast := as_cast(node)) is not None:
        src, dtype = cast
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise Refuse(f"cast to {dtype} between softmax and selection changes the order")
        if dtype.itemsize == 1:  # 3 or 2 mantissa bits: ties everywhere, where the original picks the lowest index
            raise Refuse(f"cast to {dtype} between softmax and selection: most close probabilities round to one value")
        casts.insert(0, dtype)
        cast_nodes.append(node)
        node = src
    return node, casts, cast_nodes


@dataclasses.dataclass
class TensorScale:
    """A temperature held in a tensor: the softmax reads x / t (or x * s), t constant along the dim."""

    node: Node  # t or s
    op: str  # "div" or "mul"
    at: Node  # the division or multiplication


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
    (exact, only more bytes than the logits): a downcast, a non-positive factor, a second tensor or one
    that varies along the dim, or a step `may_peel(node)` refuses (a write in place)."""
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
            if isinstance(by, Node):
                if dim is None or tensor is not None or not _row_constant(by, node, dim):
                    return node, peeled, factor, tensor
                tensor = TensorScale(by, "div" if target_key(node) in _DIVISIONS else "mul", node)
            elif not by > 0:  # also NaN
                return node, peeled, factor, tensor
            else:
                factor *= by
        peeled.append(node)
        node = step[0]


_DIVISIONS = {key for key, factor in _SCALES.items() if factor is _reciprocal}


def _row_constant(scale: Node, scaled: Node, dim: int) -> bool:
    """Whether `scale` broadcasts along `dim` (one value per row, or one in all) without changing the
    scaled tensor's shape: otherwise it reweighs the entries of a row, not the row."""
    value, result = fake_tensor(scale), fake_tensor(scaled)
    if value is None or result is None or value.dim() > result.dim():
        return False
    offset = result.dim() - value.dim()
    return dim < offset or value.shape[dim - offset] == 1


def match_dynamo_softmax(node: Node) -> Softmax | None:
    """softmax spelled as one call."""
    spelling = SOFTMAX_SPELLINGS.get(target_key(node))
    if spelling is None:
        return None
    names, is_log = spelling
    bound = bind(node, names)
    if bound is None or not isinstance(bound.get("input"), Node):
        raise Refuse(f"{node.name}: softmax arguments not understood")
    scores = bound["input"]
    if bound.get("dim") is None:
        raise Refuse(f"{node.name}: softmax without an explicit dim")
    dim = normalise_dim(bound["dim"], rank(scores))
    if dim is None or not rank(scores):
        raise Refuse(f"{node.name}: softmax dim {bound['dim']!r} is not a known dim of a tensor of rank >= 1")
    dtype = bound.get("dtype")
    value = fake_tensor(scores)
    if dtype is not None and not is_upcast(value.dtype if value is not None else None, dtype):
        raise Refuse(f"{node.name}: softmax dtype={dtype} is narrower than its input")
    return Softmax(node, scores, dim, is_log, dtype=dtype if isinstance(dtype, torch.dtype) else None)


# ATen argument names, defaults dropped in post-grad graphs
_SUM = ("input", "dim", "keepdim", "dtype")
_AMAX = ("input", "dim", "keepdim")


def _reduces(node: Any, target: Any, names: tuple[str, ...], dim: int | None, source: Node) -> int | None:
    """The one dim `node` = target(source, [d], keepdim=True) reduces, checked against `dim` if given."""
    if not is_call(node, target):
        return None
    bound = bind(node, names)
    if bound is None or bound.get("input") is not source or bound.get("keepdim") is not True or bound.get("dtype"):
        return None
    found = normalise_dim(bound.get("dim"), rank(source))
    return found if found is not None and (dim is None or found == dim) else None


def match_aten_softmax(node: Node) -> Softmax | None:
    """The decomposed softmax whose value `node` is (see the module docstring)."""
    if is_call(node, aten.div.Tensor) and len(node.args) == 2 and is_call(node.args[0], aten.exp.default):
        exp, sum_node = node.args
        log_node, is_log = None, False
    elif _plain_sub(node) and is_call(node.args[1], aten.log.default):
        log_node, is_log = node.args[1], True
        sum_node = log_node.args[0]
        if not is_call(sum_node, aten.sum.dim_IntList) or not is_call(sum_node.args[0], aten.exp.default):
            return None
        exp = sum_node.args[0]
        if exp.args[0] is not node.args[0]:
            return None
    else:
        return None
    z = exp.args[0]
    if not rank(z):
        return None  # a 0-d tensor normalised by itself is no softmax along a dim
    dim = _reduces(sum_node, aten.sum.dim_IntList, _SUM, None, exp)
    if dim is None:
        return None  # not sum(exp(z), [d], keepdim=True): no softmax, whatever it computes
    scores, factor = _scaled_max_subtracted(z, dim)
    return Softmax(node, scores, dim, is_log, scale=factor, z=z, sum_exp=sum_node, log_sum=log_node)


def _plain_sub(node: Node) -> bool:
    """a - b: aten.sub.Tensor without an alpha (a - alpha * b) other than 1."""
    return is_call(node, aten.sub.Tensor) and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1 and set(node.kwargs) <= {"alpha"}


def _scaled_max_subtracted(z: Node, dim: int) -> tuple[Node, float]:
    """(s, c) with z = c * (s - amax(s, [dim], True)), c > 0 a constant; Refuse otherwise."""
    if _plain_sub(z):
        s, row_max = z.args
        if _reduces(row_max, aten.amax.default, _AMAX, dim, s) is not None:
            return s, 1.0
        raise Refuse(f"exp input {z.name} is not s - amax(s, [{dim}], keepdim=True)")
    if (scale := as_scale(z)) is not None and target_key(z) in (aten.div.Tensor, aten.mul.Tensor):
        inner, by = scale
        if isinstance(by, Node):
            raise Refuse(f"temperature {by.name} is a tensor whose sign is not known")
        if not by > 0:
            raise Refuse(f"temperature factor {by} is not positive")
        s, factor = _scaled_max_subtracted(inner, dim)
        return s, factor * by
    if is_call(z, aten.where.self) and len(z.args) == 3:
        return _inductor_temperature_form(z, dim)
    raise Refuse(f"exp input {z.name} ({z.target}) is not recognised as s - max(s)")


def _inductor_temperature_form(z: Node, dim: int) -> tuple[Node, float]:
    """where(all_finite(s'), c * (s - max(s)), s' - max(s')) with s' = c * s: both branches are the
    same order-preserving function of the logits, with row maximum 0."""
    mask, first, second = z.args
    s1, c1 = _scaled_max_subtracted(first, dim)
    s2, c2 = _scaled_max_subtracted(second, dim)
    base1, _, f1 = peel_logits(s1)
    base2, _, f2 = peel_logits(s2)
    if base1 is not base2 or c1 * f1 != c2 * f2:
        raise Refuse(f"{z.name}: the two branches of the where scale the logits differently ({c1 * f1} and {c2 * f2})")
    if not _is_all_finite(mask, s2, dim):
        raise Refuse(f"{z.name}: the where's condition is not Inductor's all-finite test of {s2.name}")
    return s2, c2


def _is_all_finite(mask: Any, s: Node, dim: int) -> bool:
    """mask = logical_not(any(logical_not(eq(s, s) * ne(abs(s), inf)), [dim], True))."""
    if not is_call(mask, aten.logical_not.default):
        return False
    any_node = mask.args[0]
    if not (is_call(any_node, aten.any.dims) or is_call(any_node, aten.any.dim)) or len(any_node.args) < 3:
        return False
    dims = any_node.args[1]
    if normalise_dim(dims, rank(s)) != dim or any_node.args[2] is not True:
        return False
    inner = any_node.args[0]
    if not is_call(inner, aten.logical_not.default) or not is_call(inner.args[0], aten.mul.Tensor):
        return False
    eq, ne = inner.args[0].args
    if is_call(ne, aten.eq.Tensor):
        eq, ne = ne, eq
    not_nan = is_call(eq, aten.eq.Tensor) and eq.args[0] is s and eq.args[1] is s
    finite = is_call(ne, aten.ne.Scalar) and is_call(ne.args[0], aten.abs.default) and ne.args[0].args[0] is s
    return not_nan and finite and ne.args[1] == float("inf")


def _recognise(node: Node, level: str) -> Softmax | None:
    return match_dynamo_softmax(node) if level == "dynamo" else match_aten_softmax(node)


def _looks_like_softmax(node: Any, level: str) -> bool:
    if not isinstance(node, Node):
        return False
    try:
        return _recognise(node, level) is not None
    except Refuse:
        return True


def match(sel: Selection, level: str, effects: Effects) -> Match | None:
    """The rewrite of one selection; None if its input is no softmax; Refuse for near-matches."""
    probs_node, casts, cast_nodes = _peel_casts_after_softmax(sel)
    softmax = _recognise(probs_node, level)
    if softmax is None:
        if probs_node.op != "placeholder" and any(_looks_like_softmax(a, level) for a in probs_node.args):
            if effects.writes(probs_node):
                raise Refuse(f"the probabilities are written in place between the softmax and the selection, by {describe(probs_node)}")
            raise Refuse(f"{probs_node.name} ({probs_node.target}) between softmax and selection is not understood")
        return None
    sel_rank = rank(sel.input)
    if not sel_rank:
        raise Refuse("the selection's input has no known rank of at least 1")
    sel_dim = normalise_dim(sel.dim, sel_rank)
    if sel_dim is None:
        raise Refuse(f"selection dim {sel.dim!r} is not a known constant")
    if sel_dim != softmax.dim:
        raise Refuse(f"softmax over dim {softmax.dim} but selection over dim {sel_dim}")
    k = sel.k
    if isinstance(k, (Node, torch.SymInt)) or not isinstance(k, int) or isinstance(k, bool):
        raise Refuse(f"k={k} is not a known constant")
    size = fake_tensor(sel.input).shape[sel_dim]
    if k < 1 or (isinstance(size, int) and k > size):
        raise Refuse(f"k={k} is outside 1..{size}")
    if not sel.largest:
        raise Refuse(
            "a smallest-probability selection: the smallest probabilities underflow to 0, and the "
            "original returns the first of those zeros, not the smallest logit"
        )
    if sel.kind == "topk" and k > 1 and not sel.sorted:
        raise Refuse("topk(sorted=False): its order is unspecified, a rewrite could permute it")
    for user in sel.node.users if sel.returns_pair else ():
        if not (is_call(user, operator.getitem) and user.args[1] in (0, 1)):
            raise Refuse(f"selection result used as a whole by {user.name}")
    logits, peeled, factor, tensor = peel_scaled_logits(
        softmax.scores, softmax.dim, lambda node: not _writes_before(node, softmax.node, effects)
    )
    probs_value = fake_tensor(probs_node)
    if probs_value is None or fake_tensor(logits) is None:
        raise Refuse("no tensor metadata on the graph (capture with Dynamo or run FakeTensorProp first)")
    _check_effects(effects, sel, softmax, peeled, cast_nodes)
    if _TOPK_MISSES_LATER_WRITES and k > 1 and sel_dim != probs_value.dim() - 1 and (written := effects.writers([logits], softmax.node)):
        raise Refuse(
            f"torch {torch.__version__}'s Inductor can compute a topk over a dim other than the last from the "
            f"logits as written later (here by {describe(written[0])}); torch 2.13 does not"
        )
    # rounded to fp16/bf16 anywhere between the softmax and the selection (softmax(x_bf16).float() too)
    rounded = next((d for d in (probs_value.dtype, *casts) if d in HALF), None)
    read_dtype = rounded or (casts[-1] if casts else probs_value.dtype)
    return Match(
        selection=sel, softmax=softmax, dim=sel_dim, k=k, logits=logits,
        factor=factor * softmax.scale, tensor_scale=tensor,
        prob_dtype=probs_value.dtype, prob_casts=casts, read_dtype=read_dtype, half=rounded is not None,
        matched=[sel.node, *cast_nodes, probs_node, *peeled], peeled=peeled,
        written_by=next(iter(_writes_before(logits, softmax.node, effects)), None),
    )  # fmt: skip


def _writes_before(node: Node, softmax: Node, effects: Effects) -> list[Node]:
    """The in-place writes to `node` or to what it reads, from `node` to the softmax: the peel's test. The
    rewrite reads the logits (and a temperature tensor) where the softmax is, so looking through `node` is
    exact only if there are none (`x = x.float(); x.div_(t)`: the softmax reads x divided, so the selection
    reads that x, not the logits before the cast; `s = x / t; t.mul_(-1)`: it reads s)."""
    return effects.writers([node, *node.all_input_nodes], node, softmax)


def _check_effects(effects: Effects, sel: Selection, softmax: Softmax, peeled: list[Node], casts: list[Node]) -> None:
    """Refuse when a write changes the probabilities the original selects from after the rewrite's point
    (the softmax), or the global state changes along the chain (writes to the logits stop the peel)."""
    after_softmax = effects.writers([softmax.node, *casts], softmax.node, sel.node)
    if after_softmax:
        raise Refuse(f"the probabilities are written in place between the softmax and the selection, by {describe(after_softmax[0])}")
    chain = [*peeled, softmax.node]  # in graph order: each reads the one before
    if changes := effects.state_changes(min(chain, key=effects.order.get), sel.node):
        raise Refuse(
            f"{describe(changes[0])} changes torch's global state (grad mode, autocast) between the softmax "
            "and the selection: the rewritten values would be computed under the softmax's"
        )


def _target_name(node: Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def describe(node: Node) -> str:
    where = user_location(node)
    return f"{node.name} ({_target_name(node)})" + (f" at {where}" if where else "")
