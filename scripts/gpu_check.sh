#!/usr/bin/env bash
# Every GPU check in one go (target: under 8 minutes on one H200): the CUDA kernel tests,
# then the paged decode bandwidth benchmark. Needs torch with CUDA, triton, and this repo.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=0
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" || exit 1
echo "== CUDA kernel tests"
timeout 300 "$PY" -m pytest -q -m gpu tests/test_triton_cache_write.py tests/test_triton_paged_attention.py
tests=$?
echo "== paged decode bandwidth"
timeout 300 "$PY" benchmarks/gpu_decode.py "$@"
bench=$?
exit $(( tests != 0 || bench != 0 ))
