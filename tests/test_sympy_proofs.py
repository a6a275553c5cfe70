"""Setup merging's proofs (draftfuse.passes.prove, run on the post-grad graph): setup the two sides
compute differently is merged only when sympy proves it equal for every value the ranges allow;
unequal or unprovable setup is kept, and the report says why.

First `prove_equal` on expressions, then the same questions asked through graphs (the whole pipeline
without code generation, draftfuse.testing.draft_graphs): ranges the caller declares, ranges producers
imply (arange, topk indices), ranges the ShapeEnv knows (symbolic sizes), and wrap-around of narrow
integer dtypes.
"""

import re

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._sympy.functions import FloorDiv, Max, Min, PythonMod
from torch.utils._sympy.value_ranges import ValueRanges

from draftfuse.passes.prove import prove_equal
from draftfuse.runtime.draft_loop import draft_loop
from draftfuse.testing import draft_graphs
from tests.test_seed_fold import composed

s, t = sympy.symbols("s t", integer=True)
INT64 = ValueRanges(-(2**63), 2**63 - 1)


@pytest.mark.parametrize(
    "a, b, ranges, expected",
    [
        # clamp(seq_lens - 1, min=0) against seq_lens - 1
        (Max(s - 1, 0), s - 1, {s: ValueRanges(1, 2**63 - 1)}, True),
        (Max(s - 1, 0), s - 1, {s: INT64}, None),  # seq_lens could be 0 or negative
        (Max(s - 1, 0), s - 1, {s: ValueRanges(-5, -1)}, None),  # always clamped: differs by 1 - s, not a constant
        (s - 1, s - 2, {s: INT64}, False),
        (Max(s, t), Max(t, s), {s: INT64, t: INT64}, True),
        (Min(s, 10), s, {s: ValueRanges(0, 10)}, True),
        (Min(s, 10), s, {s: ValueRanges(0, 100)}, None),
        (PythonMod(s, 8), s, {s: ValueRanges(0, 7)}, True),
        (PythonMod(s, 8), s, {s: ValueRanges(0, 8)}, None),
        (FloorDiv(s, 4), sympy.Integer(0), {s: ValueRanges(0, 3)}, True),
        (Max(Min(s, 7), 0), s, {s: ValueRanges(0, 7)}, True),  # nested clamps
    ],
)
def test_prove_equal(a, b, ranges, expected):
    equal, diff = prove_equal(a, b, ranges)
    assert equal is expected
    assert (diff == 0) is (expected is True)


def test_differing_expressions_report_their_difference():
    equal, diff = prove_equal(s + 1, s - 1, {s: INT64})
    assert equal is False and diff == 2


SEQ_LENS = torch.tensor([3, 6], dtype=torch.int32)


def seed(seq_lens):
    return seq_lens - 1, seq_lens


def clamping_loop(position, seq_lens):
    return position * (seq_lens - 1).clamp(min=0)


def widening_seed(seq_lens):
    return (seq_lens - 1).long(), seq_lens


def widening_loop(position, seq_lens):
    return position * (seq_lens.long() - 1)


def fold(seed, loop, kwargs, **facts):
    """The setup-merging report of seed + loop composed as fold() composes them, after checking the
    merged graph computes what the composition computes."""
    graphs = draft_graphs(composed(seed, loop, **facts), **kwargs)
    expected = loop(*seed(**kwargs))
    torch.testing.assert_close(list(torch.utils._pytree.tree_leaves(graphs.outputs)), torch.utils._pytree.tree_leaves(expected), rtol=0, atol=0)
    (report,) = [r for r in graphs.reports if r.pass_name == "merge_setup"]
    report.notes += [n for r in graphs.reports if r.pass_name == "seed_fold" for n in r.notes]
    assert not any("internal error" in note for r in graphs.reports for note in r.notes), graphs.report
    return report


def proven(report):
    return [r.detail for r in report.rewrites if r.rule == "setup merged (proven equal)"]


def test_declared_range_proves_the_clamp_away():
    report = fold(seed, clamping_loop, dict(seq_lens=SEQ_LENS), value_ranges={"seq_lens": (1, None)})
    assert proven(report) == ["Max(0, seq_lens - 1) == seq_lens - 1 given seq_lens in [1, 2147483647]"]
    assert report.refusals == []


def test_without_the_range_the_clamp_stays_and_the_report_says_what_would_prove_it():
    report = fold(seed, clamping_loop, dict(seq_lens=SEQ_LENS))
    assert proven(report) == []
    (refusal,) = report.refusals
    assert refusal.reason == (
        "kept Max(0, seq_lens - 1) beside seq_lens - 1 (from `return seq_lens - 1, seq_lens`): not proven, its "
        "operand may wrap around given seq_lens in [-2147483648, 2147483647]; value_ranges={'seq_lens': (low, high)} "
        "lets the proof use what the caller knows"
    )


def test_a_range_for_no_input_is_reported_unused():
    report = fold(seed, clamping_loop, dict(seq_lens=SEQ_LENS), value_ranges={"seq_len": (1, None)})
    (note,) = [n for n in report.notes if n.startswith("value_ranges: no graph input is named 'seq_len'; its range is unused")]
    assert note.endswith("(integer inputs: seq_lens)"), note
    assert proven(report) == []


def test_narrow_dtypes_wrap_so_widening_needs_a_range():
    # int32 seq_lens - 1 wraps at the minimum; seq_lens.long() - 1 does not: equal only without wrap.
    kept = fold(widening_seed, widening_loop, dict(seq_lens=SEQ_LENS))
    assert proven(kept) == []
    merged = fold(widening_seed, widening_loop, dict(seq_lens=SEQ_LENS), value_ranges={"seq_lens": (1, None)})
    assert proven(merged) == ["seq_lens - 1 == seq_lens - 1 given seq_lens in [1, 2147483647]"]


def test_producer_ranges_need_no_declaration():
    def seed(logits):
        index = logits.topk(1).indices
        return index, torch.arange(6), logits

    def loop(index, slots, logits):
        # a topk index is already within [0, vocab - 1]; arange(6) already within [0, 5]
        return index.clamp(max=logits.shape[-1] - 1) + (slots % 6).sum(), index + slots.sum()

    report = fold(seed, loop, dict(logits=torch.randn(2, 8)))
    details = sorted(proven(report))
    assert len(details) == 2, details
    assert re.fullmatch(r"Min\(7, (getitem\w*)\) == \1 given \1 in \[0, 7\]", details[0]), details
    assert re.fullmatch(r"PythonMod\((iota\w*), 6\) == \1 given \1 in \[0, 5\]", details[1]), details


def _compiled_equals_eager(draft, *args):
    torch._dynamo.reset()
    want = draft(*args)
    got = torch.compile(draft, backend="draftfuse", fullgraph=True)(*args)
    torch._dynamo.reset()
    assert [t.tolist() for t in got] == [t.tolist() for t in want]


def test_operands_converted_to_a_narrower_result_dtype_decide_nothing():
    """torch converts every operand to the result's dtype: a 0-d int64 limit of 2**32 - 1 is -1 to an int32
    tensor, a divisor of 2**32 + 3 is 3, and 300 is 44 to a uint8 tensor, a clamp bound of -1 is 255. The proofs
    used the unconverted values and merged minimum(x, limit) into x, slot % (2**32 + 3) into slot, b % 300 and
    b.clamp(min=-1) into b."""

    def draft(x, b):
        slot = torch.arange(4, dtype=torch.int32)
        limited = torch.minimum(x, torch.full((), 2**32 - 1, dtype=torch.int64))
        # a negative Python bound is converted too (no error for an unsigned dtype): uint8 clamp(min=-1) is 255
        floor = b.clamp(min=-1).long() + b
        return limited * 2, slot % (2**32 + 3) + x, b % 300 + 1, torch.div(b, 300, rounding_mode="floor") + 1, floor

    _compiled_equals_eager(draft, torch.tensor([3, 5, 7, 9], dtype=torch.int32), torch.tensor([50, 200], dtype=torch.uint8))


def test_an_empty_arange_compiles():
    """arange(0) (a draft with no extra slots configured): its range [0, -1] raised ValueRangeError in
    every compile of the graph."""

    def draft(pos):
        return pos + 1, torch.arange(0) + pos.max()

    _compiled_equals_eager(draft, torch.tensor([1, 2]))


def test_an_arange_of_a_data_dependent_length_compiles():
    """The empty-arange check read numel() == 0 of an unbacked size: a data-dependent guard error."""

    def draft(pos, n):
        m = n.item()
        torch._check(m >= 0)
        torch._check(m < 100)
        return pos + 1, torch.arange(m) + pos.max()

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        _compiled_equals_eager(draft, torch.tensor([1, 2]), torch.tensor(3))


def test_shape_env_ranges_prove_clamps_of_symbolic_sizes():
    def seed(tokens, keys):
        position = torch.full_like(tokens, keys.size(1) - 1)
        return tokens + position, keys, tokens

    def loop(x, keys, tokens):
        return x * torch.full_like(tokens, keys.size(1)).sub(1).clamp(min=0)

    keys = torch.randn(2, 5)
    torch._dynamo.mark_dynamic(keys, 1)
    report = fold(seed, loop, dict(tokens=torch.tensor([1, 2]), keys=keys))
    # full_like(tokens, size) - 1 is the seed's full_like(tokens, size - 1); the clamp of it then goes
    # too, since a size is >= 2 in the ShapeEnv (sympy already simplifies Max(0, s - 1) to s - 1).
    details = proven(report)
    assert len(details) == 2, details
    for detail in details:
        assert re.fullmatch(r"(s\d+) - 1 == \1 - 1 given \1 in \[2, 9223372036854775807\]", detail), detail
    assert report.refusals == []


# Property: over generated index arithmetic, whatever the pass merges, the folded graph computes what
# the composition computes, for inputs anywhere in the declared range (extremes included, where int32
# arithmetic wraps around).
ARITHMETIC = {
    "add": lambda x, c: x + c,
    "sub": lambda x, c: x - c,
    "mul": lambda x, c: x * c,
    "clamp_min": lambda x, c: x.clamp(min=c),
    "clamp_max": lambda x, c: x.clamp(max=c),
    "floordiv": lambda x, c: x // c,
    "mod": lambda x, c: x % c,
    "long": lambda x, c: x.long(),
}


def apply(x, steps):
    for op, constant in steps:
        x = ARITHMETIC[op](x, constant)
    return x


def steps(constants):
    def positive_divisors(ops):
        return [(op, abs(c) + 1 if op in ("floordiv", "mod") else c) for op, c in ops]

    return st.lists(st.tuples(st.sampled_from(sorted(ARITHMETIC)), constants), max_size=3).map(positive_divisors)


# Steps that change nothing for some inputs and ranges, and something for others.
MAYBE_NEUTRAL = [
    ("add", 0), ("mul", 1), ("floordiv", 1), ("clamp_min", -4), ("clamp_min", 1), ("clamp_max", 12), ("mod", 13),
    ("long", None),
]


@st.composite
def setups(draw):
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    low = draw(st.one_of(st.none(), st.integers(-4, 4)))
    high = draw(st.one_of(st.none(), st.integers(5, 12)))
    seed_steps = draw(steps(st.integers(-3, 3)))
    # The loop computes the seed's value with steps that may or may not change nothing in the range.
    loop_steps = list(seed_steps)
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(loop_steps)))
        loop_steps.insert(at, draw(st.sampled_from(MAYBE_NEUTRAL)))
    info = torch.iinfo(dtype)
    values = st.integers(info.min if low is None else low, info.max if high is None else high)
    edges = [v for v in (info.min, info.min + 1, info.max) if (low is None or v >= low) and (high is None or v <= high)]
    inputs = draw(st.lists(st.one_of(values, st.sampled_from(edges)) if edges else values, min_size=3, max_size=3))
    return dtype, (low, high), seed_steps, loop_steps, inputs


@settings(max_examples=30)
@given(setups())
def test_merges_never_change_what_the_graph_computes(setup):
    dtype, (low, high), seed_steps, loop_steps, inputs = setup

    def seed(seq_lens):
        return apply(seq_lens, seed_steps), seq_lens

    def loop(value, seq_lens):
        return torch.stack([value.long(), apply(seq_lens, loop_steps).long()])

    seq_lens = torch.tensor(inputs, dtype=dtype)
    fold(seed, loop, dict(seq_lens=seq_lens), value_ranges={"seq_lens": (low, high)})  # checks the values


def _positions_written_after_a_cast_is_stored(positions, hidden, rope_positions):
    # SGLang-style: int32 positions advanced in place by the loop; the seed stores an int64 copy's
    # int32 cast in a persistent buffer (proven equal to positions: merged where nothing overwrites it)
    wide = positions.to(torch.int64)
    hidden = hidden + wide[:, None].float()
    rope_positions.copy_(wide.int())
    for _ in range(2):
        positions.add_(1)
        hidden = hidden + positions[:, None].float()
    return hidden


def test_a_merge_does_not_keep_an_input_the_graph_overwrites_before_the_twin_is_read():
    """The cast was merged into the positions input, and the buffer's copy, which Inductor runs after its
    copy into positions, stored the advanced positions ([2, 12, 22, 32] where eager stores [0, 10, 20, 30]).
    A real compile: draft_graphs runs the graph with the input writes after it, as AOT autograd does by default."""
    def arguments():
        return torch.arange(4, dtype=torch.int32) * 10, torch.ones(4, 3), torch.zeros(4, dtype=torch.int32)

    want, got = arguments(), arguments()
    _positions_written_after_a_cast_is_stored(*want)
    draft_loop(_positions_written_after_a_cast_is_stored, mode=None)(*got)
    for w, g in zip(want, got):
        assert torch.equal(w, g), (w, g)


@pytest.mark.slow  # an Inductor compile per example: about 2 s each on a 2-core CPU
@settings(max_examples=12, deadline=None, derandomize=True)
@given(setups())
def test_merges_never_read_an_input_after_the_graph_overwrites_it(setup):
    """The property above with the hazard: the loop stores a value (proven equal to seq_lens, or not) in a
    buffer, then advances seq_lens in place; through a real compile, buffers and outputs are eager's."""
    dtype, (low, high), seed_steps, loop_steps, inputs = setup

    def seed(seq_lens, out):
        return apply(seq_lens, seed_steps), seq_lens, out

    def loop(value, seq_lens, out):
        out.copy_(apply(seq_lens, loop_steps) + 0)  # a computed value: torch.compile copies an input itself too late (README)
        seq_lens.add_(1)
        return value.long()

    def arguments():
        seq_lens = torch.tensor(inputs, dtype=dtype)
        return {"seq_lens": seq_lens, "out": torch.zeros_like(apply(seq_lens, loop_steps))}

    want_args, got_args = arguments(), arguments()
    want = loop(*seed(**want_args))
    got = draft_loop(composed(seed, loop, value_ranges={"seq_lens": (low, high)}), mode=None)(**got_args)
    assert torch.equal(got, want)
    for name in want_args:
        assert torch.equal(got_args[name], want_args[name]), (name, got_args[name], want_args[name])
