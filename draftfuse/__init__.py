"""draftfuse: torch.compile passes and a small runtime that make speculative-decoding draft loops fast."""

from draftfuse.runtime.errors import DraftCaptureError

__all__ = ["DraftCaptureError"]
__version__ = "0.1.0"
