"""Does a call's host time depend on how many calls are already queued on the device?

benchmarks/run.py's host column (draftfuse._measure.host_time) times a batch of up to 20 back-to-back
calls behind one GPU sleep: by the 20th call, 19 draft graphs (100-190 kernels each) wait in the launch
queue. A server issues one draft and then waits on its tokens, so its draft call meets a queue of 0-1
drafts. This probe times each call of a 20-call batch on its own (perf_counter around each call, the
device kept busy throughout: a batch whose sleep ended before the batch did is dropped) and reports, per
position in the batch, the median over the batches; then batches of 1 call (the first position alone)
against the whole batch's mean, as host_time takes it. Variants, taking turns batch by batch:

  replay alone     draftfuse's recorded graph, graph.replay() with nothing around it
  raw runner       the benchmark's raw_cuda_graph variant (input copies, replay, output clones)
  draftfuse        the benchmark's draftfuse variant (outputs dropped)

Usage (GPU): python notes/queue_depth_probe.py [--batches 1 32] [--only mtp] [--pin CPU] [--wait sync|poll]
             [--variants "replay alone" "raw runner" draftfuse] [--out F]
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch  # noqa: E402

from draftfuse import _measure  # noqa: E402
from host_breakdown import BUILDERS, recorded  # noqa: E402

CALLS = 20
ROUNDS = 15
WAIT = "sync"  # --wait
VARIANTS = ("replay alone", "raw runner", "draftfuse")  # --variants


def timed_batch(call, calls: int, device: torch.device, sleep_us: float, wait: str = "sync") -> list[float] | None:
    """µs of each of `calls` calls made behind a GPU sleep of `sleep_us`; None if the device went idle.
    `wait`: how the host waits for the device to go idle first: torch.cuda.synchronize ("sync", as
    host_time does), or a Python loop polling an event ("poll": the interpreter stays busy)."""
    rate = _measure._sleep_cycles_per_us(device)
    if wait == "poll":
        done = torch.cuda.Event()
        done.record()
        while not done.query():
            pass
    else:
        torch.cuda.synchronize(device)
    torch.cuda._sleep(int(sleep_us * rate))
    slept = torch.cuda.Event()
    slept.record()
    stamps = [time.perf_counter()]
    for _ in range(calls):
        call()
        stamps.append(time.perf_counter())
    busy = not slept.query()  # the next batch's wait lets the device finish
    if not busy:
        return None
    return [(b - a) * 1e6 for a, b in zip(stamps, stamps[1:])]


def probe(name: str, batch: int, device: torch.device) -> dict:
    raw, _, ours, loop = recorded(name, batch, device)
    replay = loop._replays[0].recorder.graph.replay
    variants = {"replay alone": replay, "raw runner": raw, "draftfuse": ours}
    variants = {k: v for k, v in variants.items() if k in VARIANTS}
    per_position = {k: [[] for _ in range(CALLS)] for k in variants}
    singles = {k: [] for k in variants}
    means = {k: [] for k in variants}
    dropped = {k: 0 for k in variants}
    for _ in range(ROUNDS):
        for key, call in variants.items():
            times = timed_batch(call, CALLS, device, 8000.0, WAIT)
            if times is None:
                dropped[key] += 1
            else:
                means[key].append(sum(times) / CALLS)
                for i, t in enumerate(times):
                    per_position[key][i].append(t)
            for _ in range(3):
                one = timed_batch(call, 1, device, 1000.0, WAIT)
                if one is None:
                    dropped[key] += 1
                else:
                    singles[key].append(one[0])
    row = {"workload": name, "batch": batch}
    for key in variants:
        row[key] = {
            "batch of 20, mean per call (host_time's figure)": statistics.median(means[key]) if means[key] else None,
            "batch of 1": statistics.median(singles[key]) if singles[key] else None,
            "by position in the batch of 20": [round(statistics.median(p), 1) if p else None for p in per_position[key]],
            "batches dropped (device idle)": dropped[key],
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--only", nargs="+", default=list(BUILDERS))
    parser.add_argument("--pin", type=int, help="run on this CPU alone (os.sched_setaffinity)")
    parser.add_argument("--wait", choices=["sync", "poll"], default="sync", help="how the host waits for the device before each batch")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--out")
    args = parser.parse_args()
    global WAIT, VARIANTS
    WAIT, VARIANTS = args.wait, tuple(args.variants)
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    device = torch.device("cuda")
    print(json.dumps({"cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)), "load": os.getloadavg()}), flush=True)
    rows = []
    for batch in args.batches:
        for name in args.only:
            row = probe(name, batch, device)
            rows.append(row)
            for key in VARIANTS:
                r = row[key]
                mean, single = r["batch of 20, mean per call (host_time's figure)"], r["batch of 1"]
                pos = r["by position in the batch of 20"]
                print(f"{name:12s} b{batch:<3d} {key:13s} 20-batch mean {mean or float('nan'):6.1f}  single {single or float('nan'):6.1f}  "
                      f"positions 0-4 {pos[:5]}  15-19 {pos[15:]}  dropped {r['batches dropped (device idle)']}", flush=True)
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
