#!/usr/bin/env bash
# One prepared GPU session for the triton backend (an H200 is assumed; about 6-9 minutes):
#   1. what is there (nvidia-smi, torch, triton, `logprob-registry info`);
#   2. the conformance suite on CUDA: logprob-registry check --backend triton --device cuda;
#   3. scripts/gpu_bench.py: verification at large vocabularies, the 16x1024x32768 benchmark
#      against compiled, chunked, naive and the seed's compiled cross-entropy, a block-size sweep.
# Results land in $OUT (default ./gpu_results): info.txt, check.txt, bench.txt, bench.json, bench.md.
#
# Nothing is installed: the package runs from this checkout through PYTHONPATH, with the machine's
# own torch, triton, pluggy and packaging (all present in the device image; carry wheels if not).
# If the machine's torch or triton is older than the versions in the triton backend's specifiers
# (the versions tested so far), this throwaway copy's specifiers are lowered to the installed
# versions, loudly, so that the run can test them; do not commit that change from the machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
  $PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  verdict=$($PY -c "import logprob_registry as lr; print(lr.explain('logprobs', device='cuda')['triton'].reason or 'eligible')")
  echo "triton backend on cuda: $verdict"
  case "$verdict" in
    needs\ torch*|needs\ triton*)
      tv=$($PY -c "import torch; print(torch.__version__.split('+')[0])")
      rv=$($PY -c "import triton; print(triton.__version__.split('+')[0])")
      echo "NOTE: lowering the triton backend's specifiers in this copy to torch>=$tv, triton>=$rv to test those versions"
      sed -i -e "s/torch=\">=[0-9.]*\"/torch=\">=$tv\"/" -e "s/triton=\">=[0-9.]*\"/triton=\">=$rv\"/" logprob_registry/kernels/triton.py
      ;;
  esac
  $PY -m logprob_registry info
} 2>&1 | tee "$OUT/info.txt"

echo "== conformance suite on CUDA" | tee "$OUT/check.txt"
timeout 240 $PY -m logprob_registry check --backend triton --device cuda 2>&1 | tee -a "$OUT/check.txt"
check_rc=${PIPESTATUS[0]}
echo "check exit status: $check_rc" | tee -a "$OUT/check.txt"

echo "== verify and benchmark" | tee "$OUT/bench.txt"
timeout 420 $PY scripts/gpu_bench.py --out "$OUT" 2>&1 | tee -a "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}
echo "bench exit status: $bench_rc" | tee -a "$OUT/bench.txt"
exit $(( check_rc != 0 || bench_rc != 0 ))
