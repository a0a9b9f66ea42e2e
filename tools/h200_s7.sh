#!/usr/bin/env bash
# Session 7's device runs (issues #13, #14, #15), after staging (../shared/gpu/README.md):
#   call 1: mkdir -p /root/gpu && cp .gpu/a/part_aa /root/gpu/                  (carry .gpu/a)
#   call 2: source .gpu/b/setup.sh && bash tools/h200_s7.sh A   (carry .gpu/b .devstage/s7b .ptxcache)
#   call 3: source .gpu/b/setup.sh && bash tools/h200_s7.sh B   (same carry)
# .devstage/s7b: `git archive b4d1581 ds4mlx` (session 6's measured "after") with only the CUDA
# kernel cache (kernels/cuda_cache.py and its two hooks) added, so that its first step does not
# spend minutes in NVRTC: the kernels it runs are b4d1581's.
# A: the cache proven on the device (a planted cubin is what MLX runs), HEAD decode 2K + 32K with
#    per-kernel GPU time (its first step: the variants compiled side by side), a second process
#    (first step with the cache warm), b4d1581 at 2K (before), GGUF decode 2K, the qmv table.
# B: the GPU tests of the kernels still self-tested at first use, then prefill after vs before.
source tools/h200_probe_lib.sh
# BEFORE: the "before" tree (next session: `git archive d109562 ds4mlx`, session 7's measured head)
before() { PYTHONPATH=$PWD/${BEFORE:-.devstage/s7b}:$PYTHONPATH probe "$@"; }
gputest() {  # the -v output kept whole in $OUT (a cut run still names what passed)
  local f="$OUT/gpu_tests_$(date +%s).txt"
  timeout "$1" python3 -m pytest -v -m gpu -p no:cacheprovider -rf "${@:2}" > "$f" 2>&1
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$f" | tail -60 | tee -a "$OUT/log.txt"
}

case "${1:-A}" in
A)
  log "the kernel cache on the device (planted cubin)"
  gputest 120 tests/test_cuda_cache.py
  log "decode, HEAD, MLX experts, 2K + 32K, GPU time per kernel (first process: cold kernel cache)"
  probe ${NEW_S:-240} --label head --ctx 2048 32768 --fake-context --gpu-busy --top 30 | tee "$OUT/decode_head.txt"
  keep
  log "decode, HEAD, second process (kernel cache warm), 2K"
  probe ${WARM_S:-100} --label head-warm --ctx 2048 --fake-context | tee "$OUT/decode_head_warm.txt"
  log "decode, before (b4d1581), 2K, GPU time"
  before ${BASE_S:-150} --label before --ctx 2048 --fake-context --gpu-busy --top 10 | tee "$OUT/decode_before.txt"
  keep
  log "decode, HEAD, GGUF experts, 2K"
  probe ${GGUF_S:-120} --label head --expert-format gguf --ctx 2048 --fake-context | tee "$OUT/decode_gguf.txt"
  keep
  log "affine_qmv decode shapes"
  timeout ${QMV_S:-100} python3 -u -m ds4mlx.bench.kernels --qmv --qmv-decode-only --no-micro --no-layer --no-model 2>&1 \
      | grep -v "_warn_once\|UserWarning" | tee "$OUT/qmv.txt"
  keep
  ;;
B)
  log "GPU tests of the kernels self-tested at first use"
  gputest ${TEST_S:-300} tests/test_kernel_attn_prep.py tests/test_kernel_sparse_attention.py tests/test_kernel_moe_route.py \
      tests/test_kernel_compressor_step.py tests/test_kernel_hyper_connection.py tests/test_grouped_experts.py \
      tests/test_kernel_selftest.py tests/test_affine_qmv.py tests/test_quant_moe.py tests/test_quant.py
  keep
  log "prefill, HEAD, to 8K"
  probe ${PNEW_S:-120} --label head --ctx 8192 --no-decode | tee "$OUT/prefill_head.txt"
  log "prefill, before, to 8K"
  before ${PBASE_S:-120} --label before --ctx 8192 --no-decode | tee "$OUT/prefill_before.txt"
  keep
  ;;
esac
log done
