"""How draftfuse measures calls: the one module the benchmarks, the examples and the demo time with.

  summary(samples)                 median, p10 and p90 (one definition: linear interpolation between order
                                   statistics, so the median is statistics.median's)
  rotation_count(nbytes, device)   how many input buffers span 3x the L2 cache, to rotate inputs through
                                   (large inputs then stream from DRAM, small ones stay L2-resident)
  device_time_us(call, device)     one call's device time: CUDA events around it from an idle device
                                   (launch gaps included); perf_counter on a CPU
  time_in_graph(call, inputs)      per-call kernel time of `call` over `inputs`, captured back to back in
                                   one CUDA graph (no launch gaps): one sample per replay
  host_time(call, device)          host time per call as a server feels it: the Python call's time to
                                   return while the GPU is kept busy, so that no call waits on the device
  time_alternating(calls, ...)     device-time samples of several calls, alternating call by call after a
                                   warm-up, so clocks, caches and other load weigh on all of them alike
  count_launches(calls)            CUDA graph launches and kernel launches per call, from torch.profiler;
                                   a launch made inside another launch call (runtime -> driver) counts once
  time_side_by_side, graph_replays_per_call: the figures the examples and the demo print
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import time
import traceback
from collections.abc import Callable, Hashable

import torch

from draftfuse.kernels import selection

# CUDA graph trees run eagerly on the first call, record on the second and replay from the third.
WARMUP_CALLS = 3
HOST_CALLS = 20  # calls per host-time batch
HOST_BATCHES = 5  # host-time batches per call in host_times (the median is taken)
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")


# ---- statistics ----


def quantile(samples: list[float], q: float) -> float:
    """The q-quantile of `samples`, interpolating linearly between order statistics."""
    s = sorted(samples)
    if not s:
        raise ValueError("quantile of no samples")
    position = q * (len(s) - 1)
    low = math.floor(position)
    high = min(low + 1, len(s) - 1)
    return s[low] + (s[high] - s[low]) * (position - low)


def summary(samples: list[float]) -> dict[str, float]:
    """{"median_us", "p10_us", "p90_us"} of `samples` (µs)."""
    return {"median_us": quantile(samples, 0.5), "p10_us": quantile(samples, 0.1), "p90_us": quantile(samples, 0.9)}


# ---- the device ----


def _synchronize() -> None:
    """Wait for the current CUDA device, if CUDA is in use (a no-op otherwise)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def rotation_count(nbytes: int, device: torch.device, span: float = 3.0, most: int = 64) -> int:
    """Input buffers of `nbytes` each to rotate through so that together they span `span` x the L2 cache
    (at least 2, at most `most`); 1 off CUDA."""
    if device.type != "cuda":
        return 1
    return max(2, min(most, math.ceil(span * _l2_bytes(device) / nbytes)))


# ---- device time ----


def device_time_us(call: Callable[[], object], device: torch.device) -> float:
    """µs of one call: on CUDA, events recorded around it on an idle device (synchronised before), so the
    time includes its launch gaps; on a CPU, perf_counter."""
    if device.type != "cuda":
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def time_in_graph(
    call: Callable[[torch.Tensor], object],
    inputs: list[torch.Tensor],
    replays: int,
    selection_workspace: bool = True,
    check: Callable[[int, object], None] | None = None,
) -> list[float]:
    """µs per call of `call` over `inputs`, all captured back to back in one CUDA graph: one sample per
    replay (the replay's event time over len(inputs)). Kernel time, without launch gaps.

    draftfuse's selection kernels in `call` are captured as draftfuse's recorder captures them: with a
    workspace made before the capture (`selection_workspace=False`: as a bare `torch.cuda.graph` capture
    does, each launch then filling a workspace of its own, one more kernel per call). `check(i, outputs)`,
    where given, is called after the last replay with the outputs of the captured call over `inputs[i]`:
    what the timed replays computed (each call's outputs are held, so none is written by another)."""
    call(inputs[0])  # compiles kernels, warms the allocator: neither may happen inside the capture
    workspace = selection.graph_workspace(inputs[0].device) if selection_workspace else None
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    outputs = []
    with selection.capturing_with(workspace), torch.cuda.graph(graph):
        for x in inputs:
            out = call(x)
            if check is not None:
                outputs.append(out)
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    for i, out in enumerate(outputs):
        check(i, out)
    return [start.elapsed_time(end) * 1e3 / len(inputs) for start, end in events]


def copy_bandwidth(device: torch.device, nbytes: int = 2**31, replays: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written), median of `replays`."""
    src = torch.randn(nbytes // 4, device=device)  # float32: torch's copy moves 16 bytes per access
    dst = torch.empty_like(src)
    median_us = summary(time_in_graph(dst.copy_, [src], replays))["median_us"]
    return 2 * nbytes / (median_us * 1e-6)


# ---- host time ----


@dataclasses.dataclass(frozen=True)
class HostTime:
    """host_time's answer. us_per_call is None where every attempt found the device idle before the batch
    ended: a call that waits on the device (a host sync) has no host time in this sense."""

    us_per_call: float | None
    calls: int  # calls in the batch that counted (or in the last attempt)
    sleep_us: float  # the GPU sleep queued before that batch
    attempts: int

    @property
    def note(self) -> str | None:
        """Why us_per_call is None on a GPU (None where it is known, and off CUDA: nothing was tried)."""
        if self.us_per_call is not None or self.attempts == 0:
            return None
        return (
            f"host time: the device went idle before the batch ended in {self.attempts} attempts (last: "
            f"{self.calls} call(s) behind a {self.sleep_us / 1e3:.1f} ms GPU sleep): the call waits on the device"
        )


_SLEEP_CYCLES_PER_US: dict[int, float] = {}
_MIN_SLEEP_US, _MAX_SLEEP_US, _BATCH_US = 1_000.0, 2_000_000.0, 20_000.0


def _sleep_cycles_per_us(device: torch.device) -> float:
    """torch.cuda._sleep's cycles per µs on `device`, calibrated once: the fastest of three timed sleeps,
    so that a sleep is at least as long as asked whatever the clock does."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SLEEP_CYCLES_PER_US:
        with torch.cuda.device(index):
            torch.cuda._sleep(50_000_000)  # ~25 ms at 2 GHz: lets the clocks rise first
            rates = []
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(10_000_000)
                end.record()
                end.synchronize()
                rates.append(10_000_000 / (start.elapsed_time(end) * 1e3))
        _SLEEP_CYCLES_PER_US[index] = max(rates)
    return _SLEEP_CYCLES_PER_US[index]


def host_times(calls: dict[str, Callable[[], object]], device: torch.device, batches: int = HOST_BATCHES) -> dict[str, HostTime]:
    """host_time of each call, `batches` times in turn (a batch of each call, then again): the median of
    each call's batches, so that the host's drift (tens of percent on a shared machine) falls on every
    call alike. A call that waits on the device (no host time in its first batch) is not timed again."""
    times: dict[str, list[HostTime]] = {name: [] for name in calls}
    for round_ in range(batches):
        for name, call in calls.items():
            if round_ == 0 or times[name][0].us_per_call is not None:
                times[name].append(host_time(call, device))
    medians = {}
    for name, found in times.items():
        valid = sorted((t for t in found if t.us_per_call is not None), key=lambda t: t.us_per_call)
        medians[name] = valid[(len(valid) - 1) // 2] if valid else found[-1]
    return medians


def host_time(call: Callable[[], object], device: torch.device, calls: int = HOST_CALLS, attempts: int = 5) -> HostTime:
    """Host µs per call of `call` (warmed up already) with the GPU kept busy, so that no call waits on it.

    Queue a GPU sleep long enough to outlast the batch (4x the batch's time estimated from one call on an
    idle device, at least 1 ms), record an event behind it, time `calls` back-to-back calls (fewer where
    they would take over 20 ms: a call of milliseconds needs no more for its mean) with
    perf_counter: host µs per call = elapsed / calls. Then check that the event had not completed when the
    batch ended (event.query() is False): the device was busy throughout. If it had, try again, with a
    quarter of the calls if the batch took as long as the sleep (it waited: on the launch queue, which
    fills at about a thousand pending launches, or on a host sync) and a longer sleep; after `attempts`
    failures the answer is None (see HostTime). Off CUDA: None, there is no device to keep busy.
    """
    if device.type != "cuda":
        return HostTime(None, calls, 0.0, 0)
    rate = _sleep_cycles_per_us(device)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    estimate_us = (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize(device)
    calls = max(1, min(calls, int(_BATCH_US / max(estimate_us, 1.0))))  # a batch of about 20 ms at most
    margin, sleep_us = 4.0, 0.0
    for attempt in range(1, attempts + 1):
        sleep_us = min(_MAX_SLEEP_US, max(_MIN_SLEEP_US, margin * estimate_us * calls))
        torch.cuda.synchronize(device)
        torch.cuda._sleep(int(sleep_us * rate))
        slept = torch.cuda.Event()
        slept.record()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        elapsed_us = (time.perf_counter() - start) * 1e6
        busy = not slept.query()
        torch.cuda.synchronize(device)
        if busy:
            return HostTime(elapsed_us / calls, calls, sleep_us, attempt)
        if elapsed_us >= 0.5 * sleep_us and calls > 1:
            calls = max(1, calls // 4)
        margin *= 2
    return HostTime(None, calls, sleep_us, attempts)


# ---- side by side ----


def report_error(exc: BaseException) -> str:
    """Print the traceback (stderr) and return the exception as one short line."""
    traceback.print_exc()
    return f"{type(exc).__name__}: {exc}"[:600]


def time_alternating(
    calls: dict[Hashable, Callable[[], object]],
    device: torch.device,
    rounds: int,
    warmup_rounds: int = WARMUP_CALLS,
    errors: dict[Hashable, str] | None = None,
) -> dict[Hashable, list[float]]:
    """device_time_us samples of each of `calls`: `warmup_rounds` untimed rounds, then `rounds` rounds, each
    round one call of each in turn. With `errors`, a call that raises is dropped from `calls` and its error
    kept there (the others go on); without, the exception propagates."""
    samples: dict[Hashable, list[float]] = {name: [] for name in calls}
    for round_index in range(warmup_rounds + rounds):
        for name, call in list(calls.items()):
            try:
                if round_index < warmup_rounds:
                    call()
                else:
                    samples[name].append(device_time_us(call, device))
            except Exception as exc:
                if errors is None:
                    raise
                errors[name] = report_error(exc)
                del calls[name], samples[name]
    return samples


def time_side_by_side(calls: dict[str, Callable[[], object]], device: torch.device, rounds: int) -> dict[str, float]:
    """Median milliseconds per call of each of `calls`, alternating round by round after a warm-up."""
    samples = time_alternating(dict(calls), device, rounds)
    return {name: summary(times)["median_us"] / 1e3 for name, times in samples.items()}


# ---- launches ----


def count_launches(
    calls: dict[Hashable, Callable[[], object]],
    per_call: int = 5,
    graph_names: tuple[str, ...] = GRAPH_LAUNCHES,
    kernel_names: tuple[str, ...] = KERNEL_LAUNCHES,
) -> dict[Hashable, tuple[float, float]]:
    """(graph launches, kernel launches) per call of each of `calls` (warmed up already), from one
    torch.profiler trace in which each runs `per_call` times inside its own labelled range. A launch event
    whose name starts with one of `graph_names` / `kernel_names` counts for the range it starts in, unless
    it starts inside another launch event (a runtime launch calls the driver's: counted once). Kernels
    replayed inside a CUDA graph are not launched one by one: the graph's launch stands for them.

    Kineto keeps CUPTI attached after a profiling session unless TEARDOWN_CUPTI=1, and every launch
    after it pays for that: on an H200 (torch 2.11, CUDA 13) a graph replay's host time went from 6 to
    19 µs for the rest of the process (notes/cupti_probe.py). So it is set to 1 here, unless set, before the
    profiler starts; benchmarks/run.py sets it before importing torch, the setting that probe measured."""
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    labels = {f"draftfuse.measure:{index}": name for index, name in enumerate(calls)}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for label, name in labels.items():
            with torch.profiler.record_function(label):
                for _ in range(per_call):
                    calls[name]()
                _synchronize()
    events = prof.events()
    # The labelled ranges on the host's timeline (the profiler mirrors them on the GPU's: not those).
    spans = sorted(
        (e.time_range.start, e.time_range.end, labels[e.name])
        for e in events
        if e.name in labels and e.device_type == torch.autograd.DeviceType.CPU
    )
    starts = [span[0] for span in spans]
    counts = {name: [0, 0] for name in calls}
    outer_end = -math.inf
    launches = sorted(
        (e.time_range.start, e.time_range.end, e.name.startswith(graph_names))
        for e in events
        if e.name.startswith(graph_names + kernel_names)
    )
    for start, end, is_graph in launches:
        if start < outer_end:
            continue  # inside the launch before it
        outer_end = end
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and start <= spans[i][1]:
            counts[spans[i][2]][0 if is_graph else 1] += 1
    return {name: (graphs / per_call, kernels / per_call) for name, (graphs, kernels) in counts.items()}


def graph_replays_per_call(call: Callable[[], object], calls: int = 10) -> float:
    """CUDA graph launches per call of `call` (warmed up already), counted in a torch.profiler trace."""
    return count_launches({"call": call}, per_call=calls)["call"][0]
