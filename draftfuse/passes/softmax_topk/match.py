"""Deciding whether a softmax -> selection may be rewritten: graph -> `Match` or a refusal (`Refuse`,
with the reason). One description serves both levels; recognise.py finds the softmax at each level,
forms.py walks back from it to the logits.

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
from typing import Any

import torch

from draftfuse.graph.effects import Effects
from draftfuse.graph.selection import Selection
from draftfuse.graph.values import Node, fake_tensor, is_call, normalise_dim, rank, user_location
from draftfuse.passes.driver import Refuse
from draftfuse.passes.softmax_topk.forms import HALF, Softmax, TensorScale, as_cast, peel_scaled_logits
from draftfuse.passes.softmax_topk.recognise import recognise

# torch 2.11's Inductor computes topk(x, k, dim) over a dim other than the last (or over a permuted view)
# from x as written by later in-place writes of the graph: topk(x, 3, 0), then x[..., 2] = v and x.neg_(),
# gave the indices of the written x (a clone of x before the topk did not help; 2.13 is right). Such a
# rewrite is refused there: the softmax read a tensor of its own.
_TOPK_MISSES_LATER_WRITES = torch.torch_version.TorchVersion(torch.__version__) < (2, 13)


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
    written_by: Node | None = None  # the last in-place write to the logits or their inputs before the softmax (what it reads)

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


def _unkept_cast(dtype: Any) -> str:
    """Why a cast of the probabilities cannot be kept by the rewrite ("" if it can)."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return f"cast to {dtype} between softmax and selection changes the order"
    if dtype.itemsize == 1:  # 3 or 2 mantissa bits: ties everywhere, where the original picks the lowest index
        return f"cast to {dtype} between softmax and selection: most close probabilities round to one value"
    return ""


def _peel_casts_after_softmax(sel: Selection, level: str) -> tuple[Node, list[torch.dtype], list[Node]] | None:
    """Walk from the selection's input back through casts: (node, casts in order, cast nodes); None past a
    cast the rewrite cannot keep, unless a softmax is behind it (Refuse, with the cast's reason)."""
    node, casts, cast_nodes, why = sel.input, [], [], ""
    while (cast := as_cast(node)) is not None:
        src, dtype = cast
        why = why or _unkept_cast(dtype)
        casts.insert(0, dtype)
        cast_nodes.append(node)
        node = src
    if not why:
        return node, casts, cast_nodes
    if _near_softmax(node, level):
        raise Refuse(why)
    return None  # x.long().argmax(): no softmax, nothing to say


def _looks_like_softmax(node: Any, level: str) -> bool:
    if not isinstance(node, Node):
        return False
    try:
        return recognise(node, level) is not None
    except Refuse:
        return True


def _near_softmax(node: Node, level: str, itself: bool = True) -> bool:
    """Whether `node` (with `itself`) or one of its arguments looks like a softmax: a near-match, whose
    refusal is news."""
    if itself and _looks_like_softmax(node, level):
        return True
    return node.op != "placeholder" and any(_looks_like_softmax(a, level) for a in node.args)


def match(sel: Selection, level: str, effects: Effects) -> Match | None:
    """The rewrite of one selection; None if its input is no softmax; Refuse for near-matches."""
    peeled_casts = _peel_casts_after_softmax(sel, level)
    if peeled_casts is None:
        return None
    probs_node, casts, cast_nodes = peeled_casts
    softmax = recognise(probs_node, level)
    if softmax is None:
        if _near_softmax(probs_node, level, itself=False):
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
    logits, peeled, factor, tensor = peel_scaled_logits(  # one tensor temperature: the softmax's own, or one peeled
        softmax.scores, None if softmax.temperature else softmax.dim, lambda node: not _writes_before(node, softmax.node, effects)
    )
    tensor = softmax.temperature or tensor
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
        written_by=(_writes_before(logits, softmax.node, effects) or [None])[-1],  # the write the softmax reads
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
    if softmax.z is not None:  # ATen: the decomposed softmax reads its input at s - amax(s), before its last node
        inputs = [softmax.scores, *([softmax.temperature.node] if softmax.temperature else [])]
        if between := effects.writers(inputs, _first_read(inputs, softmax.node, effects), softmax.node):
            raise Refuse(f"the softmax's input {softmax.scores.name} is written in place between its reads, by {describe(between[0])}")
    chain = [*peeled, softmax.node]  # in graph order: each reads the one before
    if changes := effects.state_changes(min(chain, key=effects.order.get), sel.node):
        raise Refuse(
            f"{describe(changes[0])} changes torch's global state (grad mode, autocast) between the softmax "
            "and the selection: the rewritten values would be computed under the softmax's"
        )


def _first_read(inputs: list[Node], softmax: Node, effects: Effects) -> Node:
    """The first node of the decomposed softmax (the nodes between `inputs` and `softmax`) that reads one of `inputs`."""
    floor = min(effects.order[node] for node in inputs)
    pieces, stack = {softmax}, [softmax]
    while stack:
        for source in stack.pop().all_input_nodes:
            if source not in pieces and effects.order[source] > floor:
                pieces.add(source)
                stack.append(source)
    return min((user for node in inputs for user in node.users if user in pieces), key=effects.order.get, default=softmax)


def _target_name(node: Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def describe(node: Node) -> str:
    where = user_location(node)
    return f"{node.name} ({_target_name(node)})" + (f" at {where}" if where else "")
