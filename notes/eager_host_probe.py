"""Host time of one eager selection call (no CUDA graph), and where it goes.

The benchmark's selection rows show draftfuse's ops at 104-305 µs of host time per eager call on the H200
host (median 140), where torch.argmax takes 8-19. This times, with the GPU kept busy (_measure.host_time), each layer
of an eager topk_prob / argmax_prob call at [8, 128256] bf16, the layers taking turns:
  op                 torch.ops.draftfuse.topk_prob(x, 4) (custom-op dispatch, checks, allocation, launch)
  op, full path      the same with the launcher's ready launches switched off (every call plans and goes
                     through Triton's JIT lookup, as before they existed)
  launcher           _triton_launch.launch_selection with outputs made beforehand (a ready launch)
  launcher, full     the same through the full path (a tuning keyword given, at its default value)
  triton launch      the JIT function's launch alone, with every argument made beforehand
  compiled launch    the compiled kernel's own launch (what a ready launch calls), every argument made
  torch.topk, torch.argmax   for scale
then a cProfile of 2000 op calls (the 15 costliest functions by own time). Usage (GPU):

    python notes/eager_host_probe.py [--out probe.json]
"""

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402

import draftfuse.kernels  # noqa: E402, F401
from draftfuse import _measure  # noqa: E402
from draftfuse.kernels import _triton_launch as launch  # noqa: E402


class _NoLaunches(dict):
    def get(self, key, default=None):
        return default

    def __setitem__(self, key, value):
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    x = torch.randn(8, 128256, device=device).to(torch.bfloat16)
    k = 4
    prob = torch.empty(8, k, device=device)
    index = torch.empty(8, k, device=device, dtype=torch.int64)
    splits, chunk, block = launch.plan(8, 128256, k, device, programs_per_sm=launch.default_programs_per_sm(2, k, False))
    part = torch.empty((8, 2, splits), dtype=torch.float32, device=device)
    keys = torch.empty((8, launch._CANDIDATES + k * splits), dtype=torch.int64, device=device)
    ws = launch._workspace(device, 8)
    record = max(32, triton.next_power_of_2(chunk // block))  # as launch_selection picks it
    kernel_args = (x, x.stride(0), 128256, chunk, splits, part, 0, part, keys, ws, prob, index, 0)
    meta = dict(K=k, CAND=launch._CANDIDATES, SORT=True, RECORD=record, BLOCK=block, V=8, HAS_SCALE=False, GPU=True,
                PDL=True, MERGE=128, num_warps=1, enable_fp_fusion=False, launch_pdl=True)
    compiled = launch._selection_kernel[(8, splits)](*kernel_args, **meta)
    consts = tuple(meta[name] for name in launch._selection_kernel.arg_names[len(kernel_args):])
    stream = torch.cuda.current_stream().cuda_stream

    def full_path(call):  # the call with no ready launch found (nor kept)
        def run():
            saved, launch._ready = launch._ready, _NoLaunches()
            try:
                return call()
            finally:
                launch._ready = saved
        return run

    per_sm = launch.default_programs_per_sm(2, k, False)
    calls = {
        "op topk_prob": lambda: torch.ops.draftfuse.topk_prob(x, k),
        "op topk_prob, full path": full_path(lambda: torch.ops.draftfuse.topk_prob(x, k)),
        "op argmax_prob": lambda: torch.ops.draftfuse.argmax_prob(x),
        "op argmax_prob, full path": full_path(lambda: torch.ops.draftfuse.argmax_prob(x)),
        "launcher": lambda: launch.launch_selection(x, k, False, prob, index),
        "launcher, full path": lambda: launch.launch_selection(x, k, False, prob, index, programs_per_sm=per_sm),
        "triton launch": lambda: launch._selection_kernel[(8, splits)](*kernel_args, **meta),
        "compiled launch": lambda: compiled[(8, splits, 1)](*kernel_args, *consts, stream=stream),
        "torch.topk": lambda: torch.topk(x, k),
        "torch.argmax": lambda: torch.argmax(x, -1),
        "torch.empty x2": lambda: (torch.empty(8, k, device=device), torch.empty(8, k, device=device)),
    }
    for call in calls.values():  # three calls: the op's third one finds its launch ready
        call(), call()
    for call in calls.values():
        call()
    torch.cuda.synchronize()
    times = _measure.host_times(calls, device, batches=7)
    out = {name: t.us_per_call for name, t in times.items()}
    for name, us in out.items():
        print(f"{name:26} {us:8.1f} µs" if us is not None else f"{name:26} -", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        torch.ops.draftfuse.topk_prob(x, k)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    print(text.getvalue())
    if args.out:
        Path(args.out).write_text(json.dumps({"host_us": out, "profile": text.getvalue()}, indent=1))


if __name__ == "__main__":
    main()
