"""Pass 1's loads one tile ahead (the committed kernel) against two tiles ahead (`ahead=2`), side by side in
one process on a GPU: does more in flight per program close the k = 1 misses at batch 8-64, where a
program streams 2-4 tiles and waits on DRAM for each? Result: notes/kernels.md ("Two tiles ahead"), raw
figures in notes/ahead_probe_h200.json. The `ahead` keyword of launch_selection was dropped afterwards;
to run this again, check out draftfuse/kernels/ at e814e41 (which has it).

Each point: µs per call in a CUDA graph (benchmarks.selection's method: inputs rotated over 3x the L2), the
variants taking turns (3 rounds of 10 replays each), every variant's tokens and probabilities checked
against the reference on the same logits; the registers of each compiled kernel. Usage (GPU):

    python notes/ahead_probe.py [--out probe.json] [--ks 1 4 16] [--budget-s 300]
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
from draftfuse.kernels import _triton_launch, topk_prob_reference  # noqa: E402

VARIANTS = {"ahead 1": {"ahead": 1}, "ahead 2": {"ahead": 2}}


def launcher(k, registers, name, **tile):
    def call(x):
        prob = torch.empty(x.shape[0], k, device=x.device)
        index = torch.empty(x.shape[0], k, device=x.device, dtype=torch.int64)
        kernel = _triton_launch.launch_selection(x, k, False, prob, index, None, **tile)
        registers.setdefault(name, getattr(kernel, "n_regs", None))
        return prob, index

    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--budget-s", type=float, default=300)
    args = parser.parse_args()
    start = time.time()
    device = torch.device("cuda")
    bandwidth = _measure.copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for vocab in (32000, 128256, 151936, 262144):
            for batch in (1, 8, 32, 64, 256):
                if time.time() - start > args.budget_s:
                    print("budget: stopping", flush=True)
                    break
                nbytes = batch * vocab * dtype.itemsize
                buffers = _measure.rotation_count(nbytes, device)
                inputs = [(torch.randn(batch, vocab, device=device) * 4).to(dtype) for _ in range(buffers)]
                floor_us = nbytes / bandwidth * 1e6
                for k in args.ks:
                    registers = {}
                    calls = {name: launcher(k, registers, name, **tile) for name, tile in VARIANTS.items()}
                    if k > 1 and batch <= 64:
                        calls["softmax+topk"] = selection_call("softmax+topk", k)
                    want_prob, want_index = topk_prob_reference(inputs[0], k)
                    wrong = []
                    for name in VARIANTS:
                        prob, index = calls[name](inputs[0])
                        if not torch.equal(index, want_index) or not torch.allclose(prob, want_prob, rtol=2e-5, atol=1e-7):
                            wrong.append(name)
                    samples = {name: [] for name in calls}
                    for _ in range(3):  # the variants take turns
                        for name, call in calls.items():
                            samples[name] += _measure.time_in_graph(call, inputs, 10)
                    times = {name: _measure.summary(s)["median_us"] for name, s in samples.items()}
                    limit, _ = selection_limit(k, batch, floor_us)
                    row = {"dtype": str(dtype).split(".")[1], "vocab": vocab, "batch": batch, "k": k, "floor_us": floor_us,
                           "limit_us": limit, **{f"{n}_us": t for n, t in times.items()}, "registers": registers, "wrong": wrong}
                    rows.append(row)
                    print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print("\ndtype vocab batch k | limit | " + " | ".join(VARIANTS) + " | 2 / 1")
    for r in rows:
        cells = " | ".join(f"{r[n + '_us']:6.2f}{'*' if r[n + '_us'] > r['limit_us'] else ' '}" for n in VARIANTS)
        print(f"{r['dtype']:8} {r['vocab']:6} {r['batch']:3} {r['k']:2} | {r['limit_us']:5.1f} | {cells} | "
              f"{r['ahead 2_us'] / r['ahead 1_us']:.3f}" + (f"  WRONG: {r['wrong']}" if r["wrong"] else ""))
    for n in VARIANTS:
        met = sum(r[n + "_us"] <= r["limit_us"] for r in rows)
        ten = [r for r in rows if r["k"] > 1 and r["batch"] <= 64]
        tenx = sum(r["softmax+topk_us"] / r[n + "_us"] >= 10 for r in ten)
        print(f"{n}: time target met at {met}/{len(rows)}, 10x at {tenx}/{len(ten)}")
    ratios = sorted(r["ahead 2_us"] / r["ahead 1_us"] for r in rows)
    if ratios:
        print(f"ahead 2 / ahead 1: median {ratios[len(ratios) // 2]:.3f}, min {ratios[0]:.3f}, max {ratios[-1]:.3f}")


if __name__ == "__main__":
    main()
