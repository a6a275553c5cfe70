#!/usr/bin/env bash
# The benchmark on a GPU machine in one go, within 9 minutes: the three draft workloads at batch 1, 32, 8
# and 64 (all five variants, raw_cuda_graph included, with host_us_per_call), and the selection grid (vocab
# 32000/128256/151936/262144 x batch 1/8/32/64/256 x bf16/fp32, k 1/4/8/16, with and without a temperature
# tensor). Writes $OUT/bench/{drafts,selection}/NAME.json (one per process), merges them into
# $OUT/bench/NAME.{json,md,png} (NAME: h200 on an H200) and prints the target table last. Run from the
# repository root with torch and triton installed:  bash scripts/gpu_bench.sh
#
# Time (from run.py's budget logic: no unit starts after --budget-s, so a process ends by its budget plus
# its longest unit; every process is also under `timeout`):
#   drafts     a batch of a workload compiles four variants cold (H200, wave 1: ~5-7 s a compile for MTP,
#              6-9 s EAGLE, 8-12 s the draft model) and times five: ~28 / 32 / 44 s, so ~105 s per batch
#              over the three workloads, ~440 s for four batches with start-up and the warm compiles.
#   selection  40 logits shapes x 20 timed calls (each a CUDA graph of up to 64 calls, 30 replays) plus
#              Triton's JIT: ~4-5 s a shape, ~200-250 s.
# With 2 or more GPUs the two run at once (drafts on GPU 0 with --budget-s 400, selection on GPU 1): about
# 7.5 minutes. With one GPU they run one after the other with budgets (drafts 290 s, selection what is
# left): about 8.5 minutes, and the run lists what the budgets skipped (batch 64 of the drafts and part
# of the selection, likely); measure those in a second call with --only/--batches and merge with
# `python benchmarks/report.py A.json B.json --out DIR/NAME`.
# A dry run of this script's plumbing on a CPU (no GPU: the one-GPU path, tiny drafts):
#   OUT=/tmp/dry LIMIT_S=400 EXTRA_ARGS="--device cpu --size tiny --quick --rounds 3 --batches 2" bash scripts/gpu_bench.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-gpu-logs}/bench"
mkdir -p "$out"
limit=${LIMIT_S:-530}  # the whole script, seconds (the device call allows 540)
rounds=${ROUNDS:-100}
read -r -a extra <<< "${EXTRA_ARGS:-}"  # more run.py arguments for both processes (a CPU dry run: see below)
start=$SECONDS
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
gpus=0
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv
    gpus=$(nvidia-smi --list-gpus | wc -l)
fi

drafts=(python3 benchmarks/run.py --only mtp eagle draft_model --batches 1,32,8,64 --rounds "$rounds" --out "$out/drafts" "${extra[@]}")
selection=(python3 benchmarks/run.py --only selection --out "$out/selection" "${extra[@]}")
if [ "$gpus" -ge 2 ]; then
    echo "=== $gpus GPUs: drafts on GPU 0 and the selection on GPU 1, at the same time"
    CUDA_VISIBLE_DEVICES=0 timeout $((limit - 30)) "${drafts[@]}" --budget-s 400 > "$out/drafts.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout $((limit - 30)) "${selection[@]}" --budget-s 400 > "$out/selection.log" 2>&1 &
    wait
else
    echo "=== one GPU: the drafts, then the selection in the time left"
    timeout 360 "${drafts[@]}" --budget-s 290 > "$out/drafts.log" 2>&1
    left=$((limit - (SECONDS - start) - 25))
    timeout "$left" "${selection[@]}" --budget-s $((left - 25)) > "$out/selection.log" 2>&1
fi
for part in drafts selection; do
    echo "=== $part: $(grep -c ': start$' "$out/$part.log") units started; from $out/$part.log:"
    grep -E '^\[ *[0-9.]+ s\] .*(skipped \(time budget\)|wrote|failed)' "$out/$part.log" | cut -c1-1500
    echo "--- exceptions (count, first line):"
    grep -E '^[A-Za-z_.]*(Error|Exception):' "$out/$part.log" | cut -c1-300 | sort | uniq -c | sort -rn | head -n 5
done
shopt -s nullglob
files=("$out"/drafts/*.json "$out"/selection/*.json)
if [ ${#files[@]} -eq 0 ]; then
    echo "=== no results file was written: see the logs in $out"
    exit 1
fi
name=$(basename "${files[0]}" .json)
echo "=== done after $((SECONDS - start)) s; the whole report: $out/$name.md; its target table last:"
python3 benchmarks/report.py "${files[@]}" --out "$out/$name" --print targets
