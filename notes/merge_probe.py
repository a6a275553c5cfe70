"""k > 1: the row's last program ranking its candidates at once (no merge round when each is alone in its
lane) against the merge by sorted rounds, the programs' floor read by a plain L2 load of the slots instead
of an atomic, and the last program ranking up to 32 appended candidates without the floor, side by side in
one process on a GPU. Result: notes/kernels.md ("Candidates ranked, not sorted").

Variants, each a copy of draftfuse/kernels/_triton_{selection,launch}.py loaded under another module name:
  sort        the kernel at 5b6d1e4: the last program merges by 64-wide sort rounds, the programs read
              the slots by an atomic max
  rank        the kernel at 6c1a404 with that atomic read put back (by substitution here): the last
              program ranks its candidates when each is alone in its lane after the floor
  rank+load   the kernel at 6c1a404: ranks, and its programs read the slots with a .cg load (and take in
              their own lanes' maxima)
  first       the kernel at 9c8c0be: as rank+load, and with at most 32 candidates appended the last program
              ranks them all, computing no floor
  record      the kernel at c029730 (landed): as first, a program's record of tile maxima as long as its
              tiles (at least 32) instead of 256, and whole tiles re-read unmasked
  pairs       the working tree's: as record, and with more than 32 appended the last program ranks the
              candidates left over the final floor when each lane holds at most two (no merge round)
  sector      as the working tree's kernel, the row's candidate count in workspace column 16 (a 32-byte sector of its own)
              instead of column 1, beside the arrival counter that every program's release hits
  split256    as the working tree's kernel, k > 1 aiming at up to 256 chunks a row instead of 128 (as k = 1 does; measured no
              faster when the kernel took 165 registers, not since it takes 121-128)
  resnap      as the working tree's kernel, every program with a hit tile reading the slots again beside the tile's load
              and taking the higher floor (a later snapshot: fewer candidates appended); the working tree does so only
              at k >= 16, 8 rows or more, one tile a program (after this variant's run, notes/merge_probe6/7_h200.json)
  noresnap    as the working tree's kernel, no program reading the slots again (the kernel before that change)

First every variant is checked against the reference (special rows of several vocabularies, forced splits,
little room for candidates, scales of every sign, log, random rows at the timed sizes), and the workspace
must be left idle. Each point: µs per call in a CUDA graph (inputs rotated over 3x the L2), 6 rounds of 10
replays, the order rotating between rounds; softmax + topk timed beside them for the 10x target. The first
run (notes/merge_probe_h200.json) had sort, rank and rank+load; the second (notes/merge_probe2_h200.json)
rank+load and first; the third (notes/merge_probe3_h200.json) first and record. Usage (GPU):

    python notes/merge_probe.py [--out probe.json] [--budget-s 300] [--variants NAME ...] [--batches B ...] [--quick]

(The checks run first, one process per variant at once: most of their time is Triton compiling, over 400 s
for three variants on a machine with a cold Triton cache. `--quick` checks only the timed points.)
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.selection import selection_call  # noqa: E402
from benchmarks.targets import selection_limit  # noqa: E402
from draftfuse import _measure  # noqa: E402
from tests.test_kernels import check_selection, special_rows, special_scales  # noqa: E402

KERNELS = REPO / "draftfuse" / "kernels"
ATOMIC_READ = 'slot_keys = tl.atomic_max(slots_ptr + lanes, _NO_KEY, sem="relaxed")'
COUNT_AT = ("ws_row + 1, ", "ws_row + 16, ")  # the candidates' count: reserved (atomic add), then read and reset
LOAD_READ = 'slot_keys = tl.maximum(tl.load(slots_ptr + lanes, cache_modifier=".cg"), own)'
RESNAP = "RESNAP=k >= _RESNAP_MIN_K and rows >= _RESNAP_MIN_ROWS and chunk == block"  # the launcher's choice


def load_variant(name: str, sources: tuple[str, str], where: Path):
    """The launch module of a variant: its kernel and launcher sources (_triton_selection.py,
    _triton_launch.py) saved as modules of their own, the launcher's import pointed at its kernel."""
    tag = name.replace("+", "_")
    selection, launch = sources
    (where / f"v_{tag}_selection.py").write_text(selection)
    launch = launch.replace("from draftfuse.kernels._triton_selection import", f"from v_{tag}_selection import")
    (where / f"v_{tag}_launch.py").write_text(launch)
    spec = importlib.util.spec_from_file_location(f"v_{tag}_launch", where / f"v_{tag}_launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launcher(module, k, scale=None, log=False, **tile):
    """A call of the variant's launcher; its launches use a workspace of their own made at the first (eager)
    call, as draftfuse's recorder gives its graphs (a graph captured without one fills a workspace per
    launch: notes/fill_probe.py), where the variant's launcher takes one."""
    held = {}

    def call(x):
        prob = torch.empty(x.shape[0], k, device=x.device)
        index = torch.empty(x.shape[0], k, device=x.device, dtype=torch.int64)
        if "workspace" not in held and "workspace" not in tile and hasattr(module, "graph_workspace"):
            held["workspace"] = module.graph_workspace(x.device)
        module.launch_selection(x, k, log, prob, index, scale, **held, **tile)
        return prob, index

    return call


def side_by_side(calls: dict, inputs: list, rounds: int = 6, replays: int = 10) -> dict[str, float]:
    """Median µs per call of each of `calls` in a CUDA graph over `inputs`, the order rotating between rounds."""
    order = list(calls)
    samples = {name: [] for name in calls}
    for round_ in range(rounds):
        for name in order[round_ % len(order):] + order[:round_ % len(order)]:
            samples[name] += _measure.time_in_graph(calls[name], inputs, replays)
    return {name: _measure.summary(s)["median_us"] for name, s in samples.items()}


def check(variants: dict) -> list[str]:
    failures = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, module in variants.items():
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            for vocab in (7, 100, 1000, 4099, 32000, 151936):
                x = special_rows(vocab, dtype, "cuda")
                for k in (4, 16):
                    if k > vocab:
                        continue
                    for scale in (None, special_scales(10, "cuda")):
                        for tile in ({}, {"splits": 3}, {"candidates": 32}):
                            log = bool(len(tile))
                            prob, index = launcher(module, k, scale, log, **tile)(x)
                            if problem := check_selection(x, k, log, prob, index, scale):
                                failures.append(f"{name} special v{vocab} {dtype} k={k} scaled={scale is not None} {tile}: {problem}")
            for batch, vocab in ((1, 32000), (8, 128256), (64, 151936), (256, 262144), (3, 7), (5, 1000003)):
                x = (torch.randn(batch, vocab, device="cuda", generator=g) * 4).to(dtype)
                for k in (4, 8, 16):
                    for scale in (None, torch.rand(batch, device="cuda", generator=g) * 4 - 2):
                        if k > vocab:
                            continue
                        prob, index = launcher(module, k, scale)(x)
                        if problem := check_selection(x, k, False, prob, index, scale):
                            failures.append(f"{name} random {batch}x{vocab} {dtype} k={k} scaled={scale is not None}: {problem}")
        for ws in module._workspaces.values():
            if not bool((ws == -(2**31)).all()):
                failures.append(f"{name}: a launch left the workspace dirty")
    return failures


def check_timed(variants: dict, batches: list[int], vocabs: list[int]) -> list[str]:
    """--quick: only the timed points (random rows, unscaled), one launch each: a sanity check that also
    compiles what the timing launches, in the check's own process."""
    failures = []
    for name, module in variants.items():
        for batch in batches:
            for dtype in (torch.bfloat16, torch.float32):
                for vocab in vocabs:
                    x = (torch.randn(batch, vocab, device="cuda") * 4).to(dtype)
                    for k in (4, 8, 16):
                        prob, index = launcher(module, k)(x)
                        if problem := check_selection(x, k, False, prob, index, None):
                            failures.append(f"{name} timed {batch}x{vocab} {dtype} k={k}: {problem}")
    return failures


def registers(variants: dict) -> dict:
    out = {}
    for name, module in variants.items():
        for dtype in (torch.bfloat16, torch.float32):
            for k in (4, 16):
                x = torch.randn(1, 32000, device="cuda").to(dtype)
                prob, index = torch.empty(1, k, device="cuda"), torch.empty(1, k, device="cuda", dtype=torch.int64)
                kernel = module.launch_selection(x, k, False, prob, index, None)
                out[f"{name} {str(dtype).split('.')[1]} k={k}"] = (kernel.n_regs, kernel.n_spills)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--budget-s", type=float, default=300)
    parser.add_argument("--variants", nargs="+", default=["first", "record"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 256])
    parser.add_argument("--vocabs", nargs="+", type=int, default=[32000, 128256, 151936, 262144])
    parser.add_argument("--check", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="check only the timed points (no special rows, scales or tilings)")
    parser.add_argument("--wait-for", help="a file to wait for before timing (other GPU work of the same call ends)")
    args = parser.parse_args()
    device = torch.device("cuda")

    def at(rev: str, name: str) -> str:
        """draftfuse/kernels/_triton_{name}.py at `rev`; on a copy without that commit (the device machine's
        was one), notes/_at_{rev}_{name}.py, made beforehand by git show."""
        found = subprocess.run(["git", "show", f"{rev}:draftfuse/kernels/_triton_{name}.py"], cwd=REPO,
                               capture_output=True, text=True)
        return found.stdout if found.returncode == 0 else (REPO / "notes" / f"_at_{rev}_{name}.py").read_text()

    def moved(source: str, old: str, new: str, count: int) -> str:
        assert source.count(old) == count, old
        return source.replace(old, new)

    def pair(rev: str, change=lambda source: source) -> tuple[str, str]:
        return change(at(rev, "selection")), at(rev, "launch")

    here = tuple((KERNELS / f"_triton_{name}.py").read_text() for name in ("selection", "launch"))
    every = {"sort": lambda: pair("5b6d1e4"), "rank": lambda: pair("6c1a404", lambda s: s.replace(LOAD_READ, ATOMIC_READ)),
             "rank+load": lambda: pair("6c1a404"), "first": lambda: pair("9c8c0be"), "record": lambda: pair("c029730"), "pairs": lambda: here,
             "sector": lambda: (moved(here[0], *COUNT_AT, count=2), here[1]),
             "split256": lambda: (moved(here[0], "_TOPK_SPLITS = 128", "_TOPK_SPLITS = 256", count=1), here[1]),
             "resnap": lambda: (here[0], moved(here[1], RESNAP, "RESNAP=True", count=1)),
             "noresnap": lambda: (here[0], moved(here[1], RESNAP, "RESNAP=False", count=1))}
    sources = {name: every[name]() for name in args.variants}
    where = Path(tempfile.mkdtemp(prefix="merge_probe_"))
    sys.path.insert(0, str(where))
    if args.check:  # one variant's checks (compiling its kernels into Triton's cache), in a process of its own
        variant = {args.check: load_variant(args.check, sources[args.check], where)}
        print(json.dumps(check_timed(variant, args.batches, args.vocabs) if args.quick else check(variant)))
        return
    # the variants' checks at once, one process each: most of their time is Triton compiling
    quick = ["--quick", "--batches", *map(str, args.batches), "--vocabs", *map(str, args.vocabs)] if args.quick else []
    checks = [subprocess.Popen([sys.executable, __file__, "--check", name, "--variants", *args.variants, *quick], stdout=subprocess.PIPE, text=True)
              for name in sources]
    failures = [f for p in checks for f in json.loads(p.communicate()[0].splitlines()[-1])]
    variants = {name: load_variant(name, source, where) for name, source in sources.items()}
    print(f"checks: {len(failures)} failures", *failures[:10], sep="\n", flush=True)
    regs = registers(variants)
    print("registers, spills:", regs, flush=True)
    while args.wait_for and not Path(args.wait_for).exists():
        time.sleep(1)
    bandwidth = _measure.copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    start = time.time()
    rows = []
    names = list(variants)
    # batch <= 64 first (the 8 us and 10x targets), then 256
    points = [(dtype, vocab, batch) for batch in args.batches for dtype in (torch.bfloat16, torch.float32)
              for vocab in args.vocabs]
    for dtype, vocab, batch in points:
        if time.time() - start > args.budget_s:
            print("budget: stopping", flush=True)
            break
        nbytes = batch * vocab * dtype.itemsize
        inputs = [(torch.randn(batch, vocab, device=device) * 4).to(dtype) for _ in range(_measure.rotation_count(nbytes, device))]
        floor_us = nbytes / bandwidth * 1e6
        for k in (4, 8, 16):
            calls = {"softmax+topk": selection_call("softmax+topk", k), **{n: launcher(m, k) for n, m in variants.items()}}
            times = side_by_side(calls, inputs)
            limit, _ = selection_limit(k, batch, floor_us)
            row = {"dtype": str(dtype).split(".")[1], "vocab": vocab, "batch": batch, "k": k, "floor_us": floor_us,
                   "limit_us": limit, **{f"{n}_us": t for n, t in times.items()}}
            rows.append(row)
            print(f"{row['dtype']:8} {vocab:6} {batch:3} k={k:2} | limit {limit:5.2f} | "
                  + " | ".join(f"{n}: {t:6.2f}" for n, t in times.items()), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps({"failures": failures, "registers": regs, "bandwidth": bandwidth, "rows": rows}, indent=1))
    for n in names:
        met = sum(r[n + "_us"] <= r["limit_us"] for r in rows)
        small = [r for r in rows if r["batch"] <= 64]
        tenx = sum(r["softmax+topk_us"] / r[n + "_us"] >= 10 for r in small)
        ratio = sorted(r[n + "_us"] / r[names[0] + "_us"] for r in rows)
        print(f"{n:10}: time met {met}/{len(rows)}, 10x {tenx}/{len(small)}; / {names[0]}: median {ratio[len(ratio) // 2]:.3f}, "
              f"range {ratio[0]:.3f}-{ratio[-1]:.3f}")


if __name__ == "__main__":
    main()
