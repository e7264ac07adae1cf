#!/usr/bin/env bash
# TensorRT end to end on a GPU machine (never run by the authors: no TensorRT or GPU there).
# Needs: an NVIDIA GPU, torch with CUDA, triton, `pip install 'tensorrt>=10.9'`, this repo.
# For tiny built-in models (unquantized, fp8, TurboQuant with an unquantized boundary layer,
# TurboQuant with a recent window of 8 tokens):
# build the artifact, build engine.plan with the AOT plugins, compare step logits with ONNX
# Runtime, print decode tokens/s for both. Then the CUDA tests of the TensorRT-order kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" || exit 1
"$PY" -c "import tensorrt; print('tensorrt', tensorrt.__version__)" || { echo "pip install 'tensorrt>=10.9'"; exit 1; }
OUT=${OUT:-$(mktemp -d)}
status=0
n=0
for case in "auto:" "fp8:" "turboquant_4bit_nc:--no-boundary --skip-layers 0" \
            "turboquant_k8v4:--no-boundary" "turboquant_4bit_nc:--no-boundary --kv-recent-window 8"; do
  dtype=${case%%:*}; extra=${case#*:}; n=$((n + 1))
  art="$OUT/tiny-llama-$n-$dtype"
  echo "== $dtype $extra: artifact, engine, parity vs ORT, decode tokens/s"
  timeout 300 "$PY" -m tqexport build tiny-llama -o "$art" --kv-cache-dtype "$dtype" $extra --force || { status=1; continue; }
  timeout 600 "$PY" -m tqexport engine "$art" --max-batch 4 --max-num-batched-tokens 128 --max-blocks 64 || { status=1; continue; }
  tol=1e-3; [ "$dtype" = auto ] || tol=5e-2
  timeout 300 "$PY" benchmarks/trt_parity.py "$art" --tolerance "$tol" || status=1
done
echo "== CUDA tests of the TensorRT-order kernels"
timeout 300 "$PY" -m pytest -q -m gpu tests/trt_plugins/test_trt_plugins.py || status=1
exit $status
