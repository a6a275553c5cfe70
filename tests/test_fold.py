"""`fold(seed, loop)`: the composition, compiled as one region, computes what `loop(*seed(...))` computes.

Each fold compiles once (seconds on a CPU), so each test compiles one.
"""

import functools
import inspect
from collections import namedtuple

import pytest
import torch

from draftfuse import GraphBreakError
from draftfuse.passes.seed_fold.seam import mark_seam
from draftfuse.runtime.draft_loop import draft_loop
from draftfuse.runtime.fold import fold
from draftfuse.runtime.replay import _guard_nodes
from tests.test_seed_fold import frozen_args, server_loop, server_seed

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

V, H = 16, 8


class Worker:
    """A draft worker on any device: an eager-style seed step (host copy of the lengths included) and
    the draft steps, which recompute their position defensively clamped."""

    def __init__(self, device: torch.device) -> None:
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.randn(V, H, generator=generator).to(device)
        self.head = torch.randn(H, V, generator=generator).to(device)

    def seed_step(self, tokens, hidden, seq_lens):
        position = seq_lens - 1
        hidden = torch.tanh(hidden + self.embed[tokens] + position[:, None])
        _, index = (hidden @ self.head).softmax(-1).topk(1)
        return index[:, 0], hidden, seq_lens.cpu()

    def draft_steps(self, token, hidden, seq_lens_host):
        position = (seq_lens_host.to(hidden.device) - 1).clamp(min=0)
        drafted = [token]
        for _ in range(3):
            hidden = torch.tanh(hidden + self.embed[drafted[-1]] + position[:, None])
            drafted.append((hidden @ self.head).softmax(-1).topk(1).indices[:, 0])
        return torch.stack(drafted, dim=1)


def worker_args(device: torch.device) -> tuple:
    return torch.tensor([3, 7], device=device), torch.randn(2, H, device=device), torch.tensor([5, 9], device=device)


def seam_report(draft):
    (record,) = draft.draft.compiles  # one Dynamo graph, compiled once
    report = record.reports[0]
    assert report.pass_name == "seed_fold"
    return report


def merge_report(draft):
    """The post-grad setup-merging report (the tests compile without the FX graph cache: it runs)."""
    (record,) = draft.draft.compiles
    (report,) = [r for r in record.reports if r.pass_name == "merge_setup"]
    return report


@pytest.mark.slow  # the first Inductor compile of a process: about 20 s on a 2-core CPU
def test_fold_equals_the_composition_of_plain_functions():
    args = frozen_args()
    draft = fold(server_seed, server_loop)
    with torch.no_grad():
        for _ in range(2):  # the second call runs what the first compiled
            tokens, probs = draft(*args.values())
            want_tokens, want_probs = server_loop(*server_seed(*args.values()))
            torch.testing.assert_close(tokens, want_tokens, rtol=0, atol=0)
            torch.testing.assert_close(probs, want_probs)
    rules = [r.rule for r in seam_report(draft).rewrites]
    removed = ["seam marker removed", "host round trip removed", "placeholder allocation removed"]
    assert set(removed) <= set(rules)
    assert "setup merged (identical)" in [r.rule for r in merge_report(draft).rewrites]


def test_fold_of_bound_methods_uses_the_declared_range():
    worker = Worker(torch.device("cpu"))
    args = worker_args(torch.device("cpu"))
    draft = fold(worker.seed_step, worker.draft_steps, value_ranges={"seq_lens": (1, None)})
    with torch.no_grad():
        got = draft(*args[:2], seq_lens=args[2])
    torch.testing.assert_close(got, worker.draft_steps(*worker.seed_step(*args)), rtol=0, atol=0)
    assert repr(draft) == "fold(Worker.seed_step, Worker.draft_steps)"
    report = seam_report(draft)
    assert "host round trip removed" in [r.rule for r in report.rewrites]
    proven = [r.detail for r in merge_report(draft).rewrites if r.rule == "setup merged (proven equal)"]
    assert any("given seq_lens in [1, " in detail for detail in proven), proven


def test_draft_loop_of_the_plain_composition_gets_the_same_fold():
    # No marker: the pass finds the seed by its chain of selections. The host copy of seq_lens would
    # be a HostSyncError; the fold removes the round trip before the capture checks look.
    worker = Worker(torch.device("cpu"))
    args = worker_args(torch.device("cpu"))
    draft = draft_loop(lambda tokens, hidden, seq_lens: worker.draft_steps(*worker.seed_step(tokens, hidden, seq_lens)))
    with torch.no_grad():
        torch.testing.assert_close(draft(*args), worker.draft_steps(*worker.seed_step(*args)), rtol=0, atol=0)
    (record,) = draft.compiles
    report = record.reports[0]
    assert "host round trip removed" in [r.rule for r in report.rewrites]
    assert "iterations found: 4 (1 in the seed, 3 in the loop; loop selections: topk_1, topk_2, topk_3)" in report.notes


def test_a_seed_returning_one_tensor_is_passed_whole():
    draft = fold(lambda x: x.softmax(-1), lambda probs: probs.topk(2).indices)
    x = torch.randn(2, V)
    torch.testing.assert_close(draft(x), x.softmax(-1).topk(2).indices, rtol=0, atol=0)


def test_a_call_the_seed_does_not_take_is_named():
    """A call that does not fit the seed: its own TypeError, raised before tracing, where fold binds the
    call to the seed's parameters; through another decorator's wrapper (called with the arguments as
    they come) a GraphBreakError at the wrapper's call that says the arguments do not fit (not "move this
    call out of the draft ... allow_in_graph")."""
    def seed(tokens, /, hidden, *, scale):
        return tokens + hidden * scale

    with pytest.raises(TypeError, match="scale"):
        fold(seed, lambda h: h.argmax(-1))(torch.ones(2), torch.ones(2))
    with pytest.raises(GraphBreakError, match="arguments do not fit the parameters") as caught:
        fold(_injects_scale(seed), lambda h: h.argmax(-1))(torch.ones(2))
    assert "allow_in_graph" not in str(caught.value)


@pytest.mark.cuda
def test_one_graph_replay_per_folded_draft_and_no_cudagraph_skips():
    from torch._dynamo.utils import counters

    from draftfuse._measure import graph_replays_per_call

    device = torch.device("cuda")
    worker = Worker(device)
    args = worker_args(device)
    counters.clear()
    draft = fold(worker.seed_step, worker.draft_steps, value_ranges={"seq_lens": (1, None)})
    with torch.no_grad():
        for _ in range(3):  # CUDA graph trees: warm-up, record, then replays
            draft(*args)
        assert graph_replays_per_call(lambda: draft(*args)) == 1
        torch.testing.assert_close(draft(*args), worker.draft_steps(*worker.seed_step(*args)), rtol=0, atol=0)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert len(draft.draft.compiles) == 1


def test_the_seam_marker_leaves_no_guards_of_its_own():
    # The marker walks the seed's tuple itself: through torch's pytree, Dynamo guarded pytree's module
    # state (its registry's version, its leaf spec, its functions' code: 23 of the MTP draft's 191 guards),
    # and every replayed call checks the guard tree. A namedtuple of outputs comes back a namedtuple.
    worker = Worker(torch.device("cpu"))
    args = worker_args(torch.device("cpu"))
    draft = fold(worker.seed_step, worker.draft_steps)
    for _ in range(3):
        draft(*args)
    sources = list(_guard_nodes(draft.draft._replays[0].guard.root))
    assert sources and not [s for s in sources if "_pytree" in s], [s for s in sources if "_pytree" in s][:3]

    Seeded = namedtuple("Seeded", "token hidden")
    marked = mark_seam(({"a": [torch.ones(2)], "n": 3}, Seeded(torch.zeros(1), 2.0)))
    assert isinstance(marked[1], Seeded) and marked[1].hidden == 2.0 and marked[0]["n"] == 3
    assert torch.equal(marked[0]["a"][0], torch.ones(2)) and torch.equal(marked[1].token, torch.zeros(1))


def test_a_fold_of_a_worker_replays_without_dynamo(recwarn):
    # The composition takes the seed's own parameters, and reads the worker's weights through its
    # closure: Dynamo's code for it only calls the graph, so the fast replay path takes it.
    worker = Worker(torch.device("cpu"))
    args = worker_args(torch.device("cpu"))
    draft = fold(worker.seed_step, worker.draft_steps, value_ranges={"seq_lens": (1, None)})
    for _ in range(3):
        draft(*args)
    assert draft.draft._replays and not [w for w in recwarn if "no fast replay" in str(w.message)]
    calls = sum(recorder.calls for recorder, _ in draft.draft._recorders)
    for got in (draft(*args), draft(args[0], hidden=args[1], seq_lens=args[2])):
        torch.testing.assert_close(got, worker.draft_steps(*worker.seed_step(*args)), rtol=0, atol=0)
    assert sum(recorder.calls for recorder, _ in draft.draft._recorders) == calls, "replayed without Dynamo"
    placeholders = [p.target for p in draft.draft._recorders[0][1]]
    assert "L_seq_lens_" in placeholders, placeholders  # graph inputs named after the seed's parameters
    # torch 2.11 compiles a function without a source file inside a wrapper frame shared by all such
    # functions, where the fast path cannot find its guards: the generated composition has one
    assert inspect.getsourcefile(draft.draft._code_fn) is not None
    assert "_df_loop_(" in inspect.getsource(draft.draft._code_fn)


def test_a_draft_whose_compiled_code_is_not_found_says_it_gets_no_fast_replay(monkeypatch):
    import torch._dynamo.eval_frame

    monkeypatch.setattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", lambda code: [])
    draft = fold(lambda x: (x + 1,), lambda y: y * 2)
    x = torch.arange(4.0)
    with pytest.warns(UserWarning, match="no fast replay for this draft: the compiled entry that ran does not pass its guards"):
        for _ in range(3):
            assert torch.equal(draft(x), (x + 1) * 2)
    assert not draft.draft._replays


def test_a_folded_call_binds_no_signature(monkeypatch):
    """The composition takes the seed's parameters: a call passes through, and its frame's locals are
    built without inspect's binding (which would cost more than the rest of a replayed call)."""
    draft = fold(lambda x: (x + 1,), lambda y: y * 2)
    x = torch.arange(4.0)
    for _ in range(3):
        draft(x)

    def no_binding(*args, **kwargs):
        raise AssertionError("inspect.Signature.bind called on a draft call")

    monkeypatch.setattr(inspect.Signature, "bind", no_binding)
    assert torch.equal(draft(x=x), (x + 1) * 2)


def _scaled_seed(logits, scale=1.0):
    return logits * scale, logits.shape[0]


def _top2(scaled, rows):
    return scaled.softmax(-1).topk(2).indices[:rows]


def test_a_seed_default_replaced_after_fold_is_read_per_call():
    """`seed.__defaults__ = (...)` after fold: the composition (generated with the seed's defaults) takes
    the new ones, on the replay path and through Dynamo, as `loop(*seed(...))` does."""
    draft = fold(_scaled_seed, _top2)
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    saved = _scaled_seed.__defaults__
    try:
        for _ in range(3):
            draft(logits)
        _scaled_seed.__defaults__ = (-1.0,)  # another order: the top two of -logits
        for _ in range(3):
            torch.testing.assert_close(draft(logits), _top2(*_scaled_seed(logits)), rtol=0, atol=0)
    finally:
        _scaled_seed.__defaults__ = saved


_HEAD = torch.randn(H, V, generator=torch.Generator().manual_seed(3))


def _reversed_seed(hidden):
    buffer, index = torch.zeros(hidden.shape[0], H), torch.arange(hidden.shape[0])
    index.copy_(index.flip(0))  # a permutation now: the index_copy_ reverses the rows
    buffer.index_copy_(0, index, hidden)
    return buffer, (buffer @ _HEAD).softmax(-1).topk(1).indices


def _steps_of(hidden, token):
    drafted = [token]
    for _ in range(2):
        hidden = hidden + 1
        drafted.append((hidden @ _HEAD).softmax(-1).topk(1).indices)
    return hidden, torch.cat(drafted, 1)


def _fills_static_hidden(hidden, static_hidden):
    static_hidden.copy_(torch.tanh(hidden))  # a server's write of the captured loop's static input
    return (static_hidden,)


def _returns_static_hidden(static_hidden):
    drafted = [(static_hidden * 0.5**i @ _HEAD).softmax(-1).topk(1).indices for i in range(2)]
    return static_hidden, torch.cat(drafted, 1)  # the buffer itself, which the caller then reads


@pytest.mark.parametrize("case", ["index written after its arange", "returned caller buffer"])
def test_a_fill_is_forwarded_only_where_its_buffer_is_the_copy_and_unread_after(case):
    """Two fills the seed fold took for plain copies: an index_copy_ whose arange index had been written
    (idx.copy_(idx.flip(0)): the loop then read the rows unreversed), and, with drop_buffer_writes=True, the
    caller's buffer the draft returns (the write was dropped: the caller read zeros, not the seed's values)."""
    if case == "index written after its arange":
        seed, loop, args, options = _reversed_seed, _steps_of, (torch.randn(3, H),), {}
    else:
        seed, loop, args, options = _fills_static_hidden, _returns_static_hidden, (torch.randn(3, H), torch.zeros(3, H)), {"drop_buffer_writes": True}
    eager_args = [a.clone() for a in args]
    want = loop(*seed(*eager_args))
    got = fold(seed, loop, **options)(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    for g, w in zip(args, eager_args):
        torch.testing.assert_close(g, w)
    if case == "returned caller buffer":
        assert got[0] is args[1], "the returned buffer is the caller's tensor"


def _seed_with_meta(tokens, hidden, meta_seq_lens, meta):
    position = meta_seq_lens - 1
    hidden = torch.tanh(hidden + _HEAD.T[tokens] + position[:, None]) + (meta["seq_lens"] - 1)[:, None] * 0
    return (hidden @ _HEAD).topk(1).indices[:, 0], hidden, meta_seq_lens


def _clamped_steps(token, hidden, seq_lens):
    position = (seq_lens - 1).clamp(min=0)
    drafted = [token]
    for _ in range(2):
        hidden = torch.tanh(hidden + _HEAD.T[drafted[-1]] + position[:, None])
        drafted.append((hidden @ _HEAD).topk(1).indices[:, 0])
    return torch.stack(drafted, 1), hidden


def test_a_range_goes_to_the_input_named_exactly():
    """Names were compared with dots made underscores: a range for the dict entry meta['seq_lens'], keyed
    "meta.seq_lens", went to the argument meta_seq_lens (which holds a 0), and the clamp it needed was proven
    away: other tokens. Now "meta.seq_lens" names no input (an attribute would be meta.seq_lens, the entry
    meta['seq_lens']), and the note lists the names."""
    tokens, hidden = torch.tensor([3, 7]), torch.randn(2, H, generator=torch.Generator().manual_seed(5))
    args = (tokens, hidden, torch.tensor([0, 4]), {"seq_lens": torch.tensor([2, 4])})
    draft = fold(_seed_with_meta, _clamped_steps, value_ranges={"meta.seq_lens": (1, None)})
    got, want = draft(*args), _clamped_steps(*_seed_with_meta(*args))
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])
    (note,) = [n for n in seam_report(draft).notes if "meta.seq_lens" in n]
    assert "no graph input is named" in note and "meta['seq_lens']" in note and "meta_seq_lens" in note


@pytest.mark.parametrize("bounds", [(5, 1), (1, 2, 3), (1.5, None), (True, None), 7])
def test_a_malformed_range_is_refused_when_folding(bounds):
    """(5, 1) failed at the first call inside Inductor (ValueRangeError); (1, 2, 3) was dropped with a logged
    internal error of the pass at every compile."""
    with pytest.raises(ValueError, match=r"value_ranges\['seq_lens'\]"):
        fold(_seed_with_meta, _clamped_steps, value_ranges={"seq_lens": bounds})


def _fills_scale(fn):
    @functools.wraps(fn)  # a wrapper with parameters of its own, which fills one of fn's
    def wrapper(logits, flip=False):
        return fn(-logits if flip else logits, 2.0)

    return wrapper


def _injects_scale(fn):
    @functools.wraps(fn)  # takes (*args, **kwargs), so it says it passes them on; it adds one
    def wrapper(*args, **kwargs):
        return fn(*args, scale=2.0, **kwargs)

    return wrapper


def _scale_by(logits, scale):
    return logits * scale, logits.shape[0]


class _CallableSeed:
    def __call__(self, logits, scale=1.0):
        return logits * scale, logits.shape[0]


def _fills_when_left_out(fn):
    @functools.wraps(fn)  # a config default, as servers decorate sampling steps: only where the call leaves it out
    def wrapper(*args, **kwargs):
        kwargs.setdefault("scale", -1.0)
        return fn(*args, **kwargs)

    return wrapper


@_fills_when_left_out
def _scaled_by_config(logits, scale=1.0):
    return logits * scale, logits.shape[0]


def test_a_wrapper_seed_is_called_as_eager_calls_it():
    """inspect.signature follows __wrapped__. A wrapper of parameters (logits, flip) that fills the wrapped
    seed's `scale` raised TypeError (the draft took (logits, scale)); a (*args, **kwargs) wrapper that adds
    an argument too; one that fills `scale` only where the call leaves it out never did (the composition
    passed scale=1.0, the wrapped default: other tokens, no error). Each is called with the draft's
    arguments as they come, and a range still names the wrapped parameter."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    seed = _fills_scale(_scale_by)
    assert torch.equal(fold(seed, _top2)(logits, flip=True), _top2(*seed(logits, flip=True)))
    seed = _injects_scale(_scale_by)
    assert torch.equal(fold(seed, _top2)(logits), _top2(*seed(logits)))
    draft = fold(_scaled_by_config, _top2)
    for call in range(3):
        assert torch.equal(draft(logits), _top2(*_scaled_by_config(logits))), call
    assert torch.equal(draft(logits, scale=2.0), _top2(*_scaled_by_config(logits, scale=2.0)))


def test_a_callable_objects_default_replaced_after_fold_is_read_per_call():
    """The defaults of a callable object's __call__ are its class's: replaced after fold, a call reads
    the new ones, as `loop(*seed(...))` does."""
    seed, logits = _CallableSeed(), torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    draft = fold(seed, _top2)
    saved = _CallableSeed.__call__.__defaults__
    try:
        for _ in range(3):
            draft(logits)
        _CallableSeed.__call__.__defaults__ = (-1.0,)
        for _ in range(3):
            assert torch.equal(draft(logits), _top2(*seed(logits)))
    finally:
        _CallableSeed.__call__.__defaults__ = saved


def test_a_loop_that_does_not_take_the_seeds_values_is_named():
    """loop(*seed(...)) raises TypeError eagerly when the loop takes fewer values than the seed returns;
    the capture error says that, not "move this call out of the draft"."""
    draft = fold(lambda x: (x, x + 1, x + 2), lambda a, b: a * b)
    with pytest.raises(GraphBreakError, match="the loop does not take the values the seed returns") as caught:
        draft(torch.arange(4.0))
    assert "allow_in_graph" not in str(caught.value)


class _PositionalWorker(Worker):
    def seed_positional(self, tokens, hidden, seq_lens, /):  # positional-only: the composition takes (*args, **kwargs)
        return self.seed_step(tokens, hidden, seq_lens)


def test_a_range_on_a_positional_only_parameter_is_used():
    """A seed whose parameters are not all plain is composed as (*args, **kwargs): its positional
    parameters reach the graph as args[i]; a range keyed by the parameter's name went unused ("no
    graph input is named 'seq_lens'") and the clamp was not proven away."""
    worker, args = _PositionalWorker(torch.device("cpu")), worker_args(torch.device("cpu"))
    draft = fold(worker.seed_positional, worker.draft_steps, value_ranges={"seq_lens": (1, None)})
    with torch.no_grad():
        assert torch.equal(draft(*args), worker.draft_steps(*worker.seed_step(*args)))
    proven = [r.detail for r in merge_report(draft).rewrites if r.rule == "setup merged (proven equal)"]
    assert any("given seq_lens in [1, " in detail for detail in proven), proven


_EMBED = torch.randn(V, H, generator=torch.Generator().manual_seed(7))


def _seed_with_context(context, tokens, hidden, lengths, seq_lens):
    hidden = torch.tanh(hidden + context[tokens] + (seq_lens - 1)[:, None] + lengths[:, None] * 0)
    return (hidden @ _HEAD).softmax(-1).topk(1).indices[:, 0], hidden, seq_lens


def _with_context(fn):
    @functools.wraps(fn)  # adds a leading argument: the wrapped function's positions are not the call's
    def wrapper(*args, **kwargs):
        return fn(_EMBED, *args, **kwargs)

    return wrapper


def _clamping_steps(token, hidden, seq_lens):
    position, drafted = (seq_lens - 1).clamp(min=0), [token]
    for _ in range(3):
        hidden = torch.tanh(hidden + _EMBED[drafted[-1]] + position[:, None])
        drafted.append((hidden @ _HEAD).softmax(-1).topk(1).indices[:, 0])
    return torch.stack(drafted, dim=1)


def test_a_range_never_lands_on_another_input_through_a_wrapper_that_adds_arguments():
    """The wrapper passes a context first: position 2 of the wrapped parameters (lengths) is the call's
    position 3 (seq_lens, which holds a 0). The range for lengths went to seq_lens, whose clamp was proven
    away: [[1, 1, 1, 13], ...] where eager gives [[1, 1, 1, 1], ...]. Through another decorator's wrapper
    only a keyword argument is named; the range is unused, with the note."""
    seed = _with_context(_seed_with_context)
    args = (torch.tensor([3, 7]), torch.randn(2, H, generator=torch.Generator().manual_seed(5)), torch.tensor([5, 9]), torch.tensor([0, 4]))
    draft = fold(seed, _clamping_steps, value_ranges={"lengths": (1, None)})
    assert torch.equal(draft(*args), _clamping_steps(*seed(*args)))
    assert any("no graph input is named 'lengths'" in note for note in seam_report(draft).notes)


def _keyword_scaled(x, seq_lens, *, scale=2.0):
    return x * scale, seq_lens


def test_a_seed_with_keyword_only_parameters_compiles_once_for_every_calling_style():
    """(*args, **kwargs) composition: draft(x, s), draft(x, seq_lens=s) and draft(x=x, seq_lens=s) are one
    call of the seed; passed on as they came they were three graphs (RecompileError with max_compiles=1)."""
    draft = fold(_keyword_scaled, lambda x, seq_lens: x.argmax(-1) + seq_lens, max_compiles=1)
    x, s = torch.randn(2, 8), torch.tensor([1, 2])
    want = _keyword_scaled(x, s)[0].argmax(-1) + s
    for call in (lambda: draft(x, s), lambda: draft(x, seq_lens=s), lambda: draft(x=x, seq_lens=s)):
        assert torch.equal(call(), want)
    assert len(draft.draft.compiles) == 1


def test_a_torch_no_grad_seed_keeps_its_parameters():
    """torch.no_grad()'s wrapper passes its arguments on as they came: the seed is composed with its own
    parameters (no per-call binding), and a range names a positional argument."""
    worker = _PositionalWorker(torch.device("cpu"))
    seed = torch.no_grad()(Worker.seed_step.__get__(worker))
    draft = fold(seed, worker.draft_steps, value_ranges={"seq_lens": (1, None)})
    args = worker_args(torch.device("cpu"))
    assert torch.equal(draft(*args), worker.draft_steps(*worker.seed_step(*args)))
    assert list(inspect.signature(draft.draft._fn).parameters) == ["tokens", "hidden", "seq_lens"]
    proven = [r.detail for r in merge_report(draft).rewrites if r.rule == "setup merged (proven equal)"]
    assert any("given seq_lens in [1, " in detail for detail in proven), proven


def _keyword_seed(tokens, hidden, /, seq_lens, *, scale=1.0, **extra):
    return torch.tanh(hidden * scale + _EMBED[tokens]), seq_lens + extra.get("shift", 0)


def _keyword_steps(hidden, seq_lens):
    position = (seq_lens - 1).clamp(min=0)
    return ((hidden + 0.01 * position[:, None]) @ _HEAD).softmax(-1).topk(2).indices


def test_a_seed_of_every_kind_of_parameter_is_composed_with_its_signature(monkeypatch):
    """Positional-only, keyword-only and **kwargs parameters: the composition takes the seed's own
    signature, so every calling style binds in CPython as the seed does, with no per-call inspect binding
    (a few µs on every replayed call), one graph, and a range reaches its input by the parameter's name."""
    draft = fold(_keyword_seed, _keyword_steps, value_ranges={"seq_lens": (1, None)}, max_compiles=1)
    tokens, hidden, s = torch.tensor([3, 7]), torch.randn(2, H, generator=torch.Generator().manual_seed(3)), torch.tensor([5, 9])
    for _ in range(3):
        draft(tokens, hidden, s)

    def no_binding(*args, **kwargs):
        raise AssertionError("inspect.Signature.bind called on a draft call")

    monkeypatch.setattr(inspect.Signature, "bind", no_binding)
    for call in (lambda: draft(tokens, hidden, s), lambda: draft(tokens, hidden, seq_lens=s), lambda: draft(tokens, hidden, s, scale=1.0)):
        assert torch.equal(call(), _keyword_steps(*_keyword_seed(tokens, hidden, s)))
    monkeypatch.undo()
    assert str(inspect.signature(draft.draft._fn)) == "(tokens, hidden, /, seq_lens, *, scale=1.0, **kwargs)"
    assert len(draft.draft.compiles) == 1
    proven = [r.detail for r in merge_report(draft).rewrites if r.rule == "setup merged (proven equal)"]
    assert any("given seq_lens in [1, " in detail for detail in proven), proven


def test_a_keyword_only_default_replaced_after_fold_is_read_per_call():
    """The composition shares the seed's __kwdefaults__: replaced after fold (or changed in place), a
    call reads the new ones, as `loop(*seed(...))` does."""
    tokens, hidden, s = torch.tensor([3, 7]), torch.randn(2, H, generator=torch.Generator().manual_seed(4)), torch.tensor([5, 9])
    draft = fold(_keyword_seed, _keyword_steps)
    saved = _keyword_seed.__kwdefaults__
    try:
        for scale in (1.0, -3.0, 0.5):
            _keyword_seed.__kwdefaults__ = {"scale": scale}
            for _ in range(3):
                assert torch.equal(draft(tokens, hidden, s), _keyword_steps(*_keyword_seed(tokens, hidden, s)))
        _keyword_seed.__kwdefaults__["scale"] = 2.0
        assert torch.equal(draft(tokens, hidden, s), _keyword_steps(*_keyword_seed(tokens, hidden, s)))
    finally:
        _keyword_seed.__kwdefaults__ = saved


class _StaticCallSeed:
    @staticmethod
    def __call__(logits, scale=2.0):  # no self: the class's __call__ is a plain function
        return logits * scale, logits.shape[0]


def test_a_callable_object_with_a_static_call_is_folded():
    """fold read a staticmethod __call__'s first parameter as self and called the seed with one argument
    too many ("takes from 1 to 2 positional arguments but 3 were given")."""
    seed, logits = _StaticCallSeed(), torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    draft = fold(seed, _top2)
    assert torch.equal(draft(logits), _top2(*seed(logits)))
    assert torch.equal(draft(logits, scale=-1.0), _top2(*seed(logits, scale=-1.0)))


def _varargs_seed(hidden, *lens, **extra):
    return hidden, lens[0], extra["seq_lens"]


def _varargs_steps(hidden, lens, seq_lens):
    return ((hidden + (lens - 1).clamp(min=0)[:, None] + (seq_lens - 1).clamp(min=0)[:, None]) @ _HEAD).topk(2).indices


def test_ranges_name_an_element_of_the_seeds_star_args_and_a_keyword_it_collects():
    """`lens[0]` is the first value the seed's *lens collects and `seq_lens` a keyword its **extra takes:
    each range reaches its input (the report declares both), and the draft computes the composition."""
    draft = fold(_varargs_seed, _varargs_steps, value_ranges={"lens[0]": (1, None), "seq_lens": (1, None)})
    hidden, lens, s = torch.randn(2, H, generator=torch.Generator().manual_seed(6)), torch.tensor([1, 4]), torch.tensor([5, 9])
    assert torch.equal(draft(hidden, lens, seq_lens=s), _varargs_steps(*_varargs_seed(hidden, lens, seq_lens=s)))
    declared = sorted(r.detail for r in seam_report(draft).rewrites if r.rule == "range declared")
    assert declared == ["every element of lens[0] in [1, inf]", "every element of seq_lens in [1, inf]"], seam_report(draft)


def _default_scaled(x, scale=2.0, *, shift=1.0):
    return x * scale + shift


def test_a_fold_traced_in_another_region_after_its_defaults_changed():
    """Inside another torch.compile(fullgraph=True) region the draft is traced as loop(*seed(...)): syncing
    the composition's defaults there (an attribute store Dynamo does not trace) failed with "Unsupported
    setattr() on unsupported type" once the seed's __defaults__ or __kwdefaults__ had been replaced."""
    draft = fold(_default_scaled, lambda h: h + 1)
    x = torch.arange(4.0)
    draft(x)
    saved = _default_scaled.__defaults__, _default_scaled.__kwdefaults__
    try:
        _default_scaled.__defaults__, _default_scaled.__kwdefaults__ = (3.0,), {"shift": -1.0}
        outer = torch.compile(lambda x: draft(x) * 1, fullgraph=True, backend="eager")
        assert torch.equal(outer(x), _default_scaled(x) + 1)
        assert torch.equal(draft(x), _default_scaled(x) + 1)
    finally:
        _default_scaled.__defaults__, _default_scaled.__kwdefaults__ = saved
