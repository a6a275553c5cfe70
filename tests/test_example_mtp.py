"""The frozen-KV MTP example at tiny size: both layouts draft the same tokens (fp32, CPU), and the
folded draft is the seed fold's work: one region, seam gone, the clamp proven away. On CUDA, one
graph replay per folded draft."""

import sys
from pathlib import Path

import pytest
import torch

# The examples are scripts, imported the way test_examples.py imports them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import mtp_frozen_kv  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.slow  # two compiles of a one-layer drafter: about 30 s on a 2-core CPU
def test_folded_draft_matches_the_server_layout():
    (result,) = mtp_frozen_kv.run(["--rounds", "2", "--batch", "3"])
    assert result["tokens_match"]
    assert result["tokens"].shape == (3, 4)  # seed + 3 steps
    assert result["max_prob_diff"] < 1e-5
    assert set(result["ms_per_draft"]) == {"eager seed + captured steps", "folded"}
    report = result["seed_fold_report"]
    rules = [r.rule for r in report.rewrites]
    removed = ["seam marker removed", "host round trip removed", "placeholder allocation removed"]
    assert set(removed) <= set(rules)
    assert report.refusals == []
    merged = result["merge_report"]  # the tests compile without the FX graph cache: the post-grad passes ran
    assert "setup merged (proven equal)" in [r.rule for r in merged.rewrites], str(merged)
    assert merged.refusals == [], str(merged)
    assert "graph_replays_per_draft" not in result  # counted on CUDA only


@pytest.mark.cuda
def test_one_graph_replay_per_folded_draft_on_cuda():
    size = mtp_frozen_kv.SIZES["tiny"]
    result = mtp_frozen_kv.compare_layouts(size, 2, device=torch.device("cuda"), dtype=torch.bfloat16, rounds=0)
    assert result["tokens_match"]
    assert result["graph_replays_per_draft"] == {"eager seed + captured steps": 1, "folded": 1}
