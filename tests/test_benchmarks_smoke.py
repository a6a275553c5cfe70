"""The benchmark entry point (benchmarks/run.py) on a CPU at tiny size, its results file and report, and the
measuring helpers it shares with the examples and the demo (draftfuse/_measure.py).

The end-to-end test runs the script in a subprocess, as it runs on the GPU machine, so its compiles,
Dynamo state and CPU settings stay out of this process: one draft workload (all five variants, compiled
twice) and the selection, a few seconds once Inductor's cache is warm. The draft check's tests run
bench_draft here, on a tiny draft with one variant made wrong (a stale replay, a wrong temperature) or on
a workload of plain functions (no compile). The report tests build rows by hand: no compile.
"""

import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import _draft_bench, _drafts, _rows, _selection_bench, report, run, selection
from draftfuse import _measure

SCRIPT = Path(run.__file__)
DRAFT_VARIANTS = ["eager", "eager_seed+captured_loop", "hand_fold+hand_argmax", "raw_cuda_graph", "draftfuse"]
GPU_ONLY = ("graph_launches_per_call", "kernel_launches_per_call", "host_us_per_call")
DRAFT_CHECK = ("probs_max_abs_diff", "tokens_changed_by_inputs")  # the draft rows' fields beyond ROW_KEYS
SELECTION_CHECK = ("prob_rel_error", "rewritten")  # the selection rows' (rewritten: draftfuse's temperature rows)
META = {"gpu": "NVIDIA H200", "torch": "2.11.0", "date": "today", "copy_bandwidth_TBps": 2.77}


@pytest.mark.slow
def test_entry_point_writes_results_and_prints_the_table_last(tmp_path):
    argv = ["--device", "cpu", "--size", "tiny", "--quick", "--rounds", "3", "--batches", "2", "--out", str(tmp_path)]
    command = [sys.executable, str(SCRIPT), *argv, "--only", "selection", "draft_model"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads((tmp_path / "cpu.json").read_text())
    assert list(results) == ["gpu", "torch", "date", "copy_bandwidth_TBps", "runs", "rows"]
    assert results["gpu"] == "cpu" and results["copy_bandwidth_TBps"] is None
    assert results["runs"][0]["command"].endswith("--only selection draft_model")
    assert results["runs"][0]["skipped"] == []
    rows = results["rows"]
    assert {r["workload"] for r in rows} == {"selection", "draft_model"}
    scale_supported = "scale" in inspect.signature(selection.selection_call).parameters
    for row in rows:
        extra = {"error", *DRAFT_CHECK} if row["workload"] == "draft_model" else {"error", *SELECTION_CHECK}
        assert list(row)[: len(_rows.ROW_KEYS)] == list(_rows.ROW_KEYS) and set(row) - set(_rows.ROW_KEYS) <= extra
        if row.get("error"):  # only the temperature rows of draftfuse, until selection_call takes a scale
            assert not scale_supported and (row["temperature"], row["variant"]) == ("tensor", "draftfuse"), row
            assert "no `scale` argument yet" in row["error"]
            continue
        assert row["batch"] == 2 and row["median_us"] > 0 and row["p10_us"] <= row["median_us"] <= row["p90_us"]
        assert all(row[key] is None for key in GPU_ONLY)  # no CUDA graphs, launches or busy device on a CPU
        assert row["tokens_match"] is True, row
        if row["workload"] == "selection" and row["variant"] in ("softmax+topk", "draftfuse"):
            assert 0 <= row["prob_rel_error"] <= _selection_bench.PROB_RTOL, row  # probabilities against float64
        if row["workload"] == "selection" and row["temperature"] and row["variant"] == "draftfuse":
            assert row["rewritten"] is True, row  # softmax(x / t[:, None]) + topk went through the passes

    drafts = [r for r in rows if r["workload"] == "draft_model"]
    assert [r["variant"] for r in drafts] == DRAFT_VARIANTS
    for row in drafts:
        compiled = row["variant"] != "eager"
        assert (row["compile_cold_s"] is not None) == compiled and (row["compile_warm_s"] is not None) == compiled
        if row["variant"] in ("raw_cuda_graph", "draftfuse"):
            assert row["tokens_reference"] == "eager, hand_fold+hand_argmax"
        # the tokens and probabilities (fp32 at the tiny size) of both input sets, and the second set's tokens differ
        assert row["tokens_changed_by_inputs"] is True and 0 <= row["probs_max_abs_diff"] < 1e-5, row
        assert "notes" not in row
    selected = {(r["dtype"], r["k"], r["temperature"], r["variant"]) for r in rows if r["workload"] == "selection"}
    dtypes, ks = ("bfloat16", "float32"), (1, 4, 8, 16)
    plain = {k: ("softmax+topk", "torch.argmax" if k == 1 else "torch.topk", "draftfuse") for k in ks}
    expected = {(d, k, None, v) for d in dtypes for k, vs in plain.items() for v in vs}
    expected |= {(d, k, "tensor", v) for d in dtypes for k in ks for v in ("softmax+topk", "draftfuse")}
    assert selected == expected  # no floor: no bandwidth on a CPU

    table = (tmp_path / "cpu.md").read_text()
    assert "## Targets" in table and "| target | met | missed | not measured |" in table
    temperature = next(line for line in table.splitlines() if line.startswith("| selection with a temperature tensor"))
    assert temperature.startswith("| selection with a temperature tensor: rewritten and exact (draftfuse) | 8 | 0 |"
                                  if scale_supported else "| selection with a temperature tensor: rewritten and exact (draftfuse) | 0 | 8 |")  # fmt: skip
    assert "## draft_model:" in table and "| raw_cuda_graph |" in table
    assert done.stdout.rstrip().endswith(table.rstrip())  # the markdown comes last
    assert "matplotlib is not installed: plot skipped" in done.stdout or (tmp_path / "cpu.png").exists()


def _first_outputs_forever(make: _drafts.Factory) -> _drafts.Factory:
    """The variant of factory `make` made stale: every call returns clones of its first call's outputs."""

    def stale_make():
        call, first = make(), []

        def stale():
            if not first:
                first.append(tuple(t.clone() for t in call()))
            return tuple(t.clone() for t in first[0])

        return stale

    return stale_make


def _bench(workload: str) -> dict[str, dict]:
    """bench_draft of `workload` at the tiny size, batch 2, fp32, one timed round, no warm compile: rows by variant."""
    with torch.no_grad():
        rows = _draft_bench.bench_draft(workload, "tiny", 2, torch.device("cpu"), torch.float32, 1, False)
    assert [r["variant"] for r in rows] == DRAFT_VARIANTS and not any(r.get("error") for r in rows), rows
    return {r["variant"]: r for r in rows}


@pytest.mark.slow
def test_the_draft_check_fails_a_variant_that_returns_stale_outputs(monkeypatch, fresh_dynamo):
    """eagle with its draftfuse variant returning its first call's outputs on every call: its tokens equal
    the references' on the inputs it first saw and not after Workload.vary(), so its row's tokens_match is
    False and its tokens did not change; every other variant drafts other tokens and matches."""
    draftfuse = _drafts._draftfuse
    monkeypatch.setattr(_drafts, "_draftfuse", lambda *args, **kw: _first_outputs_forever(draftfuse(*args, **kw)))
    rows = _bench("eagle")
    assert rows["draftfuse"]["tokens_match"] is False and rows["draftfuse"]["tokens_changed_by_inputs"] is False
    for variant in DRAFT_VARIANTS[:-1]:
        assert rows[variant]["tokens_match"] is True and rows[variant]["tokens_changed_by_inputs"] is True, variant
    assert all(r["probs_max_abs_diff"] is None and "notes" not in r for r in rows.values())  # eagle: tokens only


@pytest.mark.slow
def test_the_draft_check_fails_probabilities_at_a_wrong_temperature(monkeypatch, fresh_dynamo):
    """draft_model with its draftfuse variant drafting at temperature 1.0 instead of 0.7: the same tokens
    (argmax does not depend on the temperature), probabilities off by far more than PROBS_TOLERANCE, so
    its tokens_match is False; the other variants' fp32 probabilities agree to 1e-5."""
    draftfuse = _drafts._draftfuse
    monkeypatch.setattr(_drafts, "_draftfuse", lambda fn, *args, **kw: draftfuse(fn, *args, **{**kw, "temperature": 1.0}))
    rows = _bench("draft_model")
    assert rows["draftfuse"]["tokens_match"] is False
    assert rows["draftfuse"]["probs_max_abs_diff"] > 3 * _draft_bench.PROBS_TOLERANCE
    for variant in DRAFT_VARIANTS[:-1]:
        assert rows[variant]["tokens_match"] is True and rows[variant]["probs_max_abs_diff"] < 1e-5, rows[variant]
    assert all(r["tokens_changed_by_inputs"] is True for r in rows.values())


def test_the_draft_rows_say_when_the_inputs_do_not_change_the_tokens(monkeypatch):
    """A workload of plain functions whose vary() changes nothing: every row says that the tokens did not
    change, and its notes that tokens_match then does not show the variant reads its inputs; a NaN
    probability fails its row (probs_max_abs_diff NaN), a difference of half PROBS_TOLERANCE passes."""
    tolerance = _draft_bench.PROBS_TOLERANCE
    tokens, probs = torch.tensor([[3, 4]]), torch.tensor([[0.5, 0.25]])
    off = {"draftfuse": torch.tensor([[math.nan, 0.25]]), "raw_cuda_graph": probs + tolerance / 2}

    def variant(name: str) -> _drafts.Factory:
        return lambda: lambda: (tokens.clone(), off.get(name, probs).clone())

    def build(size, batch, device, dtype) -> _drafts.Workload:
        return _drafts.Workload(vocab=8, variants={name: variant(name) for name in DRAFT_VARIANTS}, vary=lambda: None)

    monkeypatch.setitem(_drafts.WORKLOADS, "mtp", build)
    rows = _draft_bench.bench_draft("mtp", "tiny", 1, torch.device("cpu"), torch.float32, 1, False)
    for r in rows:
        assert r["tokens_changed_by_inputs"] is False and "Workload.vary()" in r["notes"], r
        assert r["tokens_match"] is (r["variant"] != "draftfuse"), r
    assert rows[3]["variant"] == "raw_cuda_graph" and rows[3]["probs_max_abs_diff"] == pytest.approx(tolerance / 2)
    assert math.isnan(rows[4]["probs_max_abs_diff"])  # draftfuse


def _draft(workload: str, batch: int, variant: str, us: float, host: float | None = None, **fields) -> dict:
    return _rows.row(workload, batch, 128256, 1, "bfloat16", variant, median_us=us, host_us_per_call=host, **fields)


def _select(vocab: int, batch: int, k, variant: str, us: float, **fields) -> dict:
    return _rows.row("selection", batch, vocab, k, "bfloat16", variant, median_us=us, **fields)


def _line(table: str, start: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(start))


def test_table_marks_each_target_met_or_missed_with_its_ratio(monkeypatch):
    from benchmarks import targets

    monkeypatch.setattr(targets, "REASONS", {})  # the maintainers' analyses of real misses: not these rows
    rows = [
        _draft("mtp", 1, "draftfuse", 2300.0, host=25.0),  # host met; 2300 / 2388.3 = 0.96 (met)
        _draft("mtp", 32, "draftfuse", 2700.0, host=45.0),  # host 45 / 30 = 1.50 (missed)
        _draft("eagle", 1, "draftfuse", 2200.0, host=None, host_note="host time: the call waits on the device"),
        _select(32000, 1, None, "floor", 4.0),
        _select(32000, 1, 1, "draftfuse", 5.5),  # ≤ max(1.5 × 4, 5) = 6: met
        _select(32000, 8, None, "floor", 0.2),
        _select(32000, 8, 1, "draftfuse", 6.0),  # 6 / 5 = 1.20: missed, beside batch 1's 5.5 µs (the fixed cost)
        _select(128256, 1, None, "floor", 1.0),
        _select(128256, 1, 1, "draftfuse", 7.0, notes="two dependent kernels"),  # 7 / 5 = 1.40: missed
        _select(128256, 1, 4, "softmax+topk", 80.0),
        _select(128256, 1, 4, "draftfuse", 8.8),  # 8.8 / 8 = 1.10 missed; 80 / 8.8 = 9.09× < 10: missed
        _select(128256, 1, 4, "draftfuse", 9.0, temperature="tensor", tokens_match=False),
        _select(128256, 1, 4, "softmax+topk", 90.0, temperature="tensor", tokens_match=True),
    ]
    baseline = [_draft("mtp", 1, "draftfuse", 2388.3), _draft("eagle", 1, "draftfuse", 2126.1)]
    tp = [
        {"workload": "tp_selection", "tp": 2, "vocab": 128256, "batch": 64, "k": 1, "variant": v, "median_us": us,
         "tokens_match": True} for v, us in (("all_gather+softmax+topk", 100.0), ("draftfuse", 40.0))
    ] + [
        {"workload": "tp_selection", "tp": 2, "vocab": 128256, "batch": 1, "k": 1, "variant": v, "median_us": us,
         "tokens_match": match} for v, us, match in (("all_gather+softmax+topk", 20.0, True), ("draftfuse", 25.0, False))
    ]  # fmt: skip
    runs = [
        {"command": "python benchmarks/run.py", "size": "reference", "seconds": 1.0, "skipped": ["eagle 8", "mtp 8"]},
        {"command": "python benchmarks/run.py --only mtp", "size": "reference", "seconds": 1.0, "skipped": [],
         "measured": ["mtp 8"]},  # what a later run measured is not listed as not measured
    ]
    table = report.markdown(META, rows, runs, baseline, tp)

    assert _line(table, "| draftfuse host µs") == (
        "| draftfuse host µs / call ≤ 30 (batch 1 and 32, each draft workload) | 1 | 2 | 3 | mtp batch 32: 45.00 µs vs "
        "<= 30.00 µs (ratio 1.50); eagle batch 1: – vs <= 30.00 µs. Reasons: host time: the call waits on the device (1×) |"
    )
    assert _line(table, "| selection k=1") == (
        "| selection k=1 (index + exact max-prob): draftfuse ≤ max(1.5 × floor, 5 µs) | 1 | 2 | 37 | bfloat16 V=32000 "
        "B=8: 6.00 µs vs <= 5.00 µs (ratio 1.20); bfloat16 V=128256 B=1: 7.00 µs vs <= 5.00 µs (ratio 1.40). Reasons: "
        "fixed cost (batch 1 here) 5.50 µs and floor 0.20 µs: 5.70 µs together (1×); two dependent kernels (1×) |"
    )
    # a miss's figures from the same run: what k = 1 takes at the point, what 10x asks for
    assert ("| 0 | 1 | 119 | bfloat16 V=128256 B=1 k=4: 8.80 µs vs <= 8.00 µs (ratio 1.10). Reasons: k = 1 here 7.00 µs, "
            "k = 4 adds 1.80 (1×) |") in table
    assert ("| 0 | 1 | 95 | bfloat16 V=128256 B=1 k=4: 9.09× vs >= 10.00× (ratio 0.91). Reasons: 10x asks for 8.00 µs "
            "here, k = 1 takes 7.00 (1×) |") in table
    # draftfuse's temperature rows only; a row with wrong outputs misses every target it is measured for
    assert "rewritten and exact (draftfuse) | 0 | 1 | 159 | bfloat16 V=128256 B=1 k=4: tokens match no |" in table
    assert ("× its time without | 0 | 1 | 159 | bfloat16 V=128256 B=1 k=4: 1.02× vs <= 1.05× (ratio 0.97). Reasons: "
            "outputs not exact (tokens_match: no) (1×) |") in table
    assert _line(table, "| draftfuse device µs now / previous") == (
        "| draftfuse device µs now / previous results (wave 1) ≤ 1 (batch 1..64) | 1 | 1 | 10 | eagle batch 1: 1.03 vs "
        "<= 1.00 (ratio 1.03) |"
    )
    assert "k=1 and 4) | 1 | 0 | 1 | – |" in table  # 100 / 40 = 2.5× at k=1; k=4 not measured
    assert ("≤ 1 (batch 1) | 0 | 1 | 0 | tp 2 V=128256 B=1 k=1: 1.25× vs <= 1.00× (ratio 1.25). Reasons: outputs not "
            "exact (tokens_match: no) (1×) |") in table  # slower, and its tokens wrong
    assert "tokens match on every row | 3 | 1 | 0 |" in table
    assert "(batch 64, vocab 128256) | 0 | 0 | 1 | – |" in table  # no tp 4/8 rows
    assert "Not measured (time budget): eagle 8." in table
    assert "| mtp batch 1 | 25.00 µs | <= 30.00 µs | 0.83 | met |  |" in table  # a met point, with its ratio
    assert table.index("## Targets") < table.index("## mtp:") < table.index("## Target points")
    # a target's reason explains its misses: a met point of it shows none
    monkeypatch.setattr(targets, "REASONS", {("sel_k1", None): "analysed"})
    table = report.markdown(META, rows, runs, baseline, tp)
    assert "| bfloat16 V=32000 B=1 | 5.50 µs | <= 6.00 µs | 0.92 | met |  |" in table
    assert "| bfloat16 V=128256 B=1 | 7.00 µs | <= 5.00 µs | 1.40 | **missed** | two dependent kernels |" in table


def test_host_and_baseline_misses_are_explained_by_the_same_runs_figures():
    from benchmarks import targets

    rows = [
        _draft("mtp", 1, "draftfuse", 2400.0, host=80.0),
        _draft("mtp", 1, "raw_cuda_graph", 2300.0, host=50.0),
        _draft("mtp", 1, "hand_fold+hand_argmax", 2600.0, host=150.0),
        _draft("eagle", 1, "draftfuse", 2000.0, host=20.0),  # met: no reason needed
        _draft("eagle", 1, "raw_cuda_graph", 1900.0, host=40.0),
    ]
    baseline = [_draft("mtp", 1, "draftfuse", 2300.0), _draft("mtp", 1, "hand_fold+hand_argmax", 2400.0)]
    points = {(p.target, p.where): p for p in targets.draft_points(rows, baseline)}

    host = points["host", "mtp batch 1"]
    assert host.met is False and host.reason == (
        "raw CUDA graph runner, same run: 50.0 µs (over the target too: this host's floor); draftfuse / raw 1.60; "
        "parts: notes/host.md (replay alone 3-21 µs; its 4 cuDNN sm90 attention nodes 1.2-2.3 each)"
    )
    assert len(host.reason) <= 200, "the target table's summary shows a reason's first 200 characters"
    assert points["host", "eagle batch 1"].met is True
    drift = points["baseline", "mtp batch 1"]  # 2400 / 2300 = 1.04: missed, while the same code moved 2600 / 2400
    assert drift.met is False
    assert drift.reason == "hand_fold+hand_argmax, the same code in both runs, moved 1.083x between them (the machine's drift)"


def test_report_merges_results_files_and_prints_the_targets_last(tmp_path, capsys):
    first, second = tmp_path / "drafts.json", tmp_path / "selection.json"
    runs = [{"command": "a", "size": "reference", "seconds": 1.0, "skipped": []}]
    first.write_text(json.dumps({**META, "runs": runs, "rows": [_draft("mtp", 1, "draftfuse", 1.0, host=20.0)]}))
    second.write_text(json.dumps({**META, "runs": runs, "rows": [_select(32000, 1, 1, "draftfuse", 3.0)]}))
    report.main([str(first), str(second), "--out", str(tmp_path / "h200"), "--print", "targets"])
    merged = json.loads((tmp_path / "h200.json").read_text())
    assert [r["workload"] for r in merged["rows"]] == ["mtp", "selection"] and len(merged["runs"]) == 2
    out = capsys.readouterr().out
    assert out.rstrip().endswith(report.targets_only((tmp_path / "h200.md").read_text()).rstrip())
    assert "| draftfuse host µs / call ≤ 30 (batch 1 and 32, each draft workload) | 1 | 0 | 5 | – |" in out
    assert "benchmarks/results/h200_wave1.json" in (tmp_path / "h200.md").read_text()  # the default baseline


def test_a_partial_run_keeps_the_other_rows_of_the_results_file(tmp_path):
    meta = {"gpu": "cpu", "torch": "2.13", "date": "today", "copy_bandwidth_TBps": None}
    info = {"command": "first", "size": "tiny", "seconds": 0.0, "skipped": ["mtp 8", "eagle 8"]}
    first = run._Results(tmp_path, "cpu", meta, partial=False)
    first.add("eagle 1", [_draft("eagle", 1, "eager", 3.0)])
    first.add("mtp 1", [_draft("mtp", 1, "eager", 1.0)])
    first.write(info)

    partial = run._Results(tmp_path, "cpu", meta, partial=True)  # e.g. --only mtp
    partial.add("mtp 1", [_draft("mtp", 1, "eager", 2.0)])
    partial.add("mtp 8", [_draft("mtp", 8, "eager", 2.0)])  # skipped by the first run, measured now
    partial.write(dict(info, command="second", skipped=[]))
    results = json.loads((tmp_path / "cpu.json").read_text())
    assert sorted((r["workload"], r["batch"], r["median_us"]) for r in results["rows"]) == [("eagle", 1, 3.0), ("mtp", 1, 2.0), ("mtp", 8, 2.0)]
    assert [(r["command"], r["skipped"]) for r in results["runs"]] == [("first", ["eagle 8"]), ("second", [])]
    # a run all of whose rows were measured again is no longer listed
    again = run._Results(tmp_path, "cpu", meta, partial=True)
    again.runs[0]["skipped"] = []
    again.runs[0]["measured"] = ["eagle 1"]
    again.add("eagle 1", [_draft("eagle", 1, "eager", 5.0)])
    again.write(dict(info, command="third", skipped=[], measured=["eagle 1"]))
    assert [r["command"] for r in json.loads((tmp_path / "cpu.json").read_text())["runs"]] == ["second", "third"]

    full = run._Results(tmp_path, "cpu", meta, partial=False)
    full.add("mtp 1", [_draft("mtp", 1, "eager", 4.0)])
    full.write(info)
    rows = json.loads((tmp_path / "cpu.json").read_text())["rows"]
    assert [(r["workload"], r["median_us"]) for r in rows] == [("mtp", 4.0)]


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_launches_are_counted_per_labelled_call_and_nested_launches_once():
    """The launch counting of the GPU run, on CPU ops standing in for the CUDA launch calls: aten::t runs
    inside aten::linear as a driver launch runs inside a runtime launch, and must not count again."""
    import torch.nn.functional as F

    x = torch.randn(4, 4)
    calls = {"two kernels": lambda: (F.linear(x, x), F.linear(x, x)), "one graph": lambda: x.cos(), ("k", 4): x.sin}
    counts = _measure.count_launches(calls, graph_names=("aten::cos",), kernel_names=("aten::linear", "aten::t"))
    assert counts == {"two kernels": (0, 2), "one graph": (1, 0), ("k", 4): (0, 0)}


def test_host_times_take_turns_and_the_median(monkeypatch):
    order, figures = [], {"fast": [9.0, 3.0, 5.0, 4.0, 30.0], "waits": [None]}
    gpu = torch.device("cuda")

    def host_time(call, device):
        name = call()
        order.append(name)
        return _measure.HostTime(figures[name][order.count(name) - 1], 20, 1000.0, 1 if figures[name][0] else 5)

    monkeypatch.setattr(_measure, "host_time", host_time)
    times = _measure.host_times({"fast": lambda: "fast", "waits": lambda: "waits"}, gpu, batches=5)
    assert order == ["fast", "waits", "fast", "fast", "fast", "fast"]  # a call with no host time is not retried
    assert times["fast"].us_per_call == 5.0 and times["waits"].us_per_call is None and times["waits"].note


def test_one_median_and_cpu_timings():
    assert _measure.summary([4.0, 1.0, 3.0, 2.0]) == pytest.approx({"median_us": 2.5, "p10_us": 1.3, "p90_us": 3.7})
    assert _measure.quantile([5.0], 0.9) == 5.0
    cpu = torch.device("cpu")
    assert _measure.host_time(lambda: None, cpu).us_per_call is None  # no device to keep busy
    samples = _measure.time_alternating({"a": lambda: None, "b": lambda: None}, cpu, rounds=3)
    assert {name: len(times) for name, times in samples.items()} == {"a": 3, "b": 3}
    errors = {}
    samples = _measure.time_alternating({"ok": lambda: None, "bad": lambda: 1 / 0}, cpu, rounds=2, errors=errors)
    assert list(samples) == ["ok"] and errors["bad"].startswith("ZeroDivisionError")
    assert _measure.rotation_count(1 << 20, cpu) == 1


def test_selection_subsets_are_partial_runs_of_those_shapes_only():
    args = run._parse_args(["--device", "cpu", "--vocabs", "262144", "--dtypes", "float32"])
    assert list(run._units(args))[-5:] == [("selection", ("float32", 262144, b)) for b in (1, 8, 32, 64, 256)]
    assert all(unit[0] == "float32" and unit[1] == 262144 for workload, unit in run._units(args) if workload == "selection")
    assert run._partial(args) and run._partial(run._parse_args(["--device", "cpu", "--dtypes", "bfloat16"]))
    assert not run._partial(run._parse_args(["--device", "cpu"]))


def test_the_selection_check_fails_wrong_indices_order_and_probabilities():
    """exact(): the k largest, distinct, in descending order, with softmax's probabilities (a check that
    sorted the picked logits passed a duplicated index, a reversed top-k and any probabilities)."""
    logits = torch.tensor([[5.0, 7.0, 7.0, 1.0], [0.0, 3.0, 2.0, 1.0]])
    probs = torch.softmax(logits.double(), -1)
    index = torch.tensor([[1, 2], [1, 2]])
    right = (probs.gather(-1, index).float(), index)
    assert _selection_bench.exact(logits, right, 2, probs=True)[0]
    tie = torch.tensor([[2, 1], [1, 2]])  # logits 7 and 7: either order
    assert _selection_bench.exact(logits, (probs.gather(-1, tie).float(), tie), 2, probs=True)[0]
    duplicated = torch.tensor([[1, 1], [1, 2]])
    assert not _selection_bench.exact(logits, (probs.gather(-1, duplicated).float(), duplicated), 2, probs=True)[0]
    reversed_ = torch.tensor([[1, 2], [2, 1]])
    assert not _selection_bench.exact(logits, (probs.gather(-1, reversed_).float(), reversed_), 2, probs=True)[0]
    assert not _selection_bench.exact(logits, (right[0].flip(0), index), 2, probs=True)[0]  # rows' probabilities swapped
    assert not _selection_bench.exact(logits, (torch.full_like(right[0], math.nan), index), 2, probs=True)[0]
    assert _selection_bench.exact(logits, index, 2, probs=False) == (True, None)  # indices alone (torch.topk's)


def test_a_unit_measured_again_replaces_every_row_of_it():
    """A draft unit that failed in a later run (its rows carry the error, and no vocabulary) replaces the
    earlier run's rows of that workload and batch: the target shows the failure, not the stale time."""
    from benchmarks import targets

    old = [_draft("mtp", 1, "draftfuse", 2300.0, host=10.0)]
    failed = [_rows.row("mtp", 1, None, 1, "bfloat16", v, error="CUDA out of memory") for v in _rows.DRAFT_VARIANTS]
    merged: dict = {}
    _rows.replace_units(merged, old)
    _rows.replace_units(merged, failed)
    assert len(merged) == len(failed) and all(r.get("error") for r in merged.values())
    host = next(p for p in targets.all_points(list(merged.values())) if p.target == "host" and p.where == "mtp batch 1")
    assert host.met is False and "out of memory" in host.reason
