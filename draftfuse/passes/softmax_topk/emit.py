"""Emitting the rewrite: the same few operations spelled for each level, and the pieces of the softmax
that the values need.

`TorchEmitter` writes torch functions as a user would (Dynamo graphs); `AtenEmitter` writes ATen
overloads with every argument given (post-grad graphs). New nodes go one after another from a cursor,
carry fake values and the replaced selection's stack trace (draftfuse.graph.values.insert_after).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from draftfuse.graph.values import Node, fake_tensor, insert_after
from draftfuse.passes.softmax_topk.forms import Softmax, as_cast, as_scale

aten = torch.ops.aten
prims = torch.ops.prims
PASS_NAME = "softmax_topk"


@torch.library.custom_op("draftfuse::round_to", mutates_args=())
def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, as an op Inductor does not fuse into its readers. Inductor elides the rounding of a
    fused float32 -> fp16/bf16 cast when a reader in the same kernel upcasts again (its
    emulate_precision_casts setting, off by default), so a value the rewrite returns in bf16 and a
    reader's arithmetic on it (EAGLE adds parents' scores to the returned log-probabilities) would
    disagree by an ulp; the original's topk returned a stored bf16 tensor, which they agree with. Always a
    new tensor (a copy where x has the dtype already): a custom op's output may not alias its input."""
    return x.to(dtype, copy=True)


@round_to.register_fake
def _round_to_fake(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(x, dtype=dtype)


def _round_to_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad.to(ctx.dtype), None  # a cast's gradient: the incoming one, in the input's dtype


def _round_to_setup(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.dtype = inputs[0].dtype


round_to.register_autograd(_round_to_backward, setup_context=_round_to_setup)


class Emitter:
    pass_name = PASS_NAME  # the provenance new nodes carry

    def __init__(self, origin: Node, cursor: Node) -> None:
        self.origin = origin  # the selection being replaced: new nodes take its stack trace
        self.cursor = cursor  # new nodes go after this one, in order

    def _node(self, op: str, target: Any, args: tuple, kwargs: dict | None = None) -> Node:
        self.cursor = insert_after(
            self.cursor, op, target, args, kwargs, origin=self.origin, provenance=f"{self.pass_name}: replaces {self.origin.name}"
        )
        return self.cursor

    def call(self, name: str, *args: Any) -> Node:
        raise NotImplementedError

    def copy_with(self, node: Node, replaced: dict[Node, Node]) -> Node:
        """`node`'s op again, with the inputs in `replaced` replaced."""
        swap = lambda a: replaced.get(a, a) if isinstance(a, Node) else a  # noqa: E731
        return self._node(node.op, node.target, tuple(map(swap, node.args)), {k: swap(v) for k, v in node.kwargs.items()})

    def can_fill(self, like: Node) -> bool:
        """Whether call("ones_like", like, ...) can be emitted: ones_like takes any shape."""
        return True

    @staticmethod
    def dtype_of(node: Node) -> torch.dtype | None:
        value = fake_tensor(node)
        return value.dtype if value is not None else None

    def to_compute_dtype(self, node: Node) -> Node:
        """float32 for half types and float32, float64 for float64: the precision softmax computes in."""
        dtype = self.dtype_of(node)
        target = torch.float64 if dtype == torch.float64 else torch.float32
        return node if dtype == target else self.call("cast", node, target)


class TorchEmitter(Emitter):
    """Dynamo graphs: torch functions and Tensor methods, as a user would write them."""

    _FUNCTIONS = {
        "argmax": (torch.argmax, ("dim", "keepdim")),
        "argmin": (torch.argmin, ("dim", "keepdim")),
        "topk": (torch.topk, ("k", "dim", "largest", "sorted")),
        "amax": (torch.amax, ("dim", "keepdim")),
        "sum": (torch.sum, ("dim", "keepdim")),
        "sub": (torch.sub, ()),
        "mul": (torch.mul, ()),
        "sign": (torch.sign, ()),
        "reshape": (torch.reshape, ("shape",)),
        "div": (torch.div, ()),
        "exp": (torch.exp, ()),
        "log": (torch.log, ()),
        "neg": (torch.neg, ()),
        "reciprocal": (torch.reciprocal, ()),
        "gather": (torch.gather, ("dim", "index")),
        "squeeze": (torch.squeeze, ("dim",)),
        "unsqueeze": (torch.unsqueeze, ("dim",)),
        "argmax_prob": (torch.ops.draftfuse.argmax_prob.default, ("log", "scale")),
        "topk_prob": (torch.ops.draftfuse.topk_prob.default, ("k", "log", "scale")),
    }

    def call(self, name: str, *args: Any) -> Node:
        if name == "cast":
            return self._node("call_method", "to", args)
        if name == "round":
            return self._node("call_function", torch.ops.draftfuse.round_to.default, args)
        if name == "getitem":
            return self._node("call_function", operator.getitem, args)
        if name in ("ones_like", "zeros_like"):
            fn = torch.ones_like if name == "ones_like" else torch.zeros_like
            return self._node("call_function", fn, args[:1], {"dtype": args[1]})
        fn, keywords = self._FUNCTIONS[name]
        split = len(args) - len(keywords)
        kwargs = {k: v for k, v in zip(keywords, args[split:]) if not (k == "scale" and v is None)}
        return self._node("call_function", fn, args[:split], kwargs)


class AtenEmitter(Emitter):
    """Post-grad graphs: ATen overloads with every argument given, as Inductor expects."""

    def can_fill(self, like: Node) -> bool:
        """ATen's full takes a static shape only (symbolic sizes would need sym_size nodes)."""
        value = fake_tensor(like)
        return value is not None and all(isinstance(size, int) for size in value.shape)

    def _full(self, like: Node, value: float, dtype: torch.dtype) -> Node:
        # post-grad graphs are decomposed: full_like is gone, full is what Inductor lowers
        fake = fake_tensor(like)
        shape = [int(size) for size in fake.shape]  # callers check can_fill first
        kwargs = {"dtype": dtype, "layout": torch.strided, "device": fake.device, "pin_memory": False}
        return self._node("call_function", aten.full.default, (shape, value), kwargs)

    def call(self, name: str, *args: Any) -> Node:
        if name in ("ones_like", "zeros_like"):
            return self._full(args[0], 1.0 if name == "ones_like" else 0.0, args[1])
        spelled = {
            "cast": lambda x, d: (prims.convert_element_type.default, (x, d)),
            "round": lambda x, d: (torch.ops.draftfuse.round_to.default, (x, d)),
            "getitem": lambda x, i: (operator.getitem, (x, i)),
            "argmax": lambda x, d, kd: (aten.argmax.default, (x, d, kd)),
            "argmin": lambda x, d, kd: (aten.argmin.default, (x, d, kd)),
            "topk": lambda x, k, d, lg, s: (aten.topk.default, (x, k, d, lg, s)),
            "amax": lambda x, d, kd: (aten.amax.default, (x, [d], kd)),
            "sum": lambda x, d, kd: (aten.sum.dim_IntList, (x, [d], kd)),
            "sub": lambda a, b: (aten.sub.Tensor, (a, b)),
            "mul": lambda a, b: (aten.mul.Tensor, (a, b)),
            "sign": lambda x: (aten.sign.default, (x,)),
            "reshape": lambda x, shape: (aten.reshape.default, (x, shape)),
            "div": lambda a, b: (aten.div.Tensor, (a, b)),
            "exp": lambda x: (aten.exp.default, (x,)),
            "log": lambda x: (aten.log.default, (x,)),
            "neg": lambda x: (aten.neg.default, (x,)),
            "reciprocal": lambda x: (aten.reciprocal.default, (x,)),
            "gather": lambda x, d, i: (aten.gather.default, (x, d, i)),
            "squeeze": lambda x, d: (aten.squeeze.dim, (x, d)),
            "unsqueeze": lambda x, d: (aten.unsqueeze.default, (x, d)),
            "argmax_prob": lambda x, lg, sc: (torch.ops.draftfuse.argmax_prob.default, (x, lg) if sc is None else (x, lg, sc)),
            "topk_prob": lambda x, k, lg, sc: (torch.ops.draftfuse.topk_prob.default, (x, k, lg) if sc is None else (x, k, lg, sc)),
        }[name]
        target, target_args = spelled(*args)
        return self._node("call_function", target, target_args)


class SoftmaxParts:
    """The pieces of softmax(s) the values need: z = s - max(s) and sum(exp(z)), float32 inside.

    On a Dynamo graph they are emitted when first needed; on a post-grad ATen graph the decomposed
    softmax already computes them and they are reused as they are (so values are bit-identical there).
    Rewrites of one softmax share one SoftmaxParts, hence one exp-sum.
    """

    def __init__(self, emit: Emitter, softmax: Softmax, read_elsewhere: bool = False, scores_written: bool = False) -> None:
        self.emit, self.softmax = emit, softmax
        self.read_elsewhere = read_elsewhere  # something but selections reads the softmax (rewrite.read_elsewhere)
        self.scores_written = scores_written  # the scores, or what they are computed from, are written in place before the softmax
        self._z, self._sum_exp, self._log_sum = softmax.z, softmax.sum_exp, softmax.log_sum

    def z(self) -> Node:
        if self._z is None:
            s, emit = self._scores_of_float_logits(), self.emit
            if self.softmax.dtype not in (None, emit.dtype_of(s)):  # softmax(x, dtype=d) computes on x.to(d)
                s = emit.call("cast", s, self.softmax.dtype)
            s = emit.to_compute_dtype(s)
            self._z = emit.call("sub", s, emit.call("amax", s, self.softmax.dim, True))
        return self._z

    def _scores_of_float_logits(self) -> Node:
        """The softmax input; for integer logits scaled into floats (x / t, x * 0.5) the same scale of x made
        float first, the same value (torch promotes x so): Inductor's joint-graph pass rewrites s - amax(s)
        into (x * sign - max(x * sign)) / (sign * t) in x's dtype, where int8's -128 * -1 wraps around. Not
        where the scores or what they are computed from are written in place before the softmax (s.mul_(0.25)):
        the expression computed again would miss the write."""
        emit, casts, s = self.emit, [], self.softmax.scores
        if self.scores_written:
            return s
        while (cast := as_cast(s)) is not None and isinstance(cast[0], Node):  # s4 = (x / t).to(float32), say
            casts.append(s)
            s = cast[0]
        step = as_scale(s)
        x = step[0] if step is not None else None
        dtype, result = (emit.dtype_of(x), emit.dtype_of(s)) if isinstance(x, Node) else (None, None)
        if dtype is None or dtype.is_floating_point or result is None or not result.is_floating_point:
            return self.softmax.scores
        old, new = s, emit.copy_with(s, {x: emit.call("cast", x, result)})
        for cast in reversed(casts):
            old, new = cast, emit.copy_with(cast, {old: new})
        return new

    def sum_exp(self) -> Node:
        if self._sum_exp is None:
            self._sum_exp = self.emit.call("sum", self.emit.call("exp", self.z()), self.softmax.dim, True)
        return self._sum_exp

    def log_sum(self) -> Node:
        if self._log_sum is None:
            self._log_sum = self.emit.call("log", self.sum_exp())
        return self._log_sum
