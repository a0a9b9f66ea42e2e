#!/usr/bin/env bash
# Issue #16 on the lent H200 (MLX CUDA), results under $OUT: a synthetic V4 Flash with
# the real shapes and 20 layers (~43 GB) written as a ds4 q2 GGUF to the device's disk,
# loaded with the one-tensor-at-a-time loader (load time, peak RSS, MLX peak), then its
# decode t/s (float32 activations) against the same model built in memory.
# Staging as tools/h200_run.sh (source .gpu/b/setup.sh first).  Not run yet.
set -u
OUT=${OUT:-out/h200}
LAYERS=${LAYERS:-20}
F=${F:-/tmp/ds4mlx_q2_${LAYERS}.gguf}
mkdir -p "$OUT"
py=python3
log() { echo "== $(date -u +%FT%TZ) $*" | tee -a "$OUT/log.txt"; }
log "write $LAYERS-layer q2 GGUF"
timeout 280 $py -m ds4mlx.bench.load_memory write-gguf "$F" --layers "$LAYERS" | tee -a "$OUT/log.txt"
log "load memory"
timeout 200 $py -m ds4mlx.bench.load_memory measure "$F" | tee "$OUT/load_memory.json" | tee -a "$OUT/log.txt"
log "decode: file vs in memory"
timeout 280 $py -m ds4mlx.bench.load_memory decode "$F" --layers "$LAYERS" | tee "$OUT/decode.json" | tee -a "$OUT/log.txt"
rm -f "$F"
