"""One device call for the selection kernel (issue 7, wave 2): correctness of every tiling, then timings.

  PYTHONUNBUFFERED=1 python3 notes/kernel_tune.py --out $OUT [--sections env,pytest,warm,check,grid]
                                                   [--variants A,B,C,D] [--budget SECONDS] [--quick]

(GPU call 2 of wave 2 ran this version with --budget 232: 86 s on an H200; notes/kernels.md.)
Sections (each guarded: an error is recorded and the run goes on):
  env     versions, GPU, clocks (nvidia-smi), the copy bandwidth that sets the floors
  pytest  starts `pytest -m cuda tests/test_kernels.py -k "graph_replay or reduce_overhead"` beside the
          warm-up and checks (it compiles and runs small GPU work), joined before any timing
  warm    compiles every kernel the run needs in worker processes sharing Triton's cache (a compile takes
          seconds; the main process then loads them from the cache)
  check   every tiling against the torch reference on fresh random data: bf16/fp32 (fp16 for the
          defaults), batch x vocab up to 256 x 262144 and 2 x 1000003, k in {1, 2, 3, 4, 8, 16}, no scale /
          positive / mixed signs with 0 and NaN / 0-d negative / all zero; special rows (NaN, +-inf, -0.0,
          ties, all -inf) and rows whose scaled products round to ties; poisoned outputs; CUDA-graph
          replay; the workspace idle afterwards; the occupancy cap per compiled kernel
  grid    the tilings A-D (VARIANTS) over the whole grid (bf16, fp32 x 4 vocabs x 5 batches x k 1, 4, 8,
          16, with and without a per-row scale) and softmax+topk where the 10x rule needs it, in CUDA
          graphs (benchmarks/selection.py's method)
  sweep   (not run by default) the variants on a subset of the grid
Writes $OUT/tune.json (every row), $OUT/tables.txt (every tiling per point), $OUT/log.txt (all output)
and prints the compact tables last.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

VOCABS = (32000, 128256, 151936, 262144)
BATCHES = (1, 8, 32, 64, 256)
KS = (1, 4, 8, 16)
# launch_selection keywords of each variant: "default" is the module's defaults (since GPU call 2: B's
# 512-element tiles); A-D are the tilings that call timed over the whole grid to choose them
VARIANTS = {
    "default": {},
    "A": {"block": 1024, "programs_per_sm": 16},
    "B": {"block": 512, "programs_per_sm": 24},
    "C": {"block": 1024, "programs_per_sm": 8},
    "D": {"block": 512, "programs_per_sm": 32},
    "no-pdl": {"pdl": False},
}
GRID_VARIANTS = ("A", "B", "C", "D")


class Log:
    def __init__(self, path):
        self.file = open(path, "w") if path else None

    def __call__(self, *parts):
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


def section(log, results, name, fn):
    start = time.time()
    log(f"== {name}")
    try:
        fn()
    except Exception:
        results.setdefault("errors", []).append({"section": name, "error": traceback.format_exc()})
        log(f"!! {name} failed:\n{traceback.format_exc()}")
    log(f"== {name} done in {time.time() - start:.1f} s")


def _scale(kind, rows, device, generator=None):
    import torch

    if kind is None:
        return None
    if kind == "pos":
        return torch.rand(rows, device=device, generator=generator) * 1.5 + 0.5
    if kind == "mixed":  # both signs, exact zeros, a NaN, a tiny and an overflowing one
        s = torch.rand(rows, device=device, generator=generator) * 4 - 2
        fixed = torch.tensor([0.0, -1.0, float("nan"), 1e-3, 1e30, -0.0], device=device)
        n = min(rows, len(fixed))
        s[:n] = fixed[:n] if rows > 2 else s[:n]
        return s
    if kind == "neg0d":
        return torch.tensor(-0.8, device=device)
    if kind == "zero":
        return torch.zeros(rows, device=device)
    raise ValueError(kind)


def _import_kernels():
    """import draftfuse.kernels; if the package's __init__ fails (others' work in progress in the tree
    this run ships), load draftfuse.kernels alone under a bare package module."""
    try:
        import draftfuse.kernels  # noqa: F401
    except Exception:  # noqa: BLE001
        import types

        for name in [m for m in sys.modules if m == "draftfuse" or m.startswith("draftfuse.")]:
            del sys.modules[name]
        package = types.ModuleType("draftfuse")
        package.__path__ = [os.path.join(REPO, "draftfuse")]
        sys.modules["draftfuse"] = package
        import draftfuse.kernels  # noqa: F401
        print("note: draftfuse/__init__.py failed to import; loaded draftfuse.kernels alone", flush=True)


def _warm_one(job):
    """Worker: one launch per (dtype, k, scaled, variant, vocab) so that its kernel lands in the cache."""
    import torch

    sys.path.insert(0, REPO)
    _import_kernels()
    from draftfuse.kernels import _triton_launch as ts

    if os.environ.get("DRAFTFUSE_NO_PDL"):
        ts._PDL = False
    dtype_name, k, scaled, variant, vocab = job
    try:
        x = torch.randn(2, vocab, device="cuda").to(getattr(torch, dtype_name))
        prob = torch.empty(2, k, device="cuda")
        index = torch.empty(2, k, device="cuda", dtype=torch.int64)
        scale = torch.ones(2, device="cuda") if scaled else None
        start = time.time()
        kernel = ts.launch_selection(x, k, False, prob, index, scale, **VARIANTS[variant])
        torch.cuda.synchronize()
        return job, time.time() - start, getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None), None
    except Exception as exc:  # noqa: BLE001
        return job, 0.0, None, None, repr(exc)[:300]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sections", default="env,pytest,warm,check,grid")
    parser.add_argument("--quick", action="store_true", help="a small subset of everything (a smoke run)")
    parser.add_argument("--variants", default=",".join(GRID_VARIANTS))
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--budget", type=float, default=285, help="seconds: later timings are skipped past this")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "log.txt"))
    sections = set(args.sections.split(","))
    variants = [v for v in args.variants.split(",") if v in VARIANTS]
    results = {"rows": [], "checks": [], "kernels": [], "env": {}}
    t_start = time.time()

    import torch

    _import_kernels()
    from benchmarks.selection import copy_bandwidth, selection_call, time_in_graph
    from benchmarks.targets import selection_limit
    from draftfuse._measure import rotation_count
    from draftfuse.kernels import _triton_launch as ts
    from tests.test_kernels import check_selection, rounding_ties, special_rows, special_scales

    vocabs, batches = (VOCABS, BATCHES) if not args.quick else ((32000, 128256), (1, 32))
    dev = "cuda"

    def env():
        import triton

        props = torch.cuda.get_device_properties(0)
        results["env"] = {
            "torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
            "sms": props.multi_processor_count, "l2": props.L2_cache_size,
        }
        log(json.dumps(results["env"]))
        q = "clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu"
        log(subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"], capture_output=True, text=True).stdout)
        results["env"]["copy_gbs"] = copy_bandwidth() / 1e9
        log(f"copy bandwidth {results['env']['copy_gbs']:.0f} GB/s (read + write)")

    def warm():
        import multiprocessing as mp

        try:  # probe PDL once here: if this Triton or driver can't launch it, every variant runs without
            x = torch.randn(1, 64, device=dev, dtype=torch.bfloat16)
            ts.launch_selection(x, 1, False, torch.empty(1, 1, device=dev), torch.empty(1, 1, device=dev, dtype=torch.int64), pdl=True)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            log(f"PDL launch failed ({exc!r:.300}): running without it")
            ts._PDL = False
            os.environ["DRAFTFUSE_NO_PDL"] = "1"
            results["env"]["pdl"] = False
        jobs = []
        for variant in ("A", "B"):  # C and D run the same kernels on other grids
            for dtype_name in ("bfloat16", "float32"):
                for k in KS:
                    for scaled in (False, True):
                        jobs.append((dtype_name, k, scaled, variant, 32000))
        for dtype_name in ("bfloat16", "float32", "float16"):  # the default tiling: checks and pytest
            for k in (1, 2, 3, 4, 8, 16):
                for scaled in (False, True):
                    if dtype_name == "float16" or k in (2, 3):
                        jobs.append((dtype_name, k, scaled, "default", 32000))
                    jobs.append((dtype_name, k, scaled, "default", 4099))  # rows not 16-byte aligned
        log(f"{len(jobs)} warm-up launches on {args.workers} workers")
        with mp.get_context("spawn").Pool(args.workers) as pool:
            for job, seconds, regs, spills, error in pool.imap_unordered(_warm_one, jobs):
                results["kernels"].append({"job": job, "seconds": seconds, "n_regs": regs, "n_spills": spills, "error": error})
                if error:
                    log("warm-up failed", job, error)
        by = {}
        for r in results["kernels"]:
            if r["n_regs"] is not None and r["job"][4] == 32000:
                by.setdefault(r["job"][3], []).append(f"{r['job'][0][:4]} k{r['job'][1]}{'s' if r['job'][2] else ''}:{r['n_regs']}/{r['n_spills']}")
        for variant, items in by.items():
            log(f"regs/spills {variant}: " + " ".join(sorted(items)))
        compile_s = [r["seconds"] for r in results["kernels"] if not r["error"]]
        if compile_s:
            log(f"compile+first launch per kernel: median {sorted(compile_s)[len(compile_s) // 2]:.1f} s, max {max(compile_s):.1f} s")

    def run_check(variant, x, k, scale, log_flag=False, label=""):
        prob = torch.full((x.shape[0], k), -7.0, device=dev)
        index = torch.full((x.shape[0], k), -7, device=dev, dtype=torch.int64)
        ts.launch_selection(x, k, log_flag, prob, index, scale, **VARIANTS[variant])
        problem = check_selection(x, k, log_flag, prob, index, scale)
        results["checks"].append({"variant": variant, "label": label, "k": k, "ok": not problem, "problem": problem})
        if problem:
            log(f"CHECK FAIL {variant} {label} k={k}: {problem}")
        return not problem

    def check():
        g = torch.Generator(device=dev).manual_seed(int(time.time()))  # fresh data each run
        shapes = [(1, 32000), (8, 128256), (32, 151936), (64, 262144), (256, 128256)]
        for variant in ("default",) + tuple(variants):
            failures_before = sum(not c["ok"] for c in results["checks"])
            n_before = len(results["checks"])
            light = variant in ("C", "D")  # same kernels as A and B, other grids
            for dtype in (torch.bfloat16, torch.float32) + ((torch.float16,) if variant == "default" else ()):
                for batch, vocab in shapes:
                    if variant == "default" and dtype != torch.float16:
                        continue  # the defaults' tiling is B's: checked under B
                    x = (torch.randn(batch, vocab, device=dev, generator=g) * 4).to(dtype)
                    for k in (1, 16) if light else KS:
                        for kind in (None,) if light else (None, "mixed", "pos", "neg0d"):
                            scale = _scale(kind, batch, dev, g)
                            run_check(variant, x, k, scale, k == 4, f"{dtype} {batch}x{vocab} scale={kind}")
                if variant != "default":
                    continue
                for batch, vocab in ((2, 1000003), (3, 4099)):
                    x = (torch.randn(batch, vocab, device=dev, generator=g) * 4).to(dtype)
                    for k in (1, 3, 16):
                        run_check(variant, x, k, _scale("mixed", batch, dev, g), False, f"{dtype} {batch}x{vocab} mixed")
                for vocab in (7, 1000, 4099, 32000):
                    x = special_rows(vocab, dtype, dev)
                    for k in (1, 2, 3, 4, 8, 16):
                        if k <= vocab:
                            for scale in (None, special_scales(10, dev)):
                                run_check(variant, x, k, scale, k == 3, f"special {dtype} v{vocab} scaled={scale is not None}")
                if dtype == torch.float32:
                    for k in KS:
                        run_check(variant, rounding_ties(dev), k, torch.tensor([0.75, -0.75, 0.75], device=dev), False, "rounding ties")
                        run_check(variant, x[:3] * 0 + 1, k, _scale("zero", 3, dev), False, "zero scale")
            n = len(results["checks"]) - n_before
            bad = sum(not c["ok"] for c in results["checks"]) - failures_before
            log(f"check {variant}: {n - bad}/{n} passed")
        # the ops in a CUDA graph (PDL and the shared workspace in capture), replayed on new data
        static = torch.randn(8, 128256, device=dev, dtype=torch.bfloat16)
        scale = torch.rand(8, device=dev) + 0.5
        torch.ops.draftfuse.topk_prob(static, 8, False, scale)
        torch.ops.draftfuse.argmax_prob(static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            prob, index = torch.ops.draftfuse.topk_prob(static, 8, False, scale)
            top1, top1_prob = torch.ops.draftfuse.argmax_prob(static)
        ok = True
        for _ in range(3):
            static.copy_(torch.randn_like(static))
            scale.copy_(torch.rand_like(scale) * 4 - 2)
            graph.replay()
            ok &= not check_selection(static, 8, False, prob, index, scale)
            ok &= not check_selection(static, 1, False, top1_prob[:, None], top1[:, None])
        results["checks"].append({"variant": "default", "label": "cuda graph replay", "ok": ok})
        log(f"cuda graph replay: {'ok' if ok else 'FAIL'}")
        idle = all(bool((ws == -(2**31)).all()) for ws in ts._workspaces.values())
        results["checks"].append({"variant": "all", "label": "workspace idle", "ok": idle})
        log(f"workspace idle after all launches: {idle}")
        log(f"occupancy notes (programs per SM that fit): {sorted((str(k[1])[6:], k[2], k[3], k[4], v) for k, v in ts._fits.items())}")
        torch.cuda.synchronize()

    def grid():
        bandwidth = results["env"].get("copy_gbs", 0) * 1e9 or copy_bandwidth()
        for dtype_name in ("bfloat16", "float32"):
            dtype = getattr(torch, dtype_name)
            for vocab in vocabs:
                for batch in batches:
                    if time.time() - t_start > args.budget:
                        log(f"budget: grid stops before {dtype_name} {vocab} {batch}")
                        return
                    nbytes = batch * vocab * dtype.itemsize
                    buffers = rotation_count(nbytes, torch.device(dev))
                    inputs = [torch.randn(batch, vocab, device=dev).mul_(4).to(dtype) for _ in range(buffers)]
                    scale = torch.rand(batch, device=dev).add_(0.5).mul_(4 / 3)
                    floor_us = nbytes / bandwidth * 1e6
                    for k in KS:
                        calls = [("softmax+topk", None, None)] if k > 1 and batch <= 64 else []  # the 10x rule
                        calls += [("draftfuse", v, s) for v in variants for s in (None, scale)]
                        for method, variant, s in calls:
                            try:
                                t = time_in_graph(selection_call(method, k, VARIANTS[variant] if variant else None, s), inputs)
                            except Exception as exc:  # noqa: BLE001
                                t = {"error": repr(exc)[:300]}
                                log(f"grid timing failed {dtype_name} {vocab} {batch} {k} {method} {variant}: {t['error']}")
                            results["rows"].append({
                                "section": "grid", "variant": variant, "dtype": dtype_name, "vocab": vocab, "batch": batch,
                                "k": k, "method": method, "scaled": s is not None, "floor_us": floor_us, **t,
                            })
                    del inputs
            log(f"grid {dtype_name} done at {time.time() - t_start:.0f} s")

    def sweep():
        bandwidth = results["env"].get("copy_gbs", 0) * 1e9 or copy_bandwidth()
        points = [("bfloat16", v, b, k) for v in (32000, 128256, 262144) for b in BATCHES for k in (1, 4, 16)]
        points += [("float32", 128256, b, k) for b in BATCHES for k in (1, 16)]
        if args.quick:
            points = points[:6]
        for dtype_name, vocab, batch, k in points:
            if time.time() - t_start > args.budget:
                log(f"budget: sweep stops before {dtype_name} {vocab} {batch} {k}")
                return
            dtype = getattr(torch, dtype_name)
            nbytes = batch * vocab * dtype.itemsize
            buffers = rotation_count(nbytes, torch.device(dev))
            inputs = [torch.randn(batch, vocab, device=dev).mul_(4).to(dtype) for _ in range(buffers)]
            for variant in variants:
                try:
                    t = time_in_graph(selection_call("draftfuse", k, VARIANTS[variant] or None), inputs)
                except Exception as exc:  # noqa: BLE001
                    t = {"error": repr(exc)[:200]}
                results["rows"].append({
                    "section": "sweep", "variant": variant, "dtype": dtype_name, "vocab": vocab, "batch": batch, "k": k,
                    "method": "draftfuse", "scaled": False, "floor_us": nbytes / bandwidth * 1e6, **t,
                })
            del inputs

    # small fixed costs, for the analysis: our kernel on a [1, 64] row, and torch's fill of one element
    def fixed():
        x = [torch.randn(1, 64, device=dev).to(torch.bfloat16) for _ in range(64)]
        for name, variant in (("argmax_prob [1,64]", "default"),):
            t = time_in_graph(selection_call("draftfuse", 1, VARIANTS[variant] or None), x)
            results["rows"].append({"section": "fixed", "label": name, **t})
            log(f"{name}: {t['median_us']:.2f} us per call")
        z = [torch.empty(1, device=dev) for _ in range(64)]
        t = time_in_graph(lambda v: v.fill_(1.0), z)
        results["rows"].append({"section": "fixed", "label": "fill_ 1 element", **t})
        log(f"fill_ 1 element: {t['median_us']:.2f} us per call")

    pytest_proc = {}

    def pytest_start():  # runs beside the warm-up and checks (compiles, small GPU work), before any timing
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_kernels.py", "--tb=short",
               "-k", "graph_replay or reduce_overhead", "-p", "no:cacheprovider", "-p", "no:logging"]
        pytest_proc["p"] = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log("started: " + " ".join(cmd[2:]))

    def pytest_join():
        p = pytest_proc.get("p")
        if p is None:
            return
        try:
            out, _ = p.communicate(timeout=max(5, 150 - (time.time() - t_start)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n(killed: time limit)"
        results["pytest"] = {"rc": p.returncode, "tail": out[-3000:]}
        log(f"pytest rc={p.returncode}:\n{out[-1500:]}")

    steps = [("env", env), ("pytest", pytest_start), ("warm", warm), ("check", check), ("pytest-join", pytest_join),
             ("fixed", fixed), ("grid", grid), ("sweep", sweep)]
    for name, fn in steps:
        if name in sections or (name == "fixed" and "grid" in sections) or (name == "pytest-join" and "pytest" in sections):
            section(log, results, name, fn)
            with open(os.path.join(args.out, "tune.json"), "w") as f:
                json.dump(results, f, indent=0, default=str)
    results["seconds"] = time.time() - t_start
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(results, f, indent=0, default=str)
    with open(os.path.join(args.out, "tables.txt"), "w") as f:
        f.write(report(results, selection_limit, full=True))
    log(report(results, selection_limit))
    log(f"total {results['seconds']:.0f} s")


def _met(r, base, targets):
    target, least = targets(r["k"], r["batch"], r["floor_us"])
    ok = r["median_us"] <= target
    sm = base.get((r["dtype"], r["vocab"], r["batch"], r["k"]))
    speedup = sm["median_us"] / r["median_us"] if sm else None
    if least is not None and speedup is not None:
        ok = ok and speedup >= least
    return ok, target, speedup


def report(results, targets, full: bool = False) -> str:
    """Compact tables. Per (dtype, k, plain/scaled): a vocab x batch matrix, each cell the default
    tiling's (B) median / target, 'xN' its speedup over softmax+topk where the
    10x rule applies, '!' a miss, and in brackets the fastest tiling when another one is faster by
    more than 5%. full=True: every tiling's time in every cell. Then met counts per tiling."""
    out = []
    rows = [r for r in results["rows"] if r.get("section") == "grid" and "median_us" in r]
    base = {(r["dtype"], r["vocab"], r["batch"], r["k"]): r for r in rows if r["method"] == "softmax+topk"}
    ours = {(r["variant"], r["dtype"], r["vocab"], r["batch"], r["k"], r["scaled"]): r for r in rows if r["method"] == "draftfuse"}
    if ours:
        variants = sorted({key[0] for key in ours})
        vocabs = sorted({key[2] for key in ours})
        batches = sorted({key[3] for key in ours})
        out.append("grid: default tiling (B) median us / target, xN = softmax+topk / ours (10x rule), "
                   "'!' miss, [V t] a tiling >5% faster")
        for dtype in ("bfloat16", "float32"):
            default = "B"
            for k in KS:
                for scaled in (False, True):
                    if not any((default, dtype, v, b, k, scaled) in ours for v in vocabs for b in batches):
                        continue
                    out.append(f"{dtype} k={k} {'scaled' if scaled else 'plain'}: " + " | ".join(f"b{b}" for b in batches))
                    for v in vocabs:
                        cells = []
                        for b in batches:
                            r = ours.get((default, dtype, v, b, k, scaled))
                            if not r:
                                cells.append("-")
                                continue
                            ok, target, speedup = _met(r, base, targets)
                            cell = f"{r['median_us']:.1f}/{target:.1f}"
                            if speedup is not None and targets(k, b, r["floor_us"])[1] is not None:
                                cell += f" x{speedup:.0f}"
                            cell += "" if ok else "!"
                            others = {var: ours[(var, dtype, v, b, k, scaled)]["median_us"] for var in variants
                                      if (var, dtype, v, b, k, scaled) in ours}
                            if full:
                                cell += " [" + " ".join(f"{var}{t:.1f}" for var, t in others.items()) + "]"
                            else:
                                best = min(others, key=others.get)
                                if others[best] < 0.95 * r["median_us"]:
                                    cell += f" [{best} {others[best]:.1f}]"
                            cells.append(cell)
                        out.append(f"  {v:>6}: " + " | ".join(cells))
        for variant in variants:
            for scaled in (False, True):
                mine = [r for key, r in ours.items() if key[0] == variant and key[5] == scaled]
                met = sum(_met(r, base, targets)[0] for r in mine)
                out.append(f"tiling {variant} {'scaled' if scaled else 'plain '}: met {met}/{len(mine)}")
        for scaled in (False, True):
            points = {key[1:] for key in ours if key[5] == scaled}
            met = 0
            for p in points:
                rs = [ours[(var,) + p] for var in variants if (var,) + p in ours]
                met += _met(min(rs, key=lambda r: r["median_us"]), base, targets)[0]
            out.append(f"fastest tiling per point {'scaled' if scaled else 'plain '}: met {met}/{len(points)}")
    checks = results["checks"]
    if checks:
        bad = [c for c in checks if not c["ok"]]
        out.append(f"checks: {len(checks) - len(bad)}/{len(checks)} passed" + (f"; first failures: {bad[:3]}" if bad else ""))
    if "pytest" in results:
        out.append(f"pytest (graph replay, reduce-overhead): rc={results['pytest']['rc']}")
    if results.get("errors"):
        out.append(f"errors in sections: {[e['section'] for e in results['errors']]}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
