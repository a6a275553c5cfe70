"""Vocab-parallel selection on tensor-parallel GPUs: the gathered-logits path against draftfuse's rewrite.

    torchrun --nproc-per-node 2 benchmarks/tp_selection.py --out benchmarks/results        # ~6 min on 2x H200
    torchrun --nproc-per-node 2 benchmarks/tp_selection.py --out /tmp/tp --quick           # ~1.5 min

Each rank holds a vocabulary shard of bf16 logits [batch, vocab / tp] (random, the same full logits on
every rank from one seed). Two variants of `softmax(all_gather(x).float()).topk(k)`, side by side in
one process per rank, alternating sample by sample:
  "all_gather+softmax+topk"   draft_loop(..., options={"vocab_parallel": False, "softmax_topk": False}): the [batch, vocab]
                              logits all-gathered, then softmax + topk as written (no rewrite at all)
  "draftfuse"                 draft_loop with the default options: each rank selects on its shard and
                              one all_gather carries k candidates (+ max and exp-sum) per rank
Both through draft_loop (mode="reduce-overhead", zero_copy_outputs=True: one CUDA graph replay per call,
the collective inside it), the input marked static (no copy into the graph). A sample is `--reps`
replays back to back between two CUDA events (µs per call); median, p10 and p90 over `--samples`.
graph_launches_per_call: cudaGraphLaunch events per call in a torch.profiler trace. tokens_match:
both variants' ids equal the selection on the full logits in one process (differences only among
exactly equal logits are allowed: their order is torch.topk's choice; `tokens_exact` says if there were any).

Workload "tp_draft": the TP example's whole draft (examples/tp_draft.py: EAGLE-style head, hidden 4096,
vocab 128256, bf16, seed + 3 steps; chain topk 1, tree topk 4), the gather path against draftfuse;
tokens_match compares draftfuse with the gather path (bf16: same rounding, the reference).

Robustness: a row's error (on any rank) is recorded in the row and the run goes on; the ranks agree on
every step through a gloo group, and rank 0's clock decides when --budget-s is spent (the rows left
are recorded as skipped). Rank 0 writes DIR/NAME_tp.json (NAME as benchmarks/run.py names its results:
h200 on an H200, else the device's name; benchmarks/report.py reads NAME_tp.json) and prints the table
last. NCCL_NVLS_ENABLE=0 is set when absent (the lent machines need it).

Estimate: each row compiles two small graphs (~5 s each: Inductor and Triton, shapes static), timing
is under a second: 30 selection rows ~300 s; the drafts ~30 s per compile. The default order puts
batches 1 and 64 first (the rows the targets read), then 32 and 256, then the drafts, then batch 8, so
a spent budget drops the least.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks and draftfuse from this checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import draftfuse  # noqa: E402
from benchmarks._rows import TP_GATHER, results_name  # noqa: E402
from draftfuse._measure import summary  # noqa: E402

VOCABS = (128256, 151936, 262144)
BATCHES = (1, 64, 32, 256, 8)  # the order rows run in: the last ones go first when the budget is spent
EARLY_BATCHES = (1, 64, 32, 256)  # run before the drafts (1 and 64: the rows of the targets)
KS = (1, 4)
GATHER, DRAFTFUSE = TP_GATHER, "draftfuse"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for NAME_tp.json (NAME: h200 on an H200)")
    parser.add_argument("--quick", action="store_true", help="vocab 128256, batches 1 and 32, fewer samples, chain draft at batch 1")
    parser.add_argument("--budget-s", type=float, default=330.0, help="stop starting rows after this many seconds (default 330)")
    parser.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS))
    parser.add_argument("--draft-batches", type=int, nargs="*", default=[1, 32], help="batches of the tp_draft workload")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--reps", type=int, default=20, help="replays per timed sample")
    args = parser.parse_args(argv)
    if args.quick:
        args.vocabs, args.batches, args.ks, args.draft_batches, args.samples = [128256], [1, 32], [1, 4], [1], 15
    return args


# ---- the ranks agree on everything through a gloo group (NCCL stays for the drafts' collectives) ----


class Control:
    def __init__(self, budget_s: float) -> None:
        self.group = dist.new_group(backend="gloo")
        self.start, self.budget_s = time.perf_counter(), budget_s

    def go(self) -> bool:
        """Rank 0's decision whether to start another row, the same on every rank."""
        decision = [time.perf_counter() - self.start < self.budget_s]
        dist.broadcast_object_list(decision, src=0, group=self.group)
        return bool(decision[0])

    def errors(self, error: str | None) -> str | None:
        """Every rank's error of the last step, joined ('' parts dropped); None if all went well."""
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, error, group=self.group)
        text = "; ".join(f"rank {r}: {e}" for r, e in enumerate(found) if e)
        return text or None


def attempt(step) -> tuple[object, str | None]:
    try:
        return step(), None
    except Exception as exc:  # recorded in the row
        traceback.print_exc()
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


# ---- measuring ----


def time_alternating(calls: dict[str, object], samples: int, reps: int) -> dict[str, dict[str, float]]:
    """µs per call of each of `calls`: per sample, `reps` calls back to back between two CUDA events;
    the variants alternate sample by sample."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(samples):
        for name, call in calls.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                call()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / reps)
    return {name: summary(t) for name, t in times.items()}


def graph_launches(call, calls: int = 5) -> float:
    """CUDA graph launches per call: the runtime's cudaGraphLaunch events (the driver's cuGraphLaunch
    only where no runtime event was recorded: one launch is not counted twice)."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    runtime = sum(1 for n in names if n.startswith("cudaGraphLaunch"))
    return (runtime or sum(1 for n in names if n.startswith("cuGraphLaunch"))) / calls


def same_tokens(ids: torch.Tensor, want: torch.Tensor, full: torch.Tensor) -> tuple[bool, bool]:
    """(match, exact): ids equal, or differing only where the logits they point at are equal."""
    exact = torch.equal(ids, want)
    return exact or torch.equal(full.gather(-1, ids), full.gather(-1, want)), exact


def measure(control: Control, rows: dict[str, dict], setup, state: dict, samples: int, reps: int) -> list[dict]:
    """Run `setup` (it compiles, checks tokens into `rows` and puts the calls in state["calls"]), then
    time and count launches; every rank agrees after each step, and an error on any rank goes into the
    rows instead of the figures."""
    _, error = attempt(setup)
    if (error := control.errors(error)) is None:
        timed, error = attempt(lambda: time_alternating(state["calls"], samples, reps))
        if (error := control.errors(error)) is None:
            for name, figures in timed.items():
                rows[name].update(figures, graph_launches_per_call=graph_launches(state["calls"][name]))
    for row in rows.values():
        if error:
            row["error"] = error
    state.clear()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return list(rows.values())


# ---- workload 1: the selection alone ----


def selection(k: int):
    def select(x):
        from torch.distributed import _functional_collectives as funcol

        full = funcol.all_gather_tensor(x, x.dim() - 1, dist.group.WORLD)
        return torch.softmax(full.float(), dim=-1).topk(k, dim=-1)

    return select


def selection_row(control: Control, vocab: int, batch: int, k: int, args, device: torch.device) -> list[dict]:
    tp, rank = dist.get_world_size(), dist.get_rank()
    base = {"workload": "tp_selection", "tp": tp, "vocab": vocab, "batch": batch, "k": k, "dtype": "bfloat16"}
    rows = {v: dict(base, variant=v) for v in (GATHER, DRAFTFUSE)}
    state: dict = {}

    def setup():
        generator = torch.Generator(device).manual_seed(batch * 7919 + vocab + k)
        full = torch.randn(batch, vocab, device=device, generator=generator).mul_(4).to(torch.bfloat16)
        shard = full.chunk(tp, dim=-1)[rank].contiguous()
        torch._dynamo.mark_static_address(shard)
        drafts = {
            GATHER: draftfuse.draft_loop(selection(k), zero_copy_outputs=True, options={"vocab_parallel": False, "softmax_topk": False}),
            DRAFTFUSE: draftfuse.draft_loop(selection(k), zero_copy_outputs=True),
        }
        want = torch.softmax(full.float(), dim=-1).topk(k, dim=-1).indices
        for name, draft in drafts.items():  # compile, warm up, record: then each call is one replay
            for _ in range(3):
                ids = draft(shard)[1]
            rows[name]["tokens_match"], rows[name]["tokens_exact"] = same_tokens(ids.clone(), want, full)
        state.update(shard=shard, calls={name: (lambda d=d: d(shard)) for name, d in drafts.items()})

    return measure(control, rows, setup, state, args.samples, args.reps)


# ---- workload 2: the TP example's whole draft ----


def draft_rows(control: Control, draft_name: str, batch: int, args, device: torch.device) -> list[dict]:
    examples = Path(__file__).resolve().parents[1] / "examples"
    sys.path.insert(0, str(examples))
    tp, rank = dist.get_world_size(), dist.get_rank()
    k = 1 if draft_name == "chain" else 4
    base = {"workload": "tp_draft", "draft": draft_name, "tp": tp, "vocab": 128256, "batch": batch, "k": k, "dtype": "bfloat16", "steps": 3}
    rows = {v: dict(base, variant=v) for v in ("gather path", DRAFTFUSE)}
    state: dict = {}

    def setup():
        import eagle_head
        import tp_draft
        from _common import _same_tokens, parse_args

        ex_args = parse_args("", ["--device", "cuda", "--size", "reference", "--batch", str(batch)], eagle_head._add_arguments)
        ex_args.device = device
        head, token, hidden, pos = eagle_head._inputs(ex_args)
        sharded = tp_draft._with_lm_head(head, tp_draft.GatheredLMHead(head.lm_head, rank, tp).to(device))
        fn = eagle_head.draft_chain if draft_name == "chain" else eagle_head.draft_tree
        kwargs = {"steps": 3} if draft_name == "chain" else {"steps": 3, "k": 4}
        drafts = {
            "gather path": draftfuse.draft_loop(fn, zero_copy_outputs=True, options={"vocab_parallel": False, "softmax_topk": False}),
            DRAFTFUSE: draftfuse.draft_loop(fn, zero_copy_outputs=True),
        }
        outs = {}
        for name, draft in drafts.items():
            for _ in range(3):
                out = draft(sharded, token, hidden, pos, **kwargs)
            outs[name] = [t.clone() for t in (out if isinstance(out, tuple) else (out,))]
        match = _same_tokens(outs[DRAFTFUSE], outs["gather path"])
        for row in rows.values():
            row["tokens_match"] = match
        state["calls"] = {name: (lambda d=d: d(sharded, token, hidden, pos, **kwargs)) for name, d in drafts.items()}

    return measure(control, rows, setup, state, max(10, args.samples // 2), 5)


# ---- the run ----


def plan(args) -> list[tuple]:
    early = [b for b in args.batches if b in EARLY_BATCHES] or args.batches
    late = [b for b in args.batches if b not in early]
    steps = [("selection", v, b, k) for b in early for v in args.vocabs for k in args.ks]
    steps += [("draft", name, b) for b in args.draft_batches for name in (("chain",) if args.quick else ("chain", "tree"))]
    steps += [("selection", v, b, k) for b in late for v in args.vocabs for k in args.ks]
    return steps


def table(rows: list[dict]) -> str:
    lines = ["workload      vocab    batch  k  variant                    median_us   p10_us   p90_us  launches  tokens"]
    for r in rows:
        name = r["workload"] + (f":{r['draft']}" if "draft" in r else "")
        if "median_us" in r:
            figures = f"{r['median_us']:9.1f} {r['p10_us']:8.1f} {r['p90_us']:8.1f} {r.get('graph_launches_per_call', float('nan')):9g}"
        else:
            figures = f"{'skipped (budget)' if r.get('skipped') else 'error':>36}"
        tokens = {True: "same", False: "DIFFERENT"}.get(r.get("tokens_match"), "-")
        lines.append(f"{name:13} {r['vocab']:6} {r['batch']:8} {r['k']:2}  {r['variant']:24} {figures}  {tokens}")
    medians: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if "median_us" in r:
            key = (r["workload"] + (f":{r['draft']}" if "draft" in r else ""), r["vocab"], r["batch"], r["k"])
            medians.setdefault(key, {})[r["variant"]] = r["median_us"]
    ratios = [
        f"  {name} V={vocab} B={batch} k={k}: {times.get(GATHER, times.get('gather path')) / times[DRAFTFUSE]:.2f}x"
        for (name, vocab, batch, k), times in medians.items()
        if DRAFTFUSE in times and (GATHER in times or "gather path" in times)
    ]
    return "\n".join([*lines, "", "gather path / draftfuse (median):", *ratios])


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=device)
    control = Control(args.budget_s)
    rank, rows = dist.get_rank(), []
    try:
        for step in plan(args):
            if not control.go():
                tp = dist.get_world_size()
                if step[0] == "selection":
                    rows += [{"workload": "tp_selection", "tp": tp, "vocab": step[1], "batch": step[2], "k": step[3],
                              "dtype": "bfloat16", "variant": v, "skipped": "budget"} for v in (GATHER, DRAFTFUSE)]
                else:
                    rows += [{"workload": "tp_draft", "draft": step[1], "tp": tp, "vocab": 128256, "batch": step[2],
                              "k": 1 if step[1] == "chain" else 4, "dtype": "bfloat16", "variant": v, "skipped": "budget"}
                             for v in ("gather path", DRAFTFUSE)]  # fmt: skip
                continue
            if step[0] == "selection":
                rows += selection_row(control, *step[1:], args, device)
            else:
                rows += draft_rows(control, step[1], step[2], args, device)
            if rank == 0:
                print(f"[{time.perf_counter() - control.start:6.0f} s] {step}: {[r.get('median_us', r.get('error', '')) for r in rows[-2:]]}", flush=True)
    finally:
        if rank == 0:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device), "tp": dist.get_world_size(),
                    "elapsed_s": time.perf_counter() - control.start, "args": {k: v for k, v in vars(args).items()}}  # fmt: skip
            path = out / f"{results_name(meta['device'])}_tp.json"  # h200_tp.json on an H200, as report.py reads
            path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            print(table(rows))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
