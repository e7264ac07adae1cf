#!/usr/bin/env bash
# A Gemma-style export: fp8 caches on the full-attention layers, the sliding-window layers kept
# unquantized (--skip-layers sw), then the per-layer plan, the cache groups and a short run.
#   bash examples/sliding_window_export.sh [MODEL] [OUT]   (default: the tiny-gemma3 built-in)
set -euo pipefail
MODEL=${1:-tiny-gemma3}
OUT=${2:-out/${MODEL}-fp8-sw}
TQX=${TQEXPORT:-tqexport}

$TQX plan "$MODEL" --kv-cache-dtype fp8 --skip-layers sw
$TQX build "$MODEL" --kv-cache-dtype fp8 --skip-layers sw -o "$OUT" --force
$TQX inspect "$OUT" --kv-cache-memory 64MiB
$TQX parity "$OUT" --steps 2 --batch 2
# the same caches in vLLM (its slot bytes are ours)
$TQX plan "$MODEL" --kv-cache-dtype fp8 --skip-layers sw --vllm-args
