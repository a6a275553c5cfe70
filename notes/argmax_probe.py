"""k = 1 with per-lane state (draftfuse/kernels/_triton_argmax.py) against the tile-wise k = 1 path that
_selection_kernel had before, side by side in one process on a GPU: every k = 1 point of the selection
targets (bf16 and fp32, vocab 32000 .. 262144, batch 1 .. 256; scaled rows at vocab 128256). Result:
notes/kernels.md ("Per-lane state for k = 1"), raw figures in notes/argmax_probe_h200.json (first run:
one or two tiles loaded ahead, 16, 24 or 32 programs per SM; the script as of commit 05de2a8) and
notes/argmax_probe_warps_h200.json (second run: programs of 1, 2, 4 or 8 warps, a 512-element tile a
warp; this script, as of commit b197d8f). The launcher keywords it passes (argmax, ahead, warps) went
with the variants that lost (commit 0415317): it runs at those commits only.

First every variant is checked against the reference: special rows (NaN, +-inf, ties, -0.0, all -inf)
of several vocabularies, forced splits, per-row scales of every sign, log on and off, and random rows at
the timed sizes. Each point: µs per call in a CUDA graph (inputs rotated over 3x the L2), 6 rounds of
10 replays, the variants' order rotating between rounds. Usage (GPU, at commit b197d8f):

    python notes/argmax_probe.py [--out probe.json] [--budget-s 200]
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.targets import selection_limit  # noqa: E402
from draftfuse import _measure  # noqa: E402
from draftfuse.kernels import _triton_launch  # noqa: E402
from tests.test_kernels import check_selection, rounding_ties, special_rows, special_scales  # noqa: E402

# name -> launch_selection keywords (programs_per_sm None: the module's default for the dtype)
VARIANTS = {
    "tiles": dict(argmax="tiles"),
    "lanes": dict(argmax="lanes", ahead=1, warps=1),
    "lanes 2 warps": dict(argmax="lanes", ahead=1, warps=2),
    "lanes 4 warps": dict(argmax="lanes", ahead=1, warps=4),
    "lanes 4 warps 8/SM": dict(argmax="lanes", ahead=1, warps=4, programs_per_sm=8),
    "lanes 8 warps": dict(argmax="lanes", ahead=1, warps=8),
    "lanes 4 warps ahead 2": dict(argmax="lanes", ahead=2, warps=4),
}


def launcher(tile, scale=None, log=False):
    def call(x):
        prob = torch.empty(x.shape[0], 1, device=x.device)
        index = torch.empty(x.shape[0], 1, device=x.device, dtype=torch.int64)
        _triton_launch.launch_selection(x, 1, log, prob, index, scale, **tile)
        return prob, index

    return call


def check_variants() -> list[str]:
    failures = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, tile in VARIANTS.items():
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            for vocab in (1, 7, 1000, 4099, 32000, 151936):
                x = special_rows(vocab, dtype, "cuda")
                for scale in (None, special_scales(10, "cuda")):
                    for log in (False, True):
                        for splits in (None, 3):
                            prob, index = launcher({**tile, "splits": splits}, scale, log)(x)
                            if problem := check_selection(x, 1, log, prob, index, scale):
                                failures.append(f"{name} special v{vocab} {dtype} scaled={scale is not None} log={log} splits={splits}: {problem}")
            for batch, vocab in ((1, 32000), (8, 128256), (64, 151936), (256, 262144), (3, 7), (5, 1000003)):
                x = (torch.randn(batch, vocab, device="cuda", generator=g) * 4).to(dtype)
                for scale in (None, torch.rand(batch, device="cuda", generator=g) * 4 - 2):
                    prob, index = launcher(tile, scale)(x)
                    if problem := check_selection(x, 1, False, prob, index, scale):
                        failures.append(f"{name} random {batch}x{vocab} {dtype} scaled={scale is not None}: {problem}")
        x = rounding_ties("cuda")
        scale = torch.tensor([0.75, -0.75, 0.75], device="cuda")
        prob, index = launcher({**tile, "splits": 2}, scale)(x)
        if problem := check_selection(x, 1, False, prob, index, scale):
            failures.append(f"{name} rounding ties: {problem}")
    for ws in _triton_launch._workspaces.values():
        if not bool((ws == -(2**31)).all()):
            failures.append("a launch left the workspace dirty")
    return failures


def registers() -> dict:
    """n_regs / n_spills of each variant's compiled kernel, bf16 and fp32, unscaled."""
    out = {}
    for name, tile in VARIANTS.items():
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(1, 32000, device="cuda").to(dtype)
            prob, index = torch.empty(1, 1, device="cuda"), torch.empty(1, 1, device="cuda", dtype=torch.int64)
            kernel = _triton_launch.launch_selection(x, 1, False, prob, index, None, **tile)
            out[f"{name} {str(dtype).split('.')[1]}"] = (kernel.n_regs, kernel.n_spills)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--budget-s", type=float, default=200)
    args = parser.parse_args()
    device = torch.device("cuda")
    failures = check_variants()
    print(f"checks: {len(failures)} failures", *failures[:10], sep="\n", flush=True)
    regs = registers()
    print("registers, spills:", regs, flush=True)
    bandwidth = _measure.copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    start = time.time()  # the budget is the timing's
    rows = []
    points = [(dtype, vocab, batch, False) for dtype in (torch.bfloat16, torch.float32)
              for vocab in (32000, 128256, 151936, 262144) for batch in (1, 8, 32, 64, 256)]
    points += [(torch.bfloat16, 128256, batch, True) for batch in (1, 8, 32, 64, 256)]
    names = list(VARIANTS)
    for dtype, vocab, batch, scaled in points:
        if time.time() - start > args.budget_s:
            print("budget: stopping", flush=True)
            break
        nbytes = batch * vocab * dtype.itemsize
        inputs = [(torch.randn(batch, vocab, device=device) * 4).to(dtype) for _ in range(_measure.rotation_count(nbytes, device))]
        scale = torch.rand(batch, device=device) * 1.5 + 0.5 if scaled else None
        floor_us = nbytes / bandwidth * 1e6
        calls = {name: launcher(tile, scale) for name, tile in VARIANTS.items()}
        samples = {name: [] for name in calls}
        for round_ in range(6):  # the order rotates
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                samples[name] += _measure.time_in_graph(calls[name], inputs, 10)
        times = {name: _measure.summary(s)["median_us"] for name, s in samples.items()}
        limit, _ = selection_limit(1, batch, floor_us)
        row = {"dtype": str(dtype).split(".")[1], "vocab": vocab, "batch": batch, "scaled": scaled,
               "floor_us": floor_us, "limit_us": limit, **{f"{n}_us": t for n, t in times.items()}}
        rows.append(row)
        print(f"{row['dtype']:8} {vocab:6} {batch:3} {'s' if scaled else ' '} | limit {limit:5.2f} | "
              + " | ".join(f"{n}: {t:6.2f}" for n, t in times.items()), flush=True)
        if args.out:  # after every point: a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps({"failures": failures, "registers": regs, "bandwidth": bandwidth, "rows": rows}, indent=1))
    for n in names:
        met = sum(r[n + "_us"] <= r["limit_us"] for r in rows)
        ratio = sorted(r[n + "_us"] / r["tiles_us"] for r in rows)
        print(f"{n:22}: target met at {met}/{len(rows)}; / tiles: median {ratio[len(ratio) // 2]:.3f}, "
              f"range {ratio[0]:.3f}-{ratio[-1]:.3f}")


if __name__ == "__main__":
    main()
