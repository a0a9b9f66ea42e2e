#!/usr/bin/env bash
# Issue #13's acceptance run on the lent H200 (decode >= 60 t/s at 2K and 32K with MLX 2-bit and
# with GGUF IQ2_XXS / Q2_K experts, mlx-lm in the same run, serve within 10 % of bench), and the
# GGUF dot16 change (e735ae2) side by side with the tree before it.
#   call 1: mkdir -p /root/gpu && cp .gpu/a/part_aa /root/gpu/                 (carry .gpu/a)
#   call 2: bash tools/h200_s11.sh D      (carry .gpu/b): decode, this tree, both expert formats; mlx-lm
#   call 3: bash tools/h200_s11.sh S      (carry .whl .devstage/pre; the warm machine keeps /root/site):
#           serve vs bench (jsonschema / aiohttp wheels from .whl when missing), then GGUF decode of
#           .devstage/pre (`git archive e735ae2^ ds4mlx`) and of this tree again, back to back
#   call 4: bash tools/h200_s11.sh R      (no carry): the multi-row plain mode's GPU tests (affine_qmv.rows),
#           then speculative verify cost through the chained static step (#21) and batched sessions (#20)
#   call 5: bash tools/h200_s11.sh P      (no carry): issue #14's prefill at chunks 2048 and 4096, GGUF
#           experts, the prefill profile, the disk KV cache at 32K (~10 min: a call of its own)
# .whl: `pip download jsonschema aiohttp --only-binary=:all: --platform manylinux2014_x86_64
# --python-version 3.12 --implementation cp -d .whl` (3.7 MB, git-ignored).
source tools/h200_probe_lib.sh  # $OUT, MLX's CUDA build, the kernel cache, log / keep / probe
case "${1:-D}" in
D)
  log "decode, this tree, MLX 2-bit experts, 2K + 32K, GPU time per kernel"
  probe ${NEW_S:-110} --label head --ctx 2048 32768 --fake-context --gpu-busy --top 15 | tee "$OUT/decode_head.txt"
  keep
  log "decode, this tree, GGUF experts, 2K + 32K"
  probe ${GGUF_S:-110} --label head-gguf --expert-format gguf --ctx 2048 32768 --fake-context --gpu-busy --top 15 | tee "$OUT/decode_gguf.txt"
  keep
  log "mlx-lm, same shapes and bits"
  timeout ${MLXLM_S:-250} python3 -u tools/mlxlm_side_by_side.py --layers 43 --prompt ${MLXLM_PROMPT:-128} --gen 16 --which mlxlm 2>&1 \
      | grep -v "_warn_once\|UserWarning" | tail -15 | tee "$OUT/mlxlm.txt"
  ;;
S)
  python3 -c "import jsonschema, aiohttp" 2>/dev/null || {
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH; }
  for f in mlx gguf; do
    log "serve vs bench, 2K, $f experts"
    timeout ${SERVE_S:-120} python3 -u tools/serve_vs_bench.py --expert-format $f --ctx 2048 --gen 64 2>&1 \
        | grep -v "_warn_once\|UserWarning" | tail -12 | tee "$OUT/serve_vs_bench_$f.txt"
  done
  log "decode, before the dot16 change (.devstage/pre), GGUF experts, 2K + 32K"
  PYTHONPATH=$PWD/.devstage/pre:$PYTHONPATH probe ${BASE_S:-90} --label pre-gguf --expert-format gguf --ctx 2048 32768 --fake-context \
      | tee "$OUT/decode_gguf_pre.txt"
  log "decode, this tree, GGUF experts, 2K + 32K (back to back with the line above)"
  probe ${GGUF_S:-90} --label head-gguf --expert-format gguf --ctx 2048 32768 --fake-context | tee "$OUT/decode_gguf_head2.txt"
  keep
  ;;
R)
  log "GPU tests of the batched step's row kernels: affine_qmv rows mode, attend_rows, index_topk_rows, compressor_step_rows, attn_prep_rows"
  timeout ${ROWS_S:-150} python3 -m pytest -m gpu -p no:cacheprovider -n 4 --timeout 180 -q --tb=short \
      tests/test_affine_qmv.py -k "gpu_rows or gpu_dense_and_gather or gpu_self_tests or first_use_self_tests or rows_self_test" \
      "tests/test_kernel_sparse_attention.py::test_gpu_first_use_self_tests_pass" \
      "tests/test_kernel_compressor_step.py::test_gpu_rows_self_test_passes" \
      tests/test_kernel_attn_prep.py 2>&1 | tail -15 | tee "$OUT/rows_tests.txt"
  log "dense mat-vecs of 1..8 rows: one launch (XR rows a threadgroup) vs a row a slice"
  timeout ${RB_S:-60} python3 -u -m ds4mlx.bench.kernels --qmv-rows --no-micro --no-layer --no-model 2>&1 \
      | grep -v "_warn_once\|UserWarning" | tail -20 | tee "$OUT/qmv_rows.txt"
  keep
  log "speculative verify cost, chained static step (#21)"
  timeout ${SPEC_S:-180} python3 -u tools/spec_bench.py --ctx 2048 --gen 32 --reps 6 --csv "$OUT/spec_bench.csv" 2>&1 \
      | grep -v "_warn_once\|UserWarning" | tail -25 | tee "$OUT/spec_bench.txt"
  log "batched sessions N = 1, 8, 4 (#20)"
  SLOTS=${SLOTS:-1,8,4} BUDGET_S=${BATCH_S:-150} OUT=$OUT bash tools/h200_batching.sh 2>&1 | tail -20 | tee -a "$OUT/log.txt"
  keep
  ;;
P)
  # issue #14: the prefill bar (2,000 t/s at 8K and 32K) and its profile; chunk 4096 never measured
  for chunk in 2048 4096; do
    log "prefill 2K..32K, MLX 2-bit experts, chunk $chunk"
    DS4MLX_PREFILL_CHUNK=$chunk DS4MLX_DECODE=legacy timeout ${PRE_S:-130} python3 -u -m ds4mlx.cli bench \
        --synthetic v4-flash --expert-format mlx --ctx-start 2048 --ctx-max 32768 --step-mul 4 --gen-tokens 0 \
        --time-budget 100 --csv "$OUT/prefill_c$chunk.csv" 2>&1 | grep "prefill_tps" | tee -a "$OUT/log.txt"
  done
  log "prefill 2K..32K, GGUF experts"
  DS4MLX_DECODE=legacy timeout ${PREG_S:-130} python3 -u -m ds4mlx.cli bench --synthetic v4-flash --expert-format gguf \
      --ctx-start 2048 --ctx-max 32768 --step-mul 4 --gen-tokens 0 --time-budget 100 --csv "$OUT/prefill_gguf.csv" 2>&1 \
      | grep "prefill_tps" | tee -a "$OUT/log.txt"
  log "prefill profile, 512- and 2,048-token chunks"
  timeout ${PROF_S:-150} python3 -u -m ds4mlx.cli bench --synthetic v4-flash --expert-format mlx --ctx-start 2048 \
      --ctx-max 2048 --gen-tokens 0 --time-budget 60 --profile-prefill --profile-chunks 512,2048 2>&1 \
      | grep -v "_warn_once\|UserWarning" | tail -40 | tee "$OUT/prefill_profile.txt"
  keep
  log "disk KV cache at 32K: restore vs re-prefill"
  DS4MLX_DECODE=legacy timeout ${KV_S:-150} python3 -u -m ds4mlx.bench.kv bench --synthetic v4-flash --tokens 32768 \
      --dir /tmp 2>&1 | grep -v '^ds4mlx: dtype' | tail -6 | cut -c1-400 | tee "$OUT/kv.txt"
  ;;
esac
log done
