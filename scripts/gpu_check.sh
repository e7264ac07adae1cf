#!/usr/bin/env bash
# Every GPU check in one go (target: under 8 minutes on one H200): the CUDA kernel tests,
# the paged decode bandwidth benchmark, then the ORT CUDA decode row (device-resident caches
# bound in place; needs onnxruntime-gpu, skipped with a note without it). Needs torch with
# CUDA, triton, and this repo.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=0
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" || exit 1
echo "== CUDA kernel tests"
timeout 300 "$PY" -m pytest -q -m gpu tests/ops/test_triton_cache_write.py tests/ops/test_triton_paged_attention.py
tests=$?
echo "== paged decode bandwidth"
timeout 300 "$PY" benchmarks/gpu_decode.py "$@"
bench=$?
echo "== ORT CUDA decode (device-resident caches)"
ortrow=0
if "$PY" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())"; then
  timeout 300 "$PY" benchmarks/ort_cuda_decode.py --model tiny-llama-d128 --context 256 --workdir out/gpu-check
  ortrow=$?
else
  echo "skipped: onnxruntime-gpu with the CUDA provider is not installed"
fi
exit $(( tests != 0 || bench != 0 || ortrow != 0 ))
