"""`@draft_loop` on the CPU: one Dynamo graph per draft, eager results, methods, outputs, profiling.

A full compile of the tiny draft costs seconds, so one module-scoped compile of the function draft
serves the tests that only read what it did; the method test compiles a one-step draft of its own.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from tests._tiny_draft import draft, make_inputs
from draftfuse.runtime.draft_loop import DraftLoop, draft_loop
from draftfuse.runtime.errors import RecompileError


@pytest.fixture(scope="module")
def compiled_draft():
    """The tiny draft (seed + 3 steps) compiled by @draft_loop, called twice, with what it left behind."""
    torch._dynamo.reset()
    counters.clear()
    model, tokens, hidden, kv_cache, position = make_inputs()
    eager_cache = kv_cache.clone()
    compiled = draft_loop(draft)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = draft(model, tokens, hidden, eager_cache, position)
        first = compiled(model, tokens, hidden, kv_cache, position)
        cache_after_first = kv_cache.clone()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            second = compiled(model, tokens, hidden, kv_cache, position)
    stats = {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}
    yield dict(
        compiled=compiled, eager=eager, first=first, second=second, kv_cache=kv_cache,
        cache_after_first=cache_after_first, eager_cache=eager_cache,
        stats=stats, profile=profile, warnings=[str(w.message) for w in caught],
    )
    torch._dynamo.reset()


def test_results_equal_eager_fp32(compiled_draft):
    eager_tokens, eager_probs = compiled_draft["eager"]
    tokens, probs = compiled_draft["first"]
    assert tokens.shape == (2, 4)  # seed + 3 steps
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(probs, eager_probs, rtol=0, atol=1e-6)
    # the KV cache written in place inside the draft holds what eager wrote
    torch.testing.assert_close(compiled_draft["cache_after_first"], compiled_draft["eager_cache"], rtol=0, atol=1e-6)


def test_one_dynamo_graph_no_graph_break(compiled_draft):
    assert compiled_draft["stats"] == {"graphs": 1, "breaks": 0}
    assert len(compiled_draft["compiled"].compiles) == 1  # the second call replayed, no recompile
    record = compiled_draft["compiled"].compiles[0]
    rewrites = [r for report in record.reports if report.pass_name == "softmax_topk" for r in report.rewrites]
    assert len(rewrites) == 4  # the selection of the seed and of each step


def test_kv_cache_made_static(compiled_draft):
    assert compiled_draft["kv_cache"]._dynamo_static_input_type == "unguarded"


def test_each_call_is_a_profiler_span(compiled_draft):
    names = [event.name for event in compiled_draft["profile"].events()]
    assert names.count("draftfuse.draft:draft") == 1


def test_a_module_draft_is_named_after_its_class():
    """draft_loop(module) was named Module._wrapped_call_impl in its profiler span, CPU warning and
    RecompileError (helper-68's README audit)."""

    class Drafter(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, -1).topk(1, -1)

    draft = draft_loop(Drafter(), max_compiles=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            draft(torch.randn(2, 8))
    assert [e.name for e in profile.events()].count("draftfuse.draft:Drafter") == 1
    assert any("'Drafter'" in str(w.message) or "Drafter" in str(w.message) for w in caught), [str(w.message) for w in caught]
    with pytest.raises(RecompileError, match="draft 'Drafter' needs compile number 2"):
        draft(torch.randn(3, 8))


def test_cpu_warns_once(compiled_draft):
    cpu_warnings = [w for w in compiled_draft["warnings"] if "CUDA graphs need a CUDA device" in w]
    assert len(cpu_warnings) == 1


class _Worker:
    """A draft worker whose draft is a method reading the model and KV cache from `self`."""

    def __init__(self) -> None:
        self.model, _, _, self.kv_cache, self.position = make_inputs()

    @draft_loop
    def draft(self, tokens, hidden):
        return draft(self.model, tokens, hidden, self.kv_cache, self.position, steps=1)


def test_method_binds_self_and_matches_eager():
    torch._dynamo.reset()
    worker, other = _Worker(), _Worker()
    _, tokens, hidden, _, _ = make_inputs()
    assert isinstance(_Worker.draft, DraftLoop)
    assert worker.draft is worker.draft  # bound once, kept on the instance
    assert worker.draft is not other.draft  # one compiled region per instance
    eager_cache = worker.kv_cache.clone()
    with torch.no_grad():
        eager = draft(worker.model, tokens, hidden, eager_cache, worker.position, steps=1)
        compiled = worker.draft(tokens, hidden)
    assert torch.equal(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(worker.kv_cache, eager_cache, rtol=0, atol=1e-6)
    assert len(worker.draft.compiles) == 1 and other.draft.compiles == []
    torch._dynamo.reset()


def test_a_deleted_worker_frees_its_draft_weights_and_compiled_region():
    # torch keeps every backend given to torch.compile, and Dynamo installs each compiled region in the draft's
    # module globals until its cache entry goes: a worker's draft held its instance (weights, KV cache, CUDA
    # graphs) for the life of the process
    torch._dynamo.reset()
    gone, kept = _Worker(), _Worker()
    _, tokens, hidden, _, _ = make_inputs()
    with torch.no_grad():
        for _ in range(2):
            gone.draft(tokens, hidden)
        expected = kept.draft(tokens, hidden)[0]
    regions = {k for k in globals() if k.startswith("__compiled_fn")}
    held = [weakref.ref(x) for x in (gone, gone.draft, gone.kv_cache, *gone.model.parameters())]
    del gone
    gc.collect()
    assert [r() for r in held] == [None] * len(held)
    assert len({k for k in globals() if k.startswith("__compiled_fn")}) == len(regions) - 1
    with torch.no_grad():  # the other worker's draft is untouched
        kept.kv_cache.zero_()
        assert torch.equal(kept.draft(tokens, hidden)[0], expected) and len(kept.draft.compiles) == 1
    torch._dynamo.reset()


class _KvWorker:
    """A worker whose draft writes its own KV cache and reads its own head (modeled on EAGLE-style workers)."""

    def __init__(self, seed: int) -> None:
        self.head = torch.nn.Linear(8, 16).requires_grad_(False)
        torch.nn.init.normal_(self.head.weight, generator=torch.Generator().manual_seed(seed))
        self.kv = torch.zeros(4, 8)

    @draft_loop
    def draft(self, h):
        self.kv[0] = h[0]
        return torch.softmax(self.head(h), -1).topk(2, -1)


def _eager_draft(worker, h):
    with torch.no_grad():
        return _KvWorker.draft._fn(worker, h)


def test_a_copied_worker_drafts_with_its_own_weights_and_cache():
    """copy.copy(worker) copied the instance's __dict__, the bound draft with it: the copy's calls ran
    the original's draft (its head, its KV cache), silently."""
    import copy

    original, h = _KvWorker(0), torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    original.draft(h)
    clone = copy.copy(original)
    clone.head, clone.kv = _KvWorker(1).head, torch.zeros(4, 8)
    got, want = clone.draft(h), _eager_draft(copy.copy(clone), h)
    assert torch.equal(got.indices, want.indices) and torch.allclose(got.values, want.values)
    assert torch.equal(clone.kv[0], h[0]), "the copy's own KV cache is written"
    assert clone.draft is not original.draft and clone.draft is clone.draft


class _KvModule(torch.nn.Module):
    """A worker that is an nn.Module (deep-copied and pickled as modules are), writing its own KV buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, 16).requires_grad_(False)
        self.register_buffer("kv", torch.zeros(4, 16))

    @draft_loop
    def draft(self, h):
        logits = self.head(h)
        self.kv[0] = logits[0]
        return torch.softmax(logits, -1).argmax(-1), logits


@pytest.mark.parametrize("calls", [0, 1, 3])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_deep_copied_or_pickled_worker_drafts_with_its_own_weights_and_cache(calls, how):
    """copy.deepcopy of a worker whose draft was looked up gave the copy a draft sharing the original's code
    cache and backend: the copy compiled into the original's draft, and the original's next call raised about its
    own KV cache. Once the draft had been called, deepcopy and pickling raised (guard managers, fake tensors)."""
    import copy
    import pickle

    original, h = _KvModule(), torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    original.draft  # noqa: B018 (looked up: the bound draft is in the instance's __dict__)
    for _ in range(calls):
        original.draft(h)
    clone = copy.deepcopy(original) if how == "deepcopy" else pickle.loads(pickle.dumps(original))
    with torch.no_grad():
        clone.head.weight.mul_(-3)
    for worker in (clone, clone, original, clone, original):
        before = worker.kv.clone()
        got = worker.draft(h)
        with torch.no_grad():
            want = worker.head(h)
        assert torch.equal(got[0], want.argmax(-1)) and torch.allclose(got[1], want)
        assert torch.allclose(worker.kv[0], want[0]) and torch.equal(worker.kv[1:], before[1:])
    assert clone.draft is not original.draft and clone.draft._instance is clone
    assert copy.copy(draft_loop(_eager_draft)) is not None and pickle.loads(pickle.dumps(_KvModule.draft)) is _KvModule.draft


class _AttributeWorker(torch.nn.Module):
    """Drafts kept as instance attributes, bound when made: a method's and a module's."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, 16).requires_grad_(False)
        self.fast = draft_loop(self.step)
        self.fast_head = draft_loop(self.head)

    def step(self, h):
        return torch.softmax(self.head(h), -1).argmax(-1)


def test_drafts_kept_as_attributes_are_bound_to_the_copy_or_the_loaded_worker():
    """Pickling a worker that keeps draft_loop(self.step) as an attribute loaded it as None (first version of the
    pickling support); copy.deepcopy(worker.fast) called directly made two drafts for the copy."""
    import copy
    import pickle

    original, h = _AttributeWorker(), torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    original.fast(h), original.fast_head(h)
    loaded = pickle.loads(pickle.dumps(original))
    with torch.no_grad():
        loaded.head.weight.mul_(-1)
    assert loaded.fast._instance is loaded and loaded.fast_head._instance is loaded.head
    assert torch.equal(loaded.fast(h), loaded.step(h)) and torch.allclose(loaded.fast_head(h), loaded.head(h))
    assert torch.equal(original.fast(h), original.step(h))
    copied = copy.deepcopy(original.fast)
    assert copied._instance is not original and copied._instance.fast is copied


def test_equal_slotted_workers_each_get_their_own_draft():
    """Workers without __dict__ were looked up by their __eq__ and __hash__: two dataclass workers equal
    but for a KV cache field left out of the comparison shared one draft (the first one's cache written)."""
    import dataclasses

    @dataclasses.dataclass(frozen=True, slots=True, weakref_slot=True)
    class SlotWorker:
        head: torch.nn.Module
        kv: torch.Tensor = dataclasses.field(compare=False, hash=False)

        @draft_loop
        def draft(self, h):
            self.kv[0] = h[0]
            return self.head(h).argmax(-1)

    head = torch.nn.Linear(8, 16).requires_grad_(False)
    a, b = SlotWorker(head, torch.zeros(4, 8)), SlotWorker(head, torch.zeros(4, 8))
    assert a == b
    h = torch.randn(2, 8)
    a.draft(h)
    b.draft(h + 5)
    assert torch.equal(a.kv[0], h[0]) and torch.equal(b.kv[0], h[0] + 5)
    assert a.draft is not b.draft


def test_a_subclass_override_calling_super_stays_the_method():
    """A subclass overriding the decorated method and calling it through super(): the first super() lookup
    stored the bound draft under the method's name in the instance, and from the second call on it was
    found before the override, whose preprocessing was skipped."""

    class Scaled(_KvWorker):
        def draft(self, h):
            return super().draft(h * 2)

    worker, h = Scaled(0), torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        got, want = worker.draft(h), _eager_draft(worker, h * 2)
        assert torch.equal(got.indices, want.indices) and torch.allclose(got.values, want.values)
    assert type(worker).draft is Scaled.draft and worker.draft.__func__ is Scaled.draft


def test_a_draft_method_replaced_on_an_instance_is_the_replacement():
    worker = _KvWorker(0)
    worker.draft(torch.randn(2, 8))
    worker.draft = lambda h: "replaced"
    assert worker.draft(None) == "replaced"
    del worker.draft
    assert isinstance(worker.draft, DraftLoop) and worker.draft.compiles


def test_a_draft_under_two_names_is_replaced_under_one():
    """`run = propose` in the class body, as workers alias their entry points: `worker.propose = fn`
    replaced `worker.run` too (the replacement's key was the last name's); as for a plain method, only
    the name assigned changes, and both names find one bound draft (one compile)."""

    class Aliased(_KvWorker):
        run = _KvWorker.draft

    worker, h = Aliased(0), torch.randn(2, 8)
    assert worker.run is worker.draft
    worker.draft(h)
    worker.draft = lambda h: "replaced"
    assert worker.draft(None) == "replaced" and isinstance(worker.run, DraftLoop)
    assert torch.equal(worker.run(h).indices, _eager_draft(worker, h).indices)
    worker.run = lambda h: "run replaced"
    del worker.draft
    assert worker.run(None) == "run replaced" and len(worker.draft.compiles) == 1
    assert len(Aliased.run.compiles) == 0 and Aliased.run.__qualname__ == Aliased.draft.__qualname__


def test_a_late_assigned_draft_takes_a_replacement_and_a_decorated_override_keeps_one_draft():
    """`Cls.fast = draft_loop(Cls.step)` then `w.fast = fn` before any lookup: the replacement went under an
    empty key and was ignored. A subclass decorating its override and calling the base's through super():
    both drafts shared one key, and each lookup threw the other's away (a compile per call)."""

    class Late:
        def step(self, h):
            return h.argmax(-1)

    Late.fast = draft_loop(Late.step)
    late = Late()
    late.fast = lambda h: "replacement"
    assert late.fast(None) == "replacement"

    class Sub(_KvWorker):
        @draft_loop
        def draft(self, h):
            return torch.softmax(self.head(h * 2), -1).topk(2, -1)

        def base_draft(self, h):
            return super().draft(h)

    worker, h = Sub(0), torch.randn(2, 8)
    first, base = worker.draft, super(Sub, worker).draft
    for _ in range(3):
        got_base, got = worker.base_draft(h), worker.draft(h)
    assert worker.draft is first and super(Sub, worker).draft is base and first is not base
    assert len(first.compiles) == 1 and len(base.compiles) == 1
    assert torch.equal(got_base.indices, _eager_draft(worker, h).indices)
    assert torch.equal(got.indices, torch.softmax(worker.head(h * 2), -1).topk(2, -1).indices)


def test_bare_and_with_arguments():
    bare = draft_loop(draft)
    configured = draft_loop(mode="default", options={"probs": "ones"}, max_compiles=2)(draft)
    assert isinstance(bare, DraftLoop) and isinstance(configured, DraftLoop)
    assert bare.__name__ == "draft" and bare.__wrapped__ is draft
    assert configured._options.mode == "default" and configured._options.probs == "ones"
    with pytest.raises(ValueError, match="unknown option 'prob'"):
        draft_loop(options={"prob": "ones"})(draft)  # at decoration, not at the first call
    # zero_copy_outputs="no" turned zero-copy on (a truthy string); max_compiles=0 failed every first call
    for bad in ({"zero_copy_outputs": "no"}, {"max_compiles": 0}, {"max_compiles": "4"}, {"max_compiles": 2.5}):
        with pytest.raises(ValueError, match=f"draft_loop\\({next(iter(bad))}="):
            draft_loop(draft, **bad)
    # torch's RuntimeError("Unrecognized mode=fast") and AssertionError("A callable function is expected");
    # a class was taken as the draft, its constructor compiled (helper-67)
    with pytest.raises(ValueError, match="mode='fast': pass one of 'default', .*'reduce-overhead'"):
        draft_loop(draft, mode="fast")
    with pytest.raises(TypeError, match="draft_loop\\(42\\): pass the draft function"):
        draft_loop(42)
    with pytest.raises(TypeError, match="draft_loop\\(Linear\\): a class; decorate an instance"):
        draft_loop(torch.nn.Linear)
    with pytest.raises(TypeError, match="draft_loop\\(DraftLoop\\): a class; decorate the method"):
        draft_loop(max_compiles=2)(DraftLoop)


def test_a_mode_without_post_grad_passes_says_so(caplog):
    """mode="lite" turns Inductor's post-grad passes off, draftfuse's with them: the log blamed a cache hit."""
    import logging

    def greedy(x):
        return torch.softmax(x, -1).argmax(-1)

    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="draftfuse"):
        draft_loop(greedy, mode=None, options={"use_post_grad_passes": False})(torch.randn(2, 8))
    assert "use_post_grad_passes is off" in caplog.text and "cache hit" not in caplog.text


def test_dynamic_shapes_with_float_symbols_compile():
    # Under dynamic=True Dynamo makes symbols of Python floats (an argument, nn.Embedding's norm_type):
    # the proofs' int64 bound on every ShapeEnv symbol asserted on them (an InductorError on the first call)
    embed = torch.nn.Embedding(8, 8)

    def f(tokens, temperature: float):
        probs, index = torch.softmax(embed(tokens) / temperature, -1).topk(1, -1)
        return index, probs

    compiled = draft_loop(f, dynamic=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for tokens, temperature in [([1, 2], 0.7), ([1, 2, 3], 0.7), ([4], 0.9)]:
            tokens = torch.tensor(tokens)
            got, want = compiled(tokens, temperature), f(tokens, temperature)
            assert torch.equal(got[0], want[0])
            torch.testing.assert_close(got[1], want[1])


def test_a_draft_called_inside_another_is_traced_there():
    # a draft worker's step calling another draft (a head, a sampler) compiles as one region
    inner = draft_loop(lambda x: torch.softmax(x, -1).topk(2, -1))

    def outer_fn(x):
        probs, index = inner(x * 2)
        return index, probs

    outer = draft_loop(outer_fn)
    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            got = outer(x)
    want = torch.softmax(x * 2, -1).topk(2, -1)
    assert torch.equal(got[0], want.indices) and torch.allclose(got[1], want.values)
    assert outer._replays and len(outer.compiles) == 1 and not inner.compiles


def test_a_draft_given_a_second_name_after_the_class_was_made_refuses_a_replacement():
    """`Cls.run = Cls.draft` after the class was made puts one descriptor under two names (no __set_name__
    tells them apart): `worker.run = fn` replaced `worker.draft` too, silently. It raises now, naming both
    and the fix; the names still find one draft."""

    class Late(_KvWorker):
        pass

    Late.run = Late.draft
    Late.alias = Late.draft  # a name that sorts before the draft's
    worker, h = Late(0), torch.randn(2, 8)
    assert worker.run is worker.draft
    with pytest.raises(AttributeError, match=r"'draft' or 'alias' alone.*class body \(alias = draft\)"):
        worker.run = lambda h: "replaced"
    assert torch.equal(worker.draft(h).indices, _eager_draft(worker, h).indices)


def test_a_draft_method_first_looked_up_inside_a_compiled_region_is_traced_there():
    """A server compiling the code that calls `worker.draft(...)`: the first lookup made the bound draft
    inside the trace (inspect and a compile set up there), a graph break ("Attempted to call function
    marked as skipped") under fullgraph=True. Inside a trace the lookup gives the method, traced inline as
    the draft's call is; nothing is kept, and the first eager lookup makes the worker's draft."""
    worker, h = _KvWorker(0), torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    outer = torch.compile(lambda h: worker.draft(h + 1), fullgraph=True, backend="eager")
    with torch.no_grad():
        got = outer(h)
    assert torch.equal(worker.kv[0], (h + 1)[0])  # its write done
    want = _eager_draft(worker, h + 1)
    assert torch.equal(got.indices, want.indices) and torch.allclose(got.values, want.values)
    assert not [k for k in vars(worker) if k.startswith("_draftfuse_")]
    assert isinstance(worker.draft, DraftLoop) and torch.equal(worker.draft(h).indices, _eager_draft(worker, h).indices)


def test_a_compile_in_another_thread_leaves_a_compiled_draft_compiled():
    """torch.compiler.is_compiling() is one flag for the process, set for the whole of any compile: a
    server thread compiling anything made every other thread's draft calls run the draft's Python eagerly
    (no passes, autograd on), silently (helper-67). Only Dynamo's own trace of the call inlines it now."""
    draft = draft_loop(lambda x: torch.softmax(x * 2, -1).topk(1, -1))
    x = torch.randn(3, 8, requires_grad=True)  # eager's outputs would require grad; the draft runs without autograd
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            draft(x)
    compiling, done = threading.Event(), threading.Event()

    def held_backend(gm, example_inputs):  # another thread's compile, held open while this one calls the draft
        compiling.set()
        done.wait(60)
        return gm.forward

    other = threading.Thread(target=torch.compile(lambda y: y + 1, backend=held_backend), args=(torch.ones(2),))
    other.start()
    try:
        assert compiling.wait(60)
        # the flag this thread sees, though it compiles nothing (torch 2.13; 2.11 sets it only in export)
        assert torch.compiler.is_compiling() or torch.torch_version.TorchVersion(torch.__version__) < "2.13"
        probs, index = draft(x)
    finally:
        done.set()
        other.join()
    assert torch.equal(index, torch.softmax(x * 2, -1).argmax(-1, keepdim=True))
    assert not probs.requires_grad and len(draft.compiles) == 1  # the compiled draft's, not eager's
