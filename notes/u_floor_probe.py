"""The k > 1 kernel before and after pass 2 compares u with a floor moved from y (`_u_floor`), side by side in
one process on a GPU, with a temperature tensor and without. Before, a scaled hit tile computed both
y = x * s and u = x * sign(s) and the order keys of both (sm_90 SASS, Triton 3.6: 868 instructions a hit
tile against 762 unscaled); after, u's key alone (776). Result: notes/kernels.md ("Pass 2 in u").

Each point: µs per call in a CUDA graph (draftfuse._measure.time_in_graph: inputs rotated over 3x the L2),
the variants taking turns (--rounds rounds of 10 replays, 3 by default), each variant's tokens and probabilities checked against
the reference first (notes/variant_probe.py does the measuring). The kernel before is loaded from a copy of
its module file:

    git show <rev>:draftfuse/kernels/_triton_selection.py > gpu-logs/selection_before.py
    python notes/u_floor_probe.py --before gpu-logs/selection_before.py [--out probe.json] [--budget-s 150]
        [--dtypes bfloat16 float32] [--vocabs 32000 151936] [--batches 1 8 64 256] [--ks 4 16] [--rounds 3]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from variant_probe import load, run, summarize  # noqa: E402

from draftfuse.kernels import _triton_launch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True)
    parser.add_argument("--out")
    parser.add_argument("--budget-s", type=float, default=150)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    variants = {"topk": {"before": (load("before", args.before, "topk"), {}), "u floor": (_triton_launch._selection_kernel, {})}}
    points = [("topk", d, v, b) for d in args.dtypes for v in args.vocabs for b in args.batches]
    rows = run(points, variants, args.ks, args.rounds, args.budget_s)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    summarize(rows, "topk", "u floor", "before")
    print("wrong:", [r for r in rows if r["wrong"]])


if __name__ == "__main__":
    main()
