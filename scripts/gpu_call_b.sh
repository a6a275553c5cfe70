#!/usr/bin/env bash
# Device call B (1 GPU): the CUDA runtime tests and a failing kernel case, then the fast-replay
# diagnosis of the draft-model workload.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
timeout 190 python3 -m pytest -m cuda -q -p no:cacheprovider --tb=short \
  tests/test_runtime_cuda.py tests/test_fold.py tests/test_example_mtp.py tests/test_softmax_topk_cuda.py \
  "tests/test_kernels.py::test_cuda_kernels_match_reference[unscaled-1-bfloat16]" \
  "tests/test_kernels.py::test_cuda_graph_replay_recomputes" "tests/test_kernels.py::test_cuda_compiled_reduce_overhead" \
  > "$OUT/cuda_tests.log" 2>&1; echo "cuda tests exit $?" >> "$OUT/cuda_tests.log"
timeout 100 python3 scripts/replay_diag.py draft_model 1 > "$OUT/diag.log" 2>&1; echo "diag exit $?" >> "$OUT/diag.log"
grep -E "passed|failed|Error|error|assert|exit|^E " "$OUT/cuda_tests.log" | head -40
grep -vE "^\s*$" "$OUT/diag.log" | grep -v "^  " | tail -25
