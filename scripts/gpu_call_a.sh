#!/usr/bin/env bash
# One device call (2 GPUs, < 10 min): the cuda-marked tests, then the draft workloads at batch 1 and 32 on
# GPU 0, while the selection grid runs on GPU 1. Logs and results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
(
  CUDA_VISIBLE_DEVICES=0 timeout 250 python3 -m pytest -m cuda -q -p no:cacheprovider -rfE tests > "$OUT/cuda_tests.log" 2>&1
  echo "cuda tests exit $?" >> "$OUT/cuda_tests.log"
  CUDA_VISIBLE_DEVICES=0 timeout 260 python3 benchmarks/run.py --only mtp eagle draft_model --batches 1,32 --rounds 60 --no-warm-compile --budget-s 230 --out "$OUT/drafts" > "$OUT/drafts.log" 2>&1
  echo "drafts exit $?" >> "$OUT/drafts.log"
) &
CUDA_VISIBLE_DEVICES=1 timeout 500 python3 benchmarks/run.py --only selection --budget-s 420 --out "$OUT/selection" > "$OUT/selection.log" 2>&1 &
wait
tail -n 30 "$OUT/cuda_tests.log"
grep -E "exit|wrote|skipped|Error" "$OUT/drafts.log" | tail -n 12
grep -E "exit|wrote|skipped|Error" "$OUT/selection.log" | tail -n 5
