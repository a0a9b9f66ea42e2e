#!/usr/bin/env bash
# One time-boxed session on the lent H200 (MLX CUDA), results under $OUT.
# Staging first (see ../shared/gpu/README.md): bash ../shared/gpu/stage.sh, then
#   device call 1: mkdir -p /root/gpu && cp .gpu/a/part_aa /root/gpu/     (carry .gpu/a)
#   device call 2: source .gpu/b/setup.sh && bash tools/h200_run.sh A     (carry .gpu/b .gpu/tc)
#   device call 3: source .gpu/b/setup.sh && bash tools/h200_run.sh B     (carry .gpu/b)
# Phase K: every GPU test + the quantized-MoE GB/s table; phase M: kernels on / off
# on the 43-layer synthetic model with MLX and with GGUF (IQ2_XXS / Q2_K) experts.
# Phase A: GPU kernel tests, kernel micro-benchmarks (kernels on/off on an 8-layer
# synthetic model), the 43-layer synthetic V4 Flash frontier bench + decode profile.
# Phase B: ds4mlx vs mlx-lm deepseek_v41 side by side (same shapes, bits, weights).
# Phase D: decode t/s with DS4MLX_DECODE=legacy vs compiled (the static step) in one
# process per expert format, with the compiled step's launches / host µs per token.
# Phase S: `serve` (streamed /v1/completions) vs `bench` decode t/s at the same context.
set -u
OUT=${OUT:-out/h200}
mkdir -p "$OUT"
py=python3
log() { echo "== $(date -u +%FT%TZ) $*" | tee -a "$OUT/log.txt"; }
log "device: $($py -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$OUT/log.txt" 2>&1

if [ "${1:-A}" = T ]; then  # the GPU tests alone
  DS4MLX_TEST_CACHE=$PWD/.gpu/tc timeout 280 $py -m pytest -q -m gpu -p no:cacheprovider "${@:2}" > "$OUT/gpu_tests.txt" 2>&1
  tail -15 "$OUT/gpu_tests.txt" | tee -a "$OUT/log.txt"
elif [ "${1:-A}" = A ]; then
  log "gpu tests"
  # tiny oracle models travel in .gpu/tc (copied from ~/.cache/ds4mlx-tests) so the device builds none
  DS4MLX_TEST_CACHE=$PWD/.gpu/tc timeout 150 $py -m pytest -q -m gpu -p no:cacheprovider tests/test_quant_moe.py \
      tests/test_kernel_hyper_connection.py tests/test_kernel_sparse_attention.py > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt" | tee -a "$OUT/log.txt"
  log "kernel micro-benchmarks + 8-layer kernels on/off"
  timeout 130 $py -m ds4mlx.bench.kernels --iters 100 --layers 8 > "$OUT/kernels.txt" 2>&1
  tail -4 "$OUT/kernels.txt" | tee -a "$OUT/log.txt"
  log "43-layer synthetic V4 Flash frontier bench"
  timeout 270 $py -m ds4mlx.cli bench --synthetic v4-flash --ctx-start 2048 --ctx-max 32768 --step-mul 4 \
      --gen-tokens 32 --time-budget 150 --profile --csv "$OUT/v4flash.csv" > "$OUT/v4flash.txt" 2>&1
  tail -25 "$OUT/v4flash.txt" | tee -a "$OUT/log.txt"
elif [ "$1" = K ]; then  # every GPU test, then the quantized-MoE GB/s table
  log "gpu tests"
  DS4MLX_TEST_CACHE=$PWD/.gpu/tc timeout 420 $py -m pytest -q -m gpu -p no:cacheprovider -rf > "$OUT/gpu_tests.txt" 2>&1
  tail -5 "$OUT/gpu_tests.txt" | tee -a "$OUT/log.txt"
  log "quantized MoE GB/s"
  timeout 300 $py -m ds4mlx.bench.kernels --qmoe --no-micro --no-layer --no-model --iters 200 \
      > "$OUT/qmoe.txt" 2>&1
  cat "$OUT/qmoe.txt" | tee -a "$OUT/log.txt"
elif [ "$1" = M ]; then  # 43-layer model, kernels on vs off in one process: MLX experts, then GGUF experts
  for fmt in ${FORMATS:-mlx gguf}; do
    log "43-layer synthetic, experts $fmt, kernels off / on"
    timeout 270 $py -m ds4mlx.bench.kernels --no-micro --no-layer --layers 43 --ctx ${CTX:-1024} \
        --gen 16 --expert-format $fmt > "$OUT/model_$fmt.txt" 2>&1
    tail -4 "$OUT/model_$fmt.txt" | tee -a "$OUT/log.txt"
  done
elif [ "$1" = D ]; then  # decode before / after the compiled static step (DS4MLX_DECODE legacy vs compiled)
  for fmt in ${FORMATS:-mlx gguf}; do
    log "43-layer synthetic, experts $fmt, decode legacy vs compiled at ${CTXS:-2048 32768}"
    timeout ${DTIME:-560} $py tools/decode_before_after.py --expert-format $fmt --ctx ${CTXS:-2048 32768} --gen 32 \
        --profile > "$OUT/decode_$fmt.txt" 2>&1
    grep -v '^#' "$OUT/decode_$fmt.txt" | tail -30 | tee -a "$OUT/log.txt"
  done
elif [ "$1" = S ]; then  # serve (streaming client) vs bench decode at the same context
  for fmt in ${FORMATS:-mlx}; do
    log "43-layer synthetic, experts $fmt, serve vs bench at ${CTX:-2048}"
    timeout ${STIME:-280} $py tools/serve_vs_bench.py --expert-format $fmt --ctx ${CTX:-2048} --gen 64 \
        > "$OUT/serve_$fmt.txt" 2>&1
    grep -v '^#' "$OUT/serve_$fmt.txt" | tail -5 | tee -a "$OUT/log.txt"
  done
elif [ "$1" = F ]; then  # the full-model bench alone
  log "43-layer synthetic V4 Flash frontier bench"
  timeout 400 $py -m ds4mlx.cli bench --synthetic v4-flash --ctx-start 2048 --ctx-max 32768 --step-mul 4 \
      --gen-tokens 32 --time-budget 220 --profile --csv "$OUT/v4flash.csv" > "$OUT/v4flash.txt" 2>&1
  tail -25 "$OUT/v4flash.txt" | tee -a "$OUT/log.txt"
else
  log "ds4mlx vs mlx-lm deepseek_v41, 43 layers"
  timeout 560 $py tools/mlxlm_side_by_side.py --layers 43 --prompt "${PROMPT:-1024}" --gen 32 --which both \
      > "$OUT/side_by_side.txt" 2>&1
  tail -5 "$OUT/side_by_side.txt" | tee -a "$OUT/log.txt"
fi
log done
