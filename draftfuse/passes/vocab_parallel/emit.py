"""Emitting the localised selection: per rank on its own logits L_r, one gather of the candidates, the merge.

Per rank (d = the vocabulary dim, kept; S = entries per shard; compute dtype c = float32, or float64):
    v_r, i_r = topk(L_r, k, d)                        (k = 1: argmax and its value; or draftfuse's kernels)
    m_r = max(s_r), t_r = sum(exp(s_r - m_r))         (s_r = the softmax's input on L_r; only if values
                                                       are read, and not for probs="ones" with k = 1)
    payload = cat([v_r, i_r, m_r, t_r] as c, d)       2k (+ 2) numbers per row
All ranks: g = all_gather(payload) over the gather's own group -> [tp, ...payload]; rank r's ids
become global by + r * S (r is g's leading index: no rank is baked into the graph, except a padded
vocabulary's mask, which needs this rank's count of real entries).
Merge (candidates in rank-major order, tp * k per row):
    k = 1: j = argmax over the tp maxima (the first of equal ones: the lowest rank, hence the lowest
           global id; NaN counts as the largest, as torch.argmax has it)
    k > 1: a stable descending sort of the candidates, the first k (ties: the lower position, i.e. the
           lower rank, then the local selection's own order)
    M = max_r m_r,  T = sum_r t_r * exp(m_r - M)      (a rank whose weight exp(m_r - M) is 0 adds 0:
                                                       its shard is all -inf, or far below M)
    values: k = 1: 1 / T (log: -log T); k > 1: exp(s_v - M) / T (log: s_v - M - log T), s_v the
            softmax input of the chosen logits, then the original's casts.
A bare selection of the logits (no softmax): the same with torch's selection on this rank's logits (their
casts and constant scales replayed on the shard), no m_r, t_r; its values are the chosen candidates, cast
back to the selection input's dtype (exact: the payload holds every fp16/bf16/fp32 value, fp64 in float64;
a NaN stays a NaN, with other bits maybe).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from draftfuse.graph.values import Node, fake_tensor
from draftfuse.passes.softmax_topk.emit import AtenEmitter, TorchEmitter
from draftfuse.passes.softmax_topk.rewrite import _kernel_choice, _replay_casts
from draftfuse.passes.vocab_parallel.match import PASS_NAME, VocabMatch

aten = torch.ops.aten
prims = torch.ops.prims


class _Spelled:
    """New nodes carry this pass's provenance; `replay` re-emits a node of the graph on new inputs."""

    pass_name = PASS_NAME

    def replay(self, node: Node, source: Node, new: Node, args: tuple | None = None, kwargs: dict | None = None) -> Node:
        args, kwargs = torch.fx.node.map_arg(
            (node.args if args is None else args, node.kwargs if kwargs is None else kwargs), lambda a: new if a is source else a
        )
        return self._node(node.op, node.target, args, kwargs)

    def collective(self, vm: VocabMatch, payload: Node) -> Node:
        gather = vm.gather
        gathered = self._node("call_function", gather.level_target, (payload, gather.tp, gather.group_name))
        return self._node("call_function", gather.wait_target, (gathered,))


class TorchVocabEmitter(_Spelled, TorchEmitter):
    def call(self, name: str, *args: Any) -> Node:
        if name == "kernel":  # draftfuse's selection op, probabilities unscaled: (logits[, k], log=False)
            return self._node("call_function", getattr(torch.ops.draftfuse, args[0]).default, args[1:], {"log": False})
        if name == "iota":
            return self._node("call_function", torch.arange, (args[0],), {"device": fake_tensor(args[1]).device})
        if name in ("reshape", "permute", "narrow", "masked_fill", "to_local"):
            return self._node("call_method", name, args)
        if name == "sort":
            return self._node("call_function", torch.sort, (args[0],), {"dim": args[1], "descending": True, "stable": True})
        functions = {"cat": torch.cat, "mul": torch.mul, "add": torch.add, "eq": torch.eq, "ge": torch.ge, "where": torch.where}
        if name in functions:
            return self._node("call_function", functions[name], args)
        return super().call(name, *args)


class AtenVocabEmitter(_Spelled, AtenEmitter):
    def call(self, name: str, *args: Any) -> Node:
        if name == "kernel":
            return self._node("call_function", getattr(torch.ops.draftfuse, args[0]).default, (*args[1:], False))
        if name == "iota":
            kwargs = {"start": 0, "step": 1, "dtype": torch.int64, "device": fake_tensor(args[1]).device, "requires_grad": False}
            return self._node("call_function", prims.iota.default, (args[0],), kwargs)
        if name == "narrow":
            x, dim, start, length = args
            return self._node("call_function", aten.slice.Tensor, (x, dim, start, start + length))
        if name == "sort":
            return self._node("call_function", aten.sort.stable, (args[0],), {"stable": True, "dim": args[1], "descending": True})
        if name == "masked_fill":
            x, mask, value = args
            return self._node("call_function", aten.where.self, (mask, self._full(x, value, self.dtype_of(x)), x))
        if name == "reshape":
            x, shape = args
            if not fake_tensor(x).is_contiguous():
                x = self._node("call_function", aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
            return self._node("call_function", aten.view.default, (x, list(shape)))
        spelled = {
            "cat": aten.cat.default, "mul": aten.mul.Tensor, "add": aten.add.Tensor, "eq": aten.eq.Scalar,
            "ge": aten.ge.Scalar, "where": aten.where.self, "permute": aten.permute.default,
        }  # fmt: skip
        if name in spelled:
            return self._node("call_function", spelled[name], args)
        return super().call(name, *args)


def _cast(emit: Any, x: Node, dtype: torch.dtype) -> Node:
    return x if emit.dtype_of(x) == dtype else emit.call("cast", x, dtype)


def _replay_scores(vm: VocabMatch, emit: Any, x: Node) -> Node:
    """The original's ops from the logits on (casts, temperature; a bare selection's scales), on `x`."""
    previous = vm.m.logits
    for node in vm.scores:
        x, previous = emit.replay(node, previous, x), node
    return x


def scores(vm: VocabMatch, emit: Any, x: Node) -> Node:
    """What the softmax exponentiates, for logits `x`: the original's casts and temperature replayed,
    in the compute dtype (ATen graphs: times the scale Inductor applies after the max subtraction)."""
    x = _replay_scores(vm, emit, x)
    softmax = vm.m.softmax
    if softmax.dtype not in (None, emit.dtype_of(x)):
        x = emit.call("cast", x, softmax.dtype)
    x = _cast(emit, x, vm.compute)
    return emit.call("mul", x, softmax.scale) if softmax.scale != 1.0 else x


def local_logits(vm: VocabMatch, emit: Any) -> Node:
    """L_r: this rank's shard, reshaped and indexed as the full logits were, padding masked to -inf. For a
    bare selection, what it selects from on this rank: its casts and scales replayed on L_r before the mask
    (a negative scale of a masked -inf would make the padding win)."""
    gather, found = vm.gather, vm.layout
    x = gather.shard if gather.shard is not None else emit.call("to_local", gather.dtensor)
    if tuple(fake_tensor(x).shape) != found.local_shape:
        x = emit.call("reshape", x, found.local_shape)
    for op in found.ops:
        x = emit.replay(op.node, op.node.args[0], x, op.args, op.kwargs)
    if vm.bare:
        x = _replay_scores(vm, emit, x)
    if found.keep is not None:
        real = max(0, min(found.shard_vocab, found.keep - gather.rank() * found.shard_vocab))
        padding = emit.call("ge", emit.call("iota", found.shard_vocab, x), real)
        x = emit.call("masked_fill", x, padding, float("-inf"))
    return x


def _rank_major(emit: Any, field: Node, dim: int, ndim: int) -> Node:
    """A payload field of every rank, [tp, ..., n at dim + 1, ...], as one row's candidates in rank-major
    order: [..., tp * n at dim, ...] (the ranks moved next to the field, then merged with it)."""
    moved = emit.call("permute", field, [*range(1, dim + 1), 0, *range(dim + 1, ndim + 1)])
    shape = list(fake_tensor(moved).shape)
    return emit.call("reshape", moved, [*shape[:dim], shape[dim] * shape[dim + 1], *shape[dim + 2 :]])


def _local_selection(emit: Any, x: Node, d: int, k: int, use_kernel: bool) -> tuple[str, Node, Node]:
    """The top k of this rank's logits `x` along d, kept: (what selected, values, local ids)."""
    if use_kernel and k == 1:  # only the kernels' index is used: ties to the lower id, NaN first
        ids = emit.call("unsqueeze", emit.call("getitem", emit.call("kernel", "argmax_prob", x), 0), d)
        return "draftfuse.argmax_prob", emit.call("gather", x, d, ids), ids
    if use_kernel:
        ids = emit.call("getitem", emit.call("kernel", "topk_prob", x, k), 1)
        return "draftfuse.topk_prob", emit.call("gather", x, d, ids), ids
    if k == 1:
        ids = emit.call("argmax", x, d, True)
        return "argmax", emit.call("gather", x, d, ids), ids
    top = emit.call("topk", x, k, d, True, True)
    return "topk", emit.call("getitem", top, 0), emit.call("getitem", top, 1)


@dataclasses.dataclass
class _Merged:
    payload: Node  # this rank's candidates (values, ids, then the stats), in the compute dtype
    g: Node  # every rank's payload, [tp, ...payload]
    candidates: Node  # the candidate values of a row, rank-major
    pick: Node  # the positions chosen among them
    index: Node  # the global ids chosen (kept dim)
    ordered: Node | None  # k > 1: the sort the positions come from


def _merge(vm: VocabMatch, emit: Any, fields: list[Node], ndim: int) -> _Merged:
    """The one collective and the merge of every rank's payload `fields`: the first k candidates in
    rank-major order (k = 1: the argmax; k > 1: a stable descending sort)."""
    d, k = vm.m.dim, vm.m.k
    payload = emit.call("cat", fields, d)
    g = emit.call("reshape", emit.collective(vm, payload), [vm.tp, *fake_tensor(payload).shape])
    candidates = _rank_major(emit, emit.call("narrow", g, d + 1, 0, k), d, ndim)
    offsets = emit.call("mul", emit.call("iota", vm.tp, g), vm.layout.shard_vocab)  # rank r's ids start at r * S
    offsets = emit.call("reshape", offsets, [vm.tp] + [1] * ndim)
    local_ids = emit.call("cast", emit.call("narrow", g, d + 1, k, k), torch.int64)
    global_ids = _rank_major(emit, emit.call("add", local_ids, offsets), d, ndim)
    ordered = None
    if k == 1:
        pick = emit.call("argmax", candidates, d, True)
    else:
        ordered = emit.call("sort", candidates, d)
        pick = emit.call("narrow", emit.call("getitem", ordered, 1), d, 0, k)
    return _Merged(payload, g, candidates, pick, emit.call("gather", global_ids, d, pick), ordered)


def _details(vm: VocabMatch) -> list[str]:
    found = vm.layout
    details = [f"tp {vm.tp}, group {vm.gather.group_name!r}, dim {vm.m.dim}, {found.shard_vocab} entries per shard"]
    if found.keep is not None:
        details.append(f"padded vocabulary: {found.keep} real of {vm.tp * found.shard_vocab}, the rest masked")
    return details


def emit_selection(vm: VocabMatch, emit: Any, wants_values: bool, probs: str, lowering: str) -> tuple[Node, Node | None, str, str]:
    """Emit the localised selection: (index, values or None, rule, detail)."""
    if vm.bare:
        return _emit_bare(vm, emit, wants_values)
    m = vm.m
    d, k, sel = m.dim, m.k, m.selection
    use_kernel, why_not = _kernel_choice(m, False, lowering)
    x = local_logits(vm, emit)
    local, best, ids = _local_selection(emit, x, d, k, use_kernel)
    stats = wants_values and not (k == 1 and probs == "ones")
    fields = [_cast(emit, best, vm.compute), _cast(emit, ids, vm.compute)]
    if stats:
        s = scores(vm, emit, x)
        row_max = emit.call("amax", s, d, True)
        fields += [row_max, emit.call("sum", emit.call("exp", emit.call("sub", s, row_max)), d, True)]
    merged = _merge(vm, emit, fields, fake_tensor(x).dim())
    index, value = merged.index, None
    if wants_values:
        value = _values(vm, emit, merged.g, merged.ordered, index, stats, probs)
        if k == 1 and not sel.keepdim:
            value = emit.call("squeeze", value, d)
        value = _replay_casts(m, emit, value)
    if k == 1 and not sel.keepdim:
        index = emit.call("squeeze", index, d)
    prefix = "log_" if m.log else ""
    width = fake_tensor(merged.payload).shape[d]
    rule = f"all_gather+{prefix}softmax+{sel.kind}(k={k}) -> local {local} + all_gather of {width} numbers per row"
    details = _details(vm)
    if wants_values:
        kind = "log-probabilities" if m.log else "probabilities"
        details.append(f"{kind} 1 (probs='ones')" if not stats else f"{kind} from the merged max and exp-sum")
    if why_not:
        details.append(f"not the kernels: {why_not}")
    if m.half:
        details.append("reads half-precision probabilities: a rounding tie picks the larger logit")
    return index, value, rule, "; ".join(details)


def _emit_bare(vm: VocabMatch, emit: Any, wants_values: bool) -> tuple[Node, Node | None, str, str]:
    """A bare selection: torch's own selection on this rank's logits (its casts and scales replayed), the
    merge; its values are the chosen candidates, in the selection input's dtype (exact: the payload holds it)."""
    sel, d, k = vm.m.selection, vm.m.dim, vm.m.k
    x = local_logits(vm, emit)
    local, best, ids = _local_selection(emit, x, d, k, False)
    merged = _merge(vm, emit, [_cast(emit, best, vm.compute), _cast(emit, ids, vm.compute)], fake_tensor(x).dim())
    index, value = merged.index, None
    if wants_values:
        if k == 1:
            value = emit.call("gather", merged.candidates, d, merged.pick)
        else:
            value = emit.call("narrow", emit.call("getitem", merged.ordered, 0), d, 0, k)
        value = _cast(emit, value, emit.dtype_of(sel.input))
        if k == 1 and not sel.keepdim:
            value = emit.call("squeeze", value, d)
    if k == 1 and not sel.keepdim:
        index = emit.call("squeeze", index, d)
    width = fake_tensor(merged.payload).shape[d]
    rule = f"all_gather+{sel.kind}(k={k}) -> local {local} + all_gather of {width} numbers per row"
    details = _details(vm)
    if wants_values:
        details.append("values: the chosen logits")
    return index, value, rule, "; ".join(details)


def _values(vm: VocabMatch, emit: Any, g: Node, ordered: Node | None, index: Node, stats: bool, probs: str) -> Node:
    m, d, k = vm.m, vm.m.dim, vm.m.k
    if not stats:  # k = 1, probs="ones": the constant the caller asked for
        return emit.call("zeros_like" if m.log else "ones_like", index, m.prob_dtype)
    row_max = emit.call("narrow", g, d + 1, 2 * k, 1)
    row_sum = emit.call("narrow", g, d + 1, 2 * k + 1, 1)
    top = emit.call("amax", row_max, 0, True)
    weight = emit.call("exp", emit.call("sub", row_max, top))
    weighted = emit.call("mul", row_sum, weight)
    weighted = emit.call("where", emit.call("eq", weight, 0), emit.call("zeros_like", weighted, vm.compute), weighted)
    total = emit.call("sum", weighted, 0, False)
    if k == 1:
        return emit.call("neg", emit.call("log", total)) if m.log else emit.call("reciprocal", total)
    chosen = emit.call("narrow", emit.call("getitem", ordered, 0), d, 0, k)
    z = emit.call("sub", scores(vm, emit, _cast(emit, chosen, fake_tensor(m.logits).dtype)), emit.call("squeeze", top, 0))
    return emit.call("sub", z, emit.call("log", total)) if m.log else emit.call("div", emit.call("exp", z), total)


__all__ = ["PASS_NAME", "AtenVocabEmitter", "TorchVocabEmitter", "emit_selection"]
