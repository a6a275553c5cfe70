"""Does a torch.profiler session (benchmarks count launches with one) slow the host calls that follow it?

Each setting runs in a process of its own: host µs per call (draftfuse._measure.host_times, the GPU kept
busy) of a CUDA graph replay (20 small kernels) and of one eager op, before any profiling, after one
_measure.count_launches, and after a second (the second CUPTI start after a teardown is where torch's
source says CUDA graphs used to crash). Settings: the environment as is, and TEARDOWN_CUPTI=1 (Kineto
finalises CUPTI when a profiling session ends). Usage (GPU): python notes/cupti_probe.py [--out PATH]
"""

import argparse
import json
import os
import subprocess
import sys

SETTINGS = {"default": {}, "TEARDOWN_CUPTI=1": {"TEARDOWN_CUPTI": "1"}}


def child() -> dict:
    import torch

    from draftfuse import _measure

    device = torch.device("cuda")
    x = torch.zeros(1024, device=device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)  # warm-up off the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(20):
                x.add_(1)
    calls = {"graph.replay()": graph.replay, "eager x.add_(1)": lambda: x.add_(1)}
    out = {}
    for stage in ("before profiling", "after one profiler session", "after two"):
        if stage != "before profiling":
            _measure.count_launches(calls, 5)
        times = _measure.host_times(calls, device, batches=7)
        out[stage] = {name: t.us_per_call for name, t in times.items()}
    torch.cuda.synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the figures here as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child()))
        return
    results = {}
    for name, env in SETTINGS.items():
        done = subprocess.run(
            [sys.executable, __file__, "--child"], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
        )
        lines = done.stdout.strip().splitlines()
        results[name] = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-2000:]}
        print(name, json.dumps(results[name], indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
