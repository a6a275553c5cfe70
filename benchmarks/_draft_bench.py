"""Measuring one draft workload at one batch size: every variant of benchmarks/_drafts.py, side by side.

In one process, on the same inputs (the timing itself is draftfuse/_measure.py's):
  * compile_cold_s: the first call of each compiled variant (compile and CUDA-graph warm-up or capture
    included), in a fresh Inductor cache directory on a GPU (run.py opens it). compile_warm_s, at each
    workload's first batch only: torch._dynamo.reset(), a fresh torch.compile of the same function, its
    first call (Inductor's FX graph cache can hit). The compiled code of that second compile is the one timed.
  * median_us, p10_us, p90_us: warm-up, then `rounds` rounds in which the variants alternate call by call;
    each call timed with CUDA events from an idle device (synchronised before): the device's view of one
    draft, launch gaps included.
  * host_us_per_call: _measure.host_times, the time for the Python call to return with the GPU kept busy
    behind a long GPU sleep (checked still busy when the batch ended), elapsed / calls; the median of 5
    batches, the variants taking turns.
  * graph and kernel launches per call: torch.profiler over a few more calls of each variant.
  * tokens: the drafted tokens of one more call, compared with those of `eager` and of
    `hand_fold+hand_argmax` (each row names its references).
On a CPU there are no CUDA events, graphs, launches or a device to keep busy: those fields are null and
the times are perf_counter's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from benchmarks import _drafts
from benchmarks._rows import DRAFT_VARIANTS, row
from draftfuse import _measure

# CUDA graph trees record on the 2nd call and replay from the 3rd; the rounds after that let clocks settle.
WARMUP_ROUNDS = _measure.WARMUP_CALLS + 7
PROFILED_CALLS = 5
TOKEN_REFERENCES = {
    "eager": ("hand_fold+hand_argmax",),
    "eager_seed+captured_loop": ("eager", "hand_fold+hand_argmax"),
    "hand_fold+hand_argmax": ("eager",),
    "raw_cuda_graph": ("eager", "hand_fold+hand_argmax"),
    "draftfuse": ("eager", "hand_fold+hand_argmax"),
}


def _log(message: str) -> None:
    print(message, flush=True)


def _first_call_s(call: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _draft_tokens(outputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return next(t for t in outputs if not t.is_floating_point())


def _compile_all(built: _drafts.Workload, device: torch.device, label: str, errors: dict, seconds: dict) -> dict:
    """A fresh call of each variant, made and called once; the first call's seconds of compiled ones."""
    calls = {}
    for variant, make in built.variants.items():
        if variant in errors:
            continue
        try:
            calls[variant] = make()
            first = _first_call_s(calls[variant], device)
        except Exception as exc:
            calls.pop(variant, None)
            errors[variant] = _measure.report_error(exc)
            continue
        if variant != "eager":
            seconds[variant] = first
            _log(f"{label}: {variant} compiled in {first:.1f} s")
    return calls


def bench_draft(
    workload: str, size: str, batch: int, device: torch.device, dtype: torch.dtype, rounds: int, warm_compile: bool
) -> list[dict]:
    """One row per variant of `workload` at `batch` (see the module docstring for what each field is)."""
    dtype_name = str(dtype).removeprefix("torch.")
    built = _drafts.WORKLOADS[workload](size, batch, device, dtype)
    errors: dict[str, str] = {}
    cold: dict[str, float] = {}
    warm: dict[str, float] = {}
    calls = _compile_all(built, device, f"{workload} batch {batch} (cold)", errors, cold)
    if warm_compile:
        calls.clear()
        torch._dynamo.reset()  # forget every compile (and CUDA graph): the next compiles start over
        calls = _compile_all(built, device, f"{workload} batch {batch} (warm)", errors, warm)

    samples = _measure.time_alternating(calls, device, rounds, WARMUP_ROUNDS, errors)
    tokens = {}
    for variant, call in list(calls.items()):
        try:
            tokens[variant] = _draft_tokens(call())
        except Exception as exc:
            del calls[variant]
            errors[variant] = _measure.report_error(exc)
    host = _measure.host_times(calls, device)
    launches = {}
    if device.type == "cuda" and calls:
        try:
            launches = _measure.count_launches(calls, PROFILED_CALLS)
        except Exception as exc:  # the counts are not worth the run
            _log(f"launch counting failed: {_measure.report_error(exc)}")

    rows = []
    for variant in DRAFT_VARIANTS:
        fields = {"compile_cold_s": cold.get(variant), "compile_warm_s": warm.get(variant)}
        if variant in errors or variant not in samples:
            fields["error"] = errors.get(variant, "not run")
        else:
            fields.update(_measure.summary(samples[variant]), host_us_per_call=host[variant].us_per_call)
            if host[variant].note:
                fields["host_note"] = host[variant].note
            graphs, kernels = launches.get(variant, (None, None))
            fields.update(graph_launches_per_call=graphs, kernel_launches_per_call=kernels)
            references = [r for r in TOKEN_REFERENCES[variant] if r in tokens]
            if references:
                fields["tokens_match"] = all(torch.equal(tokens[variant], tokens[r]) for r in references)
                fields["tokens_reference"] = ", ".join(references)
        rows.append(row(workload, batch, built.vocab, 1, dtype_name, variant, **fields))
    return rows
