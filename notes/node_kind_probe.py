"""Which graph nodes cost the host time of a CUDA graph replay: notes/launch_probe.py found a replay of 1 to
192 small aten kernels (memsets among them or not) at ~5 µs of host time, while the MTP draft's recorded
graph (83 kernels + 8 memsets) replays in 13-21 µs. Here graphs of 48 nodes of one kind each (and of
all kinds in turn), host µs per `graph.replay()` (draftfuse._measure.host_times: the GPU kept busy), all
taking turns, beside the MTP draft's graphs (benchmarks/_drafts.py, reference size, bf16, batch 1:
draftfuse's recording and the raw runner's), and the kernels one replay of draftfuse's MTP graph runs, by name (a torch.profiler trace, last).
Usage (GPU): python notes/node_kind_probe.py [--out probe.json] [--only SUBSTRING ...] [--no-mtp]
(--only: the kinds whose names hold one of the substrings; --no-mtp: no MTP draft built or timed)
"""

import argparse
import collections
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import draftfuse  # noqa: E402, F401  (torch.ops.draftfuse)
from draftfuse import _measure  # noqa: E402
from draftfuse.kernels import _triton_launch  # noqa: E402

NODES = 48


def captured(op) -> torch.cuda.CUDAGraph:
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            op()  # compiles, warms the allocator and cuBLAS's workspace
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(NODES):
                op()
    return graph


def kernels_of(graph) -> dict[str, int]:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    names = collections.Counter(e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return dict(names.most_common())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--only", nargs="+", help="only the kinds whose names hold one of these")
    parser.add_argument("--no-mtp", action="store_true", help="without the MTP draft's graphs")
    args = parser.parse_args()
    device = torch.device("cuda")
    bf = dict(device=device, dtype=torch.bfloat16)
    x = torch.zeros(1024, device=device)
    a1, a32, w = torch.randn(1, 1024, **bf), torch.randn(32, 1024, **bf), torch.randn(4096, 1024, **bf)
    q, kv = torch.randn(1, 8, 1, 64, **bf), torch.randn(1, 8, 512, 64, **bf)
    logits = torch.randn(1, 32000, **bf)
    prob, index = torch.empty(1, 1, device=device), torch.empty(1, 1, device=device, dtype=torch.int64)
    fused = torch.compile(lambda t: (t * 2 + 1).relu_(), dynamic=False)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn_sdpa():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q16, kv16, kv16)

    q16, kv16 = torch.randn(1, 16, 1, 128, **bf), torch.randn(1, 16, 1024, 128, **bf)
    a4k, w_tall = torch.randn(1, 4096, **bf), torch.randn(1024, 4096, **bf)
    # MTP's attention at batch 1 (examples/mtp_frozen_kv.py, reference size): 8 KV heads of 4 queries each over a
    # frozen cache of 2048 keys, a boolean mask; on the H200 its graph runs cuDNN's sm90 flash kernel there
    q_mtp, kv_mtp = torch.randn(1, 8, 4, 128, **bf), torch.randn(1, 8, 2048, 128, **bf)
    mask_mtp = (torch.arange(2048, device=device) < 1024)[None, None, None, :]
    bias_mtp = torch.zeros(mask_mtp.shape, **bf).masked_fill_(~mask_mtp, float("-inf"))
    distinct = [torch.compile(lambda t, c=c: (t * c + 1).relu_(), dynamic=False) for c in range(2, 10)]
    turn = [0]

    def in_turn(fns):
        def op():
            turn[0] += 1
            return fns[turn[0] % len(fns)]()
        return op

    ops = {
        "aten add_": lambda: x.add_(1),
        "linear bf16 [1, 1024] x [4096, 1024] (cuBLAS)": lambda: F.linear(a1, w),
        "linear bf16 [32, 1024] x [4096, 1024] (cuBLAS)": lambda: F.linear(a32, w),
        "sdpa bf16, 1 query, 512 keys": lambda: F.scaled_dot_product_attention(q, kv, kv),
        "Inductor Triton kernel": lambda: fused(x),
        "selection kernel, PDL": lambda: _triton_launch.launch_selection(logits, 1, False, prob, index, pdl=True),
        "selection kernel, no PDL": lambda: _triton_launch.launch_selection(logits, 1, False, prob, index, pdl=False),
        "cuDNN sdpa bf16, 1 query, 1024 keys": cudnn_sdpa,
        "linear bf16 [1, 4096] x [1024, 4096] (split-K?)": lambda: F.linear(a4k, w_tall),
        "8 Inductor kernels in turn": in_turn([lambda f=f: f(x) for f in distinct]),
        "MTP's masked sdpa bf16, 8 x 4 queries, 2048 keys": lambda: F.scaled_dot_product_attention(q_mtp, kv_mtp, kv_mtp, attn_mask=mask_mtp),
        # taken apart: the attention with its mask already additive (no conversion kernels), without a mask,
        # and the conversion's kernels alone (the bool mask to a bf16 bias)
        "MTP's sdpa, additive bf16 mask": lambda: F.scaled_dot_product_attention(q_mtp, kv_mtp, kv_mtp, attn_mask=bias_mtp),
        "MTP's sdpa, no mask": lambda: F.scaled_dot_product_attention(q_mtp, kv_mtp, kv_mtp),
        "MTP's mask to a bias alone": lambda: torch.zeros_like(mask_mtp, dtype=torch.bfloat16).masked_fill_(~mask_mtp, float("-inf")),
    }
    if args.only:
        ops = {name: op for name, op in ops.items() if any(s in name for s in args.only)}
    if "8 Inductor kernels in turn" in ops:
        for f in distinct:
            f(x)  # compiled before any capture
    graphs, failed = {}, {}
    for name, op in ops.items():
        try:
            graphs[name] = captured(op)
        except Exception as error:  # a kind this torch build can't run here (cuDNN attention, say)
            failed[name] = repr(error)[:300]
    graphs["every kind above in turn"] = captured(in_turn([ops[name] for name in list(graphs)]))
    calls = {f"{name} x {NODES}": g.replay for name, g in graphs.items()}
    if not args.no_mtp:  # the MTP draft's graphs at batch 1, its calls kept alive (their static buffers)
        from host_breakdown import recorded

        raw, raw_graph, ours, loop = recorded("mtp", 1, device)
        calls["mtp: draftfuse's recording"] = loop._replays[0].recorder.graph.replay
        calls["mtp: the raw runner's graph"] = raw_graph.replay
    torch.cuda.synchronize()
    out = {"host us per replay": {k: t.us_per_call for k, t in _measure.host_times(calls, device, batches=9).items()}, "failed": failed}
    print(json.dumps(out, indent=1), flush=True)
    out["kernels of each probe graph"] = {name: kernels_of(g) for name, g in graphs.items()}
    for name, replay in calls.items():
        if name.startswith("mtp: "):
            out[f"kernels in one replay of {name[5:]}"] = kernels_of(replay.__self__)
    print(json.dumps(out, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
