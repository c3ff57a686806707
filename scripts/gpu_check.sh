#!/usr/bin/env bash
# The prepared GPU session: prove and measure the backends on one NVIDIA GPU (written for an H200;
# at most 11 minutes, the sum of the steps' time limits; QUICK=1 at most 5). Every step is a
# logprob-registry command (the script uses the package's public names and CLI only):
#   1. info: nvidia-smi, python, torch, triton, `logprob-registry info`;
#   2. check: the conformance suite on CUDA, `logprob-registry check --backend triton --device
#      cuda` (values at vocabularies up to 262144 in every dtype, gradients, in place, strides);
#   3. bench: `logprob-registry bench` of logprobs at 16x1024x32768 (preset verl) in fp32 and bf16,
#      forward and forward+backward, every eligible backend against the textbook baseline (time,
#      GB/s, peak memory, max |diff| and max |grad diff| against float64); triton's in-place
#      backward; logprobs_from_hidden at 4x1024x32768, H=4096, bf16, forward+backward.
# Results land in $OUT (default ./gpu_results): info.txt, check.txt, bench.txt and bench-*.json.
# Exit status: non-zero when check or a bench command failed.
#
#   bash scripts/gpu_check.sh                 # OUT=dir: where; PYTHON=python3.12: which Python
#   STEPS="check bench" bash scripts/gpu_check.sh   # only these steps (info always runs)
#   QUICK=1 bash scripts/gpu_check.sh         # small shapes, a few tests, triton and chunked only:
#                                             # to try this script itself
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
STEPS=" ${STEPS:-check bench} "
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET LOGPROB_REGISTRY_BACKEND
status=0

triton_verdict() {
  $PY -c "import logprob_registry as lr; print(lr.explain('logprobs', device='cuda')['triton'].reason or 'eligible')" 2>&1 | tail -1
}

rm -f "$OUT"/info.txt "$OUT"/check.txt "$OUT"/bench.txt "$OUT"/bench-*.json
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
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
  $PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  echo "triton backend on cuda: $verdict"
  if [ -n "$note" ]; then
    echo "$note"
    echo "triton backend on cuda now: $(triton_verdict)"
  fi
  $PY -m logprob_registry info
} 2>&1 | tee "$OUT/info.txt"

run() {  # run NAME SECONDS COMMAND...: output to $OUT/NAME.txt (appended), a failure counted
  local name=$1 seconds=$2
  shift 2
  echo "== $*" | tee -a "$OUT/$name.txt"
  timeout "$seconds" "$@" 2>&1 | tee -a "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "exit status: $rc" | tee -a "$OUT/$name.txt"
  [ "$rc" -eq 0 ] || status=1
}

LR="$PY -m logprob_registry"
B="$LR bench --device cuda"
if [ -n "$QUICK" ]; then
  CHECK=(-k "test_dtypes or test_large_vocab") LOGITS=(--shape 2,256,32768) ONLY=(--backend triton)
  HIDDEN=(--shape 2,256,32768 --hidden-size 1024 --backend chunked) REPEAT=(--repeat 3 --warmup 1)
else
  CHECK=() LOGITS=(--preset verl) ONLY=() HIDDEN=(--shape 4,1024,32768 --hidden-size 4096) REPEAT=(--repeat 5 --warmup 2)
fi
if [[ $STEPS == *" check "* ]]; then
  run check 200 $LR check --backend triton --device cuda "${CHECK[@]}"
fi
if [[ $STEPS == *" bench "* ]]; then
  run bench 150 $B "${LOGITS[@]}" "${ONLY[@]}" "${REPEAT[@]}" --dtype float32,bfloat16 --json "$OUT/bench-forward.json"
  run bench 150 $B "${LOGITS[@]}" "${ONLY[@]}" "${REPEAT[@]}" --dtype float32,bfloat16 --backward \
    --json "$OUT/bench-backward.json"
  run bench 60 $B "${LOGITS[@]}" --backend triton "${REPEAT[@]}" --dtype bfloat16 --backward --inplace-backward \
    --json "$OUT/bench-inplace.json"
  run bench 90 $B --op logprobs_from_hidden "${HIDDEN[@]}" "${REPEAT[@]}" --dtype bfloat16 --backward \
    --json "$OUT/bench-hidden.json"
fi
exit $status
