"""Every way a draft can fail to be one captured region raises a DraftCaptureError at the right line.

Each offending statement carries a `# <- name` marker; `_line(name)` finds its line, so the tests
assert the exact file:line the error names. Most causes are found while tracing, before Inductor
runs, so these tests cost a Dynamo trace each; the ones that need a first compile use tiny functions.
"""

from __future__ import annotations

import logging
import os
import pickle
import pathlib
import unittest.mock
import warnings

import pytest
import torch
import torch._dynamo

from draftfuse.runtime import translate
from draftfuse.runtime.draft_loop import draft_loop
from draftfuse.runtime.errors import (
    CudagraphSkipError,
    DraftCaptureError,
    GraphBreakError,
    HostSyncError,
    RecompileError,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

THIS_FILE = pathlib.Path(__file__).resolve()


def _line(marker: str) -> str:
    """file:line of the statement marked `# <- marker` in this file."""
    for number, text in enumerate(THIS_FILE.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# <- {marker}"):
            return f"{THIS_FILE}:{number}"
    raise AssertionError(f"no line marked {marker!r}")


def _raises(error_type: type[DraftCaptureError], draft, *args, **kwargs) -> DraftCaptureError:
    with pytest.raises(error_type) as info:
        draft(*args, **kwargs)
    return info.value


# ---- graph breaks ----------------------------------------------------------------------------------


def _branch_on_value(x):
    if x.sum() > 0:  # <- branch
        return x + 1
    return x - 1


def _untraceable_call(x):
    os.getpid()  # <- untraceable
    return x + 1


def test_branch_on_tensor_value_is_a_graph_break():
    error = _raises(GraphBreakError, draft_loop(_branch_on_value), torch.randn(4))
    assert error.where == _line("branch")
    assert "graph break" in error.cause and error.fix


def _checked_batch(tokens, hidden):
    if tokens.shape[0] != hidden.shape[0]:  # (not an assert: pytest would rewrite it, and Dynamo trace pytest's formatting)
        raise AssertionError("batch mismatch")  # <- assert
    return torch.softmax(hidden, -1).topk(1, -1)


def test_an_assert_on_the_arguments_that_fails_says_so():
    # a plain `assert` was a HostSyncError saying a device value was read on the host, with a padding fix, and
    # a raise a generic graph break (Dynamo's "Observed exception"): both are named so now
    draft = draft_loop(_checked_batch)
    draft(torch.zeros(2, dtype=torch.long), torch.randn(2, 8))
    error = _raises(GraphBreakError, draft, torch.zeros(3, dtype=torch.long), torch.randn(2, 8))
    assert error.where == _line("assert")
    assert "the draft raises AssertionError" in error.cause and "for this call's arguments" in error.cause
    assert "torch._assert_async" in error.fix


def _validated_steps(hidden, steps: int = 3):
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")  # <- user raise
    return torch.softmax(hidden, -1).topk(1, -1)


def test_the_draft_s_own_exception_is_quoted():
    """The message of an exception the draft raised when traced was lost (a generic "assert or raise fails")."""
    error = _raises(GraphBreakError, draft_loop(_validated_steps), torch.randn(2, 8), steps=0)
    assert error.where == _line("user raise")
    # torch 2.11's Dynamo keeps only the exception's type
    quoted = "ValueError('steps must be >= 1, got 0')" if torch.__version__ >= "2.13" else "ValueError"
    assert f"the draft raises {quoted} for this call's arguments" in error.cause, error.cause


def _checked_steps(hidden, steps: int = 3):
    torch._check(steps >= 1, lambda: f"steps must be >= 1, got {steps}")  # <- torch check
    return torch.softmax(hidden, -1).topk(1, -1)


def _described(hidden, model):
    if hidden.dim() != 2:
        raise ValueError(f"{model} takes [batch, hidden]")  # <- described
    return torch.softmax(hidden, -1).topk(1, -1)


def test_the_messages_of_torch_check_and_of_a_formatted_object_are_quoted():
    """torch._check's message (a traced string in Dynamo's exception) and a message formatting an object were
    dropped: "the draft raises RuntimeError" alone (helper-67)."""
    error = _raises(GraphBreakError, draft_loop(_checked_steps), torch.randn(2, 8), steps=0)
    assert error.where == _line("torch check")
    if torch.__version__ >= "2.13":  # torch 2.11's Dynamo keeps only the exception's type
        assert "the draft raises RuntimeError('steps must be >= 1, got 0') for" in error.cause, error.cause
    error = _raises(GraphBreakError, draft_loop(_described), torch.randn(2, 4, 8), torch.nn.Linear(8, 8))
    assert error.where == _line("described") and "Variable" not in error.cause
    if torch.__version__ >= "2.13":
        assert "the draft raises ValueError('<Linear> takes [batch, hidden]') for" in error.cause, error.cause


_LOG = logging.getLogger("tests.draft")


def _printing(hidden):
    picked = torch.softmax(hidden, -1).topk(1, -1)
    print("drafted", picked.indices)  # <- print
    return picked


def _warning(hidden):
    picked = torch.softmax(hidden, -1).topk(1, -1)
    warnings.warn("drafted")  # <- warn
    return picked


def _logging(hidden):
    picked = torch.softmax(hidden, -1).topk(1, -1)
    _LOG.debug("drafted %s", "rows")  # <- log
    return picked


def test_print_warnings_and_logging_in_a_draft_get_a_fix_that_works():
    """The fix offered allow_in_graph or a custom op (helper-67). print and warnings.warn work when registered
    as reorderable logging functions (checked here); a logging.Logger method does not, so it must move out."""
    for draft, marker in ((_printing, "print"), (_warning, "warn")):
        error = _raises(GraphBreakError, draft_loop(draft), torch.randn(2, 8))
        assert error.where == _line(marker) and "reorderable_logging_functions" in error.fix, error
    error = _raises(GraphBreakError, draft_loop(_logging), torch.randn(2, 8))
    assert error.where == _line("log") and "move the logging out of the draft" in error.fix, error
    with unittest.mock.patch.object(torch._dynamo.config, "reorderable_logging_functions", {print, warnings.warn}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for draft in (_printing, _warning):
                torch._dynamo.reset()
                assert draft_loop(draft)(torch.randn(2, 8)).indices.shape == (2, 1)


class _CodedError(ValueError):
    def __init__(self, code, message):
        super().__init__(message)  # <- super init
        self.code = code


def _raises_coded(hidden, steps: int = 3):
    if steps < 1:
        raise _CodedError(7, "steps must be >= 1")
    return torch.softmax(hidden, -1).topk(1, -1)


def test_an_exception_class_dynamo_cannot_make_gets_a_fix_for_it():
    """An exception class whose __init__ calls super().__init__ is one Dynamo cannot make: the error pointed
    at that line with "move this call out of the draft" (helper-67); the fix now says what to change."""
    error = _raises(GraphBreakError, draft_loop(_raises_coded), torch.randn(2, 8), steps=0)
    assert error.where == _line("super init") and "no __init__ of its own that calls super().__init__" in error.fix, error


class _StepsError(KeyError):  # a draft's own exception class (KeyError's str is a repr: not the error's)
    pass


def _validated_rows(hidden, rows: int):
    if rows > hidden.shape[0]:
        raise _StepsError("more rows than the batch")  # <- own class
    return torch.softmax(hidden[:rows], -1).topk(1, -1)


def test_the_error_is_also_the_exception_the_draft_raised():
    """`except ValueError:` (or the draft's own class) around the call caught what eager raises, and nothing
    from the compiled draft: the GraphBreakError is now an instance of the raised class too."""
    with pytest.raises(ValueError) as caught:
        draft_loop(_validated_steps)(torch.randn(2, 8), steps=0)
    assert isinstance(caught.value, GraphBreakError) and caught.value.where == _line("user raise")
    with pytest.raises(_StepsError) as caught:
        draft_loop(_validated_rows)(torch.randn(2, 8), 3)
    assert isinstance(caught.value, GraphBreakError) and caught.value.where == _line("own class")
    assert str(caught.value).startswith(f"{_line('own class')}: the draft raises")
    again = pickle.loads(pickle.dumps(caught.value))  # as a worker process sends it
    assert type(again) is type(caught.value) and str(again) == str(caught.value)
    assert draft_loop(_validated_rows)(torch.randn(2, 8), 1)[1].shape == (1, 1)


class _InferenceWorker(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, 16)
        self.cache = torch.zeros(2, 4, 8)  # a KV cache the draft writes

    @torch.inference_mode()
    def draft(self, h, pos):
        self.cache.index_copy_(1, pos, h.unsqueeze(1))  # <- inference write
        return torch.softmax(self.head(h + self.cache.sum(1)), -1).topk(1, -1)


def test_a_compile_that_fails_under_inference_mode_is_named_and_leaves_torch_working():
    """torch 2.13 cannot compile a KV write under inference_mode ("Cannot set version_counter for inference
    tensor", plain torch.compile too): that raw error came out, and every torch op after it failed an
    internal assert ("PythonDispatcherTLS was not set"), grad mode left off. Now a DraftCaptureError with the
    fix, and the thread's dispatch keys and grad mode are the caller's again. torch 2.11 fails there with a
    RuntimeError whose message is a storage's weakref: the same DraftCaptureError."""
    keys = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())
    worker, eager = _InferenceWorker(), _InferenceWorker()
    eager.load_state_dict(worker.state_dict())
    h, pos = torch.randn(2, 8), torch.tensor([1])
    try:
        got = draft_loop(worker.draft)(h, pos)
    except DraftCaptureError as error:
        assert "inference_mode" in error.cause and "torch.no_grad()" in error.fix, str(error)
        assert error.where == _line("inference write")
    else:  # a torch that compiles it: eager's tokens
        assert torch.equal(got[1], eager.draft(h, pos)[1])
    assert (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()) == keys
    assert torch.is_grad_enabled() and (torch.randn(2, requires_grad=True) * 2).grad_fn is not None


def _mixed_dtypes(h, kv):
    att = torch.bmm(h.unsqueeze(1), kv.transpose(1, 2))  # <- op error
    return torch.softmax(att.squeeze(1), -1).topk(1, -1)


def test_an_op_that_raises_when_traced_is_quoted():
    """A float64 query against a float32 cache (a model made .double()): eager raises "expected scalar type
    ...", the error said only "RuntimeError when making fake tensor call" (Dynamo's wrapper)."""
    h, kv = torch.randn(2, 8, dtype=torch.float64), torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="expected scalar type"):
        _mixed_dtypes(h, kv)
    error = _raises(DraftCaptureError, draft_loop(_mixed_dtypes), h, kv)
    assert error.where == _line("op error")
    assert "RuntimeError: expected scalar type" in error.cause, error.cause  # fake tensors name the dtypes their way


def _cache_write_missing_a_dim(k, h, pos):
    k[:, pos] = h  # <- lowering error
    return torch.softmax(k.sum(1), -1).topk(1, -1)


def test_a_draft_error_inductor_meets_first_is_a_capture_error():
    """HF's legacy cache write without its unsqueeze(1): eager raises "shape mismatch", Inductor's lowering
    fails first. A raw InductorError came out (it is a BackendCompilerFailed whose inner error is the
    lowering's, which the translation unwrapped into nothing it knew), saying nothing of the draft."""
    args = (torch.zeros(2, 8, 8), torch.ones(2, 8), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        _cache_write_missing_a_dim(*[a.clone() for a in args])
    error = _raises(DraftCaptureError, draft_loop(_cache_write_missing_a_dim), *args)
    assert error.where == _line("lowering error") and "Inductor" in error.cause and "eagerly" in error.fix


def _decides_on_a_read(hidden):
    n = hidden.argmax(-1)[0].item()  # <- read
    return hidden.argmax(-1) + (1 if n > 5 else 0)  # <- decision


def _decides_on_a_longest(hidden, seq_lens):
    longest = int(seq_lens.max())  # <- int read
    steps = 2 if longest > 100 else 3  # <- int decision
    for _ in range(steps):
        hidden = torch.tanh(hidden)
    return hidden.argmax(-1)


def test_a_python_decision_on_a_read_value_is_a_host_sync_with_the_where_fix():
    """It carried torch's torch._check advice and the fix for data-dependent sizes. The cause names the
    line that read the value: for `int(seq_lens.max())` (a server's longest sequence) it did not (the
    probe that finds the read traced it as a graph break, leaving it out of its graph)."""
    error = _raises(HostSyncError, draft_loop(_decides_on_a_read), torch.randn(2, 8))
    assert error.where == _line("decision") and "a Python decision" in error.cause and "_check" not in error.cause
    assert f"read at {_line('read')} " in error.cause, error.cause
    assert "torch.where" in error.fix
    error = _raises(HostSyncError, draft_loop(_decides_on_a_longest), torch.randn(2, 8), torch.tensor([3, 4]))
    assert error.where == _line("int decision") and f"read at {_line('int read')} " in error.cause, error.cause


def test_untraceable_call_is_a_graph_break():
    error = _raises(GraphBreakError, draft_loop(_untraceable_call), torch.randn(4))
    assert error.where == _line("untraceable")
    assert str(error).startswith(f"{_line('untraceable')}: graph break")


# ---- host syncs ------------------------------------------------------------------------------------


def _item(x):
    scale = x.sum().item()  # <- item
    return x * scale


def _tolist(x):
    values = x.tolist()  # <- tolist
    return x * values[0]


def _to_cpu(x):
    return x.cpu() * 2  # <- cpu


def _nonzero(x):
    return torch.nonzero(x > 0)  # <- nonzero


@pytest.mark.parametrize("fn, marker", [(_item, "item"), (_tolist, "tolist"), (_to_cpu, "cpu"), (_nonzero, "nonzero")])
def test_host_sync_names_its_line(fn, marker):
    # torch 2.13 traces .item(), .cpu() and nonzero into the graph (found by the graph scan) and
    # breaks on a float .tolist() (found in Dynamo's error): both are HostSyncErrors.
    error = _raises(HostSyncError, draft_loop(fn), torch.randn(4))
    assert error.where == _line(marker)
    assert "host" in error.cause


def _int_list(seq_lens):
    return torch.tensor(seq_lens.tolist()) + 1  # <- int tolist


def test_an_int_tolist_is_named_by_what_was_written():
    # Dynamo traces an integer tensor's .tolist() as .item() calls: the error named only `.item()`
    error = _raises(HostSyncError, draft_loop(_int_list), torch.tensor([3, 4]))
    assert error.where == _line("int tolist") and "`.tolist()`" in error.cause, error.cause


def test_host_read_graph_breaks_of_older_torch_are_host_syncs():
    # torch 2.11 breaks the graph on .item() and nonzero where 2.13 traces them.
    item = torch._dynamo.exc.Unsupported("Unsupported Tensor.item() call with capture_scalar_outputs=False")
    nonzero = torch._dynamo.exc.Unsupported(
        "Dynamic shape operator\n  Explanation: Operator `aten.nonzero.default`'s output shape depends on input data."
    )
    other = torch._dynamo.exc.Unsupported("Failed to trace builtin operator\n  Explanation: print")
    assert isinstance(translate.from_exception(item), HostSyncError)
    assert isinstance(translate.from_exception(nonzero), HostSyncError)
    assert type(translate.from_exception(other)) is GraphBreakError


# ---- CUDA-graph skips ------------------------------------------------------------------------------


def _mixed_devices(x, y):
    return x * 2, y + 1  # <- mixed devices


def test_cpu_tensor_input_on_an_accelerator_draft():
    # "meta" stands in for a GPU: the check compares devices only (the CUDA test uses a real one).
    error = _raises(CudagraphSkipError, draft_loop(_mixed_devices), torch.randn(4, device="meta"), torch.randn(4))
    assert error.where == _line("mixed devices")
    assert "'y' is a CPU tensor" in error.cause


def _write_cache(x, cache, position):
    cache.index_copy_(0, position, x)  # <- cache write
    return cache.sum(0)


def test_cache_swapped_between_calls_names_the_argument():
    draft = draft_loop(_write_cache)
    x, position = torch.randn(1, 4), torch.tensor([1])
    cache = torch.zeros(3, 4)
    draft(x, cache, position)
    assert torch.equal(cache[1], x[0])
    assert cache._dynamo_static_input_type == "unguarded"  # made static for CUDA graphs
    draft(x, cache, position)  # same tensor: fine
    error = _raises(CudagraphSkipError, draft, x, torch.zeros(3, 4), position)
    assert error.where == _line("cache write")
    assert "'cache' is written in place" in error.cause


def _reads_previous(cache, prev, position, h):
    cache[position] = h  # <- shared write
    return prev * 1


def test_a_read_input_that_shared_the_written_cache_names_the_sharing():
    """`prev = cache[1]` on the first calls, a tensor of its own later: the error said 'prev' "is written in
    place by the draft", which the draft never does. It names the sharing now; the cache itself swapped
    keeps the plain message."""
    draft = draft_loop(_reads_previous)
    cache, position, h = torch.zeros(6, 4), torch.tensor([1]), torch.ones(1, 4)
    for _ in range(2):
        draft(cache, cache[1], position, h)
    error = _raises(CudagraphSkipError, draft, cache, torch.full((4,), 7.0), position, h)
    assert error.where == _line("shared write")
    assert "input 'prev' shared memory with 'cache' when the draft was compiled" in error.cause, error.cause
    error = _raises(CudagraphSkipError, draft, torch.zeros(6, 4), cache[1], position, h)
    assert "input 'cache' is written in place by the draft" in error.cause, error.cause


def _scaled(x):
    return x * 2  # <- first use


def test_dynamic_shape_raises_unless_asked_for():
    draft = draft_loop(_scaled)
    x = torch.randn(3, 4)
    torch._dynamo.mark_dynamic(x, 0)  # a size made symbolic where the draft asked for static shapes
    error = _raises(CudagraphSkipError, draft, x)
    assert error.where == _line("first use")
    assert "dynamic shape" in error.cause and "'x'" in error.cause and "torch._dynamo.mark_dynamic" in error.cause  # the likely cause, named (helper-67)


def test_torchs_automatic_dynamic_shapes_are_refused_at_decoration():
    """dynamic=None raised at a draft's second size, and torch keeps the sizes it saw per source line,
    so one worker's calls made another's first call dynamic: refused where it is asked for."""
    with pytest.raises(ValueError, match="dynamic=None"):
        draft_loop(_scaled, dynamic=None)


def test_inductor_skip_message_is_translated():
    message = 'skipping cudagraphs due to mutated inputs (1 instances). Found from : \n   File "/w/d.py", line 12, in f\n    c.add_(1)'
    error = translate.from_exception(RuntimeError(message))
    assert isinstance(error, CudagraphSkipError)
    assert error.where == "/w/d.py:12" and "mutated inputs (1 instances)" in error.cause
    assert translate.from_exception(RuntimeError("unrelated")) is None


# ---- recompiles ------------------------------------------------------------------------------------


def _steps(x, steps: int):
    for _ in range(steps):
        x = x * 2
    return x


def test_recompile_past_the_limit_says_what_changed():
    draft = draft_loop(_steps, max_compiles=1)
    draft(torch.randn(4), 1)
    draft(torch.randn(4), 1)
    with pytest.raises(RecompileError) as info:
        draft(torch.randn(4), 2)  # <- recompile
    assert info.value.where == _line("recompile")
    assert "steps: 2, was 1" in info.value.cause
    with pytest.raises(RecompileError) as again:  # the refused compile is not counted as the last one made
        draft(torch.randn(4), 2)
    assert "compile number 2 " in again.value.cause and "steps: 2, was 1" in again.value.cause
    assert torch.equal(draft(torch.ones(4), 1), torch.full((4,), 2.0))


def test_recompile_names_a_switch_to_inference_tensors():
    """A caller switching from no_grad to inference_mode passes inference tensors, and the draft recompiles
    (Dynamo guards the tensors' dispatch keys): the error said "no argument changed as a whole"."""
    draft = draft_loop(_steps, max_compiles=1)
    draft(torch.randn(4), 1)
    with torch.inference_mode(), pytest.raises(RecompileError) as info:
        draft(torch.randn(4), 1)
    assert "x: float32 of shape (4,) on cpu (an inference tensor), was float32 of shape (4,) on cpu" in info.value.cause


def _over_caches(x, caches, meta):
    for cache in caches:
        x = x + cache.sum() * meta["scale"]
    return x


def test_recompile_names_the_entry_of_a_list_or_dict_that_changed():
    """A list of KV tensors (and a dict of settings) was described as "list object" before and after, so
    the error said "no argument changed as a whole" when one cache's shape changed."""
    draft = draft_loop(_over_caches, max_compiles=1)
    draft(torch.randn(4), [torch.randn(2, 8), torch.randn(2, 8)], {"scale": 2.0})
    with pytest.raises(RecompileError) as info:
        draft(torch.randn(4), [torch.randn(2, 8), torch.randn(3, 8)], {"scale": 2.0})
    assert "caches[1]: float32 of shape (3, 8) on cpu, was float32 of shape (2, 8) on cpu" in info.value.cause, info.value.cause
    with pytest.raises(RecompileError) as info:
        draft(torch.randn(4), [torch.randn(2, 8)] * 3, {"scale": 3.0})
    assert "caches: list of 3, was list of 2" in info.value.cause and "meta['scale']: 3.0, was 2.0" in info.value.cause, info.value.cause


def test_the_guard_named_is_the_one_of_the_last_compile():
    """It was the first compile's (steps: 4, was 3, with "guard failed: steps == 1")."""
    draft = draft_loop(_steps, max_compiles=3)
    for steps in (1, 2, 3):
        draft(torch.randn(4), steps)
    with pytest.raises(RecompileError) as info:
        draft(torch.randn(4), 4)
    assert "steps: 4, was 3 (Dynamo: guard failed: steps == 3)" in info.value.cause, info.value.cause
    with pytest.raises(RecompileError) as again:  # another refusal: its own guard, not the one before
        draft(torch.randn(5), 3)
    assert "(Dynamo: guard failed: tensor 'x' size mismatch" in again.value.cause, again.value.cause


def test_max_compiles_governs_above_torchs_recompile_limit():
    # A server captures one graph per padded batch size: more than torch's limit (8 by default).
    draft = draft_loop(_steps, max_compiles=12)
    with torch._dynamo.config.patch(recompile_limit=2):
        for batch in range(1, 13):
            draft(torch.randn(batch), 1)
        assert torch._dynamo.config.recompile_limit == 2  # raised only while the draft compiled
        with pytest.raises(RecompileError) as info:
            draft(torch.randn(13), 1)  # <- thirteenth
    assert info.value.where == _line("thirteenth")
    assert "x: float32 of shape (13,) on cpu, was float32 of shape (12,) on cpu" in info.value.cause


def test_each_draft_has_its_own_compile_budget():
    # Two drafts of one function (two worker instances, say) do not share Dynamo's cache or its limit.
    first, second = draft_loop(_steps, max_compiles=1), draft_loop(_steps, max_compiles=1)
    with torch._dynamo.config.patch(recompile_limit=1):
        first(torch.randn(4), 1)
        second(torch.randn(4), 2)  # another Python value: its own first compile
        assert torch.equal(second(torch.ones(4), 2), torch.full((4,), 4.0))


# From a review of the one-region promise on draft-worker patterns (each failed before its fix).


def _greedy(weight, tok, steps=3):
    out = []
    for _ in range(steps):
        tok = torch.softmax(weight[tok], -1).argmax(-1)
        out.append(tok)
    return torch.stack(out, -1)


def _item_as_index(weight, tok):
    t = _greedy(weight, tok)
    return t[0, t[0, 0].item() % 3]  # <- item index


def test_a_host_read_used_as_an_index_is_a_host_sync_error():
    weight, tok = torch.randn(16, 16), torch.tensor([1, 2])
    with pytest.raises(HostSyncError, match="used as a Python int") as info:
        draft_loop(_item_as_index)(weight, tok)
    assert info.value.where == _line("item index")


def _confidence_of_the_first_row(weight, tok):
    probs = torch.softmax(weight[tok], -1)
    token = probs.argmax(-1)
    return probs[0, token[0]]  # <- 0-d index


def test_a_zero_dim_tensor_index_is_a_host_sync_used_as_an_int():
    # HF assisted generation's confidence check indexes the probabilities with a 0-d tensor,
    # probs[0, token[0]]: Dynamo reads it on the host ("Could not extract specialized integer"), which
    # was reported as a data-dependent size with a padding fix
    with pytest.raises(HostSyncError, match="used as a Python int") as info:
        draft_loop(_confidence_of_the_first_row)(torch.randn(16, 16), torch.tensor([1, 2]))
    assert info.value.where == _line("0-d index")
    assert "x[0, t[:1]]" in info.value.fix


def _split_by_a_count(x):
    return torch.split(x, x[0].nonzero().shape[0], dim=1)[0]  # <- count as a size


def test_a_data_dependent_size_keeps_the_padding_fix_not_the_index_one():
    # the same "Could not extract specialized integer" from a size (size-like symbols): padding fits, gather does not.
    # torch 2.11 raises "Could not guard on data-dependent expression" inside split's decomposition: it was
    # worded as the draft's own Python decision
    with pytest.raises(HostSyncError, match="data-dependent value read on the host") as info:
        draft_loop(_split_by_a_count)(torch.randn(2, 8))
    assert info.value.where == _line("count as a size")
    assert "pad to a static size" in info.value.fix


def _try_matmul(t):
    try:
        r = t @ torch.ones(5, 5)  # <- caught
    except RuntimeError:
        r = t + 1
    return r


def test_an_error_the_draft_catches_says_so():
    """Eager catches the failing matmul; a traced draft cannot: the error must not claim eager raises it."""
    with pytest.raises(DraftCaptureError) as info:
        draft_loop(_try_matmul)(torch.ones(2, 3))
    assert "try/except around a tensor op" in info.value.fix


def test_a_partial_draft_runs_without_the_fast_path():
    import functools
    import warnings

    draft = draft_loop(functools.partial(_greedy, steps=2))
    weight, tok = torch.randn(16, 16), torch.tensor([1, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU warning, and no fast replay for a callable without code
        for _ in range(3):
            assert torch.equal(draft(weight, tok), _greedy(weight, tok, steps=2))


def test_a_partial_draft_keeps_its_compile_budget():
    """A draft without code of its own has no cache entries to count: the reset check must not read that as a
    reset (its first version cleared the compiles counted on every compile: no RecompileError)."""
    import functools

    draft = draft_loop(functools.partial(_steps, steps=1), max_compiles=2)
    draft(torch.randn(2))
    draft(torch.randn(3))
    with pytest.raises(RecompileError):
        draft(torch.randn(4))


class _SlottedWorker:
    __slots__ = ("weight",)

    def __init__(self):
        self.weight = torch.randn(16, 16)

    def step(self, tok):
        return _greedy(self.weight, tok)


_SlottedWorker.fast = draft_loop(_SlottedWorker.step)


def test_a_method_draft_on_a_worker_with_slots():
    worker, tok = _SlottedWorker(), torch.tensor([1, 2])
    for _ in range(3):
        assert torch.equal(worker.fast(tok), worker.step(tok))
    assert worker.fast is worker.fast  # one compiled draft per instance, held without a weak reference


def test_a_draft_refused_under_a_dispatch_mode_leaves_dynamos_settings():
    """torch.compile(dynamic=False) patches automatic_dynamic_shapes off for the call and, when Dynamo skips the
    frame under a TorchDispatchMode, leaves it off (plain torch.compile too): every later compile in the
    process specialised each new batch size (a probs="ones" test two files later saw it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    before = (torch._dynamo.config.automatic_dynamic_shapes, torch._dynamo.config.assume_static_by_default)
    with Passthrough(), pytest.raises(DraftCaptureError):
        draft_loop(lambda hidden: torch.softmax(hidden, -1).argmax(-1))(torch.randn(2, 8))
    assert (torch._dynamo.config.automatic_dynamic_shapes, torch._dynamo.config.assume_static_by_default) == before


def test_a_dispatch_mode_dynamo_compiles_under_is_no_capture_error():
    """A TorchDispatchMode that opts out of compile internals (ignore_compile_internals: torch's DebugMode,
    say) does not make Dynamo skip the frame: the draft compiles under it, as under plain torch.compile."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ignored(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls):
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def draft(hidden):
        return torch.softmax(hidden * 2, -1).topk(1, -1).indices

    fast, hidden = draft_loop(draft), torch.randn(2, 8)
    with Ignored():
        assert torch.equal(fast(hidden), draft(hidden)) and len(fast.compiles) == 1


def test_a_draft_under_a_dispatch_mode_is_a_draft_capture_error():
    """Dynamo skips a frame run under a user TorchDispatchMode whole; fullgraph then raises torch's "found
    no compiled frames": a DraftCaptureError naming the draft's line and the reason."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def draft(hidden):
        return torch.softmax(hidden * 2, -1).topk(1, -1).indices

    fast = draft_loop(draft)
    with Passthrough(), pytest.raises(DraftCaptureError, match="dispatch mode") as raised:
        fast(torch.randn(2, 8))
    assert f"{__file__}:" in str(raised.value)
