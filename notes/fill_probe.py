"""What a bare `torch.cuda.graph` capture adds to a selection call: the per-launch workspace fill.

The selection kernels keep their counters in a per-stream workspace made outside any capture. A capture
on a stream that has none (torch.cuda.graph captures on a stream of its own, so a warm-up call on the
current stream makes none for it) gives each launch a fresh workspace, filled by a kernel of the graph:
two kernels per call. draftfuse's recorder captures inside `capturing_with(graph_workspace(device))`,
so its drafts run one. `_measure.time_in_graph` now captures the same way; until this probe, the
benchmark's selection rows and every kernel probe in notes/ timed the bare capture's two kernels.

Each point: the op captured both ways, side by side in one process (6 rounds of 10 replays, the order
alternating between rounds), µs per call; inputs rotated over 3x the L2. Usage (GPU):

    python notes/fill_probe.py [--out probe.json]

Then the fill kernels that one replay of 4 captured calls runs, from torch.profiler: a bare capture, the
recorder's way, and torch.compile(mode="reduce-overhead") (CUDA graph trees warm up and record on a stream
of their own, which then has its workspace).
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import draftfuse.kernels.selection  # noqa: E402  (registers torch.ops.draftfuse.*)
from benchmarks.selection import selection_call  # noqa: E402
from draftfuse import _measure  # noqa: E402
from tests.test_kernels import fill_kernels_of  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    points = [(torch.bfloat16, vocab) for vocab in (32000, 128256, 262144)] + [(torch.float32, 128256)]
    for dtype, vocab in points:
        for batch in (1, 8, 32, 64):
            nbytes = batch * vocab * dtype.itemsize
            inputs = [(torch.randn(batch, vocab, device=device) * 4).to(dtype)
                      for _ in range(_measure.rotation_count(nbytes, device))]
            for k in (1, 4, 16):
                samples = {"workspace": [], "bare": []}
                for round_ in range(6):
                    for name in (("workspace", "bare") if round_ % 2 == 0 else ("bare", "workspace")):
                        samples[name] += _measure.time_in_graph(selection_call("draftfuse", k), inputs, 10,
                                                                selection_workspace=name == "workspace")
                us = {name: _measure.summary(s)["median_us"] for name, s in samples.items()}
                rows.append({"dtype": str(dtype).split(".")[1], "vocab": vocab, "batch": batch, "k": k, **us})
                print(f"{rows[-1]['dtype']:8} {vocab:6} b{batch:<3} k={k:2}: bare {us['bare']:6.2f}  workspace "
                      f"{us['workspace']:6.2f}  saved {us['bare'] - us['workspace']:5.2f} µs", flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(rows, indent=1))
    saved = sorted(r["bare"] - r["workspace"] for r in rows)
    print(f"saved: median {saved[len(saved) // 2]:.2f} µs, range {saved[0]:.2f}-{saved[-1]:.2f}")
    fills = {name: fill_kernels(name) for name in ("bare", "workspace", "reduce-overhead")}
    print("fill kernels in one replay of 4 captured calls:", fills)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "fill_kernels_per_4_calls": fills}, indent=1))


def fill_kernels(how: str) -> int:
    """Fill kernels the device runs in one replay of a graph of 4 topk_prob calls captured `how`: bare
    torch.cuda.graph, with the recorder's workspace, or by torch.compile(mode="reduce-overhead")'s trees."""
    x = torch.randn(8, 32000, device="cuda")
    four = lambda x: [torch.ops.draftfuse.topk_prob(x + i, 4, False, None) for i in range(4)]  # noqa: E731
    if how == "reduce-overhead":
        compiled = torch.compile(four, mode="reduce-overhead")
        for _ in range(3):
            compiled(x)
        replay = lambda: compiled(x)  # noqa: E731
    else:
        four(x)
        workspace = draftfuse.kernels.selection.graph_workspace(x.device) if how == "workspace" else None
        graph = torch.cuda.CUDAGraph()
        with draftfuse.kernels.selection.capturing_with(workspace), torch.cuda.graph(graph):
            four(x)
        replay = graph.replay
    replay()
    return fill_kernels_of(replay)


if __name__ == "__main__":
    main()
