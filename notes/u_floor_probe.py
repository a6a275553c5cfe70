"""The k > 1 kernel before and after pass 2 compares u with a floor moved from y (`_u_floor`), side by side in
one process on a GPU, with a temperature tensor and without. Before, a scaled hit tile computed both
y = x * s and u = x * sign(s) and the order keys of both (sm_90 SASS, Triton 3.6: 868 instructions a hit
tile against 762 unscaled); after, u's key alone (776). Result: notes/kernels.md ("Pass 2 in u").

Each point: µs per call in a CUDA graph (draftfuse._measure.time_in_graph: inputs rotated over 3x the L2),
the variants taking turns (--rounds rounds of 10 replays, 3 by default), each variant's tokens and probabilities checked against
the reference first. The kernel before is loaded from a copy of its module file:

    git show <rev>:draftfuse/kernels/_triton_selection.py > gpu-logs/selection_before.py
    python notes/u_floor_probe.py --before gpu-logs/selection_before.py [--out probe.json] [--budget-s 150]
        [--dtypes bfloat16 float32] [--vocabs 32000 151936] [--batches 1 8 64 256] [--ks 4 16] [--rounds 3]
"""

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from draftfuse import _measure  # noqa: E402
from draftfuse.kernels import _triton_launch, topk_prob_reference  # noqa: E402


def load(path: str):
    spec = importlib.util.spec_from_file_location("selection_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._selection_kernel


def launcher(kernel, k: int, scale: torch.Tensor | None):
    """A call of launch_selection with `kernel` in place of the module's k > 1 kernel (the plan's own
    programs per SM, passed so that no ready launch of the other variant is reused)."""

    def call(x):
        prob = torch.empty(x.shape[0], k, device=x.device)
        index = torch.empty(x.shape[0], k, device=x.device, dtype=torch.int64)
        kept, _triton_launch._selection_kernel = _triton_launch._selection_kernel, kernel
        try:
            per_sm = _triton_launch.default_programs_per_sm(x.element_size(), k, scale is not None)
            _triton_launch.launch_selection(x, k, False, prob, index, scale, programs_per_sm=per_sm)
        finally:
            _triton_launch._selection_kernel = kept
        return prob, index

    return call


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
    variants = {"before": load(args.before), "u floor": _triton_launch._selection_kernel}
    start, device, rows = time.time(), torch.device("cuda"), []
    points = [(getattr(torch, d), v, b) for d in args.dtypes for v in args.vocabs for b in args.batches]
    for dtype, vocab, batch in points:
        if time.time() - start > args.budget_s:
            print("budget: stopping", flush=True)
            break
        buffers = _measure.rotation_count(batch * vocab * dtype.itemsize, device)
        inputs = [(torch.randn(batch, vocab, device=device) * 4).to(dtype) for _ in range(buffers)]
        t = torch.rand(batch, device=device) + 0.5  # temperatures 0.5-1.5, as SGLang's per-request ones
        for k in args.ks:
            for scale in (None, 1 / t):
                calls = {name: launcher(kernel, k, scale) for name, kernel in variants.items()}
                want_prob, want_index = topk_prob_reference(inputs[0], k, scale=scale)
                wrong = []
                for name, call in calls.items():
                    prob, index = call(inputs[0])
                    if not torch.equal(index, want_index) or not torch.allclose(prob, want_prob, rtol=2e-5, atol=1e-7):
                        wrong.append(name)
                samples = {name: [] for name in calls}
                for _ in range(args.rounds):
                    for name, call in calls.items():
                        samples[name] += _measure.time_in_graph(call, inputs, 10)
                times = {name: _measure.summary(s)["median_us"] for name, s in samples.items()}
                row = {"dtype": str(dtype).split(".")[1], "vocab": vocab, "batch": batch, "k": k,
                       "scaled": scale is not None, **{f"{n}_us": v for n, v in times.items()}, "wrong": wrong}
                rows.append(row)
                print(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    for scaled in (False, True):
        ratios = sorted(r["u floor_us"] / r["before_us"] for r in rows if r["scaled"] == scaled)
        if ratios:
            print(f"{'scaled' if scaled else 'plain '}: after / before median {ratios[len(ratios) // 2]:.3f}, "
                  f"min {ratios[0]:.3f}, max {ratios[-1]:.3f} ({len(ratios)} points)")
    print("wrong:", [r for r in rows if r["wrong"]])


if __name__ == "__main__":
    main()
