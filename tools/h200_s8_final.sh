source .gpu/b/setup.sh && source tools/h200_probe_lib.sh
log "the failing GPU tests, with their messages"
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -x "tests/test_kernel_hyper_connection.py::test_gpu_tails_equal_two_launches[n5_d33_T2_float32]" 2>&1 | grep -E "^E |Error|assert|passed|failed" | head -20 | tee -a $OUT/log.txt
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short "tests/test_kernel_attn_prep.py::test_gpu_face_matches_reference" 2>&1 | grep -E "^E |passed|failed" | head -10 | tee -a $OUT/log.txt
for v in "DS4MLX_PREFILL_SDPA=matmul DS4MLX_PREFILL_LINEARS=dequant" "default"; do
  log "prefill 2K..32K, MLX 2-bit experts, $v"
  env ${v/default/} DS4MLX_DECODE=legacy timeout 130 python3 -u -m ds4mlx.cli bench --synthetic v4-flash --expert-format mlx \
      --ctx-start 2048 --ctx-max 32768 --step-mul 4 --gen-tokens 0 --time-budget 100 --csv "$OUT/prefill_${v%%=*}.csv" 2>&1 \
      | grep "prefill_tps" | tee -a "$OUT/log.txt"
done
log done
