"""The effects model (draftfuse.graph.effects) and what the writes it finds do to the softmax -> topk rewrite.

Public samplers write the probabilities between the softmax and the selection (Gumbel division in
place, bans, reweighting) and penalties write the logits (`x += penalty`): the rewrite must see each
such write, through any view: one to the probabilities refuses the rewrite, one to the logits makes the
selection read the values the softmax reads, not the logits before them. Each case runs the
rewritten graph against eager on the same inputs: selected tokens equal, inputs' final contents equal.
"""

from __future__ import annotations

import pytest
import torch

from draftfuse.graph.effects import Effects, is_random, written_values
from draftfuse.passes.softmax_topk import rewrite_softmax_topk
from tests._graphs import dynamo_graph

torch.manual_seed(0)
X = torch.randn(4, 16) * 3
Q = torch.rand(4, 16) + 0.5  # exponential draws, pre-drawn so eager and compiled can be compared
BANNED = torch.tensor([0, 3, 7])


def run_both(fn, *args):
    """The pass's report, after checking the rewritten graph computes what eager computes."""
    gm = dynamo_graph(fn, *[a.clone() for a in args])
    result = rewrite_softmax_topk(gm)
    eager_args = [a.clone() for a in args]
    graph_args = [a.clone() for a in args]
    want = fn(*eager_args)
    got = result.graph_module(*graph_args)
    for w, g in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)):
        if w.dtype.is_floating_point:
            torch.testing.assert_close(g, w)
        else:
            assert torch.equal(g, w), (g, w)
    for w, g in zip(eager_args, graph_args):
        assert torch.equal(w, g), "an input's final contents differ"
    return result.report


# ---- writes to the probabilities: refused (each picked a wrong token before wave 2) ----


def gumbel_div_in_place(x, q):
    probs = torch.softmax(x, -1)
    return probs.div_(q).argmax(-1)


def ban_by_setitem(x, banned):
    probs = x.softmax(-1)
    probs[:, banned] = 0
    return probs.topk(2, -1)


def masked_fill_in_place(x, q):
    probs = torch.softmax(x, -1)
    probs.masked_fill_(q > 1.2, 0.0)
    return probs.max(-1)


def reweight_mul_in_place(x, q):
    probs = torch.softmax(x, -1)
    probs.mul_(q)
    return probs.topk(1, dim=-1)


def reweight_imul(x, q):
    probs = torch.softmax(x, -1)
    probs *= q
    return torch.argmax(probs, dim=-1)


def write_through_transpose(x, q):
    probs = torch.softmax(x, -1)
    probs.t().mul_(q.t())
    return probs.argmax(-1)


def write_through_cast_alias(x, q):
    probs = torch.softmax(x, -1).float()  # float() of float32 is the same tensor
    probs.div_(q)
    return probs.argmax(-1)


@pytest.mark.parametrize(
    "fn, second",
    [
        (gumbel_div_in_place, Q), (ban_by_setitem, BANNED), (masked_fill_in_place, Q), (reweight_mul_in_place, Q),
        (reweight_imul, Q), (write_through_transpose, Q), (write_through_cast_alias, Q),
    ],
)  # fmt: skip
def test_a_write_to_the_probabilities_refuses_the_rewrite(fn, second):
    report = run_both(fn, X, second)
    assert report.rewrites == [], str(report)
    (refusal,) = report.refusals
    assert "probabilities are written in place" in refusal.reason
    assert "test_effects.py:" in refusal.where


def sort_into_probs(x, q):
    probs, index = torch.softmax(x, -1), torch.empty(4, 16, dtype=torch.long)
    torch.sort(probs.clone() * q, -1, descending=True, out=(probs, index))  # out= of two outputs
    return probs.topk(2, -1)


def frexp_into_probs(x, q):
    probs = torch.softmax(x, -1)
    torch.frexp(probs * q, out=(probs, torch.empty(4, 16, dtype=torch.int32)))
    return probs.argmax(-1)


@pytest.mark.parametrize("fn", [sort_into_probs, frexp_into_probs])
def test_a_write_through_an_out_tuple_is_seen(fn):
    """`out=(values, indices)`: the schema names the written arguments apart (values, indices; mantissa,
    exponent), which the lookup by name missed, so the write went unseen: other tokens ([[13, 14], ...]
    where eager picks [[0, 1], ...] after the sort)."""
    report = run_both(fn, X, Q)
    assert report.rewrites == [], str(report)
    assert "probabilities are written in place" in report.refusals[0].reason


def test_a_write_to_a_clone_of_the_probabilities_does_not_block_it():
    def f(x, q):
        probs = torch.softmax(x, -1)
        noisy = probs.clone()
        noisy.div_(q)
        return probs.argmax(-1), noisy

    report = run_both(f, X, Q)
    assert len(report.rewrites) == 1 and report.refusals == []


# ---- writes to the logits ----


def _reads_as_written(report, write: str) -> None:
    """One rewrite, which says it selects from the value the softmax reads because of `write`."""
    assert len(report.rewrites) == 1 and report.refusals == [], str(report)
    assert "as the softmax reads it" in report.rewrites[0].detail and write in report.rewrites[0].detail, str(report)


def test_a_penalty_added_in_place_after_the_temperature_read_selects_from_the_scaled_values():
    # Dynamo records `x += penalty` as operator.iadd: a write like any other. It was refused; the
    # selection now reads `scaled` (what the softmax reads), not x, which the write changed
    def f(x, q):
        scaled = x / 0.7
        x += q
        return torch.softmax(scaled, -1).argmax(-1)

    assert not torch.equal((X + Q).argmax(-1), X.argmax(-1)), "reading x as written must pick other tokens"
    _reads_as_written(run_both(f, X, Q), "iadd")


def test_an_in_place_temperature_is_rewritten_from_the_divided_copy():
    """vLLM's sampler: a float32 copy of the logits divided in place. The selection must not read the
    logits (the softmax reads them divided, and t's signs differ): it reads the divided copy. It was
    refused before; the out-of-place spelling keeps the temperature operand on the bf16 logits."""

    def in_place(x, t):
        x = x.to(torch.float32)
        x.div_(t.unsqueeze(dim=1))
        return x.softmax(dim=-1, dtype=torch.float32).max(dim=-1)

    def out_of_place(x, t):
        x = x.to(torch.float32)
        x = x / t.unsqueeze(dim=1)
        return x.softmax(dim=-1, dtype=torch.float32).max(dim=-1)

    t = torch.tensor([0.5, 1.5, -2.0, 0.7])
    assert not torch.equal((X.bfloat16().float() / t[:, None]).argmax(-1), X.bfloat16().argmax(-1))
    _reads_as_written(run_both(in_place, X.bfloat16(), t), "div_")
    report = run_both(out_of_place, X.bfloat16(), t)
    assert len(report.rewrites) == 1 and "temperature tensor" in report.rewrites[0].detail, str(report)


def test_a_temperature_tensor_written_after_its_read_leaves_the_scaled_logits_to_the_selection():
    # the softmax reads x / t as t was; the selection must not follow the sign of t as written (it was
    # refused, untested): it reads the scaled values
    def f(t, x):  # (Dynamo's inputs come in the order of first use)
        scaled = x / t[:, None]
        t.mul_(-1)
        return torch.softmax(scaled, -1).argmax(-1)

    t = torch.tensor([0.5, 1.5, 2.0, 0.7])
    assert not torch.equal((X / t[:, None]).argmax(-1), (-X).argmax(-1)), "following t as written must pick other tokens"
    _reads_as_written(run_both(f, t, X), "mul_")


def test_a_mask_written_in_place_on_a_float_copy_is_selected_from():
    # a ban written on the float32 copy (masked_fill_), then the softmax: the selection reads the copy
    def f(x, banned):
        x = x.float()
        x[:, banned] = float("-inf")
        return torch.softmax(x, -1).topk(2, -1)

    assert not torch.equal(X.topk(2, -1).indices, X.index_fill(1, BANNED, float("-inf")).topk(2, -1).indices)
    _reads_as_written(run_both(f, X.bfloat16(), BANNED), "setitem")


@pytest.mark.parametrize("spelling", ["elu", "hardtanh", "silu"])
def test_an_inplace_flag_passed_by_position_is_a_write(spelling):
    # Dynamo keeps F.elu(p, 1.0, True) as one call, which resolves by name to aten.elu (no write): the
    # flag by position was missed, and the selection read the probabilities before the write
    write = {
        "elu": lambda p: torch.nn.functional.elu(p, -1.0, True),
        "hardtanh": lambda p: torch.nn.functional.hardtanh(p, 0.0, 0.05, True),
        "silu": lambda p: torch.nn.functional.silu(p, True),
    }[spelling]

    def f(x):
        probs = torch.log_softmax(x, -1)
        write(probs)
        return probs.max(-1)

    report = run_both(f, X)
    assert report.rewrites == [] and report.refusals, str(report)


def test_an_inplace_flag_by_position_on_the_logits_before_the_softmax_reads_is_a_write():
    def f(t, x):  # (Dynamo's inputs come in the order of first use: t's slice, then x)
        scaled = x / t[:, :1]
        torch.nn.functional.relu(x, True)
        return torch.softmax(scaled, -1).argmax(-1)

    _reads_as_written(run_both(f, Q, X), "relu")


def test_a_write_to_the_logits_after_the_softmax_does_not_matter():
    # the rewrite selects where the softmax read the logits, before the write
    def f(x, q):
        probs = torch.softmax(x, -1)
        x.mul_(q)
        return probs.topk(2, -1), x

    report = run_both(f, X, Q)
    assert len(report.rewrites) == 1, str(report)


def test_a_topk_over_another_dim_of_logits_written_later_is_exact_through_inductor():
    # found by the fuzzer on torch 2.11: Inductor computed topk(x, 3, 0) from x as written by two later
    # in-place writes; the rewrite is refused there (2.13 compiles it right, and rewrites)
    def f(x, v):
        probs = torch.softmax((x * 2.0).double(), 0)
        x[..., 2] = v
        x.unsqueeze(0)[0].neg_()
        return (torch.topk(probs, 3, 0).indices,)

    x, v = torch.randn(3, 2, 26), torch.randn(3, 2)
    torch._dynamo.reset()
    got = torch.compile(f, backend="draftfuse", fullgraph=True)(x.clone(), v)[0]
    assert torch.equal(got, f(x.clone(), v)[0])
    report = rewrite_softmax_topk(dynamo_graph(f, x.clone(), v)).report
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 13):
        assert not report.rewrites and "other than the last from the logits as written later" in report.refusals[0].reason
    else:
        assert len(report.rewrites) == 1, str(report)


def test_logits_written_through_an_out_argument_are_a_write():
    def f(x, q):
        scaled = x * 2.0
        torch.add(x, q, out=x)
        return torch.softmax(scaled, -1).argmax(-1)

    _reads_as_written(run_both(f, X, Q), "add")


# ---- the model itself ----


def _graph(fn, *args):
    return dynamo_graph(fn, *args).graph


def test_views_share_memory_and_writes_through_them_are_seen():
    def f(pool, layer, x):
        y = torch.einsum("ij->ji", x)  # einsum returns a view here
        y.add_(1)
        layer.mul_(2)
        o = torch.empty_like(x)
        torch.add(x, 1, out=o)
        torch._foreach_add_([x], 1)
        return pool.sum(), o

    pool = torch.zeros(4, 4)
    graph = _graph(f, pool, pool[1], torch.randn(3, 3))
    effects = Effects(graph)
    nodes = {n.name: n for n in graph.nodes}
    placeholders = {str(n.target): n for n in graph.find_nodes(op="placeholder")}
    pool_node, layer_node, x_node = placeholders["L_pool_"], placeholders["L_layer_"], placeholders["L_x_"]
    assert effects.may_share(pool_node, layer_node), "a pool and a view of it passed together share memory"
    assert effects.may_share(nodes["y"], x_node), "einsum's view"
    written = effects.written_inputs()
    assert set(written) == {pool_node, layer_node, x_node}
    assert written[x_node].name == "add_"  # the first write of x is through the einsum view
    assert effects.writers([nodes["o"]], nodes["o"]), "the out= call writes o"
    foreach = next(n for n in graph.nodes if n.target is torch._foreach_add_)
    assert x_node in written_values(foreach)


def test_a_sort_writes_nothing_but_its_out_tuple():
    """aten.sort has TorchScript list overloads that write their list (sort.Tensor(Tensor(a!)[] self),
    sort.int(int[](a!) self)); counting them made every `torch.sort(x)` and `x.sort()` a write of x: the
    softmax rewrite refused, and draft_loop took sorted logits for a written input (CudagraphSkipError
    on the next call's new logits). Top-p filters sort the logits so (HF TopPLogitsWarper, vLLM's
    apply_top_k_top_p)."""

    def f(x, v, i):
        a = torch.sort(x, descending=False)
        b = x.sort(dim=-1, descending=True, stable=True)
        c = torch.sort(x, -1, out=(v, i))
        return a[0], b[1], c[0]

    x, v, i = torch.randn(4, 8), torch.empty(4, 8), torch.empty(4, 8, dtype=torch.long)
    graph = _graph(f, x, v, i)
    placeholders = {str(n.target): n for n in graph.find_nodes(op="placeholder")}
    sorts = [n for n in graph.nodes if n.target in (torch.sort, "sort")]
    assert len(sorts) == 3, graph
    assert written_values(sorts[0]) == [] and written_values(sorts[1]) == []
    assert set(written_values(sorts[2])) == {placeholders["L_v_"], placeholders["L_i_"]}
    assert set(Effects(graph).written_inputs()) == {placeholders["L_v_"], placeholders["L_i_"]}


def test_in_place_operators_and_unknown_calls():
    graph = _graph(lambda x: x.add(1), torch.randn(2))
    node = next(n for n in graph.nodes if n.op == "call_method")
    assert written_values(node) == [] and not is_random(node)

    def user_function(t):  # not torch's: its effects are unknown
        return t

    fake_node = torch.fx.Graph().call_function(user_function, (node,))
    assert written_values(fake_node) is None and is_random(fake_node)


def _two_groups_in_one_buffer(a, b):
    buf = a.new_full((a.shape[0], 16), float("-inf"))
    buf[:, :8] = a
    first = buf.softmax(-1).topk(1, dim=-1)
    buf.fill_(float("-inf"))
    buf[:, 8:] = b  # the write the second softmax reads
    return first, buf.softmax(-1).topk(1, dim=-1)


def test_a_report_names_the_write_the_softmax_reads():
    """A logits buffer reused for a second request group (vLLM's EAGLE-3 scatters into a -inf buffer): the
    second rewrite's report named the buffer's first write, which the second softmax does not read."""
    report = run_both(_two_groups_in_one_buffer, torch.randn(3, 8), torch.randn(3, 8))
    first, second = report.rewrites
    assert "setitem " in first.detail and "setitem_1 " in second.detail, report


def test_operators_recorded_as_dunder_methods():
    """torch 2.11's Dynamo records `positions == 0` as positions.__eq__(0) (DeepSeek MTP's masked embedding,
    `inputs_embeds[positions == 0] = 0`): unknown, it made `positions` a written input, and a draft called
    with a new positions tensor each step raised CudagraphSkipError. A dunder writes what its `operator`
    function writes: the in-place ones their first argument, the others nothing."""
    graph = torch.fx.Graph()
    positions, embeds = graph.placeholder("positions"), graph.placeholder("embeds")
    mask = graph.call_method("__eq__", (positions, 0))
    shifted = graph.call_method("__radd__", (positions, 1))
    put = graph.call_method("__setitem__", (embeds, mask, 0.0))
    bumped = graph.call_method("__iadd__", (positions, 1))
    graph.output((shifted, put, bumped))
    assert written_values(mask) == [] and written_values(shifted) == [] and not is_random(mask)
    assert written_values(put) == [embeds] and written_values(bumped) == [positions]
    unknown = graph.call_method("__call__", (positions,))  # a dunder that is no operator: still unknown
    assert written_values(unknown) is None


@pytest.mark.parametrize("op", [torch.binomial, torch.poisson, torch.bernoulli])
def test_randomness_comes_from_the_op_tag(op):
    def f(x):
        return op(x) if op is not torch.binomial else op(x, x)

    graph = _graph(f, torch.rand(3))
    node = next(n for n in graph.nodes if n.target is op)
    assert is_random(node)


# ---- dtypes the selection cannot read: the logits are peeled back no further ----
_CLOSE = torch.tensor([[2.00, 2.04, -3.0, -3.0]])  # probabilities 0.49 / 0.51: one value in float8


def fp8_logits_upcast(x):
    return torch.softmax(x.to(torch.float8_e4m3fn).float() / 0.7, -1).topk(2, -1)


def bool_mask_scaled(x):
    return torch.softmax((x > 0) * 2.0, -1).topk(2, -1)


def uint16_scaled(x):
    return torch.softmax(x.abs().to(torch.uint16) * 2.0, -1).argmax(-1)


def fp8_probabilities(x):
    return torch.softmax(x, -1).to(torch.float8_e4m3fn).float().argmax(-1)


@pytest.mark.parametrize("fn", [fp8_logits_upcast, bool_mask_scaled, uint16_scaled])
def test_logits_of_a_dtype_topk_cannot_read_are_not_peeled_to(fn):
    """float8 -> float32 is exact and x * 2.0 a positive scale, so the logits were peeled back to the
    float8, bool or uint16 tensor, which topk and argmax have no kernel for: valid drafts failed to
    compile. The selection now reads the first tensor of a dtype they take; tokens are eager's."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)) * 4
    report = run_both(fn, x)
    assert len(report.rewrites) == 1, str(report)


def test_probabilities_rounded_to_float8_are_not_rewritten():
    """Two probabilities 0.02 apart are one float8 value: the original picks the lower index, the
    rewrite picked the larger logit, with half_probs="keep" too and no note (fp16/bf16 rounding is the
    documented case; float8 is refused)."""
    report = run_both(fp8_probabilities, _CLOSE)
    assert report.rewrites == [] and "float8" in report.refusals[0].reason


def _reads_through_numpy(logits, n):
    bias = torch.from_numpy(n.numpy() * 2)  # Dynamo records the * as an operator on NumPy arrays
    return torch.softmax(logits + bias[:, None], -1).topk(2, -1).indices


def _writes_through_numpy(logits, n):
    a = n.numpy()
    a += 1  # writes n: the array shares its memory
    return torch.softmax(logits + n[:, None], -1).topk(2, -1).indices


def test_operators_on_numpy_arrays_write_what_their_operator_writes():
    """A draft reading an input through `.numpy()` (helper-62's repro): Dynamo records `a * 2` on the array as
    a wrapped `operator.mul`, which resolves to no ATen op, so it was unknown and `n` a written input: the
    second call with a new tensor raised CudagraphSkipError. The wrapped in-place operators write their first
    argument (a view of `n`), the others nothing."""
    from draftfuse import CudagraphSkipError, draft_loop

    logits = torch.randn(4, 16)
    reads, writes = draft_loop(_reads_through_numpy), draft_loop(_writes_through_numpy)
    for step in range(3):
        n = torch.arange(4.0) * step
        assert torch.equal(reads(logits, n), _reads_through_numpy(logits, n))
    n, m = torch.arange(4.0), torch.arange(4.0)
    assert torch.equal(writes(logits, n), _writes_through_numpy(logits, m)) and torch.equal(n, m)
    with pytest.raises(CudagraphSkipError, match="input 'n' is written in place"):
        writes(logits, torch.arange(4.0) * 2)
    wrapped = [n for n in dynamo_graph(_reads_through_numpy, logits, n).graph.nodes if type(n.target).__name__ == "numpy_operator_wrapper"]
    assert len(wrapped) == 1 and written_values(wrapped[0]) == [] and not is_random(wrapped[0])
