"""Tracing a draft as `draft_loop` compiles it, for its compile and for the tools that must see the same
graph (explain, testing): its own code copy, fullgraph, no grad; a failed trace raised as the
DraftCaptureError that names the user's line; the graph before a draft's first break, to locate a host read.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import any_torch_dispatch_mode_on_stack

from draftfuse.graph.values import user_frame, user_location
from draftfuse.runtime import checks, translate
from draftfuse.runtime.errors import DraftCaptureError


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with a code object of its own, so that Dynamo's cache for it is not shared: a copy of a plain
    function, or, for a function that torch.compile would run inside its shared wrapper frame (one Dynamo
    does not trace as a top frame, such as the wrapper of `@torch.no_grad()`, or one without a source
    file), a frame of its own that calls it. Anything else is returned as it is."""
    if not isinstance(fn, types.FunctionType):
        return fn
    if _run_inside_a_wrapper(fn):
        return own_code(_frame_calling(fn))
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    return copy


def _run_inside_a_wrapper(fn: types.FunctionType) -> bool:
    """Whether torch.compile(fn) would trace a wrapper frame that every such function shares (there
    Dynamo's cache entries and guards are not on fn's code, and the fast replay path finds none)."""
    try:
        source = inspect.getsourcefile(fn)
    except TypeError:
        source = None
    return source is None or bool(torch._dynamo.trace_rules.check(fn))


def _frame_calling(fn: Callable[..., Any]) -> Callable[..., Any]:
    def draft(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    draft.__qualname__ = getattr(fn, "__qualname__", draft.__qualname__)
    return draft


class _Captured(Exception):
    """Raised by the probe backend once it holds the graph: nothing of the draft runs."""


def trace_before_break(fn: Callable[..., Any], dynamic: bool | None, args: tuple, kwargs: dict, backend: Callable[..., Any]) -> None:
    """Trace `fn` without fullgraph into `backend`, which raises _Captured once it has the first graph:
    the graph before the draft's first graph break. Nothing of the draft runs but what comes before its
    first traced op, where that op is past a break; its code is a copy, so the draft's cache is untouched.
    A host read (`.item()`, `int(t)`) is traced into the graph, as under fullgraph, so the graph holds it
    when what breaks is a decision on its value."""
    if any_torch_dispatch_mode_on_stack():
        return  # Dynamo would skip the frame, and the draft would run
    try:
        with torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=True):
            torch.compile(own_code(fn), dynamic=dynamic, backend=backend)(*args, **kwargs)
    except Exception:
        pass


def first_data_dependent(fn: Callable[..., Any], dynamic: bool | None, args: tuple, kwargs: dict) -> str:
    """file:line of the draft's first op whose size or value depends on the data: traced again without
    fullgraph, the graph before the failure holds it."""
    graphs: list[torch.fx.GraphModule] = []

    def probe(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(gm)
        raise _Captured

    trace_before_break(fn, dynamic, args, kwargs, probe)
    for gm in graphs:
        for node in gm.graph.nodes:
            if checks.host_read(node) or checks.defines_data_dependent_value(node):
                return user_location(node)
    return ""


_SHAPE_SETTINGS = ("automatic_dynamic_shapes", "assume_static_by_default")


def shape_settings(values: tuple[bool, ...] | None = None) -> tuple[bool, ...]:
    """Dynamo's two settings that torch.compile(dynamic=...) patches for the call (read; with `values`, set
    back). torch 2.13 leaves its patch in place when Dynamo skips the draft's frame (under a
    TorchDispatchMode): every later compile in the process then had automatic dynamic shapes off."""
    if values is not None:
        for name, value in zip(_SHAPE_SETTINGS, values):
            setattr(torch._dynamo.config, name, value)
    return tuple(getattr(torch._dynamo.config, name) for name in _SHAPE_SETTINGS)


def caller_location() -> str:
    """file:line of the innermost frame outside draftfuse (the user's call of the draft)."""
    frame, _ = user_frame()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""


def refuse_dispatch_modes() -> None:
    """Dynamo's own test for skipping a frame whole: under a TorchDispatchMode torch 2.11 runs the draft
    eagerly, silently. Raised at the caller's line."""
    if any_torch_dispatch_mode_on_stack():
        raise translate.skipped_error("non-infra torch dispatch mode present", caller_location()).with_traceback(None)


def trace_as_draft_loop(fn: Callable[..., Any], backend: Callable[..., Any], args: tuple, kwargs: dict, dynamic: bool | None = False) -> None:
    """Trace `fn(*args, **kwargs)` as draft_loop's compile does (its own code copy, fullgraph, no grad)
    into `backend`; a failure of the trace is raised as the DraftCaptureError draft_loop raises for it.
    A backend that raises _Captured ends the trace there: nothing of the draft runs."""
    refuse_dispatch_modes()
    shapes = shape_settings()
    try:
        with torch.no_grad():
            torch.compile(own_code(fn), fullgraph=True, dynamic=dynamic, backend=backend)(*args, **kwargs)
    except Exception as exc:
        if isinstance(getattr(exc, "inner_exception", None), _Captured) or isinstance(exc, _Captured):
            return
        translated = capture_error(exc, fn, dynamic, args, kwargs)
        if translated is None:
            raise
        error, cause = translated
        raise error.with_traceback(None) from cause
    finally:
        shape_settings(shapes)


def capture_error(exc: Exception, fn: Callable[..., Any], dynamic: bool | None, args: tuple, kwargs: dict) -> tuple[DraftCaptureError, Exception | None] | None:
    """The DraftCaptureError a failed trace or compile of `fn(*args, **kwargs)` stands for (a host read's
    first op located), with the exception to raise it from: torch's, where it was translated; none for
    draftfuse's own. None for an error that is torch's own."""
    first = first_data_dependent(fn, dynamic, args, kwargs) if translate.is_data_dependent(exc) else ""
    error = translate.from_exception(exc, first)
    if error is None:
        return None
    return error, None if error is exc or error is getattr(exc, "inner_exception", None) else exc
