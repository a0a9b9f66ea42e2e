#!/usr/bin/env bash
# Session 9 on the lent H200: the acceptance runs of #15 (GPU tests), #16 (a q2 GGUF on the
# device's disk), #21 (verify cost) and #20 (batched sessions), three calls after staging.
#   call 1: mkdir -p /root/gpu && cp .gpu/a/part_aa /root/gpu/ && cp .gpu/tcA/tc.tar /root/   (carry .gpu/a .gpu/tcA)
#   call 2: bash tools/h200_s9.sh T     (carry .gpu/b .gpu/tcB): GPU tests; the GGUF written meanwhile
#   call 3: bash tools/h200_s9.sh W     (no carry: /root/site, /root/ptx, /tmp stay on a warm machine)
#   call 4: bash tools/h200_s9.sh B
# (.gpu/tcA + tcB: the tiny oracle models the GPU tests load, split so that no call carries
# more than 64 MiB; the device builds none.)
set -u
OUT=${OUT:-out/h200}; mkdir -p "$OUT"
if [ -f .gpu/b/setup.sh ]; then source .gpu/b/setup.sh
else export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1; fi
source tools/h200_probe_lib.sh
LAYERS=${LAYERS:-20}
F=/tmp/ds4mlx_q2_${LAYERS}.gguf
case "${1:-T}" in
T)
  mkdir -p /root/tc && tar xf /root/tc.tar -C /root/tc && { [ ! -f .gpu/tcB/tc.tar ] || tar xf .gpu/tcB/tc.tar -C /root/tc; }
  log "write the $LAYERS-layer q2 GGUF in the background (CPU + disk)"
  ( timeout 420 nice python3 -m ds4mlx.bench.load_memory write-gguf "$F" --layers "$LAYERS" > "$OUT/write_gguf.txt" 2>&1
    echo "rc=$?" >> "$OUT/write_gguf.txt" ) &
  writer=$!
  log "pytest -m gpu"
  DS4MLX_TEST_CACHE=/root/tc timeout "${TEST_S:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
      --tb=short > "$OUT/gpu_tests.txt" 2>&1
  echo "rc=$?" >> "$OUT/gpu_tests.txt"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -30 | tee -a "$OUT/log.txt"
  wait $writer; cat "$OUT/write_gguf.txt" | tee -a "$OUT/log.txt"; ls -la "$F" >> "$OUT/log.txt" 2>&1
  keep
  ;;
W)
  log "load memory of $F"
  timeout 150 python3 -m ds4mlx.bench.load_memory measure "$F" 2>&1 | tail -3 | tee "$OUT/load_memory.json" | tee -a "$OUT/log.txt"
  log "decode: file vs in memory, float32 activations"
  timeout "${DEC_S:-280}" python3 -m ds4mlx.bench.load_memory decode "$F" --layers "$LAYERS" > "$OUT/decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/decode.txt"; tail -4 "$OUT/decode.txt" | tee -a "$OUT/log.txt"
  rm -f "$F"
  log "speculative verify cost (#21)"
  timeout "${SPEC_S:-200}" python3 -u tools/spec_bench.py --ctx 2048 --gen 32 --reps 6 --csv "$OUT/spec_bench.csv" \
      > "$OUT/spec_bench.txt" 2>&1
  echo "rc=$?" >> "$OUT/spec_bench.txt"; tail -30 "$OUT/spec_bench.txt" | tee -a "$OUT/log.txt"
  keep
  ;;
B)
  log "batched sessions N = 1..16 (#20)"
  BUDGET_S=${BUDGET_S:-480} OUT=$OUT bash tools/h200_batching.sh 2>&1 | tee -a "$OUT/log.txt"
  keep
  ;;
V)  # (a cold machine: call 1 again, then this with carry .gpu/b .ptxcache) the twobank failure's message, then
    # the GPU tests of the other kernels still in dispatch.UNVERIFIED_KERNELS, one line a test
  mkdir -p /root/tc && tar xf /root/tc.tar -C /root/tc
  export DS4MLX_TEST_CACHE=/root/tc
  timeout 120 python3 -m pytest -v -m gpu -p no:cacheprovider --tb=short \
      "tests/test_affine_qmv.py::test_gpu_twobank_v4_flash_shapes_equal_reference" > "$OUT/twobank.txt" 2>&1
  grep -E "^E |PASSED|FAILED|Error" "$OUT/twobank.txt" | head -40 | tee -a "$OUT/log.txt"
  timeout "${TEST_S:-200}" python3 -m pytest -v -m gpu -p no:cacheprovider --tb=line tests/test_quant_moe.py \
      tests/test_kernel_sparse_attention.py -k "fused_modes or dequant or index_topk or index_scores" \
      > "$OUT/unverified.txt" 2>&1
  grep -E "PASSED|FAILED|ERROR|^E " "$OUT/unverified.txt" | tail -60 | tee -a "$OUT/log.txt"
  keep
  ;;
esac
log done
