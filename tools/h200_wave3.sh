#!/usr/bin/env bash
# This wave's one device session after staging (issues #13, #14): the compiled decode step's
# launches, host/device split and t/s at 2K with its GPU attention checked against the plain
# step, then the prefill frontier with the prefill profile (tools/h200_prefill.sh phase M).
#   call 1: mkdir -p /root/gpu && cp .gpu/a/part_aa /root/gpu/               (carry .gpu/a)
#   call 2: source .gpu/b/setup.sh && bash tools/h200_wave3.sh               (carry .gpu/b .ptxcache)
set -u
OUT=${OUT:-out/h200}; mkdir -p "$OUT"
export MLX_PTX_CACHE_DIR=/root/ptx; mkdir -p "$MLX_PTX_CACHE_DIR"
[ -f .ptxcache/ptx.tgz ] && tar xzf .ptxcache/ptx.tgz -C /root
log() { echo "== $(date -u +%T) $*" | tee -a "$OUT/log.txt"; }
log "decode probe (PTX cache: $(ls $MLX_PTX_CACHE_DIR | wc -l) files)"
timeout ${DECODE_S:-300} python3 -u tools/decode_probe.py --check-kernel --count-layers 6 --layers 43 --ctx 2048 \
    --check-plain 2>&1 | grep -v Warning | tee "$OUT/decode.txt" | cut -c1-700
tar czf "$OUT/ptx.tgz" -C /root ptx
log "prefill frontier + profile"
BENCH_S=${PREFILL_S:-230} BUDGET_S=${PREFILL_BUDGET_S:-150} bash tools/h200_prefill.sh M > /dev/null 2>&1
grep -v '^ds4mlx: dtype' "$OUT/prefill_mlx.txt" | tail -40 | cut -c1-300
tar czf "$OUT/ptx.tgz" -C /root ptx
log done
