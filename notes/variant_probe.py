"""Selection kernels from copies of their module files against the package's, side by side in one process on
a GPU, with a temperature tensor and without: the probe for a kernel change before it lands.

    python notes/variant_probe.py --k1 NAME=path/_triton_argmax.py ... --topk NAME=path/_triton_selection.py ...
        [--points k1:bfloat16:128256:32 topk:bfloat16:32000:8 ...] [--ks 4 16] [--out probe.json] [--budget-s 200]

A variant file is a whole copy of the module (it may import the package's other kernel modules); a variant
`NAME=package:maxnreg=80` is the package's kernel launched with that keyword of launch_selection. Each point:
µs per call in a CUDA graph (draftfuse._measure.time_in_graph: inputs rotated over 3x the L2), the variants
taking turns (--rounds rounds of 10 replays), each variant's tokens and probabilities checked against the
reference first. The package's own kernel is the variant "package".
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

ATTRIBUTE = {"k1": "_argmax_kernel", "topk": "_selection_kernel"}


def load(name: str, path: str, kind: str):
    spec = importlib.util.spec_from_file_location(f"variant_{kind}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, ATTRIBUTE[kind])


def launcher(kind: str, kernel, k: int, scale: torch.Tensor | None, **options):
    """launch_selection with `kernel` in place of the package's and `options` (by default the plan's own
    programs per SM, passed so that no ready launch of another variant is reused)."""

    def call(x):
        prob = torch.empty(x.shape[0], k, device=x.device)
        index = torch.empty(x.shape[0], k, device=x.device, dtype=torch.int64)
        kept = getattr(_triton_launch, ATTRIBUTE[kind])
        setattr(_triton_launch, ATTRIBUTE[kind], kernel)
        try:
            per_sm = _triton_launch.default_programs_per_sm(x.element_size(), k, scale is not None)
            _triton_launch.launch_selection(x, k, False, prob, index, scale, **{"programs_per_sm": per_sm, **options})
        finally:
            setattr(_triton_launch, ATTRIBUTE[kind], kept)
        return prob, index

    return call


def measure(calls: dict, inputs: list[torch.Tensor], k: int, scale: torch.Tensor | None, rounds: int) -> tuple[dict, list]:
    """(median µs per call of each call, the names of those whose tokens or probabilities were wrong)."""
    want_prob, want_index = topk_prob_reference(inputs[0], k, scale=scale)
    wrong = []
    for name, call in calls.items():
        prob, index = call(inputs[0])
        if not torch.equal(index, want_index) or not torch.allclose(prob, want_prob, rtol=2e-5, atol=1e-7):
            wrong.append(name)
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name] += _measure.time_in_graph(call, inputs, 10)
    return {name: _measure.summary(s)["median_us"] for name, s in samples.items()}, wrong


def run(points: list[tuple[str, str, int, int]], variants: dict, ks: list[int], rounds: int, budget_s: float) -> list[dict]:
    """Every (kind, dtype, vocab, batch) point, with and without a temperature tensor, its kind's variants
    ({kind: {name: (kernel, launch options)}}) taking turns; a row per point, k and scale, printed as it is measured."""
    start, device, rows = time.time(), torch.device("cuda"), []
    for kind, dtype_name, vocab, batch in points:
        if time.time() - start > budget_s:
            print("budget: stopping before", (kind, dtype_name, vocab, batch), flush=True)
            break
        dtype = getattr(torch, dtype_name)
        buffers = _measure.rotation_count(batch * vocab * dtype.itemsize, device)
        inputs = [(torch.randn(batch, vocab, device=device) * 4).to(dtype) for _ in range(buffers)]
        t = torch.rand(batch, device=device) + 0.5  # temperatures 0.5-1.5, as SGLang's per-request ones
        for k in [1] if kind == "k1" else ks:
            for scale in (None, 1 / t):
                calls = {name: launcher(kind, kernel, k, scale, **options) for name, (kernel, options) in variants[kind].items()}
                times, wrong = measure(calls, inputs, k, scale, rounds)
                row = {"kind": kind, "dtype": dtype_name, "vocab": vocab, "batch": batch, "k": k, "scaled": scale is not None,
                       **{f"{n}_us": v for n, v in times.items()}, "wrong": wrong}
                rows.append(row)
                print(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    return rows


def summarize(rows: list[dict], kind: str, name: str, base: str) -> None:
    for scaled in (False, True):
        ratios = sorted(r[f"{name}_us"] / r[f"{base}_us"] for r in rows if r["kind"] == kind and r["scaled"] == scaled)
        if ratios:
            print(f"{kind} {name} / {base} {'scaled' if scaled else 'plain '}: median {ratios[len(ratios) // 2]:.3f}, "
                  f"min {ratios[0]:.3f}, max {ratios[-1]:.3f} ({len(ratios)} points)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k1", nargs="*", default=[], help="NAME=path of a copy of _triton_argmax.py")
    parser.add_argument("--topk", nargs="*", default=[], help="NAME=path of a copy of _triton_selection.py")
    parser.add_argument("--points", nargs="+", required=True, help="kind:dtype:vocab:batch, kind k1 or topk")
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()
    variants = {kind: {"package": (getattr(_triton_launch, ATTRIBUTE[kind]), {})} for kind in ATTRIBUTE}
    for kind in ATTRIBUTE:
        for spec in getattr(args, kind):
            name, path = spec.split("=", 1)
            if path.startswith("package:"):  # the package's kernel, other launch keywords (maxnreg=80)
                options = {key: int(value) for key, value in (item.split("=") for item in path.split(":")[1:])}
                variants[kind][name] = (variants[kind]["package"][0], options)
            else:
                variants[kind][name] = (load(name, path, kind), {})
    points = [(kind, dtype, int(vocab), int(batch)) for kind, dtype, vocab, batch in (p.split(":") for p in args.points)]
    rows = run(points, variants, args.ks, args.rounds, args.budget_s)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    for kind in ATTRIBUTE:
        for name in variants[kind]:
            if name != "package":
                summarize(rows, kind, name, "package")
    print("wrong:", [r for r in rows if r["wrong"]])


if __name__ == "__main__":
    main()
