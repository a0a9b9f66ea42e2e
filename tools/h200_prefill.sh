#!/usr/bin/env bash
# Prefill speed on the lent H200 (issue #14), results under $OUT.  Phases (default: all,
# in this order; device calls of <= 10 minutes each: "E T M" then "D G" then "K"):
#   E  routed experts at prefill as per-expert batched GEMMs (models/grouped_experts.py, the GPU
#      default): its GPU test against the CPU's per-pair path, then one V4 Flash layer's routed
#      experts at 256- and 2,048-token chunks, grouped (gather_qmm M = cap / dequantized slices
#      + cuBLAS) vs per-pair, MLX 2-bit and GGUF (tools/prefill_experts_bench.py; ~1-2 min)
#   T  GPU tests of the grouped GGUF-expert prefill (quant_moe: dequantized stack + sorted gather_mm),
#      then on the GPU the dequantized-expert tests and V4's oracle parity (the banded / per-query
#      prefill attention against transformers, TF32 off)
#   M  43-layer synthetic V4 Flash, MLX 2-bit experts: frontier bench 2K..32K (x4) with the default
#      GPU chunk (2048) + the prefill profile at 512- and 2048-token chunks (at ctx 2048)
#   D  MLX experts with DS4MLX_PREFILL_EXPERTS=dequant (stack dequantized + sorted grouped GEMM
#      instead of gather_qmm) and DS4MLX_PREFILL_LINEARS=dequant (dense quantized linears as
#      dequantized GEMMs): frontier 2K..8K + the profile at 2048 (the A/B for phase M; the
#      profile's families say which of the two moved)
#   G  the same as M with ds4's GGUF experts (IQ2_XXS gate/up, Q2_K down)
#   K  the disk KV cache bench at 32K on the synthetic model (restore vs re-prefill)
# Decode is not measured here (--gen-tokens 0) and runs the legacy step for the bench's
# warm-up (DS4MLX_DECODE=legacy): the compiled decode step would spend ~4.5 min compiling.
# Expected device time: building the synthetic model ~40-60 s per phase M/G/K (random
# weights on the device), the first prefill chunk compiles MLX's CUDA kernels (~1 min on
# a fresh machine), then ~30 s per phase at >= 1,000 t/s; each phase is time-boxed.
# Staging as tools/h200_run.sh (source .gpu/b/setup.sh first).
set -u
OUT=${OUT:-out/h200}
mkdir -p "$OUT"
py=python3
export DS4MLX_DECODE=legacy
log() { echo "== $(date -u +%FT%TZ) $*" | tee -a "$OUT/log.txt"; }
log "device: $($py -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$OUT/log.txt" 2>&1
phases=${*:-E T M D G K}
frontier() {  # $1 = expert format, $2 = run name, $3 = ctx max, $4 = profile chunks
  timeout ${BENCH_S:-200} $py -u -m ds4mlx.cli bench --synthetic v4-flash --expert-format "$1" \
      --ctx-start 2048 --ctx-max ${3:-32768} --step-mul 4 --gen-tokens 0 --time-budget ${BUDGET_S:-100} \
      --profile-prefill --profile-chunks ${4:-512,2048} --csv "$OUT/prefill_$2.csv" > "$OUT/prefill_$2.txt" 2>&1
  echo "rc=$?" >> "$OUT/prefill_$2.txt"
  grep -v '^ds4mlx: dtype' "$OUT/prefill_$2.txt" | tail -45 | cut -c1-400 | tee -a "$OUT/log.txt"
}
for ph in $phases; do
  case $ph in
    T)
      log "gpu tests: quant_moe (grouped prefill path)"
      DS4MLX_TEST_CACHE=$PWD/.gpu/tc timeout ${TEST_S:-120} $py -m pytest -q -m gpu -p no:cacheprovider \
          tests/test_quant_moe.py > "$OUT/gpu_tests.txt" 2>&1
      tail -5 "$OUT/gpu_tests.txt" | tee -a "$OUT/log.txt"
      DS4MLX_TEST_CACHE=$PWD/.gpu/tc timeout ${PARITY_S:-150} $py -m pytest -q -p no:cacheprovider \
          tests/test_prefill_experts.py tests/test_deepseek_v4_parity.py > "$OUT/gpu_parity.txt" 2>&1
      tail -8 "$OUT/gpu_parity.txt" | tee -a "$OUT/log.txt" ;;
    E)
      log "gpu test + bench: routed experts as per-expert batched GEMMs"
      DS4MLX_TEST_CACHE=$PWD/.gpu/tc timeout ${TEST_S:-180} $py -m pytest -q -m gpu -p no:cacheprovider \
          tests/test_grouped_experts.py > "$OUT/gpu_grouped_experts.txt" 2>&1
      tail -5 "$OUT/gpu_grouped_experts.txt" | tee -a "$OUT/log.txt"
      timeout ${EXPERTS_S:-240} $py -u tools/prefill_experts_bench.py --chunks 256,2048 \
          > "$OUT/prefill_experts_bench.txt" 2>&1
      echo "rc=$?" >> "$OUT/prefill_experts_bench.txt"
      tail -40 "$OUT/prefill_experts_bench.txt" | cut -c1-300 | tee -a "$OUT/log.txt" ;;
    M) log "43-layer synthetic V4 Flash, MLX 2-bit experts: prefill frontier + profile"; frontier mlx mlx ;;
    D) log "MLX experts, DS4MLX_PREFILL_EXPERTS=dequant DS4MLX_PREFILL_LINEARS=dequant"
       DS4MLX_PREFILL_EXPERTS=dequant DS4MLX_PREFILL_LINEARS=dequant frontier mlx mlx_dequant 8192 2048 ;;
    G) log "43-layer synthetic V4 Flash, GGUF experts: prefill frontier + profile"; frontier gguf gguf ;;
    K)
      log "disk KV cache bench at 32K (synthetic, MLX experts)"
      timeout ${KV_S:-200} $py -u -m ds4mlx.bench.kv bench --synthetic v4-flash --tokens 32768 --dir /tmp \
          > "$OUT/kv.txt" 2>&1
      echo "rc=$?" >> "$OUT/kv.txt"
      grep -v '^ds4mlx: dtype' "$OUT/kv.txt" | tail -6 | cut -c1-400 | tee -a "$OUT/log.txt" ;;
    *) log "unknown phase $ph (E T M D G K)" ;;
  esac
done
