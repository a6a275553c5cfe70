"""What the examples share: the command line, building a seeded model, and running one draft three ways
(eager, torch.compile with Inductor, draftfuse) to compare tokens, time per draft, and on a GPU the host
time per draft with the GPU kept busy and the CUDA graph replays (the measuring itself is
draftfuse/_measure.py's, shared with the benchmarks and `python -m draftfuse demo`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from _layers import SIZES, Config
from torch import nn

from draftfuse._measure import graph_replays_per_call, host_time, time_side_by_side
from draftfuse.runtime.draft_loop import draft_loop

# Both compiled versions use the mode servers use for draft loops; on a CPU the CUDA graphs are skipped.
MODE = "reduce-overhead"


def parse_args(description: str, argv: list[str] | None = None, add_arguments=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES), help="model size (default tiny)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 tiny, bfloat16 reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=30, help="timing rounds; 0 only checks the tokens")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    args.dtype = getattr(torch, args.dtype or ("float32" if args.size == "tiny" else "bfloat16"))
    args.config = SIZES[args.size]
    return args


def build(make: Callable[[Config], nn.Module], args: argparse.Namespace) -> nn.Module:
    """`make(config)` with seeded random weights, on the device, in the dtype, frozen."""
    torch.manual_seed(args.seed)
    with args.device:
        model = make(args.config)
    return model.to(args.dtype).requires_grad_(False)


def compare(label: str, draft: Callable, inputs: tuple, options: dict, args: argparse.Namespace) -> dict:
    """Run `draft(*inputs, **options)` eagerly, through torch.compile and through draftfuse; print and
    return how they compare: tokens, first-call (compile) seconds, and with `--rounds` time per draft.

    fp32 tokens must equal eager's exactly. In bf16 the reference is torch.compile (Inductor): draftfuse
    shares its kernels and rounding, while eager rounds differently, so eager is shown for information only.
    """
    # Without timing an fp32 check needs only eager and draftfuse: skip the extra compile.
    with_baseline = args.rounds > 0 or args.dtype != torch.float32
    runners = {"eager": draft}
    if with_baseline:
        runners["torch.compile"] = torch.compile(draft, mode=MODE, fullgraph=True)
    runners["draftfuse"] = draft_loop(draft, mode=MODE)

    outputs, compile_s = {}, {}
    with torch.no_grad():
        for name, run in runners.items():
            start = time.perf_counter()
            outputs[name] = _detached(run(*inputs, **options))  # the copy outlives the next CUDA graph replay
            compile_s[name] = time.perf_counter() - start
        reference = "eager" if args.dtype == torch.float32 else "torch.compile"
        result = {
            "tokens_match": _same_tokens(outputs["draftfuse"], outputs[reference]),
            "reference": reference,
            "max_score_diff": _max_float_diff(outputs["draftfuse"], outputs[reference]),
            "tokens_match_eager": _same_tokens(outputs["draftfuse"], outputs["eager"]),
            "first_call_s": {name: s for name, s in compile_s.items() if name != "eager"},
            "outputs": outputs["draftfuse"],
        }
        if args.rounds > 0:
            calls = {name: (lambda run=run: run(*inputs, **options)) for name, run in runners.items()}
            result["ms_per_draft"] = time_side_by_side(calls, args.device, args.rounds)
            if args.device.type == "cuda":
                result["graph_replays_per_draft"] = {
                    name: graph_replays_per_call(call) for name, call in calls.items() if name != "eager"
                }
                # Host time with the GPU kept busy behind a sleep: what a server's Python thread spends per draft.
                result["host_us_per_draft"] = {
                    name: host_time(call, args.device).us_per_call for name, call in calls.items()
                }
    _print_result(label, args, result)
    return result


def _flat(out) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


def _detached(out):
    return tuple(t.detach().clone() for t in _flat(out))


def _same_tokens(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b) if not x.is_floating_point())


def _max_float_diff(a, b) -> float:
    diffs = [(x.float() - y.float()).abs().max().item() for x, y in zip(a, b) if x.is_floating_point()]
    return max(diffs, default=0.0)


def _print_result(label: str, args: argparse.Namespace, result: dict) -> None:
    dtype = str(args.dtype).removeprefix("torch.")
    print(f"{label}: batch {args.batch}, {dtype} on {args.device} (size {args.size})")
    verdict = "same" if result["tokens_match"] else "DIFFERENT"
    if result["reference"] == "eager":
        print(f"  tokens, draftfuse vs eager (fp32, must be exact): {verdict}")
    else:
        eager = "same" if result["tokens_match_eager"] else "different"
        print(f"  tokens, draftfuse vs torch.compile (the bf16 reference: same Inductor rounding): {verdict}")
        print(f"  tokens, draftfuse vs eager (bf16, rounded differently, for information): {eager}")
    if result["max_score_diff"]:
        print(f"  scores, largest difference: {result['max_score_diff']:.3g}")
    compiles = " | ".join(f"{name} {s:.1f} s" for name, s in result["first_call_s"].items())
    print(f"  first call, compile included: {compiles}")
    if "ms_per_draft" in result:
        times = " | ".join(f"{name} {ms:.3f} ms" for name, ms in result["ms_per_draft"].items())
        print(f"  time per draft (median of {args.rounds}, alternating): {times}")
    if "host_us_per_draft" in result:
        hosts = " | ".join(
            f"{name} " + ("– (it waits on the device)" if us is None else f"{us:.1f} us")
            for name, us in result["host_us_per_draft"].items()
        )
        print(f"  host time per draft, GPU kept busy: {hosts}")
    if "graph_replays_per_draft" in result:
        replays = " | ".join(f"{name} {n:g}" for name, n in result["graph_replays_per_draft"].items())
        print(f"  CUDA graph replays per draft: {replays}")
