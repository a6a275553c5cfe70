import os

import pytest
import torch
from hypothesis import settings

# Property tests run a Dynamo capture per example: keep them few and without deadlines on slow CPUs.
settings.register_profile("draftfuse", max_examples=int(os.environ.get("DRAFTFUSE_HYPOTHESIS_EXAMPLES", "40")), deadline=None)
settings.load_profile("draftfuse")

# Tests read the post-grad passes' reports, which Inductor's FX graph cache skips on a hit (the cached
# code is the one the passes produced): compile afresh unless a test asks for the cache.
torch._inductor.config.fx_graph_cache = False


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `python -m pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_dynamo():
    """Each test compiles from nothing and reads counters of its own (`pytestmark = pytest.mark.usefixtures("fresh_dynamo")`)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def copy_launches(monkeypatch):
    """start() -> a list that gets an entry per torch._foreach_copy_ call from then on (the replay path's
    input copies and output copies are each one such launch)."""

    def start() -> list[int]:
        calls, copy = [], torch._foreach_copy_
        monkeypatch.setattr(torch, "_foreach_copy_", lambda *a, **k: (calls.append(1), copy(*a, **k))[1])
        return calls

    return start
