"""The benchmark entry point (benchmarks/run.py) on a CPU at tiny size, and its results file and table.

The end-to-end tests run the script in a subprocess, as it runs on the GPU machine, so its compiles,
Dynamo state and CPU settings stay out of this process. Every compiled draft variant compiles twice
(cold and warm), about 10 s a compile on 2 cores, so each test runs one workload group and stays under
a minute. The table tests build rows by hand: no compile.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import run

SCRIPT = Path(run.__file__)
DRAFT_VARIANTS = ["eager", "eager_seed+captured_loop", "hand_fold+hand_argmax", "draftfuse"]
GPU_ONLY = ("graph_launches_per_call", "kernel_launches_per_call")


def _run_benchmark(out: Path, *only: str) -> str:
    argv = ["--device", "cpu", "--size", "tiny", "--quick", "--rounds", "3", "--batches", "2", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv, "--only", *only], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("only", [("selection", "mtp"), ("eagle",), ("draft_model",)])
def test_entry_point_writes_results_and_prints_the_table_last(tmp_path, only):
    stdout = _run_benchmark(tmp_path, *only)
    results = json.loads((tmp_path / "cpu.json").read_text())
    assert list(results) == ["gpu", "torch", "date", "copy_bandwidth_TBps", "rows"]
    assert results["gpu"] == "cpu" and results["copy_bandwidth_TBps"] is None
    rows = results["rows"]
    assert {r["workload"] for r in rows} == set(only)
    for row in rows:
        assert list(row) == list(run.ROW_KEYS), row  # no "error": every variant ran
        assert row["batch"] == 2 and row["median_us"] > 0 and row["p10_us"] <= row["median_us"] <= row["p90_us"]
        assert all(row[key] is None for key in GPU_ONLY)  # no CUDA graphs or launches on a CPU
        assert row["tokens_match"] is True, row

    drafts = [r for r in rows if r["workload"] != "selection"]
    for workload in {r["workload"] for r in drafts}:
        mine = [r for r in drafts if r["workload"] == workload]
        assert [r["variant"] for r in mine] == DRAFT_VARIANTS
        for row in mine:
            compiled = row["variant"] != "eager"
            assert (row["compile_cold_s"] is not None) == compiled and (row["compile_warm_s"] is not None) == compiled
        assert mine[-1]["tokens_reference"] == "eager, hand_fold+hand_argmax"  # draftfuse: both references
    selection = [r for r in rows if r["workload"] == "selection"]
    if selection:
        variants = {1: ("softmax+topk", "torch.argmax", "draftfuse"), 4: ("softmax+topk", "torch.topk", "draftfuse")}
        expected = {(dtype, k, v) for dtype in ("bfloat16", "float32") for k in (1, 4) for v in variants[k]}
        assert {(r["dtype"], r["k"], r["variant"]) for r in selection} == expected  # no floor: no bandwidth on a CPU

    table = (tmp_path / "cpu.md").read_text()
    assert "## Targets (issue 6)" in table and "| target | met | missed |" in table
    assert stdout.rstrip().endswith(table.rstrip())  # the markdown comes last
    assert "matplotlib is not installed: plot skipped" in stdout or (tmp_path / "cpu.png").exists()


def _draft_rows(workload: str, batch: int, medians: dict[str, float], graph_launches: float | None) -> list[dict]:
    return [
        run._row(workload, batch, 128256, 1, "bfloat16", v, median_us=us, graph_launches_per_call=graph_launches)
        for v, us in medians.items()
    ]


def test_table_marks_each_target_met_or_missed():
    medians = dict(zip(DRAFT_VARIANTS, (2200.0, 2000.0, 1650.0, 1700.0)))
    rows = _draft_rows("mtp", 1, medians, 1.0)  # 2000 / 1700 = 1.18 (met), 1700 / 1650 = 1.03 (missed)
    rows += _draft_rows("mtp", 64, dict(medians, draftfuse=1680.0), 2.0)  # 1.018 (met); no 1.15 target at 64
    rows += [
        run._row("selection", 1, 32000, None, "bfloat16", "floor", median_us=0.05),
        run._row("selection", 1, 32000, 1, "bfloat16", "draftfuse", median_us=5.5),  # <= max(2 x 0.05, 6)
        run._row("selection", 1, 32000, 4, "bfloat16", "softmax+topk", median_us=80.0),
        run._row("selection", 1, 32000, 4, "bfloat16", "draftfuse", median_us=90.0),  # slower than softmax+topk
    ]
    run_info = {"command": "python benchmarks/run.py", "size": "reference", "seconds": 1.0, "skipped": ["eagle 1"]}
    meta = {"gpu": "NVIDIA H200", "torch": "2.11.0", "date": "today", "copy_bandwidth_TBps": 4.3}
    table = run.markdown(meta, rows, run_info)

    assert "| MTP eager_seed+captured_loop / draftfuse ≥ 1.15 | 1 | 0 | 0 | – |" in table
    assert "| draftfuse / hand_fold+hand_argmax ≤ 1.02 | 1 | 1 | 0 | mtp batch 1: 1.030 |" in table
    assert "| one graph replay per draftfuse call | 1 | 1 | 0 | mtp batch 64: 2.00 |" in table
    assert "| selection k=1: draftfuse ≤ max(2 × floor, 6 µs) | 1 | 0 | 0 | – |" in table
    assert "| selection k=4: draftfuse < softmax+topk | 0 | 1 | 0 | bfloat16 V=32000 B=1: 90.00 vs 80.00 |" in table
    assert "Not measured in this run (time budget): eagle 1." in table


def test_a_partial_run_keeps_the_other_rows_of_the_results_file(tmp_path):
    meta = {"gpu": "cpu", "torch": "2.13", "date": "today", "copy_bandwidth_TBps": None}
    info = {"command": "", "size": "tiny", "seconds": 0.0, "skipped": []}
    first = run._Results(tmp_path, "cpu", meta, partial=False)
    first.add(_draft_rows("eagle", 1, {"eager": 3.0}, None) + _draft_rows("mtp", 1, {"eager": 1.0}, None))
    first.write(info)

    partial = run._Results(tmp_path, "cpu", meta, partial=True)  # e.g. --only mtp
    partial.add(_draft_rows("mtp", 1, {"eager": 2.0}, None))
    partial.write(info)
    rows = json.loads((tmp_path / "cpu.json").read_text())["rows"]
    assert [(r["workload"], r["median_us"]) for r in rows] == [("mtp", 2.0), ("eagle", 3.0)]

    full = run._Results(tmp_path, "cpu", meta, partial=False)
    full.add(_draft_rows("mtp", 1, {"eager": 4.0}, None))
    full.write(info)
    rows = json.loads((tmp_path / "cpu.json").read_text())["rows"]
    assert [(r["workload"], r["median_us"]) for r in rows] == [("mtp", 4.0)]


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_launches_are_counted_per_labelled_call_and_nested_launches_once(monkeypatch):
    """The launch counting of the GPU run, on CPU ops standing in for the CUDA launch calls: aten::t runs
    inside aten::linear as a driver launch runs inside a runtime launch, and must not count again."""
    import torch
    import torch.nn.functional as F

    monkeypatch.setattr(run, "_KERNEL_LAUNCHES", ("aten::linear", "aten::t"))
    monkeypatch.setattr(run, "_GRAPH_LAUNCHES", ("aten::cos",))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    x = torch.randn(4, 4)
    calls = {"two kernels": lambda: (F.linear(x, x), F.linear(x, x)), "one graph": lambda: x.cos(), ("k", 4): x.sin}
    counts = run._profiled_launches(calls)
    assert counts == {"two kernels": (0, 2), "one graph": (1, 0), ("k", 4): (0, 0)}
