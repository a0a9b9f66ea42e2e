#!/usr/bin/env bash
# Session 5's device runs (issues #13, #14), after staging (../shared/gpu/README.md):
#   call 1: mkdir -p /root/gpu && cp .gpu/a/part_aa /root/gpu/                      (carry .gpu/a)
#   call 2: source .gpu/b/setup.sh && bash tools/h200_wave4.sh D    (carry .gpu/b .devstage .ptxcache)
#   call 3: source .gpu/b/setup.sh && bash tools/h200_wave4.sh P    (same carry)
# .devstage/base: the tree at the session's start (`git archive c00548b ds4mlx`), the "before";
# .devstage/whl: py-spy (native host profile of the decode loop); .ptxcache/ptx.tgz: MLX's PTX cache.
# D: decode, MLX 2-bit experts, new vs base at 2K (+ new at 32K), GPU busy time, a py-spy
#    profile of the new step's host side, then GGUF experts (new) at 2K and 32K.
# P: the new kernels' GPU tests, then prefill (new vs base) and the prefill profile.
# F: decode with the per-kernel GPU time, one layer's prefill experts old vs new, prefill to 8K,
#    a few GPU tests (the session's last call).
source tools/h200_probe_lib.sh
base() { PYTHONPATH=$PWD/.devstage/base:$PYTHONPATH probe "$@"; }

if [ "${1:-D}" = D ]; then
  log "decode, new tree, MLX experts, 2K + 32K (caches jumped to the context)"
  probe ${NEW_S:-200} --label new --ctx 2048 32768 --fake-context --gpu-busy | tee "$OUT/decode_new.txt"
  keep
  log "decode, base tree (session start), MLX experts, 2K"
  base ${BASE_S:-120} --label base --ctx 2048 --fake-context --gpu-busy | tee "$OUT/decode_base.txt"
  log "host profile of the new decode loop (py-spy --native, 8 layers)"
  python3 -m pip install -q --no-index --no-deps --target /root/pyspy .devstage/whl/py_spy-*.whl >/dev/null 2>&1
  timeout ${SPY_S:-80} /root/pyspy/bin/py-spy record --native --format raw -r 250 -o "$OUT/spy_raw.txt" -- \
      python3 -u tools/wave4_probe.py --label spy --layers 8 --ctx 2048 --fake-context --gen 400 > /dev/null 2>&1
  python3 tools/pyspy_top.py "$OUT/spy_raw.txt" --within loop_tps --top 30 | cut -c1-190 | tee "$OUT/spy_top.txt"
  log "decode, new tree, GGUF experts, 2K + 32K"
  probe ${GGUF_S:-170} --label new --expert-format gguf --ctx 2048 32768 --fake-context | tee "$OUT/decode_gguf.txt"
  keep
elif [ "$1" = P ]; then
  log "gpu tests of the new kernels"
  timeout ${TEST_S:-170} python3 -m pytest -q -m gpu -p no:cacheprovider -x ${TESTS:-tests/test_kernel_moe_route.py \
      tests/test_kernel_compressor_step.py tests/test_kernel_attn_prep.py tests/test_kernel_hyper_connection.py} \
      > "$OUT/gpu_tests.txt" 2>&1
  tail -4 "$OUT/gpu_tests.txt" | tee -a "$OUT/log.txt"
  keep
  log "prefill, new tree, MLX experts, to 8K and 32K"
  probe ${PNEW_S:-200} --label new --ctx 8192 32768 --no-decode | tee "$OUT/prefill_new.txt"
  log "prefill, base tree, MLX experts, to 8K"
  base ${PBASE_S:-90} --label base --ctx 8192 --no-decode | tee "$OUT/prefill_base.txt"
  keep
elif [ "$1" = F ]; then  # the last call: decode after the qmv merge + per-kernel GPU time, prefill
  log "decode, new tree, MLX experts, 2K, GPU time per kernel"
  probe ${NEW_S:-200} --label new --ctx 2048 --fake-context --gpu-busy --top 40 | tee "$OUT/decode_final.txt"
  keep
  log "prefill: one layer's routed experts, grouped vs today's gather_qmm (MLX 2-bit, GGUF)"
  timeout ${PEXP_S:-90} python3 -u tools/prefill_experts_bench.py --chunks 2048 --formats mlx2,gguf 2>&1 \
      | grep -v "_warn_once\|UserWarning" | tee "$OUT/prefill_experts.txt"
  log "prefill, new tree, MLX experts, to 8K (real prefill, chunk 2048)"
  probe ${PNEW_S:-150} --label new --ctx 8192 --no-decode | tee "$OUT/prefill_new.txt"
  keep
  log "gpu tests of the new decode kernels"
  timeout ${TEST_S:-80} python3 -m pytest -q -m gpu -p no:cacheprovider -x ${TESTS:-tests/test_kernel_moe_route.py \
      tests/test_kernel_compressor_step.py} > "$OUT/gpu_tests.txt" 2>&1
  tail -4 "$OUT/gpu_tests.txt" | tee -a "$OUT/log.txt"
fi
log done
