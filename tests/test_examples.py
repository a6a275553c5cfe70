"""Every example at tiny size on a CPU: draftfuse's tokens equal eager's exactly (fp32).

The examples run in-process through their `run(argv)`. `--rounds 0` checks tokens without timing, which
also skips the plain torch.compile baseline (one compile less); the Medusa test times two rounds so the
baseline and the side-by-side timing run too.
"""

import sys
from pathlib import Path

import pytest

# The examples import their sibling modules (_common, _layers) the way a script does.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import draft_model  # noqa: E402
import eagle_head  # noqa: E402
import medusa_heads  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.slow
def test_eagle_head_chain_and_tree_match_eager():
    result = eagle_head.run(["--rounds", "0", "--steps", "2", "--topk", "3"])
    chain, tree = result["chain"], result["tree"]
    assert chain["reference"] == "eager" and chain["tokens_match"]
    assert chain["outputs"][0].shape == (1, 3)
    assert tree["tokens_match"]
    tokens, parents, scores = tree["outputs"]
    assert tokens.shape == (1, 3, 3) and parents.shape == (1, 2, 3) and scores.shape == (1, 3, 3)
    assert tree["max_score_diff"] < 1e-4
    # Cumulative log-probs only fall along a path, and each level comes out best first.
    assert bool((scores[:, 1:].max(-1).values <= scores[:, :-1].max(-1).values + 1e-6).all())
    assert bool((scores.diff(dim=-1) <= 0).all())


@pytest.mark.slow
def test_draft_model_matches_eager():
    result = draft_model.run(["--rounds", "0", "--steps", "2"])
    assert result["reference"] == "eager" and result["tokens_match"]
    tokens, probs = result["outputs"]
    assert tokens.shape == probs.shape == (1, 3)
    assert result["max_score_diff"] < 1e-5


def test_medusa_heads_match_eager_and_are_timed():
    result = medusa_heads.run(["--rounds", "2", "--heads", "2"])
    assert result["reference"] == "eager" and result["tokens_match"]
    tokens, probs = result["outputs"]
    assert tokens.shape == probs.shape == (1, 2, 4)
    assert set(result["ms_per_draft"]) == {"eager", "torch.compile", "draftfuse"}
    assert "graph_replays_per_draft" not in result  # counted only on CUDA
