#!/usr/bin/env bash
# Session 6's device runs (issues #13, #14, #15), after staging (../shared/gpu/README.md):
#   call 1: mkdir -p /root/gpu && cp .gpu/a/part_aa /root/gpu/                  (carry .gpu/a)
#   call 2: source .gpu/b/setup.sh && bash tools/h200_s6.sh A   (carry .gpu/b .devstage .ptxcache)
#   call 3: source .gpu/b/setup.sh && bash tools/h200_s6.sh B   (same carry)
# .devstage/s6: `git archive 47c56cf ds4mlx` (this session's start, the "before");
# .devstage/base: c00548b (session 5's start); .ptxcache/ptx.tgz: MLX's PTX cache.
# A: decode (MLX 2-bit experts, 2K + 32K, per-kernel GPU time), GGUF decode, one layer's GGUF
#    prefill experts grouped vs gather_qmm, prefill to 8K.
# B: every `pytest -m gpu` test (issue #15's acceptance), then mlx-lm side by side.
# C: before (.devstage/s6) vs after decode and prefill in one call.
source tools/h200_probe_lib.sh
before() { PYTHONPATH=$PWD/.devstage/s6:$PYTHONPATH probe "$@"; }

case "${1:-A}" in
A)
  log "decode, HEAD, MLX experts, 2K + 32K, GPU time per kernel"
  probe ${NEW_S:-300} --label head --ctx 2048 32768 --fake-context --gpu-busy --top 45 | tee "$OUT/decode_head.txt"
  keep
  log "decode, HEAD, GGUF experts, 2K"
  probe ${GGUF_S:-110} --label head --expert-format gguf --ctx 2048 --fake-context | tee "$OUT/decode_gguf.txt"
  keep
  log "prefill: one layer's routed GGUF experts, grouped vs gather_qmm"
  timeout ${PEXP_S:-50} python3 -u tools/prefill_experts_bench.py --chunks 2048 --formats gguf 2>&1 \
      | grep -v "_warn_once\|UserWarning" | tee "$OUT/prefill_experts.txt"
  log "prefill, HEAD, MLX experts, to 8K (warm-up chunk untimed)"
  probe ${PNEW_S:-110} --label head --ctx 8192 --no-decode | tee "$OUT/prefill_head.txt"
  keep
  ;;
B)
  log "every gpu test"
  # (the device's Python lacks jsonschema: the serve test modules cannot be collected there)
  timeout ${TEST_S:-400} python3 -m pytest -v -m gpu -p no:cacheprovider -rf --continue-on-collection-errors \
      > "$OUT/gpu_tests.txt" 2>&1
  tail -25 "$OUT/gpu_tests.txt" | tee -a "$OUT/log.txt"
  keep
  log "mlx-lm side by side, 43 layers, 2K prompt"
  timeout ${LM_S:-170} python3 -u tools/mlxlm_side_by_side.py --layers 43 --prompt 2048 --gen 32 --which both 2>&1 \
      | grep -v "_warn_once\|UserWarning" | tail -30 | tee "$OUT/mlxlm.txt"
  ;;
C)
  log "decode, after, MLX experts, 2K + 32K"
  probe ${NEW_S:-200} --label after --ctx 2048 32768 --fake-context --gpu-busy --top 30 | tee "$OUT/decode_after.txt"
  keep
  log "decode, before (session start), MLX experts, 2K"
  before ${BASE_S:-120} --label before --ctx 2048 --fake-context --gpu-busy | tee "$OUT/decode_before.txt"
  log "prefill, after, to 8K"
  probe ${PNEW_S:-120} --label after --ctx 8192 --no-decode | tee "$OUT/prefill_after.txt"
  log "prefill, before, to 8K"
  before ${PBASE_S:-120} --label before --ctx 8192 --no-decode | tee "$OUT/prefill_before.txt"
  ;;
esac
log done
