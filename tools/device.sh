#!/usr/bin/env bash
# Device runs on a lent GPU machine (MLX CUDA), one script with named phases; results and logs
# under $OUT (default out/device).  Staging, carry lists and the 64 MiB limit: docs/device.md.
#
#   bash tools/device.sh PHASE [PHASE ...]        e.g.  bash tools/device.sh gpu-tests
#                                                       bash tools/device.sh decode serve
# Phases (each time-boxed with `timeout`; the *_S variables change the boxes):
#   gpu-tests [FILES]  every `pytest -m gpu` file (4 xdist workers, a per-test timeout), or FILES;
#                      the tiny oracle models from /root/tc.tar when staged (tools/stage_gpu_oracles.py)
#   decode             synthetic 43-layer V4 Flash decode at CTXS (2048 32768) per expert format in
#                      FORMATS (mlx gguf), caches jumped to the context, GPU time per kernel
#   decode-modes       decode with the legacy forward vs the compiled static step in one process
#                      (tools/decode_before_after.py), with the compiled step's launches per token
#   prefill            `ds4mlx bench` prefill 2K..32K per format in FORMATS at each chunk in CHUNKS
#                      (2048), then the prefill profile at 512 / 2,048-token chunks
#   prefill-experts    one layer's routed experts at prefill: grouped GEMMs (GGUF: dequantized slices, grouped_blocks,
#                      grouped_blocks_mma side by side) vs per pair (PE_CHUNKS; PE_ARGS, e.g. --split: GGUF dequant, GEMM
#                      and grouped_qmm (float32 FMA, mma) apart)
#   kernels            `python -m ds4mlx.bench.kernels` $KERNELS_ARGS (default: --qmv --qmv-rows
#                      --qmoe, the micro / layer / model tables off)
#   kernels-model      the 43-layer model with the kernels on vs off, per format in FORMATS
#   batched            batched sessions N = SLOTS (1,2,4,8,16) concurrent streams (tools/bench_batched.py)
#   numerics           the compiled decode step vs the full forward under the float32 activation policy,
#                      4 layers at V4 Flash shapes (tools/gpu_policy_check.py; docs/numerics.md: <= 1e-3)
#   spec               speculative decoding: verify cost, self-draft, break-even (tools/spec_bench.py)
#   structured         structured output's per-token cost: free vs json_schema jobs, llguidance's mask
#                      time per token and its share of a step (tools/structured_cost.py), synthetic V4 Flash
#   serve              `ds4mlx serve` streamed vs `bench` decode at 2K, per format in FORMATS
#   engine             the engine in process (a Job, no HTTP) vs `bench` decode at CTX (2048), per format in
#                      FORMATS, with bench's profile columns and the engine's GPU-busy (serve_vs_bench.py --engine)
#                      then per path (bench loop, engine, batched-session slots, HTTP SSE) wall / CPU / decode
#                      thread / token-read wait us per token and the worker's cProfile (ds4mlx.bench.engine_host)
#   profile            `ds4mlx bench --profile` 2K..32K per format in FORMATS: GPU-busy ms, launches, host ms,
#                      % of roofline per frontier (CSV), then the op-family profile at 2K
#   mlxlm              mlx-lm's deepseek_v41 on the same shapes, bits and weights (tools/mlxlm_side_by_side.py)
#   ds4                ds4 itself on a synthetic q2 GGUF against ds4mlx (tools/ds4_vs_ds4mlx.sh)
#   kv                 the disk KV cache at 32K: restore vs re-prefill
#   weights            a LAYERS-layer q2 GGUF on disk: load memory, decode from the file vs in memory
#   ssd                expert streaming at budgets 10..100 % (tools/ssd_bench.py; writes the GGUF first)
#   graphs             MLX CUDA command-buffer settings vs the compiled step, one process each
#   vision             the vision tower's encode times (tools/vision_bench.py)
# MODEL_LAYERS (43; 20 on an H100) sets the synthetic V4 Flash's depth for every model phase.
# Before / after: BEFORE=DIR (a `git archive REV ds4mlx` unpacked there) adds a run of the same
# decode / prefill phase over that tree, labelled "before", back to back with this tree's.
# The PTX cache: .ptxcache/ptx.txz when carried is unpacked into $MLX_PTX_CACHE_DIR once per machine;
# every phase leaves the current cache as $OUT/ptx.txz (copy it into .ptxcache/ for the next call).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/device}; mkdir -p "$OUT"
# MLX's CUDA build: .gpu/b/setup.sh when carried, else what an earlier call left in /root/site
if [[ ":${PYTHONPATH:-}:" != *":/root/site:"* ]]; then
  if [ -f .gpu/b/setup.sh ]; then source .gpu/b/setup.sh
  else export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1; fi
fi
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/root/ptx}; mkdir -p "$MLX_PTX_CACHE_DIR"
for f in .ptxcache/ptx.txz .ptxcache/ptx.tgz; do
  [ -f "$f" ] && [ ! -f "$MLX_PTX_CACHE_DIR/.unpacked" ] && tar xf "$f" -C "$(dirname "$MLX_PTX_CACHE_DIR")" \
    && touch "$MLX_PTX_CACHE_DIR/.unpacked"
done
FORMATS=${FORMATS:-mlx gguf}
CTXS=${CTXS:-2048 32768}
# synthetic V4 Flash layers: 43 (the real model, ~95 GB with 2-bit experts) fits an H200, an H100 takes 20
MODEL_LAYERS=${MODEL_LAYERS:-43}
LAYERS=${LAYERS:-20}  # weights / ssd: layers of the on-disk q2 GGUF (~2 GB a layer)
NOISE="_warn_once\|UserWarning\|warnings.warn\|device_time_total\|cuda_time_total\|^ds4mlx: dtype"

log() { echo "== $(date -u +%FT%TZ) $*" | tee -a "$OUT/log.txt"; }
keep() {  # the PTX cache as it is now (xz -1: ~5 MB where gzip needs 13 of a call's 64 MiB)
  local d; d=$(dirname "$MLX_PTX_CACHE_DIR")
  if command -v xz >/dev/null; then tar -I "xz -T0 -1" --exclude='*.cu' -cf "$OUT/ptx.txz" -C "$d" "$(basename "$MLX_PTX_CACHE_DIR")"
  else tar czf "$OUT/ptx.tgz" --exclude='*.cu' -C "$d" "$(basename "$MLX_PTX_CACHE_DIR")"; fi
}
quiet() { grep -v "$NOISE"; }
py() { local t=$1; shift; timeout "$t" python3 -u "$@" 2>&1 | quiet; }
# this tree, then (BEFORE=DIR) the tree there: `both LABEL CMD...` runs CMD with --label LABEL / before
both() {
  local label=$1; shift
  "$@" --label "$label"
  if [ -n "${BEFORE:-}" ]; then PYTHONPATH=$PWD/$BEFORE:$PYTHONPATH "$@" --label before; fi
}
probe() { py "${PROBE_S:-200}" tools/frontier_probe.py --layers "$MODEL_LAYERS" "$@"; }
frontier() {  # $1 format, $2 chunk, $3 csv name: prefill 2K..32K, decode not measured
  DS4MLX_PREFILL_CHUNK=$2 DS4MLX_DECODE=legacy timeout "${PREFILL_S:-130}" python3 -u -m ds4mlx.cli bench \
    --synthetic v4-flash --layers "$MODEL_LAYERS" --expert-format "$1" --ctx-start 2048 --ctx-max "${CTX_MAX:-32768}" --step-mul 4 \
    --gen-tokens 0 --time-budget "${PREFILL_BUDGET_S:-100}" --csv "$OUT/$3.csv" 2>&1 | grep "prefill_tps"
}

log "device: $(python3 -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())' 2>&1 | tail -1)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$OUT/log.txt" 2>&1
[ $# -gt 0 ] || { sed -n 2,30p "$0"; exit 2; }

phase=$1; shift
case "$phase" in
gpu-tests)
  mkdir -p /root/tc && { [ ! -f /root/tc.tar ] || tar xf /root/tc.tar -C /root/tc; }
  export DS4MLX_TEST_CACHE=/root/tc
  # the serve test modules import jsonschema, which device images may lack
  files=${*:-$(grep -l "mark.gpu" tests/test_*.py | xargs grep -L "jsonschema" | tr '\n' ' ')}
  log "pytest -m gpu on: $files"
  timeout "${TEST_S:-540}" python3 -m pytest -m gpu -p no:cacheprovider -n "${WORKERS:-4}" --timeout "${PER_TEST_S:-240}" \
    -v --tb=short -rfE --durations=25 $files > "$OUT/gpu_tests.txt" 2>&1
  echo "rc=$?" >> "$OUT/gpu_tests.txt"
  grep -E "(PASSED|FAILED|ERROR|SKIPPED).*::|::.*(PASSED|FAILED|ERROR|SKIPPED)" "$OUT/gpu_tests.txt" > "$OUT/gpu_tests_lines.txt"
  grep -E "^E |^FAILED|^ERROR|Error" "$OUT/gpu_tests.txt" | head -80 > "$OUT/gpu_failures.txt"
  log "$(grep -c PASSED "$OUT/gpu_tests_lines.txt") passed, $(grep -c -E 'FAILED|ERROR' "$OUT/gpu_tests_lines.txt") failed"
  tail -3 "$OUT/gpu_tests.txt" | tee -a "$OUT/log.txt"; head -40 "$OUT/gpu_failures.txt"
  keep   # the tests' NVRTC builds: without them a cold card's V4-shaped cases pass their timeout
  ;;
decode)
  for fmt in $FORMATS; do
    log "decode, $fmt experts, $CTXS, GPU time per kernel"
    both "head-$fmt" probe --expert-format "$fmt" --ctx $CTXS --fake-context --gpu-busy --top "${TOP:-15}" \
      | tee -a "$OUT/decode_$fmt.txt"
    keep
  done
  ;;
decode-modes)
  for fmt in $FORMATS; do
    log "decode, $fmt experts, legacy vs compiled at $CTXS"
    py "${DECODE_S:-560}" tools/decode_before_after.py --layers "$MODEL_LAYERS" --expert-format "$fmt" --ctx $CTXS --gen 32 --profile \
      | tee "$OUT/decode_modes_$fmt.txt" | grep -v '^#' | tail -30
    keep
  done
  ;;
prefill)
  for fmt in $FORMATS; do
    for chunk in ${CHUNKS:-2048}; do
      log "prefill 2K..${CTX_MAX:-32768}, $fmt experts, chunk $chunk"
      frontier "$fmt" "$chunk" "prefill_${fmt}_c$chunk" | tee -a "$OUT/log.txt"
      [ -z "${BEFORE:-}" ] || PYTHONPATH=$PWD/$BEFORE:$PYTHONPATH frontier "$fmt" "$chunk" "prefill_${fmt}_c${chunk}_before" \
        | sed 's/^/before: /' | tee -a "$OUT/log.txt"
    done
  done
  log "prefill profile, 512- and 2,048-token chunks"
  DS4MLX_DECODE=legacy py "${PROFILE_S:-150}" -m ds4mlx.cli bench --synthetic v4-flash --layers "$MODEL_LAYERS" \
    --expert-format mlx --ctx-start 2048 --ctx-max 2048 --gen-tokens 0 --time-budget 60 --profile-prefill --profile-chunks 512,2048 \
    | cut -c1-400 | tail -45 | tee "$OUT/prefill_profile.txt"
  keep
  ;;
prefill-experts)
  log "one layer's routed experts at prefill, grouped vs per pair"
  py "${EXPERTS_S:-240}" tools/prefill_experts_bench.py --chunks "${PE_CHUNKS:-256,2048}" ${PE_ARGS:-} | tee "$OUT/prefill_experts.txt"
  ;;
kernels)
  log "bench.kernels ${KERNELS_ARGS:---qmv --qmv-rows --qmoe}"
  py "${KERNELS_S:-300}" -m ds4mlx.bench.kernels ${KERNELS_ARGS:---qmv --qmv-rows --qmoe} --no-micro --no-layer --no-model \
    --json "$OUT/kernels.json" | tee "$OUT/kernels.txt"
  keep
  ;;
kernels-model)
  for fmt in $FORMATS; do
    log "43-layer synthetic, $fmt experts, kernels off / on"
    py "${MODEL_S:-270}" -m ds4mlx.bench.kernels --no-micro --no-layer --layers "$MODEL_LAYERS" --ctx "${CTX:-2048}" --gen 16 \
      --expert-format "$fmt" | tee "$OUT/kernels_model_$fmt.txt" | tail -4
  done
  keep
  ;;
batched)
  log "batched sessions N = ${SLOTS:-1,2,4,8,16}"
  args=(--synthetic --layers "$MODEL_LAYERS" --slots "${SLOTS:-1,2,4,8,16}" --requests-per-slot "${RPS:-1}"
        --input-len "${INPUT:-256}" --output-len "${GEN:-32}" --ctx "${CTX:-4096}")
  py "${BATCH_S:-560}" tools/bench_batched.py "${args[@]}" --json "$OUT/batched.json" | tee "$OUT/batched.txt" | tail -12
  keep
  ;;
numerics)
  log "numerics: decode step vs full forward, float32 activations, ${NUM_LAYERS:-4} layers"
  py "${NUM_S:-240}" tools/gpu_policy_check.py --layers "${NUM_LAYERS:-4}" --tokens 300 | tee "$OUT/numerics.txt"
  keep
  ;;
spec)
  log "speculative decoding: verify cost, self-draft, break-even"
  py "${SPEC_S:-200}" tools/spec_bench.py --layers "$MODEL_LAYERS" --ctx 2048 --gen 32 --reps 6 --csv "$OUT/spec_bench.csv" \
    | tee "$OUT/spec_bench.txt" | tail -25
  keep
  ;;
structured)
  log "structured output cost, synthetic V4 Flash $MODEL_LAYERS layers"
  py "${STRUCT_S:-300}" tools/structured_cost.py --layers "$MODEL_LAYERS" --jobs "${JOBS:-4}" | tee "$OUT/structured.txt" | tail -6
  keep
  ;;
serve)
  for fmt in ${FORMATS}; do
    log "serve vs bench, 2K, $fmt experts"
    py "${SERVE_S:-120}" tools/serve_vs_bench.py --layers "$MODEL_LAYERS" --expert-format "$fmt" --ctx 2048 --gen 64 \
      | tee "$OUT/serve_vs_bench_$fmt.txt" | tail -12
  done
  keep
  ;;
engine)
  for fmt in ${FORMATS}; do
    log "engine vs bench, ${CTX:-2048}, $fmt experts"
    py "${ENGINE_S:-240}" tools/serve_vs_bench.py --engine --profile --layers "$MODEL_LAYERS" --expert-format "$fmt" \
      --ctx "${CTX:-2048}" --gen "${GEN:-128}" | tee "$OUT/engine_vs_bench_$fmt.txt" | tail -8
    log "host cost per token: bench loop, engine, batched slots, HTTP SSE, ${CTX:-2048}, $fmt experts"
    py "${ENGINE_S:-240}" -m ds4mlx.bench.engine_host --synthetic --layers "$MODEL_LAYERS" --expert-format "$fmt" \
      --ctx "${CTX:-2048}" --gen "${GEN:-128}" --repeat 2 --profile | tee "$OUT/engine_host_$fmt.txt" | grep -E '^(path|bench|engine|batched|http|# )'
    log "the same with EOS and the stop ids live (every step kept undoable, as a chat request's), $fmt experts"
    py "${ENGINE_S:-240}" -m ds4mlx.bench.engine_host --synthetic --layers "$MODEL_LAYERS" --expert-format "$fmt" \
      --ctx "${CTX:-2048}" --gen "${GEN:-128}" --repeat 2 --eos --paths bench,engine | tee "$OUT/engine_host_eos_$fmt.txt" | tail -3
  done
  keep
  ;;
profile)
  for fmt in ${FORMATS}; do
    log "bench --profile 2K..${CTX_MAX:-32768}, $fmt experts"
    py "${PROFILE_S:-400}" -m ds4mlx.cli bench --synthetic v4-flash --layers "$MODEL_LAYERS" --expert-format "$fmt" \
      --ctx-start 2048 --ctx-max "${CTX_MAX:-32768}" --step-mul 4 --gen-tokens "${GEN:-64}" --profile \
      --csv "$OUT/profile_$fmt.csv" | cut -c1-400 | tail -30 | tee "$OUT/profile_$fmt.txt"
  done
  keep
  ;;
mlxlm)
  log "mlx-lm, same shapes and bits, prompt ${MLXLM_PROMPT:-2048}"
  py "${MLXLM_S:-250}" tools/mlxlm_side_by_side.py --layers "$MODEL_LAYERS" --prompt "${MLXLM_PROMPT:-2048}" --gen 32 \
    --which "${WHICH:-both}" | tee "$OUT/mlxlm.txt" | tail -15
  ;;
ds4)
  OUT=$OUT bash tools/ds4_vs_ds4mlx.sh
  ;;
kv)
  log "disk KV cache at 32K: restore vs re-prefill"
  DS4MLX_DECODE=legacy py "${KV_S:-200}" -m ds4mlx.bench.kv bench --synthetic v4-flash --tokens 32768 --dir /tmp \
    | cut -c1-400 | tee "$OUT/kv.txt" | tail -6
  ;;
weights)
  F=/tmp/ds4mlx_q2_${LAYERS}.gguf
  log "write the $LAYERS-layer q2 GGUF, load memory, decode from the file vs in memory"
  [ -f "$F" ] || py "${WRITE_S:-420}" -m ds4mlx.bench.load_memory write-gguf "$F" --layers "$LAYERS" | tail -3
  py "${LOAD_S:-150}" -m ds4mlx.bench.load_memory measure "$F" | tail -3 | tee "$OUT/load_memory.json"
  py "${DEC_S:-280}" -m ds4mlx.bench.load_memory decode "$F" --layers "$LAYERS" | tee "$OUT/decode_file.txt" | tail -12
  [ "${KEEP:-0}" = 1 ] || rm -f "$F"
  ;;
ssd)
  F=/tmp/ds4mlx_ssd_${LAYERS}.gguf
  SSD="tools/ssd_bench.py --shapes v4-flash --layers $LAYERS --expert-format q2 --out $F"
  [ -f "$F" ] || { log "write the $LAYERS-layer q2 GGUF"; py "${WRITE_S:-500}" $SSD --build-only | tail -3; }
  log "expert streaming rows"
  py "${SSD_S:-540}" $SSD --no-resident --budgets 10,25,50,100 --prompt 512 --chunk 512 --gen 32 --drop-caches \
    --csv "$OUT/ssd.csv" | tee "$OUT/ssd.txt" | tail -14
  ;;
graphs)
  for v in ${VARIANTS:-"DEFAULT=1" "MLX_USE_CUDA_GRAPHS=0" "MLX_MAX_MB_PER_BUFFER=1000000 MLX_MAX_OPS_PER_BUFFER=400"}; do
    log "$v"
    env $v timeout "${GRAPH_S:-150}" python3 -u tools/decode_probe.py --count-layers 0 --layers "$MODEL_LAYERS" --ctx "${CTX:-2048}" \
      --modes compiled 2>&1 | grep "step\|loop\|Error\|error" | tee -a "$OUT/log.txt"
    keep
  done
  ;;
vision)
  log "vision tower encode times"
  py "${VISION_S:-180}" tools/vision_bench.py --dtype bfloat16 --out "$OUT/vision_bench.json" | tail -20
  ;;
*)
  echo "unknown phase $phase"; sed -n 2,30p "$0"; exit 2
  ;;
esac
[ $# -eq 0 ] || [ "$phase" = gpu-tests ] || exec bash "$0" "$@"
log done
