"""On a GPU: the backend lowers softmax -> topk to draftfuse's selection kernels, visibly in the generated
code, with the same tokens as the unrewritten function compiled by Inductor."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import draftfuse.runtime.backend  # noqa: F401  (registers backend="draftfuse")
from tests._oracle import assert_same_selection


def _draft_picks(logits):
    probs = torch.softmax(logits.float(), dim=-1)
    greedy_p, greedy = probs.max(-1)
    tree_p, tree = probs.topk(4, dim=-1)
    return greedy_p, greedy, tree_p, tree


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_backend_lowers_to_selection_kernels_on_cuda(dtype):
    logits = torch.randn(8, 128256, device="cuda", dtype=dtype) * 4
    torch._dynamo.reset()
    got, (code,) = run_and_get_code(torch.compile(_draft_picks, backend="draftfuse", fullgraph=True), logits)
    assert "draftfuse.argmax_prob" in code and "draftfuse.topk_prob" in code
    assert "aten.topk" not in code
    torch._dynamo.reset()
    want = torch.compile(_draft_picks, fullgraph=True)(logits)
    # bf16 logits tie exactly often in 128256 entries: the kernels take the lower index of a tie, torch's
    # topk any of them; the oracle accepts a different index only where the probabilities tie
    probs = torch.softmax(logits.float(), dim=-1)
    assert_same_selection(probs, 1, want[1], got[1], keepdim=False)
    assert_same_selection(probs, 1, want[3], got[3], keepdim=True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2].sort(-1).values, want[2].sort(-1).values, rtol=1e-5, atol=1e-7)
