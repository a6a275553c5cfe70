"""Applying the rewrite: selections from the logits, values from the softmax's exp-sum, the pass driver.

For each selection whose input is a softmax (match.py decides whether it may be rewritten), in graph
order: emit the index (argmax/argmin, topk of the logits, or draftfuse's selection op), emit the values
only if something reads them, point the selection's readers at the new nodes, erase what the rewrite
replaced one node at a time (Dynamo graphs are not functional: graph-wide dead-code elimination would
delete in-place writes there). New nodes go right after the softmax: that is where the logits held the
values the selection saw.

The values are computed from the softmax's exp-sum (float32 inside), not read from a probability tensor,
except where something other than selections reads the probabilities, or those of a twin (the same
softmax spelled again, which eager computes bit for bit alike): they are computed anyway then,
and the values are gathered from them at the new index, the very elements the original selection
returned (a recomputed value may differ in its last bit, and code that compares the probabilities with
their max, `probs == probs.max(-1, keepdim=True).values`, would then find no max).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters

from draftfuse.graph.effects import Effects
from draftfuse.graph.selection import Selection, as_selection, readers, rewire_readers
from draftfuse.graph.values import Node, erase_emitted, erase_unused, fake_tensor, level as graph_level, user_location
from draftfuse.kernels import selection_kernels_available  # registers torch.ops.draftfuse.*
from draftfuse.passes.driver import Refuse, rewrite_selections
from draftfuse.passes.report import PassReport, Rewrite
from draftfuse.passes.softmax_topk.emit import PASS_NAME, AtenEmitter, Emitter, SoftmaxParts, TorchEmitter
from draftfuse.passes.softmax_topk.forms import HALF, Softmax, as_cast, peel_logits
from draftfuse.passes.softmax_topk.match import Match, describe, match
from draftfuse.passes.softmax_topk.recognise import recognise

log = logging.getLogger("draftfuse.passes.softmax_topk")

PROBS = ("exact", "ones")
LOWERINGS = ("torch", "kernels", "auto")
HALF_PROBS = ("rewrite", "keep")


def _ones(m: Match, emit: Emitter, like: Node, probs: str) -> bool:
    """Whether the k = 1 values are the constant probs="ones" asks for: where the level can make a constant
    of `like`'s shape (a Dynamo graph's ones_like any; ATen's full a static one) and no gradient flows
    through them (else the exact values, as the report says)."""
    return m.k == 1 and probs == "ones" and not m.needs_grad and emit.can_fill(like)


def _replay_casts(m: Match, emit: Emitter, value: Node) -> Node:
    """Cast values like the original probabilities, then through the casts the selection saw. A cast
    down to fp16/bf16 is `draftfuse::round_to`, so that readers fused after it see the rounded value."""
    for dtype in [m.prob_dtype, *m.prob_casts]:
        if emit.dtype_of(value) != dtype:
            value = emit.call("round" if dtype in HALF else "cast", value, dtype)
    return value


def read_elsewhere(softmax: Softmax, twins: list[Node], rewritten: Callable[[Selection], bool]) -> bool:
    """Whether anything but selections this pass rewrites (directly or through casts) reads the
    probabilities, or those of a twin: the same softmax spelled again (a helper's `softmax(logits)`),
    which eager computes bit for bit alike, so a reader comparing the twin's probabilities with the
    values (`probs >= values[:, -1:]`) must get values from a probability tensor too (Inductor merges
    the twins into one)."""
    return any(_read_by_others(node, rewritten) for node in [softmax.node, *twins])


def _twins(softmax: Softmax, level: str, limit: int = 256) -> list[Node]:
    """Other softmaxes over the same dim of the same logits (through casts and positive scales, which
    may make them differ: then the values are only gathered where they need not be)."""
    root = peel_logits(softmax.scores)[0]
    seen, frontier, found = {root}, [(root, 0)], []
    while frontier and len(seen) < limit:
        node, depth = frontier.pop()
        if node is not softmax.node:
            try:
                other = recognise(node, level)
            except Refuse:
                other = None
            if other is not None and (other.dim, other.log) == (softmax.dim, softmax.log) and peel_logits(other.scores)[0] is root:
                found.append(node)
        if depth < 8:
            for user in node.users:
                if user not in seen:
                    seen.add(user)
                    frontier.append((user, depth + 1))
    if level == "aten":  # decomposed, each softmax(x, dtype=...) casts x again: twins of equal logits, not the same node
        found += [n for n in _aten_twins(softmax, root) if n not in found]
    return found


def _aten_twins(softmax: Softmax, root: Node) -> list[Node]:
    """Softmaxes of a post-grad graph (functional: an op's value is fixed by its op and inputs) over the same
    dim of logits computed by the same ops from the same inputs."""
    found = []
    for node in softmax.node.graph.nodes:
        if node is softmax.node or node.op != "call_function":
            continue
        try:
            other = recognise(node, "aten")
        except Refuse:
            continue
        if other is not None and (other.dim, other.log) == (softmax.dim, softmax.log) and _same_value(peel_logits(other.scores)[0], root):
            found.append(node)
    return found


def _same_value(a: Any, b: Any, depth: int = 8) -> bool:
    """Whether two post-grad values are computed alike: the same node, equal constants, or the same
    deterministic op over arguments computed alike (at most `depth` ops deep)."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y, depth) for x, y in zip(a, b))
    if not isinstance(a, Node) or not isinstance(b, Node):
        return not isinstance(a, Node) and not isinstance(b, Node) and type(a) is type(b) and a == b
    if depth == 0 or a.op != "call_function" or b.op != "call_function" or a.target != b.target:
        return False
    if torch.Tag.nondeterministic_seeded in getattr(a.target, "tags", ()) or a.kwargs.keys() != b.kwargs.keys():
        return False
    return _same_value(a.args, b.args, depth - 1) and all(_same_value(a.kwargs[k], b.kwargs[k], depth - 1) for k in a.kwargs)


def _read_by_others(probs: Node, rewritten: Callable[[Selection], bool]) -> bool:
    frontier = list(probs.users)
    while frontier:
        user = frontier.pop()
        if as_cast(user) is not None:
            frontier.extend(user.users)
        elif (sel := as_selection(user)) is None or not rewritten(sel):
            return True
    return False


def _half_tensors(m: Match) -> list[Node]:
    """The fp16/bf16 probability tensors on the way from the softmax to the selection that are tensors of
    their own (the softmax's output, or a cast that changes the dtype; not a view, which shares memory)."""
    casts = m.matched[1 : 1 + len(m.prob_casts)]  # Match.matched: the selection, its casts back to the softmax, ...
    return _own_half([m.matched[1 + len(m.prob_casts)], *reversed(casts)])  # the softmax's output first


def _half_twins(twins: list[Node]) -> list[Node]:
    """The fp16/bf16 outputs of the softmax's twins (read_elsewhere), and of the casts right after one that
    make its probabilities fp16/bf16: read beside the values as the softmax's own are."""
    casts = [user for twin in twins for user in twin.users if (as_cast(user) or (None,))[0] is twin]
    return _own_half([*twins, *casts])


def _own_half(nodes: list[Node]) -> list[Node]:
    """Those of `nodes` that hold fp16/bf16 values in a tensor of their own: not a cast to the dtype its input
    has already (p.to(p.dtype) is p itself)."""
    dtype = Emitter.dtype_of
    return [n for n in nodes if dtype(n) in HALF and ((cast := as_cast(n)) is None or dtype(cast[0]) != dtype(n))]


def round_for_readers(half: Node, emitter_cls: type[Emitter], rounded: Node | None = None) -> Node:
    """Make every reader of `half` (fp16/bf16 probabilities that something besides a rewritten selection
    reads) read it through `draftfuse::round_to`, which Inductor stores rounded. Without it, once the
    selection no longer reads the probabilities, Inductor may fuse the softmax into those readers and
    compute them from the unrounded float32 values, while the values the rewrite gathers are rounded:
    `(probs >= values.amin(-1, keepdim=True)).sum(-1)` then counted fewer than the k entries eager keeps.
    A cast is replaced by the same cast as round_to; the softmax's own fp16/bf16 output is copied (its
    readers, in-place writes included, all go to the copy, so aliasing is as it was). `rounded`: the copy
    made for an earlier selection's rewrite, which the new readers (this rewrite's gather) go to as well.
    Returns the round_to."""
    cast = as_cast(half) if rounded is None else None
    if rounded is None:
        source, dtype = cast if cast is not None else (half, fake_tensor(half).dtype)
        rounded = emitter_cls(origin=half, cursor=half).call("round", source, dtype)
    half.replace_all_uses_with(rounded, delete_user_cb=lambda user: user is not rounded)
    if cast is not None:
        half.graph.erase_node(half)
    return rounded


def _gathered(m: Match, emit: Emitter, index: Node, dim_kept: bool) -> Node:
    """The selected elements of the probabilities themselves (computed anyway: read_elsewhere)."""
    at = index if dim_kept else emit.call("unsqueeze", index, m.dim)
    value = emit.call("gather", m.softmax.node, m.dim, at)
    if m.k == 1 and not m.selection.keepdim:
        value = emit.call("squeeze", value, m.dim)
    return _replay_casts(m, emit, value)


def _values(m: Match, parts: SoftmaxParts, index_keepdim: Node, ones: bool, dim_kept: bool) -> Node:
    """The probabilities (or log-probabilities) the selection returned, without the probability tensor
    unless it is read elsewhere (`ones`: the constant probs="ones" asks for)."""
    emit, sel = parts.emit, m.selection
    if parts.read_elsewhere and not ones:
        return _gathered(m, emit, index_keepdim, dim_kept)
    if ones:
        # greedy chains that never read the probabilities: the constant the caller asked for
        value = emit.call("zeros_like" if m.log else "ones_like", index_keepdim, m.prob_dtype)
    elif m.k == 1 and not m.needs_grad:
        # the row maximum of z = s - max(s) is exactly 0 and exp(0) = 1, so p_max = 1 / sum(exp(z)). With
        # grad, z at the index (the same 0) below: max's backward would split a tie's gradient, eager's
        # routes it to the index picked
        value = emit.call("neg", parts.log_sum()) if m.log else emit.call("reciprocal", parts.sum_exp())
    else:
        at = index_keepdim if dim_kept else emit.call("unsqueeze", index_keepdim, m.dim)
        picked = emit.call("gather", parts.z(), m.dim, at)
        value = emit.call("sub", picked, parts.log_sum()) if m.log else emit.call("div", emit.call("exp", picked), parts.sum_exp())
    if m.k == 1 and not sel.keepdim:
        value = emit.call("squeeze", value, m.dim)
    return _replay_casts(m, emit, value)


def _scale_rows_shape(m: Match) -> str | None:
    """How the tensor temperature becomes the kernels' per-row scale: "rows" (one per row, the dim
    kept: squeeze it), "one" (a single value: reshape to 0-d), or None (another broadcast, or one that
    adds dims to the logits: the softmax's dim then counts in a shape the kernels never see)."""
    logits, t = fake_tensor(m.logits), fake_tensor(m.tensor_scale.node)
    if t.dim() > logits.dim():
        return None
    if t.numel() == 1:
        return "one"
    if t.dim() == logits.dim() and list(t.shape[:-1]) == list(logits.shape[:-1]) and t.shape[-1] == 1:
        return "rows"
    return None


def _kernel_choice(m: Match, wants_values: bool, lowering: str) -> tuple[bool, str]:
    """Whether to select with draftfuse's kernels (torch.ops.draftfuse.*), and if not, why."""
    if lowering == "torch":
        return False, ""
    logits = fake_tensor(m.logits)
    reasons = [
        (m.dim != logits.dim() - 1, "the kernels reduce the last dim"),
        (m.needs_grad, "the probabilities require grad (the kernels have no backward)"),
        (m.tensor_scale is not None and _scale_rows_shape(m) is None, "the temperature is not one value per row of the logits"),
        # 1 / t in float32 can round to 0 or inf (t = 1e50) and x * s tie where x / t in float64 does not
        (m.tensor_scale is not None and fake_tensor(m.tensor_scale.at).dtype == torch.float64,
         "the logits are scaled in float64, the kernels scale in float32"),
        # the kernels' probabilities are softmax(x * scale): a constant temperature is not passed to them
        (wants_values and m.factor != 1.0, "values under a constant temperature"),
        (wants_values and m.prob_dtype == torch.float64, "the kernels' probabilities are float32"),
        (lowering == "auto" and not selection_kernels_available(logits.device, logits.dtype, m.k, logits.stride(-1) == 1),
         "they run on CUDA with Triton, k <= 16" + ("" if logits.device.type == "cuda" else f", not on {logits.device.type}")),
    ]  # fmt: skip
    why = [reason for failed, reason in reasons if failed]
    return not why, "; ".join(why)


def _select_with_kernel(m: Match, emit: Emitter, wants_values: bool, probs: str) -> tuple[Node, Node | None]:
    """(index, values or None) from one draftfuse selection op, which reads the logits once."""
    sel = m.selection
    scale = _kernel_scale(m, emit)
    if m.k == 1:  # argmax_prob reduces the dim away: put it back for topk and keepdim=True
        out = emit.call("argmax_prob", m.logits, m.log, scale)
        index = emit.call("getitem", out, 0)
        index = emit.call("unsqueeze", index, m.dim) if sel.keepdim else index
        if not wants_values:
            return index, None
        prob = emit.call("getitem", out, 1)
        prob = emit.call("unsqueeze", prob, m.dim) if sel.keepdim else prob
    else:
        out = emit.call("topk_prob", m.logits, m.k, m.log, scale)
        index = emit.call("getitem", out, 1)
        if not wants_values:
            return index, None
        prob = emit.call("getitem", out, 0)
    if _ones(m, emit, index, probs):
        prob = emit.call("zeros_like" if m.log else "ones_like", index, torch.float32)
    return index, _replay_casts(m, emit, prob)


def _kernel_scale(m: Match, emit: Emitter) -> Node | None:
    """The kernels' scale operand for a tensor temperature: 1 / t (or s) per row, float32."""
    if m.tensor_scale is None:
        return None
    scale = m.tensor_scale.node
    scale = emit.call("reciprocal", emit.to_compute_dtype(scale)) if m.tensor_scale.op == "div" else emit.to_compute_dtype(scale)
    return emit.call("squeeze", scale, -1) if _scale_rows_shape(m) == "rows" else emit.call("reshape", scale, [])


def _emit(m: Match, parts: SoftmaxParts, wants_values: bool, probs: str, lowering: str) -> tuple[Node, Node | None, str, str, bool]:
    """Emit the new index and values: (index, values or None, rule, why not the kernels, whether the
    values are probs="ones"'s constant)."""
    emit, sel = parts.emit, m.selection
    prefix = "log_" if m.log else ""
    gathered = wants_values and parts.read_elsewhere and not (m.k == 1 and probs == "ones")
    use_kernel, why_not = _kernel_choice(m, wants_values and not gathered, lowering)
    if use_kernel:
        index, value = _select_with_kernel(m, emit, wants_values and not gathered, probs)
        if gathered:
            value = _gathered(m, emit, index, m.k > 1 or sel.keepdim)
        op = "draftfuse.argmax_prob" if m.k == 1 else "draftfuse.topk_prob"
        return index, value, f"{prefix}softmax+{sel.kind}(k={m.k}) -> {op}", why_not, _ones(m, emit, index, probs)
    # Under a tensor temperature the order is that of x * sign(s), s the kernels' scale (1 / t for x / t): x's,
    # -x's, or all tied (s = 0: t = +-inf, where x / t is +-0 everywhere, as eager's uniform row has it); integer
    # logits in float64 first (exact up to 2**53), where -x would wrap (uint8, or int8's -128)
    logits = m.logits
    if m.tensor_scale is not None:
        dtype = emit.dtype_of(logits)
        if dtype is None or not (dtype.is_floating_point or dtype.is_complex):
            logits = emit.call("cast", logits, torch.float64)
        scale = m.tensor_scale.node
        scale = emit.call("reciprocal", scale) if m.tensor_scale.op == "div" else scale
        logits = emit.call("mul", logits, emit.call("sign", scale))
    dim_kept = True  # whether index_keepdim keeps the selected dim (as topk's indices do)
    if m.k == 1:
        if sel.keepdim or not (wants_values and probs == "ones"):
            index = index_keepdim = emit.call("argmax", logits, m.dim, sel.keepdim)
            dim_kept = sel.keepdim
        else:  # the constant values take the index's shape with the dim kept
            index_keepdim = emit.call("argmax", logits, m.dim, True)
            index = emit.call("squeeze", index_keepdim, m.dim)
        rule = f"{prefix}softmax+{sel.kind}(k=1) -> argmax"
    else:
        topk = emit.call("topk", logits, m.k, m.dim, True, True)
        index = index_keepdim = emit.call("getitem", topk, 1)
        rule = f"{prefix}softmax+topk(k={m.k}) -> topk(logits)"
    ones = wants_values and _ones(m, emit, index_keepdim, probs)
    value = _values(m, parts, index_keepdim, ones, dim_kept) if wants_values else None
    return index, value, rule, why_not, ones


def _apply(m: Match, parts: SoftmaxParts, probs: str, lowering: str, erased: set[Node]) -> Rewrite:
    """Rewrite one match in place; the nodes it erases are added to `erased`."""
    sel = m.selection
    found = readers(sel)
    wants_values = bool(found[0])
    index, value, rule, why_not, ones = _emit(m, parts, wants_values, probs, lowering)
    rewire_readers(sel, found, index, value)  # emitted: nothing below can fail halfway
    details = [f"dim {m.dim}"]
    if m.tensor_scale is not None:
        details.append(f"temperature tensor {m.tensor_scale.node.name}: the order of x * sign")
    if m.written_by is not None:
        details.append(f"selects from {m.logits.name} as the softmax reads it: {describe(m.written_by)} writes in place before the softmax")
    if wants_values:
        source = "the kernel" if rule.endswith(("argmax_prob", "topk_prob")) else "the exp-sum"
        source = "the probability tensor, read elsewhere too" if parts.read_elsewhere else source
        kind = "log-probabilities" if m.log else "probabilities"
        read = ", though the probabilities are read elsewhere" if ones and parts.read_elsewhere else ""
        details.append(f"{kind} {0 if m.log else 1} (probs='ones'{read})" if ones else f"{kind} from {source}")
    if why_not:
        details.append(f"not the kernels: {why_not}")
    if m.half:
        details.append(f"reads {str(m.read_dtype).removeprefix('torch.')} probabilities: a rounding tie picks the larger logit")
    detail = "; ".join(details)
    erase_unused([*found[0], *found[1], *m.matched], erased)
    counters["draftfuse"][f"{PASS_NAME}.{'k1' if m.k == 1 else 'topk'}"] += 1
    return Rewrite(rule, tuple(n.name for n in m.matched if n.op != "placeholder"), detail, user_location(sel.node))


def rewrite_graph(graph: torch.fx.Graph, *, probs: str = "exact", lowering: str = "torch", half_probs: str = "rewrite") -> PassReport:
    """Rewrite every softmax -> selection of `graph` in place and report; never raises on a graph."""
    level = graph_level(graph)
    report = PassReport(PASS_NAME)
    emitter_cls = AtenEmitter if level == "aten" else TorchEmitter
    parts_by_softmax: dict[Node, SoftmaxParts] = {}  # selections of one softmax share its emitted parts
    twins_of: dict[Node, list[Node]] = {}  # each softmax's twins, found once
    rounded_of: dict[Node, Node] = {}  # a softmax's fp16/bf16 output -> the round_to its other readers read

    last_effects: list[Effects] = []  # of the graph as the selection being applied was matched on

    def match_one(sel: Selection, effects: Effects) -> Match | None:
        last_effects[:] = [effects]
        m = match(sel, level, effects)
        if m is not None and m.half and half_probs == "keep":
            raise Refuse(f'reads {str(m.read_dtype).removeprefix("torch.")} probabilities and half_probs="keep"')
        return m

    def rewritten(sel: Selection) -> bool:
        try:
            return match_one(sel, last_effects[0]) is not None
        except Exception:  # Refuse, or anything a sibling's match raises: counted as a reader (values gathered)
            return False

    def apply(sel: Selection, m: Match, erased: set[Node]) -> Rewrite:
        if m.softmax.node not in twins_of:
            twins_of[m.softmax.node] = _twins(m.softmax, level)
        twins = twins_of[m.softmax.node]
        parts = parts_by_softmax.get(m.softmax.node) or SoftmaxParts(
            emitter_cls(origin=sel.node, cursor=m.softmax.node), m.softmax, read_elsewhere(m.softmax, twins, rewritten), m.written_by is not None
        )
        parts.emit.origin = sel.node
        start = parts.emit.cursor
        half = _half_tensors(m) + _half_twins(twins) if parts.read_elsewhere and m.half else []
        try:
            rewrite = _apply(m, parts, probs, lowering, erased)
        except Exception:
            erase_emitted(start, parts.emit.cursor)
            parts_by_softmax.pop(m.softmax.node, None)
            raise
        parts_by_softmax[m.softmax.node] = parts
        rounded = [node for node in half if node not in erased and set(node.users) - {rounded_of.get(node)}]
        for node in rounded:
            rounded_of[node] = round_for_readers(node, emitter_cls, rounded_of.get(node))
        if rounded:
            note = f"its other readers read the {str(m.read_dtype).removeprefix('torch.')} probabilities stored rounded (round_to)"
            rewrite = dataclasses.replace(rewrite, detail=f"{rewrite.detail}; {note}")
        return rewrite

    rewrite_selections(graph, report, log, match_one, apply)
    if level == "aten":
        graph.eliminate_dead_code()  # post-grad graphs are functional: safe here, and only here
    if probs == "ones" and report.rewrites:  # not on a graph without one (post-grad, after the Dynamo level's)
        report.notes.append('probs="ones": k = 1 values are the constant 1 (0 for log_softmax) where no gradient flows through them (after decomposition, with static shapes only); each rewrite says which it emitted')
    if any(" probabilities: a rounding tie" in r.detail for r in report.rewrites):
        report.notes.append('selections that read fp16/bf16 probabilities were rewritten; half_probs="keep" leaves them')
    return report


def check_options(probs: str, lowering: str, half_probs: str) -> None:
    for name, value, choices in (("probs", probs, PROBS), ("lowering", lowering, LOWERINGS), ("half_probs", half_probs, HALF_PROBS)):
        if value not in choices:
            raise ValueError(f"draftfuse: {name} must be one of {choices}, not {value!r}")

