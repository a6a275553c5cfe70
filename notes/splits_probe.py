"""Up to 256 chunks a row (the committed planner) against the old cap of 128, side by side in one process
on a GPU, at the points where the two plans differ (batch 1 and 8, vocab >= 128256): shorter chunks, so a
shorter chain of tile loads per program, against a merge of up to 256 partials. Result: notes/kernels.md
("256 chunks a row"), raw figures in notes/splits_probe_h200.json.

Each point: µs per call in a CUDA graph (inputs rotated over 3x the L2), 3 rounds of 10 replays, the two
variants' order alternating between rounds; both checked against the reference on the same logits, and
on special rows (NaN, inf, ties) split into 200 chunks. Usage (GPU):

    python notes/splits_probe.py [--out probe.json] [--budget-s 100]
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
from draftfuse.kernels import _triton_launch, topk_prob_reference  # noqa: E402
from tests.test_kernels import check_selection, special_rows, special_scales  # noqa: E402


_READY = {}  # each cap's ready launches: they hold the plan the caps gave, and the caps are not in their key


def launcher(k, cap):
    def call(x):
        prob = torch.empty(x.shape[0], k, device=x.device)
        index = torch.empty(x.shape[0], k, device=x.device, dtype=torch.int64)
        saved = _triton_launch._MAX_SPLITS, _triton_launch._TOPK_SPLITS, _triton_launch._ready
        _triton_launch._MAX_SPLITS = _triton_launch._TOPK_SPLITS = cap  # the planner's caps (a launch captured in a graph plans once)
        _triton_launch._ready = _READY.setdefault(cap, {})
        try:
            _triton_launch.launch_selection(x, k, False, prob, index, None)
        finally:
            _triton_launch._MAX_SPLITS, _triton_launch._TOPK_SPLITS, _triton_launch._ready = saved
        return prob, index

    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--budget-s", type=float, default=100)
    args = parser.parse_args()
    start = time.time()
    device = torch.device("cuda")
    failures = []
    for dtype in (torch.bfloat16, torch.float32):
        x = special_rows(40000, dtype, "cuda")
        for k in (1, 4, 16):
            for scale in (None, special_scales(x.shape[0], "cuda")):
                prob, index = torch.empty(x.shape[0], k, device="cuda"), torch.empty(x.shape[0], k, device="cuda", dtype=torch.int64)
                _triton_launch.launch_selection(x, k, False, prob, index, scale, splits=200, block=256)
                if problem := check_selection(x, k, False, prob, index, scale):
                    failures.append(f"special rows {dtype} k={k} scaled={scale is not None}: {problem}")
    print(f"special rows in 157 chunks: {len(failures)} failures {failures[:3]}", flush=True)
    bandwidth = _measure.copy_bandwidth(device)
    rows = []
    variants = {"cap 128": 128, "cap 256": 256}
    for dtype in (torch.bfloat16, torch.float32):
        for vocab in (128256, 151936, 262144):
            for batch in (1, 8):
                if time.time() - start > args.budget_s:
                    print("budget: stopping", flush=True)
                    break
                nbytes = batch * vocab * dtype.itemsize
                inputs = [(torch.randn(batch, vocab, device=device) * 4).to(dtype) for _ in range(_measure.rotation_count(nbytes, device))]
                floor_us = nbytes / bandwidth * 1e6
                for k in (1, 4, 16):
                    calls = {name: launcher(k, cap) for name, cap in variants.items()}
                    want_prob, want_index = topk_prob_reference(inputs[0], k)
                    wrong = [n for n, c in calls.items() if not (lambda p, i: torch.equal(i, want_index) and torch.allclose(p, want_prob, rtol=2e-5, atol=1e-7))(*c(inputs[0]))]
                    samples = {name: [] for name in calls}
                    for round_ in range(4):  # the order alternates
                        for name in (list(calls) if round_ % 2 == 0 else list(calls)[::-1]):
                            samples[name] += _measure.time_in_graph(calls[name], inputs, 10)
                    times = {name: _measure.summary(s)["median_us"] for name, s in samples.items()}
                    limit, _ = selection_limit(k, batch, floor_us)
                    row = {"dtype": str(dtype).split(".")[1], "vocab": vocab, "batch": batch, "k": k, "floor_us": floor_us,
                           "limit_us": limit, **{f"{n}_us": t for n, t in times.items()}, "wrong": wrong}
                    rows.append(row)
                    print(f"{row['dtype']:8} {vocab:6} {batch:3} {k:2} | limit {limit:5.2f} | 128: {times['cap 128']:6.2f} | "
                          f"256: {times['cap 256']:6.2f} | {times['cap 256'] / times['cap 128']:.3f}" + (f" WRONG {wrong}" if wrong else ""), flush=True)
                    if args.out:  # after every point: a run cut short keeps what it measured
                        Path(args.out).write_text(json.dumps({"special_row_failures": failures, "rows": rows}, indent=1))
    for n in variants:
        print(f"{n}: time target met at {sum(r[n + '_us'] <= r['limit_us'] for r in rows)}/{len(rows)}")


if __name__ == "__main__":
    main()
