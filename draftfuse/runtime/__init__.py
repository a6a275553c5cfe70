"""The draftfuse runtime: the torch.compile backend, `draft_loop`, `fold`, capture checks and errors."""
