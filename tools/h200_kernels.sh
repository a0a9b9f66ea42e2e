#!/usr/bin/env bash
# One time-boxed device session for the decode kernels (issue #13), results under $OUT.
#   device call 1 (cold machine): mkdir -p /root/gpu && cp .gpu/a/part_aa /root/gpu/        (carry .gpu/a)
#   device call 2: source .gpu/b/setup.sh && cd .devstage/kernels && bash tools/h200_kernels.sh [PHASES]
# Phases (default "T Q"): T the affine-qmv / hyper-connection GPU tests; Q the dependent-chain
# mat-vec GB/s table (bench_kernels --qmv); H the hyper-connection per-call times;
# M the 43-layer synthetic model, kernels on / off, MLX experts (CTX, default 2048).
set -u
OUT=${OUT:-out/h200}
mkdir -p "$OUT"
py=python3
log() { echo "== $(date -u +%FT%TZ) $*" | tee -a "$OUT/log.txt"; }
log "device: $($py -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())')"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader >> "$OUT/log.txt" 2>&1
for ph in ${@:-T Q}; do
  case $ph in
    T) log "gpu tests"
       MLX_ENABLE_TF32=0 timeout ${T_LIMIT:-150} $py -m pytest -q -m gpu -p no:cacheprovider -rf -x \
           ${TESTS:-tests/test_affine_qmv.py} > "$OUT/gpu_tests.txt" 2>&1
       tail -8 "$OUT/gpu_tests.txt" | tee -a "$OUT/log.txt" ;;
    Q) log "dependent-chain mat-vec GB/s"
       timeout ${Q_LIMIT:-240} $py -m ds4mlx.bench.kernels --qmv ${SWEEP:+--qmv-sweep} --no-micro --no-layer --no-model \
           --json "$OUT/qmv.json" > "$OUT/qmv.txt" 2>&1
       cat "$OUT/qmv.txt" | tee -a "$OUT/log.txt" ;;
    H) log "hyper-connection per call"
       timeout ${H_LIMIT:-60} $py -c "from ds4mlx.bench import kernels as b; b.bench_hc(200)" \
           > "$OUT/hc.txt" 2>&1
       cat "$OUT/hc.txt" | tee -a "$OUT/log.txt" ;;
    M) log "43-layer synthetic, MLX experts, kernels off / on"
       timeout ${M_LIMIT:-200} $py -m ds4mlx.bench.kernels --no-micro --no-layer --layers 43 \
           --ctx ${CTX:-2048} --gen 16 --expert-format mlx > "$OUT/model_mlx.txt" 2>&1
       tail -4 "$OUT/model_mlx.txt" | tee -a "$OUT/log.txt" ;;
  esac
done
log done
