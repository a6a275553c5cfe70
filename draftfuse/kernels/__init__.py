"""draftfuse's kernels: selection custom ops (torch.ops.draftfuse.argmax_prob / topk_prob), registered
on import, with Triton implementations on CUDA and torch references elsewhere."""

from draftfuse.kernels.selection import (
    argmax_prob,
    argmax_prob_reference,
    capturing_with,
    graph_workspace,
    selection_kernels_available,
    topk_prob,
    topk_prob_reference,
)

__all__ = [
    "argmax_prob",
    "argmax_prob_reference",
    "capturing_with",
    "graph_workspace",
    "selection_kernels_available",
    "topk_prob",
    "topk_prob_reference",
]
