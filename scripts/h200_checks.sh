#!/usr/bin/env bash
# The GPU checks of the README, in one go: the cuda-marked tests, then every example and the demo at
# reference size. Each step has a time limit so that one slow step cannot starve the others; logs go
# to $OUT (or ./gpu-logs). Run from the repository root on a CUDA machine with torch, triton, pytest,
# hypothesis and expecttest installed.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-gpu-logs}"; mkdir -p "$out"
step() {  # step NAME SECONDS COMMAND...: run it, keep its log, report its exit status
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - start))s"
    tail -n "${TAIL:-25}" "$out/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step cuda_tests 900 python3 -m pytest -m cuda -q -p no:cacheprovider -rA --tb=short tests
step mtp_frozen_kv 150 python3 examples/mtp_frozen_kv.py --device cuda --batch 1 8 32
step eagle_head 80 python3 examples/eagle_head.py --device cuda --size reference
step draft_model 60 python3 examples/draft_model.py --device cuda --size reference
step medusa_heads 40 python3 examples/medusa_heads.py --device cuda --size reference
step demo 60 python3 -m draftfuse demo --device cuda
