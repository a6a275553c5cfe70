"""What one selection launch costs before it reads anything: µs per call captured back to back in a CUDA
graph (draftfuse._measure.time_in_graph, the benchmark's method), bf16 logits rotated over 3x the L2, of

  nop, 1 program              an empty Triton kernel
  nop, N programs             the same over the grid argmax_prob runs at [1, 32000] (N = its splits)
  one tile per program        N one-warp programs, each loading one 512-element tile and storing its max
  + counter and merge         the same, then an atomic counter per row; the row's last program loads the N
                              maxima and stores their max (the shape of the k = 1 kernel, without its math)
  argmax_prob                 torch.ops.draftfuse.argmax_prob itself, at [1, 32000] and [1, 64]

Usage (GPU): python notes/fixed_cost_probe.py [--out probe.json]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import draftfuse  # noqa: E402, F401  (registers torch.ops.draftfuse)
from draftfuse import _measure  # noqa: E402
from draftfuse.kernels import _triton_launch  # noqa: E402


@triton.jit
def _nop(x_ptr):
    pass


@triton.jit
def _tile_max(x_ptr, out_ptr, counter_ptr, result_ptr, vocab, splits, MERGE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    tl.store(out_ptr + pid, tl.max(x, 0))
    if MERGE:
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
        if arrived == splits - 1:
            parts = tl.load(out_ptr + tl.arange(0, 128), mask=tl.arange(0, 128) < splits, other=float("-inf"))
            tl.store(result_ptr, tl.max(parts, 0))
            tl.store(counter_ptr, 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    vocab = 32000
    splits, _, _ = _triton_launch.plan(1, vocab, 1, device, programs_per_sm=_triton_launch.default_programs_per_sm(2, 1, False))
    n = _measure.rotation_count(2 * vocab, device)
    inputs = [torch.randn(1, vocab, device=device).to(torch.bfloat16) for _ in range(n)]
    small = [torch.randn(1, 64, device=device).to(torch.bfloat16) for _ in range(n)]
    out = torch.empty(128, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    result = torch.empty(1, device=device)
    calls = {
        "nop, 1 program": (lambda x: _nop[(1,)](x, num_warps=1), inputs),
        f"nop, {splits} programs": (lambda x: _nop[(splits,)](x, num_warps=1), inputs),
        f"one tile per program ({splits})": (
            lambda x: _tile_max[(splits,)](x, out, counter, result, vocab, splits, MERGE=False, BLOCK=512, num_warps=1), inputs),
        f"+ counter and merge ({splits})": (
            lambda x: _tile_max[(splits,)](x, out, counter, result, vocab, splits, MERGE=True, BLOCK=512, num_warps=1), inputs),
        "argmax_prob [1, 32000]": (lambda x: torch.ops.draftfuse.argmax_prob(x), inputs),
        "argmax_prob [1, 64]": (lambda x: torch.ops.draftfuse.argmax_prob(x), small),
    }
    found = {name: [] for name in calls}
    for round_ in range(5):
        names = list(calls) if round_ % 2 == 0 else list(reversed(calls))
        for name in names:
            call, xs = calls[name]
            found[name].append(_measure.summary(_measure.time_in_graph(call, xs, 20))["median_us"])
    result_rows = {name: sorted(v)[len(v) // 2] for name, v in found.items()}
    print(json.dumps(result_rows, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"splits": splits, "median of 5 rounds (us)": result_rows, "rounds": found}, indent=1))


if __name__ == "__main__":
    main()
