"""softmax -> topk: pick tokens from the logits, never from the full probability tensor.

The rewrite (dim d is the softmax dim and must be the dim the selection reduces):

    p = softmax(s, d)          # s = logits, maybe upcast and divided by a positive temperature
    v, i = topk(p, k, d)       # or max(p, d), argmax(p, d)

becomes, for k = 1:

    i = argmax(x, d, keepdim)                  # x = the logits before upcasts and temperature (or
                                               # the value where looking back stops: forms.py)
    v = 1 / sum(exp(s - max(s)))               # only if v is read; float32 inside, cast like p
                                               # log_softmax: v = -log(sum(exp(s - max(s))))
                                               # probs="ones": v = 1 (0 for log_softmax)

and for k > 1:

    i = topk(x, k, d).indices
    v = exp(s[i] - max(s)) / sum(exp(s - max(s)))   # = exp(s[i] - logsumexp(s)), float32 inside

so the probability tensor is never materialised. Values go through the same casts as the original
probabilities did before the selection, so their dtype and rounding match. With lowering "kernels"
(or "auto" where they run) the index and values come from draftfuse's one-pass selection ops instead.

When it is legal is match.py's docstring (the casts and temperatures looked through: forms.py's): the
dims, k, the writes (effects) that refuse it, and why smallest-probability selections are refused. Results differ
from the unrewritten graph only in two documented cases: rows holding NaN or +inf, and ties that
rounding creates between logits and probabilities (fp16/bf16 softmax, temperature division): argmax
then returns the true maximum of the logits; exact ties resolve to the first index.

Modules, in the order a rewrite goes through them:
    recognise.py  the softmax, as Dynamo graphs and post-grad ATen graphs spell it
    forms.py      casts and temperatures between the logits and the softmax, and the walk back through them
    match.py      graph -> Match or a refusal, for both levels
    emit.py       the new nodes, spelled per level, and the softmax pieces the values reuse
    rewrite.py    values, kernel choice, rewiring, the driver and its report

Why a matcher of our own rather than Inductor's pattern matcher (`register_replacement` with an
`extra_check`): the family is wide (any dim, keepdim or not, chains of casts, temperatures by constant
division or multiplication, Inductor's own `where` temperature form, six selection spellings, k read
off the call), and `register_replacement` traces one pattern per dtype with integer arguments such as
the dim fixed, so the family would need hundreds of traced patterns; the legality is about effects
between nodes, which a pattern's `extra_check` sees only through the same graph walks done here; and the
Dynamo-level rewrite (which `explain`, golden tests and non-Inductor backends see) needs the matcher
anyway. One description (`Match`) serves both levels; only the softmax recogniser differs.
"""

from __future__ import annotations

import torch

from draftfuse.passes.report import PassResult, run_on_copy
from draftfuse.passes.softmax_topk.rewrite import PASS_NAME, check_options, rewrite_graph


def rewrite_softmax_topk(
    gm: torch.fx.GraphModule, *, probs: str = "exact", lowering: str = "torch", half_probs: str = "rewrite"
) -> PassResult:
    """Rewrite every softmax -> topk/max/argmax selection of `gm` to select on the logits.

    Works on Dynamo graphs and on ATen graphs (detected from the graph). Returns a new GraphModule
    (`gm` is untouched) and a report of each rewrite and each refused near-match. Never raises on a
    graph it does not understand: such a graph comes back unchanged.
    probs: "exact" or "ones" (k = 1 values are the constant 1); lowering: "torch", "kernels" or "auto";
    half_probs: "rewrite" or "keep" (leave selections that read fp16/bf16 probabilities alone).
    """
    check_options(probs, lowering, half_probs)
    return run_on_copy(gm, PASS_NAME, lambda graph: rewrite_graph(graph, probs=probs, lowering=lowering, half_probs=half_probs))


__all__ = ["PASS_NAME", "rewrite_graph", "rewrite_softmax_topk"]
