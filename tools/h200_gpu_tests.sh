#!/usr/bin/env bash
# Every `pytest -m gpu` test on the lent H200 in one time-boxed call (issue #15), results under $OUT.
#   call 1: mkdir -p /root/gpu && cp .gpu/a/part_aa /root/gpu/ && cp .gpu/tcA/tc.tar /root/   (carry .gpu/a .gpu/tcA)
#   call 2: bash tools/h200_gpu_tests.sh     (carry .gpu/b, and .ptxcache once a call of this session wrote one)
# Why this shape (session 9, 2026-12-02): one serial pytest on a cold kernel cache ran 27 of 273
# tests in 420 s (each new kernel instance is compiled at first use) and, killed by its box,
# printed no failure message.  Here: the GPU test files only (the serve tests import jsonschema,
# which the device image lacks), 4 xdist workers (the image has pytest-xdist and pytest-timeout:
# nvrtc compiles run side by side on the 16 cores), one line per test as it ends, a per-test
# timeout so one hang does not eat the box, and the failures' messages in their own file.
# .gpu/tcA: the tiny oracle models the tests load most (tools/stage_gpu_oracles.py builds and packs
# them here; the tests build the others on the device); devcache/ptx.txz (committed) or
# .ptxcache/ptx.txz (this session's newest): the kernel cache.
set -u
source tools/h200_probe_lib.sh  # $OUT, MLX's CUDA build, the kernel cache, log / keep
mkdir -p /root/tc
[ -f /root/tc.tar ] && tar xf /root/tc.tar -C /root/tc
export DS4MLX_TEST_CACHE=/root/tc
files=$(grep -l "mark.gpu" tests/test_*.py | xargs grep -L "jsonschema" | tr '\n' ' ')
log "pytest -m gpu on: $files"
timeout "${TEST_S:-540}" python3 -m pytest -m gpu -p no:cacheprovider -n "${WORKERS:-4}" --timeout "${PER_TEST_S:-240}" \
    -v --tb=short -rfE --durations=25 $files > "$OUT/gpu_tests.txt" 2>&1
echo "rc=$?" >> "$OUT/gpu_tests.txt"
grep -E "(PASSED|FAILED|ERROR|SKIPPED).*::|::.*(PASSED|FAILED|ERROR|SKIPPED)" "$OUT/gpu_tests.txt" > "$OUT/gpu_tests_lines.txt"
grep -E "^E |^FAILED|^ERROR|Error" "$OUT/gpu_tests.txt" | head -80 > "$OUT/gpu_failures.txt"
log "$(grep -c PASSED "$OUT/gpu_tests_lines.txt") passed, $(grep -c -E 'FAILED|ERROR' "$OUT/gpu_tests_lines.txt") failed"
tail -3 "$OUT/gpu_tests.txt" | tee -a "$OUT/log.txt"
head -40 "$OUT/gpu_failures.txt"
keep
