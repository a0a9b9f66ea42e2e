"""Routed experts at prefill as per-expert batched GEMMs.

Why: at prefill the experts' old path, `mx.gather_qmm(x [P, 1, K], ...,
rhs_indices, sorted_indices=True)`, is one batch entry per (token, expert) pair with
M = 1 row. MLX CUDA (quantized/quantized.cpp `GatherQMM::eval_gpu`) ignores
`sorted_indices` and runs qmm_sm80 (4/8-bit, 16-bit x) or qmm_naive (2-bit, or
float32 x: FMA, no tensor cores) once per pair with a tile of 16..64 rows: every pair
re-reads its expert and fills one row of the tile.

Here the rows are grouped per expert into real matrices:

1. device: the chunk's pair experts are sorted (argsort) and counted (scatter-add);
2. host: ONE sync reads the E counts; `layout` cuts each expert's rows into batches of
   `cap` rows (cap in CAPS, `choose_cap`'s cost model); experts without pairs get no batch;
3. device: the sorted rows are gathered into x_pad [B, cap, K] (zero rows pad a batch's
   end) and each projection is ONE batched call, batch b through expert experts[b]:
   the switch module's `per_expert(x_pad, experts)` (MLX affine: `gather_qmm` with
   M = cap; GGUF blocks: dequantized slices of experts + batched matmuls, or with
   DS4MLX_PREFILL_EXPERTS=grouped_blocks one `kernels.grouped_qmm` launch on the blocks,
   `gguf_per_expert`);
   SwiGLU runs on the padded layout; the outputs are gathered back to (token, slot) order.

Memory per call (one layer, one chunk of P pairs, E experts): the padded rows are
R = B * cap <= 3 P + 47 E (see `choose_cap`); x_pad, gate/up, SwiGLU and down outputs are
R x (K + 2I + I + H) values in the compute dtype, plus for GGUF one slice of
dequantized experts (<= MAX_SLICE_BYTES; none under grouped_blocks). V4 Flash, 2,048-token chunk (P = 12,288), bf16:
typically R ~ 19K rows (cap 64), ~0.7 GB with the SwiGLU temporaries; at the bound
(R ~ 49K) ~1.8 GB.

On a GPU the batched GEMMs run in a 16-bit type (tensor cores): x's type when 16-bit,
else the affine scales' type when 16-bit, else float16 (`compute_dtype`); so float32
activations are rounded to 16 bits here, where the per-pair path kept float32 (FMA). On
the CPU they run in x's type (MLX affine) or float32 (GGUF and float banks): in
tests/test_grouped_experts.py the CPU results equal the per-pair path's bit for bit, but
the CPU keeps the per-pair path by default (no faster there). SwitchGLU takes this path
for >= MIN_PAIRS pairs on a GPU (`prefill_experts.grouped_wanted`; DS4MLX_PREFILL_EXPERTS).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..kernels import grouped_qmm, quant_moe
from ..kernels.activations import clamped_swiglu
from . import prefill_experts

CAPS = (16, 32, 64, 128, 256, 512)  # rows per batch: every call's shapes come from this set
# One more batch (another read of an expert's weights, another tile row of the grid)
# costs about as much as this many padded rows (reasoned from the H200's ~4 TB/s and
# a 2-bit 2048 x 4096 expert, not measured).
BATCH_ROWS = 32
GPU_DTYPE = mx.float16  # compute dtype on a GPU when neither x nor the scales are 16-bit
MAX_SLICE_BYTES = 1 << 30  # GGUF: dequantized expert weights held at once per projection
MAX_SLICE_ELEMS = 1 << 30  # and never near 2**31 values in one array (int32 offsets)
# MLX-affine experts through dequantized slices + cuBLAS instead of gather_qmm with
# M = cap (tools/prefill_experts_bench.py times both; the faster one is the default)
AFFINE_VIA_DEQUANT = False


@dataclass(frozen=True)
class Layout:
    """Where every sorted pair goes: batch b holds rows b*cap .. b*cap+cap-1 of expert experts[b]."""

    cap: int
    experts: np.ndarray  # [B] int32
    rows: np.ndarray  # [B * cap] int32: the sorted pair feeding each padded row (P: a zero row)
    dest: np.ndarray  # [P] int32: the padded row of each sorted pair
    lengths: np.ndarray  # [B] int32: live rows of each batch (the rest: zero rows of padding)

    @property
    def batches(self) -> int:
        return int(self.experts.size)


def _batches(counts: np.ndarray, cap: int) -> np.ndarray:
    return -(-counts // cap)


def choose_cap(counts: np.ndarray) -> int:
    """The cap of CAPS (at most the largest count's bucket) minimising padded rows +
    BATCH_ROWS x batches.  Bound: rows(cap) <= cost(cap) <= cost(16) <= P + 15 E +
    32 (P / 16 + E) = 3 P + 47 E."""
    top = int(counts.max()) if counts.size else 0
    best, best_cost = CAPS[0], None
    for cap in CAPS:
        nb = _batches(counts, cap)
        cost = int(nb.sum()) * (cap + BATCH_ROWS)
        if best_cost is None or cost < best_cost:
            best, best_cost = cap, cost
        if cap >= top:
            break
    return best


def layout(counts: np.ndarray, cap: int | None = None) -> Layout:
    """The padded layout of pairs sorted by expert, from the per-expert counts [E]."""
    counts = np.asarray(counts, dtype=np.int64)
    cap = choose_cap(counts) if cap is None else cap
    n_pairs, n_exp = int(counts.sum()), counts.size
    nb = _batches(counts, cap)
    first_batch = np.cumsum(nb) - nb  # [E]
    start = np.cumsum(counts) - counts  # [E]: first sorted pair of each expert
    experts = np.repeat(np.arange(n_exp), nb)  # [B]
    j = np.arange(experts.size) - first_batch[experts]  # batch index within its expert
    b_start = start[experts] + j * cap
    b_len = np.minimum(cap, counts[experts] - j * cap)
    slot = np.arange(cap)
    rows = np.where(slot[None, :] < b_len[:, None], b_start[:, None] + slot[None, :], n_pairs)
    e_of = np.repeat(np.arange(n_exp), counts)  # [P]: expert of each sorted pair
    r = np.arange(n_pairs) - start[e_of]  # its rank within the expert
    dest = (first_batch[e_of] + r // cap) * cap + r % cap
    i32 = np.int32
    return Layout(cap, experts.astype(i32), rows.reshape(-1).astype(i32), dest.astype(i32), b_len.astype(i32))


def on_gpu() -> bool:
    return mx.default_device().type != mx.DeviceType.cpu


_HALF = (mx.float16, mx.bfloat16)


def compute_dtype(x_dtype, scales_dtype=None):
    """The 16-bit type of a GPU batched GEMM: x's when 16-bit, else the scales' when
    16-bit (MLX promotes x with the scales: a float32 operand would mean FMA), else GPU_DTYPE."""
    if scales_dtype is not None and scales_dtype in _HALF:  # (an MLX Dtype == None raises)
        return scales_dtype
    return x_dtype if x_dtype in _HALF else GPU_DTYPE


def sliced_per_expert(x: mx.array, experts: mx.array, per_expert_values: int, dequantize) -> mx.array:
    """x [B, M, K], experts [B] -> [B, M, out]: batch b times expert experts[b]'s weights,
    `dequantize(ids, dtype) -> [S, out, K]` MAX_SLICE_BYTES of experts at a time (float32
    on the CPU, 16-bit on a GPU), each slice one batched matmul (cuBLAS strided batched
    on CUDA)."""
    n_batch = x.shape[0]
    dt = compute_dtype(x.dtype) if on_gpu() else mx.float32
    per = per_expert_values
    step = max(1, min(n_batch, MAX_SLICE_BYTES // (per * dt.size), MAX_SLICE_ELEMS // per))
    xs = x.astype(dt)
    outs = []
    for b0 in range(0, n_batch, step):
        w = dequantize(experts[b0 : b0 + step], dt)  # [S, out, K]
        outs.append(xs[b0 : b0 + step] @ w.swapaxes(-1, -2))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def gguf_per_expert(x: mx.array, blocks: mx.array, qtype, experts: mx.array, lengths=None) -> mx.array:
    """x [B, M, K] times GGUF blocks uint8 [E, out, row_bytes]: on the blocks (`grouped_qmm`,
    which skips the padding rows past `lengths`) under DS4MLX_PREFILL_EXPERTS=grouped_blocks
    (`grouped_blocks_mma`: its tensor-core variant),
    except on a GPU whose grouped_qmm face failed its self-test; else `sliced_per_expert`
    (quant_moe's dequantization)."""
    if prefill_experts.blocks_wanted():
        mma = prefill_experts.mma_wanted()
        face = grouped_qmm.face(qtype, mma)
        if face != "reference" or not on_gpu():
            return grouped_qmm.grouped_qmm(x, blocks, qtype, experts, lengths, backend=face, mma=mma)
    return sliced_per_expert(
        x,
        experts,
        blocks.shape[1] * x.shape[-1],
        lambda ids, dt: quant_moe.gather_dequantize(blocks, qtype, ids, dt),
    )


def affine_per_expert_dequantized(x: mx.array, experts: mx.array, weight, scales, biases, **quant) -> mx.array:
    """`sliced_per_expert` of an MLX-quantized bank (`mx.dequantize` of the slice's experts):
    the alternative to gather_qmm with M = cap that AFFINE_VIA_DEQUANT selects."""

    def dequantize(ids, dt):
        # scales and biases in dt first: mx.dequantize computes in their type (bf16
        # scales would round a float32 result to bf16)
        floats = quant.get("mode", "affine") == "affine"
        s = scales[ids].astype(dt) if floats else scales[ids]
        b = None if biases is None else biases[ids].astype(dt)
        return mx.dequantize(weight[ids], s, b, dtype=dt, **quant)

    return sliced_per_expert(x, experts, weight.shape[1] * x.shape[-1], dequantize)


def switch_glu(gate_up, down, x: mx.array, indices: mx.array, intermediate: int, limit) -> mx.array | None:
    """SwitchGLU's result ([..., k, H] in x.dtype, unweighted per slot) through per-expert
    batches; None where this path does not apply (a projection without `per_expert`,
    x and indices not sharing their leading axes, or inside mx.compile / vmap, where
    the host cannot read the counts)."""
    if not (hasattr(gate_up, "per_expert") and hasattr(down, "per_expert")):
        return None
    lead, k = tuple(indices.shape[:-1]), indices.shape[-1]
    if tuple(x.shape[:-1]) != lead:
        return None
    n_exp, hidden = down.weight.shape[0], x.shape[-1]
    flat = indices.reshape(-1).astype(mx.int32)
    n_pairs = flat.size
    order = mx.argsort(flat)  # sorted position -> pair
    counts = mx.zeros((n_exp,), mx.int32).at[flat].add(1)
    try:
        counts_np = np.array(counts)  # the one host sync of the call
    except ValueError:  # "eval during function transformations": traced, no sync possible
        return None
    lay = layout(counts_np)
    n_tok = n_pairs // k
    token_of_sorted = mx.concatenate([(order // k).astype(mx.int32), mx.array([n_tok], mx.int32)])
    x_ext = mx.concatenate([x.reshape(n_tok, hidden), mx.zeros((1, hidden), x.dtype)])  # last row: padding
    x_pad = x_ext[token_of_sorted[mx.array(lay.rows)]].reshape(lay.batches, lay.cap, hidden)
    experts, lengths = mx.array(lay.experts), mx.array(lay.lengths)
    gu = gate_up.per_expert(x_pad, experts, lengths)
    h = clamped_swiglu(gu[..., :intermediate], gu[..., intermediate:], limit)
    y = down.per_expert(h, experts, lengths).reshape(lay.batches * lay.cap, hidden)
    pad_row = mx.array(lay.dest)[mx.argsort(order)]  # pair -> its padded row
    return y[pad_row].astype(x.dtype).reshape(*lead, k, hidden)
