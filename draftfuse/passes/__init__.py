"""draftfuse's graph passes: pure functions on torch.fx graphs, each returning a new graph and a report.

    rewrite_softmax_topk(gm, probs=..., lowering=..., half_probs=...) -> PassResult   # softmax_topk/
    fold_seed(gm, value_ranges=..., drop_buffer_writes=...) -> PassResult           # seed_fold/
    rewrite_vocab_parallel(gm, ...) -> PassResult                                   # vocab_parallel/
    PostGradPass(options)    # Inductor CustomGraphPass: softmax -> topk and setup merging (merge_setup.py)
"""

from draftfuse.passes.post_grad import PostGradPass
from draftfuse.passes.report import PassReport, PassResult, Refusal, Rewrite
from draftfuse.passes.seed_fold import fold_seed
from draftfuse.passes.softmax_topk import rewrite_softmax_topk
from draftfuse.passes.vocab_parallel import rewrite_vocab_parallel

__all__ = ["PassReport", "PassResult", "PostGradPass", "Refusal", "Rewrite", "fold_seed", "rewrite_softmax_topk", "rewrite_vocab_parallel"]
