"""draftfuse: torch.compile passes and a small runtime that make speculative-decoding draft loops fast.

Three ways in:
  * `torch.compile(fn, backend="draftfuse", ...)`: the passes, then Inductor;
  * `@draftfuse.draft_loop`: one captured region per draft, outputs safe to keep, clear errors;
  * `draftfuse.fold(seed, loop)`: a worker's eager seed step folded into its captured loop.
The passes themselves live in `draftfuse.passes`.
"""

from draftfuse.explain import explain
from draftfuse.runtime.draft_loop import draft_loop
from draftfuse.runtime.fold import fold
from draftfuse.runtime.errors import CudagraphSkipError, DraftCaptureError, GraphBreakError, HostSyncError, RecompileError

__all__ = [
    "CudagraphSkipError",
    "DraftCaptureError",
    "GraphBreakError",
    "HostSyncError",
    "RecompileError",
    "draft_loop",
    "explain",
    "fold",
]
__version__ = "0.1.0"
