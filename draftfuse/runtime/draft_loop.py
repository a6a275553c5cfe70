"""`@draft_loop`: compile a draft (seed + recurrent steps) into one captured region, or say why not.

    @draftfuse.draft_loop
    def draft(model, tokens, hidden, kv_cache, steps: int = 3): ...

    class Worker:
        @draftfuse.draft_loop(options={"probs": "ones"})
        def draft(self, tokens, hidden): ...

The function is compiled with torch.compile(fullgraph=True) through the draftfuse backend, by default
with mode="reduce-overhead" (CUDA graph trees), on its first call. On every call:

  * Outputs are cloned, because CUDA graph trees hand out the same output tensors on every replay: an
    output kept across calls would be overwritten by the next draft. (Outputs that are input tensors
    themselves, e.g. a returned KV cache, are returned as they are.) `zero_copy_outputs=True` returns
    the graph's own outputs: no copy, valid only until the next call of this draft.
  * Tensor inputs the draft writes in place (KV caches) are found in the traced graph and marked
    static (torch._dynamo.mark_static_address), since CUDA graphs skip on writes to other inputs.
    Their address is then checked on every call: a different tensor raises CudagraphSkipError naming
    the argument, because a replay would write into the address it recorded.
  * Anything that stops the draft from being one captured region raises a DraftCaptureError (see
    capture.py): graph breaks, host syncs, CPU inputs, dynamic shapes, more than `max_compiles`
    compiles (each distinct shape or Python value that the draft specialises on costs one).
  * The call runs inside torch.profiler.record_function("draftfuse.draft:<qualname>"), and without
    autograd (torch.no_grad): a draft proposes tokens, nothing is trained through it, and a graph
    compiled for backward would save activations for a backward that never comes.
  * On a CPU draft it runs compiled, without CUDA graphs, and warns once that they need a CUDA device.

Methods: each instance gets its own bound draft (created on first access, stored on the instance),
with its own compiled region, compile records and recompile budget. Dynamo keeps compiled graphs on
the function's code object and guards on the backend, so each instance adds one entry there, and
torch's recompile_limit (8 by default) bounds the number of live worker instances per draft method.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_map_only

from draftfuse.runtime import capture
from draftfuse.runtime.backend import CompileRecord, compile_graph, inductor_config_patches, split_options
from draftfuse.runtime.errors import RecompileError

_CPU_WARNING = (
    "draftfuse: draft {name!r} runs on the CPU: it is compiled, but CUDA graphs need a CUDA device, "
    "so mode={mode!r} replays nothing here"
)


class DraftLoop:
    """A draft function (or a method bound to one instance) compiled as one region; see the module doc."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        mode: str | None,
        options: dict[str, Any] | None,
        zero_copy_outputs: bool,
        dynamic: bool | None,
        max_compiles: int,
        instance: Any = None,
    ) -> None:
        split_options(options)  # a bad option fails here, at decoration, not at the first call
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._settings = dict(
            mode=mode, options=options, zero_copy_outputs=zero_copy_outputs, dynamic=dynamic, max_compiles=max_compiles
        )
        self._instance = instance
        self._span = f"draftfuse.draft:{fn.__qualname__}"
        self._compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=self._compile)
        self.compiles: list[CompileRecord] = []  # one per Dynamo graph compiled for this draft
        self._call_signatures: list[dict[str, str]] = []  # the arguments that led to each compile
        self._current_call: tuple[tuple, dict] | None = None
        self._warned_cpu = False

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        name = self._fn.__name__
        bound = instance.__dict__.get(name)
        if not isinstance(bound, DraftLoop):
            bound = DraftLoop(self._fn, **self._settings, instance=instance)
            instance.__dict__[name] = bound  # later lookups find it before this (non-data) descriptor
        return bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._instance is not None:
            args = (self._instance, *args)
        self._current_call = (args, kwargs)
        try:
            # the span costs ~10 us per call even with no profiler running: only open it for one
            span = torch.profiler.record_function(self._span) if torch.autograd._profiler_enabled() else nullcontext()
            with span, torch.no_grad():
                out = self._compiled(*args, **kwargs)
        except Exception as exc:
            error = capture.capture_error(exc)
            if error is None:
                raise
            # Our own errors (raised inside the backend) need no Dynamo wrapper around them;
            # a translated torch error stays attached as the cause, for its full text.
            own = error is exc or error is getattr(exc, "inner_exception", None)
            if not error.where:  # raised about the call itself (its arguments): point at the caller
                caller = sys._getframe(1)
                error = type(error)(error.cause, where=f"{caller.f_code.co_filename}:{caller.f_lineno}", fix=error.fix)
            raise error.with_traceback(None) from (None if own else exc)
        finally:
            self._current_call = None
        if self._settings["zero_copy_outputs"]:
            return out
        inputs = {id(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        return tree_map_only(torch.Tensor, lambda t: t if id(t) in inputs else t.clone(), out)

    # ---- the backend this draft compiles with: capture checks around draftfuse's backend ----

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self._check_recompiles()
        device = capture.draft_device(gm)
        mode = self._settings["mode"]
        options = dict(self._settings["options"] or {})
        _, inductor_options = split_options(options)
        uses_cudagraphs = inductor_config_patches(mode, inductor_options).get(
            "triton.cudagraphs", torch._inductor.config.triton.cudagraphs
        )
        if uses_cudagraphs and device.type == "cuda" and hasattr(torch._inductor.config.triton, "cudagraph_or_error"):
            # Any skip Inductor finds beyond our checks becomes an error instead of a silent fallback.
            options.setdefault("triton.cudagraph_or_error", True)
        if uses_cudagraphs and device.type == "cpu" and not self._warned_cpu:
            self._warned_cpu = True
            warnings.warn(_CPU_WARNING.format(name=self._fn.__qualname__, mode=mode))

        moved_input_checks: list[tuple[capture.MutatedInput, int]] = []

        def check(final_gm: torch.fx.GraphModule) -> None:
            capture.check_graph(final_gm, allow_dynamic=self._settings["dynamic"] is True)
            for mutated in capture.mutated_inputs(final_gm):
                if not mutated.static:
                    capture.make_static(final_gm, example_inputs, mutated)
                moved_input_checks.append((mutated, example_inputs[mutated.index].data_ptr()))

        compiled, record = compile_graph(gm, example_inputs, mode=mode, options=options, inspect_graph=check)
        self.compiles.append(record)
        if not moved_input_checks:
            return compiled

        def run(*args: Any) -> Any:
            for mutated, address in moved_input_checks:
                if args[mutated.index].data_ptr() != address:
                    raise capture.moved_input_error(mutated)
            return compiled(*args)

        return run

    def _check_recompiles(self) -> None:
        signature = self._signature()
        self._call_signatures.append(signature)
        if len(self._call_signatures) <= self._settings["max_compiles"]:
            return
        change = capture.describe_change(self._call_signatures[-2], signature)
        guard = capture.last_guard_failure(self._fn.__code__)
        raise RecompileError(
            f"draft {self._fn.__qualname__!r} needs compile number {len(self._call_signatures)} "
            f"(max_compiles={self._settings['max_compiles']}): "
            + (f"what changed since the last compile: {change}" if change else "no argument changed")
            + (f" (Dynamo: guard failed: {guard})" if guard else ""),
            fix="keep shapes and Python arguments the same on every call (pass changing values as "
            "tensors, pad batches to a few fixed sizes), or raise max_compiles if each is expected",
        )

    def _signature(self) -> dict[str, str]:
        if self._current_call is None:
            return {}
        args, kwargs = self._current_call
        try:
            bound = inspect.signature(self._fn).bind(*args, **kwargs)
        except TypeError:
            return {}
        return {name: capture.describe_value(value) for name, value in bound.arguments.items()}


def draft_loop(
    fn: Callable[..., Any] | None = None,
    *,
    mode: str | None = "reduce-overhead",
    options: dict[str, Any] | None = None,
    zero_copy_outputs: bool = False,
    dynamic: bool | None = False,
    max_compiles: int = 4,
) -> Any:
    """Compile a draft function or method as one captured region (see the module docstring).

    Usable bare (`@draft_loop`) or with arguments (`@draft_loop(mode=..., options=...)`).
    mode/options: as for the draftfuse backend (`options` may mix draftfuse's and Inductor's keys).
    zero_copy_outputs: return the CUDA graph's own output tensors, overwritten by the next call.
    dynamic: torch.compile's `dynamic`; False (default) compiles one graph per input shape, which is
        what CUDA graphs want; True allows symbolic shapes (one CUDA graph recorded per size).
    max_compiles: compiles allowed per draft (per instance for methods) before RecompileError.
    """
    settings = dict(
        mode=mode, options=options, zero_copy_outputs=zero_copy_outputs, dynamic=dynamic, max_compiles=max_compiles
    )
    if fn is None:
        return functools.partial(draft_loop, **settings)
    return DraftLoop(fn, **settings)

