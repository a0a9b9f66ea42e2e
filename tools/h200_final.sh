#!/usr/bin/env bash
# The wave's last device session (one call after staging): old tree vs new tree decode at 2K on the
# 43-layer synthetic V4 Flash, the compiled step's first-run compile time and its profile.
#   call 1: mkdir -p /root/gpu && cp .gpu/a/part_aa /root/gpu/                     (carry .gpu/a)
#   call 2: source .gpu/b/setup.sh && bash tools/h200_final.sh                      (carry .gpu/b .baseline .devstage/final)
# .baseline = `git worktree add --detach .baseline <old commit>`, .devstage/final = `git archive` of the new tree.
set -u
OUT=${OUT:-out/h200}; mkdir -p "$OUT"
log() { echo "== $(date -u +%T) $*" | tee -a "$OUT/log.txt"; }
ptx() { ls /tmp/mlx/*/ptx/*.ptx 2>/dev/null | wc -l; }
( while sleep 15; do echo "$(date -u +%T) ptx=$(ptx)" >> "$OUT/ptx.log"; done ) & watcher=$!
root=$PWD
log "old tree ($(cd .baseline && git log -1 --format=%h 2>/dev/null || echo baseline)): bench 2K"
(cd .baseline && PYTHONPATH=$PWD:$PYTHONPATH timeout ${OLD_S:-110} python3 -m ds4mlx.cli bench --synthetic v4-flash \
    --ctx-start 2048 --ctx-max 2048 --gen-tokens 16 --csv "$OUT/old.csv" > "$OUT/old.txt" 2>&1)
tail -3 "$OUT/old.txt" | tee -a "$OUT/log.txt"; cat "$OUT/old.csv" 2>/dev/null | tee -a "$OUT/log.txt"
log "new tree: compiled decode at 2K (first run: NVRTC compiles every fused kernel; ptx=$(ptx))"
(cd .devstage/final && PYTHONPATH=$PWD:$PYTHONPATH timeout ${NEW_S:-330} python3 -u tools/decode_before_after.py \
    --layers 43 --ctx 2048 --gen 16 --modes ${MODES:-compiled} --profile > "$OUT/new.txt" 2>&1)
log "new tree done, ptx=$(ptx)"
tail -40 "$OUT/new.txt" | cut -c1-600 | tee -a "$OUT/log.txt"
kill $watcher 2>/dev/null
tail -30 "$OUT/ptx.log" | tr '\n' ' ' | tee -a "$OUT/log.txt"; echo
