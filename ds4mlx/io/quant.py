"""GGUF quantization types: reference dequantization and exact repacking for MLX.

`dequantize(raw, qtype, shape)` is the numpy reference (the oracle for every other
path).  It is vectorised over whole tensors and computes each value with the same
float32 operations, in the same order, as ``gguf.quants.dequantize`` (and ggml's C
reference), so the two agree bit for bit.

Types implemented here: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q2_K, Q4_K, IQ2_XXS
(ds4's published files use F32, F16, Q8_0, Q2_K, Q4_K and IQ2_XXS; ds4 also lists
BF16).  Every other type gguf-py knows falls back to ``gguf.quants.dequantize``.

`repack_for_mlx(raw, qtype, shape)` turns a tensor into MLX's affine layout
(``mx.quantize``: uint32-packed weights, one scale and one bias per group, value =
scale * q + bias) when that is *exact*:

=========  =====  ====  ===========================  ================================
type       group  bits  scale                        bias
=========  =====  ====  ===========================  ================================
Q8_0       32     8     d                            -128 d        (q stored as q+128)
Q4_0       32     4     d                            -8 d
Q4_1       32     4     d                            m
Q4_K       32     4     d * sc_j  (6-bit sub-scale)  -dmin * m_j   (6-bit sub-min)
=========  =====  ====  ===========================  ================================

Each product ``scale * q`` is exact in float32 (at most 11 + 6 + 8 significant
bits), so MLX's ``scale * q + bias`` rounds once, exactly like the reference: with
float32 scales/biases the MLX dequantization equals `dequantize` bit for bit
(checked on MLX's CPU and CUDA backends), up to the sign of zero for Q8_0 / Q4_0
blocks with d < 0 (reference d * 0 = -0.0, MLX d*128 - 128*d = +0.0).
Q2_K (16-value sub-blocks: MLX's smallest group is 32), IQ2_XXS (a lattice
codebook, not affine), Q3_K/Q6_K (16-value sub-blocks) are not representable and
return None; they run through `ds4mlx.kernels.quant_moe` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

QK_K = 256

# Types with a numpy implementation in this module (the rest fall back to gguf-py).
NATIVE_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q2_K, QT.Q4_K, QT.IQ2_XXS)
# The types ds4 (antirez/ds4, ds4.c) reads from its GGUF files, weights only.
DS4_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q2_K, QT.Q4_K, QT.IQ2_XXS)
# Types `repack_for_mlx` can map exactly onto MLX affine quantization.
MLX_EXACT_TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K)


# --------------------------------------------------------------------------- types


def as_qtype(qtype) -> QT:
    """GGMLQuantizationType from an enum member, its integer value or its name
    ("q4_k", "Q4_K", "iq2_xxs")."""
    if isinstance(qtype, QT):
        return qtype
    if isinstance(qtype, (int, np.integer)):
        return QT(int(qtype))
    if isinstance(qtype, str):
        try:
            return QT[qtype.upper()]
        except KeyError:
            raise ValueError(f"unknown GGUF quantization type {qtype!r}") from None
    raise TypeError(f"not a GGUF quantization type: {qtype!r}")


def block_size(qtype) -> tuple[int, int]:
    """(values per block, bytes per block)."""
    return GGML_QUANT_SIZES[as_qtype(qtype)]


def row_bytes(qtype, n: int) -> int:
    """Bytes of one row of `n` values."""
    elems, nbytes = block_size(qtype)
    if n % elems:
        raise ValueError(f"a {as_qtype(qtype).name} row needs a multiple of {elems} values, got {n}")
    return n // elems * nbytes


def byte_shape(qtype, shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of the uint8 array holding a tensor of logical `shape`."""
    shape = tuple(int(s) for s in shape)
    return (*shape[:-1], row_bytes(qtype, shape[-1]))


@dataclass(frozen=True)
class QuantizedTensor:
    """A GGUF block-quantized tensor, still in its file bytes.

    raw:   np.ndarray uint8, shape [..., bytes_per_row] (a view of the mmap)
    qtype: gguf.GGMLQuantizationType
    shape: logical shape in numpy order (ggml `ne` reversed), e.g. [E, I, H]
    """

    raw: np.ndarray
    qtype: Any
    shape: tuple

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def dequantize(self) -> np.ndarray:
        """float32 array of `shape` (`dequantize`)."""
        return dequantize(self.raw, self.qtype, tuple(self.shape))

    def __repr__(self) -> str:
        name = getattr(self.qtype, "name", self.qtype)
        return f"QuantizedTensor({name}, shape={tuple(self.shape)}, {self.nbytes} bytes)"


# --------------------------------------------------------------------------- MX (OCP microscaling)
# DeepSeek's Hugging Face release stores FP8 E4M3 weights with UE8M0 block scales
# and FP4 E2M1 experts (two per byte, low nibble first) with one UE8M0 scale per 32
# inputs.  Both are, byte for byte, MLX's "mxfp8" / "mxfp4" layouts (one UE8M0
# scale per 32 inputs): the FP8 block scale is repeated onto each 32-wide group.

MX_GROUP = 32
MX_MODES = {"mxfp8": 8, "mxfp4": 4}


@dataclass(frozen=True)
class MXTensor:
    """A microscaled tensor still in its file bytes.

    weight: uint8 [..., out, in] (mxfp8: one E4M3 byte per value) or
            [..., out, in/2] (mxfp4: two E2M1 codes per byte, low nibble first);
            any array-like (np.asarray gives the uint8 array: a lazy read is fine)
    scales: uint8 [..., out, in/32] UE8M0 exponents (value 2**(e-127))
    mode:   "mxfp8" or "mxfp4"
    shape:  logical numpy-order shape [..., out, in]
    """

    weight: Any
    scales: Any
    mode: str
    shape: tuple

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def bits(self) -> int:
        return MX_MODES[self.mode]

    @property
    def nbytes(self) -> int:
        n = int(np.prod(self.shape, dtype=np.int64))
        return n * self.bits // 8 + n // MX_GROUP

    @property
    def sources(self) -> tuple:
        return (self.weight, self.scales)

    def dequantize(self) -> np.ndarray:
        """float32 array of `shape` (ds4's deepseek4-quantize.c decoding)."""
        w = np.asarray(self.weight).view(np.uint8)
        if self.mode == "mxfp8":
            vals = e4m3fn_table()[w]
        else:
            vals = np.empty((*w.shape[:-1], w.shape[-1] * 2), np.float32)
            vals[..., 0::2] = FP4_TABLE[w & 0x0F]
            vals[..., 1::2] = FP4_TABLE[w >> 4]
        s = e8m0_to_f32(np.asarray(self.scales))
        out = vals.reshape(*vals.shape[:-1], -1, MX_GROUP) * s[..., None]
        return out.reshape(tuple(self.shape))

    def __repr__(self) -> str:
        return f"MXTensor({self.mode}, shape={tuple(self.shape)}, {self.nbytes} bytes)"


def e8m0_to_f32(e: np.ndarray) -> np.ndarray:
    """UE8M0 exponents -> float32 (ds4 gguf-tools/deepseek4-quantize.c e8m0_to_f32:
    0 -> 2^-127 (0x00400000), else 2^(e-127))."""
    e = np.asarray(e).astype(np.uint32)
    bits = np.where(e == 0, np.uint32(0x00400000), e << 23).astype(np.uint32)
    return bits.view(np.float32)


@cache
def e4m3fn_table() -> np.ndarray:
    """byte -> float32 for FP8 E4M3FN (ds4 deepseek4-quantize.c e4m3fn_to_f32:
    the NaN codes 0x7f / 0xff read as 0)."""
    t = np.zeros(256, np.float32)
    for x in range(256):
        a = x & 0x7F
        s = -1.0 if x & 0x80 else 1.0
        if a == 0 or a == 0x7F:
            t[x] = 0.0 * s
            continue
        e, m = (x >> 3) & 0xF, x & 7
        t[x] = s * (m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    t.setflags(write=False)
    return t


FP4_TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# --------------------------------------------------------------------------- tables


@cache
def iq2xxs_grid() -> np.ndarray:
    """The IQ2_XXS lattice: [256, 8] uint8, each value one of 8, 25, 43 (taken from
    gguf-py's copy of ggml's ``iq2xxs_grid``)."""
    from gguf.quants import IQ2_XXS

    IQ2_XXS.init_grid()
    grid = np.asarray(IQ2_XXS.grid, dtype=np.float32).reshape(256, 8)
    return grid.astype(np.uint8)


@cache
def iq2xxs_grid_u64() -> np.ndarray:
    """The lattice as 256 little-endian uint64 (byte i = value i), ggml's C form."""
    return np.ascontiguousarray(iq2xxs_grid()).view("<u8").reshape(256).astype(np.uint64)


@cache
def ksigns_iq2xs() -> np.ndarray:
    """[128] uint8: the 7 stored sign bits plus an 8th bit that makes the count of
    negative values even (ggml's ``ksigns_iq2xs``)."""
    i = np.arange(128, dtype=np.uint8)
    parity = np.unpackbits(i[:, None], axis=1).sum(axis=1) & 1
    return (i | (parity.astype(np.uint8) << 7)).astype(np.uint8)


@cache
def iq2xxs_sign_table() -> np.ndarray:
    """[128, 8] float32 of +1 / -1: sign of value i for each 7-bit sign index."""
    bits = (ksigns_iq2xs()[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return np.where(bits == 0, np.float32(1), np.float32(-1)).astype(np.float32)


# --------------------------------------------------------------------------- helpers


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian fp16 bytes -> [...] float32."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _u32(b: np.ndarray) -> np.ndarray:
    """[..., 4] little-endian bytes -> [...] uint32."""
    return np.ascontiguousarray(b).view("<u4")[..., 0]


def _blocks(raw: np.ndarray, qtype: QT, shape: Sequence[int]) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raw = np.ascontiguousarray(raw).view(np.uint8)
    n = int(np.prod(shape, dtype=np.int64))
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    if shape and int(shape[-1]) % elems:
        raise ValueError(f"{qtype.name}: last dimension {shape[-1]} is not a multiple of {elems}")
    want = n // elems * nbytes
    if raw.size != want:
        raise ValueError(f"{qtype.name} tensor of shape {tuple(shape)} needs {want} bytes, got {raw.size}")
    return raw.reshape(-1, nbytes)


def q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] packed Q4_K / Q5_K scale bytes -> (sc, m), each [..., 8] uint8 (6 bits)."""
    lo, mid, hi = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, m


def q4k_pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of `q4k_scale_min`: (sc, m) [..., 8] with values < 64 -> [..., 12] uint8."""
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    out = np.empty((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((m[..., 4:8] & 0x0F) << 4)
    return out


def _nibbles_k(qs: np.ndarray) -> np.ndarray:
    """Q4_K [..., 128] bytes -> [..., 256] levels: byte 32c+l holds element 64c+l (low
    nibble) and 64c+32+l (high nibble)."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*qs.shape[:-1], QK_K)


def _nibbles_0(qs: np.ndarray) -> np.ndarray:
    """Q4_0 / Q4_1 [..., 16] bytes -> [..., 32] levels: byte l = element l (low), l+16 (high)."""
    q = qs[..., None, :] >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*qs.shape[:-1], 32)


# --------------------------------------------------------------------------- dequantize


def dequantize(raw: np.ndarray, qtype, shape: Sequence[int]) -> np.ndarray:
    """Reference dequantization: GGUF bytes of a tensor of logical (numpy-order)
    `shape` -> float32 array of that shape, through `gguf.quants` (the oracle the
    MLX / Metal / CUDA paths are tested against)."""
    qtype = as_qtype(qtype)
    shape = tuple(int(s) for s in shape)
    raw = np.asarray(raw)
    if qtype == QT.F32:
        return np.ascontiguousarray(raw).view("<f4").reshape(shape).astype(np.float32, copy=False)
    if qtype == QT.F16:
        return np.ascontiguousarray(raw).view("<f2").reshape(shape).astype(np.float32)
    if qtype == QT.BF16:
        bits = np.ascontiguousarray(raw).view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if qtype not in GGML_QUANT_SIZES:
        raise ValueError(f"{qtype.name} has no block layout")
    import gguf.quants  # the reference: ds4mlx does not re-implement ggml's block formats

    blocks = _blocks(raw, qtype, shape)
    rows = blocks.reshape(-1, row_bytes(qtype, shape[-1]) if shape else GGML_QUANT_SIZES[qtype][1])
    return gguf.quants.dequantize(rows, qtype).astype(np.float32, copy=False).reshape(shape)


# --------------------------------------------------------------------------- expert bank spans
EXPERTS_PER_LAUNCH = 16  # random / quantize calls over an expert bank: a whole [256, 4096, 4096]
# bank in one launch overflows a CUDA grid (or fails to add its graph node) on the H200

# MLX's CUDA grouped GEMM (`mx.gather_mm(..., sorted_indices=True)` with one row per pair)
# forms each expert's pointer as `expert * itemsize * rows * cols` in 32-bit int
# (prepare_grouped_mm_data, mlx/backend/cuda/gemms/grouped_gemm_unaligned.cu): in a bank of
# 2^31 bytes or more the later experts' offsets wrap, and the GEMM reads bytes before the bank
# (an illegal address, or another buffer's bytes read as weights).
GROUPED_GEMM_MAX_BYTES = 1 << 31


def expert_spans(experts: int, per_span: int = EXPERTS_PER_LAUNCH):
    """(first, count) of each `per_span`-expert slice of a bank of `experts`."""
    for e0 in range(0, experts, per_span):
        yield e0, min(per_span, experts - e0)


def grouped_gemm_spans(experts: int, expert_bytes: int) -> list[tuple[int, int]]:
    """`expert_spans` of a bank whose experts take `expert_bytes` each, every span at most
    GROUPED_GEMM_MAX_BYTES (one span when the whole bank fits): the slices a grouped GEMM
    may see one at a time."""
    return list(expert_spans(experts, max(1, GROUPED_GEMM_MAX_BYTES // max(1, expert_bytes))))


def grouped_gemm_rows(experts: int, rows: int, cols: int, itemsize: int) -> int:
    """The most output rows of an [experts, rows, cols] bank one grouped GEMM may see
    (GROUPED_GEMM_MAX_BYTES), for a bank split along its rows instead (all experts each time)."""
    return max(1, min(rows, GROUPED_GEMM_MAX_BYTES // max(1, experts * cols * itemsize)))


# --------------------------------------------------------------------------- random blocks
# Byte offsets of the float16 scale fields inside one block of each type: random
# bytes there could be inf / NaN; a fixed small scale keeps the outputs finite.


_F16_FIELDS = {"IQ2_XXS": (0,), "Q2_K": (80, 82), "Q4_K": (0, 2), "Q8_0": (0,)}


def random_block_bytes(qtype, shape, rng: np.random.Generator, scale: float = 1 / 16) -> np.ndarray:
    """numpy twin of `random_gguf_blocks` for file writers: the uint8 `byte_shape` of a
    tensor of `shape`, random quants, every f16 scale field `scale`."""
    qt = as_qtype(qtype)
    bs = byte_shape(qt, shape)
    raw = np.frombuffer(rng.bytes(int(np.prod(bs))), np.uint8).copy()
    blocks = raw.reshape(-1, block_size(qt)[1])
    for off in _F16_FIELDS[qt.name]:
        blocks[:, off : off + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    return raw.reshape(bs)


def random_gguf_blocks(qtype, experts: int, rows: int, k: int, seed: int = 0):
    """uint8 [experts, rows, row_bytes] GGUF blocks: random quants, every f16 scale 1/16."""
    import mlx.core as mx  # imported here: the rest of this module is numpy only

    qt = as_qtype(qtype)
    elems, nbytes = block_size(qt)
    chunks = []
    for e0, e in expert_spans(experts):
        b = mx.random.randint(0, 256, (e, rows, k // elems, nbytes), key=mx.random.key(seed + e0)).astype(mx.uint8)
        for off in _F16_FIELDS[qt.name]:
            b[..., off] = 0x00
            b[..., off + 1] = 0x2C  # float16 0.0625
        chunks.append(b.reshape(e, rows, row_bytes(qt, k)))
        mx.eval(chunks[-1])
    return mx.concatenate(chunks)


# --------------------------------------------------------------------------- MLX repacking


def pack_mlx(q: np.ndarray, bits: int) -> np.ndarray:
    """[..., K] integer levels < 2**bits -> [..., K*bits/32] uint32, MLX's packing
    (element j of each word at bits [j*bits, (j+1)*bits)).  bits in {2, 4, 8}."""
    if bits not in (2, 4, 8):
        raise ValueError("pack_mlx supports 2, 4 and 8 bits")
    per = 32 // bits
    q = q.astype(np.uint32).reshape(*q.shape[:-1], q.shape[-1] // per, per)
    shifts = np.arange(per, dtype=np.uint32) * bits
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)


def unpack_mlx(w_q: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `pack_mlx`: [..., W] uint32 -> [..., W*32/bits] uint8."""
    per = 32 // bits
    w_q = np.asarray(w_q, dtype=np.uint32)
    q = (w_q[..., None] >> (np.arange(per, dtype=np.uint32) * bits)) & ((1 << bits) - 1)
    return q.reshape(*w_q.shape[:-1], w_q.shape[-1] * per).astype(np.uint8)


def _affine_params(raw, qtype: QT, shape):
    """(levels [rows, K] uint8, scales [rows, K/32] f32, biases [rows, K/32] f32, bits)."""
    shape = tuple(int(s) for s in shape)
    b = _blocks(raw, qtype, shape)
    n = b.shape[0]
    if qtype == QT.Q8_0:
        d = _f16(b[:, 0:2])
        q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d, d * np.float32(-128), 8
    if qtype == QT.Q4_0:
        d = _f16(b[:, 0:2])
        return _nibbles_0(b[:, 2:]), d, d * np.float32(-8), 4
    if qtype == QT.Q4_1:
        return _nibbles_0(b[:, 4:]), _f16(b[:, 0:2]), _f16(b[:, 2:4]), 4
    if qtype == QT.Q4_K:
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, m = q4k_scale_min(b[:, 4:16])
        scales = d * sc.astype(np.float32)
        biases = -(dmin * m.astype(np.float32))
        return _nibbles_k(b[:, 16:144]), scales.reshape(n * 8), biases.reshape(n * 8), 4
    raise AssertionError(qtype)


def repack_for_mlx(raw: np.ndarray, qtype, shape: Sequence[int], dtype=None, narrow: bool = True):
    """Exact MLX affine form of a GGUF tensor, or None when there is none.

    Returns ``(w_q, scales, biases, group_size, bits)`` as MLX arrays shaped like
    ``mx.quantize`` of a ``shape`` tensor (group_size is 32), such that
    ``mx.dequantize(w_q, scales, biases, group_size, bits)`` reproduces
    `dequantize(raw, qtype, shape)`.  `dtype` (default float32) is the dtype of
    scales and biases; a narrower dtype is accepted only when every scale and
    bias converts to it exactly (e.g. Q8_0 / Q4_0 / Q4_1 in float16), else None.
    With `narrow`, a 4-bit tensor whose levels all fit in 2 bits (how
    `ds4mlx quantize --experts mlx2` stores MLX 2-bit affine weights in a Q4_1
    container) is packed as bits = 2; still exact.
    """
    import mlx.core as mx

    qtype = as_qtype(qtype)
    if qtype not in MLX_EXACT_TYPES:
        return None
    shape = tuple(int(s) for s in shape)
    q, scales, biases, bits = _affine_params(raw, qtype, shape)
    lead, k = shape[:-1], shape[-1]
    scales = scales.reshape(*lead, k // 32)
    biases = biases.reshape(*lead, k // 32)
    dtype = mx.float32 if dtype is None else dtype
    if dtype != mx.float32:
        np_dt = {mx.float16: np.float16}.get(dtype)
        if np_dt is None:
            # bfloat16: check through MLX itself.
            s_mx, b_mx = mx.array(scales).astype(dtype), mx.array(biases).astype(dtype)
            ok = np.array_equal(np.array(s_mx.astype(mx.float32)), scales) and np.array_equal(
                np.array(b_mx.astype(mx.float32)), biases
            )
        else:
            with np.errstate(over="ignore"):
                ok = np.array_equal(scales.astype(np_dt).astype(np.float32), scales) and np.array_equal(
                    biases.astype(np_dt).astype(np.float32), biases
                )
        if not ok:
            return None
    if narrow and bits == 4 and qtype in (QT.Q4_1, QT.Q4_K) and int(q.max(initial=0)) < 4:
        bits = 2
    w_q = pack_mlx(q.reshape(*lead, k), bits)
    return (mx.array(w_q), mx.array(scales).astype(dtype), mx.array(biases).astype(dtype), 32, bits)
