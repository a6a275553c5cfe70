"""`@draft_loop`: compile a draft (seed + recurrent steps) into one captured region, or say why not.

    @draftfuse.draft_loop
    def draft(model, tokens, hidden, kv_cache, steps: int = 3): ...

    class Worker:
        @draftfuse.draft_loop(options={"probs": "ones"})
        def draft(self, tokens, hidden): ...

The function is compiled with torch.compile(fullgraph=True) through draftfuse's pipeline, by default
with mode="reduce-overhead" (CUDA graph trees), on its first call. A compile goes one way:
options (parsed once, at decoration) -> prepare (draftfuse's passes on the Dynamo graph) -> capture
checks (checks.py) -> lower (Inductor, draftfuse's post-grad pass) -> replay. On every call:

  * Outputs are the caller's: no later call writes them, although a CUDA graph replay writes the same
    output tensors every time. Two spare recordings (option "spare_recordings") hand out their outputs
    while nothing else holds them (recorder.py), so a caller that drops or keeps only the last draft's
    outputs pays no copy; one that keeps more gets copies. (Outputs that are input tensors themselves,
    an argument or a tensor in a list, tuple or dict argument, e.g. a returned KV cache, are returned
    as they are.)
    `zero_copy_outputs=True` returns the main recording's own outputs: no spare recordings, valid only
    until the next call of this draft.
  * Tensor inputs the draft writes in place (KV caches) are found in the traced graph and marked
    static (torch._dynamo.mark_static_address), since CUDA graphs skip on writes to other inputs.
    Their address is checked on every call (a different tensor raises CudagraphSkipError naming the
    argument: a replay writes into the address it recorded), and so is their memory against the other
    tensor arguments: a written input sharing memory with another argument that did not share it when
    traced raises, since the compiled draft assumes the memory the trace saw.
  * Anything that stops the draft from being one captured region raises a DraftCaptureError naming the
    user's file and line (translate.py): graph breaks, host syncs (for a data-dependent size, the first
    op whose size or value depends on the data), CPU inputs, dynamic shapes, more than `max_compiles`
    compiles (each distinct shape or Python value the draft specialises on costs one).
  * The call runs without autograd (torch.no_grad): a draft proposes tokens, nothing is trained
    through it. With a profiler running, it is a torch.profiler.record_function("draftfuse.draft:<name>") span.
  * On a CPU draft it runs compiled, without CUDA graphs, and warns once that they need a CUDA device.

Each draft (each instance's, for methods) compiles its own copy of the function's code object, so
Dynamo's compile cache and recompile limit are the draft's own: `max_compiles` governs however many
drafts or worker instances exist, above torch's global recompile_limit when asked (the limit is raised
only while the draft compiles). Methods: methods.py (one bound draft per instance, kept with it).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import traceback
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo import eval_frame as _eval_frame

from draftfuse.graph.values import input_name, user_frame
from draftfuse.options import Options
from draftfuse.runtime import checks
from draftfuse.runtime.binding import binder, sync_defaults
from draftfuse.runtime.errors import DraftCaptureError, RecompileError, causes
from draftfuse.runtime.hooks import HookWatch
from draftfuse.runtime.methods import AsMethod
from draftfuse.runtime.pipeline import CompileRecord, lower, prepare
from draftfuse.runtime.recorder import GraphRecorder, log
from draftfuse.runtime.replay import IDENTITY_GUARD, Replay, warn_no_fast_replay
from draftfuse.runtime.tracing import caller_location, capture_error, own_code, refuse_dispatch_modes, shape_settings

_CPU_WARNING = (
    "draftfuse: draft {name!r} runs on the CPU: it is compiled, but CUDA graphs need a CUDA device, "
    "so its CUDA graphs (mode='reduce-overhead', or the option triton.cudagraphs) are not recorded here"
)


class DraftLoop(AsMethod):
    """A draft function (or a method bound to one instance) compiled as one region; see the module doc."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        options: Options,
        zero_copy_outputs: bool,
        dynamic: bool | None,
        max_compiles: int,
        instance: Any = None,
    ) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.inline_fn = fn  # what a trace of an enclosing compiled region traces (fold: without its marker)
        self._options = options
        self._zero_copy, self._dynamic, self._max_compiles = zero_copy_outputs, dynamic, max_compiles
        self._instance = instance
        self._attribute: str | None = None  # the class attribute this draft was assigned to
        self._looked_up = False  # made by a decorated method's lookup (kept in the instance under a private name)
        self._keys = ("", "")  # where an instance's __dict__ keeps its draft, and a replacement assigned to it
        # for instances without __dict__, by identity (not by their __eq__: equal workers are distinct); held
        # for good, the instance with them (its draft refers to it)
        self._bound: dict[int, DraftLoop] = {}
        module_call = isinstance(instance, torch.nn.Module) and fn is getattr(type(instance), "__call__", None)
        # the name in spans, warnings and errors: a module draft's is its class's (not Module._wrapped_call_impl)
        self._name = type(instance).__name__ if module_call else getattr(fn, "__qualname__", repr(fn))
        self._span = f"draftfuse.draft:{self._name}"
        self._code_fn = own_code(fn)  # Dynamo's cache for this draft lives on this copy's code
        self._compiled = torch.compile(self._code_fn, fullgraph=True, dynamic=dynamic, backend=_weak_backend(self))
        code = getattr(self._code_fn, "__code__", None)
        if code is not None:  # a deleted draft (a worker's, say) frees its compiled code, recordings and pools
            weakref.finalize(self, _eval_frame.reset_code, code).atexit = False
        self.compiles: list[CompileRecord] = []  # one per Dynamo graph compiled for this draft
        self._bind = binder(fn, self._code_fn)
        self._replays: list[Replay] = []  # recorded calls that run without Dynamo (replay.py)
        # each compiled region's recorder, with the graph's placeholders; held weakly: Dynamo's cache entry holds
        # the region, and torch._dynamo.reset() (or an evicted entry) frees it with its CUDA graphs
        self._recorder_refs: list[tuple[weakref.ref[GraphRecorder], list[torch.fx.Node]]] = []
        self._signatures: list[dict[str, str]] = []  # the arguments that led to each compile
        self._anew = ""  # why the draft's code was dropped for a compile anew (its compiles stay counted)
        self._current_call: tuple[tuple, dict] | None = None
        self._warned_cpu = self._warn_cpu = False
        # a module's call traces its hooks, which no guard holds: watched here (hooks.py)
        self._hooks = HookWatch(instance) if module_call else None

    def __deepcopy__(self, memo: dict) -> DraftLoop:
        """copy.deepcopy of a worker: the copy's draft is its own, bound to the copy and compiled afresh on its
        first call (a deep copy of the compiled state would share the original's code cache and backend); an
        unbound draft is itself, as a function is (a fold's composition too: its closure is the original's)."""
        if self._instance is None:
            return self
        instance = copy.deepcopy(self._instance, memo)
        if id(self) in memo:  # copying the instance copied this draft (it is in the instance's __dict__)
            return memo[id(self)]
        return self._bound_to(instance)

    def __copy__(self) -> DraftLoop:
        return self  # as for a function (copy.copy of a worker shares its __dict__'s values; __get__ tells them apart)

    def __reduce__(self) -> Any:
        """Pickling a worker (torch.save): a draft it keeps as an attribute (draft_loop(self.step)) loads bound to
        the loaded worker, compiled afresh on its first call; a decorated method's is left out (its next lookup
        makes one). An unbound draft pickles by its module and name, as a function does."""
        if self._instance is None:
            return self.__qualname__
        if self._looked_up:
            return _no_draft, ()
        return _bound_draft, (self._fn, self._instance, self._settings())

    def _bound_to(self, instance: Any) -> DraftLoop:
        return _bound_draft(self._fn, instance, self._settings())

    def _settings(self) -> dict[str, Any]:
        return dict(options=self._options, zero_copy_outputs=self._zero_copy, dynamic=self._dynamic, max_compiles=self._max_compiles)

    # ---- the call ----

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._instance is not None:
            args = (self._instance, *args)
        if torch.compiler.is_dynamo_compiling():  # called inside another compiled region (a draft in a draft): traced there
            return self.inline_fn(*args, **kwargs)
        if self._hooks is not None and self._hooks.changed():
            self._compile_anew("a hook of the draft module (or a global module hook) was added or removed")
        # a stance other than the default (force_eager, say) is honoured by Dynamo's path, which reads it per call
        f_locals = self._bind(args, kwargs) if self._replays and _eval_frame._stance.stance == "default" else None
        if f_locals is not None:
            explain = log.isEnabledFor(logging.DEBUG)
            grad = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)  # as torch.no_grad(), at a third of its cost: the guards hold the grad mode the draft compiled under
            try:
                for i, replay in enumerate(self._replays):
                    if replay.matches(f_locals, explain):
                        if i:  # the last hit first: a server's batch size holds for many calls (a miss is a guard check)
                            self._replays.insert(0, self._replays.pop(i))
                        if torch.autograd._profiler_enabled():
                            with torch.profiler.record_function(self._span):
                                return replay.run(f_locals, clone=not self._zero_copy)
                        return replay.run(f_locals, clone=not self._zero_copy)
            finally:
                torch._C._set_grad_enabled(grad)
        return self._call_through_dynamo(args, kwargs)

    def _compile_anew(self, why: str) -> None:
        """Drop the draft's compiled code and recordings: its next call compiles, and counts against max_compiles."""
        log.info("draftfuse: %s since %r was compiled: compiling it anew", why, self._name)
        self._replays, self._anew = [], why
        if (code := getattr(self._code_fn, "__code__", None)) is not None:
            _eval_frame.reset_code(code)

    def _call_through_dynamo(self, args: tuple, kwargs: dict) -> Any:
        refuse_dispatch_modes()
        self._current_call = (args, kwargs)
        entry_run = self._entry_to_run(args, kwargs)  # before the call: the draft may change what guards read
        try:
            span = torch.profiler.record_function(self._span) if torch.autograd._profiler_enabled() else contextlib.nullcontext()
            limit = torch._dynamo.config.recompile_limit
            raised = torch._dynamo.config.patch(recompile_limit=self._max_compiles + 1) if self._max_compiles >= limit else contextlib.nullcontext()
            sync_defaults(self._code_fn, self._fn)
            # torch 2.11-2.13 can fail a compile under inference_mode leaving its dispatch keys set (every
            # later op then fails an internal assert): the keys this thread had are put back, whatever happens
            with span, raised, torch._C._PreserveDispatchKeyGuard(), torch.no_grad():
                shapes = shape_settings()
                try:
                    out = self._compiled(*args, **kwargs)
                except BaseException as exc:
                    # a mode guard torch left alive in a frame restores its stale state when freed: at once, here
                    # (no state shows it until then), then the guards above put back the caller's
                    _release_frames(exc)
                    shape_settings(shapes)
                    raise
        except Exception as exc:
            self._forget_call()
            translated = capture_error(exc, self._fn, self._dynamic, args, kwargs)
            if translated is None:
                raise
            error, cause = translated
            if not error.where:  # raised about the call itself (its arguments): point at the caller
                error = type(error)(error.cause, where=caller_location(), fix=error.fix)
            raise error.with_traceback(None) from cause
        finally:
            self._current_call = None
        if self._warn_cpu:
            self._warn_cpu = False
            warnings.warn(_CPU_WARNING.format(name=self._name), stacklevel=user_frame()[1])
        # The outputs are the caller's already, wherever Dynamo's code put them (returned, in an object, in an
        # attribute): the recorder hands out outputs of their own to a call through Dynamo (zero_copy_outputs:
        # the recording's), and a region run plainly (its first call, or off CUDA) makes new ones.
        self._record_replay(args, kwargs, out, entry_run)
        return out

    @property
    def _recorders(self) -> list[tuple[GraphRecorder, list[torch.fx.Node]]]:
        found = [(ref, ref(), p) for ref, p in self._recorder_refs]
        self._recorder_refs = [(ref, p) for ref, r, p in found if r is not None]
        return [(r, p) for _, r, p in found if r is not None]

    def _cache_entries(self) -> list[Any]:
        """Dynamo's cache entries for the draft's code; none for a callable without code of its own (a
        functools.partial: its calls stay on the Dynamo path, and _build_replay says so)."""
        code = getattr(self._code_fn, "__code__", None)
        return _eval_frame._debug_get_cache_entry_list(code) if code is not None else []

    def _entry_to_run(self, args: tuple, kwargs: dict) -> tuple[set, Any]:
        """(the compiled code of each cache entry of the draft's code, that of the entry Dynamo will run for
        this call: the first whose guards pass, or None when it compiles a new one), before the call."""
        f_locals = self._bind(args, kwargs)
        entries = self._cache_entries()
        with torch.no_grad():  # as the call runs
            first = next((e.code for e in entries if _passes(e, f_locals)), None)
        return {e.code for e in entries}, first

    def _record_replay(self, args: tuple, kwargs: dict, out: Any, entry_run: tuple[set, Any]) -> None:
        """After a call through Dynamo, record it as a Replay where that is sound (replay.py)."""
        try:
            self._build_replay(args, kwargs, out, entry_run)
        finally:
            self._forget_call()

    def _forget_call(self) -> None:
        """The recorders hold no tensor of the call just made, and count it as seen (a call that raised
        builds no Replay, and the next call's recorder is still told apart by its count)."""
        for recorder, _ in self._recorders:
            recorder.last_call_inputs, recorder.handed_out = (), None
            recorder.last_seen = recorder.calls

    def _build_replay(self, args: tuple, kwargs: dict, out: Any, entry_run: tuple[set, Any]) -> None:
        self._replays = [r for r in self._replays if not r.stale]
        # the recorder this call ran: the one whose count moved; it must have captured
        ran = [(r, p) for r, p in self._recorders if r.calls == r.last_seen + 1]  # (last_seen: see _forget_call)
        if len(ran) != 1 or not ran[0][0].captured:
            return
        recorder, placeholders = ran[0]
        # one Replay per recording; more only while each holds arguments to be one object (_template), up to 4
        mine = [x for x in self._replays if x.recorder is recorder]
        if recorder.refused == recorder.generation or len(mine) >= 4 or any(not x.aliased for x in mine):
            return  # (refused: this recording cannot run without Dynamo, the log said why: do not ask again)
        # The entry that ran: the one whose guards passed before the call, else the one this call compiled. Its
        # guards must pass after the call too: a draft that changes what they read (a flag it clears) would
        # otherwise leave a Replay whose guards describe one call and whose recording another.
        before, ran_code = entry_run
        entries = self._cache_entries()
        new = [e for e in entries if e.code not in before]
        entry = next((e for e in entries if e.code is ran_code), None) if ran_code is not None else new[0] if len(new) == 1 else None
        f_locals = self._bind(args, kwargs)
        with torch.no_grad():  # as the call ran
            passes = entry is not None and _passes(entry, f_locals)
        if not passes:  # own_code gives the draft a frame of its own: should torch.compile still run it inside another
            recorder.refused = recorder.generation
            warn_no_fast_replay("the compiled entry that ran does not pass its guards for this call's arguments as they are after "
                                "the call (the draft changed what they read: an argument or attribute it mutates), or torch.compile "
                                "ran the draft inside a wrapper frame")
            return
        replay = Replay.build(entry, recorder, placeholders, f_locals, out)
        if replay is None:
            recorder.refused = recorder.generation
        else:
            self._replays.insert(0, replay)

    # ---- the compile: prepare -> checks -> lower ----

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self._check_recompiles()
        options = self._options
        device = checks.draft_device(gm)
        own_graph = options.uses_cudagraphs or device.type == "cpu"
        if options.uses_cudagraphs:
            # draftfuse records the CUDA graph itself (recorder.py): Inductor compiles the region without
            options = options.with_inductor(**{"triton.cudagraphs": False})
        if self._options.uses_cudagraphs and device.type == "cpu" and not self._warned_cpu:
            self._warned_cpu = True
            self._warn_cpu = True  # once the call returns, at the caller's line

        prepared = prepare(gm, options)
        found = checks.obstacles(prepared.graph_module, allow_dynamic=self._dynamic is True)
        if found:
            raise found[0]
        written = checks.written_inputs(prepared.graph_module)
        for item in written:
            if not item.static:
                checks.make_static(prepared.graph_module, example_inputs, item)
        compiled, record = lower(prepared, example_inputs, options)
        self.compiles.append(record)
        placeholders = prepared.graph_module.graph.find_nodes(op="placeholder")
        if written:
            compiled = checks.guard_written_inputs(compiled, written, example_inputs, [input_name(p) for p in placeholders])
        if not own_graph:
            return compiled
        written_at = {item.index for item in written}
        # read where they are: weights, buffers and written inputs (a plain tensor attribute is read per call)
        static = [checks.is_static(p) and (i in written_at or checks.is_parameter_or_buffer(p)) for i, p in enumerate(placeholders)]
        recorder = GraphRecorder(compiled, static, written_at, device, spares=0 if self._zero_copy else options.spare_recordings,
                                 hand_out=not self._zero_copy)
        self._recorder_refs.append((weakref.ref(recorder), placeholders))
        return _translating_capture_errors(recorder)

    def _check_recompiles(self) -> None:
        anew, self._anew = self._anew, ""
        if hasattr(self._code_fn, "__code__") and not self._cache_entries() and not anew:
            self._signatures.clear()  # its code's entries are gone (torch._dynamo.reset()), and the compiles counted
        signature = self._signature()
        if len(self._signatures) < self._max_compiles:
            self._signatures.append(signature)  # a compile refused is not one: the next error compares with the last made
            return
        change = checks.describe_change(self._signatures[-1], signature) if self._signatures else ""
        guard = checks.last_guard_failure(getattr(self._code_fn, "__code__", None))
        raise RecompileError(
            f"draft {self._name!r} needs compile number {len(self._signatures) + 1} "
            f"(max_compiles={self._max_compiles}): "
            + (f"what changed since the last compile: {change}" if change else "no argument changed as a whole")
            + (f" ({anew})" if anew else f" (Dynamo: guard failed: {guard})" if guard else ""),
            fix=(
                "register the draft module's hooks before its first call (each change compiles it anew), or raise max_compiles"
                if anew else
                "load new weights into the ones the draft was compiled with (p.copy_(w), load_state_dict), or set "
                "p.data = w (records the graph again, no compile): each new Parameter or buffer object costs a compile"
                if IDENTITY_GUARD in guard else
                "keep shapes and Python arguments the same on every call (pass changing values as tensors, pad "
                "batches to a few fixed sizes), or raise max_compiles if each is expected"
            ),
        )

    def _signature(self) -> dict[str, str]:
        if self._current_call is None:
            return {}
        args, kwargs = self._current_call
        try:
            bound = inspect.signature(self._fn).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return {}
        return checks.describe_arguments(bound.arguments)


def _release_frames(exc: BaseException) -> None:
    """Clear the locals of the frames in `exc`'s tracebacks (its causes' too). A compile that failed under
    inference_mode can leave torch's own mode guards alive in those frames (torch 2.11-2.13); freed when the
    error is, later, they would set this thread's dispatch keys and grad mode back to what they were inside
    the compile. Cleared here, they do so at once, and the guards around the call then restore the caller's."""
    for each in causes(exc):
        traceback.clear_frames(each.__traceback__)


def _no_draft() -> None:
    """What a decorated method's draft loads as from a pickled worker: nothing, so that its lookup makes one."""
    return None


def _bound_draft(fn: Callable[..., Any], instance: Any, settings: dict[str, Any]) -> DraftLoop:
    """A new draft of `fn` bound to `instance` (a copied or loaded worker's): nothing compiled yet."""
    return DraftLoop(fn, instance=instance, **settings)


def _weak_backend(loop: DraftLoop) -> Callable[..., Any]:
    """The draft's backend, holding it weakly: torch keeps every backend it was given for good, which would
    keep the draft (its instance, weights and CUDA graphs) alive after the caller dropped it. On the draft's
    end its code's cache entries go (reset_code): with them Dynamo drops the compiled regions it keeps."""
    draft = weakref.ref(loop)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return draft()._compile(gm, example_inputs)

    return backend


def _passes(entry: Any, f_locals: dict[str, Any] | None) -> bool:
    try:
        return f_locals is not None and bool(entry.guard_manager.check(f_locals))
    except Exception:
        return False


def _translating_capture_errors(recorder: GraphRecorder) -> Callable[..., Any]:
    def run(*inputs: Any) -> Any:
        try:
            return recorder(*inputs)
        except RuntimeError as exc:
            if "capture" not in str(exc).lower() or isinstance(exc, DraftCaptureError):
                raise
            raise checks.capture_failed_error(exc) from exc

    return run


def draft_loop(
    fn: Callable[..., Any] | None = None,
    *,
    mode: str | None = "reduce-overhead",
    options: dict[str, Any] | None = None,
    zero_copy_outputs: bool = False,
    dynamic: bool = False,
    max_compiles: int = 4,
) -> Any:
    """Compile a draft as one captured region (see the module docstring): a function, a method (decorated
    in its class, or bound: `draft_loop(worker.step)`), or an nn.Module (its call, hooks included).

    Usable bare (`@draft_loop`) or with arguments (`@draft_loop(mode=..., options=...)`).
    mode/options: as for the draftfuse backend (`options` may mix draftfuse's and Inductor's keys);
        checked here, at decoration.
    zero_copy_outputs: return the CUDA graph's own output tensors, overwritten by the next call.
    dynamic: torch.compile's `dynamic`; False (default) compiles one graph per input shape, which is
        what CUDA graphs want; True allows symbolic shapes: one compile serves every size of 2 or more
        (torch specialises a size of 1: a compile of its own), every call goes through Dynamo (no fast
        replay), and its CUDA graph is recorded for one size at a time (a call of other sizes runs the
        region without it and records again for them), which suits sizes that change now and then.
        None (torch's automatic dynamic shapes) is refused: its second size would raise, and torch keeps
        its record of sizes seen per source line, so one worker's sizes would make another's first
        call dynamic.
    max_compiles: compiles allowed per draft (per instance for methods) before RecompileError, whatever
        torch's recompile_limit is.
    """
    if dynamic is not True and dynamic is not False:
        raise ValueError(f"draft_loop(dynamic={dynamic!r}): pass False (one graph per input shape, the default) or True (one graph for every size)")
    if zero_copy_outputs is not True and zero_copy_outputs is not False:
        raise ValueError(f"draft_loop(zero_copy_outputs={zero_copy_outputs!r}): pass True or False")
    if not isinstance(max_compiles, int) or isinstance(max_compiles, bool) or max_compiles < 1:
        raise ValueError(f"draft_loop(max_compiles={max_compiles!r}): pass an int >= 1")
    parsed = Options.parse(mode, options)
    if fn is None:
        return functools.partial(_decorate, options=parsed, zero_copy_outputs=zero_copy_outputs, dynamic=dynamic, max_compiles=max_compiles)
    return _decorate(fn, options=parsed, zero_copy_outputs=zero_copy_outputs, dynamic=dynamic, max_compiles=max_compiles)


def _decorate(fn: Callable[..., Any], **settings: Any) -> DraftLoop:
    if isinstance(fn, type):  # calling it makes an instance: the draft would be the constructor
        hint = "an instance (draft_loop(model)) or its forward" if issubclass(fn, torch.nn.Module) else "the method that drafts"
        raise TypeError(f"draft_loop({fn.__name__}): a class; decorate {hint}")
    if not callable(fn):
        raise TypeError(f"draft_loop({fn!r}): pass the draft function, a method or an nn.Module")
    if isinstance(fn, torch.nn.Module):
        fn = fn.__call__  # its hooks and forward, as torch.compile(module) runs them
    if isinstance(fn, types.MethodType):  # a bound method: the function, for this instance (as a decorated method)
        return DraftLoop(fn.__func__, instance=fn.__self__, **settings)
    return DraftLoop(fn, **settings)
