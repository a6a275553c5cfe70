"""Where the k > 1 kernel's time over k = 1 goes: the kernel with its parts taken away one by one, each
variant timed side by side in one process on a GPU (timing only: the variants past `full` give wrong
tokens and are never checked). Result: notes/kernels.md ("Where k > 1's time goes").

Variants, each draftfuse/kernels/_triton_selection.py with substitutions, loaded under another name:
  full         the kernel as it is
  no-hits      pass 2 re-reads no tile and appends nothing (the floor is still read and computed); the
               last program ranks nothing
  no-floor     as no-hits, and the floor is computed from the program's own lanes (no read of the slots)
  no-publish   as no-floor, and pass 1 publishes nothing to the slots (no atomics per tile)
and draftfuse's k = 1 kernel (`k=1`) beside them. What remains in no-publish is k > 1's pass 1 (the
online softmax and the tile record), the programs' ends (partials, the release counter, K keys of the
overflow area), and the last program's loads of the partials and candidates. Each point: µs per call in
a CUDA graph (inputs rotated over 3x the L2), 6 rounds of 10 replays, the order rotating between rounds.
`--counts`: each row's appended candidates instead (the full kernel writing the count over the row's first
probability). `--k16`: k = 16 only, full against no-atomic (pass 2 as it is but with no atomic add to
reserve the candidates' places: they overwrite each other, and the last program ranks none) and no-hits
(`notes/k_breakdown_k16_h200.json`). Every run timed a bare torch.cuda.graph capture, one workspace fill
kernel per call in each variant alike (notes/fill_probe.py): the differences stand. Usage (GPU):

    python notes/k_breakdown_probe.py [--out probe.json] [--budget-s 120] [--counts | --k16]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "notes"))

import torch  # noqa: E402

from draftfuse import _measure  # noqa: E402
from merge_probe import launcher, load_variant, side_by_side  # noqa: E402

KERNELS = REPO / "draftfuse" / "kernels"
NO_HITS = ("while tl.max(pending.to(tl.int32), 0) > 0:", "while tl.max(pending.to(tl.int32), 0) > splits + 1:")
NO_FLOOR = ('slot_keys = tl.maximum(tl.load(slots_ptr + lanes, cache_modifier=".cg"), own)', "slot_keys = own")
NO_PUBLISH = ("publish = splits > 1", "publish = splits < 0")
NO_ATOMIC = ('at += tl.atomic_add(ws_row + 1, n, sem="relaxed") - _NO_KEY', "at += 0")
STEPS = {"full": [], "no-atomic": [NO_ATOMIC], "no-hits": [NO_HITS], "no-floor": [NO_HITS, NO_FLOOR], "no-publish": [NO_HITS, NO_FLOOR, NO_PUBLISH]}


def variant_source(name: str) -> str:
    source = (KERNELS / "_triton_selection.py").read_text()
    for old, new in STEPS[name]:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return source


# the appended count of each row written over its first probability (after the merge's own writes)
COUNT = ("                       log, K, HAS_SCALE)\n\n\n@triton.jit\ndef _write_top(",
         "                       log, K, HAS_SCALE)\n        tl.store(prob_ptr + row64 * K, appended.to(tl.float32))\n\n\n@triton.jit\ndef _write_top(")


def appended_counts(where: Path, launch: str) -> list[dict]:
    """How many candidates the programs of a row append (randn * 4 rows, as timed): the full kernel with
    each row's count written over its first probability."""
    source = (KERNELS / "_triton_selection.py").read_text()
    assert source.count(COUNT[0]) == 1
    module = load_variant("count", (source.replace(*COUNT), launch), where)
    out = []
    for batch in (1, 8, 32):
        for vocab in (32000, 128256, 262144):
            x = (torch.randn(batch, vocab, device="cuda") * 4).to(torch.bfloat16)
            for k in (4, 16):
                counts = [launcher(module, k)(x)[0][:, 0] for _ in range(20)]
                c = torch.cat(counts)
                out.append({"vocab": vocab, "batch": batch, "k": k, "mean": c.mean().item(), "max": c.max().item(),
                            "over_32": (c > 32).float().mean().item(), "over_room": (c > 256).float().mean().item()})
                print(f"appended bf16 {vocab:6} b{batch:<3} k={k:2}: mean {out[-1]['mean']:6.1f} max {out[-1]['max']:5.0f} "
                      f"> 32: {out[-1]['over_32']:.2f}  > 256: {out[-1]['over_room']:.2f}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--budget-s", type=float, default=120)
    parser.add_argument("--k16", action="store_true", help="k = 16 only: full, no-atomic, no-hits")
    parser.add_argument("--counts", action="store_true", help="only the rows' appended candidate counts")
    args = parser.parse_args()
    device = torch.device("cuda")
    where = Path(tempfile.mkdtemp(prefix="k_breakdown_"))
    sys.path.insert(0, str(where))
    launch = (KERNELS / "_triton_launch.py").read_text()
    if args.counts:
        counts = appended_counts(where, launch)
        if args.out:
            Path(args.out).write_text(json.dumps({"appended": counts}, indent=1))
        return
    names = ("full", "no-atomic", "no-hits") if args.k16 else [n for n in STEPS if n != "no-atomic"]
    modules = {name: load_variant(name.replace("-", "_"), (variant_source(name), launch), where) for name in names}
    start = time.time()
    rows = []
    for batch in (1, 8, 32):
        for vocab in (32000, 128256, 262144):
            if time.time() - start > args.budget_s:
                print("budget: stopping", flush=True)
                break
            dtype = torch.bfloat16
            nbytes = batch * vocab * dtype.itemsize
            inputs = [(torch.randn(batch, vocab, device=device) * 4).to(dtype) for _ in range(_measure.rotation_count(nbytes, device))]
            if args.k16:
                calls = {f"{n} k=16": launcher(modules[n], 16) for n in ("full", "no-atomic", "no-hits")}
            else:
                calls = {"k=1": launcher(modules["full"], 1), **{f"{n} k=4": launcher(m, 4) for n, m in modules.items() if n != "no-atomic"},
                         "full k=16": launcher(modules["full"], 16), "no-hits k=16": launcher(modules["no-hits"], 16)}
            times = side_by_side(calls, inputs)
            rows.append({"dtype": "bfloat16", "vocab": vocab, "batch": batch, **{f"{n}_us": t for n, t in times.items()}})
            print(f"bf16 {vocab:6} b{batch:<3} " + " | ".join(f"{n}: {t:6.2f}" for n, t in times.items()), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
