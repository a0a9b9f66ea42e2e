"""A matrix-tile API for the shared kernel text: tensor cores (CUDA) and simdgroup matrices (Metal).

A kernel written once for both GPU faces (kernels/metal/*.metal) multiplies 16-bit tiles in
shared memory with float32 accumulation through these names; each face's `PRELUDE` defines
them (appended to the kernel's header; the kernel's template constants must include MT, the
16-bit operand type: bfloat16 or float16).  One SIMD group / warp owns each tile object and
every call is made by all of its 32 lanes together (uniform control flow):

    DS4_MMA_M, DS4_MMA_N, DS4_MMA_K   the tile shape: C [M x N] += A [M x K] B [K x N]
                                      (CUDA: 16 x 16 x 16, `nvcuda::wmma`; Metal: 8 x 8 x 8)
    DS4_MMA_A, DS4_MMA_B, DS4_MMA_C   the operand / accumulator tile types (C holds float32)
    ds4_mma_zero(c)                   c = 0
    ds4_mma_load_a(a, p, ld)          a[m][k] = p[m ld + k]   (p: shared MT, row-major)
    ds4_mma_load_b(b, p, ld)          b[k][n] = p[n ld + k]   (p: shared MT, B stored n-major:
                                      a weight row's K values contiguous)
    ds4_mma(c, a, b)                  c += a b, float32 accumulation
    ds4_mma_store(p, c, ld)           p[m ld + n] = c[m][n]   (p: shared float)
    ds4_mma_barrier()                 the SIMD group's lanes see each other's shared stores
    ds4_mma_bits(f)                   f rounded to MT (to nearest even), its 16 bits as uint32_t
                                      (staging code packs operands into wide shared stores)

CUDA's wmma loads and stores want 32-byte aligned pointers and `ld` a multiple of 8 (16-bit)
or 4 (float) elements: the kernel lays its tiles out so.  A product of two 16-bit values is
exact in float32, so a tile product differs from a float32 one only by the operands' rounding
to MT and the accumulation order.  The tests give the g++ emulation its own definition of the
same names (each emulated lane holds the whole tile and computes the whole product).
"""

from __future__ import annotations

SHAPE = {"cuda": 16, "metal": 8}  # M = N = K of one tile per face

PRELUDE = {
    "cuda": r"""
#include <mma.h>
#define DS4_MMA_M 16
#define DS4_MMA_N 16
#define DS4_MMA_K 16
#define DS4_MMA_A nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, MT, nvcuda::wmma::row_major>
#define DS4_MMA_B nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, MT, nvcuda::wmma::col_major>
#define DS4_MMA_C nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>
#define ds4_mma_zero(c) nvcuda::wmma::fill_fragment(c, 0.0f)
#define ds4_mma_load_a(a, p, ld) nvcuda::wmma::load_matrix_sync(a, p, ld)
#define ds4_mma_load_b(b, p, ld) nvcuda::wmma::load_matrix_sync(b, p, ld)
#define ds4_mma(c, a, b) nvcuda::wmma::mma_sync(c, a, b, c)
#define ds4_mma_store(p, c, ld) nvcuda::wmma::store_matrix_sync(p, c, ld, nvcuda::wmma::mem_row_major)
#define ds4_mma_barrier() __syncwarp()
__device__ __forceinline__ uint32_t ds4_mt_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ uint32_t ds4_mt_bits(__half v) { return __half_as_ushort(v); }
#define ds4_mma_bits(f) ds4_mt_bits(static_cast<MT>(f))
""",
    "metal": r"""
#include <metal_simdgroup_matrix>
#define DS4_MMA_M 8
#define DS4_MMA_N 8
#define DS4_MMA_K 8
#define DS4_MMA_A simdgroup_matrix<MT, 8, 8>
#define DS4_MMA_B simdgroup_matrix<MT, 8, 8>
#define DS4_MMA_C simdgroup_matrix<float, 8, 8>
#define ds4_mma_zero(c) (c) = simdgroup_matrix<float, 8, 8>(0.0f)
#define ds4_mma_load_a(a, p, ld) simdgroup_load(a, p, ld)
#define ds4_mma_load_b(b, p, ld) simdgroup_load(b, p, ld, ulong2(0, 0), true)
#define ds4_mma(c, a, b) simdgroup_multiply_accumulate(c, a, b, c)
#define ds4_mma_store(p, c, ld) simdgroup_store(c, p, ld)
#define ds4_mma_barrier() simdgroup_barrier(mem_flags::mem_threadgroup)
#define ds4_mma_bits(f) uint32_t(as_type<ushort>(static_cast<MT>(f)))
""",
}
