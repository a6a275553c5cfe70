"""A k > 1 selection kernel with programs' own floors (v4, tried and dropped: commit cb4f34a) against the
kernel before and after it (v3: slots shared by a row's programs, candidates appended to one per-row
array), side by side in one process on a GPU, plus v4's tuning knobs (a program's room for candidates, a
register cap). Result: notes/kernels.md ("Programs' own floors").

The run had v4 as draftfuse's kernel and v3 in notes/v3/ (draftfuse/kernels/_triton_{selection,launch}.py
at c303564, the launcher importing notes.v3._triton_selection); to run it again, put v4's two files
(`git show cb4f34a:draftfuse/kernels/_triton_selection.py`) where this script imports draftfuse's. Each point: µs per
call in a CUDA graph (benchmarks.selection's method: inputs rotated over 3x the L2), the variants taking
turns, and every variant's tokens checked against torch's reference on the same logits. Also times
softmax + topk and k = 1 at each shape, for the targets' ratios. Usage (GPU):

    python notes/kernel_v4_probe.py [--out probe.json] [--quick]
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.selection import selection_call  # noqa: E402
from benchmarks.targets import selection_limit  # noqa: E402
from draftfuse import _measure  # noqa: E402
from draftfuse.kernels import _triton_launch as v4  # noqa: E402
from draftfuse.kernels import topk_prob_reference  # noqa: E402

try:
    from notes.v3 import _triton_launch as v3
except ImportError:
    v3 = None


def launcher(module, k, **tile):
    def call(x):
        prob = torch.empty(x.shape[0], k, device=x.device)
        index = torch.empty(x.shape[0], k, device=x.device, dtype=torch.int64)
        module.launch_selection(x, k, False, prob, index, None, **tile)
        return prob, index

    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--budget-s", type=float, default=400)
    args = parser.parse_args()
    start = time.time()
    device = torch.device("cuda")
    bandwidth = _measure.copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    variants = {"v4": lambda k: launcher(v4, k), "v4 room 64": lambda k: launcher(v4, k, room=64),
                "v4 maxnreg 168": lambda k: launcher(v4, k, maxnreg=168)}
    if v3 is not None:
        variants = {"v3": lambda k: launcher(v3, k), **variants}
    rows = []
    vocabs, batches = ((32000, 128256), (1, 32)) if args.quick else ((32000, 128256, 262144), (1, 8, 32, 64, 256))
    for dtype in (torch.bfloat16, torch.float32):
        for vocab in vocabs:
            for batch in batches:
                if time.time() - start > args.budget_s:
                    print("budget: stopping", flush=True)
                    break
                nbytes = batch * vocab * dtype.itemsize
                buffers = _measure.rotation_count(nbytes, device)
                inputs = [(torch.randn(batch, vocab, device=device) * 4).to(dtype) for _ in range(buffers)]
                floor_us = nbytes / bandwidth * 1e6
                one = _measure.summary(_measure.time_in_graph(selection_call("draftfuse", 1), inputs, 20))["median_us"]
                for k in (4, 16):
                    calls = {"softmax+topk": selection_call("softmax+topk", k), **{n: make(k) for n, make in variants.items()}}
                    want_prob, want_index = topk_prob_reference(inputs[0], k)
                    times, wrong = {}, []
                    for name, call in calls.items():
                        if name != "softmax+topk":
                            prob, index = call(inputs[0])
                            if not torch.equal(index, want_index) or not torch.allclose(prob, want_prob, rtol=2e-5):
                                wrong.append(name)
                    samples = {name: [] for name in calls}
                    for _ in range(3):  # the variants take turns
                        for name, call in calls.items():
                            samples[name] += _measure.time_in_graph(call, inputs, 10)
                    times = {name: _measure.summary(s)["median_us"] for name, s in samples.items()}
                    limit, _ = selection_limit(k, batch, floor_us)
                    row = {"dtype": str(dtype).split(".")[1], "vocab": vocab, "batch": batch, "k": k, "floor_us": floor_us,
                           "limit_us": limit, "k1_us": one, **{f"{n}_us": t for n, t in times.items()}, "wrong": wrong}
                    rows.append(row)
                    print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    names = [n for n in variants]
    print("\ndtype vocab batch k | limit | softmax+topk | " + " | ".join(names) + " | k=1")
    for r in rows:
        cells = " | ".join(f"{r[n + '_us']:6.2f}{'*' if r[n + '_us'] > r['limit_us'] else ' '}" for n in names)
        print(f"{r['dtype']:8} {r['vocab']:6} {r['batch']:3} {r['k']:2} | {r['limit_us']:5.1f} | {r['softmax+topk_us']:6.1f} | {cells} | {r['k1_us']:5.2f}"
              + (f"  WRONG: {r['wrong']}" if r["wrong"] else ""))
    for n in names:
        met = sum(r[n + "_us"] <= r["limit_us"] for r in rows)
        ten = [r for r in rows if r["batch"] <= 64]
        tenx = sum(r["softmax+topk_us"] / r[n + "_us"] >= 10 for r in ten)
        print(f"{n}: time target met at {met}/{len(rows)}, 10x at {tenx}/{len(ten)}")


if __name__ == "__main__":
    main()
