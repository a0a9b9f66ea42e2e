# Sourced by the device scripts (h200_*.sh): the output folder, MLX's CUDA build,
# MLX's PTX cache (carried as .ptxcache/ptx.txz or the committed devcache/ptx.txz, unpacked once per machine),
# a log line, the cache kept for the next session, and the probe with its warnings filtered.
set -u
OUT=${OUT:-out/h200}; mkdir -p "$OUT"
# MLX's CUDA build: .gpu/b/setup.sh when carried (installs it once per warm machine), else the
# install a call before this one left in /root/site; skipped when a script already did either
if [[ ":${PYTHONPATH:-}:" != *":/root/site:"* ]]; then
  if [ -f .gpu/b/setup.sh ]; then source .gpu/b/setup.sh
  else export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1; fi
fi
# (xz -1: ~5 MB for MLX's kernels and ours, where gzip needs 13 MB of the 64 MiB a call carries;
# the generated .cu sources are left out: MLX loads an entry from its .ptx and .txt)
export MLX_PTX_CACHE_DIR=/root/ptx; mkdir -p "$MLX_PTX_CACHE_DIR"
for f in .ptxcache/ptx.txz .ptxcache/ptx.tgz devcache/ptx.txz; do  # this session's newest, else the committed one
  [ -f "$f" ] && [ ! -f /root/ptx/.unpacked ] && tar xf "$f" -C /root && touch /root/ptx/.unpacked
done
log() { echo "== $(date -u +%T) $*" | tee -a "$OUT/log.txt"; }
keep() {
  if command -v xz >/dev/null; then tar -I "xz -T0 -1" --exclude='*.cu' -cf "$OUT/ptx.txz" -C /root ptx
  else tar czf "$OUT/ptx.tgz" --exclude='*.cu' -C /root ptx; fi
}
probe() { local t=$1; shift; timeout "$t" python3 -u tools/wave4_probe.py "$@" 2>&1 | grep -v "_warn_once\|UserWarning\|warnings.warn\|device_time_total\|cuda_time_total"; }
