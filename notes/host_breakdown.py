"""Where a draft call's host time goes, on a GPU: the benchmark's draft workloads (reference size),
each timed the way benchmarks/run.py times host µs per call (draftfuse._measure.host_time: the GPU kept
busy, so no call waits on it), in one process, side by side:

  graph.replay() alone       the draft's own recorded CUDA graph, replayed with nothing around it: the
                             floor of any runner of that graph
  raw runner graph.replay()  the raw_cuda_graph variant's graph (the hand edit), replayed alone
  raw_cuda_graph             that runner: input copies, replay, output clones
  draftfuse zero-copy        draftfuse's replay path, zero_copy_outputs=True (the main recording's outputs)
  draftfuse                  draftfuse as used, its outputs dropped at once (a spare recording is free)
  ..., last outputs held     the outputs kept until the next call returns (a server's loop: the other spare)
  ..., spares held           both spares' outputs held: the main recording replays, its outputs are copied
  draftfuse checks only      Replay.matches on the call's locals (Dynamo's C++ guards, storage and
                             identity checks), no GPU work; Dynamo guards only: its guard check alone
  inputs: / outputs:         the copies alone, made each way they could be made (inputs: into buffers
                             like the static buffers of a recording that copies its inputs)
  draftfuse Python only      draftfuse's call with the graphs' replays made no-ops (a spare handed out)
  graph nodes                what one replay of draftfuse's (and the raw runner's) graph runs on the
                             device: kernels, memsets, memcpys (a torch.profiler trace, after the timings)

Each figure is the median of 5 host_time batches; raw_cuda_graph and the three draftfuse calls take turns,
9 batches each (_measure.host_times), so that the host's drift falls on them alike. Usage (GPU): python notes/host_breakdown.py [--batches 1 32]
"""

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TEARDOWN_CUPTI", "1")  # before torch is imported: no CUPTI cost after graph_nodes' traces

import torch  # noqa: E402

from benchmarks import _drafts  # noqa: E402
from draftfuse import _measure  # noqa: E402
from draftfuse.runtime.draft_loop import DraftLoop  # noqa: E402

PROFILE = False  # --profile
ROUNDS = 9  # host_time batches of each of the variants that take turns
BUILDERS = {"mtp": _drafts.build_mtp, "eagle": _drafts.build_eagle, "draft_model": _drafts.build_draft_model}


def host_us(call, device, repeats: int = 5) -> float | None:
    if device.type != "cuda":  # a dry run of the script: plain perf_counter
        return python_us(call, 200)
    return _measure.host_times({"call": call}, device, batches=repeats)["call"].us_per_call


def python_us(call, calls: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def profile(call, calls: int = 20000, top: int = 25) -> list[str]:
    """cProfile of `calls` calls: the `top` functions by own time, µs per call each (cProfile's own cost
    inflates every function's share alike; the order is what it tells)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [f"{tt / calls * 1e6:6.2f} own {ct / calls * 1e6:6.2f} cum  x{nc // calls}  {Path(f).name}:{line}:{fn}"
            for (f, line, fn), (cc, nc, tt, ct, _) in rows]


def graph_nodes(graph) -> dict[str, int]:
    """What one replay of `graph` runs on the device, by kind (kernels, memsets, memcpys): from a
    torch.profiler trace (CUPTI records a graph's nodes one by one). Run after every timing: CUPTI's cost
    stays on later launches unless TEARDOWN_CUPTI=1, which this script sets before importing torch."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kinds = {"kernels": 0, "memsets": 0, "memcpys": 0}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = "memsets" if event.name.startswith("Memset") else "memcpys" if event.name.startswith("Memcpy") else "kernels"
        kinds[kind] += 1
    return kinds


def recorded(name: str, batch: int, device: torch.device, size: str = "reference") -> tuple:
    """(the raw runner's call, its torch.cuda.CUDAGraph, draftfuse's call, its DraftLoop) for a benchmark draft,
    each called until its graphs are recorded (bf16 on the GPU, float32 on the CPU)."""
    work = BUILDERS[name](size, batch, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    raw = work.variants["raw_cuda_graph"]()
    for _ in range(3):
        raw()
    raw_graph = raw.__closure__[raw.__code__.co_freevars.index("state")].cell_contents.get("graph")
    before = {id(o) for o in gc.get_objects() if type(o) is DraftLoop}
    ours = work.variants["draftfuse"]()
    for _ in range(4):
        ours()
    loop = next(o for o in gc.get_objects() if type(o) is DraftLoop and id(o) not in before and o._replays)
    return raw, raw_graph, ours, loop


def breakdown(name: str, batch: int, device: torch.device, size: str) -> dict:
    raw, raw_graph, ours, loop = recorded(name, batch, device, size)
    replay = loop._replays[0]
    seen = {}
    bind = loop._bind
    loop._bind = lambda args, kwargs: seen.setdefault("f_locals", bind(args, kwargs))
    ours()
    loop._bind = bind
    f_locals = seen["f_locals"]
    out = {"workload": name, "batch": batch}
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["graph.replay() alone"] = host_us(replay.recorder.graph.replay, device)
        out["raw runner graph.replay()"] = host_us(raw_graph.replay, device)
    held = [None]

    def zero_copy():
        loop._zero_copy = True
        ours()
        loop._zero_copy = False

    turns = {  # these take turns, ROUNDS host_time batches each (the benchmark's method, more batches)
        "raw_cuda_graph": raw,
        "draftfuse zero-copy": zero_copy,
        "draftfuse": ours,  # its outputs dropped at once: a spare is free on every call
        "draftfuse, last outputs held": lambda: held.__setitem__(0, ours()),  # a server's loop
    }
    if device.type == "cuda":
        out.update((k, t.us_per_call) for k, t in _measure.host_times(turns, device, batches=ROUNDS).items())
    else:
        out.update((k, python_us(call, 200)) for k, call in turns.items())
    held[0] = None
    recorder = replay.recorder
    pins = [[t.detach() for t in spare.outputs if isinstance(t, torch.Tensor)] for spare in recorder.spares]
    out["draftfuse, spares held (outputs copied)"] = host_us(ours, device)
    del pins
    with torch.no_grad():
        assert replay.matches(f_locals)
        out["draftfuse checks only"] = python_us(lambda: replay.matches(f_locals))
        out["Dynamo guards only"] = python_us(lambda: replay.guard.check(f_locals))
    # The copies alone, each way they could be made (the same tensors as the replay path's).
    sources = [fetch(f_locals) for fetch in replay.fetchers]
    buffers = [torch.empty_like(s) for s in sources]  # as the static buffers of a recording that copies its inputs
    outputs = [recorder.flat_outputs()[i] for i in replay.graph_leaves]
    if buffers:
        out["inputs: one _foreach_copy_"] = host_us(lambda: torch._foreach_copy_(buffers, sources), device)
        out["inputs: copy_ each"] = host_us(lambda: [b.copy_(s) for b, s in zip(buffers, sources)], device)
        if all(t.is_contiguous() for t in buffers + sources):
            as_bytes = [b.view(-1).view(torch.uint8) for b in buffers]
            out["inputs: _foreach_copy_ of byte views"] = host_us(
                lambda: torch._foreach_copy_(as_bytes, [s.view(-1).view(torch.uint8) for s in sources]), device
            )
    out["outputs: empty_like + one _foreach_copy_"] = host_us(
        lambda: torch._foreach_copy_([torch.empty_like(t) for t in outputs], outputs), device
    )
    out["outputs: clone each"] = host_us(lambda: [t.clone() for t in outputs], device)
    # draftfuse's Python alone: the same call with the replay and the copies made no-ops.
    graphs = [recorder.graph, *(spare.graph for spare in recorder.spares)] if device.type == "cuda" else []
    replays = [g.replay for g in graphs]
    for g in graphs:
        g.replay = lambda: None  # the instance attribute shadows the method
    try:
        out["draftfuse Python only (no GPU work)"] = python_us(ours)  # spares handed out: no copy either
        if PROFILE:
            out["profile of draftfuse Python only"] = profile(ours)
    finally:
        for g, method in zip(graphs, replays):
            g.replay = method
    if device.type == "cuda":  # last: the profiler's CUPTI
        out["graph nodes"] = graph_nodes(recorder.graph)
        out["raw runner graph nodes"] = graph_nodes(raw_graph)
    out["inputs read in place"] = recorder.in_place  # the benchmark passes the same tensors on every call
    out["inputs"] = len(replay.fetchers)
    out["outputs copied"] = len(replay.graph_leaves)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--only", nargs="+", default=list(BUILDERS))
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only checks the script (size tiny)")
    parser.add_argument("--profile", action="store_true", help="also a cProfile of draftfuse's Python only (top 25 by own time)")
    args = parser.parse_args()
    global PROFILE
    PROFILE = args.profile
    device = torch.device(args.device)
    size = "reference" if device.type == "cuda" else "tiny"
    rows = []
    for batch in args.batches:
        for name in args.only:
            row = breakdown(name, batch, device, size)
            rows.append(row)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
