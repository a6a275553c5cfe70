"""The seam marker's guards on a GPU host: the MTP draft (benchmarks/_drafts.py, reference size) folded
twice in one process, once with the marker as it is (tuples walked by draftfuse) and once with the
marker it replaced (torch's pytree, traced by Dynamo: 23 more guards of pytree's module state), timed in
turns: Dynamo's guard check alone (perf_counter, no GPU work) and host µs per call with the GPU kept busy
(draftfuse._measure.host_times, the benchmark's method). Usage (GPU): python notes/seam_host_probe.py
"""

import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import draftfuse.runtime.fold as fold_module  # noqa: E402
from benchmarks import _drafts  # noqa: E402
from draftfuse import _measure  # noqa: E402
from draftfuse.passes.seed_fold.seam import mark_seam_by_pytree  # noqa: E402
from draftfuse.runtime.draft_loop import DraftLoop  # noqa: E402


def folded(marker, batch, device):
    fold_module.mark_seam = marker
    work = _drafts.build_mtp("reference" if device.type == "cuda" else "tiny", batch, device,
                             torch.bfloat16 if device.type == "cuda" else torch.float32)
    before = {id(o) for o in gc.get_objects() if type(o) is DraftLoop}
    call = work.variants["draftfuse"]()
    for _ in range(4):
        call()
    loop = next(o for o in gc.get_objects() if type(o) is DraftLoop and id(o) not in before and o._replays)
    seen = {}
    bind = loop._bind
    loop._bind = lambda args, kwargs: seen.setdefault("f_locals", bind(args, kwargs))
    call()
    loop._bind = bind
    replay = loop._replays[0]
    guards = sum(len(n.get_leaf_guards()) for n in _nodes(replay.guard.root))
    return call, replay.guard, seen["f_locals"], guards


def _nodes(root):
    stack, found = [root], []
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(node.get_child_managers())
        if hasattr(node, "get_key_value_managers"):
            stack.extend(m for pair in node.get_key_value_managers().values() for m in pair if m is not None)
    return found


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    original = fold_module.mark_seam
    rows = []
    for batch in (1, 32):
        variants = {"walked": folded(original, batch, device), "pytree": folded(mark_seam_by_pytree, batch, device)}
        fold_module.mark_seam = original
        guard_us = {name: [] for name in variants}
        with torch.no_grad():
            for _ in range(15):
                for name, (_, guard, f_locals, _) in variants.items():
                    start = time.perf_counter()
                    for _ in range(2000):
                        guard.check(f_locals)
                    guard_us[name].append((time.perf_counter() - start) / 2000 * 1e6)
        row = {"batch": batch, **{f"{n} guards": v[3] for n, v in variants.items()},
               **{f"{n} guard check us": sorted(t)[len(t) // 2] for n, t in guard_us.items()}}
        if device.type == "cuda":
            host = _measure.host_times({n: v[0] for n, v in variants.items()}, device, batches=9)
            row.update({f"{n} host us": t.us_per_call for n, t in host.items()})
        rows.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
