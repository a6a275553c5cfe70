"""What a CUDA graph replay costs the host, and whether pinning the calling thread to one core steadies it.

Part 1: host µs per `graph.replay()` (draftfuse._measure.host_times: the GPU kept busy, so no call waits
on it) of graphs of N small kernels (`x.add_(1)`), N in NODES, and of 88 kernels + 8 memset nodes (the
shape of MTP's recorded graph: 83 kernels + 8 memsets), every graph taking turns with the others.
Part 2: the same figures, and the MTP draft's (benchmarks/_drafts.py, reference size, bf16, batch 1:
draftfuse and the raw CUDA-graph runner) with the main thread free to run on every allowed core and
pinned to one (os.sched_setaffinity), the two settings taking turns, their order alternating by round.
Usage (GPU): python notes/launch_probe.py [--out probe.json] [--no-draft]
"""

import argparse
import ctypes
import glob
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch  # noqa: E402

from draftfuse import _measure  # noqa: E402

NODES = (1, 24, 48, 96, 192)
ROUNDS = 4


def _cudart():
    """The CUDA runtime torch loaded (for cudaMemsetAsync: a memset node when captured), or None."""
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    names += glob.glob(str(Path(torch.__file__).parents[1] / "nvidia" / "*" / "lib" / "libcudart.so*"))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaMemsetAsync.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
        return lib
    return None


def captured(kernels: int, memsets: int = 0, cudart=None) -> torch.cuda.CUDAGraph:
    """A graph of `kernels` add_ kernels with `memsets` memset nodes spread among them."""
    x = torch.zeros(1024, device="cuda")
    scratch = torch.zeros(4096, device="cuda")
    every = kernels // memsets if memsets else 0
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for i in range(kernels):
                x.add_(1)
                if every and i % every == 0 and i // every < memsets:
                    error = cudart.cudaMemsetAsync(scratch.data_ptr(), 0, scratch.nbytes, torch.cuda.current_stream().cuda_stream)
                    assert error == 0, error
    graph._keep = (x, scratch)
    return graph


def pinned_core() -> int:
    return sorted(os.sched_getaffinity(0))[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--no-draft", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    cudart = _cudart()
    calls = {f"replay, {n} kernels": captured(n).replay for n in NODES}
    if cudart is not None:
        calls["replay, 88 kernels + 8 memsets"] = captured(88, 8, cudart).replay
    for call in calls.values():
        call()
    torch.cuda.synchronize()
    out = {"nodes": {k: t.us_per_call for k, t in _measure.host_times(calls, device, batches=7).items()}}
    print(json.dumps(out), flush=True)
    if not args.no_draft:
        from benchmarks import _drafts

        work = _drafts.build_mtp("reference", 1, device, torch.bfloat16)
        for name in ("raw_cuda_graph", "draftfuse"):
            call = work.variants[name]()
            for _ in range(4):
                call()
            calls[f"mtp b1 {name}"] = call
        torch.cuda.synchronize()
    everywhere, core = os.sched_getaffinity(0), pinned_core()
    rounds: dict[str, dict[str, list]] = {"all cores": {}, f"pinned to core {core}": {}}
    for round_ in range(ROUNDS):
        order = list(rounds) if round_ % 2 == 0 else list(reversed(rounds))
        for setting in order:
            os.sched_setaffinity(0, {core} if setting != "all cores" else everywhere)
            for name, t in _measure.host_times(calls, device, batches=3).items():
                rounds[setting].setdefault(name, []).append(t.us_per_call)
    os.sched_setaffinity(0, everywhere)
    out["affinity"] = rounds
    out["allowed cores"] = len(everywhere)
    print(json.dumps(out, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
