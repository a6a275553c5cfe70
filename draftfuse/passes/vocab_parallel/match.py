"""Recognising all_gather -> softmax -> selection, and deciding whether it may be localised.

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
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from draftfuse.graph.effects import Effects
from draftfuse.graph.selection import Selection
from draftfuse.graph.values import Node, fake_tensor, target_key
from draftfuse.passes.driver import Refuse
from draftfuse.passes.softmax_topk.forms import as_cast, as_scale
from draftfuse.passes.softmax_topk.match import Match
from draftfuse.passes.softmax_topk.match import match as match_softmax
from draftfuse.passes.softmax_topk.recognise import SOFTMAX_SPELLINGS
from draftfuse.passes.vocab_parallel import layout
from draftfuse.passes.vocab_parallel.gather import Gather, as_gather, is_gather_node
from draftfuse.passes.vocab_parallel.layout import Reassembly, chain_between, reassemble

aten = torch.ops.aten
# Exact integers in the payload: float32 holds every id below 2**24, float64 below 2**53.
_EXACT_IDS = {torch.float32: 2**24, torch.float64: 2**53}
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
class VocabMatch:
    m: Match  # the softmax -> selection, as softmax_topk matched it
    gather: Gather
    layout: Reassembly
    scores: list[Node]  # the ops from the logits to the softmax input (casts, temperature), in order
    compute: torch.dtype  # float32 (float64 when the softmax computes in it): the payload's dtype
    pattern: list[Node]  # every node the rewrite replaces, in graph order

    @property
    def tp(self) -> int:
        return self.gather.tp


def _walk_back(node: Node, through: set, limit: int = 256) -> Gather | None:
    """The gather behind `node`, walking back only through the ops in `through` (and casts, scales)."""
    seen, frontier = {node}, [node]
    while frontier and len(seen) < limit:
        current = frontier.pop()
        found = as_gather(current)
        if found is not None:
            return found
        if current is not node and not (target_key(current) in through or as_cast(current) or as_scale(current)):
            continue
        for source in current.all_input_nodes:
            if source not in seen:
                seen.add(source)
                frontier.append(source)
    return None


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
    try:
        m = match_softmax(sel, level, effects)
    except Refuse:
        if reads_gather(sel):
            raise
        return None
    if m is None:
        return None
    gather = _walk_back(m.logits, _MOVEMENT)
    if gather is None:
        if any(_gathered_into_buffers(n) for n in [m.logits, *m.logits.all_input_nodes]):
            raise Refuse("the shards are gathered into a list of buffers (dist.all_gather(list, x), then cat): not localised; "
                         "gather with funcol.all_gather_tensor or dist.all_gather_into_tensor")
        return None
    if m.half and half_probs == "keep":
        raise Refuse('reads half-precision probabilities and half_probs="keep"')
    if m.tensor_scale is not None:
        raise Refuse(f"temperature {m.tensor_scale.node.name} is a tensor: not localised (softmax_topk selects on the gathered logits)")
    if m.needs_grad:
        # the localised gather's backward need not be the original's (DTensor's full_tensor() takes the local
        # slice of the gradient, a gather's backward sums over the ranks: tp times eager's gradient)
        raise Refuse("the gathered logits require grad: the localised gather's backward is not the original's")
    found = reassemble(gather, m.logits)
    if found.dim != m.dim:
        raise Refuse(f"the shards are concatenated along dim {found.dim}, the softmax is over dim {m.dim}")
    pattern = sorted({*gather.nodes, *chain_between(gather.start, sel.node)}, key=effects.order.get)
    if (other := _other_user(pattern, sel.node)) is not None:
        raise Refuse(f"the gathered logits have other users: {other[0].name} is also read by {other[1].name}")
    if changes := effects.state_changes(gather.anchor, sel.node):  # the rewrite emits at the anchor
        raise Refuse(f"{changes[0].name} changes torch's global state (grad mode, autocast) between the gather and the selection")
    writes = [w for w in effects.writers([gather.start, *found.chain], gather.anchor, m.softmax.node) if w not in gather.nodes]
    if writes:
        raise Refuse(f"the gathered logits are written in place before the softmax, by {writes[0].name}")
    if m.k > found.shard_vocab:
        raise Refuse(f"k={m.k} is larger than one shard ({found.shard_vocab} entries)")
    compute = _compute_dtype(m)
    if found.shard_vocab > _EXACT_IDS[compute]:
        raise Refuse(f"a shard of {found.shard_vocab} entries: its ids are not exact in a {compute} payload")
    if found.keep is not None:
        if found.keep < found.shard_vocab:
            raise Refuse(f"a padded vocabulary of {found.keep} real entries leaves rank 0's shard ({found.shard_vocab}) partly padded")
        if found.dim != fake_tensor(m.logits).dim() - 1:
            raise Refuse("a padded vocabulary along a dim other than the last")
    return VocabMatch(m, gather, found, list(reversed(m.peeled)), compute, pattern)


__all__ = ["VocabMatch", "is_gather_node", "match", "reads_gather"]
