"""`python -m draftfuse demo` runs end to end in a fresh process, as a new user would run it."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_exits_zero_and_prints_the_rewrites():
    done = subprocess.run(
        [sys.executable, "-m", "draftfuse", "demo", "--rounds", "3"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "what draftfuse did to the draft's Dynamo graph:" in out
    # seed + 3 steps: four softmax -> topk(1) selections, each now an argmax.
    assert "[softmax_topk] 4 rewrites, 0 refusals" in out
    assert out.count("-> argmax") >= 4
    assert "tokens: identical in eager, Inductor and draftfuse" in out
    assert "time per draft (median of 3, alternating): eager" in out
