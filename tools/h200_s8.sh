#!/usr/bin/env bash
# Session 8's device runs (issues #13, #14, #15), after staging (../shared/gpu/README.md):
#   call 1: mkdir -p /root/gpu && cp .gpu/a/part_aa /root/gpu/                  (carry .gpu/a)
#   later:  source .gpu/b/setup.sh && bash tools/h200_s8.sh A|B|C   (carry .gpu/b .ptxcache [.devstage/s8a])
# A: every `pytest -m gpu` test (#15's last acceptance point), then decode of this tree
#    (session 7's fused mHC sites and GGUF MoE modes, first measured here): MLX 2-bit experts
#    32K then 2K (--descending: is 2K slower only because it ran first?), GGUF experts 2K + 32K.
# B: prefill: one layer's routed experts at a 2,048-token chunk with the GGUF path's
#    dequantization and GEMMs timed apart, then the 43-layer prefill frontier + profile.
# C: the GPU tests of what changed, then the end-of-session decode: this tree with MLX's CUDA
#    graphs on and off, BEFORE (the tree A measured, `git archive d0c73aa ds4mlx` into
#    .devstage/s8a), GGUF experts.
# D: prefill ops one by one, the GGUF dequantization, prefill to 8K as it is and with the
#    dense linears as dequantized GEMMs + the attention as GEMMs, serve vs bench.
# E: mlx-lm on the same shapes, GGUF prefill.
source tools/h200_probe_lib.sh
before() { PYTHONPATH=$PWD/${BEFORE:-.devstage/s8a}:$PYTHONPATH probe "$@"; }
gputest() {  # the -v output kept whole in $OUT (a cut run still names what passed)
  local f="$OUT/gpu_tests_$(date +%s).txt"
  timeout "$1" python3 -m pytest -v -m gpu -p no:cacheprovider -rf "${@:2}" > "$f" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$f" | tail -40 | cut -c1-300 | tee -a "$OUT/log.txt"
}
case "${1:-A}" in
A)
  log "every GPU test"
  gputest ${TEST_S:-280} tests/test_affine_qmv.py tests/test_cuda_cache.py tests/test_grouped_experts.py tests/test_kernel_attn_prep.py tests/test_kernel_compressor_step.py tests/test_kernel_hyper_connection.py tests/test_kernel_moe_route.py tests/test_kernel_selftest.py tests/test_kernel_sparse_attention.py tests/test_quant.py tests/test_quant_moe.py 
  keep
  log "decode, this tree, MLX 2-bit experts, 32K then 2K, GPU time per kernel"
  probe ${NEW_S:-170} --label head --ctx 32768 2048 --descending --fake-context --gpu-busy --top 25 | tee "$OUT/decode_head.txt"
  keep
  log "decode, this tree, GGUF experts, 2K + 32K"
  probe ${GGUF_S:-110} --label head-gguf --expert-format gguf --ctx 2048 32768 --fake-context --gpu-busy --top 12 | tee "$OUT/decode_gguf.txt"
  keep
  ;;
B)
  log "one layer's routed experts, 2,048-token chunk, GGUF split"
  timeout ${EXPERTS_S:-120} python3 -u tools/prefill_experts_bench.py --chunks 2048 --formats gguf,mlx2 --split --no-old \
      2>&1 | grep -v "_warn_once\|UserWarning" | tee "$OUT/prefill_experts.txt"
  log "prefill frontier 2K..32K + profile, MLX 2-bit experts"
  DS4MLX_DECODE=legacy timeout ${BENCH_S:-330} python3 -u -m ds4mlx.cli bench --synthetic v4-flash --expert-format mlx \
      --ctx-start 2048 --ctx-max 32768 --step-mul 4 --gen-tokens 0 --time-budget 200 \
      --profile-prefill --profile-chunks 512,2048 --csv "$OUT/prefill_mlx.csv" 2>&1 | grep -v '^ds4mlx: dtype\|_warn_once\|UserWarning' \
      | cut -c1-400 | tee "$OUT/prefill_mlx.txt"
  keep
  ;;
C)
  log "GPU tests of the kernels changed or unverified since their last pass"
  gputest ${TEST_S:-300} tests/test_cuda_cache.py tests/test_kernel_attn_prep.py tests/test_kernel_hyper_connection.py \
      tests/test_quant_moe.py tests/test_affine_qmv.py tests/test_kernel_sparse_attention.py tests/test_grouped_experts.py \
      tests/test_quant.py tests/test_kernel_selftest.py ${MORE_TESTS:-}
  keep
  log "decode, this tree (MLX's CUDA graphs on, its default), MLX 2-bit experts, GPU time"
  probe ${NEW_S:-120} --label head --ctx 2048 32768 --fake-context --gpu-busy --top 12 | tee "$OUT/decode_head.txt"
  keep
  log "decode, this tree, MLX_USE_CUDA_GRAPHS=0 (direct launches)"
  MLX_USE_CUDA_GRAPHS=0 probe ${NOG_S:-90} --label head-nographs --ctx 2048 32768 --fake-context | tee "$OUT/decode_nographs.txt"
  log "decode, before (.devstage/s8a = d0c73aa), MLX 2-bit experts"
  before ${BASE_S:-70} --label before --ctx 2048 --fake-context | tee "$OUT/decode_before.txt"
  log "decode, this tree, GGUF experts"
  probe ${GGUF_S:-90} --label head-gguf --expert-format gguf --ctx 2048 32768 --fake-context | tee "$OUT/decode_gguf.txt"
  ;;
D)
  log "prefill ops one by one (2,048-token chunk)"
  timeout ${OPS_S:-70} python3 -u tools/prefill_ops_probe.py --chunk 2048 2>&1 | grep -v "_warn_once\|UserWarning" | tee "$OUT/prefill_ops.txt"
  log "one layer's routed experts, 2,048-token chunk, GGUF split (the dequantization kernel)"
  timeout ${EXPERTS_S:-60} python3 -u tools/prefill_experts_bench.py --chunks 2048 --formats gguf --split --no-old \
      2>&1 | grep -v "_warn_once\|UserWarning" | tee "$OUT/prefill_experts.txt"
  for v in "default" "DS4MLX_PREFILL_LINEARS=dequant DS4MLX_PREFILL_SDPA=matmul"; do
    log "prefill 2K..8K, MLX 2-bit experts, $v"
    env ${v/default/} DS4MLX_DECODE=legacy timeout ${PRE_S:-100} python3 -u -m ds4mlx.cli bench --synthetic v4-flash \
        --expert-format mlx --ctx-start 2048 --ctx-max 8192 --step-mul 4 --gen-tokens 0 --time-budget 75 \
        --csv "$OUT/prefill_${v%%=*}.csv" 2>&1 | grep "prefill_tps" | tee -a "$OUT/prefill.txt"
  done
  log "serve vs bench, 2K"
  timeout ${SERVE_S:-90} python3 -u tools/serve_vs_bench.py --ctx 2048 --gen 64 2>&1 | grep -v "_warn_once\|UserWarning" | tail -15 | tee "$OUT/serve_vs_bench.txt"
  ;;
E)
  log "mlx-lm, same shapes and bits"
  timeout ${MLXLM_S:-120} python3 -u tools/mlxlm_side_by_side.py --layers 43 --prompt ${MLXLM_PROMPT:-512} --gen 16 --which mlxlm 2>&1 \
      | grep -v "_warn_once\|UserWarning" | tail -15 | tee "$OUT/mlxlm.txt"
  log "prefill 2K..8K, GGUF experts"
  DS4MLX_DECODE=legacy timeout ${PREG_S:-120} python3 -u -m ds4mlx.cli bench --synthetic v4-flash --expert-format gguf \
      --ctx-start 2048 --ctx-max 8192 --step-mul 4 --gen-tokens 0 --time-budget 90 --csv "$OUT/prefill_gguf.csv" 2>&1 \
      | grep "prefill_tps" | tee "$OUT/prefill_gguf.txt"
  ;;
esac
log done
