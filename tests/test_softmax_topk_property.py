"""Property test: over generated selection graphs, the rewritten graph computes what the original does.

Generated: shape and rank, dim (negative or positive), k, largest, keepdim, dtype, an upcast before the
softmax, a positive temperature (multiplied or divided), log_softmax, a cast after the softmax, and an
extra user of the softmax. Smallest-probability selections must be refused. The oracle is the original graph run eagerly: indices pick the same
probabilities (equal, or tied there: the documented rounding case), values agree to a few ulps.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from draftfuse.passes.softmax_topk import rewrite_softmax_topk
from tests._graphs import dynamo_graph
from tests._oracle import assert_same_selection, ulp


@st.composite
def selection_graphs(draw):
    rank = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 7), min_size=rank, max_size=rank))
    dim = draw(st.integers(-rank, rank - 1))
    kind = draw(st.sampled_from(["topk", "max", "min", "argmax", "argmin"]))
    return dict(
        shape=shape, dim=dim, kind=kind,
        k=draw(st.integers(1, shape[dim])) if kind == "topk" else 1,
        largest=draw(st.booleans()), keepdim=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        upcast=draw(st.booleans()), temperature=draw(st.sampled_from([None, ("div", 0.7), ("mul", 2.0), ("div", 1.5)])),
        log=draw(st.booleans()), cast_after=draw(st.sampled_from([None, torch.float32])),
        extra_user=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def build(case):
    dim = case["dim"]

    def draft_selection(x):
        s = x.float() if case["upcast"] else x
        if case["temperature"] is not None:
            op, t = case["temperature"]
            s = s / t if op == "div" else t * s
        p = torch.log_softmax(s, dim) if case["log"] else torch.softmax(s, dim)
        q = p.to(case["cast_after"]) if case["cast_after"] is not None else p
        kind = case["kind"]
        if kind == "topk":
            values, index = torch.topk(q, case["k"], dim=dim, largest=case["largest"])
        elif kind in ("max", "min"):
            values, index = getattr(q, kind)(dim, keepdim=case["keepdim"])
        else:  # indices only: a zero-size stand-in keeps the outputs' layout fixed
            values, index = q.new_empty(0), getattr(torch, kind)(q, dim=dim, keepdim=case["keepdim"])
        extra = (p * 2,) if case["extra_user"] else ()
        return (q, values, index, *extra)

    return draft_selection


@given(selection_graphs())
def test_rewritten_graph_computes_what_the_original_computes(case):
    x = (torch.randn(case["shape"], generator=torch.Generator().manual_seed(case["seed"])) * 3).to(case["dtype"])
    fn = build(case)
    probs, want_values, want_index, *extra = fn(x)
    result = rewrite_softmax_topk(dynamo_graph(lambda x: fn(x)[1:], x))
    if case["kind"] in ("min", "argmin") or (case["kind"] == "topk" and not case["largest"]):
        # smallest-probability selections are refused: probabilities that underflow to 0 tie there
        assert not result.report.rewrites and "smallest" in result.report.refusals[0].reason, str(result.report)
        return
    assert len(result.report.rewrites) == 1 and not result.report.refusals, str(result.report)
    got_values, got_index, *got_extra = result.graph_module(x)
    dim = case["dim"] % len(case["shape"])
    keepdim = case["kind"] == "topk" or case["keepdim"]
    assert_same_selection(probs, dim, want_index, got_index, keepdim)
    for want, got in zip(extra, got_extra):  # the softmax's other user still works
        assert torch.equal(want, got)
    if case["kind"] in ("argmax", "argmin"):
        return
    assert got_values.dtype == want_values.dtype and got_values.shape == want_values.shape
    same = want_index == got_index
    error = (got_values.double() - want_values.double()).abs()[same]
    # eager softmax sums in another order than torch.sum, and log-probs near 0 cancel against the
    # log-sum-exp they were computed from: allow a few ulps of the larger of |value| and that sum
    lse = torch.logsumexp(x.double() * (1 if case["temperature"] is None else 3), dim).abs().max().clamp_min(1).item()
    softmax_dtype = torch.float32 if case["upcast"] else case["dtype"]  # values were rounded to it
    scale = ulp(want_values.to(softmax_dtype))[same] if not case["log"] else ulp(torch.tensor(lse, dtype=softmax_dtype)).item()
    assert (error <= 16 * scale).all(), (error.max(), scale)
