"""draft_loop's fast path (draftfuse/runtime/replay.py): after two calls a draft replays without Dynamo,
and every change that would make the recording wrong sends the call back through Dynamo (which
recompiles, or raises) instead of replaying stale work.

On a CPU the "replay" calls the compiled region on the recorded static tensors and the call's own
tensors: the guards, the lookups of the arguments and the rebuilt return values are the same code as
on CUDA, where a CUDA graph replays (tests/test_runtime_cuda.py).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

import draftfuse
from draftfuse.runtime.errors import CudagraphSkipError

pytestmark = [pytest.mark.filterwarnings("ignore:draftfuse. draft .* runs on the CPU"), pytest.mark.usefixtures("fresh_dynamo")]


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.scale = 1.0  # a Python attribute the draft reads (Dynamo specialises on it)

    def forward(self, hidden):
        hidden = torch.tanh(self.proj(hidden)) * self.scale
        return self.lm_head(hidden), hidden


def draft(head, hidden, cache, position, steps: int = 3):
    tokens = []
    for step in range(steps):
        logits, hidden = head(hidden)
        cache.index_copy_(0, position + step, hidden[:1])
        tokens.append(torch.softmax(logits, -1).argmax(-1))
    return torch.stack(tokens, 1), hidden, steps


def make():
    torch.manual_seed(0)
    head = Head().requires_grad_(False)
    return head, torch.randn(2, 8), torch.zeros(6, 8), torch.tensor([0])


def recorder_calls(compiled):
    """Calls of the compiled regions through Dynamo (the fast path calls none)."""
    return sum(entry[0].calls for entry in compiled._recorders)


def warmed(compiled, *args):
    for _ in range(2):  # compile + warm-up, then record
        compiled(*args)
    assert compiled._replays, "a replay is recorded after the second call"
    return compiled


def check_same(compiled, head, hidden, cache, position):
    want_cache = cache.clone()
    want = draft(head, hidden, want_cache, position)
    got = compiled(head, hidden, cache, position)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1]) and got[2] == want[2]
    assert torch.allclose(cache, want_cache)
    return got


def test_replays_without_dynamo_and_matches_eager():
    head, hidden, cache, position = make()
    compiled = warmed(draftfuse.draft_loop(draft), head, hidden, cache, position)
    calls = recorder_calls(compiled)
    for _ in range(3):
        hidden = torch.randn(2, 8)  # new tensors every call: found from the arguments
        got = check_same(compiled, head, hidden, cache, position)
    assert recorder_calls(compiled) == calls, "the calls went around Dynamo"
    assert len(compiled.compiles) == 1
    kept = got[0]
    compiled(head, torch.randn(2, 8), cache, position)
    assert kept.data_ptr() != compiled(head, hidden, cache, position)[0].data_ptr(), "outputs are copies"


def test_a_batch_size_called_again_checks_its_own_replay_first(monkeypatch):
    """A server calls one draft at many batch sizes, each with a Replay; they were tried newest first,
    so every call at the oldest size paid a failed guard check for each newer one (~4 us each)."""
    from draftfuse.runtime.replay import Replay

    head, _, cache, position = make()
    compiled = draftfuse.draft_loop(draft, max_compiles=4)
    batches = [torch.randn(n, 8) for n in (1, 2, 3, 4)]
    for hidden in batches:
        warmed(compiled, head, hidden, cache, position)
    checks = []
    matches = Replay.matches
    monkeypatch.setattr(Replay, "matches", lambda self, *a: checks.append(self) or matches(self, *a))
    for _ in range(3):
        check_same(compiled, head, batches[0], cache, position)  # the oldest size, three times
    assert len(checks) == 4 + 1 + 1, len(checks)  # a scan on the first call, then its own Replay first
    checks.clear()
    check_same(compiled, head, batches[3], cache, position)
    assert len(checks) == 2, len(checks)


@pytest.mark.parametrize("change", ["python attribute", "weight replaced", "weight storage swapped", "shape"])
def test_a_change_that_would_make_the_recording_wrong_goes_through_dynamo(change):
    head, hidden, cache, position = make()
    compiled = warmed(draftfuse.draft_loop(draft), head, hidden, cache, position)
    if change == "python attribute":
        head.scale = 0.5
    elif change == "weight replaced":
        head.proj.weight = nn.Parameter(torch.randn(8, 8), requires_grad=False)
    elif change == "weight storage swapped":
        head.proj.weight.data = torch.randn(8, 8)
    else:
        hidden = torch.randn(3, 8)
    calls = recorder_calls(compiled)
    check_same(compiled, head, hidden, cache, position)
    assert recorder_calls(compiled) > calls, "the call went through Dynamo"
    for _ in range(2):  # and is recorded again
        check_same(compiled, head, hidden, cache, position)


class _Activated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def act(self, x):
        return torch.tanh(x)

    def forward(self, x):
        return self.act(self.lin(x))


def _activated_draft(head, x):
    logits = head(x)
    return torch.softmax(logits, -1).argmax(-1), logits


def test_after_dynamo_reset_a_draft_compiles_again_and_frees_its_recordings(monkeypatch):
    """torch._dynamo.reset() is how a draft sees what Dynamo does not guard (a method patched on the class).
    The Replays kept their guard managers, whose guards still passed after the reset: the draft replayed the
    old method, and held its recordings (on CUDA their graphs and pools) for good."""
    import gc
    import weakref

    torch.manual_seed(0)
    head, x = _Activated().requires_grad_(False), torch.randn(3, 8)
    compiled = draftfuse.draft_loop(_activated_draft)
    for _ in range(3):
        compiled(head, x)
    assert compiled._replays
    recorded = weakref.ref(compiled._recorders[0][0])
    monkeypatch.setattr(_Activated, "act", lambda self, x: x * 100.0)
    torch._dynamo.reset()
    for _ in range(3):  # compiled anew, then recorded and replayed
        got, want = compiled(head, x), _activated_draft(head, x)
        assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])
    assert len(compiled.compiles) == 2 and compiled._replays
    gc.collect()
    assert recorded() is None, "the recordings of the reset compile are freed (at the draft's next call)"
    assert len(compiled._recorders) == 1


def test_after_dynamo_reset_the_compile_budget_starts_again():
    """The compiles counted before a reset stayed counted: a draft at max_compiles raised RecompileError for a
    size it had compiled before."""
    head, x = _Activated().requires_grad_(False), torch.randn(3, 8)
    compiled = draftfuse.draft_loop(_activated_draft, max_compiles=2)
    for batch in (3, 2):
        compiled(head, x[:batch])
    torch._dynamo.reset()
    for batch in (3, 2):
        got, want = compiled(head, x[:batch]), _activated_draft(head, x[:batch])
        assert torch.equal(got[0], want[0])


class Stack(nn.Module):
    """Layers in a ModuleList, each with a KV cache buffer it writes: Dynamo guards these through its
    dict entries (the identity guards draftfuse adds must reach them)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        for layer in self.layers:
            layer.register_buffer("cache", torch.zeros(6, 8))
            layer.scale = 1.0


def stack_draft(stack, hidden, position):
    tokens = []
    for step in range(2):
        for layer in stack.layers:
            hidden = torch.tanh(layer(hidden)) * layer.scale
            layer.cache.index_copy_(0, position + step, hidden[:1])
        tokens.append(torch.softmax(hidden, -1).argmax(-1))
    return torch.stack(tokens, 1), hidden


@pytest.mark.parametrize("change", ["attribute", "weight replaced", "weight storage swapped", "layer replaced", "nothing"])
def test_a_change_inside_a_module_list_goes_through_dynamo(change):
    torch.manual_seed(0)
    stack, hidden, position = Stack().requires_grad_(False), torch.randn(2, 8), torch.tensor([1])
    compiled = warmed(draftfuse.draft_loop(stack_draft), stack, hidden, position)
    if change == "attribute":
        stack.layers[1].scale = 0.5
    elif change == "weight replaced":
        stack.layers[1].weight = nn.Parameter(torch.randn(8, 8), requires_grad=False)
    elif change == "weight storage swapped":
        stack.layers[0].weight.data = torch.randn(8, 8)
    elif change == "layer replaced":
        layer = nn.Linear(8, 8).requires_grad_(False)
        layer.register_buffer("cache", stack.layers[1].cache)
        layer.scale = 1.0
        stack.layers[1] = layer
    calls = recorder_calls(compiled)
    for _ in range(3):  # through Dynamo when something changed, then recorded again
        caches = [layer.cache.clone() for layer in stack.layers]
        want = stack_draft(stack, hidden, position)
        want_caches = [layer.cache.clone() for layer in stack.layers]
        for layer, cache in zip(stack.layers, caches):
            layer.cache.copy_(cache)
        got = compiled(stack, hidden, position)
        assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])
        assert all(torch.allclose(layer.cache, c) for layer, c in zip(stack.layers, want_caches))
        if change != "nothing" and _ == 0:
            assert recorder_calls(compiled) > calls, "the call went through Dynamo"
    if change == "nothing":
        assert recorder_calls(compiled) == calls, "nothing changed: every call replayed without Dynamo"
        # the weights' identities are guards in Dynamo's tree (under its dict entries); only the caches are checked by source
        names = compiled._replays[0].checked_by_source
        assert len(names) == 2 and all(name.endswith("['cache']") for name in names), names


def test_another_kv_buffer_in_a_module_list_raises_and_the_call_holds_nothing():
    import weakref

    torch.manual_seed(0)
    stack, hidden, position = Stack().requires_grad_(False), torch.randn(2, 8), torch.tensor([1])
    compiled = warmed(draftfuse.draft_loop(stack_draft), stack, hidden, position)
    cache, other = stack.layers[1].cache, torch.zeros(6, 8)
    stack.layers[1].cache = other  # a buffer the draft writes, replaced
    with pytest.raises(CudagraphSkipError, match="written in place"):
        compiled(stack, hidden, position)
    stack.layers[1].cache = cache
    gone = weakref.ref(other)
    del other
    assert gone() is None, "the call that raised holds none of its tensors"
    calls = recorder_calls(compiled)
    compiled(stack, hidden, position)
    assert recorder_calls(compiled) == calls, "the recording replays again"


def test_a_moved_kv_cache_raises():
    head, hidden, cache, position = make()
    compiled = warmed(draftfuse.draft_loop(draft), head, hidden, cache, position)
    with pytest.raises(CudagraphSkipError, match="'cache' is written in place"):
        compiled(head, hidden, torch.zeros(6, 8), position)
    # the call that raised left the recording as it was: the right cache replays it, without Dynamo
    recorder = compiled._recorders[0][0]
    assert recorder.captured
    calls = recorder_calls(compiled)
    check_same(compiled, head, hidden, cache, position)
    assert recorder_calls(compiled) == calls


def test_weights_loaded_in_place_replay_without_dynamo():
    head, hidden, cache, position = make()
    compiled = warmed(draftfuse.draft_loop(draft), head, hidden, cache, position)
    calls = recorder_calls(compiled)
    head.proj.weight.copy_(torch.randn(8, 8))  # new weights, loaded into the same tensor
    check_same(compiled, head, hidden, cache, position)
    assert recorder_calls(compiled) == calls and len(compiled.compiles) == 1


def test_after_a_weight_moved_the_draft_is_recorded_again_and_replays():
    head, hidden, cache, position = make()
    compiled = warmed(draftfuse.draft_loop(draft), head, hidden, cache, position)
    head.proj.weight.data = torch.randn(8, 8)
    for _ in range(3):  # through Dynamo (the weight moved), warm-up, record
        check_same(compiled, head, hidden, cache, position)
    calls = recorder_calls(compiled)
    check_same(compiled, head, hidden, cache, position)
    assert recorder_calls(compiled) == calls, "the new recording replays without Dynamo"
    assert len(compiled._replays) == 1, "the replay of the old recording is dropped"
    assert len(compiled.compiles) == 1, "p.data = ... records again without a compile"


def test_new_parameter_objects_past_max_compiles_say_to_load_weights_in_place():
    """Each new Parameter object costs a compile (the recording reads the old one's memory); past max_compiles
    the error said to "keep shapes and Python arguments the same", which no argument had changed."""
    head, hidden, cache, position = make()
    compiled = warmed(draftfuse.draft_loop(draft, max_compiles=2), head, hidden, cache, position)
    head.proj.weight = nn.Parameter(torch.randn(8, 8), requires_grad=False)
    for _ in range(3):  # compile 2, warm-up, record (its Replay guards the new weight's identity)
        check_same(compiled, head, hidden, cache, position)
    head.proj.weight = nn.Parameter(torch.randn(8, 8), requires_grad=False)
    with pytest.raises(draftfuse.RecompileError) as raised:
        compiled(head, hidden, cache, position)
    assert "the tensor the recorded graph reads" in str(raised.value)
    assert "p.copy_(w)" in str(raised.value) and "keep shapes" not in str(raised.value)


def test_the_overlap_check_is_the_one_of_the_compile_replayed():
    @draftfuse.draft_loop
    def step(x, kv):
        kv.add_(1)
        return x * 2 + kv.sum()

    kv4, kv8 = torch.zeros(4), torch.zeros(8)
    for _ in range(3):
        step(torch.ones(4), kv4)
    for _ in range(3):
        step(torch.ones(8), kv8)  # a second compile, writing another cache
    # a view of the second compile's cache does not overlap what the first compile writes
    want = kv8[:4] * 2 + (kv4.sum() + 4)
    assert torch.equal(step(kv8[:4], kv4), want)
    with pytest.raises(draftfuse.DraftCaptureError, match="shares memory with an input the draft writes"):
        step(kv4[:4], kv4)


def test_a_returned_argument_tensor_is_the_argument_on_every_path():
    @draftfuse.draft_loop
    def step(x, caches):
        caches[0].add_(x)
        return x * 2, caches[0]

    caches = [torch.zeros(4), torch.zeros(4)]
    for call in range(4):  # through Dynamo (compile, warm-up, record), then replayed
        _, returned = step(torch.ones(4), caches)
        assert returned is caches[0], f"call {call}"

    @draftfuse.draft_loop
    def whole(x, caches):
        caches[0].add_(x)
        return x * 2, caches

    for call in range(4):
        listed = list(caches)  # a new list of the same caches each call
        _, returned = whole(torch.ones(4), listed)
        assert returned is listed, f"call {call}: the caller's own list, as eager returns it"
    assert step._replays


def test_an_argument_sharing_the_written_cache_raises():
    head, hidden, cache, position = make()
    compiled = warmed(draftfuse.draft_loop(draft), head, hidden, cache, position)
    with pytest.raises(draftfuse.DraftCaptureError, match="shares memory with an input the draft writes") as raised:
        compiled(head, cache[:2], cache, position)
    assert "input 'hidden' shares memory with an input the draft writes in place ('cache')" in str(raised.value)  # both named


def test_the_overlap_check_runs_for_inputs_not_read_in_place():
    # On CUDA the recording reads the capture call's own input tensors; a call passing those same tensors
    # skips the overlap check (checked when recorded), any other tensor is still checked before the replay.
    head, hidden, cache, position = make()
    compiled = warmed(draftfuse.draft_loop(draft), head, hidden, cache, position)
    recorder, replay = compiled._recorders[0][0], compiled._replays[0]
    f_locals = compiled._bind((head, hidden, cache, position), {})
    recorder.in_place, recorder.in_place_pointers = True, [fetch(f_locals).data_ptr() for fetch in replay.fetchers]
    calls = recorder_calls(compiled)
    check_same(compiled, head, hidden, cache, position)
    with pytest.raises(draftfuse.DraftCaptureError, match="shares memory with an input the draft writes"):
        compiled(head, cache[:2], cache, position)
    assert recorder_calls(compiled) == calls, "both calls took the fast path"


def test_every_kind_of_parameter_binds_on_the_fast_path():
    def kinds(head, hidden, /, cache, *extra, position, steps=3, **options):
        out = draft(head, hidden, cache, position, steps=steps)[0]
        return out * options.get("gain", 1.0) + sum(extra)

    compiled = draftfuse.draft_loop(kinds)
    head, hidden, cache, position = make()
    for call in range(5):
        got = compiled(head, hidden, cache, 1.0, position=position, gain=2.0) if call % 2 else compiled(head, hidden, cache, 1.0, position=position, steps=3, gain=2.0)
        want = kinds(head, hidden, cache.clone(), 1.0, position=position, gain=2.0)
        torch.testing.assert_close(got, want)
    assert compiled._replays and len(compiled.compiles) == 1
    calls = recorder_calls(compiled)
    compiled(head, hidden, cache, 1.0, position=position, gain=2.0)
    assert recorder_calls(compiled) == calls, "replayed without Dynamo"
    assert compiled._bind((head,), {}) is None, "a call that does not bind goes through Dynamo (which raises for it)"


def _wrapped(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)

    return wrapper


_TORCH_2_13 = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)
_INFERENCE_MODE = pytest.param(torch.inference_mode(), id="inference_mode", marks=pytest.mark.skipif(
    not _TORCH_2_13, reason="torch 2.11's AOT autograd fails on this draft under inference_mode (aot_eager and inductor alike)"))


@pytest.mark.parametrize("decorate", [pytest.param(_wrapped, id="functools.wraps"), pytest.param(torch.no_grad(), id="no_grad"), _INFERENCE_MODE])
def test_decorated_drafts_replay_without_dynamo(decorate):
    # Public workers decorate their draft methods (`@torch.inference_mode()` on a proposer's step);
    # torch.compile runs a function defined in a file Dynamo skips (torch's decorator wrappers) inside a
    # wrapper frame shared by all, and functools.wraps shows a signature that is not the frame's.
    class Worker(nn.Module):
        def __init__(self):
            super().__init__()
            self.head, self.hidden, self.cache, self.position = make()

        @draftfuse.draft_loop
        @decorate
        def step(self, hidden, steps=2):
            return draft(self.head, hidden, self.cache, self.position, steps=steps)

    worker = Worker()
    hidden = torch.randn(2, 8)
    for _ in range(3):
        worker.step(hidden)
    compiled = worker.step
    assert compiled._replays, "the draft replays without Dynamo"
    calls = recorder_calls(compiled)
    cache_before = worker.cache.clone()
    got = compiled(hidden)
    assert recorder_calls(compiled) == calls
    with torch.no_grad():
        want = draft(worker.head, hidden, cache_before, worker.position, steps=2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class _Stepper(nn.Module):
    def __init__(self):
        super().__init__()
        self.head, _, self.cache, self.position = make()

    def forward(self, hidden, steps: int = 2):
        return draft(self.head, hidden, self.cache, self.position, steps=steps)[:2]

    def step(self, hidden):
        return self(hidden, steps=3)


@pytest.mark.parametrize("which", ["module", "bound method"])
def test_a_module_and_a_bound_method_replay_without_dynamo(which):
    model, hidden = _Stepper(), torch.randn(2, 8)
    eager = model if which == "module" else model.step
    compiled = draftfuse.draft_loop(eager)
    for _ in range(3):
        compiled(hidden)
    assert compiled._replays
    calls, cache = recorder_calls(compiled), model.cache.clone()
    got = compiled(hidden)
    assert recorder_calls(compiled) == calls, "replayed without Dynamo"
    model.cache.copy_(cache)
    with torch.no_grad():
        want = eager(hidden)
    # Inductor's CPU kernels against eager's: the tokens equal, the float outputs within rounding (on this
    # project's CPU machine one element of the three-step chain differed by one float32 ulp)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_hooks_added_to_a_module_draft_after_its_first_call_are_run():
    """draft_loop(module) traces the module's hooks into the region, and Dynamo guards none: a hook registered
    (or removed) after the first call was not run, by a replay or through Dynamo. Its own hooks and the global
    module hooks are checked on every call now; a change compiles the draft anew, which then replays again."""
    from torch.nn.modules.module import register_module_forward_hook

    model, hidden = _Stepper(), torch.randn(2, 8)
    compiled = draftfuse.draft_loop(model, max_compiles=7)

    def check(compiles: int) -> None:
        cache = model.cache.clone()
        got = compiled(hidden)
        model.cache.copy_(cache)
        with torch.no_grad():
            want = model(hidden)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
        assert len(compiled.compiles) == compiles

    for _ in range(3):
        check(1)
    assert compiled._replays
    changes = [
        lambda: model.register_forward_hook(lambda module, args, out: (out[0], out[1] * -2.0)),
        lambda: model.register_forward_pre_hook(lambda module, args: (args[0] + 1.0,)),
        lambda: register_module_forward_hook(lambda module, args, out: out * 0.5 if module is model.head.proj else out),
    ]
    compiles = 1
    for change in changes:
        handle = change()
        compiles += 1
        for _ in range(3):
            check(compiles)
        assert compiled._replays, "the draft compiled anew replays without Dynamo again"
        handle.remove()
        compiles += 1
        for _ in range(3):
            check(compiles)
    model.register_forward_hook(lambda module, args, out: out).remove()  # added and removed between calls: the same hooks
    check(compiles)
    # each change is a compile, counted against max_compiles (a hook added and removed around every call is no
    # reason to compile without end)
    handle = model.register_forward_hook(lambda module, args, out: out)
    with pytest.raises(draftfuse.RecompileError, match="needs compile number 8") as raised:
        compiled(hidden)
    assert "hook of the draft module" in str(raised.value) and "register the draft module's hooks before" in str(raised.value)
    handle.remove()


def test_a_returned_argument_object_is_the_call_s_own():
    # Servers pass a metadata object rebuilt every step (positions, seq_lens) and some drafts hand it back:
    # the fast path returned the object of the call it was recorded from (found by probing such patterns).
    class Meta:
        def __init__(self, positions):
            self.positions = positions

    @draftfuse.draft_loop
    def step(x, meta, extra):
        return torch.softmax(x + meta.positions, -1).argmax(-1), meta, extra[0]

    x = torch.randn(2, 3)
    for i in range(5):
        meta, extra = Meta(torch.full((3,), float(i))), [object()]
        tokens, returned, first = step(x, meta, extra)
        assert returned is meta and first is extra[0], f"call {i}"
        assert torch.equal(tokens, torch.softmax(x + meta.positions, -1).argmax(-1))
    assert step._replays, "the calls after the recording replayed without Dynamo"


def test_python_values_passed_through_are_the_call_s_own():
    # Dynamo guards nothing on a value it only returns: a recorded constant would be stale
    @draftfuse.draft_loop
    def step(x, n, cfg=None):
        return torch.softmax(x, -1).argmax(-1), n, cfg

    x = torch.randn(2, 3)
    for n, cfg in [(1, None), (1, None), (1, None), (2, "tag"), (7, [1, 2]), (1, None), ("s", None)]:
        tokens, got_n, got_cfg = step(x, n, cfg)
        assert got_n == n and got_cfg == cfg, (n, cfg, got_n, got_cfg)
        assert torch.equal(tokens, torch.softmax(x, -1).argmax(-1))


def test_a_written_buffer_passed_as_a_new_view_each_call_replays():
    # Servers pass `buf[:n]` every step: a new view object of the same memory is the same input
    @draftfuse.draft_loop
    def step(h, out):
        out[:, 0] = torch.softmax(h, -1).argmax(-1)
        return out

    buf, want = torch.zeros(8, 4, dtype=torch.long), torch.zeros(8, 4, dtype=torch.long)
    for i in range(5):
        h = torch.randn(3, 16)
        view = buf[:3]
        returned = step(h, view)
        want[:3, 0] = torch.softmax(h, -1).argmax(-1)
        assert torch.equal(buf, want) and returned is view, f"call {i}"
    calls = recorder_calls(step)
    step(torch.randn(3, 16), buf[:3])
    assert recorder_calls(step) == calls, "replayed without Dynamo"
    with pytest.raises(CudagraphSkipError, match="'out' is written in place"):
        step(torch.randn(3, 16), buf[1:4])  # other memory


def test_a_plain_tensor_attribute_replaced_each_call_is_read_per_call():
    # Medusa-style: `model.medusa_mask = mask` every step. Dynamo marks a module's plain tensor attribute
    # static; draftfuse guarded its identity as a weight's, so each new mask compiled again (RecompileError
    # at the fifth), where torch.compile compiles once.
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 32)
            self.mask = torch.zeros(3, 16)

        def forward(self, x):
            return torch.softmax(self.proj(x + self.mask), -1).topk(2, -1).indices

    model = Heads().requires_grad_(False)
    compiled = draftfuse.draft_loop(model)
    for i in range(8):
        model.mask = torch.randn(3, 16)
        x = torch.randn(3, 16)
        assert torch.equal(compiled(x), model(x)), f"call {i}"
    assert len(compiled.compiles) == 1 and compiled._replays
    calls = recorder_calls(compiled)
    model.mask = torch.randn(3, 16)
    compiled(x)
    assert recorder_calls(compiled) == calls, "replayed without Dynamo"


def test_a_draft_with_a_side_effect_stays_on_the_dynamo_path():
    class Recorder(nn.Module):
        def forward(self, x):
            self.last = x  # an attribute store: Dynamo's code replays it after the graph
            return x * 2

    module = Recorder()
    compiled = draftfuse.draft_loop(lambda m, x: m(x))
    with pytest.warns(UserWarning, match="no fast replay for this draft: Dynamo's code for the draft does more") as said:
        for _ in range(3):
            x = torch.randn(3)
            assert torch.equal(compiled(module, x), x * 2)
            assert module.last is x
    assert not compiled._replays
    assert [w.filename for w in said if "fast replay" in str(w.message)] == [__file__]  # points at the caller


def test_methods_and_keyword_arguments_replay():
    class Worker:
        def __init__(self):
            self.head, self.hidden, self.cache, self.position = make()

        @draftfuse.draft_loop
        def step(self, hidden, *, steps: int = 2):
            return draft(self.head, hidden, self.cache, self.position, steps=steps)[0]

    worker = Worker()
    hidden = torch.randn(2, 8)
    for _ in range(3):
        got = worker.step(hidden, steps=2)
    assert worker.step._replays
    want = draft(worker.head, hidden, worker.cache.clone(), worker.position, steps=2)[0]
    assert torch.equal(got, want)


def test_weights_dynamo_guards_by_module_are_checked_too():
    # Dynamo guards some parameters through their module (a dict tag) rather than a guard of their own:
    # the fast path checks those tensors itself. The examples' draft model has RMSNorm weights so guarded.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import draft_model
    from _layers import SIZES

    torch.manual_seed(0)
    model = draft_model.DraftModel(SIZES["tiny"], 2).requires_grad_(False)
    token, pos = torch.randint(0, SIZES["tiny"].vocab, (2, 1)), torch.tensor([3])
    compiled = draftfuse.draft_loop(draft_model.draft)
    for _ in range(3):
        compiled(model, token, pos, steps=2)
    assert compiled._replays
    norm = model.layers[0].attn_norm
    norm.weight = nn.Parameter(torch.rand_like(norm.weight) + 0.5, requires_grad=False)
    calls = recorder_calls(compiled)
    caches = [(layer.attn.k_cache.clone(), layer.attn.v_cache.clone()) for layer in model.layers]
    got = compiled(model, token, pos, steps=2)
    for layer, (k, v) in zip(model.layers, caches):  # eager writes the same cache slots again
        layer.attn.k_cache.copy_(k), layer.attn.v_cache.copy_(v)
    want = draft_model.draft(model, token, pos, steps=2)
    assert recorder_calls(compiled) > calls, "the replaced weight sent the call through Dynamo"
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])


def test_dynamic_shapes_record_again_for_other_sizes():
    # draft_loop(dynamic=True): one compile serves every batch size; the recording is of one size at a time
    # (it used to replay the first size's recording with the capture call's sizes: a crash or a wrong copy).
    def greedy(head, hidden):
        logits, hidden = head(hidden)
        return torch.softmax(logits, -1).argmax(-1), hidden

    head = Head()
    compiled = draftfuse.draft_loop(greedy, dynamic=True)
    with torch.no_grad():
        for batch in (4, 4, 4, 6, 6, 6, 3, 4, 4, 4):
            hidden = torch.randn(batch, 8)
            tokens, out = compiled(head, hidden)
            want_tokens, want = greedy(head, hidden)
            assert torch.equal(tokens, want_tokens) and tokens.shape == (batch,)
            torch.testing.assert_close(out, want)
    assert len(compiled.compiles) <= 2  # the sizes are symbolic (one compile; the first size may be specialised)
    recorder = next(r for r, _ in compiled._recorders if r.calls)
    shapes = [tuple(size[0]) for size in recorder.sizes if isinstance(size, tuple)]
    assert recorder.captured and (4, 8) in shapes and (3, 8) not in shapes  # recorded again for batch 4 at the end


class _Request:
    def __init__(self, first: bool) -> None:
        self.first = first  # a request's first draft step (its worker clears it)


def _first_step_once(x, request):
    if request.first:
        request.first = False  # a store: this entry's calls stay on the Dynamo path
        return (x * 10).argmax(-1)
    return (x * -1).argmax(-1)


def test_a_replay_pairs_the_entry_that_ran_with_its_recording():
    """A draft that clears a flag its guards read runs the flag's entry, and after the call its arguments
    pass the other entry's guards: the Replay must not pair those guards with this call's recording."""
    compiled = draftfuse.draft_loop(_first_step_once)
    x = torch.tensor([[1.0, 2.0, 3.0]])
    for flag in [True, False, False, True, False, False, True, False]:
        assert compiled(x, _Request(flag)).item() == _first_step_once(x, _Request(flag)).item(), flag


def test_a_store_to_an_enclosing_function_s_variable_is_not_skipped():
    """A worker keeping its last hidden state in a closure variable (`nonlocal`): Dynamo's code stores it
    after the graph, so the draft has a side effect and keeps to the Dynamo path."""
    last = {}

    def make_worker():
        last_hidden = None

        def step(hidden, w):
            nonlocal last_hidden
            out = torch.tanh(hidden @ w)
            last_hidden = out
            return torch.softmax(out, -1).argmax(-1)

        last["read"] = lambda: last_hidden
        return step

    compiled = draftfuse.draft_loop(make_worker())
    w = torch.randn(8, 8)
    for _ in range(4):
        hidden = torch.randn(2, 8)
        compiled(hidden, w)
        assert torch.allclose(last["read"](), torch.tanh(hidden @ w))
    assert not compiled._replays


def _nested_value(x, cfg, batch):
    return (x * 2).argmax(-1), cfg["meta"]["num_tokens"], batch[1][0]


def test_a_value_returned_from_inside_nested_arguments_is_the_call_s_own():
    """Dynamo returns cfg["meta"]["num_tokens"] as it finds it, with no guard on it: a replay returns the
    call's value too, not the recorded call's as a constant."""
    compiled = draftfuse.draft_loop(_nested_value)
    x = torch.randn(2, 5)
    for n in [4, 4, 4, 7, 9]:
        _, num_tokens, first = compiled(x, {"meta": {"num_tokens": n}}, [x, (n + 1,)])
        assert (num_tokens, first) == (n, n + 1)


class _Bias:
    def __init__(self, value) -> None:
        self.bias = value


def _attribute_value(x, state, meta):
    return x + state.bias, meta.bias  # one name: a graph input's attribute, and a Python value returned


def test_an_attribute_returned_as_found_is_the_call_s_own():
    """Dynamo reads meta.bias anew on each call to return it (no guard on it); the read shares its name
    with a graph input's source (state.bias), which must not let the draft replay it as a constant."""
    compiled = draftfuse.draft_loop(_attribute_value)
    x, state = torch.randn(3), _Bias(torch.ones(3))
    for n in [4, 4, 4, 7, 9]:
        assert compiled(x, state, _Bias(n))[1] == n


@_wrapped
def _returns_its_default(hidden, tag=1000.5):
    return torch.softmax(hidden, -1).argmax(-1), tag  # tag only returned: no guard holds it


class _Sub:
    def __init__(self) -> None:
        self.sub = [torch.ones(3), 3]


def _returns_an_attribute_list(x, state):
    return x + state.sub[0], state.sub  # the list read on the way to a graph input, then returned


@pytest.mark.skipif(not _TORCH_2_13, reason="torch 2.11's Dynamo reads the wrapped function's default once, as a constant, and no guard holds it: plain torch.compile returns the old value too (README)")
def test_a_default_read_through_a_wrapper_is_the_call_s_own():
    """Dynamo's code reads fn.__defaults__[0] (through the decorator's closure) anew on each call to return
    it, and no guard holds its value: a replay would return the recorded call's. Such a draft stays on the
    Dynamo path (it says so), and returns what eager returns."""
    hidden = torch.randn(2, 8)
    saved = _returns_its_default.__wrapped__.__defaults__
    try:
        compiled = draftfuse.draft_loop(_returns_its_default)
        with pytest.warns(UserWarning, match="no guard holds"):
            for _ in range(3):
                compiled(hidden)
        _returns_its_default.__wrapped__.__defaults__ = (2000.5,)
        assert compiled(hidden)[1] == 2000.5 and not compiled._replays
    finally:
        _returns_its_default.__wrapped__.__defaults__ = saved


def test_an_attribute_read_anew_is_the_call_s_own():
    """state.sub is read on the way to a graph input and returned, and no guard holds the list: the draft
    stays on the Dynamo path (it says so), and returns what eager returns."""
    x, state = torch.randn(3), _Sub()
    compiled = draftfuse.draft_loop(_returns_an_attribute_list)
    with pytest.warns(UserWarning, match=r"state'\]\.sub that is no graph input's source and that no guard holds"):
        for _ in range(3):
            compiled(x, state)
    state.sub[1] = 4
    assert compiled(x, state)[1] == [state.sub[0], 4] and not compiled._replays


def _scaled_by_its_default(hidden, scale=2.0):
    return torch.tanh(hidden * scale), scale  # scale used: a guard holds it


def test_a_returned_default_that_a_guard_holds_still_replays():
    compiled = draftfuse.draft_loop(_wrapped(_scaled_by_its_default))
    hidden = torch.randn(2, 8)
    for _ in range(3):
        compiled(hidden)
    assert compiled._replays
    calls = recorder_calls(compiled)
    out, scale = compiled(hidden)
    assert recorder_calls(compiled) == calls and scale == 2.0
    torch.testing.assert_close(out, torch.tanh(hidden * 2.0))


def _aliased_outputs(hidden, w):
    logits = torch.tanh(hidden @ w)
    return logits, logits[:, :4], hidden, hidden  # a view of an output, and one tensor twice


def test_outputs_alias_one_another_as_in_eager_on_every_path():
    """Copies made for the caller (the Dynamo path's, and a replay's when its outputs are still held)
    keep the outputs' aliasing: a write to one shows in its view, and a tensor returned twice is one."""
    compiled = draftfuse.draft_loop(_aliased_outputs)
    w, kept = torch.randn(8, 8), []
    for _ in range(5):
        hidden = torch.randn(2, 8)
        logits, head, h1, h2 = compiled(hidden, w)
        kept.append(logits)  # held: later calls must copy theirs
        assert h1 is h2 is hidden and torch.allclose(logits, torch.tanh(hidden @ w))
        logits.zero_()
        assert torch.equal(head, torch.zeros(2, 4)), "the view shares the output's memory"


class _CacheHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("kv", torch.zeros(6, 8))

    def forward(self, hidden, position, caches):
        caches[0][0].index_copy_(0, position, hidden[:1])
        self.kv.index_copy_(0, position, hidden[:1])
        return torch.softmax(hidden, -1).argmax(-1), caches[0][0], self.kv


def test_a_returned_cache_is_the_caller_s_own_tensor():
    """A cache returned from inside nested argument lists or off a module attribute is the tensor
    itself, as in eager: neither copied on the Dynamo path nor refused a replay."""
    holder = _CacheHolder()
    compiled = draftfuse.draft_loop(holder)
    caches = [[torch.zeros(6, 8), torch.zeros(6, 8)]]
    for step in range(4):
        _, nested, attribute = compiled(torch.randn(2, 8), torch.tensor([step]), caches)
        assert nested is caches[0][0] and attribute is holder.kv, step
    assert compiled._replays


def _with_keyword_default(x, *, steps=2):
    for _ in range(steps):
        x = torch.tanh(x)
    return x


def test_defaults_changed_after_compiling_are_read_per_call():
    compiled = draftfuse.draft_loop(_with_keyword_default)
    x = torch.tensor([[1.0, -3.0, 2.0]])
    saved = dict(_with_keyword_default.__kwdefaults__)
    try:
        for _ in range(3):
            compiled(x)
        _with_keyword_default.__kwdefaults__["steps"] = 5
        assert torch.allclose(compiled(x), _with_keyword_default(x))
    finally:
        _with_keyword_default.__kwdefaults__.update(saved)


def _with_positional_default(x, steps=2, scale=1.0):
    for _ in range(steps):
        x = torch.tanh(x) * scale
    return x


def test_defaults_reassigned_after_compiling_are_read_per_call():
    """`fn.__defaults__ = (...)` replaces the tuple: the copy draftfuse compiles (its code of its own)
    must take the new one too, on the replay path and through Dynamo."""
    compiled = draftfuse.draft_loop(_with_positional_default)
    x = torch.tensor([[1.0, -3.0, 2.0]])
    saved = _with_positional_default.__defaults__
    try:
        for _ in range(3):
            compiled(x)
        assert compiled._replays
        _with_positional_default.__defaults__ = (5, 1.0)  # another step count: another graph
        assert torch.allclose(compiled(x), _with_positional_default(x))
        _with_positional_default.__defaults__ = (2, 0.5)  # a float default: specialised, so recompiled
        for _ in range(3):
            assert torch.allclose(compiled(x), _with_positional_default(x))
    finally:
        _with_positional_default.__defaults__ = saved


class _SimulatedCudaGraph:
    """A stand-in for torch.cuda.CUDAGraph on a CPU, with its semantics for GraphRecorder: the capture
    records the region's call on the tensors it was captured with; a replay reads those tensors' memory
    as it is then and writes into the same output tensors."""

    capturing: _SimulatedCudaGraph | None = None

    def __init__(self):
        self.calls, self.outputs, self.replays = [], None, 0

    def replay(self):
        self.replays += 1
        fn, inputs = self.calls[0]
        for static, new in zip(self.outputs, fn(*inputs)):
            if isinstance(static, torch.Tensor):
                static.copy_(new)


def _simulated_recorder(monkeypatch, fn, static, spares=0):
    import contextlib

    from draftfuse.kernels import selection as _selection
    from draftfuse.runtime.recorder import GraphRecorder

    @contextlib.contextmanager
    def graph(g, stream=None):
        _SimulatedCudaGraph.capturing = g
        try:
            yield
        finally:
            _SimulatedCudaGraph.capturing = None

    def region(*inputs):
        if _SimulatedCudaGraph.capturing is not None:
            g = _SimulatedCudaGraph.capturing
            g.calls.append((fn, inputs))
            memory = {v.untyped_storage().data_ptr() for v in inputs}
            # what the graph will write, unwritten yet (a view of an input stays one)
            g.outputs = [t if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in memory else torch.empty_like(t)
                         for t in fn(*inputs)]  # (an int: a size the region returns, as under dynamic=True)
            return tuple(g.outputs)
        return fn(*inputs)

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    for name, value in {"CUDAGraph": _SimulatedCudaGraph, "Stream": Stream, "current_stream": lambda device=None: Stream(),
                        "stream": lambda s: contextlib.nullcontext(), "graph": graph}.items():  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(_selection, "graph_workspace", lambda device: None)  # no selection kernels on the CPU
    device = type("Device", (), {"type": "cuda"})()
    return GraphRecorder(region, static, set(), device, spares=spares)


def test_recorder_reads_inputs_in_place_then_copies_after_another_tensor(monkeypatch):
    weight = torch.tensor([2.0, 2.0, 2.0, 2.0])
    recorder = _simulated_recorder(monkeypatch, lambda w, x, y: (x * w + y,), [True, False, False])
    x, y = torch.arange(4.0), torch.ones(4)
    recorder(weight, x, y)  # warm-up: runs plainly
    recorder(weight, x, y)  # records, reading x and y where they are
    assert recorder.in_place and recorder.buffers[0] is x and recorder.graph.replays == 1
    x.add_(10)  # the caller refills its buffer in place: the replay reads it, nothing is copied
    recorder.replay([x, y])
    assert torch.equal(recorder.outputs[0], x * 2 + 1)
    generation = recorder.generation
    other = torch.full((4,), 5.0)
    recorder.replay([other, y])  # another tensor: recorded again over static buffers, which it is copied into
    assert not recorder.in_place and recorder.buffers[0] is not other and recorder.generation > generation
    assert torch.equal(recorder.outputs[0], other * 2 + 1)
    x.zero_()
    recorder.replay([x, y])  # the first tensor again: copied now, and read as it is
    assert torch.equal(recorder.outputs[0], y)


def test_the_recorder_checks_overlap_before_every_replay_of_inputs_not_read_in_place(monkeypatch):
    """Once another input tensor had recorded again over static buffers, a call through Dynamo replayed
    with no overlap check (only the fast path had one): an argument sharing the KV cache the draft writes
    was copied into a static buffer before the draft's write and read stale (eager reads it written), where
    draftfuse promises an error. Every path's replay now checks in one place."""
    weight = torch.tensor([2.0, 2.0, 2.0, 2.0])
    recorder = _simulated_recorder(monkeypatch, lambda w, x: (x * w,), [True, False])
    checked = []
    recorder.check_overlap = lambda sources, positions: checked.append((sources, positions))
    x = torch.arange(4.0)
    recorder(weight, x)  # warm-up
    recorder(weight, x)  # records, reading x where it is
    recorder(weight, x)  # replays x in place: checked when recorded
    assert checked == []
    other = torch.ones(4)
    recorder(weight, other)  # through Dynamo, another tensor: checked, then recorded again over static buffers
    assert len(checked) == 1 and checked[0][0][0] is other and checked[0][1] == [1]
    recorder(weight, x)  # through Dynamo, copied into the static buffer: checked
    recorder.replay_for_caller([other], ())  # the fast path's call: checked
    assert [c[0][0] for c in checked[1:]] == [x, other]


def test_recorder_keeps_an_expanded_input_in_place_and_a_failed_capture_unrecorded(monkeypatch):
    weight = torch.tensor([2.0, 2.0, 2.0, 2.0])
    recorder = _simulated_recorder(monkeypatch, lambda w, x, y: (x * w + y,), [True, False, False])
    x, y = torch.arange(4.0), torch.ones(1).expand(4)  # y: stride 0, no static buffer of its strides can be filled
    recorder(weight, x, y)
    recorder(weight, x, y)
    other_y = torch.full((1,), 3.0).expand(4)
    recorder.replay([x, other_y])
    assert recorder.in_place and recorder.buffers[1] is other_y  # recorded again over the new tensors
    assert torch.equal(recorder.outputs[0], x * 2 + 3)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, stream=None: (_ for _ in ()).throw(RuntimeError("out of memory")))
    generation = recorder.generation
    with pytest.raises(RuntimeError, match="out of memory"):
        recorder.replay([torch.zeros(4), other_y])
    assert not recorder.captured and recorder.graph is None and recorder.generation > generation  # no old graph over new buffers


def _recorded_with_spares(monkeypatch):
    weight = torch.tensor([2.0, 2.0, 2.0, 2.0])
    recorder = _simulated_recorder(monkeypatch, lambda w, x: (x * w, x.sum(0, keepdim=True)), [True, False], spares=2)
    x = torch.arange(4.0)
    recorder(weight, x)
    recorder(weight, x)  # records: the main recording and two spares, each with output tensors of its own
    assert len(recorder.spares) == 2
    return recorder, x, weight


def test_outputs_handed_out_are_never_written_by_a_later_call(monkeypatch, copy_launches):
    recorder, x, weight = _recorded_with_spares(monkeypatch)
    copies = copy_launches()
    kept = []
    for step in range(6):  # the caller keeps every call's outputs (and a view of one)
        x.fill_(float(step))
        outputs = recorder.replay_for_caller([x], [0, 1])
        kept.append((step, outputs[0], outputs[1][0:1]))
    for step, scaled, total in kept:
        assert torch.equal(scaled, torch.full((4,), 2.0 * step)) and torch.equal(total, torch.tensor([4.0 * step]))
    # the first two calls took the two spares; from then on both are held, so each call copied its outputs
    assert len(copies) == 4
    assert not any(spare.free() for spare in recorder.spares)


def test_calls_through_dynamo_get_outputs_of_their_own_unless_zero_copy(monkeypatch, copy_launches):
    """The recorder's call (what Dynamo's code calls) returned the recording's own output tensors, and
    draft_loop copied the returned ones afterwards: tensors Dynamo's code put elsewhere (a returned
    dataclass's field, `self.last = h`) were the recording's, written by the next call, and `self.last is
    returned` no longer held. The recorder hands out outputs of their own to every call now (spares, or
    copies); zero_copy_outputs keeps the recording's."""
    recorder, x, weight = _recorded_with_spares(monkeypatch)
    kept = []
    for step in range(4):  # every call's outputs kept: two spares, then copies
        x.fill_(float(step))
        kept.append(recorder(weight, x))
    for step, (scaled, total) in enumerate(kept):
        assert torch.equal(scaled, torch.full((4,), 2.0 * step)) and torch.equal(total, torch.tensor([4.0 * step]))
    assert all(scaled.data_ptr() != recorder.outputs[0].data_ptr() for scaled, _ in kept)
    zero_copy = _simulated_recorder(monkeypatch, lambda w, x: (x * w,), [True, False])
    zero_copy.hand_out = False
    for _ in range(3):
        out = zero_copy(weight, x)
    assert out[0] is zero_copy.outputs[0]


@pytest.mark.parametrize("spares", [0, 2])
def test_a_size_among_the_outputs_is_handed_out_as_it_is(monkeypatch, spares):
    """Under dynamic=True a region returns sizes (ints) beside its tensors: handing every output out called
    .detach() on the int, and every call through Dynamo after the capture raised AttributeError."""
    recorder = _simulated_recorder(monkeypatch, lambda w, x: (x * w, x.shape[0] * 2), [True, False], spares=spares)
    weight, x = torch.full((4,), 2.0), torch.arange(4.0)
    for _ in range(3):  # warm-up, capture, replay
        scaled, size = recorder(weight, x)
        assert torch.equal(scaled, x * weight) and size == 8


class _ReadsKv:
    def __init__(self):
        self.kv = torch.ones(4)

    @draftfuse.draft_loop
    def draft(self, x, out):
        return x * self.kv, self.kv


def test_an_argument_that_was_a_tensor_the_graph_reads_when_recorded_is_told_apart():
    """`w.draft(x, w.kv)` recorded: the returned self.kv was planned as argument `out` (the template's paths
    are the arguments', not attributes), and a later call with another `out` returned `out` where eager
    returns self.kv."""
    worker, x = _ReadsKv(), torch.arange(4.0)
    for _ in range(3):
        worker.draft(x, worker.kv)
    other = torch.zeros(4)
    for _ in range(2):
        assert worker.draft(x, other)[1] is worker.kv
    assert worker.draft(x, worker.kv)[1] is worker.kv


def test_a_spare_replays_again_once_nothing_holds_its_outputs(monkeypatch, copy_launches):
    recorder, x, weight = _recorded_with_spares(monkeypatch)
    copies = copy_launches()
    previous = None
    for step in range(6):  # a server's loop: the last draft's outputs are held while the next one runs
        x.fill_(float(step))
        outputs = recorder.replay_for_caller([x], [0, 1])
        assert previous is None or torch.equal(previous[0], torch.full((4,), 2.0 * (step - 1))), "held: not written"
        assert torch.equal(outputs[0], torch.full((4,), 2.0 * step))
        previous = outputs
    del outputs
    assert not copies, "with the last call's outputs held, the other spare is free: nothing is copied"
    view = previous[1][:]  # a view of a handed-out output holds its spare as the tensor does
    spare = next(s for s in recorder.spares if s.outputs[1].untyped_storage().data_ptr() == previous[1].untyped_storage().data_ptr())
    del previous
    assert not spare.free()
    del view
    assert spare.free()


def test_a_resized_output_retires_its_spare(monkeypatch, copy_launches):
    recorder, x, weight = _recorded_with_spares(monkeypatch)
    outputs = recorder.replay_for_caller([x], [0, 1])
    outputs[0].resize_(1000)  # grows the storage the spare's output tensor shares: its memory moves
    del outputs
    assert sum(spare.free() for spare in recorder.spares) == 1 and sum(spare.retired() for spare in recorder.spares) == 1
    copies = copy_launches()
    for step in range(3):
        x.fill_(float(step))
        assert torch.equal(recorder.replay_for_caller([x], [0, 1])[0], torch.full((4,), 2.0 * step))
    assert not copies
    held = [recorder.replay_for_caller([x], [0, 1])]  # the free spare held: the copy path drops the retired one
    held.append(recorder.replay_for_caller([x], [0, 1]))
    assert len(recorder.spares) == 1 and len(copies) == 1


def test_an_output_in_an_input_s_memory_is_the_caller_s_and_the_others_handed_out(monkeypatch, copy_launches):
    """A view of a weight, a KV cache or an input the graph reads where the caller keeps it is a view of
    the caller's tensor, as in eager (it was a copy: a write through it missed the cache); one of an
    input copied into a static buffer is copied (the buffer is the next call's)."""
    weight = torch.tensor([2.0, 2.0, 2.0, 2.0])
    recorder = _simulated_recorder(monkeypatch, lambda w, x: (x * w, w[1:], x[:2]), [True, False], spares=2)
    x = torch.arange(4.0)
    recorder(weight, x)
    recorder(weight, x)
    assert len(recorder.spares) == 2 and all(spare.foreign == {1, 2} for spare in recorder.spares)
    copies = copy_launches()
    outputs = recorder.replay_for_caller([x], [0, 1, 2])
    assert torch.equal(outputs[0], x * 2) and torch.equal(outputs[1], weight[1:]) and torch.equal(outputs[2], x[:2]) and not copies
    assert outputs[1].untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert outputs[2].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert outputs[0].untyped_storage().data_ptr() == recorder.spares[0].outputs[0].untyped_storage().data_ptr()
    weight.mul_(2)  # the caller changes the input whose view was returned: the view shows it, as in eager
    assert torch.equal(outputs[1], torch.tensor([4.0, 4.0, 4.0]))
    y = torch.arange(4.0) + 10  # another tensor: recorded again over a static buffer, which later calls copy into
    outputs = recorder.replay_for_caller([y], [0, 1, 2])
    assert torch.equal(outputs[2], y[:2]) and outputs[2].untyped_storage().data_ptr() not in (
        y.untyped_storage().data_ptr(), recorder.buffers[0].untyped_storage().data_ptr())
    recorder_no_own = _simulated_recorder(monkeypatch, lambda w, x: (w[1:],), [True, False], spares=2)
    recorder_no_own(weight, x)
    recorder_no_own(weight, x)
    assert recorder_no_own.spares == []  # no output of its own memory: nothing to hand out


def test_a_returned_view_of_a_written_argument_is_a_view_on_every_path():
    """draft_loop returned a copy of cache[:, :2] (eager: a view): a write through it missed the cache."""

    def write_and_view(x, cache):
        cache[:, 0] = x
        return torch.softmax(x, -1).argmax(-1), cache[:, :2]

    compiled = draftfuse.draft_loop(write_and_view)
    cache = torch.zeros(2, 3, 5)
    for call in range(4):  # Dynamo's path, then the replay's
        _, view = compiled(torch.randn(2, 5), cache)
        view.fill_(float(call))
        assert torch.equal(cache[:, :2], torch.full((2, 2, 5), float(call))), call
    assert compiled._replays


def test_a_held_storage_object_keeps_its_spare_busy(monkeypatch):
    recorder, x, weight = _recorded_with_spares(monkeypatch)
    storage = recorder.replay_for_caller([x], [0, 1])[0].untyped_storage()  # the tensors dropped, their storage kept
    kept = torch.empty(0).set_(storage).clone()
    for step in range(1, 4):
        x.fill_(float(step))
        recorder.replay_for_caller([x], [0, 1])
    assert torch.equal(torch.empty(0).set_(storage), kept), "the storage object held: its memory is not written"


def test_a_failed_spare_capture_keeps_the_main_recording(monkeypatch):
    weight = torch.tensor([2.0, 2.0, 2.0, 2.0])
    recorder = _simulated_recorder(monkeypatch, lambda w, x: (x * w,), [True, False], spares=2)
    graph = torch.cuda.graph
    captures, failure = [], {3: RuntimeError("CUDA out of memory. Tried to allocate 2 GiB\nmore text")}

    def failing(g, stream=None):
        captures.append(g)
        if len(captures) in failure:
            raise failure[len(captures)]
        return graph(g, stream)

    monkeypatch.setattr(torch.cuda, "graph", failing)
    x = torch.arange(4.0)
    recorder(weight, x)
    with pytest.warns(UserWarning, match=r"1 of 2 spare recordings for this draft \(CUDA out of memory. Tried to allocate 2 GiB\): its outputs are copied when those are held"):
        recorder(weight, x)
    assert recorder.captured and recorder.graph is captures[0] and [s.graph for s in recorder.spares] == [captures[1]]
    x.fill_(3.0)
    assert torch.equal(recorder.replay_for_caller([x], [0])[0], torch.full((4,), 6.0))
    # another error is not out of memory: it is raised, and the recorder is left unrecorded
    failure[5] = RuntimeError("operation not permitted when stream is capturing")
    generation = recorder.generation
    with pytest.raises(RuntimeError, match="not permitted"):
        recorder.replay_for_caller([torch.zeros(4), ], [0])  # another tensor: records again over static buffers
    assert not recorder.captured and recorder.graph is None and recorder.spares == [] and recorder.generation > generation


def test_the_spare_recordings_option_reaches_the_recorder():
    head, hidden, cache, position = make()
    for count in (0, 1, 2):
        compiled = warmed(draftfuse.draft_loop(draft, options={"spare_recordings": count}), head, hidden, cache, position)
        assert compiled._recorders[0][0].spare_count == count
    compiled = warmed(draftfuse.draft_loop(draft, zero_copy_outputs=True), head, hidden, cache, position)
    assert compiled._recorders[0][0].spare_count == 0  # the main recording's outputs are returned: no spares


def test_a_stance_other_than_the_default_is_honoured():
    """Under torch.compiler.set_stance("force_eager") a recorded draft runs eagerly, as torch.compile's
    own functions do (a user comparing with eager): its random draws are eager's, under one seed."""
    def sample(logits):
        probs = torch.softmax(logits, -1)
        return (probs / torch.empty_like(probs).exponential_()).argmax(-1)

    compiled = draftfuse.draft_loop(sample)
    logits = torch.randn(4, 64)
    for _ in range(3):
        compiled(logits)
    assert compiled._replays
    with torch.compiler.set_stance("force_eager"):
        torch.manual_seed(1)
        got = compiled(logits)
        torch.manual_seed(1)
        want = sample(logits)
    assert torch.equal(got, want)


def _passes_back(hidden, scratch, out_buf):
    return torch.softmax(hidden, -1), out_buf


def _passes_back_nested(hidden, bufs, out):
    return hidden * 2, bufs[0]


@pytest.mark.parametrize("nested", [False, True])
def test_arguments_that_were_one_object_when_recorded_are_returned_as_each_call_passes_them(nested):
    """A warm-up passing one dummy for several buffers (`draft(h, dummy, dummy)`, or `out` that is
    `bufs[0]`): the Replay rebuilt the returned buffer from the first argument holding that object, and
    every later call with distinct buffers returned `scratch` where eager returns `out_buf` (`out` for
    `bufs[0]`). It returns what this call passes; a Replay holding arguments to be one object does not run
    for a call where they are not."""
    hidden, dummy = torch.randn(2, 3), torch.zeros(3)
    if nested:
        draft, call = draftfuse.draft_loop(_passes_back_nested), lambda a, b: draft(hidden, [b], a)
    else:
        draft, call = draftfuse.draft_loop(_passes_back), lambda a, b: draft(hidden, a, b)
    for _ in range(3):
        call(dummy, dummy)
    for _ in range(3):
        a, b = torch.full((3,), 1.0), torch.full((3,), 2.0)
        assert call(a, b)[1] is b
    for _ in range(2):  # one object again
        assert call(a, a)[1] is a
    assert len(draft._replays) == 2  # the aliased recording's, and one of distinct buffers


@dataclasses.dataclass
class _AttentionMetadata:
    seq_lens: torch.Tensor


def _bumps_seq_lens(logits, meta):
    meta.seq_lens += 1  # vLLM's propose: common_attn_metadata.seq_lens += 1 (an attribute store)
    return logits.argmax(dim=-1)


def test_an_attribute_store_is_named_as_one_in_the_no_fast_replay_warning():
    """Dynamo's code stores the attribute on every call through its helper object_setattr_ignore_descriptor:
    the warning named that helper as 'a load of a global', not the store. (torch 2.11's code stores it with
    STORE_ATTR, which the warning named by its opcode.)"""
    meta = _AttentionMetadata(torch.zeros(3, dtype=torch.int32))
    compiled = draftfuse.draft_loop(_bumps_seq_lens)
    with pytest.warns(UserWarning, match=r"no fast replay .*\(an attribute store"):
        for _ in range(3):
            compiled(torch.randn(3, 8), meta)
    assert meta.seq_lens.tolist() == [3, 3, 3] and not compiled._replays
