#!/usr/bin/env bash
# Device call C (1 GPU): every cuda-marked test (but the slow tiling sweep), then the draft workloads at
# batch 1, 32, 8 and 64 (what fits the budget), all variants, host time with the device kept busy.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
timeout 200 python3 -m pytest -m cuda -q -p no:cacheprovider --tb=short -k "not test_cuda_other_tilings" tests \
  > "$OUT/cuda_tests.log" 2>&1; echo "cuda tests exit $?" >> "$OUT/cuda_tests.log"
timeout 320 python3 benchmarks/run.py --only mtp eagle draft_model --batches 1,32,8,64 --rounds 50 --no-warm-compile \
  --budget-s 250 --out "$OUT/drafts" > "$OUT/drafts.log" 2>&1; echo "drafts exit $?" >> "$OUT/drafts.log"
grep -E "passed|failed|exit|^E |FAILED" "$OUT/cuda_tests.log" | head -30
grep -E "exit|wrote|skipped|Error" "$OUT/drafts.log" | tail -n 8
