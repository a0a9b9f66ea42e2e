#!/usr/bin/env bash
# MLX CUDA command-buffer settings vs the compiled decode step (issue #13): one process per
# setting (MLX reads them at start), the 43-layer synthetic V4 Flash at 2K.  The PTX cache
# travels back as $OUT/ptx.tgz (carry it next time: tar xzf into $MLX_PTX_CACHE_DIR).
#   source .gpu/b/setup.sh && bash tools/h200_graphs.sh
set -u
OUT=${OUT:-out/h200}; mkdir -p "$OUT"
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/root/ptx}; mkdir -p "$MLX_PTX_CACHE_DIR"
[ -f .ptxcache/ptx.tgz ] && tar xzf .ptxcache/ptx.tgz -C "$(dirname "$MLX_PTX_CACHE_DIR")"
first=1
for v in ${VARIANTS:-"DEFAULT=1" "MLX_USE_CUDA_GRAPHS=0" "MLX_MAX_MB_PER_BUFFER=1000000 MLX_MAX_OPS_PER_BUFFER=100000" "MLX_MAX_MB_PER_BUFFER=1000000 MLX_MAX_OPS_PER_BUFFER=400"}; do
  echo "=== $(date -u +%T) $v"
  lim=100; [ $first = 1 ] && lim=${FIRST_S:-280}; first=0
  env $v timeout $lim python3 -u tools/decode_probe.py --count-layers 0 --layers 43 --ctx ${CTX:-2048} \
      --modes compiled 2>&1 | grep -v Warning | grep "step\|loop\|Error\|error"
  tar czf "$OUT/ptx.tgz" -C "$(dirname "$MLX_PTX_CACHE_DIR")" "$(basename "$MLX_PTX_CACHE_DIR")"
done
