"""draftfuse's graph passes: each one a module, a function on a torch.fx graph that returns a report."""

from draftfuse.passes._report import PassReport, PassResult, Refusal, Rewrite

__all__ = ["PassReport", "PassResult", "Refusal", "Rewrite"]
