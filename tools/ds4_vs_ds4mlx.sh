#!/usr/bin/env bash
# ds4 itself (antirez/ds4, its CUDA backend) against ds4mlx on the
# same synthetic q2 GGUF, one device call, results under $OUT.  From the project root:
#   bash tools/device.sh ds4      carry [".gpu/b", ".devstage/ds4src", ".devstage/ds4bin"]
# (a fresh machine needs the usual call 1 of shared/gpu/README.md first: .gpu/a -> /root/gpu).
# .devstage/ds4src: ds4's source as fetched (git-ignored, never committed), ~7 MB.
# .devstage/ds4bin/ds4-bench-L<N>: ds4-bench built off the device by tools/ds4_build_cuda.sh
# (CUDA 13.0 nvcc, sm_90, layers N; .devstage/ds4bin holds N=20, .devstage/ds4bin-L10 N=10:
# carry that one instead with LAYERS=10), used when present; else ds4 is built here with the
# device's nvcc.  Phases, each timed and boxed with `timeout`:
#   0 environment (nvcc, CUDA dirs, GPU, disk, the cuBLAS ds4 links)   1 ds4-bench: prebuilt or build
#   2 write the GGUF (tools/ds4_synthetic_gguf.py, LAYERS layers, real shapes, ~2 GB a layer)
#   3 ds4-bench on it    4 ds4mlx bench on it (same text, same frontiers)    5 the side-by-side table
# Env: LAYERS (20: ds4 hard-codes 43, patched; 43 q2 layers are ~87 GB, over the 64 GiB disk),
# CTX_START 2048, CTX_MAX 32768, STEP_MUL 2, GEN 32, WRITE_S / DS4_S / MLX_S (phase boxes; MLX_S
# defaults to what is left of CALL_S=570 s), MLX_BUDGET (ds4mlx bench --time-budget), GGUF (file path: /dev/shm when it has room, else /tmp), DS4_BUILD (auto | device | prebuilt),
# DS4_ENV (ds4's environment, default DS4_CUDA_COPY_MODEL=1; "" = ds4's defaults), KEEP=1.
set -u
OUT=${OUT:-out/h200}; mkdir -p "$OUT"
root=$PWD
LAYERS=${LAYERS:-20}
# the file goes to /dev/shm when it has room (no disk in the way of writing and reading it),
# else to /tmp (the 64 GiB disk); ~2.0 GB a layer + 1.7 GB embedding and head, 8 GB spare
need_kb=$(( (LAYERS * 2000 + 1700 + 8000) * 1000 ))
shm_kb=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
if [ -z "${GGUF:-}" ]; then
  if [ "${shm_kb:-0}" -gt "$need_kb" ] 2>/dev/null; then GGUF=/dev/shm/ds4_q2_${LAYERS}.gguf; else GGUF=/tmp/ds4_q2_${LAYERS}.gguf; fi
fi
SRC=${DS4_SRC:-$root/.devstage/ds4src}
PREBUILT=${DS4_PREBUILT:-$root/.devstage/ds4bin/ds4-bench-L$LAYERS}
[ -x "$PREBUILT" ] || [ ! -x "$root/.devstage/ds4bin-L$LAYERS/ds4-bench-L$LAYERS" ] || PREBUILT=$root/.devstage/ds4bin-L$LAYERS/ds4-bench-L$LAYERS
TEXT=$SRC/speed-bench/promessi_sposi.txt
CTX_START=${CTX_START:-2048} CTX_MAX=${CTX_MAX:-32768} STEP_MUL=${STEP_MUL:-2} GEN=${GEN:-32}
py=python3
T0=$(date +%s)
log() { echo "== $(date -u +%T) +$(( $(date +%s) - T0 ))s $*" | tee -a "$OUT/log.txt"; }
phase_t=$T0
phase() { local now; now=$(date +%s); log "[phase done in $((now - phase_t)) s] -> $*"; phase_t=$now; }

log "0 environment (layers $LAYERS, file $GGUF, frontiers $CTX_START..$CTX_MAX x$STEP_MUL, gen $GEN)"
{
  echo "--- which nvcc; nvcc --version; ls /usr/local/cuda*"
  which nvcc || echo "no nvcc on PATH"
  nvcc --version 2>&1 | tail -2 || true
  ls -d /usr/local/cuda* 2>&1
  for d in /usr/local/cuda*/bin; do [ -x "$d/nvcc" ] && echo "toolkit nvcc: $d/nvcc"; done
  echo "--- gcc / make"; which cc gcc make 2>&1
  echo "--- GPU"; nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1
  echo "--- disk / memory / cores"; df -h /tmp /dev/shm "$root" 2>&1; free -g 2>&1; nproc
  echo "--- ds4 source"; du -sh "$SRC" 2>&1; ls -la "$PREBUILT" 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" | tee -a "$OUT/log.txt"
# cuBLAS / cudart 13: the pip packages MLX's CUDA build uses (nvidia/cu13/lib), or a toolkit's lib64
cudalibs=$($py - <<'EOF'
import glob, os, sys
hits = []
roots = [p for p in sys.path if os.path.isdir(os.path.join(p, "nvidia"))]
for r in roots:
    for f in glob.glob(os.path.join(r, "nvidia", "**", "libcublas.so*"), recursive=True):
        hits.append(os.path.dirname(f))
for f in glob.glob("/usr/local/cuda*/lib64/libcublas.so*") + glob.glob("/usr/local/cuda*/targets/*/lib/libcublas.so*"):
    hits.append(os.path.dirname(f))
print(":".join(dict.fromkeys(hits)))
EOF
)
log "cuBLAS found in: ${cudalibs:-NOWHERE}"
export LD_LIBRARY_PATH=${cudalibs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
phase "1 ds4-bench"

# 1 ds4-bench: the prebuilt binary (built off the device for these LAYERS) or a build here,
# in the background while the GGUF is written
BIN=$OUT/ds4build/ds4-bench
mkdir -p "$OUT/ds4build"
mode=${DS4_BUILD:-auto}
if [ "$mode" = auto ]; then
  if [ -x "$PREBUILT" ]; then mode=prebuilt; else mode=device; fi
fi
if [ "$mode" = prebuilt ]; then
  cp "$PREBUILT" "$BIN" && log "ds4-bench: prebuilt $PREBUILT" || log "FAILED: no prebuilt ds4-bench at $PREBUILT"
  build_pid=""
else
  log "ds4-bench: building on the device (make ds4-bench, CUDA_ARCH=sm_90, DS4_N_LAYER=$LAYERS)"
  # the pip nvidia-cublas carries headers next to its library; point the build at it if the toolkit has none
  cub=""
  for d in ${cudalibs//:/ }; do [ -f "$d/../include/cublas_v2.h" ] && cub=$(cd "$d/.." && pwd) && break; done
  ( CUBLAS_HOME=$cub JOBS=8 timeout 420 bash "$root/tools/ds4_build_cuda.sh" "$SRC" "$LAYERS" "/tmp/ds4build" \
      > "$OUT/ds4_build.txt" 2>&1 && cp /tmp/ds4build/ds4-bench "$BIN" ) &
  build_pid=$!
fi

# 2 the GGUF
if [ -f "$GGUF" ] && [ "${REWRITE:-0}" != 1 ]; then
  log "2 GGUF already there: $(du -h "$GGUF" | cut -f1)"
else
  log "2 write the $LAYERS-layer q2 GGUF"
  timeout ${WRITE_S:-240} $py -u "$root/tools/ds4_synthetic_gguf.py" --layers "$LAYERS" --threads 12 "$GGUF" \
      2>&1 | tee -a "$OUT/log.txt"
fi
ls -la "$GGUF" 2>&1 | tee -a "$OUT/log.txt"
df -h "$(dirname "$GGUF")" | tail -1 | tee -a "$OUT/log.txt"
phase "3 ds4-bench"

if [ -n "${build_pid:-}" ]; then
  wait "$build_pid"; log "device build rc=$?"; tail -5 "$OUT/ds4_build.txt" | tee -a "$OUT/log.txt"
fi
# 3 ds4-bench
if [ -x "$BIN" ] && [ -f "$GGUF" ]; then
  ldd "$BIN" 2>&1 | grep -E "cublas|cudart|not found" | tee -a "$OUT/log.txt"
  # ds4's CUDA backend by default cudaHostRegister()s the mapped file and reads the weights
  # over PCIe (right for DGX Spark's shared memory, not for an H200): DS4_CUDA_COPY_MODEL=1
  # copies the whole file into HBM first (ds4_cuda.cu ds4_gpu_set_model_map)
  log "ds4 env: ${DS4_ENV-DS4_CUDA_COPY_MODEL=1}"
  timeout ${DS4_S:-180} env ${DS4_ENV-DS4_CUDA_COPY_MODEL=1} "$BIN" -m "$GGUF" --prompt-file "$TEXT" --ctx-start "$CTX_START" --ctx-max "$CTX_MAX" \
      --step-mul "$STEP_MUL" --gen-tokens "$GEN" --csv "$OUT/ds4.csv" > "$OUT/ds4.txt" 2>&1
  log "ds4-bench rc=$?"
  tr '\r' '\n' < "$OUT/ds4.txt" | grep -v "prefill layer\|^$" | tail -25 | cut -c1-300 | tee -a "$OUT/log.txt"
  cat "$OUT/ds4.csv" 2>/dev/null | tee -a "$OUT/log.txt"
else
  log "FAILED: ds4-bench not run (binary: $( [ -x "$BIN" ] && echo ok || echo missing ), file: $( [ -f "$GGUF" ] && echo ok || echo missing ))"
fi
phase "4 ds4mlx bench"

# 4 ds4mlx bench, same file, same text, same frontiers
# its box: what is left of a 10-minute device call (CALL_S, 570 s with a margin), at most 300 s;
# the bench's own --time-budget leaves ~110 s of that to loading and the warm-up
left=$(( ${CALL_S:-570} - ($(date +%s) - T0) ))
MLX_S=${MLX_S:-$(( left < 300 ? left : 300 ))}
MLX_BUDGET=${MLX_BUDGET:-$(( MLX_S > 150 ? MLX_S - 110 : MLX_S / 2 ))}
if [ -f "$GGUF" ] && [ "$MLX_S" -gt 30 ]; then
  log "ds4mlx bench: box ${MLX_S} s, --time-budget ${MLX_BUDGET}"
  timeout ${MLX_S} $py -u -m ds4mlx.cli bench -m "$GGUF" --text "$TEXT" --ctx-start "$CTX_START" \
      --ctx-max "$CTX_MAX" --step-mul "$STEP_MUL" --gen-tokens "$GEN" --time-budget ${MLX_BUDGET} \
      --csv "$OUT/ds4mlx.csv" > "$OUT/ds4mlx.txt" 2>&1
  log "ds4mlx bench rc=$?"
  tail -12 "$OUT/ds4mlx.txt" | cut -c1-400 | tee -a "$OUT/log.txt"
else
  log "ds4mlx bench not run (file $( [ -f "$GGUF" ] && echo ok || echo missing ), ${MLX_S} s left)"
fi
phase "5 table"

# 5 side by side
$py "$root/tools/ds4_side_by_side.py" "$OUT/ds4.csv" "$OUT/ds4mlx.csv" --layers "$LAYERS" \
    --csv "$OUT/side_by_side.csv" 2>&1 | tee -a "$OUT/log.txt"
[ "${KEEP:-1}" = 1 ] || rm -f "$GGUF"
log "done"
