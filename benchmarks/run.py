"""The benchmark: draftfuse against today's server layouts, a raw CUDA graph and the memory floor, side by side.

    python benchmarks/run.py                    # on a GPU: every workload at reference size
    python benchmarks/run.py --quick            # fewer vocabularies and batch sizes
    python benchmarks/run.py --only mtp eagle   # some workloads (their rows update an existing results file)
    python benchmarks/run.py --only selection --vocabs 262144 --dtypes float32   # some logits shapes
    python benchmarks/run.py --device cpu --size tiny --quick --rounds 3 --out /tmp/bench   # CPU smoke run
    bash scripts/gpu_bench.sh                   # the whole GPU run in one go (selection and drafts)

Needs only torch (2.11 or newer; Triton on a GPU; matplotlib for the plot, skipped without it): draftfuse
and the examples are imported from this checkout. Writes DIR/NAME.json, DIR/NAME.md and DIR/NAME.png
(DIR: --out, default benchmarks/results; NAME: h200 on an H200, else the device's name) after every
workload batch or logits shape, so an interrupted run leaves what it measured; prints the markdown last.

Workloads: three drafts at reference size (benchmarks/_drafts.py: frozen-KV MTP, EAGLE-style chain,
independent draft model, five variants each; measured by benchmarks/_draft_bench.py), run batch by
batch across the workloads, then the selection alone (benchmarks/_selection_bench.py: every method and
k, with and without a temperature tensor, each timed in a CUDA graph over rotating logits buffers).
Every timing is draftfuse/_measure.py's; the report (target table, tables, plot) is benchmarks/report.py's.
On a CPU there are no CUDA events, graphs, launches or a device to keep busy: those fields are null.

Budget: a draft batch at reference size compiles four variants (~30-45 s on an H200), a selection shape
takes a few seconds. The run starts no new unit (draft batch or logits shape) after --budget-s seconds
(default 420 on a GPU, no limit on a CPU) and lists what it skipped; a later run with --only (and
--batches, --vocabs, --dtypes) measures those into the same results file, keeping the rows it does not remeasure. So a run
lasts at most --budget-s plus its longest unit (and the imports before the clock starts).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

# Launch counts come from torch.profiler; without this, CUPTI stays attached after each profiling session
# and every later call's host time grows (3x for a graph replay on the H200: notes/cupti_probe.py).
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch  # noqa: E402
from torch._inductor.utils import fresh_cache  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # draftfuse and benchmarks from this checkout: nothing needs installing

from benchmarks import _draft_bench, _selection_bench, report, targets  # noqa: E402
from benchmarks._rows import DRAFT_VARIANTS, DRAFT_WORKLOADS, WORKLOADS, results_name, replace_units, row, row_key  # noqa: E402
from draftfuse import _measure  # noqa: E402

DRAFT_BATCHES, QUICK_DRAFT_BATCHES = (1, 8, 32, 64), (1, 32)
SELECTION_VOCABS, QUICK_SELECTION_VOCABS = targets.SELECTION_VOCABS, (128256,)
SELECTION_BATCHES, QUICK_SELECTION_BATCHES = targets.SELECTION_BATCHES, (1, 32)
SELECTION_DTYPES = targets.SELECTION_DTYPES

_START = time.perf_counter()


def _log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f} s] {message}", flush=True)


def _results_name(device: torch.device) -> str:
    return results_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else device.type


class _Results:
    """The rows so far, written out after every step; a partial run (--only, --batches, --vocabs, --dtypes)
    updates the rows it measures in an existing results file and keeps the others (and the runs that
    measured them)."""

    def __init__(self, out: Path, name: str, meta: dict, partial: bool, baseline=None, tp=None) -> None:
        self.out, self.name, self.meta, self.baseline, self.tp = out, name, meta, baseline, tp
        self.json_path, self.md_path, self.png_path = (out / f"{name}.{ext}" for ext in ("json", "md", "png"))
        self.rows: dict[tuple, dict] = {}
        self.runs: list[dict] = []
        if partial and self.json_path.exists():
            old_meta, old_rows = report.read_results(self.json_path)
            self.rows = {row_key(r): r for r in old_rows}
            self.runs = old_meta.get("runs", [])

    def add(self, label: str, rows: list[dict]) -> None:
        replace_units(self.rows, rows)
        for run in self.runs:  # measured now: neither skipped nor measured by an earlier run any more
            run["skipped"] = [s for s in run.get("skipped", []) if s != label]
            if "measured" in run:
                run["measured"] = [s for s in run["measured"] if s != label]

    def write(self, run: dict) -> str:
        # an earlier run none of whose rows are left is not listed (runs from before "measured" was kept stay)
        self.runs = [r for r in self.runs if r is not run and (r.get("measured") != [] or r.get("skipped"))]
        runs = self.runs + [run]
        return report.write(self.out, self.name, self.meta, list(self.rows.values()), runs, self.baseline, self.tp)


# ---- the run ----


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--size", choices=("tiny", "reference"), help="draft size (default: reference on cuda)")
    parser.add_argument("--only", nargs="+", choices=WORKLOADS, help="run only these workloads")
    parser.add_argument("--quick", action="store_true", help="fewer vocabularies and batch sizes")
    ints = lambda text: tuple(int(b) for b in text.split(","))  # noqa: E731
    parser.add_argument("--batches", type=ints, help="batch sizes of every workload, in this order, e.g. 1,32,8")
    names = lambda text: tuple(text.split(","))  # noqa: E731
    parser.add_argument("--vocabs", type=ints, help="selection: vocabularies, e.g. 262144 (default: all)")
    parser.add_argument("--dtypes", type=names, help="selection: logits dtypes, e.g. float32 (default: all)")
    parser.add_argument("--rounds", type=int, default=100, help="timed calls per draft variant (default 100)")
    parser.add_argument("--replays", type=int, default=30, help="selection: CUDA graph replays timed (default 30)")
    parser.add_argument("--no-warm-compile", dest="warm_compile", action="store_false",
                        help="skip the second (warm-cache) compile at each draft workload's first batch")  # fmt: skip
    parser.add_argument("--budget-s", type=float, help="start nothing new after this (default 420 s; cpu: none)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="results directory")
    parser.add_argument("--baseline", type=Path, help="previous results (default: benchmarks/results/NAME_wave1.json)")
    parser.add_argument("--tp", type=Path, help="tp_selection rows (default: OUT/NAME_tp.json, else in results)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.replays < 1:
        parser.error("--rounds and --replays must be at least 1")
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --device cpu (with --size tiny for a quick check)")
    args.size = args.size or ("reference" if args.device.type == "cuda" else "tiny")
    if args.budget_s is None:  # a CPU smoke run measures everything it is asked for, however slow the machine
        args.budget_s = 420.0 if args.device.type == "cuda" else float("inf")
    return args


def _partial(args: argparse.Namespace) -> bool:
    """Whether the run measures a part of the grid (its rows update the results file's, the rest kept)."""
    return bool(args.only or args.batches or args.vocabs or args.dtypes)


def _warm_up_compiler(device: torch.device) -> None:
    """One small compile, so that the first measured compile does not pay for lazy imports and for
    starting Inductor's compile workers."""
    compiled = torch.compile(lambda x: torch.softmax(x.sin(), -1), mode="reduce-overhead", fullgraph=True)
    for _ in range(_measure.WARMUP_CALLS):
        compiled(torch.randn(8, 64, device=device))
    torch._dynamo.reset()


def _units(args: argparse.Namespace) -> Iterator[tuple[str, tuple]]:
    """(workload, unit) in run order: the draft batches, batch by batch across the workloads (the first
    batches given are measured first), then the selection's logits shapes."""
    wanted = [w for w in WORKLOADS if not args.only or w in args.only]
    for batch in args.batches or (QUICK_DRAFT_BATCHES if args.quick else DRAFT_BATCHES):
        for workload in (w for w in wanted if w in DRAFT_WORKLOADS):
            yield workload, (batch,)
    if "selection" in wanted:
        vocabs = args.vocabs or (QUICK_SELECTION_VOCABS if args.quick else SELECTION_VOCABS)
        for dtype in args.dtypes or SELECTION_DTYPES:
            for vocab in vocabs:
                for batch in args.batches or (QUICK_SELECTION_BATCHES if args.quick else SELECTION_BATCHES):
                    yield "selection", (dtype, vocab, batch)


def _failed_unit(workload: str, unit: tuple, dtype: torch.dtype, error: str) -> list[dict]:
    if workload == "selection":
        return _selection_bench.failed_rows(*unit, error)
    dtype_name = str(dtype).removeprefix("torch.")
    return [row(workload, unit[0], None, 1, dtype_name, variant, error=error) for variant in DRAFT_VARIANTS]


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    device = args.device
    dtype = torch.bfloat16 if args.size == "reference" else torch.float32
    cuda = device.type == "cuda"
    if not cuda:
        # In-process compiles beat a pool of worker processes on a small CPU; one thread keeps times steady.
        torch._inductor.config.compile_threads = 1
        torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="draftfuse: draft .* runs on the CPU")
    command = "python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    run = {"command": command.strip(), "size": args.size, "seconds": 0.0, "skipped": [], "measured": []}
    # On a GPU, compile_cold_s must be cold: a fresh Inductor (and Triton) cache for this process.
    caches = fresh_cache() if cuda else contextlib.nullcontext()
    with caches, torch.no_grad():
        bandwidth = _measure.copy_bandwidth(device) if cuda else None
        meta = {
            "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "copy_bandwidth_TBps": bandwidth / 1e12 if bandwidth else None,
        }
        name = _results_name(device)
        baseline = args.baseline or report.default_baseline(name)
        tp = args.tp or report.default_tp(args.out, name)
        results = _Results(args.out, name, meta, _partial(args), baseline, tp)
        _log(f"{meta['gpu']}, torch {meta['torch']}, size {args.size}, {args.rounds} rounds; copy bandwidth "
             f"{report._fmt(meta['copy_bandwidth_TBps'], 2)} TB/s; writing {results.json_path}")  # fmt: skip
        _log(f"baseline (previous results): {baseline}; tensor-parallel rows: {tp}")
        if cuda:
            _warm_up_compiler(device)
        first_batch: dict[str, int] = {}
        for workload, unit in _units(args):
            label = f"{workload} " + " ".join(map(str, unit))
            if time.perf_counter() - _START > args.budget_s:
                run["skipped"].append(label)
                continue
            _log(f"{label}: start")
            try:
                if workload == "selection":
                    rows = _selection_bench.bench_selection_shape(*unit, device, args.rounds, args.replays, bandwidth)
                else:
                    warm = args.warm_compile and first_batch.setdefault(workload, unit[0]) == unit[0]
                    rows = _draft_bench.bench_draft(workload, args.size, unit[0], device, dtype, args.rounds, warm)
            except Exception as exc:  # building the workload failed (e.g. out of memory): record it, go on
                rows = _failed_unit(workload, unit, dtype, _measure.report_error(exc))
                _log(f"{label}: failed: {rows[0]['error']}")
            finally:
                torch._dynamo.reset()  # frees the compiled code and CUDA graph memory of this unit
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            results.add(label, rows)
            run["measured"].append(label)
            shown = [r for r in rows if r["k"] in (1, None) and not r.get("temperature")]
            summary = (f"{r['variant']} {report._fmt(r['median_us'])} µs (host {report._fmt(r['host_us_per_call'])})"
                       for r in shown)
            _log(f"{label}: " + " | ".join(summary))
            run["seconds"] = time.perf_counter() - _START
            results.write(run)
    if run["skipped"]:
        _log("skipped (time budget): " + ", ".join(run["skipped"]))
    run["seconds"] = time.perf_counter() - _START
    text = results.write(run)
    plotted = report.plot(list(results.rows.values()), results.png_path)
    _log(f"wrote {results.json_path} and {results.md_path}; {plotted}")
    print(text, flush=True)


if __name__ == "__main__":
    main()
