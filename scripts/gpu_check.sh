#!/usr/bin/env bash
# The prepared GPU session: prove and measure the backends on one NVIDIA GPU (written for an H200).
# At most 10 minutes in all: every step's limit is cut to what is left of the deadline, and a step
# with no time left is reported as not run. Every step is a logprob-registry command or
# scripts/gpu_proof.py (public names and the CLI only):
#   1. info: nvidia-smi, python, torch, triton, `logprob-registry info`.
#   2. at once, none of them timed: `logprob-registry check --backend triton --device cuda` and
#      `--backend compiled` (the whole conformance suite, its sections included), and
#      scripts/gpu_proof.py: logits past 2**31 elements (8x4096x151936 bf16, a label in the last row
#      and column), a forward+backward step captured in a CUDA graph and replayed, batch invariance
#      of one row alone and in batches of 64 and 4096, on every eligible backend.
#   3. alone: `logprob-registry bench`, every eligible backend against the textbook baseline (time,
#      GB/s and % of the device's memory bandwidth, peak memory, error against float64), forward and
#      forward+backward: logprobs at 16x1024x32768 fp32 (the seed's shape) and 8x2048x151936 bf16,
#      triton's in-place backward there, logprobs_from_hidden at 8192 rows, H=4096, V=151936 bf16
#      (matmul + textbook, torch's linear_cross_entropy and the backends).
#   4. summary.md: the tables for docs/hardware.md (scripts/gpu_proof.py summary).
# Results in $OUT (default ./gpu_results), 7 files: info.txt, check.txt, proof.txt, proof.json,
# bench.txt, bench.json (every bench command's document merged), summary.md. Keep them in
# docs/gpu/. Exit status: non-zero when a check, a proof or a bench command failed or ran out of time.
#
#   bash scripts/gpu_check.sh                        # OUT=dir: where; PYTHON=python3.12: which Python
#   STEPS="proof bench" bash scripts/gpu_check.sh    # only these steps (info and summary always run)
#   QUICK=1 bash scripts/gpu_check.sh                # small shapes, a few tests (5 minutes at most): to
#                                                    # try this script; without a GPU it runs on the CPU
#                                                    # (DEVICE=cpu), triton through its interpreter
#
# Nothing is installed and no source is edited: the package runs from this checkout through
# PYTHONPATH with the machine's own torch, triton, pluggy and packaging (carry wheels if one is
# missing). When the machine's torch or triton is outside the versions the triton backend declares
# (the versions tested so far), the run sets LOGPROB_REGISTRY_UNTESTED_VERSIONS=triton, loudly,
# so that the backend runs there to be tested; `info` then shows the variable in force.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
QUICK=${QUICK:-}
STEPS=" ${STEPS:-check proof bench} "
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset LOGPROB_REGISTRY_BACKEND
if [ -z "${DEVICE:-}" ]; then
  DEVICE=cuda
  if [ -n "$QUICK" ] && ! $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    DEVICE=cpu
  fi
fi
if [ "$DEVICE" = cpu ]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi
DEADLINE=$((SECONDS + ${LIMIT:-$([ -n "$QUICK" ] && echo 300 || echo 590)}))
status=0
PARTS=$(mktemp -d)

triton_verdict() {
  $PY -c "import logprob_registry as lr; print(lr.explain('logprobs', device='$DEVICE')['triton'].reason or 'eligible')" 2>&1 | tail -1
}

rm -f "$OUT"/{info,check,proof,bench}.txt "$OUT"/{proof,bench}.json "$OUT"/summary.md
verdict=$(triton_verdict)
note=
case "$verdict" in
  needs\ torch*found*|needs\ triton*found*)
    export LOGPROB_REGISTRY_UNTESTED_VERSIONS=triton
    note="NOTE: LOGPROB_REGISTRY_UNTESTED_VERSIONS=triton: the triton backend runs outside the versions it declares, to test them"
    ;;
esac
{
  date -u
  echo "device: $DEVICE${QUICK:+ (QUICK)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
  $PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  echo "triton backend on $DEVICE: $verdict"
  if [ -n "$note" ]; then
    echo "$note"
    echo "triton backend on $DEVICE now: $(triton_verdict)"
  fi
  $PY -m logprob_registry info
} 2>&1 | tee "$OUT/info.txt"

left() {  # left SECONDS: the step's limit, cut to the deadline (0: no time left)
  local rest=$((DEADLINE - SECONDS))
  [ "$rest" -lt "$1" ] && echo $((rest > 0 ? rest : 0)) || echo "$1"
}

run() {  # run FILE SECONDS COMMAND...: output appended to FILE, a failure or a timeout counted
  local file=$1 seconds
  seconds=$(left "$2")
  shift 2
  echo "== $*" >>"$file"
  if [ "$seconds" -le 5 ]; then
    echo "not run: no time left before the deadline" >>"$file"
    status=1
    return
  fi
  timeout "$seconds" "$@" >>"$file" 2>&1
  local rc=$?
  [ "$rc" -eq 124 ] && echo "timed out after $seconds s" >>"$file"
  echo "exit status: $rc" >>"$file"
  [ "$rc" -eq 0 ] || status=1
}

LR="$PY -m logprob_registry"
B="$LR bench --device $DEVICE --timeout 150"
if [ -n "$QUICK" ]; then
  CHECK=(-k "test_dtypes or test_large_vocab") PROOF=(--quick) REPEAT=(--repeat 3 --warmup 1)
  SEED=(--shape 2,64,4096 --dtype float32) BIG=(--shape 2,64,8192 --dtype bfloat16)
  HIDDEN=(--op logprobs_from_hidden --shape 1,128,4096 --hidden-size 256 --dtype bfloat16)
else
  CHECK=() PROOF=() REPEAT=(--repeat 5 --warmup 2)
  SEED=(--preset verl --dtype float32) BIG=(--shape 8,2048,151936 --dtype bfloat16)
  HIDDEN=(--op logprobs_from_hidden --shape 1,8192,151936 --hidden-size 4096 --dtype bfloat16)
fi

# 2. correctness, all at once (nothing here is timed)
pids=()
if [[ $STEPS == *" check "* ]]; then
  for backend in triton compiled; do
    run "$PARTS/check-$backend.txt" 240 $LR check --backend $backend --device "$DEVICE" "${CHECK[@]}" &
    pids+=($!)
  done
fi
if [[ $STEPS == *" proof "* ]]; then
  run "$PARTS/proof.txt" 240 $PY scripts/gpu_proof.py --device "$DEVICE" "${PROOF[@]}" --json "$OUT/proof.json" &
  pids+=($!)
fi
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
for f in "$PARTS"/check-*.txt; do [ -e "$f" ] && cat "$f" >>"$OUT/check.txt"; done
[ -e "$PARTS/proof.txt" ] && cp "$PARTS/proof.txt" "$OUT/proof.txt"
grep -h -E "^(== |exit status|timed out|not run)|  (pass|FAIL)|^(PASS|FAIL|SKIP) |passed, " "$OUT/check.txt" "$OUT/proof.txt" 2>/dev/null
# `run` in a background job sets status in that job only: read the exit statuses back
grep -q -E "^exit status: [1-9]|^not run" "$OUT/check.txt" "$OUT/proof.txt" 2>/dev/null && status=1

# 3. measurements, alone on the device
if [[ $STEPS == *" bench "* ]]; then
  n=0
  for setting in SEED BIG HIDDEN; do
    case $setting in
      SEED) args=("${SEED[@]}") ;;
      BIG) args=("${BIG[@]}") ;;
      HIDDEN) args=("${HIDDEN[@]}") ;;
    esac
    for pass in "" "--backward"; do
      n=$((n + 1))
      run "$OUT/bench.txt" 120 $B "${args[@]}" "${REPEAT[@]}" $pass --json "$PARTS/bench-$n.json"
    done
  done
  run "$OUT/bench.txt" 60 $B "${BIG[@]}" "${REPEAT[@]}" --backend triton --backward --inplace-backward \
    --json "$PARTS/bench-7.json"
  $PY scripts/gpu_proof.py merge "$OUT/bench.json" $(ls "$PARTS"/bench-*.json 2>/dev/null | sort -V) || status=1
  grep -E "^(== |exit status|timed out|not run)" "$OUT/bench.txt"
fi

# 4. the summary for docs/hardware.md
{ head -4 "$OUT/info.txt"; echo; $PY scripts/gpu_proof.py summary "$OUT"; } >"$OUT/summary.md" 2>&1
cat "$OUT/summary.md"
rm -rf "$PARTS"
echo "gpu_check: $((SECONDS)) s, exit status $status"
exit $status
