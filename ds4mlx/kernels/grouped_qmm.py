"""Grouped quantized matmul: prefill's per-expert GEMMs read straight from GGUF blocks.

``grouped_qmm(x [B, M, K], w_blocks [E, N, row_bytes], qtype, experts [B], lengths [B]) -> [B, M, N]``:
batch b's M rows times expert ``experts[b]``'s weights (``y[b] = x[b] @ W[experts[b]].T``),
the shape of prefill's grouped layout (models/grouped_experts.py: pairs sorted by expert,
each expert's rows cut into batches of `cap`; a switch module's `per_expert`).  Rows of
batch b from ``lengths[b]`` on are the layout's padding: zeros out, no product computed.  Types:
`quant_moe.SUPPORTED` (Q8_0, Q2_K, Q4_K, IQ2_XXS).

Why: the grouped path's GGUF banks were dequantized to 16-bit slices in memory (written,
then read back by cuBLAS); here a thread group decodes each 32-value chunk of its weight
tile once into shared memory and uses it for a tile of up to 64 tokens (the weight bytes
read once per tile, not once per token as in a mat-vec), accumulating in float32.

Three faces (kernels/dispatch.py): the reference face dequantizes the batches' experts to
float32 (`quant_moe.gather_dequantize`, bounded slices) and multiplies in float32; the Metal
and CUDA faces are one text, kernels/metal/grouped_qmm.metal (its `grouped_qmm` section;
the header is quant_moe's, whose `common` section holds the block decoders), which explains
the tile shapes: 256 threads, 8 GQ_RM tokens (GQ_RM = `tokens_per_warp(M)`, up to 8) x 128
output rows per thread group, K in steps of one 32-value chunk.  Outputs equal the reference's
within a float32 summation bound (the same float32 products, summed in another order).

Tensor cores (`mma=True`, the `grouped_qmm_mma` section, DS4MLX_PREFILL_EXPERTS=grouped_blocks_mma):
the same tiles (up to 64 tokens x 128 rows of one batch, `tokens_per_tile(M)` tokens), the
decoded chunk and x rounded to a 16-bit MT (bfloat16 for bfloat16 x, else float16) in shared
memory, the product on the face's matrix tiles (kernels/mma_tile.py: PTX mma.sync 16 x 16 x 16 on
CUDA, simdgroup matrices 8 x 8 on Metal), float32 accumulation.  Bound against the float32
reference, per output: ``|y - ref| <= (e + K 2**-22) sum_k |w_k x_k|`` (+ float16's
underflow, ``2**-24 sum_k (|w_k| + |x_k|)``), e = 2**-8 for bfloat16 operands, 2**-11 for
float16 (each of w and x rounded once to MT; bfloat16 x is not rounded again); the output in
T adds T's own rounding; float16 operands hold magnitudes up to 65,504 only (float32 x beyond
that overflows: run such activations in bfloat16).  Its GPU faces are self-tested at first
use (`MMA_KERNELS`).

Verification state: the shared text through g++ (threadgroups emulated) and nvcc, and the
CUDA face at V4 Flash expert shapes for every type in float32 and bfloat16
(tests/test_grouped_qmm.py, its `pytest -m gpu` tests); the Metal face self-tests at first use.
The tensor-core variant: its text through g++ on a CPU tile API (at 16 and at 8) and nvcc
(sm_90, no spills), the CUDA tile API's per-lane fragment offsets on a 32-lane model.  Its
CUDA face failed to build under NVRTC on an H100 on 2026-12-07 (<mma.h> wants crt/mma.h,
absent from the pip CUDA headers: every launch fell back to the reference); rewritten in
inline PTX with no CUDA header, unverified on a GPU (tests/test_grouped_qmm_mma.py's GPU tests).
Tile sizes reasoned, not swept (tools/prefill_experts_bench.py times the mode).
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from ds4mlx.io.quant import QT, as_qtype, random_gguf_blocks
from ds4mlx.kernels import mma_tile, quant_moe
from ds4mlx.kernels.dispatch import INDEX, METAL_DIR, Kernel, auto_face, close_enough, sections

SOURCE = METAL_DIR / "grouped_qmm.metal"
THREADS = 256  # 8 SIMD groups per thread group (GQ_THREADS in the kernel text)
TILE_N = 128  # output rows per thread group: 4 per lane (GQ_TN)
MAX_TOKENS_PER_WARP = 8  # GQ_RM: 8 tokens per SIMD group, 64 per thread group
MAX_GRID_Z = 65535  # CUDA's grid z limit: more (batch, token tile) pairs go in several launches
MAX_REFERENCE_BYTES = 1 << 30  # float32 weights the reference face dequantizes at once
# auto_face names, self-tested at first use while dispatch.UNVERIFIED_KERNELS lists them
GROUPED_KERNELS = {t: f"grouped_qmm.{t.name}" for t in quant_moe.SUPPORTED}
MMA_KERNELS = {t: f"grouped_qmm_mma.{t.name}" for t in quant_moe.SUPPORTED}  # the tensor-core variant
MMA_TILE_M = 16  # token tiles of the tensor-core variant are whole 16-row tiles (CUDA's tile M; Metal's 8 divides it)


def tokens_per_warp(m: int) -> int:
    """GQ_RM for batches of m rows: a thread group's 8 SIMD groups cover min(m, 64) rows
    (rounded up to a multiple of 8), so a batch of 16 rows does not compute 48 idle ones."""
    return max(1, min(MAX_TOKENS_PER_WARP, -(-m // 8)))


def tokens_per_tile(m: int) -> int:
    """GQ_TM of the tensor-core variant for batches of m rows: min(m, 64) rounded up to whole
    16-row tiles."""
    return min(8 * MAX_TOKENS_PER_WARP, -(-m // MMA_TILE_M) * MMA_TILE_M)


def kernel_sources(qtype, face: str, mma: bool = False) -> tuple[str, str]:
    """(header, body) of the kernel for `qtype` on `face` ('metal' or 'cuda'); `mma`: the
    tensor-core variant (the tile API of kernels/mma_tile.py in its header)."""
    sec = sections(SOURCE)
    if mma:
        header = quant_moe.block_header(qtype, face) + mma_tile.PRELUDE[face] + sec["helpers_mma"]
        return header, INDEX[face] + sec["grouped_qmm_mma"]
    return quant_moe.block_header(qtype, face) + sec["helpers"], INDEX[face] + sec["grouped_qmm"]


@cache
def _kernel(qtype: QT, mma: bool = False) -> Kernel:
    return Kernel(
        f"ds4mlx_grouped_qmm{'_mma' if mma else ''}_{qtype.name.lower()}",
        ["x", "w", "eids", "lens"],
        ["y"],
        metal=kernel_sources(qtype, "metal", mma),
        cuda=kernel_sources(qtype, "cuda", mma),
    )


def face(qtype, mma: bool = False) -> str:
    """The automatic face for `qtype` (`mma`: the tensor-core variant): the device's
    (self-tested at first use while unverified), 'reference' on the CPU or where the GPU
    face failed its self-test."""
    qtype = as_qtype(qtype)
    names = MMA_KERNELS if mma else GROUPED_KERNELS
    return auto_face(names[qtype], lambda f: _self_test(f, qtype, mma))


def operand_dtype(x_dtype) -> mx.Dtype:
    """MT, the tensor-core variant's 16-bit operand type for activations of `x_dtype`."""
    return mx.bfloat16 if x_dtype == mx.bfloat16 else mx.float16


def grouped_qmm(
    x: mx.array,
    w_blocks: mx.array,
    qtype,
    experts: mx.array,
    lengths: mx.array | None = None,
    *,
    backend=None,
    mma: bool = False,
) -> mx.array:
    """x [B, M, K] (any float dtype), w_blocks uint8 [E, N, row_bytes], experts [B] ints ->
    [B, M, N] in x.dtype: ``out[b] = x[b] @ dequantize(W[experts[b]]).T``, float32 sums;
    `lengths` [B] ints (default M each): rows m >= lengths[b] of batch b are padding, out 0.
    `mma`: the GPU faces multiply on tensor cores / simdgroup matrices (16-bit operands; the
    bound in the module's docstring); the reference face is the same float32 product."""
    qtype, _, rows, k_dim = quant_moe.check_blocks(w_blocks, qtype)
    if x.ndim != 3 or x.shape[-1] != k_dim:
        raise ValueError(f"x must be [B, M, {k_dim}], got {x.shape}")
    if experts.ndim != 1 or experts.shape[0] != x.shape[0]:
        raise ValueError(f"experts must be [{x.shape[0]}] (one per batch of x), got {experts.shape}")
    n_batch, m = x.shape[:2]
    experts = experts.astype(mx.int32)
    if lengths is None:
        lengths = mx.full((n_batch,), m, mx.int32)
    elif lengths.shape != experts.shape:
        raise ValueError(f"lengths must be [{n_batch}] (live rows of each batch), got {lengths.shape}")
    lengths = lengths.astype(mx.int32)
    if n_batch == 0 or m == 0:
        return mx.zeros((n_batch, m, rows), x.dtype)
    chosen = face(qtype, mma) if backend is None else backend
    if chosen == "reference":
        return _reference(x, w_blocks, qtype, experts, lengths)
    if mma:
        tm = tokens_per_tile(m)
        tile_consts = [("GQ_TM", tm), ("MT", operand_dtype(x.dtype))]
    else:
        tm = 8 * tokens_per_warp(m)
        tile_consts = [("GQ_RM", tm // 8)]
    m_tiles = -(-m // tm)
    step = max(1, MAX_GRID_Z // m_tiles)  # batches per launch
    outs = []
    for b0 in range(0, n_batch, step):
        span = slice(b0, b0 + step)
        xs, es, ls = (x, experts, lengths) if step >= n_batch else (x[span], experts[span], lengths[span])
        nb = xs.shape[0]
        outs.append(
            _kernel(qtype, mma)(
                chosen,
                inputs=[xs, w_blocks, es, ls],
                template=[
                    ("T", x.dtype),
                    ("N_ROWS", rows),
                    ("K_DIM", k_dim),
                    ("ROW_BYTES", w_blocks.shape[2]),
                    ("M_ROWS", m),
                    *tile_consts,
                ],
                grid=(THREADS, -(-rows // TILE_N), nb * m_tiles),
                threadgroup=(THREADS, 1, 1),
                output_shapes=[(nb, m, rows)],
                output_dtypes=[x.dtype],
            )[0]
        )
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def _reference(x: mx.array, w_blocks: mx.array, qtype: QT, experts: mx.array, lengths: mx.array) -> mx.array:
    """The dequantize + matmul path, float32: batches' experts dequantized by the reference
    decoding (MAX_REFERENCE_BYTES at a time), one batched matmul per slice; padding rows 0."""
    n_batch, m, k_dim = x.shape
    per = w_blocks.shape[1] * k_dim * 4
    step = max(1, min(n_batch, MAX_REFERENCE_BYTES // per))
    xs = x.astype(mx.float32)
    outs = []
    for b0 in range(0, n_batch, step):
        w = quant_moe.gather_dequantize(w_blocks, qtype, experts[b0 : b0 + step], mx.float32, backend="reference")
        outs.append(xs[b0 : b0 + step] @ w.swapaxes(-1, -2))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    live = mx.arange(m)[None, :, None] < lengths[:, None, None]
    return mx.where(live, out, 0.0).astype(x.dtype)


def _self_test(face: str, qtype: QT, mma: bool = False) -> bool:
    """`face` against the reference on a tiny bank: 130 rows (a second, nearly empty row
    tile), K = 512, batches of 20 rows (a token tile of 24 (mma: 32), rows idle) and of 70 rows
    (two tiles), experts repeated and out of order, padding (a short batch, an empty one, a
    tile of padding only), float32 and bfloat16 x; `mma`: the tensor-core variant, at
    tolerances of its 16-bit operands."""
    blocks = random_gguf_blocks(qtype, 3, 130, 512, seed=16)
    experts = mx.array([2, 0, 2], dtype=mx.int32)
    for m, lengths in ((20, None), (20, [20, 3, 0]), (70, [70, 9, 64])):
        lengths = None if lengths is None else mx.array(lengths, dtype=mx.int32)
        for dt, tol in ((mx.float32, 1e-2 if mma else 1e-3), (mx.bfloat16, 2e-2)):
            x = mx.random.normal((3, m, 512), key=mx.random.key(m)).astype(dt)
            got = grouped_qmm(x, blocks, qtype, experts, lengths, backend=face, mma=mma)
            if got.dtype != dt or got.shape != (3, m, 130):
                return False
            with mx.stream(mx.cpu):  # a CUDA float32 matmul may round through TF32: not an oracle
                want = grouped_qmm(x, blocks, qtype, experts, lengths, backend="reference")
                mx.eval(want)
            if not close_enough(got, want, rtol=tol, atol=tol / 10):
                return False
    return True
