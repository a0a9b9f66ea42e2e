#!/usr/bin/env bash
# Build ds4's `ds4-bench` (antirez/ds4, CUDA backend) with its fixed layer count patched.
#   bash tools/ds4_build_cuda.sh SRC_DIR LAYERS OUT_DIR
# SRC_DIR is ds4's source as fetched (never committed here: .devstage/ds4src, git-ignored);
# it is copied to OUT_DIR/src, where DS4_N_LAYER (ds4.c's enum, 43) becomes LAYERS with sed,
# then `make ds4-bench` runs with ds4's own Makefile and flags (NVCCFLAGS -O3 -g -lineinfo
# --use_fast_math -arch=$CUDA_ARCH).  Result: OUT_DIR/ds4-bench.
# Environment: CUDA_HOME (default: the nvcc found on PATH, else /usr/local/cuda), CUDA_ARCH
# (sm_90), HOST_ARCH (-march flag for host code, default native; a binary built on another
# machine wants a portable one, e.g. x86-64-v3), CUBLAS_HOME (a folder with include/cublas_v2.h
# and lib/libcublas.so when the toolkit has no cuBLAS, e.g. the nvidia-cublas wheel's nvidia/cu13),
# JOBS (make -j).
set -euo pipefail
src=$1 layers=$2 out=$3
arch=${CUDA_ARCH:-sm_90}
host=${HOST_ARCH:-native}
if [ -z "${CUDA_HOME:-}" ]; then
  if command -v nvcc >/dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    # /usr/local/bin/nvcc may be a wrapper script: take the toolkit it execs
    if [ ! -d "$CUDA_HOME/include" ] && grep -q exec "$(command -v nvcc)" 2>/dev/null; then
      CUDA_HOME=$(dirname "$(dirname "$(grep -o '/[^ ]*/bin/nvcc' "$(command -v nvcc)" | head -1)")")
    fi
  else
    CUDA_HOME=/usr/local/cuda
  fi
fi
[ -x "$CUDA_HOME/bin/nvcc" ] || { echo "ds4_build_cuda: no nvcc at $CUDA_HOME/bin/nvcc" >&2; exit 3; }
rm -rf "$out/src"; mkdir -p "$out"; cp -r "$src" "$out/src"; cd "$out/src"
rm -f ./*.o ds4 ds4-bench ds4-server ds4-eval ds4-agent
sed -i -E "s/^(\s*DS4_N_LAYER\s*=\s*)43,/\1${layers},/" ds4.c
grep -qE "^\s*DS4_N_LAYER\s*=\s*${layers}," ds4.c || { echo "ds4_build_cuda: layer-count patch did not apply" >&2; exit 4; }
extra_inc="" extra_lib=""
if [ -n "${CUBLAS_HOME:-}" ]; then
  extra_inc="-I$CUBLAS_HOME/include"
  extra_lib="-L$CUBLAS_HOME/lib -Xlinker -rpath-link=$CUBLAS_HOME/lib"
fi
nvflags="-O3 -g -lineinfo --use_fast_math -arch=$arch -Xcompiler -march=$host -Xcompiler -pthread $extra_inc"
# cudart linked statically (one shared library less to find on the device); cuBLAS shared
ldlibs="-lm -Xcompiler -pthread -L$CUDA_HOME/lib64 -L$CUDA_HOME/lib $extra_lib -lcudart_static -ldl -lrt -lcublas"
echo "ds4_build_cuda: $($CUDA_HOME/bin/nvcc --version | tail -1), arch $arch, host -march=$host, layers $layers"
make -j"${JOBS:-4}" ds4-bench CUDA_HOME="$CUDA_HOME" CUDA_ARCH="$arch" NATIVE_CPU_FLAG="-march=$host" \
    NVCCFLAGS="$nvflags" CUDA_LDLIBS="$ldlibs"
cp ds4-bench "$out/ds4-bench"
echo "ds4_build_cuda: built $out/ds4-bench ($(du -h "$out/ds4-bench" | cut -f1))"
