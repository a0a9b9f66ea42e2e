"""A matrix-tile API for the shared kernel text: tensor cores (CUDA) and simdgroup matrices (Metal).

A kernel written once for both GPU faces (kernels/metal/*.metal) multiplies 16-bit tiles in
shared memory with float32 accumulation through these names; each face's `PRELUDE` defines
them (appended to the kernel's header; the kernel's template constants must include MT, the
16-bit operand type: bfloat16 or float16).  One SIMD group / warp owns each tile object and
every call is made by all of its 32 lanes together (uniform control flow):

    DS4_MMA_M, DS4_MMA_N, DS4_MMA_K   the tile shape: C [M x N] += A [M x K] B [K x N]
                                      (CUDA: 16 x 16 x 16, two PTX m16n8k16; Metal: 8 x 8 x 8)
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

The CUDA face includes no CUDA header (MLX builds custom kernels with NVRTC against the pip
CUDA headers, whose <mma.h> wants a crt/mma.h they lack): it is inline PTX
`mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}`, each lane loading and storing its own
fragment elements with plain shared-memory indexing, at the offsets `FRAGMENT` lists (the
PTX ISA's m16n8k16 fragment layouts; tests/test_mma_fragments.py checks them on a 32-lane
model).  A product of two 16-bit values is exact in float32, so a tile product differs from
a float32 one only by the operands' rounding to MT and the accumulation order.  The tests
give the g++ emulation its own definition of the same names (each emulated lane holds the
whole tile and computes the whole product).
"""

from __future__ import annotations

SHAPE = {"cuda": 16, "metal": 8}  # M = N = K of one tile per face

# A lane's fragment elements, in register order, as offsets from the tile's pointer p: C++
# (and Python) expressions in the lane's g = lane / 4, t = lane % 4 and the tile's ld.  Each
# pair (row, first column) names two adjacent elements, one 32-bit register of two MT (the
# lower index in the low half) or two floats; a 16 x 16 tile is two m16n8k16 ops, n 0..7
# then n 8..15.  A: a[m][k] at p[m ld + k], pairs (m, k); B: b[k][n] at p[n ld + k], pairs
# (n, k), the first n half's two registers then the second's; C: c[m][n] at p[m ld + n],
# pairs (m, n), four floats per n half.
_PAIRS = {
    "a": (("g", 0), ("g + 8", 0), ("g", 8), ("g + 8", 8)),
    "b": (("g", 0), ("g", 8), ("g + 8", 0), ("g + 8", 8)),
    "c": (("g", 0), ("g + 8", 0), ("g", 8), ("g + 8", 8)),
}
FRAGMENT = {
    op: tuple(f"({r}) * ld + 2 * t + {c + e}" for r, c in pairs for e in (0, 1)) for op, pairs in _PAIRS.items()
}


def _loads(dst: str, op: str) -> str:
    """The C++ statements filling fragment `dst` (4 registers of two MT) from p."""
    off = FRAGMENT[op]
    return "\n".join(
        f"    {dst}.r[{i}] = ds4_mma_pack(p[{off[2 * i]}], p[{off[2 * i + 1]}]);" for i in range(len(off) // 2)
    )


def _mma_op(mt: str, ptx: str) -> str:
    """ds4_mma_op<mt>::run: c += a b as two m16n8k16 ops of PTX type `ptx`."""
    return (
        f"template <> struct ds4_mma_op<{mt}> {{\n"
        "    static __device__ __forceinline__ void run(ds4_mma_c& c, const ds4_mma_a& a, const ds4_mma_b& b) {\n"
        "#pragma unroll\n"
        "        for (int h = 0; h < 2; ++h) {\n"
        f'            asm("mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32 {{%0, %1, %2, %3}}, '
        '{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"\n'
        '                : "+f"(c.r[4 * h]), "+f"(c.r[4 * h + 1]), "+f"(c.r[4 * h + 2]), "+f"(c.r[4 * h + 3])\n'
        '                : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[2 * h]), "r"(b.r[2 * h + 1]));\n'
        "        }\n    }\n};\n"
    )


_CUDA = (
    r"""
#define DS4_MMA_M 16
#define DS4_MMA_N 16
#define DS4_MMA_K 16
struct ds4_mma_a { uint32_t r[4]; };
struct ds4_mma_b { uint32_t r[4]; };
struct ds4_mma_c { float r[8]; };
#define DS4_MMA_A ds4_mma_a
#define DS4_MMA_B ds4_mma_b
#define DS4_MMA_C ds4_mma_c
__device__ __forceinline__ uint32_t ds4_mt_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ uint32_t ds4_mt_bits(__half v) { return __half_as_ushort(v); }
#define ds4_mma_bits(f) ds4_mt_bits(static_cast<MT>(f))
template <typename E> __device__ __forceinline__ uint32_t ds4_mma_pack(E lo, E hi) {
    return ds4_mt_bits(lo) | (ds4_mt_bits(hi) << 16);
}
__device__ __forceinline__ uint32_t ds4_mma_lane() {
    uint32_t l;
    asm("mov.u32 %0, %%laneid;" : "=r"(l));
    return l;
}
__device__ __forceinline__ void ds4_mma_zero(ds4_mma_c& c) {
    for (int i = 0; i < 8; ++i) c.r[i] = 0.0f;
}
template <typename E> __device__ __forceinline__ void ds4_mma_load_a(ds4_mma_a& a, const E* p, uint32_t ld) {
    const uint32_t g = ds4_mma_lane() >> 2, t = ds4_mma_lane() & 3u;
"""
    + _loads("a", "a")
    + r"""
}
template <typename E> __device__ __forceinline__ void ds4_mma_load_b(ds4_mma_b& b, const E* p, uint32_t ld) {
    const uint32_t g = ds4_mma_lane() >> 2, t = ds4_mma_lane() & 3u;
"""
    + _loads("b", "b")
    + r"""
}
__device__ __forceinline__ void ds4_mma_store(float* p, const ds4_mma_c& c, uint32_t ld) {
    const uint32_t g = ds4_mma_lane() >> 2, t = ds4_mma_lane() & 3u;
"""
    + "\n".join(f"    p[{o}] = c.r[{i}];" for i, o in enumerate(FRAGMENT["c"]))
    + r"""
}
template <typename E> struct ds4_mma_op;
"""
    + _mma_op("__nv_bfloat16", "bf16")
    + _mma_op("__half", "f16")
    + r"""#define ds4_mma(c, a, b) ds4_mma_op<MT>::run(c, a, b)
#define ds4_mma_barrier() __syncwarp()
"""
)

PRELUDE = {
    "cuda": _CUDA,
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
