"""Numerics of the softmax -> topk rewrite on CPU, against the unrewritten function.

Tokens: equal, except the two documented cases, each shown by its own test below: rows holding NaN or
+inf, and ties that rounding of the probabilities creates in fp16/bf16. Values: within one ulp of the
unrewritten compiled function for fp16/bf16 results, a few ulps for fp32 (where Inductor may split
the exp-sum reduction differently once the probability tensor is gone).
"""

import pytest
import torch
from torch._inductor import config as inductor_config

from draftfuse.options import Options
from draftfuse.passes.post_grad import PostGradPass
from draftfuse.passes.softmax_topk import rewrite_softmax_topk
from tests._graphs import dynamo_graph
from tests._oracle import assert_same_selection, assert_values_close, ulp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MAX_ULPS = {torch.float32: 8, torch.float16: 1, torch.bfloat16: 1}


def logits(dtype, rows=16, vocab=1000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)


# Each form returns (probabilities it selected on, values, indices, dim, keepdim).
FORMS = {
    "softmax+topk1": lambda x: (p := torch.softmax(x, -1), *p.topk(1), -1, True),
    "softmax+topk4": lambda x: (p := torch.softmax(x, -1), *p.topk(4), -1, True),
    "log_softmax+topk4": lambda x: (p := torch.log_softmax(x, -1), *p.topk(4), -1, True),
    "temperature+max": lambda x: (p := torch.softmax(x.float() / 0.7, -1), *p.max(-1), -1, False),
    "log_softmax+max": lambda x: (p := torch.log_softmax(x, -1), *p.max(-1), -1, False),
    "softmax(dtype=f32)+max": lambda x: (p := torch.softmax(x, -1, dtype=torch.float32), *p.max(-1), -1, False),
    "dim0+topk2": lambda x: (p := torch.softmax(x, 0), *p.topk(2, dim=0), 0, True),
}


def _selections_only(form):
    """The same form without returning the probabilities, so that the softmax can go away."""
    return lambda x: form(x)[1:3]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FORMS)
def test_eager_rewritten_graph_matches_unrewritten(name, dtype):
    form = FORMS[name]
    for seed in range(3):
        x = logits(dtype, seed=seed)
        probs, want_values, want_index, dim, keepdim = form(x)
        result = rewrite_softmax_topk(dynamo_graph(_selections_only(form), x))
        assert len(result.report.rewrites) == 1, str(result.report)
        got_values, got_index = result.graph_module(x)
        assert_same_selection(probs, dim, want_index, got_index, keepdim)
        same = want_index == got_index
        if "log" in name:
            # log-probs near 0 cancel: compare on the scale of the log-sum-exp they were computed from
            scale = ulp(torch.logsumexp(x.float(), dim, keepdim=True).expand_as(x).to(want_values.dtype).gather(dim, want_index if keepdim else want_index.unsqueeze(dim)))
            scale = scale if keepdim else scale.squeeze(dim)
            assert ((got_values.double() - want_values.double()).abs()[same] <= 4 * scale[same]).all()
        else:
            # eager softmax sums in another order than torch.sum: a few ulps in fp32
            assert_values_close(want_values[same], got_values[same], max_ulps=16 if want_values.dtype == torch.float32 else 1)


def _compiled(fn, x, *, with_pass: bool):
    torch._dynamo.reset()
    patches = {"fx_graph_cache": False}
    if with_pass:
        patches["post_grad_custom_pre_pass"] = pass_ = PostGradPass(Options.parse(options={"seed_fold": False, "lowering": "torch"}))
    with inductor_config.patch(patches):
        out = torch.compile(fn, fullgraph=True)(x)
    return out, (pass_.reports[-1] if with_pass else None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_with_pass_matches_compiled_without(dtype):
    names = ["softmax+topk1", "softmax+topk4", "log_softmax+topk4", "temperature+max", "softmax(dtype=f32)+max"]

    def selections(x):
        return [_selections_only(FORMS[name])(x) for name in names]

    def with_probs(x):
        return [FORMS[name](x)[:3] for name in names]

    x = logits(dtype, seed=1)
    want, _ = _compiled(with_probs, x, with_pass=False)
    got, report = _compiled(selections, x, with_pass=True)
    assert len(report.rewrites) == len(names), str(report)
    for name, (probs, want_values, want_index), (got_values, got_index) in zip(names, want, got):
        _, _, _, dim, keepdim = FORMS[name](x)
        assert_same_selection(probs, dim, want_index, got_index, keepdim)
        same = want_index == got_index
        assert_values_close(want_values[same], got_values[same], MAX_ULPS[want_values.dtype])


def _topk1(x):
    return torch.softmax(x, -1).topk(1)


def test_exact_logit_ties_pick_the_first_index():
    """Exact ties in the logits are ties in the probabilities too: the rewrite returns the first
    index (argmax's rule); torch.topk on CPU may return any of the tied indices, equally valid."""
    x = torch.randint(0, 4, (64, 50)).float()  # many exact ties
    result = rewrite_softmax_topk(dynamo_graph(_topk1, x))
    got_index = result.graph_module(x)[1]
    first_max = (x == x.amax(-1, keepdim=True)).float().argmax(-1, keepdim=True)
    assert torch.equal(got_index, first_max)
    assert_same_selection(torch.softmax(x, -1), -1, _topk1(x)[1], got_index, keepdim=True)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_documented_nan_and_inf_rows(poison):
    """A NaN or +inf logit turns the whole softmax row into NaN: topk of it returns an arbitrary index,
    while the rewrite points at the poisoned logit (argmax treats NaN as the maximum, as torch does).
    Rows without it are untouched, and -inf logits are ordinary (probability 0)."""
    x = logits(torch.float32, rows=4, vocab=100)
    x[0, 37] = poison
    x[1, 5] = float("-inf")
    result = rewrite_softmax_topk(dynamo_graph(_topk1, x))
    want_values, want_index = _topk1(x)
    got_values, got_index = result.graph_module(x)
    assert torch.isnan(want_values[0]).all() and torch.isnan(got_values[0]).all()
    assert got_index[0].item() == 37
    assert torch.equal(got_index[1:], want_index[1:])
    assert_values_close(want_values[1:], got_values[1:], max_ulps=16)


def test_documented_rounding_tie_in_bf16():
    """Two logits close enough that their bf16 probabilities round to the same value: topk of the
    probabilities returns the lower index, argmax of the logits the true maximum."""
    x = torch.full((1, 8), -30.0, dtype=torch.bfloat16)
    x[0, 2], x[0, 6] = 0.0, 2.0**-10  # distinct in bf16, but both probabilities round to 0.5
    want_values, want_index = _topk1(x)
    result = rewrite_softmax_topk(dynamo_graph(_topk1, x))
    got_values, got_index = result.graph_module(x)
    probs = torch.softmax(x, -1)
    assert probs[0, 2] == probs[0, 6]  # the tie is made by rounding
    assert want_index.item() == 2 and got_index.item() == 6
    assert torch.equal(got_values, want_values)  # same probability either way


@pytest.mark.parametrize("spelling", ["method", "function"])
def test_argmax_without_a_dim_is_over_the_flattened_probabilities(spelling):
    """`p.argmax()` has no dim: one index into the flattened tensor, no selection along the last dim."""
    def f(x):
        p = torch.softmax(x, -1)
        return p.argmax() if spelling == "method" else torch.argmax(p)

    x = torch.stack([torch.randperm(97, generator=torch.Generator().manual_seed(row)).float() * 0.37 - 10 for row in range(4)])
    result = rewrite_softmax_topk(dynamo_graph(f, x))
    assert result.report.rewrites == [] and result.report.refusals == [], str(result.report)
    torch._dynamo.reset()
    got = torch.compile(f, backend="draftfuse")(x)
    assert got.shape == () and torch.equal(got, f(x))


def test_a_flat_argmax_is_not_taken_for_a_last_dim_index():
    """The index range of `x.argmax()` is the whole tensor's: a clamp to the last dim's size is real
    (the setup merge must not prove it away)."""
    def f(x):
        return (x.argmax().clamp(max=49),)

    x = torch.zeros(4, 50)
    x[3, 7] = 5.0  # the maximum in the last row: flat index 157
    torch._dynamo.reset()
    assert torch.compile(f, backend="draftfuse")(x)[0].item() == 49


@pytest.mark.parametrize("upcast", ["bf16 softmax, float()", "half(), float()"])
def test_probabilities_rounded_to_half_then_upcast_are_named_and_kept(upcast):
    """Probabilities rounded to fp16/bf16 and read after an upcast tie by rounding as half ones do: the
    report names them, and half_probs="keep" leaves them as written."""
    if upcast == "bf16 softmax, float()":
        x, f = torch.randn(4, 64).to(torch.bfloat16), lambda x: torch.softmax(x, -1).float().topk(1)
    else:
        x, f = torch.randn(4, 64), lambda x: torch.softmax(x, -1).half().float().topk(1)
    rewritten = rewrite_softmax_topk(dynamo_graph(f, x)).report
    assert len(rewritten.rewrites) == 1 and "probabilities: a rounding tie picks the larger logit" in rewritten.rewrites[0].detail
    kept = rewrite_softmax_topk(dynamo_graph(f, x), half_probs="keep").report
    assert kept.rewrites == [] and "half_probs=\"keep\"" in kept.refusals[0].reason
