"""Why a draft's calls do or do not take draft_loop's fast replay, and their host cost: one workload of
benchmarks/_drafts.py at reference size, with draftfuse's debug log on. Usage on a GPU:
    python3 scripts/replay_diag.py draft_model 1
"""

import logging
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks import _drafts  # noqa: E402
from draftfuse._measure import host_time  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="%(message)s")
logging.getLogger("draftfuse").setLevel(logging.DEBUG)
name, batch = sys.argv[1], int(sys.argv[2])
device = torch.device("cuda")
workload = _drafts.WORKLOADS[name]("reference", batch, device, torch.bfloat16)
for variant in ("raw_cuda_graph", "draftfuse"):
    call = workload.variants[variant]()
    for i in range(4):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        print(f"{variant} call {i}: {(time.perf_counter() - start) * 1e3:.2f} ms")
    print(variant, "host us per call:", host_time(call, device))
