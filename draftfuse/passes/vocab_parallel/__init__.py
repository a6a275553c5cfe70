"""Vocab-parallel drafts: all_gather -> softmax -> topk becomes a selection on each rank's own shard and
one gather of k candidates per rank.

Under tensor parallelism a draft's LM head is vocab-sharded: rank r holds logits for the vocabulary
entries [r * S, (r + 1) * S). Servers all-gather the full [B, V] logits to every rank, then take
softmax and topk. The rewrite:

    full = reassemble(all_gather(shard_r))         # [B, tp * S]
    p = softmax(full)       (casts, temperature)   # as softmax_topk knows it
    v, i = topk(p, k)       (argmax, max, log_softmax ...)

becomes, in the same captured region (no host sync, no rank read on the host at run time):

    local: top-k of shard_r with ids, max m_r and exp-sum t_r of the softmax input (float32)
    one all_gather of those 2k + 2 numbers per row, over the same group
    merge: ids + r * S, the top k of the tp * k candidates, values from M = max m_r and
           T = sum t_r * exp(m_r - M)

A bare selection of the gathered logits (argmax, max, topk with no softmax, through casts and constant
scales: `logits.argmax(dim=-1)`) is localised the same way, without m_r and t_r; its values are the
chosen logits. emit.py has the formulas. Exactness: every vocabulary entry belongs to exactly one shard, and the
global top-k entries are each in their own shard's top k, so the candidates contain them; ties are
broken by rank order across shards (the lower global id, as the rank blocks ascend) and by the
local selection within one (argmax: the first; topk_prob: the lower id; torch.topk: as it does,
arbitrarily on a CPU, as in the single-GPU rewrite). NaN and +inf follow the single-GPU rewrite: a
NaN or +inf anywhere in a row makes M or T NaN, so every value of the row is NaN, and the index is
torch.argmax's (the first NaN, else the first +inf) for k = 1. A shard of -inf only adds nothing.
Values are exp(s_v - M) / T in float32: the full softmax's, up to float32 rounding of the sum split
by shard. What is recognised and refused: gather.py, layout.py, match.py.

Modules: gather.py (the collective and its group), layout.py (the reassembly, proven), match.py
(softmax_topk's matcher plus this pass's legality), emit.py (the new nodes), rewrite.py (the driver).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from draftfuse.passes.report import PassReport, PassResult, run_on_copy
from draftfuse.passes.softmax_topk.rewrite import check_options
from draftfuse.passes.vocab_parallel.emit import PASS_NAME
from draftfuse.passes.vocab_parallel.rewrite import has_gather, rewrite_graph


def rewrite_vocab_parallel(
    gm: torch.fx.GraphModule, *, probs: str = "exact", lowering: str = "torch", half_probs: str = "rewrite"
) -> PassResult:
    """Localise every all_gather -> softmax -> selection of `gm` (Dynamo or ATen graph). Returns a new
    GraphModule (`gm` is untouched) and the report; never raises on a graph (rewrite_graph refuses
    what fails; a graph that then does not lint comes back as it was). Options as rewrite_softmax_topk's;
    an option it does not know raises ValueError."""
    check_options(probs, lowering, half_probs)
    return run_on_copy(gm, PASS_NAME, lambda graph: rewrite_graph(graph, probs=probs, lowering=lowering, half_probs=half_probs))


def dynamo_pass(gm: torch.fx.GraphModule, options) -> PassResult | None:
    """The pipeline's Dynamo-level step: None (no report) for a graph without a gather."""
    if not has_gather(gm.graph):
        return None
    return rewrite_vocab_parallel(gm, probs=options.probs, lowering=options.lowering, half_probs=options.half_probs)


def post_grad_pass(graph: torch.fx.Graph, options) -> PassReport | None:
    """The post-grad step, in place: None (no report) for a graph without a gather."""
    if not has_gather(graph):
        return None
    report = rewrite_graph(graph, probs=options.probs, lowering=options.lowering, half_probs=options.half_probs)
    report.pass_name = f"{PASS_NAME} (post-grad)"
    return report


def cache_key() -> tuple | None:
    """What the post-grad rewrite depends on besides the graph: this process's rank (a padded
    vocabulary's mask holds it), for the FX graph cache shared by the ranks of one machine."""
    if dist.is_available() and dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size())
    return None


__all__ = ["PASS_NAME", "cache_key", "dynamo_pass", "post_grad_pass", "rewrite_graph", "rewrite_vocab_parallel"]
