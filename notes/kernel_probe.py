"""Where the selection kernel's time goes for k > 1 (notes/kernels.md, wave 2, after GPU call 2): the
same points timed with stages left out, each variant in a process of its own (its own Triton cache, so
that no kernel compiled for one variant serves another). Results are wrong in every variant but "base";
only the times matter, and the differences between variants place the time. (Written for the kernel
before k > 1's candidates were appended instead of merged in each program; with today's kernel
"no-rounds" only leaves out the last program's round and the rare overflow path.)

  base        the kernel as committed
  no-rounds   _insert does nothing: no merge round, in the programs or in the row's last program (each
              program still re-reads the tiles that reach the floor and builds its candidates)
  no-pass2    _kth_largest answers a floor above every key: no tile is re-read, no candidate, no round
              (the slots are still published and read, the counter and the merge's loads still run)

  PYTHONUNBUFFERED=1 python3 notes/kernel_probe.py [--out DIR]      (GPU; prints one table)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("base", "no-rounds", "no-pass2")
VOCABS = (32000, 128256, 262144)
BATCHES = (1, 8, 32, 64)
KS = (1, 4, 16)


@triton.jit
def _insert_nothing(cand, top, kth, K: tl.constexpr, SORT: tl.constexpr):
    return top, kth


@triton.jit
def _floor_above_every_key(keys, K: tl.constexpr):
    return tl.full([], 0x7FFFFFFF, tl.int32)  # _NAN_KEY: no key reaches it


def _patch(variant: str) -> None:
    """Swap a helper of the kernel's module before anything is compiled (Triton reads the helpers, and
    hashes their source into its cache key, when it first compiles the kernel)."""
    from draftfuse.kernels import _triton_selection as ts

    if variant == "no-rounds":
        ts._insert = _insert_nothing
    elif variant == "no-pass2":
        ts._kth_largest = _floor_above_every_key


def measure(variant: str) -> list[dict]:
    import torch

    sys.path.insert(0, str(REPO))
    _patch(variant)
    from benchmarks.selection import selection_call, time_in_graph
    from draftfuse import _measure

    rows = []
    for vocab in VOCABS:
        for batch in BATCHES:
            nbytes = batch * vocab * 2
            inputs = [torch.randn(batch, vocab, device="cuda").mul_(4).bfloat16() for _ in range(_measure.rotation_count(nbytes, torch.device("cuda")))]
            for k in KS:
                if k == 1 and variant != "base":
                    continue
                t = time_in_graph(selection_call("draftfuse", k), inputs)
                rows.append({"variant": variant, "vocab": vocab, "batch": batch, "k": k, "us": t["median_us"]})
                print(variant, vocab, batch, k, round(t["median_us"], 2), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--variant", default=None, help="(internal) measure one variant in this process")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant)))
        return
    rows = []
    for variant in VARIANTS:
        env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix=f"probe-{variant}-")}
        done = subprocess.run([sys.executable, __file__, "--variant", variant], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(variant, "failed:", done.stderr[-2000:])
            continue
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    by = {(r["variant"], r["vocab"], r["batch"], r["k"]): r["us"] for r in rows}
    print("bf16, us per call in a CUDA graph (median of 30 replays); k=1 base for reference")
    print(f"{'vocab':>7} {'batch':>5} {'k':>3} {'k=1':>6} " + " ".join(f"{v:>10}" for v in VARIANTS))
    for vocab in VOCABS:
        for batch in BATCHES:
            for k in KS[1:]:
                cells = " ".join(f"{by.get((v, vocab, batch, k), float('nan')):10.2f}" for v in VARIANTS)
                print(f"{vocab:>7} {batch:>5} {k:>3} {by.get(('base', vocab, batch, 1), float('nan')):6.2f} {cells}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
