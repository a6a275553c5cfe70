"""Errors raised when a draft cannot run as one captured region.

Every error names the user's file and line (when known), the cause in plain words, and the usual fix.
draftfuse never falls back silently: a draft that would graph-break, sync with the host, skip CUDA
graphs or recompile repeatedly raises one of these instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator


class DraftCaptureError(RuntimeError):
    """A draft could not be captured as one region (one Dynamo graph, one CUDA graph replay)."""

    def __init__(self, cause: str, *, where: str = "", fix: str = "") -> None:
        self.cause = cause
        self.where = where
        self.fix = fix
        msg = cause
        if where:
            msg = f"{where}: {msg}"
        if fix:
            msg = f"{msg}\n  fix: {fix}"
        super().__init__(msg)


class GraphBreakError(DraftCaptureError):
    """Dynamo could not trace the draft as one graph (untraceable call, branch on a tensor value...)."""


class HostSyncError(DraftCaptureError):
    """The draft reads a device value on the host (`.item()`, `.tolist()`, `.cpu()`, `nonzero`...)."""


class CudagraphSkipError(DraftCaptureError):
    """Inductor would not capture the draft in a CUDA graph (CPU tensor, mutated non-static input...)."""


class RecompileError(DraftCaptureError):
    """The draft recompiles on every call (a changing Python value or shape), so nothing is replayed."""


def first_line(text: str, default: str) -> str:
    """The first non-blank line of an error's text (`default` if it has none)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), default)


def _cause_or_context(exc: BaseException) -> BaseException | None:
    return exc.__cause__ or exc.__context__


def causes(exc: BaseException | None, follow: Callable[[BaseException], BaseException | None] = _cause_or_context) -> Iterator[BaseException]:
    """`exc`, then what `follow` leads to from each (its cause, else its context), each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = follow(exc)
