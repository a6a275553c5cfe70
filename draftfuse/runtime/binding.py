"""A call's arguments as the frame's locals that Dynamo's guards read, bound without inspect: draft_loop's
replay path binds every call, so the binder is generated with the draft's own signature and CPython does
the binding (defaults, keywords, *args and **kwargs) in one call. Defaults are read as they are at the
call (a function's __defaults__ and __kwdefaults__ may be changed after it was decorated)."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any


class _Default:
    """A parameter's default in the binder's generated signature: rendered as a lookup of it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"__defaults[{self.name!r}]"


def binder(fn: Callable[..., Any], code_fn: Callable[..., Any]) -> Callable[[tuple, dict], dict[str, Any] | None]:
    """A function (args, kwargs) -> the frame's locals at entry, as Dynamo's guards read them (each
    parameter by name, *args and **kwargs as a tuple and a dict, closure variables by name); None
    when the call does not bind. Generated with the signature of the code Dynamo runs (a wrapper's own,
    not the one functools.wraps shows), so that CPython binds the arguments (defaults and keywords
    included) in one call. Where `code_fn` is a copy of `fn` (draft_loop's own_code), the defaults are
    `fn`'s: those are the ones a user changes."""
    try:
        signature = inspect.signature(code_fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return lambda args, kwargs: None
    code = getattr(code_fn, "__code__", None)
    closure = getattr(code_fn, "__closure__", None) or ()
    free = dict(zip(code.co_freevars, closure)) if code is not None else {}
    names = list(signature.parameters)
    copied = is_copy(code_fn, fn)  # then the defaults a call reads are fn's (they may be changed after this)
    if any(name.startswith("__") or not name.isidentifier() for name in [*names, *free]):  # names the generated code
        return _binder_by_signature(fn if copied else code_fn, free)  # could not use as they are (slower)
    defaults = {n: p.default for n, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}
    owner = fn if copied else getattr(code_fn, "__func__", code_fn)
    plain = signature.replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty, default=_Default(n) if n in defaults else p.default) for n, p in signature.parameters.items()],
        return_annotation=inspect.Signature.empty,
    )
    source = "\n".join([
        f"def __locals{plain}:",
        f"    return {{{', '.join(f'{n!r}: {n}' for n in names)}}}",
        "def bind(__args, __kwargs):",
        *(["    __locals.__defaults__, __locals.__kwdefaults__ = __fn.__defaults__, __fn.__kwdefaults__  # as they are now"]
          if isinstance(owner, types.FunctionType) else []),
        "    try:",
        "        __f = __locals(*__args, **__kwargs)",
        "    except TypeError:",
        "        return None",
        *[f"    __f[{n!r}] = __cells[{n!r}].cell_contents" for n in free],
        "    return __f",
    ])  # fmt: skip
    scope = {"__defaults": defaults, "__cells": free, "__fn": owner}
    exec(compile(source, f"<draftfuse binder of {getattr(fn, '__qualname__', 'a draft')}>", "exec"), scope)
    bind = scope["bind"]

    def bind_or_none(args: tuple, kwargs: dict) -> dict[str, Any] | None:
        try:
            return bind(args, kwargs)
        except ValueError:  # an empty closure cell
            return None

    return bind_or_none if free else bind


def is_copy(copy: Any, fn: Any) -> bool:
    """Whether `copy` is a copy of the plain function `fn` (its code replaced, defaults taken when copied)."""
    return copy is not fn and isinstance(copy, types.FunctionType) and isinstance(fn, types.FunctionType) and copy.__code__ == fn.__code__


def sync_defaults(copy: Any, fn: Any) -> None:
    """Give a copy of `fn` the defaults `fn` has now (assigned after the copy was made, they are not shared)."""
    if is_copy(copy, fn):
        copy.__defaults__, copy.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__


def _binder_by_signature(code_fn: Callable[..., Any], free: dict[str, Any]) -> Callable[[tuple, dict], dict[str, Any] | None]:
    def bind(args: tuple, kwargs: dict) -> dict[str, Any] | None:
        try:
            bound = inspect.signature(code_fn, follow_wrapped=False).bind(*args, **kwargs)  # its defaults as they are now
            bound.apply_defaults()
            f_locals = dict(bound.arguments)
            for name, cell in free.items():
                f_locals[name] = cell.cell_contents
        except (TypeError, ValueError):  # no binding; an empty cell
            return None
        return f_locals

    return bind
