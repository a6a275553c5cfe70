"""Measuring drafts side by side, for the demo and the examples: time per call and CUDA graph replays.

The versions being compared alternate call by call in one process, after a warm-up, and each reports
its median: the machine's state (clocks, caches, other load) then weighs on all of them alike. On a GPU
a call is timed with CUDA events from an idle device, which is the device's view of one draft, launch
gaps included; on a CPU with perf_counter.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

# CUDA graph trees run eagerly on the first call, record on the second and replay from the third.
WARMUP_CALLS = 3


def time_side_by_side(calls: dict[str, Callable[[], object]], device: torch.device, rounds: int) -> dict[str, float]:
    """Median milliseconds per call of each of `calls`, alternating round by round after a warm-up."""
    for call in calls.values():
        for _ in range(WARMUP_CALLS):
            call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].append(_time_once(call, device))
    return {name: statistics.median(times) for name, times in samples.items()}


def _time_once(call: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()  # an idle device, so the events time this call alone
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def graph_replays_per_call(call: Callable[[], object], calls: int = 10) -> float:
    """CUDA graph launches per call of `call` (warmed up already), counted in a torch.profiler trace."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return sum(event.name == "cudaGraphLaunch" for event in prof.events()) / calls
