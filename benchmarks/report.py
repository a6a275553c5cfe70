"""The benchmark's results as a report: the target table, one table per workload, the plot. No measuring here.

    python benchmarks/report.py RESULTS.json [MORE.json ...] [--out DIR/NAME] [--baseline JSON] [--tp JSON]
                                [--print targets]

merges the rows of the results files (a later file's row replaces an earlier one that measures the same
thing), writes DIR/NAME.{json,md,png} with --out, and prints the markdown last (with `--print targets`,
only its target table). benchmarks/run.py writes the same report after every step of a run.

Besides the rows of a run, the report reads the previous committed results (the baseline of the
"at least as fast as before" target: benchmarks/results/NAME_wave1.json by default) and the
tensor-parallel rows of another benchmark (workload "tp_selection": NAME_tp.json next to the results,
else in benchmarks/results), where those files exist.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

from benchmarks import targets as _targets  # noqa: E402
from benchmarks._rows import DRAFT_VARIANTS, DRAFT_WORKLOADS, TITLES, replace_units, sort_key  # noqa: E402
from benchmarks.targets import quotient  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
MISSES_SHOWN = 8  # misses listed per target in the summary; the rest under "Target points"


# ---- files ----


def read_results(path: Path) -> tuple[dict, list[dict]]:
    """(meta, rows) of a results file: {"gpu": ..., "rows": [...]} or a bare list of rows."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        return {}, data
    return {k: v for k, v in data.items() if k != "rows"}, data["rows"]


def default_baseline(name: str) -> Path | None:
    path = RESULTS / f"{name}_wave1.json"
    return path if path.exists() else None


def default_tp(out: Path, name: str) -> Path | None:
    return next((p for p in (out / f"{name}_tp.json", RESULTS / f"{name}_tp.json") if p.exists()), None)


def merge(files: list[Path]) -> tuple[dict, list[dict]]:
    """One results object from several: the last file's meta (where it has the field; the header then
    names the latest run), every file's runs, and each unit's rows from the last file that measured it."""
    meta: dict = {}
    runs: list[dict] = []
    rows: dict[tuple, dict] = {}
    for path in files:
        file_meta, file_rows = read_results(path)
        later = file_meta.pop("runs", [])
        remeasured = {label for run in later for label in run.get("measured", [])}
        for run in runs:  # an earlier run's units measured again are no longer its own
            if "measured" in run:
                run["measured"] = [label for label in run["measured"] if label not in remeasured]
        runs = [run for run in runs if run.get("measured") != [] or run.get("skipped")] + later
        meta.update((key, value) for key, value in file_meta.items() if value is not None)
        replace_units(rows, file_rows)
    return {**meta, "runs": runs}, sorted(rows.values(), key=sort_key)


# ---- formatting ----


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _by(rows: list[dict], *keys: str) -> dict[tuple, dict[str, dict]]:
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), {})[r["variant"]] = r
    return groups


def _get(by_variant: dict[str, dict], variant: str, field: str = "median_us"):
    return by_variant.get(variant, {}).get(field)


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def _table(header: list[str], align: str, body: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in cells) + " |" for cells in body]


def _problems(rows: list[dict], describe) -> list[str]:
    """One line per row with an error or notes."""
    lines = []
    for r in rows:
        for field in ("error", "notes", "host_note"):
            if r.get(field):
                lines.append(f"- {field}, {describe(r)}: {str(r[field]).splitlines()[0][:240]}")
    return lines


# ---- sections ----


def _draft_section(workload: str, rows: list[dict]) -> list[str]:
    eager, captured, hand, raw, ours = DRAFT_VARIANTS
    body = []
    for (batch,), v in sorted(_by(rows, "batch").items()):
        cells = [batch] + [_fmt(_get(v, name)) for name in DRAFT_VARIANTS]
        cells += [_fmt(quotient(_get(v, captured), _get(v, ours)), 3), _fmt(quotient(_get(v, ours), _get(v, hand)), 3)]
        cells += [_fmt(quotient(_get(v, ours), _get(v, raw)), 3)]
        cells += [_fmt(_get(v, name, "host_us_per_call")) for name in (hand, raw, ours)]
        cells += [_fmt(_get(v, ours, "graph_launches_per_call"), 2)]
        body.append(cells)
    header = ["batch"] + [f"{name} µs" for name in DRAFT_VARIANTS]
    header += [f"{captured} / {ours}", f"{ours} / {hand}", f"{ours} / {raw}"]
    header += [f"host µs {name}" for name in (hand, raw, ours)] + [f"{ours} graph launches / call"]
    lines = [f"## {workload}: {TITLES[workload]}", ""]
    lines += ["Device µs per draft (median); host µs per call with the GPU kept busy.", ""]
    lines += _table(header, "r" * len(header), body) + [""]
    detail = []
    for r in rows:
        cells = [r["batch"], r["variant"], _fmt(r["median_us"]), _fmt(r["p10_us"]), _fmt(r["p90_us"])]
        cells += [_fmt(r["graph_launches_per_call"], 2), _fmt(r["kernel_launches_per_call"], 2)]
        cells += [_fmt(r["host_us_per_call"]), _fmt(r["tokens_match"]), _fmt(r["tokens_reference"])]
        cells += [_fmt(r["compile_cold_s"]), _fmt(r["compile_warm_s"])]
        detail.append(cells)
    header = ["batch", "variant", "median µs", "p10 µs", "p90 µs", "graph launches / call", "kernel launches / call",
              "host µs / call", "tokens match", "compared with", "compile cold s", "compile warm s"]  # fmt: skip
    lines += _table(header, "rlrrrrrrllrr", detail)
    return lines + [""] + _problems(rows, lambda r: f"batch {r['batch']} {r['variant']}")


def _baseline_section(rows: list[dict], baseline: list[dict]) -> list[str]:
    now = _by([r for r in rows if r["workload"] in DRAFT_WORKLOADS], "workload", "batch")
    then = _by([r for r in baseline if r["workload"] in DRAFT_WORKLOADS], "workload", "batch")
    body = []
    for workload in DRAFT_WORKLOADS:
        for batch in sorted(b for w, b in then if w == workload):
            new, old = now.get((workload, batch), {}), then[workload, batch]
            ratio = quotient(_get(new, "draftfuse"), _get(old, "draftfuse"))
            drift = quotient(_get(new, "hand_fold+hand_argmax"), _get(old, "hand_fold+hand_argmax"))
            body.append([workload, batch, _fmt(_get(new, "draftfuse")), _fmt(_get(old, "draftfuse")), _fmt(ratio, 3),
                         _fmt(drift, 3)])  # fmt: skip
    header = ["workload", "batch", "draftfuse µs now", "draftfuse µs then", "now / then",
              "hand_fold+hand_argmax now / then (same code: the machine's drift)"]  # fmt: skip
    return ["## Device time against the previous results", ""] + _table(header, "lrrrrr", body) + [""]


def _selection_section(rows: list[dict]) -> list[str]:
    floors = {(r["dtype"], r["vocab"], r["batch"]): r["median_us"] for r in rows if r["variant"] == "floor"}
    plain = [r for r in rows if r["variant"] != "floor" and not r.get("temperature")]
    body = []
    for (dtype, k, vocab, batch), v in _by(plain, "dtype", "k", "vocab", "batch").items():
        floor, ours = floors.get((dtype, vocab, batch)), _get(v, "draftfuse")
        target = _targets.selection_limit(k, batch, floor)[0]
        speedup = quotient(_get(v, "softmax+topk"), ours)
        cells = [dtype, k, vocab, batch, _fmt(floor, 2), _fmt(_get(v, "softmax+topk"), 2)]
        cells += [_fmt(_get(v, "torch.argmax" if k == 1 else "torch.topk"), 2), _fmt(ours, 2), _fmt(target, 2)]
        cells += [_fmt(quotient(ours, target), 2), _fmt(speedup, 1), _fmt(_get(v, "draftfuse", "host_us_per_call"), 1)]
        cells += [_fmt(_get(v, "draftfuse", "tokens_match"))]
        body.append(cells)
    header = ["dtype", "k", "vocab", "batch", "floor µs", "softmax+topk µs", "torch.argmax / topk µs"]
    header += ["draftfuse µs", "target µs", "draftfuse / target", "softmax+topk / draftfuse", "draftfuse host µs"]
    header += ["draftfuse tokens"]
    lines = [
        f"## selection: {TITLES['selection']}",
        "",
        "Each call captured in a CUDA graph of calls over rotating logits buffers (kernel time), draftfuse's "
        "kernels with a workspace made before the capture, as draftfuse's recordings and CUDA graph trees run "
        "them (a bare torch.cuda.graph capture adds a fill kernel per call; selection runs before 2026-12-02 "
        "timed that); floor: the "
        "logits' bytes read once at the measured copy bandwidth. Target: max(1.5 × floor, 5 µs) for k = 1, "
        "max(3 × floor, 8 µs) for k > 1 (and softmax+topk / draftfuse ≥ 10 at batch ≤ 64). Tokens: the "
        "indices pick the k largest logits.",
        "",
        *_table(header, "lrrrrrrrrrrrl", body),
        "",
    ]
    tempered = [r for r in rows if r.get("temperature")]
    if tempered:
        body = []
        for (dtype, k, vocab, batch), v in _by(tempered, "dtype", "k", "vocab", "batch").items():
            base, ours = _get(v, "softmax+topk"), _get(v, "draftfuse")
            cells = [dtype, k, vocab, batch, _fmt(base, 2), _fmt(ours, 2), _fmt(quotient(base, ours), 1)]
            body.append(cells + [_fmt(_get(v, name, "tokens_match")) for name in ("softmax+topk", "draftfuse")])
        header = ["dtype", "k", "vocab", "batch", "softmax(x / t) + topk µs", "draftfuse (scale = 1 / t) µs",
                  "softmax+topk / draftfuse", "softmax+topk tokens", "draftfuse tokens"]  # fmt: skip
        lines += ["### With a per-row temperature tensor t", "", *_table(header, "lrrrrrrll", body), ""]
    describe = lambda r: f"{r['dtype']} k={r['k']} V={r['vocab']} B={r['batch']} {r['variant']}" + (  # noqa: E731
        " (temperature)" if r.get("temperature") else "")
    return lines + _problems(rows, describe)


def _tp_section(tp_rows: list[dict]) -> list[str]:
    body = []
    for (tp, dtype, vocab, batch, k), v in sorted(_by(tp_rows, "tp", "dtype", "vocab", "batch", "k").items(), key=str):
        gather, ours = _get(v, _targets.TP_GATHER), _get(v, "draftfuse")
        cells = [tp, _fmt(dtype), vocab, batch, k, _fmt(gather, 2), _fmt(ours, 2), _fmt(quotient(gather, ours), 2)]
        body.append(cells + [_fmt(_get(v, name, "tokens_match")) for name in (_targets.TP_GATHER, "draftfuse")])
    header = ["tp", "dtype", "vocab", "batch", "k", f"{_targets.TP_GATHER} µs", "draftfuse µs",
              f"{_targets.TP_GATHER} / draftfuse", "gather tokens", "draftfuse tokens"]  # fmt: skip
    lines = [f"## tp_selection: {TITLES['tp_selection']}", "", *_table(header, "rlrrrrrrll", body), ""]
    return lines + _problems(tp_rows, lambda r: f"tp {r.get('tp')} V={r.get('vocab')} B={r['batch']} {r['variant']}")


def target_table(points: list[_targets.Point]) -> list[str]:
    """The summary: per target, points met, missed (each with its ratio and reason), not measured."""
    lines = ["## Targets", ""]
    lines += ["| target | met | missed | not measured | missed at: measured vs target (ratio); reason |"]
    lines += ["|---|---:|---:|---:|---|"]
    for target, name in _targets.NAMES.items():
        mine = [p for p in points if p.target == target]
        missed = [p.text(reason=False) for p in mine if p.met is False]
        shown = "; ".join(missed[:MISSES_SHOWN]) + (f"; … {len(missed) - MISSES_SHOWN} more under Target points"
                                                     if len(missed) > MISSES_SHOWN else "")  # fmt: skip
        reasons = Counter(p.reason for p in mine if p.met is False and p.reason)
        if reasons:
            shown += ". Reasons: " + "; ".join(f"{text[:200]} ({n}×)" for text, n in reasons.most_common(3))
        counts = [sum(p.met is True for p in mine), len(missed), sum(p.met is None for p in mine)]
        lines.append(f"| {name} | " + " | ".join(map(str, counts)) + f" | {shown or '–'} |")
    return lines


def _points_section(points: list[_targets.Point]) -> list[str]:
    lines = ["## Target points", "", "Every measured point of every target: measured, the bound, their ratio, the "
             "verdict (yes/no targets: their misses).", ""]  # fmt: skip
    for target, name in _targets.NAMES.items():
        mine = [p for p in points if p.target == target]
        shown = [p for p in mine if p.met is False or (p.met is True and p.op != "is")]
        body = []
        for p in shown:
            measured = _fmt(p.measured, 2) if not isinstance(p.measured, float) else f"{p.measured:.2f}{p.unit}"
            limit = "yes" if p.op == "is" else "–" if p.limit is None else f"{p.op} {p.limit:.2f}{p.unit}"
            body.append([p.where, measured, limit, _fmt(p.ratio, 2), _verdict(p.met), (p.met is False and p.reason) or ""])  # why a miss is one
        counts = (f"{sum(p.met is True for p in mine)} met, {sum(p.met is False for p in mine)} missed, "
                  f"{sum(p.met is None for p in mine)} not measured")  # fmt: skip
        lines += [f"### {name}", "", counts + ".", ""]
        if body:
            lines += [*_table(["where", "measured", "target", "ratio", "verdict", "reason"], "lrrrll", body), ""]
    return lines


NOTES = [
    "- Drafts (benchmarks/_drafts.py, benchmarks/_draft_bench.py): the variants alternate call by call in one "
    "process on the same inputs, after a warm-up; each call timed with CUDA events from an idle device; median, "
    "p10, p90 over `--rounds` calls (draftfuse/_measure.py).",
    "- host µs / call: the time for the Python call to return with the GPU kept busy, so that no call waits on "
    "the device: a GPU sleep (torch.cuda._sleep, calibrated) queued first, N calls timed back to back with "
    "perf_counter, elapsed / N; valid only if an event recorded behind the sleep had not completed when the "
    "batch ended (else retried with fewer calls and a longer sleep; null, with a note, if the call waits on the "
    "device); the median of 5 such batches, the variants taking turns. raw_cuda_graph: the hand edit captured "
    "once in a torch.cuda.CUDAGraph; per call, its inputs copied into static buffers, one replay, the outputs "
    "cloned. draftfuse's outputs are the caller's too, without a copy while a spare recording is free (the "
    "benchmark drops each call's outputs).",
    "- Launches: torch.profiler host events per call; a launch inside another launch call counts once. Kernels "
    "inside a CUDA graph replay are not launched individually: a replay shows as one cudaGraphLaunch. "
    "Selection launches are of the call run eagerly (its timing is inside a CUDA graph).",
    "- Tokens (drafts): after the timing, each variant is called on the workload's inputs, then on other inputs "
    "written into the same tensors (other tokens, hidden states, positions), its outputs cloned as each call "
    "returns; tokens must equal those of the variants named in `compared with` and the probabilities be within "
    "0.05 of theirs (probs_max_abs_diff in the json; one bf16 step of a logit moves them by up to 0.022), and "
    "tokens_changed_by_inputs shows the second set drafted other tokens. Tokens (selection): the outputs of the "
    "eager call and of every call in the timed CUDA graph, after its last replay: k distinct indices of the k "
    "largest logits in descending order, and softmax's probabilities there within 1e-4 relative (float64 "
    "reference; prob_rel_error in the json). A row whose outputs are wrong misses every target it is in.",
    "- compile cold: the first call (compile, CUDA-graph warm-up or capture) in a fresh Inductor cache; compile "
    "warm (each workload's first batch only): after torch._dynamo.reset(), a fresh compile of the same function.",
]


def markdown(
    meta: dict, rows: list[dict], runs: list[dict], baseline: list[dict] | None = None, tp_rows: list[dict] = (),
    sources: dict[str, str] | None = None,
) -> str:  # fmt: skip
    """The results as markdown: the target table first, one table per workload, every target point, how
    they were measured. `sources`: where the baseline and tensor-parallel rows came from (for the header)."""
    tp_rows = list(tp_rows)
    points = _targets.all_points(rows, baseline, tp_rows)
    bandwidth = meta.get("copy_bandwidth_TBps")
    lines = [f"# draftfuse benchmarks on {meta.get('gpu')}", ""]
    lines += [f"torch {meta.get('torch')}, {meta.get('date')}; device-to-device copy bandwidth "
              f"{_fmt(bandwidth, 2)} TB/s (bytes read + written).", ""]  # fmt: skip
    for run in runs:
        lines.append(f"- `{run['command']}` ({run['size']} size, {run['seconds']:.0f} s)")
    for label, source in (sources or {}).items():
        lines.append(f"- {label}: {source}")
    lines += ["", *target_table(points)]
    measured = {s for run in runs for s in run.get("measured", [])}  # a later run may measure what one skipped
    skipped = list(dict.fromkeys(s for run in runs for s in run.get("skipped", []) if s not in measured))
    if skipped:
        lines += ["", "Not measured (time budget): " + ", ".join(skipped) + "."]
    lines.append("")
    for workload in DRAFT_WORKLOADS:
        mine = [r for r in rows if r["workload"] == workload]
        if mine:
            lines += _draft_section(workload, mine) + [""]
    if baseline:
        lines += _baseline_section(rows, baseline)
    selection = [r for r in rows if r["workload"] == "selection"]
    if selection:
        lines += _selection_section(selection) + [""]
    if tp_rows:
        lines += _tp_section(tp_rows) + [""]
    lines += [*_points_section(points), "## How these were measured", "", *NOTES]
    return "\n".join(lines) + "\n"


def targets_only(text: str) -> str:
    """The target table (and what was skipped) of a report's markdown."""
    start = text.index("## Targets")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None].rstrip() + "\n"


# ---- the plot ----

_COLORS = {
    "eager": "tab:gray", "eager_seed+captured_loop": "tab:orange", "hand_fold+hand_argmax": "tab:green",
    "raw_cuda_graph": "tab:blue", "draftfuse": "tab:red", "softmax+topk": "tab:orange", "torch.argmax": "tab:green",
    "torch.topk": "tab:green", "floor": "black",
}  # fmt: skip


def plot(rows: list[dict], path: Path) -> str:
    """Latency against batch, one line per variant, one panel per draft workload and per selection
    (dtype, k, vocab); temperature rows dashed in their selection panel."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: plot skipped"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in rows if r.get("median_us") is not None), key=sort_key)
    floors = [r for r in rows if r["variant"] == "floor"]
    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["variant"] != "floor":
            panels.setdefault((r["workload"], r["dtype"], r["k"], r["vocab"]), []).append(r)
    if not panels:
        return "no rows: plot skipped"
    columns = min(4, len(panels))
    figure, axes = plt.subplots(math.ceil(len(panels) / columns), columns, figsize=(4.2 * columns,
                                3.2 * math.ceil(len(panels) / columns)), squeeze=False)  # fmt: skip
    for ax, ((workload, dtype, k, vocab), panel) in zip(axes.flat, panels.items()):
        if workload == "selection":
            panel = [r for r in floors if (r["dtype"], r["vocab"]) == (dtype, vocab)] + panel
        lines = {}
        for r in panel:
            label = r["variant"] + (" (temperature)" if r.get("temperature") else "")
            lines.setdefault(label, []).append((r["batch"], r["median_us"]))
        for label, points in lines.items():
            variant = label.split(" ")[0]
            style = "--" if variant == "floor" or "temperature" in label else "-o"
            ax.plot(*zip(*sorted(points)), style, label=label, color=_COLORS.get(variant), markersize=3)
        batches = sorted({r["batch"] for r in panel})
        title = f"{workload} ({dtype})" if workload != "selection" else f"selection {dtype} k={k} V={vocab}"
        ax.set(title=title, xlabel="batch", ylabel="µs per call", yscale="log")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return f"wrote {path}"


# ---- writing ----


def render(meta: dict, rows: list[dict], runs: list[dict], baseline: Path | None = None, tp: Path | None = None) -> str:
    """markdown() of the rows, with the baseline's and the tensor-parallel rows read from their files."""
    sources, baseline_rows, tp_rows = {}, None, []
    if baseline is not None:
        baseline_rows = read_results(baseline)[1]
        sources["previous results (the baseline)"] = f"{_shown(baseline)} ({len(baseline_rows)} rows)"
    if tp is not None:
        tp_rows = [r for r in read_results(tp)[1] if r.get("workload") == "tp_selection"]
        sources["tensor-parallel rows"] = f"{_shown(tp)} ({len(tp_rows)} rows)"
    return markdown(meta, rows, runs, baseline_rows, tp_rows, sources)


def write(out: Path, name: str, meta: dict, rows: list[dict], runs: list[dict],
          baseline: Path | None = None, tp: Path | None = None) -> str:  # fmt: skip
    """Write out/NAME.json (meta, runs, rows) and out/NAME.md; return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=sort_key)
    (out / f"{name}.json").write_text(json.dumps({**meta, "runs": runs, "rows": rows}, indent=1) + "\n")
    text = render(meta, rows, runs, baseline, tp)
    (out / f"{name}.md").write_text(text)
    return text


def _shown(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="results files (JSON) to merge, later ones win")
    parser.add_argument("--out", type=Path, help="DIR/NAME: write DIR/NAME.{json,md,png} (default: print only)")
    parser.add_argument("--baseline", type=Path, help="previous results (default: benchmarks/results/NAME_wave1.json)")
    parser.add_argument("--tp", type=Path, help="tp_selection rows (default: NAME_tp.json by --out, else in results)")
    parser.add_argument("--print", dest="show", choices=("all", "targets"), default="all")
    args = parser.parse_args(argv)
    meta, rows = merge(args.files)
    runs = meta.pop("runs")
    out, name = (args.out.parent, args.out.name) if args.out else (args.files[0].parent, args.files[0].stem)
    baseline = args.baseline or default_baseline(name)
    tp = args.tp or default_tp(out, name)
    if args.out:
        text = write(out, name, meta, rows, runs, baseline, tp)
        print(plot(rows, out / f"{name}.png"), flush=True)
    else:
        text = render(meta, rows, runs, baseline, tp)
    print(targets_only(text) if args.show == "targets" else text, end="", flush=True)


if __name__ == "__main__":
    main()
