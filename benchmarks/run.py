"""The benchmark of issue 6: draftfuse against today's server layouts and the memory floor, side by side.

    python benchmarks/run.py                    # on a GPU: every workload at reference size
    python benchmarks/run.py --quick            # fewer vocabularies and batch sizes
    python benchmarks/run.py --only mtp eagle   # some workloads (their rows update an existing results file)
    python benchmarks/run.py --device cpu --size tiny --quick --rounds 3 --out /tmp/bench   # CPU smoke run

Needs only torch (2.11 or newer; Triton on a GPU; matplotlib for the plot, skipped without it): draftfuse
and the examples are imported from this checkout. Writes DIR/NAME.json, DIR/NAME.md and DIR/NAME.png
(DIR: --out, default benchmarks/results; NAME: h200 on an H200, else the device's name) after every
workload and batch, so an interrupted run leaves what it measured; prints the markdown last.

Workloads: the selection alone (benchmarks/selection.py's calls, each timed in a CUDA graph of calls
over rotating logits buffers: kernel time), and three drafts at reference size (benchmarks/_drafts.py:
frozen-KV MTP, EAGLE-style chain, independent draft model; the variants are described there).

How a draft is measured, per workload and batch, in one process on the same inputs:
  * compile_cold_s: the first call of each compiled variant (compile and CUDA-graph warm-up run
    included), in a fresh Inductor cache directory on a GPU. compile_warm_s, at each workload's first
    batch only: torch._dynamo.reset(), a fresh torch.compile of the same function, its first call
    (Inductor's FX graph cache can hit). The compiled code of that second compile is the one timed.
  * warm-up, then `--rounds` rounds in which the variants alternate call by call; each call is timed
    with CUDA events from an idle device (synchronised before), the host's share with perf_counter
    around the call, without synchronising. median, p10, p90 of the event times; host time averaged.
  * graph and kernel launches per call: torch.profiler over a few more calls of each variant, counting
    cudaGraphLaunch and the kernel launch calls (cudaLaunchKernel*, cuLaunchKernel*) made inside each
    variant's range. Kernels replayed inside a CUDA graph are not launched one by one: the profiler
    shows one cudaGraphLaunch for them, and that is what is reported.
  * tokens: the drafted tokens of a call after the timing, compared with those of `eager` and of
    `hand_fold+hand_argmax` (each row names its references).
On a CPU there are no CUDA events, graphs or launches: those fields are null and the times are
perf_counter's.

Budget: a full run at reference size compiles three variants per workload and batch. The run starts no
new workload batch or logits shape after --budget-s seconds and lists what it skipped; a later run with
--only (and --batches) measures those into the same results file, keeping the rows it does not remeasure.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime
import gc
import json
import math
import re
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch._inductor.utils import fresh_cache

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # draftfuse and benchmarks from this checkout: nothing needs installing

from benchmarks import _drafts, selection  # noqa: E402
from draftfuse._measure import WARMUP_CALLS  # noqa: E402

WORKLOADS = ("mtp", "selection", "eagle", "draft_model")  # run in this order: MTP carries the main targets
TITLES = {
    "mtp": "frozen-KV MTP draft (seed + 3 steps)",
    "eagle": "EAGLE-style head, greedy chain (seed + 3 steps)",
    "draft_model": "independent draft model, 2 layers (seed + 3 steps)",
    "selection": "selection alone: picking tokens from logits",
}
DRAFT_BATCHES, QUICK_DRAFT_BATCHES = (1, 8, 32, 64), (1, 32)
SELECTION_VOCABS, QUICK_SELECTION_VOCABS = (32000, 128256, 151936, 262144), (128256,)
SELECTION_BATCHES, QUICK_SELECTION_BATCHES = (1, 8, 32, 64, 256), (1, 32)
SELECTION_DTYPES, SELECTION_KS = ("bfloat16", "float32"), (1, 4)

# CUDA graph trees record on the 2nd call and replay from the 3rd; the rounds after that let clocks settle.
WARMUP_ROUNDS = WARMUP_CALLS + 7
PROFILED_CALLS = 5
HOST_CALLS = 20  # selection: eager calls whose host time is averaged
# The row fields of issue 6, then the variants the tokens were compared with. A variant that failed
# also has "error" (its exception, one line), with null timings.
ROW_KEYS = (
    "workload", "batch", "vocab", "k", "dtype", "variant", "median_us", "p10_us", "p90_us",
    "graph_launches_per_call", "kernel_launches_per_call", "host_us_per_call", "tokens_match",
    "compile_cold_s", "compile_warm_s", "tokens_reference",
)  # fmt: skip
TOKEN_REFERENCES = {
    "eager": ("hand_fold+hand_argmax",),
    "eager_seed+captured_loop": ("eager", "hand_fold+hand_argmax"),
    "hand_fold+hand_argmax": ("eager",),
    "draftfuse": ("eager", "hand_fold+hand_argmax"),
}
_KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")
_GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")

_START = time.perf_counter()


def _log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f} s] {message}", flush=True)


def _report_error(exc: BaseException) -> str:
    """Print the traceback (stderr) and return the row's error text: a failing variant ends no run."""
    traceback.print_exc(file=sys.stderr)
    return f"{type(exc).__name__}: {exc}"[:600]


def _row(workload: str, batch: int, vocab: int | None, k: int | None, dtype: str, variant: str, **fields) -> dict:
    row = dict.fromkeys(ROW_KEYS)
    row.update(workload=workload, batch=batch, vocab=vocab, k=k, dtype=dtype, variant=variant, **fields)
    return row


def _summary(samples: list[float]) -> dict:
    """median, p10 and p90 (nearest rank) of `samples`."""
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, round(q * (len(s) - 1)))]  # noqa: E731
    return {"median_us": statistics.median(s), "p10_us": pick(0.1), "p90_us": pick(0.9)}


# ---- timing, launches ----


def _time_once(call: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(device µs, host µs) of one call: CUDA events from an idle device, perf_counter for the host."""
    if device.type != "cuda":
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
        return seconds * 1e6, seconds * 1e6
    torch.cuda.synchronize()  # an idle device: the events time this call alone
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host_start = time.perf_counter()
    call()
    host = time.perf_counter() - host_start
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3, host * 1e6


def _first_call_s(call: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _time_alternating(
    calls: dict[str, Callable[[], object]], device: torch.device, rounds: int, errors: dict[str, str]
) -> dict[str, tuple[list[float], list[float]]]:
    """Device and host µs per call of each of `calls`, alternating call by call after a warm-up.
    A call that raises is dropped from `calls`, its error kept in `errors`."""
    samples = {name: ([], []) for name in calls}
    for round_index in range(WARMUP_ROUNDS + rounds):
        for name, call in list(calls.items()):
            try:
                if round_index < WARMUP_ROUNDS:
                    call()
                    continue
                device_us, host_us = _time_once(call, device)
            except Exception as exc:
                errors[name] = _report_error(exc)
                del calls[name], samples[name]
                continue
            samples[name][0].append(device_us)
            samples[name][1].append(host_us)
    return samples


def _launches_per_call(calls: dict[object, Callable[[], object]]) -> dict[object, tuple[float, float]]:
    """(graph launches, kernel launches) per call of each of `calls`, from one torch.profiler trace in
    which each runs PROFILED_CALLS times inside its own labelled range; {} (and the error printed) if
    the profiler fails: the counts are not worth the run."""
    try:
        return _profiled_launches(calls)
    except Exception as exc:
        _log(f"launch counting failed: {_report_error(exc)}")
        return {}


def _profiled_launches(calls: dict[object, Callable[[], object]]) -> dict[object, tuple[float, float]]:
    labels = {f"benchmark:{name}": name for name in calls}
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for label, name in labels.items():
            with torch.profiler.record_function(label):
                for _ in range(PROFILED_CALLS):
                    calls[name]()
                torch.cuda.synchronize()
    events = prof.events()
    # The labelled ranges on the host's timeline (the profiler mirrors them on the GPU's: not those).
    spans = sorted(
        (e.time_range.start, e.time_range.end, labels[e.name])
        for e in events
        if e.name in labels and e.device_type == torch.autograd.DeviceType.CPU
    )
    starts = [span[0] for span in spans]
    counts = {name: [0, 0] for name in calls}
    outer_end = -math.inf  # a launch made inside another launch call (runtime -> driver) counts once
    launches = sorted(
        (e.time_range.start, e.time_range.end, e.name.startswith(_GRAPH_LAUNCHES))
        for e in events
        if e.name.startswith(_GRAPH_LAUNCHES + _KERNEL_LAUNCHES)
    )
    for start, end, is_graph in launches:
        if start < outer_end:
            continue
        outer_end = end
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and start <= spans[i][1]:
            counts[spans[i][2]][0 if is_graph else 1] += 1
    return {name: (graphs / PROFILED_CALLS, kernels / PROFILED_CALLS) for name, (graphs, kernels) in counts.items()}


# ---- drafts ----


def _draft_tokens(outputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return next(t for t in outputs if not t.is_floating_point())


def bench_draft(
    workload: str, size: str, batch: int, device: torch.device, dtype: torch.dtype, rounds: int, warm_compile: bool
) -> list[dict]:
    """One row per variant of `workload` at `batch` (see the module docstring for what each field is)."""
    dtype_name = str(dtype).removeprefix("torch.")
    built = _drafts.WORKLOADS[workload](size, batch, device, dtype)
    calls, errors, cold, warm = {}, {}, {}, {}
    for variant, make in built.variants.items():
        try:
            calls[variant] = make()
            seconds = _first_call_s(calls[variant], device)
        except Exception as exc:
            calls.pop(variant, None)
            errors[variant] = _report_error(exc)
            continue
        if variant != "eager":
            cold[variant] = seconds
            _log(f"{workload} batch {batch}: {variant} compiled (cold) in {seconds:.1f} s")
    if warm_compile:
        torch._dynamo.reset()  # forget every compile (and CUDA graph): the next compiles start over
        for variant in [v for v in calls if v != "eager"]:
            try:
                calls[variant] = built.variants[variant]()
                warm[variant] = _first_call_s(calls[variant], device)
            except Exception as exc:
                del calls[variant]
                errors[variant] = _report_error(exc)
                continue
            _log(f"{workload} batch {batch}: {variant} compiled (warm) in {warm[variant]:.1f} s")

    samples = _time_alternating(calls, device, rounds, errors)
    tokens = {}
    for variant, call in list(calls.items()):
        try:
            tokens[variant] = _draft_tokens(call())
        except Exception as exc:
            del calls[variant]
            errors[variant] = _report_error(exc)
    launches = _launches_per_call(calls) if device.type == "cuda" and calls else {}

    rows = []
    for variant in _drafts.VARIANTS:
        fields = {"compile_cold_s": cold.get(variant), "compile_warm_s": warm.get(variant)}
        if variant in errors or variant not in samples:
            fields["error"] = errors.get(variant, "not run")
        else:
            device_us, host_us = samples[variant]
            fields.update(_summary(device_us), host_us_per_call=statistics.fmean(host_us))
            graphs, kernels = launches.get(variant, (None, None))
            fields.update(graph_launches_per_call=graphs, kernel_launches_per_call=kernels)
            references = [r for r in TOKEN_REFERENCES[variant] if r in tokens]
            if references:
                fields["tokens_match"] = all(torch.equal(tokens[variant], tokens[r]) for r in references)
                fields["tokens_reference"] = ", ".join(references)
        rows.append(_row(workload, batch, built.vocab, 1, dtype_name, variant, **fields))
    return rows


# ---- selection ----


def _selection_variants(k: int) -> dict[str, str]:
    """benchmarks/selection.py's method names -> the variant names of the rows."""
    torch_variant = "torch.argmax" if k == 1 else "torch.topk"
    return {"softmax+topk": "softmax+topk", "torch": torch_variant, "draftfuse": "draftfuse"}


def _selected_logits_match(logits: torch.Tensor, outputs, k: int) -> bool:
    """Whether the int64 output of a selection picks the k largest logits (exact ties: either index)."""
    index = next(t for t in ((outputs,) if isinstance(outputs, torch.Tensor) else outputs) if t.dtype == torch.int64)
    picked = logits.float().gather(-1, index.reshape(logits.shape[0], -1)).sort(-1, descending=True).values
    return torch.equal(picked, torch.topk(logits.float(), k, dim=-1).values)


def _host_us(call: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = 0.0
    for _ in range(HOST_CALLS):
        start = time.perf_counter()
        call()
        total += time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
    return total / HOST_CALLS * 1e6


def bench_selection_shape(
    dtype_name: str, vocab: int, batch: int, device: torch.device, rounds: int, bandwidth: float | None
) -> list[dict]:
    """Rows of every selection method and k for one logits shape, and the floor where it is known."""
    dtype = getattr(torch, dtype_name)
    nbytes = batch * vocab * dtype.itemsize
    if device.type == "cuda":
        # As benchmarks/selection.py does: buffers spanning 3x the L2 cache, so large logits stream from DRAM.
        l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        buffers = max(2, min(64, math.ceil(3 * l2_bytes / nbytes)))
    else:
        buffers = 1
    generator = torch.Generator(device).manual_seed(0)
    inputs = [
        torch.randn(batch, vocab, device=device, generator=generator).mul_(4).to(dtype) for _ in range(buffers)
    ]
    rows = []
    if bandwidth:
        rows.append(_row("selection", batch, vocab, None, dtype_name, "floor", median_us=nbytes / bandwidth * 1e6))
    calls = {}
    for k in SELECTION_KS:
        for method, variant in _selection_variants(k).items():
            fn = selection.selection_call(method, k, None)
            call = lambda fn=fn: fn(inputs[0])  # noqa: E731
            try:
                match = _selected_logits_match(inputs[0], call(), k)  # also the warm-up (Triton's JIT)
                if device.type == "cuda":
                    timing = selection.time_in_graph(fn, inputs, replays=rounds)
                else:
                    timing = _summary([_time_once(call, device)[0] for _ in range(rounds)])
                host = _host_us(call, device)
            except Exception as exc:
                rows.append(_row("selection", batch, vocab, k, dtype_name, variant, error=_report_error(exc)))
                continue
            calls[k, variant] = call
            rows.append(_row(
                "selection", batch, vocab, k, dtype_name, variant, **timing, host_us_per_call=host,
                tokens_match=match, tokens_reference="torch.topk(logits.float(), k)",
            ))  # fmt: skip
    if device.type == "cuda" and calls:
        # The timed calls sit in a CUDA graph; these counts are of the same calls run eagerly.
        launches = _launches_per_call(calls)
        for row in rows:
            if (row["k"], row["variant"]) in launches:
                row["kernel_launches_per_call"] = launches[row["k"], row["variant"]][1]
    return rows


# ---- results: JSON, markdown, plot ----


def _row_key(row: dict) -> tuple:
    return tuple(row[k] for k in ("workload", "batch", "vocab", "k", "dtype", "variant"))


def _sort_key(row: dict) -> tuple:
    variants = (*_drafts.VARIANTS, "floor", "softmax+topk", "torch.argmax", "torch.topk", "draftfuse")
    order = WORKLOADS.index(row["workload"]) if row["workload"] in WORKLOADS else len(WORKLOADS)
    variant = variants.index(row["variant"]) if row["variant"] in variants else len(variants)
    return (order, row["dtype"], row["k"] or 0, row["vocab"] or 0, row["batch"], variant)


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
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), {})[row["variant"]] = row
    return groups


def _median(by_variant: dict[str, dict], variant: str) -> float | None:
    return by_variant.get(variant, {}).get("median_us")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def _draft_tables(workload: str, rows: list[dict], targets: list[tuple[str, str, bool | None, str]]) -> list[str]:
    eager, captured, hand, ours = _drafts.VARIANTS
    lines = [
        f"## {workload}: {TITLES[workload]}",
        "",
        f"| batch | {eager} µs | {captured} µs | {hand} µs | {ours} µs | {captured} / {ours} | {ours} / {hand} "
        f"| {ours} graph launches / call |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (batch,), by_variant in sorted(_by(rows, "batch").items()):
        speedup = _ratio(_median(by_variant, captured), _median(by_variant, ours))
        parity = _ratio(_median(by_variant, ours), _median(by_variant, hand))
        replays = by_variant.get(ours, {}).get("graph_launches_per_call")
        speedup_ok = None if speedup is None or workload != "mtp" or batch > 32 else speedup >= 1.15
        parity_ok = None if parity is None else parity <= 1.02
        replays_ok = None if replays is None else replays == 1
        if workload == "mtp" and batch <= 32:
            targets.append((f"MTP {captured} / {ours} ≥ 1.15", f"batch {batch}", speedup_ok, _fmt(speedup, 3)))
        targets.append((f"{ours} / {hand} ≤ 1.02", f"{workload} batch {batch}", parity_ok, _fmt(parity, 3)))
        targets.append((f"one graph replay per {ours} call", f"{workload} batch {batch}", replays_ok, _fmt(replays, 2)))
        speedup_text = _fmt(speedup, 3) + (f" ({_verdict(speedup_ok)})" if speedup_ok is not None else "")
        lines.append(
            f"| {batch} | " + " | ".join(_fmt(_median(by_variant, v)) for v in _drafts.VARIANTS)
            + f" | {speedup_text} | {_fmt(parity, 3)} ({_verdict(parity_ok)})"
            + f" | {_fmt(replays, 2)} ({_verdict(replays_ok)}) |"
        )
    lines += [
        "",
        "| batch | variant | median µs | p10 µs | p90 µs | graph launches / call | kernel launches / call "
        "| host µs / call | tokens match | compared with | compile cold s | compile warm s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for row in rows:
        cells = [row["batch"], row["variant"], row["median_us"], row["p10_us"], row["p90_us"]]
        cells += [row["graph_launches_per_call"], row["kernel_launches_per_call"], row["host_us_per_call"]]
        cells += [row["tokens_match"], row["tokens_reference"], row["compile_cold_s"], row["compile_warm_s"]]
        lines.append("| " + " | ".join(_fmt(c, 2 if i in (5, 6) else 1) for i, c in enumerate(cells)) + " |")
        if row.get("error"):
            lines.append(f"| | error: {row['error'].splitlines()[0][:200]} |" + " |" * 10)
    return lines


def _selection_table(rows: list[dict], targets: list[tuple[str, str, bool | None, str]]) -> list[str]:
    lines = [
        f"## selection: {TITLES['selection']}",
        "",
        "Each call captured in a CUDA graph of calls over rotating logits buffers (kernel time); floor: the "
        "logits' bytes read once at the measured copy bandwidth. Tokens: the indices pick the k largest logits.",
        "",
        "| dtype | k | vocab | batch | floor µs | softmax+topk µs | torch.argmax / topk µs | draftfuse µs "
        "| target µs | target | draftfuse tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    floors = {(r["dtype"], r["vocab"], r["batch"]): r["median_us"] for r in rows if r["variant"] == "floor"}
    shapes = _by([r for r in rows if r["variant"] != "floor"], "dtype", "k", "vocab", "batch")
    for (dtype, k, vocab, batch), by_variant in shapes.items():
        floor, ours = floors.get((dtype, vocab, batch)), _median(by_variant, "draftfuse")
        baseline = _median(by_variant, "softmax+topk")
        torch_us = _median(by_variant, "torch.argmax" if k == 1 else "torch.topk")
        if k == 1:
            target = max(2 * floor, 6.0) if floor is not None else None
            ok = None if target is None or ours is None else ours <= target
            targets.append(("selection k=1: draftfuse ≤ max(2 × floor, 6 µs)", f"{dtype} V={vocab} B={batch}",
                            ok, f"{_fmt(ours, 2)} vs {_fmt(target, 2)}"))  # fmt: skip
        else:
            target = baseline
            ok = None if target is None or ours is None else ours < target
            targets.append((f"selection k={k}: draftfuse < softmax+topk", f"{dtype} V={vocab} B={batch}",
                            ok, f"{_fmt(ours, 2)} vs {_fmt(target, 2)}"))  # fmt: skip
        cells = [dtype, k, vocab, batch, _fmt(floor, 2), _fmt(baseline, 2), _fmt(torch_us, 2), _fmt(ours, 2)]
        cells += [_fmt(target, 2), _verdict(ok), _fmt(by_variant.get("draftfuse", {}).get("tokens_match"))]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    errors = [r for r in rows if r.get("error")]
    lines += [""] + [f"- error, {r['dtype']} k={r['k']} V={r['vocab']} B={r['batch']} {r['variant']}: "
                     f"{r['error'].splitlines()[0][:200]}" for r in errors]  # fmt: skip
    return lines


def markdown(meta: dict, rows: list[dict], run: dict) -> str:
    """The results as markdown: the targets first, one table per workload, then how it was measured."""
    targets: list[tuple[str, str, bool | None, str]] = []
    sections = []
    for workload in WORKLOADS:
        workload_rows = [r for r in rows if r["workload"] == workload]
        if not workload_rows:
            continue
        if workload == "selection":
            sections += _selection_table(workload_rows, targets) + [""]
        else:
            sections += _draft_tables(workload, workload_rows, targets) + [""]
    bandwidth = meta["copy_bandwidth_TBps"]
    lines = [
        f"# draftfuse benchmarks on {meta['gpu']}",
        "",
        f"torch {meta['torch']}, {meta['date']}; `{run['command']}` ({run['size']} size, {run['seconds']:.0f} s); "
        f"device-to-device copy bandwidth {_fmt(bandwidth, 2)} TB/s (bytes read + written).",
        "",
        "## Targets (issue 6)",
        "",
        "| target | met | missed | not measured | missed at (measured vs target) |",
        "|---|---:|---:|---:|---|",
    ]
    for name in dict.fromkeys(t[0] for t in targets):
        mine = [t for t in targets if t[0] == name]
        missed = [f"{where}: {value}" for _, where, ok, value in mine if ok is False]
        counts = [sum(t[2] is True for t in mine), len(missed), sum(t[2] is None for t in mine)]
        lines.append(f"| {name} | " + " | ".join(map(str, counts)) + f" | {'; '.join(missed) or '–'} |")
    if run["skipped"]:
        lines += ["", "Not measured in this run (time budget): " + ", ".join(run["skipped"]) + "."]
    lines += ["", *sections, "## How these were measured", "", *NOTES]
    return "\n".join(lines) + "\n"


NOTES = [
    "- Drafts: the variants (benchmarks/_drafts.py) alternate call by call in one process on the same inputs, "
    "after a warm-up; each call timed with CUDA events from an idle device; median, p10, p90 over `--rounds` calls.",
    "- host µs / call: perf_counter around the call without synchronising (a call that waits for the device "
    "itself, such as the MTP seed's `.cpu()`, includes that wait).",
    "- Launches: torch.profiler host events per call. Kernels inside a CUDA graph replay are not launched "
    "individually: a graph replay shows as one cudaGraphLaunch, and only launches outside graphs count as "
    "kernel launches. Selection launches are of the call run eagerly (its timing is inside a CUDA graph).",
    "- Tokens: each draft variant's tokens compared with those of the variants named in `compared with` "
    "(`eager`, and `hand_fold+hand_argmax`, whose compiled bf16 code may round differently from eager's); "
    "the weights make each step's best token lead by far more than bf16 rounding, so all must agree.",
    "- compile cold: the first call (compile, CUDA-graph warm-up run) in a fresh Inductor cache; compile warm "
    "(each workload's first batch only): after torch._dynamo.reset(), a fresh compile of the same function, "
    "where Inductor's FX graph cache can hit.",
]


_COLORS = {
    "eager": "tab:gray", "eager_seed+captured_loop": "tab:orange", "hand_fold+hand_argmax": "tab:green",
    "draftfuse": "tab:red", "softmax+topk": "tab:orange", "torch.argmax": "tab:green", "torch.topk": "tab:green",
    "floor": "black",
}  # fmt: skip


def _plot(rows: list[dict], path: Path) -> str:
    """Latency against batch, one line per variant, one panel per workload (selection: per dtype, k, vocab)."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: plot skipped"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=_sort_key)
    floors = [r for r in rows if r["variant"] == "floor"]
    panels: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["variant"] != "floor":
            panels.setdefault((row["workload"], row["dtype"], row["k"], row["vocab"]), []).append(row)
    if not panels:
        return "no rows: plot skipped"
    columns = min(4, len(panels))
    lines = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(lines, columns, figsize=(4.2 * columns, 3.2 * lines), squeeze=False)
    for ax, ((workload, dtype, k, vocab), panel_rows) in zip(axes.flat, panels.items()):
        if workload == "selection":
            panel_rows = [r for r in floors if (r["dtype"], r["vocab"]) == (dtype, vocab)] + panel_rows
        panel_rows = [r for r in panel_rows if r["median_us"] is not None]
        for variant in dict.fromkeys(r["variant"] for r in panel_rows):
            points = sorted((r["batch"], r["median_us"]) for r in panel_rows if r["variant"] == variant)
            style = "--" if variant == "floor" else "-o"
            ax.plot(*zip(*points), style, label=variant, color=_COLORS.get(variant), markersize=3)
        batches = sorted({r["batch"] for r in panel_rows})
        title = f"{workload} ({dtype})" if workload != "selection" else f"selection {dtype} k={k} V={vocab}"
        ax.set(title=title, xlabel="batch", ylabel="µs per call", yscale="log")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"wrote {path}"


def _results_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    return "h200" if "H200" in name else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


class _Results:
    """The rows so far, written out after every step; a partial run (--only, --batches) updates the rows
    it measures in an existing results file and keeps the others."""

    def __init__(self, out: Path, name: str, meta: dict, partial: bool) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.md_path, self.png_path = (out / f"{name}.{ext}" for ext in ("json", "md", "png"))
        self.meta = meta
        self.rows: dict[tuple, dict] = {}
        if partial and self.json_path.exists():
            self.rows = {_row_key(r): r for r in json.loads(self.json_path.read_text())["rows"]}

    def add(self, rows: list[dict]) -> None:
        self.rows.update((_row_key(r), r) for r in rows)

    def write(self, run: dict) -> str:
        rows = sorted(self.rows.values(), key=_sort_key)
        self.json_path.write_text(json.dumps({**self.meta, "rows": rows}, indent=1) + "\n")
        text = markdown(self.meta, rows, run)
        self.md_path.write_text(text)
        return text


# ---- the run ----


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--size", choices=("tiny", "reference"), help="draft size (default: reference on cuda)")
    parser.add_argument("--only", nargs="+", choices=WORKLOADS, help="run only these workloads")
    parser.add_argument("--quick", action="store_true", help="fewer vocabularies and batch sizes")
    batches = lambda text: tuple(int(b) for b in text.split(","))  # noqa: E731
    parser.add_argument("--batches", type=batches, help="batch sizes of every workload, e.g. 1,8")
    parser.add_argument("--rounds", type=int, default=100, help="timed calls per variant, at least 1 (default 100)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start nothing new after this (default 420 s)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="results directory")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --device cpu (with --size tiny for a quick check)")
    args.size = args.size or ("reference" if args.device.type == "cuda" else "tiny")
    return args


def _warm_up_compiler(device: torch.device) -> None:
    """One small compile, so that the first measured compile does not pay for lazy imports and for
    starting Inductor's compile workers."""
    compiled = torch.compile(lambda x: torch.softmax(x.sin(), -1), mode="reduce-overhead", fullgraph=True)
    for _ in range(WARMUP_CALLS):
        compiled(torch.randn(8, 64, device=device))
    torch._dynamo.reset()


def _units(args: argparse.Namespace) -> Iterator[tuple[str, tuple]]:
    """(workload, unit) in run order: one draft batch, or one selection logits shape."""
    for workload in WORKLOADS:
        if args.only and workload not in args.only:
            continue
        if workload == "selection":
            vocabs = QUICK_SELECTION_VOCABS if args.quick else SELECTION_VOCABS
            batches = args.batches or (QUICK_SELECTION_BATCHES if args.quick else SELECTION_BATCHES)
            for dtype in SELECTION_DTYPES:
                for vocab in vocabs:
                    for batch in batches:
                        yield workload, (dtype, vocab, batch)
        else:
            for batch in args.batches or (QUICK_DRAFT_BATCHES if args.quick else DRAFT_BATCHES):
                yield workload, (batch,)


def _failed_unit(workload: str, unit: tuple, dtype: torch.dtype, error: str) -> list[dict]:
    if workload == "selection":
        dtype_name, vocab, batch = unit
        variants = [(k, v) for k in SELECTION_KS for v in _selection_variants(k).values()]
        return [_row(workload, batch, vocab, k, dtype_name, v, error=error) for k, v in variants]
    dtype_name = str(dtype).removeprefix("torch.")
    return [_row(workload, unit[0], None, 1, dtype_name, variant, error=error) for variant in _drafts.VARIANTS]


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
    run = {"command": command.strip(), "size": args.size, "seconds": 0.0, "skipped": []}
    # On a GPU, compile_cold_s must be cold: a fresh Inductor (and Triton) cache for this process.
    caches = fresh_cache() if cuda else contextlib.nullcontext()
    with caches, torch.no_grad():
        bandwidth = selection.copy_bandwidth() if cuda else None
        meta = {
            "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "copy_bandwidth_TBps": bandwidth / 1e12 if bandwidth else None,
        }
        results = _Results(args.out, _results_name(device), meta, partial=bool(args.only or args.batches))
        _log(f"{meta['gpu']}, torch {meta['torch']}, size {args.size}, {args.rounds} rounds; "
             f"copy bandwidth {_fmt(meta['copy_bandwidth_TBps'], 2)} TB/s; writing {results.json_path}")  # fmt: skip
        if cuda:
            _warm_up_compiler(device)
        first_batch = {}
        for workload, unit in _units(args):
            label = f"{workload} " + " ".join(map(str, unit))
            if time.perf_counter() - _START > args.budget_s:
                run["skipped"].append(label)
                continue
            _log(f"{label}: start")
            try:
                if workload == "selection":
                    rows = bench_selection_shape(*unit, device, args.rounds, bandwidth)
                else:
                    warm = first_batch.setdefault(workload, unit[0]) == unit[0]
                    rows = bench_draft(workload, args.size, unit[0], device, dtype, args.rounds, warm)
            except Exception as exc:  # building the workload failed (e.g. out of memory): record it, go on
                rows = _failed_unit(workload, unit, dtype, _report_error(exc))
                _log(f"{label}: failed: {rows[0]['error']}")
            finally:
                torch._dynamo.reset()  # frees the compiled code and CUDA graph memory of this unit
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            results.add(rows)
            _log(f"{label}: " + " | ".join(f"{r['variant']} {_fmt(r['median_us'])} µs" for r in rows if r["k"] != 4))
            run["seconds"] = time.perf_counter() - _START
            results.write(run)
    if run["skipped"]:
        _log("skipped (time budget): " + ", ".join(run["skipped"]))
    run["seconds"] = time.perf_counter() - _START
    text = results.write(run)
    _log(f"wrote {results.json_path} and {results.md_path}; {_plot(list(results.rows.values()), results.png_path)}")
    print(text, flush=True)


if __name__ == "__main__":
    main()
