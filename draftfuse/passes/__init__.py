"""draftfuse's graph passes: each one a module, a function on a torch.fx graph that returns a report.

    rewrite_softmax_topk(gm, probs=..., lowering=...) -> PassResult   # softmax_topk.py, Dynamo or ATen graphs
    SoftmaxTopkPostGradPass(probs=..., lowering=...)                   # the same, as an Inductor CustomGraphPass
    fold_seed(gm, value_ranges=..., drop_buffer_writes=...) -> PassResult  # seed_fold.py
"""

from draftfuse.passes._report import PassReport, PassResult, Refusal, Rewrite
from draftfuse.passes.seed_fold import fold_seed
from draftfuse.passes.softmax_topk import SoftmaxTopkPostGradPass, rewrite_softmax_topk

__all__ = ["PassReport", "PassResult", "Refusal", "Rewrite", "SoftmaxTopkPostGradPass", "fold_seed", "rewrite_softmax_topk"]
