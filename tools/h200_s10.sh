#!/usr/bin/env bash
# Session 10 on the lent H200: #15's GPU tests, #16's file-vs-memory decode and #19's
# streaming rows, all on ONE 20-layer V4 Flash q2 GGUF (random IQ2_XXS / Q2_K experts,
# random f16 rest: routing is not degenerate, unlike load_memory's constant file).
#   call 1: mkdir -p /root/gpu && cp .gpu/a/part_aa /root/gpu/ && cp .gpu/tcA/tc.tar /root/   (carry .gpu/a .gpu/tcA)
#   call 2: bash tools/h200_s10.sh G   (carry .gpu/b): GPU tests; the GGUF written meanwhile
#   call 3: bash tools/h200_s10.sh D   (no carry: /root, /tmp stay on a warm machine)
#   call 4: bash tools/h200_s10.sh S
set -u
source tools/h200_probe_lib.sh  # $OUT, MLX's CUDA build, the kernel cache, log / keep
LAYERS=${LAYERS:-20}
F=/tmp/ds4mlx_ssd_${LAYERS}.gguf
SSD="tools/ssd_bench.py --shapes v4-flash --layers $LAYERS --expert-format q2 --out $F"
case "${1:-G}" in
G)
  log "write the $LAYERS-layer q2 GGUF in the background"
  ( timeout "${WRITE_S:-500}" nice python3 $SSD --build-only > "$OUT/write_gguf.txt" 2>&1
    echo "rc=$?" >> "$OUT/write_gguf.txt" ) &
  writer=$!
  TEST_S=${TEST_S:-470} bash tools/h200_gpu_tests.sh
  wait $writer; cat "$OUT/write_gguf.txt" | tee -a "$OUT/log.txt"; ls -la "$F" >> "$OUT/log.txt" 2>&1
  df -h /tmp | tail -1 >> "$OUT/log.txt"
  keep
  ;;
D)
  log "decode: file vs in memory, float32 activations (#16)"
  timeout "${DEC_S:-540}" python3 -m ds4mlx.bench.load_memory decode "$F" --layers "$LAYERS" > "$OUT/decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/decode.txt"; tail -12 "$OUT/decode.txt" | tee -a "$OUT/log.txt"
  keep
  ;;
S)
  log "expert streaming rows (#19)"
  timeout "${SSD_S:-540}" python3 $SSD --no-resident --budgets 10,25,50,100 --prompt 512 --chunk 512 --gen 32 \
      --drop-caches --csv "$OUT/ssd_h200.csv" > "$OUT/ssd.txt" 2>&1
  echo "rc=$?" >> "$OUT/ssd.txt"; tail -14 "$OUT/ssd.txt" | tee -a "$OUT/log.txt"
  keep
  ;;
esac
log done
