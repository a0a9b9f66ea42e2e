#!/usr/bin/env bash
# Session 8's last device minutes (after staging): GGUF-expert prefill after the coalesced
# dequant, the prefill profile at 2,048 tokens with the GEMM defaults, mlx-lm's decode.
source tools/h200_probe_lib.sh
log "prefill 2K..8K, GGUF experts"
DS4MLX_DECODE=legacy timeout ${PREG_S:-100} python3 -u -m ds4mlx.cli bench --synthetic v4-flash --expert-format gguf \
    --ctx-start 2048 --ctx-max 8192 --step-mul 4 --gen-tokens 0 --time-budget 80 --csv "$OUT/prefill_gguf.csv" 2>&1 \
    | grep "prefill_tps" | tee -a "$OUT/log.txt"
log "prefill profile at 2,048 tokens, MLX 2-bit experts (the GPU defaults)"
DS4MLX_DECODE=legacy timeout ${PROF_S:-80} python3 -u -m ds4mlx.cli bench --synthetic v4-flash --expert-format mlx \
    --ctx-start 2048 --ctx-max 2048 --gen-tokens 0 --time-budget 40 --profile-prefill --profile-chunks 2048 2>&1 \
    | grep -v '^ds4mlx: dtype\|_warn_once\|UserWarning' | cut -c1-300 | tee -a "$OUT/log.txt"
log "mlx-lm, same shapes and bits"
timeout ${MLXLM_S:-80} python3 -u tools/mlxlm_side_by_side.py --layers 43 --prompt ${MLXLM_PROMPT:-128} --gen 16 --which mlxlm 2>&1 \
    | grep -v "_warn_once\|UserWarning" | tail -12 | tee -a "$OUT/log.txt"
log done
