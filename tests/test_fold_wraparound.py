"""The seed fold's proofs and forwarding where values wrap around their dtype or a reader goes by the
storage (from a differential review): a clamp on wrapped ids is kept, a counting producer that
overflows its dtype gives no range, and a buffer read through as_strided is not forwarded."""

import warnings

import pytest
import torch

import draftfuse
from draftfuse.passes.seed_fold import fold_seed, mark_seam

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _fold(seed, loop, *args):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        draft = draftfuse.fold(seed, loop, mode=None)
        got = draft(*args)
    return got, "\n".join(str(r) for record in draft.draft.compiles for r in record.reports)


def test_ids_narrowed_then_viewed_keep_their_clamp():
    """topk ids over a 40000 vocab cast to int16 wrap past 32767: a view of them holds negative values,
    and `clamp(min=0)` on it is no no-op."""
    def seed(logits):
        return logits.softmax(-1).topk(1).indices.to(torch.int16), logits

    def loop(ids16, logits):
        col = ids16.view(-1)
        return col.clamp(min=0), col + 0

    logits = torch.zeros(2, 40000)
    logits[0, 39000], logits[1, 5] = 10.0, 10.0
    got, report = _fold(seed, loop, logits)
    want = loop(*seed(logits))
    assert all(torch.equal(g, w) for g, w in zip(got, want)), (got, want, report)


def test_a_counting_producer_past_its_dtype_gives_no_range():
    """arange(200, dtype=int8) wraps to -128 ..: its clamp is not proven away (the report says so; the
    values themselves are Inductor's to get right)."""
    def seed(x):
        return torch.arange(200, dtype=torch.int8), x

    def loop(a, x):
        return a.clamp(min=0)[-4:], x + 1

    _, report = _fold(seed, loop, torch.tensor([1, 2]))
    assert "iota in [0, 127]" not in report and "arange in [0, 127]" not in report, report


def test_a_buffer_read_through_its_storage_is_not_forwarded():
    """buf.copy_(x[1:]) then buf.as_strided(..., 0): forwarding buf to x[1:] would read x from its start."""
    def seed(x):
        buf = torch.zeros(3)
        buf.copy_(x[1:])
        return (buf,)

    def loop(buf):
        return (buf.as_strided((3,), (1,), 0) + 0,)

    reports = []

    def backend(gm, example_inputs):
        result = fold_seed(gm)
        reports.append(str(result.report))
        return result.graph_module.forward

    x = torch.arange(4.0)
    got = torch.compile(lambda x: loop(*mark_seam(seed(x))), backend=backend, fullgraph=True)(x.clone())
    assert torch.equal(got[0], loop(*seed(x))[0]) and "by its storage" in reports[0], reports
