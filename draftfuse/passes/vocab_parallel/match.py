"""Recognising all_gather -> softmax -> selection (and all_gather -> selection), and deciding whether it
may be localised.

The softmax -> selection part is softmax_topk's own matcher (`softmax_topk.match.match`): the same
spellings, casts, temperatures, k, dims and effects rules, at both levels. On top of it:

  * the logits come from a gather (gather.py) through a reassembly proven to concatenate the rank
    shards along the softmax's dim (layout.py);
  * nothing else reads the gathered logits: every node from the collective to the selection is read
    only by the next nodes of the pattern (the rewrite removes the full logits, so another reader
    would need a gather of its own);
  * effects: nothing writes the gathered tensor or any step of its reassembly between the collective
    and the softmax (softmax_topk's matcher checks the logits and the probabilities themselves), and
    nothing changes torch's global state between the collective and the selection;
  * no gradient flows through the gathered logits (a draft run with grad enabled): the localised
    collective's backward is not the original gather's;
  * k fits in one shard, ids fit the float payload exactly, and a padded vocabulary (a prefix slice)
    leaves rank 0's shard whole and is padded along the last dim.

A bare selection of the gathered logits (argmax, max, topk with no softmax: vLLM's greedy EAGLE draft
takes `logits.argmax(dim=-1)`), through dtype casts and constant scales, is localised under the same
rules, read up to the selection instead of the softmax. Each cast or scale acts on every entry alone, so
each rank replays it on its shard; the selection's values, fp16/bf16/fp32 (fp64), travel exactly in a
float32 (float64) payload (a NaN as a NaN). Refused: smallest selections, topk(sorted=False), integer values.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch

from draftfuse.graph.effects import Effects, written_values
from draftfuse.graph.selection import Selection
from draftfuse.graph.values import Node, fake_tensor, is_call, made_by, normalise_dim, rank, target_key
from draftfuse.passes.driver import Refuse
from draftfuse.passes.softmax_topk.forms import as_cast, as_scale
from draftfuse.passes.softmax_topk.match import Match
from draftfuse.passes.softmax_topk.match import match as match_softmax
from draftfuse.passes.softmax_topk.recognise import SOFTMAX_SPELLINGS
from draftfuse.passes.vocab_parallel import layout
from draftfuse.passes.vocab_parallel.gather import Gather, as_gather, is_gather_node
from draftfuse.passes.vocab_parallel.layout import Reassembly, chain_between, reassemble

aten = torch.ops.aten
PASS_NAME = "vocab_parallel"
# F.pad and its ATen ops: the vocabulary grows after the gather
_PADS = {torch.nn.functional.pad, torch._C._nn.pad, aten.constant_pad_nd.default, aten.pad.default}
# Ops that return their first argument with other values written into it (the functional forms of
# buf[:, ids] = g and buf[:, :n].copy_(g), as AOT autograd writes those): gathered logits scattered so
_SCATTERS = {
    "scatter", "scatter_add", "scatter_reduce", "index_put", "index_copy", "index_add", "masked_scatter",
    torch.scatter, torch.scatter_add, torch.scatter_reduce, torch.index_put, torch.index_copy, torch.index_add,
    torch.masked_scatter, torch.slice_scatter, torch.select_scatter, torch.diagonal_scatter, torch.as_strided_scatter,
    aten.scatter.src, aten.scatter.reduce, aten.scatter_add.default, aten.scatter_reduce.two, aten.index_put.default,
    aten.index_copy.default, aten.index_add.default, aten.masked_scatter.default, aten.slice_scatter.default,
    aten.select_scatter.default, aten.diagonal_scatter.default, aten.as_strided_scatter.default,
}  # fmt: skip
# Exact integers in the payload: float32 holds every id below 2**24, float64 below 2**53.
_EXACT_IDS = {torch.float32: 2**24, torch.float64: 2**53}
# The payload dtype a bare selection's values travel in exactly, by their dtype.
_EXACT_VALUES = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32, torch.float64: torch.float64}
_MOVEMENT = (
    layout._VIEWS | layout._PERMUTES | set(layout._SPLITS) | set(layout._CATS) | layout._MASKS
    | {operator.getitem, aten.select.int, aten.slice.Tensor, "narrow", torch.narrow, aten.narrow.default}
)  # fmt: skip
# What a softmax is made of at either level, for deciding whether a refused selection reads a gather.
_SOFTMAX_PARTS = set(SOFTMAX_SPELLINGS) | {
    aten.amax.default, aten.sub.Tensor, aten.exp.default, aten.sum.dim_IntList, aten.div.Tensor, aten.log.default,
    aten.where.self, aten.mul.Tensor, aten.logical_not.default, aten.any.dims, aten.any.dim, aten.eq.Tensor,
    aten.ne.Scalar, aten.abs.default,
}  # fmt: skip


@dataclasses.dataclass
class Bare:
    """A selection of the gathered logits themselves, with no softmax (vLLM's greedy EAGLE draft:
    `logits.argmax(dim=-1)`), through casts and constant scales: the fields a `Match` has too."""

    selection: Selection
    dim: int  # normalised
    k: int
    logits: Node  # the reassembled logits; the casts and scales up to the selection are VocabMatch.scores


@dataclasses.dataclass
class VocabMatch:
    m: Match | Bare  # the softmax -> selection, as softmax_topk matched it; or a bare selection
    gather: Gather
    layout: Reassembly
    scores: list[Node]  # the ops from the logits to the softmax input (casts, temperature), or to a bare selection's input
    compute: torch.dtype  # float32 (float64 when the softmax or the bare selection computes in it): the payload's dtype
    pattern: list[Node]  # every node the rewrite replaces, in graph order

    @property
    def tp(self) -> int:
        return self.gather.tp

    @property
    def bare(self) -> bool:
        return isinstance(self.m, Bare)


def _walk_back(node: Node, through: set, limit: int = 256) -> Gather | None:
    """The gather behind `node`, walking back only through the ops in `through` (and casts, scales). From
    `node` itself, whatever its op, to the inputs that broadcast to its shape: an op on the gathered entries
    one by one (tanh(g / 30) * 30, g[:, None] + beams), found so that the reassembly names it; not
    h_gathered @ w.T, whose entries are no gathered logits."""
    seen, frontier = {node}, [node]
    while frontier and len(seen) < limit:
        current = frontier.pop()
        found = as_gather(current)
        if found is not None:
            return found
        passes = target_key(current) in through or as_cast(current) or as_scale(current)
        if current is not node and not passes:
            continue
        for source in current.all_input_nodes:
            if not passes and not _broadcasts(source, current):
                continue
            if source not in seen:
                seen.add(source)
                frontier.append(source)
    return None


def _broadcasts(source: Node, node: Node) -> bool:
    """Whether `source`'s value broadcasts to `node`'s shape (True without metadata: nothing is known)."""
    a, b = fake_tensor(source), fake_tensor(node)
    if a is None or b is None:
        return True
    try:
        return tuple(torch.broadcast_shapes(a.shape, b.shape)) == tuple(b.shape)
    except RuntimeError:
        return False


def _gathered_into_buffers(node: Node) -> bool:
    """Whether `node` is a cat of buffers that a gather's value is copied into (`dist.all_gather(list, x)`
    then `torch.cat(list, -1)`, Megatron's spelling; Dynamo traces it to a gather into one tensor, a slice
    of it copied into each buffer): a form the reassembly does not read."""
    if target_key(node) not in layout._CATS or not node.args or not isinstance(node.args[0], (list, tuple)):
        return False
    for buffer in node.args[0]:
        sources = [u.args[1] for u in getattr(buffer, "users", ()) if target_key(u) == "copy_" and u.args[0] is buffer and len(u.args) > 1]
        if any(isinstance(v, Node) and _walk_back(v, _MOVEMENT) is not None for v in sources):
            return True
    return False


def reads_gather(sel: Selection) -> bool:
    """Whether a selection reads gathered logits through a softmax (so a refusal is this pass's news)."""
    try:
        return _walk_back(sel.input, _MOVEMENT | _SOFTMAX_PARTS) is not None
    except Refuse:
        return True


def _other_user(pattern: list[Node], sel: Node) -> tuple[Node, Node] | None:
    inside = set(pattern)
    for node in pattern:
        if node is sel:
            continue
        for user in node.users:
            if user not in inside:
                return node, user
    return None


def _compute_dtype(m: Match) -> torch.dtype:
    dtypes = {getattr(fake_tensor(n), "dtype", None) for n in (m.logits, m.softmax.scores)} | {m.softmax.dtype}
    return torch.float64 if torch.float64 in dtypes else torch.float32


def match(sel: Selection, level: str, effects: Effects, half_probs: str = "rewrite") -> VocabMatch | None:
    """The localisation of one selection; None when its logits are no gather's; Refuse for near-matches."""
    if made_by(sel.node).startswith(PASS_NAME):  # the merge of a rewrite at the Dynamo level, now in ATen ops
        return None
    try:
        m = match_softmax(sel, level, effects)
    except Refuse:
        if reads_gather(sel):
            raise
        return None
    if m is None:
        return _match_bare(sel, effects)
    gather = _gather_of(m.logits, sel.node, effects)
    if gather is None:
        return None
    if m.half and half_probs == "keep":
        raise Refuse('reads half-precision probabilities and half_probs="keep"')
    if m.tensor_scale is not None:
        raise Refuse(f"temperature {m.tensor_scale.node.name} is a tensor (it may differ by rank): not localised, the selection stays on the gathered logits")
    if m.needs_grad:
        # the localised gather's backward need not be the original's (DTensor's full_tensor() takes the local
        # slice of the gradient, a gather's backward sums over the ranks: tp times eager's gradient)
        raise Refuse("the gathered logits require grad: the localised gather's backward is not the original's")
    return _localised(m, gather, list(reversed(m.peeled)), _compute_dtype(m), m.softmax.node, effects)


def _gather_of(logits: Node, sel: Node, effects: Effects) -> Gather | None:
    """The gather `logits` are reassembled from; None if none, Refuse where gathered logits reach them
    another way (a near-match whose refusal is news)."""
    gather = _walk_back(logits, _MOVEMENT)
    if gather is not None:
        return gather
    if any(_gathered_into_buffers(n) for n in [logits, *logits.all_input_nodes]):
        raise Refuse("the shards are gathered into a list of buffers (dist.all_gather(list, x), then cat): not localised; "
                     "gather with funcol.all_gather_tensor or dist.all_gather_into_tensor")
    if target_key(logits) in _PADS and isinstance(logits.args[0], Node) and _walk_back(logits.args[0], _MOVEMENT):
        raise Refuse(f"{logits.name} pads the gathered logits before the selection (the vocabulary grows): not localised")
    eagle3 = "as vLLM's EAGLE-3 scatters its draft vocabulary into the target's, or a buffer gathered into again"
    for target in _upstream(logits, _moves):  # the logits, and a buffer they view (dist.all_gather_into_tensor(buf, x))
        if (writer := _written_with_gathered(target, sel, effects)) is not None:
            why = "an input of the draft: its caller sees the gather there" if target.op == "placeholder" else eagle3
            raise Refuse(f"the gathered logits are written into {target.name} by {writer.name} before the selection ({why}): not localised")
    if (writer := _scattered_with_gathered(logits)) is not None:
        raise Refuse(f"the gathered logits are scattered into {_name(writer.args[0])} by {writer.name} before the selection ({eagle3}): not localised")
    return None


def _upstream(node: Node, through: Callable[[Node], bool], limit: int = 64) -> list[Node]:
    """`node` and the nodes it is computed from through nodes for which `through` holds (a bounded walk back)."""
    found, frontier = [node], [node]
    while frontier and len(found) < limit:
        current = frontier.pop()
        if through(current):
            for source in current.all_input_nodes:
                if source not in found:
                    found.append(source)
                    frontier.append(source)
    return found


def _moves(node: Node) -> bool:
    return target_key(node) in _MOVEMENT


def _name(value) -> str:
    return value.name if isinstance(value, Node) else repr(value)


def _written_with_gathered(node: Node, sel: Node, effects: Effects) -> Node | None:
    """A write in place into `node` (through a view too) before the selection whose written values are
    gathered logits (buf[:, ids] = g, buf[:, :n].copy_(g)), if any."""
    for writer in effects.writers([node], node, sel):
        written = set(written_values(writer) or ())
        if any(v not in written and _walk_back(v, _MOVEMENT) for v in writer.all_input_nodes):
            return writer
    return None


def _scattered_with_gathered(node: Node) -> Node | None:
    """The functional scatter (slice_scatter, index_put, scatter, ...) that `node` is, or reads through
    views and casts, whose written values are gathered logits (copied in: aten's copy(slice, g)), if any."""
    for current in _upstream(node, lambda n: _moves(n) or bool(as_cast(n) or as_scale(n))):
        if target_key(current) in _SCATTERS:
            base = current.args[0] if current.args else None
            if any(v is not base and _walk_back(v, _MOVEMENT | {aten.copy.default}) for v in current.all_input_nodes):
                return current
    return None


def _peel_elementwise(node: Node) -> tuple[Node, list[Node]]:
    """From a bare selection's input back through dtype casts and constant scales, each of which acts on
    every entry alone (so it may run on each shard): (the node reached, the nodes peeled, in graph order)."""
    peeled: list[Node] = []
    while (step := as_cast(node) or as_scale(node)) is not None and isinstance(step[0], Node) and not isinstance(step[1], Node):
        peeled.insert(0, node)
        node = step[0]
    return node, peeled


def _match_bare(sel: Selection, effects: Effects) -> VocabMatch | None:
    """A selection of the gathered logits with no softmax: each rank selects on its shard, the merge is
    the softmax one's without the max and exp-sum; values (max, topk) are the chosen logits."""
    logits, elementwise = _peel_elementwise(sel.input)
    gather = _gather_of(logits, sel.node, effects)
    if gather is None:
        return None
    value = fake_tensor(sel.input)
    dim = normalise_dim(sel.dim, rank(sel.input))
    if value is None or dim is None:
        raise Refuse(f"selection dim {sel.dim!r} is not a known constant (or no tensor metadata)")
    k = sel.k
    if isinstance(k, (Node, torch.SymInt)) or not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= value.shape[dim]:
        raise Refuse(f"k={k} is not a known constant in 1..{value.shape[dim]}")
    if not sel.largest:
        raise Refuse(f"a smallest selection ({sel.kind}) of the gathered logits: not localised")
    if sel.kind == "topk" and k > 1 and not sel.sorted:
        raise Refuse("topk(sorted=False): its order is unspecified, a rewrite could permute it")
    for user in sel.node.users if sel.returns_pair else ():
        if not (is_call(user, operator.getitem) and user.args[1] in (0, 1)):
            raise Refuse(f"selection result used as a whole by {user.name}")
    if value.dtype not in _EXACT_VALUES:
        raise Refuse(f"a selection of {value.dtype} values: not exact in a float payload")
    if any(getattr(fake_tensor(n), "requires_grad", False) for n in (logits, sel.input)):
        raise Refuse("the gathered logits require grad: the localised gather's backward is not the original's")
    return _localised(Bare(sel, dim, k, logits), gather, elementwise, _EXACT_VALUES[value.dtype], sel.node, effects)


def _localised(m: Match | Bare, gather: Gather, scores: list[Node], compute: torch.dtype, end: Node, effects: Effects) -> VocabMatch:
    """The legality both forms share, from the gather to `end` (the softmax, or a bare selection), which
    reads `scores` (the nodes from the logits on) last."""
    sel, reader = m.selection, "selection" if end is m.selection.node else "softmax"
    found = reassemble(gather, m.logits, reader)
    if found.dim != m.dim:
        raise Refuse(f"the shards are concatenated along dim {found.dim}, the {reader} is over dim {m.dim}")
    pattern = sorted({*gather.nodes, *chain_between(gather.start, sel.node)}, key=effects.order.get)
    if (other := _other_user(pattern, sel.node)) is not None:
        raise Refuse(f"the gathered logits have other users: {other[0].name} is also read by {other[1].name}")
    if changes := effects.state_changes(gather.anchor, sel.node):  # the rewrite emits at the anchor
        raise Refuse(f"{changes[0].name} changes torch's global state (grad mode, autocast) between the gather and the selection")
    writes = [w for w in effects.writers([gather.start, *found.chain, *scores], gather.anchor, end) if w not in gather.nodes]
    if writes:
        raise Refuse(f"the gathered logits are written in place before the {reader}, by {writes[0].name}")
    if m.k > found.shard_vocab:
        raise Refuse(f"k={m.k} is larger than one shard ({found.shard_vocab} entries)")
    if found.shard_vocab > _EXACT_IDS[compute]:
        raise Refuse(f"a shard of {found.shard_vocab} entries: its ids are not exact in a {compute} payload")
    if found.keep is not None:
        if found.keep < found.shard_vocab:
            raise Refuse(f"a padded vocabulary of {found.keep} real entries leaves rank 0's shard ({found.shard_vocab}) partly padded")
        if found.dim != fake_tensor(m.logits).dim() - 1:
            raise Refuse("a padded vocabulary along a dim other than the last")
    return VocabMatch(m, gather, found, scores, compute, pattern)


__all__ = ["Bare", "VocabMatch", "is_gather_node", "match", "reads_gather"]
