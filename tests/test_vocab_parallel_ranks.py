"""The vocab-parallel rewrite on real ranks: gloo process groups of 2, 4 (and, slow, 8) CPU processes.

Each world is spawned once (tests/_tp.py) and runs every case; each test reads its case's result.
A case: every rank holds a vocabulary shard of logits built from one seed, the draft gathers and
selects, and its tokens must equal the selection on the full logits in one process (exactly; ties,
NaN and inf by the documented rules) with probabilities equal to float32 rounding. Levels: the
Dynamo graph after the pass ("dynamo"), the post-grad ATen graph after it ("aten"), and the whole
pipeline with Inductor: the TP example's drafts under draft_loop, a seed + loop under draftfuse.fold.
"""

import pytest
import torch.distributed as dist

from tests import _tp

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")

TWO = [
    *_tp.case_specs(), "example-draft_loop-chain", "fold-chain", "dtensor_full-grad", "dtensor-draft_loop", "gathered_into_a_list",
    "vllm_greedy_eagle-draft_loop", "bare_fuzz", "example-draft_loop-greedy",
]  # fmt: skip
FOUR = [
    "gather_dim-topk4", "chunk_cat-argmax-special-aten", "view_permute-log_topk3_temperature", "into_buffer-max_temperature-special",
    "dtensor_full-topk4-aten", "chunk_cat-padded_topk2", "gather_dim-topk4-kernels-ties", "gather_dim-last_row_topk2-aten",
    "gather_dim-bare_argmax-special", "gather_dim-bare_padded_max-aten", "vllm_greedy_eagle-draft_loop",
]  # fmt: skip
EIGHT = ["gather_dim-topk4", "chunk_cat-argmax-special", "view_permute-log_topk3_temperature-aten", "dtensor_redistribute-argmax-special",
         "gather_dim-padded_argmax-aten", "gather_dim-topk4-kernels-ties", "example-draft_loop-tree"]  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks():
    return _tp.run_world(2, TWO)


@pytest.fixture(scope="module")
def four_ranks():
    return _tp.run_world(4, FOUR)


@pytest.mark.parametrize("case", TWO)
def test_two_ranks(two_ranks, case):
    assert not two_ranks[case], two_ranks[case]


@pytest.mark.parametrize("case", FOUR)
def test_four_ranks(four_ranks, case):
    assert not four_ranks[case], four_ranks[case]


@pytest.mark.slow
def test_eight_ranks_exact():
    """TP8 exactness on a CPU (no 8-GPU machine is lent): 8 gloo ranks, forms, levels, ties, padding,
    and the tree draft compiled through draft_loop."""
    results = _tp.run_world(8, EIGHT)
    failed = {case: why for case, why in results.items() if why}
    assert not failed, failed
