"""@draft_loop on a GPU: one CUDA graph replay per draft call, no skips, outputs safe to keep.

CUDA graph trees warm up on the first call, record on the second and replay from the third, so each
test calls the draft a few times before it measures or compares.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from draftfuse.runtime.draft_loop import draft_loop
from draftfuse.runtime.errors import CudagraphSkipError, DraftCaptureError
from tests._tiny_draft import BATCH, HIDDEN, VOCAB, draft, make_inputs
from tests.test_replay import _Activated, _activated_draft

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]

_WARM_CALLS = 3  # warm-up, record, first replay


def _other_inputs(seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH,), device="cuda", generator=generator)
    hidden = torch.randn(BATCH, HIDDEN, device="cuda", generator=generator)
    return tokens, hidden


def test_one_graph_replay_per_draft_call_and_eager_tokens():
    model, tokens, hidden, kv_cache, position = make_inputs("cuda")
    compiled = draft_loop(draft)
    with torch.no_grad():
        eager_cache = kv_cache.clone()
        eager_tokens, _ = draft(model, tokens, hidden, eager_cache, position)
        first_tokens, _ = compiled(model, tokens, hidden, kv_cache, position)
        for _ in range(_WARM_CALLS - 1):
            compiled(model, tokens, hidden, kv_cache, position)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(5):
                compiled(model, tokens, hidden, kv_cache, position)
            torch.cuda.synchronize()
    assert torch.equal(first_tokens, eager_tokens)
    names = [event.name for event in profile.events()]
    assert sum("cudaGraphLaunch" in name for name in names) == 5, sorted(set(names))
    # the selection kernels run in the graph on the recorder's workspace: no fill kernel of their own
    kernels = [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("_argmax_kernel" in name for name in kernels) == 5 * 4 and not any("FillFunctor" in name for name in kernels), kernels
    # one span per call on the host (the profiler mirrors each span on the GPU timeline as well)
    host_spans = [e for e in profile.events() if e.name == "draftfuse.draft:draft" and e.device_type == torch.autograd.DeviceType.CPU]
    assert len(host_spans) == 5
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] == 1 and len(compiled.compiles) == 1


def test_kv_cache_written_inside_the_draft_without_a_skip():
    model, tokens, hidden, kv_cache, position = make_inputs("cuda")
    compiled = draft_loop(draft)
    for _ in range(_WARM_CALLS):
        compiled(model, tokens, hidden, kv_cache, position)
    eager_cache = kv_cache.clone()
    with torch.no_grad():
        draft(model, tokens, hidden, eager_cache, position)
    compiled(model, tokens, hidden, kv_cache, position)  # a replay writes the cache in place
    torch.testing.assert_close(kv_cache, eager_cache, rtol=0, atol=1e-5)
    assert kv_cache._dynamo_static_input_type == "unguarded"
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_kept_outputs_are_not_overwritten_by_the_next_call():
    model, tokens, hidden, kv_cache, position = make_inputs("cuda")
    compiled = draft_loop(draft)
    for _ in range(_WARM_CALLS):
        compiled(model, tokens, hidden, kv_cache, position)
    tokens_a, hidden_a = _other_inputs(1)
    tokens_b, hidden_b = _other_inputs(2)
    with torch.no_grad():
        expected_a = draft(model, tokens_a, hidden_a, kv_cache.clone(), position)
    kept = compiled(model, tokens_a, hidden_a, kv_cache, position)
    later = compiled(model, tokens_b, hidden_b, kv_cache, position)
    assert not torch.equal(later[1], kept[1])  # the second call did produce something else
    assert torch.equal(kept[0], expected_a[0])
    torch.testing.assert_close(kept[1], expected_a[1], rtol=0, atol=1e-5)


def test_outputs_kept_from_every_call_stay_eager_and_a_server_loop_copies_nothing(copy_launches):
    # Default outputs are the caller's: spare recordings hand theirs out while nothing else holds them,
    # and copies are made only when every spare's outputs are still held.
    model, tokens, hidden, kv_cache, position = make_inputs("cuda")
    compiled = draft_loop(draft)
    for _ in range(_WARM_CALLS):
        compiled(model, tokens, hidden, kv_cache, position)
    copies = copy_launches()
    kept, expected = [], []
    for seed in range(1, 7):  # every call's outputs kept: two spares, then a copy per call
        tokens.copy_(_other_inputs(seed)[0])
        hidden.copy_(_other_inputs(seed)[1])
        with torch.no_grad():
            expected.append(draft(model, tokens, hidden, kv_cache.clone(), position))
        kept.append(compiled(model, tokens, hidden, kv_cache, position))
    for got, want in zip(kept, expected):
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    assert len(copies) == 4
    del kept
    copies.clear()
    previous = None
    for seed in range(7, 13):  # a server's loop: the last draft's outputs are held while the next one runs
        tokens.copy_(_other_inputs(seed)[0])
        with torch.no_grad():
            want = draft(model, tokens, hidden, kv_cache.clone(), position)
        got = compiled(model, tokens, hidden, kv_cache, position)
        if previous is not None:  # held across this call: neither moved nor written
            held, snapshot = previous
            assert got[1].data_ptr() != held[1].data_ptr()
            assert all(torch.equal(t, c) for t, c in zip(held, snapshot))
            del held, snapshot  # a server holds only the last draft's outputs (these names would hold two)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
        previous = (got, [t.clone() for t in got])
    assert not copies


@dataclasses.dataclass
class _Proposal:  # a worker's output object (EAGLE's verify input, say): not a pytree
    tokens: torch.Tensor
    probs: torch.Tensor


class _StoringWorker:
    def __init__(self) -> None:
        self.model, _, _, self.kv_cache, self.position = make_inputs("cuda")
        self.last_probs = None

    @draft_loop
    def propose(self, tokens, hidden):
        out_tokens, out_probs = draft(self.model, tokens, hidden, self.kv_cache, self.position, steps=1)
        self.last_probs = out_probs  # kept for the next round, as workers keep their last step's state
        return _Proposal(out_tokens, out_probs)


def test_outputs_in_an_object_or_an_attribute_are_the_callers_and_keep_their_identity():
    """A dataclass returned, and `self.last_probs = p`: their tensors were the recording's own (draft_loop
    copied only pytree leaves it returned), so the next call wrote them, and `self.last_probs` was not the
    returned tensor (eager: the same one). Each call through Dynamo now gets outputs of its own."""
    worker = _StoringWorker()
    for seed in range(1, 4):  # warm-up, record, and calls: Dynamo's code stores the attribute (no fast replay)
        kept = worker.propose(*_other_inputs(seed))
    snapshot = (kept.tokens.clone(), kept.probs.clone())
    assert worker.last_probs is kept.probs
    later = worker.propose(*_other_inputs(9))
    assert not torch.equal(later.probs, snapshot[1])  # the later call did produce something else
    assert torch.equal(kept.tokens, snapshot[0]) and torch.equal(kept.probs, snapshot[1])
    assert worker.last_probs is later.probs


def test_zero_copy_outputs_are_the_graphs_own():
    # The documented trade: no copy, and the next call reuses the same memory.
    model, tokens, hidden, kv_cache, position = make_inputs("cuda")
    compiled = draft_loop(draft, zero_copy_outputs=True)
    for _ in range(_WARM_CALLS):
        compiled(model, tokens, hidden, kv_cache, position)
    first_address = compiled(model, tokens, hidden, kv_cache, position)[1].data_ptr()
    second_address = compiled(model, tokens, hidden, kv_cache, position)[1].data_ptr()
    assert first_address == second_address


def _scaled(x, scale):
    return x * scale


def test_cpu_tensor_input_on_a_cuda_draft_raises():
    with pytest.raises(CudagraphSkipError, match="'scale' is a CPU tensor"):
        draft_loop(_scaled)(torch.randn(4, device="cuda"), torch.tensor(2.0))


def _recorded_zero_copy():
    """A zero-copy draft called until it replays, its inputs, and its recorder."""
    model, tokens, hidden, kv_cache, position = make_inputs("cuda")
    compiled = draft_loop(draft, zero_copy_outputs=True)
    for _ in range(_WARM_CALLS):
        compiled(model, tokens, hidden, kv_cache, position)
    return compiled, (model, tokens, hidden, kv_cache, position), compiled._replays[0].recorder


def test_persistent_input_buffers_are_read_where_they_are(monkeypatch, copy_launches):
    # A server keeps its input buffers and refills them for each draft: the graph reads them in place.
    compiled, (model, tokens, hidden, kv_cache, position), recorder = _recorded_zero_copy()
    assert recorder.in_place and any(buffer is hidden for buffer in recorder.buffers)
    copies = copy_launches()
    for seed in (1, 2, 3):
        new_tokens, new_hidden = _other_inputs(seed)
        tokens.copy_(new_tokens)
        hidden.copy_(new_hidden)
        with torch.no_grad():
            expected = draft(model, tokens, hidden, kv_cache.clone(), position)
        got = compiled(model, tokens, hidden, kv_cache, position)
        assert torch.equal(got[0], expected[0])
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-5)
    assert not copies and recorder.in_place


def test_other_input_tensors_record_again_over_static_buffers(monkeypatch, copy_launches):
    compiled, (model, tokens, hidden, kv_cache, position), recorder = _recorded_zero_copy()
    copies = copy_launches()
    for seed in (1, 2, 3, 4):
        new_tokens, new_hidden = _other_inputs(seed)  # fresh tensors on every call, as most callers pass them
        with torch.no_grad():
            expected = draft(model, new_tokens, new_hidden, kv_cache.clone(), position)
        got = compiled(model, new_tokens, new_hidden, kv_cache, position)
        assert torch.equal(got[0], expected[0])
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-5)
    assert not recorder.in_place and all(buffer is not hidden for buffer in recorder.buffers)
    assert len(copies) == 4  # one copy launch per call from the first call with other tensors
    hidden.copy_(_other_inputs(5)[1])  # the first tensors again, changed in place: copied now, read right
    with torch.no_grad():
        expected = draft(model, tokens, hidden, kv_cache.clone(), position)
    got = compiled(model, tokens, hidden, kv_cache, position)
    assert torch.equal(got[0], expected[0]) and len(copies) == 5
    assert counters["inductor"]["cudagraph_skips"] == 0 and len(compiled.compiles) == 1


class _CudaWorker:
    def __init__(self) -> None:
        self.model, self.tokens, self.hidden, self.kv_cache, self.position = make_inputs("cuda")

    @draft_loop
    def draft(self):
        return draft(self.model, self.tokens, self.hidden, self.kv_cache, self.position)


def test_an_argument_sharing_the_written_cache_raises_after_another_input_recorded_again():
    """A server passing a fresh hidden tensor each call records again over static buffers; a later call
    through Dynamo whose argument is a view of the KV cache the draft writes raised only on the fast path,
    and on this one read the row before the draft's write."""

    def step(h, cache):
        cache[0] = cache[0] * 2 + 1
        return h * 3 + cache[1:3].sum(0)

    compiled = draft_loop(step)
    cache = torch.arange(32.0, device="cuda").reshape(4, 8)
    want_cache = cache.clone()
    for _ in range(3):
        h = torch.randn(1, 8, device="cuda")
        torch.testing.assert_close(compiled(h, cache), step(h.clone(), want_cache))  # Triton may fuse h * 3 + s into an FMA
    with pytest.raises(DraftCaptureError, match="shares memory with an input the draft writes"):
        compiled(cache[0:1], cache)


def _run_worker() -> tuple[weakref.ref, int]:
    worker = _CudaWorker()
    for _ in range(_WARM_CALLS + 2):  # recorded and replayed, with its spares
        worker.draft()
    return weakref.ref(worker.draft._replays[0].recorder), torch.cuda.memory_allocated()


def test_a_deleted_worker_gives_its_cuda_graphs_memory_back():
    _run_worker()  # the first, for what stays by design (kernels' caches, eager calls' and the capture stream's workspaces)
    gc.collect()
    before = torch.cuda.memory_allocated()
    recorder, during = _run_worker()
    gc.collect()
    assert during > before and recorder() is None and torch.cuda.memory_allocated() == before


def test_after_dynamo_reset_the_draft_records_anew_and_frees_the_old_graphs(monkeypatch):
    head, x = _Activated().cuda().requires_grad_(False), torch.randn(3, 8, device="cuda")
    compiled = draft_loop(_activated_draft)
    for _ in range(_WARM_CALLS):
        compiled(head, x)
    recorded = weakref.ref(compiled._replays[0].recorder)
    monkeypatch.setattr(_Activated, "act", lambda self, x: x * 100.0)  # unguarded: seen after a reset
    torch._dynamo.reset()
    for _ in range(_WARM_CALLS + 1):
        got = compiled(head, x)
    with torch.no_grad():
        want = _activated_draft(head, x)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])
    gc.collect()
    assert recorded() is None and len(compiled._recorders) == 1 and compiled._replays[0].recorder.graph is not None


def _appends(x, history):
    probs = torch.softmax(x * 2, -1)
    history.append(probs)
    return probs


def test_a_returned_tensor_also_appended_to_an_argument_list_is_not_written_later():
    """It was counted among the call's own arguments (the list was read after the call, holding it) and
    handed out uncopied: the recording's output, written by the next call."""
    compiled = draft_loop(_appends)
    x = torch.randn(BATCH, VOCAB, device="cuda")
    for _ in range(_WARM_CALLS):
        compiled(x, [])  # a list per call (a growing one recompiles: its length is guarded)
    history = []
    kept = compiled(x, history)
    snapshot = kept.clone()
    later = compiled(-x, [])  # (x + 1 would give the same softmax)
    assert not torch.equal(later, snapshot)  # the later call did produce something else
    assert torch.equal(kept, snapshot) and history[0] is kept
