"""Recognising a softmax, per level: graph node -> `Softmax`, None (no softmax) or `Refuse` (a
near-match, with the reason).

  * Dynamo graphs: one call (torch.softmax, F.softmax with dtype=, Tensor.softmax, log_softmax forms);
  * post-grad ATen graphs, softmax decomposed: div(exp(z), sum(exp(z), [d], True)) or
    log_softmax sub(z, log(sum(exp(z), [d], True))), with z = s - amax(s, [d], True) (keepdim checked:
    without it the subtraction broadcasts along another dim), z scaled by a positive constant, or
    Inductor's temperature form where(all_finite(s'), (s - amax(s)) / t, s' - amax(s')) with s' = s / t
    (the mask and both branches' scales checked); for a temperature tensor t (or s in s * x) its first
    branch is (x * w - amax(x * w)) / (w * t), w = where(t >= 0, 1, -1), checked piece by piece. torch
    2.11's Inductor gives that branch alone, without the where (the same order: x * sign(t)'s, wherever
    x / t is finite; where it is not, the row is NaN or uniform in both, README's Semantics).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from draftfuse.graph.selection import bind
from draftfuse.graph.values import Node, fake_tensor, is_call, normalise_dim, rank, target_key
from draftfuse.passes.driver import Refuse
from draftfuse.passes.softmax_topk.forms import Softmax, TensorScale, as_scale, is_upcast, peel_logits, peel_scaled_logits, row_constant

aten = torch.ops.aten

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
    if (signed := _signed_temperature(z, dim)) is not None:  # torch 2.11: the where's first branch alone
        _check_subtracts_in_floats(z)
        scores, temperature = signed
        return Softmax(node, scores, dim, is_log, temperature=temperature, z=z, sum_exp=sum_node, log_sum=log_node)
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
    same order-preserving function of the logits, with row maximum 0. For a tensor temperature the first
    branch is (x * w - max(x * w)) / (w * t) (or * (w * s)) with w = where(t >= 0, 1, -1): the order of
    x * sign(t), as s' = x / t has it wherever s' is finite (t = 0 or NaN leaves s' not finite)."""
    mask, first, second = z.args
    s2, c2 = _scaled_max_subtracted(second, dim)
    _check_subtracts_in_floats(first)
    if not (c2 == 1.0 and _is_signed_temperature(first, s2, dim)):  # Inductor's second branch is s' - max(s')
        s1, c1 = _scaled_max_subtracted(first, dim)
        base1, _, f1 = peel_logits(s1)
        base2, _, f2 = peel_logits(s2)
        if base1 is not base2 or c1 * f1 != c2 * f2:
            if (step := as_scale(base2)) is not None and isinstance(step[1], float) and not step[1] > 0:
                raise Refuse(f"temperature factor {step[1]} is not positive (Inductor's form for it is not matched here)")
            raise Refuse(f"{z.name}: the two branches of the where scale the logits differently ({c1 * f1} and {c2 * f2})")
    if not _is_all_finite(mask, s2, dim):
        raise Refuse(f"{z.name}: the where's condition is not Inductor's all-finite test of {s2.name}")
    return s2, c2


def _check_subtracts_in_floats(branch: Node) -> None:
    """Refuse a first branch that subtracts the row maximum in an integer dtype: for integer logits
    Inductor's form computes x * sign - max in x's dtype, which wraps (int8: -128 - 100 = 28), so its z
    is no max-subtracted softmax input (the values taken from it would be wrong, and Inductor's own
    token is)."""
    found = next((n for n in (branch, *branch.all_input_nodes) if _plain_sub(n)), None)
    value = fake_tensor(found) if found is not None else None
    if value is not None and not value.dtype.is_floating_point:
        raise Refuse(f"{branch.name}: Inductor's temperature form subtracts the row maximum in {value.dtype}, which wraps")


def _signed_temperature(branch: Node, dim: int) -> tuple[Node, TensorScale] | None:
    """(x, t) if branch = (x * w - amax(x * w, [dim], True)) op (w * t), w = where(t >= 0, 1, -1), op div
    or mul, t one value per row: Inductor's softmax(x / t) (or x * t) for a tensor t, in the order of
    x * sign(t). None for any other form."""
    op = {aten.div.Tensor: "div", aten.mul.Tensor: "mul"}.get(target_key(branch))
    if op is None or len(branch.args) != 2 or branch.kwargs or not _plain_sub(branch.args[0]):
        return None
    (s1, row_max), divisor = branch.args[0].args, branch.args[1]
    if _reduces(row_max, aten.amax.default, _AMAX, dim, s1) is None or not is_call(s1, aten.mul.Tensor):
        return None
    sign, t = next(((w, t) for w in s1.args if (t := _sign_of(w)) is not None), (None, None))
    if sign is None or not is_call(divisor, aten.mul.Tensor) or set(divisor.args) != {sign, t} or len(set(s1.args)) != 2:
        return None
    x = next(arg for arg in s1.args if arg is not sign)
    if not isinstance(x, Node) or not row_constant(t, branch, dim):
        return None
    return x, TensorScale(t, op, branch)


def _is_signed_temperature(branch: Node, scaled: Node, dim: int) -> bool:
    """branch is the signed form of `scaled` (= x op t looked through exact upcasts, t the peel's
    temperature): the first branch of Inductor's where for softmax(x / t) and softmax(x * s)."""
    if (signed := _signed_temperature(branch, dim)) is None:
        return False
    x, temperature = signed
    base, _, factor, tensor = peel_scaled_logits(scaled, dim)
    return tensor is not None and tensor.node is temperature.node and tensor.op == temperature.op and peel_logits(x)[0::2] == (base, factor)


def _sign_of(w: Any) -> Node | None:
    """t if w = where(t >= 0, one, -one) with one = scalar_tensor(1): the sign of t (+1 at zero)."""
    if not is_call(w, aten.where.self) or len(w.args) != 3:
        return None
    cond, one, minus_one = w.args
    if not (is_call(cond, aten.ge.Scalar) and cond.args[1] == 0 and isinstance(cond.args[0], Node)):
        return None
    if not (is_call(one, aten.scalar_tensor.default) and one.args[0] == 1 and is_call(minus_one, aten.neg.default) and minus_one.args[0] is one):
        return None
    if not (one.kwargs.get("dtype") or torch.float32).is_floating_point:  # an unsigned -1 is 255: no sign
        return None
    return cond.args[0]


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


def recognise(node: Node, level: str) -> Softmax | None:
    return match_dynamo_softmax(node) if level == "dynamo" else match_aten_softmax(node)
