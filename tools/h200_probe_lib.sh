# Sourced by the device scripts that run tools/wave4_probe.py (h200_wave4.sh, h200_s6.sh):
# the output folder, MLX's PTX cache (carried as .ptxcache/ptx.tgz, unpacked once per machine),
# a log line, the cache kept for the next session, and the probe with its warnings filtered.
set -u
OUT=${OUT:-out/h200}; mkdir -p "$OUT"
export MLX_PTX_CACHE_DIR=/root/ptx; mkdir -p "$MLX_PTX_CACHE_DIR"
[ -f .ptxcache/ptx.tgz ] && [ ! -f /root/ptx/.unpacked ] && tar xzf .ptxcache/ptx.tgz -C /root && touch /root/ptx/.unpacked
log() { echo "== $(date -u +%T) $*" | tee -a "$OUT/log.txt"; }
keep() { tar czf "$OUT/ptx.tgz" -C /root ptx; }
probe() { local t=$1; shift; timeout "$t" python3 -u tools/wave4_probe.py "$@" 2>&1 | grep -v "_warn_once\|UserWarning\|warnings.warn\|device_time_total\|cuda_time_total"; }
