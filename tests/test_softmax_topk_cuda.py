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


@pytest.mark.cuda
def test_a_draft_with_grad_enabled_selects_with_torch_ops_and_keeps_gradients():
    """Logits that require grad (a head's parameters, no no_grad): the kernels have no backward, so the
    rewrite selects with torch's ops there, and the compile neither fails nor changes the gradient."""
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 32000, device="cuda")
    hidden = torch.randn(4, 64, device="cuda")

    def draft(hidden):
        return torch.softmax(head(hidden).float(), dim=-1).topk(4, dim=-1)

    torch._dynamo.reset()
    (values, index), codes = run_and_get_code(torch.compile(draft, backend="draftfuse", fullgraph=True), hidden)
    assert codes and not any("draftfuse.topk_prob" in code for code in codes)
    want_values, want_index = draft(hidden)
    assert torch.equal(index, want_index)
    values.sum().backward()
    got = head.weight.grad.clone()
    head.zero_grad()
    want_values.sum().backward()
    torch.testing.assert_close(got, head.weight.grad, rtol=1e-4, atol=1e-6)


def _selects_with_the_kernels_as_eager(sample, k):
    """sample(bf16 logits [16, 32000], temperatures of both signs) through backend="draftfuse": the code
    calls the selection kernels, the tokens are eager's (the temperatures change them), the values close."""
    torch.manual_seed(0)
    logits = torch.randn(16, 32000, device="cuda", dtype=torch.bfloat16) * 4
    temperature = torch.tensor([0.5, -1.5, 2.0, 0.7] * 4, device="cuda")
    torch._dynamo.reset()
    (values, index), (code,) = run_and_get_code(torch.compile(sample, backend="draftfuse", fullgraph=True), logits, temperature)
    assert "draftfuse.topk_prob" in code or "draftfuse.argmax_prob" in code
    want_values, want_index = sample(logits, temperature)
    assert not torch.equal(want_index, logits.float().topk(k, dim=-1).indices), "the temperatures must change tokens"
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    assert_same_selection(probs, 1, want_index, index, keepdim=True)
    torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-7)


@pytest.mark.cuda
@pytest.mark.parametrize("k", [1, 4])
def test_an_in_place_temperature_selects_with_the_kernels_from_the_divided_copy(k):
    """vLLM's sampler divides a float32 copy of the logits in place by per-request temperatures of any
    sign; the selection reads that copy (the kernels on it), with eager's tokens."""

    def sample(logits, temperature):
        x = logits.to(torch.float32)
        x.div_(temperature.unsqueeze(dim=1))
        return x.softmax(dim=-1, dtype=torch.float32).topk(k, dim=-1)

    _selects_with_the_kernels_as_eager(sample, k)


@pytest.mark.cuda
@pytest.mark.parametrize("k", [1, 4])
def test_a_hand_written_softmax_of_a_temperature_tensor_selects_with_the_kernels(k):
    """Dynamo sees no softmax in a hand-written stable softmax of x / t; Inductor gives it its signed
    temperature form, which the post-grad pass lowers to the kernels with the scale 1 / t."""

    def sample(logits, temperature):
        z = logits.float() / temperature[:, None]
        e = (z - z.amax(-1, keepdim=True)).exp()
        return (e / e.sum(-1, keepdim=True)).topk(k, dim=-1)

    _selects_with_the_kernels_as_eager(sample, k)
