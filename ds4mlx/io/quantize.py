"""`ds4mlx quantize`: quantize a model's routed experts into a new GGUF.

Quantization functions (numpy, vectorised over whole tensors, no per-block loops):

``quantize(array, qtype, importance=None) -> uint8 [..., row_bytes]``
    Q8_0 (bit-identical to ggml / gguf-py), Q4_0 and Q4_1 (gguf-py), Q4_K and
    Q2_K (ggml's reference "qkx2" search: per sub-block, 21 / 16 candidate
    scales, weighted least-squares refit of scale and min, then 6-bit / 4-bit
    quantized sub-scales against the block maximum), IQ2_XXS (see below).
    `importance` ([K], e.g. an imatrix column or ds4's fallback column energy)
    multiplies the per-value error weights.

``quantize_mlx(array, bits, group_size=32) -> (w_q, scales, biases)``
    MLX's own affine quantization (``mx.quantize``), scales / biases float16.

IQ2_XXS (a 2.06 bit lattice codebook) is quantized with a nearest-grid-point
search: every 32-value sub-block gets its signs (made even per 8 values by
flipping the cheapest one, the format's constraint); then for each candidate
scale (`IQ2_SCALE_STEPS` of them) every 8-value group takes the nearest of all
256 grid points by weighted squared error (exhaustive, computed as one small
matrix product); the best scale is refitted by least squares, the 4-bit
sub-scales are quantized against the block maximum and the grid points are
picked once more at the final scale.

Quality, relative RMS error on Gaussian weights (tests/test_quant.py): Q8_0 0.005,
Q4_0 0.087, Q4_1 0.079, Q4_K 0.072, Q2_K 0.30, IQ2_XXS 0.333 (it has no zero
level), mlx4 0.08, mlx2 0.37.  No imatrix search beyond the weighting: ds4's own
quantizer with a real imatrix does better on real activations.

Speed (numpy, one core, measured here): Q8_0 ~25 M values/s, Q4_K ~3.6 M/s,
Q2_K ~2.4 M/s, IQ2_XXS ~0.75 M/s.  A full DeepSeek V4 Flash (about 2.8e11 routed
expert weights, two thirds of them IQ2_XXS in the 2-bit recipe) therefore takes
days on a laptop CPU; the tool is meant for small models and for re-typing
single tensors until the IQ2_XXS search moves to the GPU.

mlx2 / mlx4 store MLX's own affine quantization (group 32, float16 scale and
bias) in GGUF Q4_1 blocks: Q4_1 is exactly ``d * q + m`` per 32 values with
float16 d and m, so the container is lossless, standard and readable by any GGUF
tool; `ds4mlx.io.quant.repack_for_mlx(raw, Q4_1, shape, dtype=mx.float16)` gives back
the very ``mx.quantize`` arrays (2-bit levels packed as bits = 2).  The price of
the container is disk: 5 bits per weight for mlx2 (3 in memory after repacking).
ds4 itself reads only Q2_K / Q4_K / IQ2_XXS experts, so mlx2 / mlx4 files are for
ds4mlx.
"""

from __future__ import annotations

import argparse
import sys
from functools import cache

import numpy as np

from ds4mlx.io.quant import (
    QK_K,
    QT,
    QuantizedTensor,
    as_qtype,
    block_size,
    byte_shape,
    dequantize,
    iq2xxs_grid,
    q4k_pack_scale_min,
    unpack_mlx,
)

QUANTIZE_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q2_K, QT.Q4_K, QT.IQ2_XXS)
EXPERT_CHOICES = ("iq2_xxs", "q2_k", "q4_k", "mlx2", "mlx4")

# --------------------------------------------------------------------------- helpers


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """[...] float -> [..., 2] uint8 little-endian fp16."""
    return np.ascontiguousarray(v.astype("<f2")).view(np.uint8).reshape(*v.shape, 2)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf: half away from zero."""
    a = np.abs(v)
    f = np.floor(a)
    return np.sign(v) * (f + np.floor(2 * (a - f)))


def _nearest(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even."""
    return np.rint(v)


# --------------------------------------------------------------------------- Q8_0


def _q8_0(x: np.ndarray) -> np.ndarray:
    b = x.reshape(-1, 32)
    d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = _roundf(b * inv).astype(np.int8)
    return np.concatenate([_f16_bytes(d[:, 0]), q.view(np.uint8)], axis=1)


# --------------------------------------------------------------------------- K-quants


def _qkx2(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """ggml's make_qkx2_quants over rows of `x` [B, n] with weights `w`.
    Returns (scale [B], min [B] (>= 0; value = scale*L - min), L [B, n] uint8)."""
    f32 = np.float32
    lo = np.minimum(x.min(axis=1), 0).astype(f32)
    hi = x.max(axis=1).astype(f32)
    span = hi - lo
    flat = span <= 0
    span = np.where(flat, f32(1), span)
    sum_w = w.sum(axis=1)
    sum_x = (w * x).sum(axis=1)

    def err(scale, mn, L):
        diff = scale[:, None] * L + mn[:, None] - x
        return (w * (np.abs(diff) if use_mad else diff * diff)).sum(axis=1)

    iscale = f32(nmax) / span
    L = np.clip(_nearest(iscale[:, None] * (x - lo[:, None])), 0, nmax)
    scale = f32(1) / iscale
    mn = lo.copy()
    best = err(scale, mn, L)
    for i in range(nstep + 1):
        iscale = (f32(rmin + rdelta * i + nmax)) / span
        La = np.clip(_nearest(iscale[:, None] * (x - lo[:, None])), 0, nmax)
        sl = (w * La).sum(axis=1)
        sl2 = (w * La * La).sum(axis=1)
        sxl = (w * La * x).sum(axis=1)
        D = sum_w * sl2 - sl * sl
        ok = D > 0
        Ds = np.where(ok, D, f32(1))
        ts = (sum_w * sxl - sum_x * sl) / Ds
        tm = (sl2 * sum_x - sl * sxl) / Ds
        pos = tm > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            ts = np.where(pos, sxl / np.where(sl2 > 0, sl2, f32(1)), ts)
        tm = np.where(pos, f32(0), tm)
        e = err(ts, tm, La)
        upd = ok & (e < best)
        best = np.where(upd, e, best)
        scale = np.where(upd, ts, scale)
        mn = np.where(upd, tm, mn)
        L = np.where(upd[:, None], La, L)
    scale = np.where(flat, f32(0), scale)
    L = np.where(flat[:, None], 0, L)
    return scale.astype(f32), (-mn).astype(f32), L.astype(np.uint8)


def _requant_levels(x, d_eff, m_eff, L, nmax):
    """Levels for the final (quantized) sub-scales; sub-blocks with d_eff == 0 keep L."""
    nz = d_eff != 0
    safe = np.where(nz, d_eff, np.float32(1))
    Ln = np.clip(_nearest((x + m_eff[..., None]) / safe[..., None]), 0, nmax)
    return np.where(nz[..., None], Ln, L).astype(np.uint8)


def _scale_min_codes(sc: np.ndarray, mn: np.ndarray, top: int):
    """Each block's sub-block scales and mins as codes 0..`top` against the block's largest
    of each (a block whose largest is 0 codes all 0); returns (scale codes, min codes, the largests)."""
    f32 = np.float32
    max_s, max_m = sc.max(axis=1), mn.max(axis=1)
    with np.errstate(divide="ignore"):
        inv_s = np.where(max_s > 0, f32(top) / max_s, f32(0))
        inv_m = np.where(max_m > 0, f32(top) / max_m, f32(0))
    ls = np.minimum(_nearest(inv_s[:, None] * sc), top).astype(np.uint8)
    lm = np.minimum(_nearest(inv_m[:, None] * mn), top).astype(np.uint8)
    return ls, lm, max_s, max_m


def _q4_k(x: np.ndarray, importance=None) -> np.ndarray:
    f32 = np.float32
    b = x.reshape(-1, 8, 32).astype(f32)
    nb = b.shape[0]
    sub = b.reshape(-1, 32)
    av = np.sqrt((sub * sub).sum(axis=1, keepdims=True) / f32(32))
    w = av + np.abs(sub)
    if importance is not None:
        w = w * _imp_rows(importance, x, 32)
    sc, mn, L = _qkx2(sub, w, 15, -1.0, 0.1, 20, False)
    sc, mn, L = sc.reshape(nb, 8), mn.reshape(nb, 8), L.reshape(nb, 8, 32)
    ls, lm, max_s, max_m = _scale_min_codes(sc, mn, 63)
    d = (max_s / f32(63)).astype(np.float16)
    dmin = (max_m / f32(63)).astype(np.float16)
    dl = d.astype(f32)[:, None] * ls.astype(f32)
    ml = dmin.astype(f32)[:, None] * lm.astype(f32)
    L = _requant_levels(b, dl, ml, L, 15)
    Lq = L.reshape(nb, 4, 2, 32)
    qs = (Lq[:, :, 0, :] | (Lq[:, :, 1, :] << 4)).reshape(nb, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), q4k_pack_scale_min(ls, lm), qs], axis=1)


def _q2_k(x: np.ndarray, importance=None) -> np.ndarray:
    f32 = np.float32
    b = x.reshape(-1, 16, 16).astype(f32)
    nb = b.shape[0]
    sub = b.reshape(-1, 16)
    w = np.abs(sub)
    if importance is not None:
        w = w * _imp_rows(importance, x, 16)
    sc, mn, L = _qkx2(sub, w, 3, -0.5, 0.1, 15, True)
    sc, mn, L = sc.reshape(nb, 16), mn.reshape(nb, 16), L.reshape(nb, 16, 16)
    ls, lm, max_s, max_m = _scale_min_codes(sc, mn, 15)
    d = np.where(max_s > 0, max_s / f32(15), f32(0)).astype(np.float16)
    dmin = np.where(max_m > 0, max_m / f32(15), f32(0)).astype(np.float16)
    dl = d.astype(f32)[:, None] * ls.astype(f32)
    ml = dmin.astype(f32)[:, None] * lm.astype(f32)
    L = _requant_levels(b, dl, ml, L, 3).reshape(nb, 2, 4, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(nb, 64)
    scales = (ls | (lm << 4)).astype(np.uint8)
    return np.concatenate([scales, qs, _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _imp_rows(importance, rows: np.ndarray, n: int) -> np.ndarray:
    """Importance [K] -> weights shaped like ``rows.reshape(-1, n)`` (rows [R, K])."""
    imp = np.asarray(importance, dtype=np.float32).reshape(-1)
    if imp.size != rows.shape[-1]:
        raise ValueError(f"importance has {imp.size} values for rows of {rows.shape[-1]}")
    return np.broadcast_to(imp, rows.shape).reshape(-1, n)


# --------------------------------------------------------------------------- IQ2_XXS

IQ2_SCALE_STEPS = 9
_IQ2_LEVELS = np.array([8, 25, 43], dtype=np.float32) / np.float32(8)  # grid units: 1, 3.125, 5.375


@cache
def _iq2_tables():
    """(levels [256, 8] float32 in grid units, one-hot [24, 256] float32: row 3*i+l is
    1 where grid point k has level l at position i)."""
    g = iq2xxs_grid()
    lv = np.select([g == 8, g == 25, g == 43], [0, 1, 2], -1)
    assert (lv >= 0).all()
    onehot = (lv.T[:, None, :] == np.arange(3)[None, :, None]).reshape(24, 256).astype(np.float32)
    return _IQ2_LEVELS[lv], onehot


def _iq2_pick(xv, wv, s):
    """Best of the 256 grid points for each 8-value group, by weighted squared error.

    xv, wv [G, 8]; s [G] scale (value = s * level).  The error of grid point k is
    const + sum_i c[i, level_k(i)] with c[i, l] = w_i (s^2 lev_l^2 - 2 s x_i lev_l),
    so all 256 errors are one [G, 24] @ [24, 256] product: an exhaustive search.
    Returns (grid index [G], levels [G, 8] float32 in grid units)."""
    levels, onehot = _iq2_tables()
    s = s[:, None, None]
    lev = _IQ2_LEVELS[None, None, :]
    c = wv[..., None] * (s * s * lev * lev - 2 * s * xv[..., None] * lev)  # [G, 8, 3]
    err = c.reshape(-1, 24) @ onehot  # [G, 256]
    best = np.argmin(err, axis=1)
    return best, levels[best]


def _iq2_xxs(x: np.ndarray, importance=None) -> np.ndarray:
    f32 = np.float32
    b = x.reshape(-1, QK_K).astype(f32)
    nb = b.shape[0]
    sigma2 = (b * b).sum(axis=1, keepdims=True) / f32(QK_K)
    w = np.sqrt(sigma2 + b * b)
    if importance is not None:
        w = w * _imp_rows(importance, x, QK_K)
    g = b.reshape(nb * 32, 8)  # groups of 8
    wg = w.reshape(nb * 32, 8)
    neg = g < 0
    xv = np.abs(g)
    odd = (neg.sum(axis=1) & 1).astype(bool)
    cheap = np.argmin(wg * g * g, axis=1)
    rows = np.nonzero(odd)[0]
    neg[rows, cheap[rows]] ^= True
    xv[rows, cheap[rows]] *= -1
    # per 32-value sub-block (4 groups)
    xs = xv.reshape(-1, 32)
    ws = wg.reshape(-1, 32)
    S = xs.shape[0]
    vmax = xs.max(axis=1)
    live = vmax > f32(1e-15)
    best_score = np.full(S, -1.0, dtype=f32)
    best_s = np.zeros(S, dtype=f32)
    for t in np.linspace(3.0, 7.0, IQ2_SCALE_STEPS, dtype=f32):
        s = np.where(live, vmax / t, f32(0))
        _, lv = _iq2_pick(xv, wg, np.repeat(s, 4))
        q = lv.reshape(S, 32)
        sqx = (ws * xs * q).sum(axis=1)
        sq2 = (ws * q * q).sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            score = np.where(sq2 > 0, sqx * sqx / sq2, f32(0))
            fit = np.where(sq2 > 0, sqx / sq2, f32(0))
        upd = live & (score > best_score)
        best_score = np.where(upd, score, best_score)
        best_s = np.where(upd, fit, best_s)
    # a negative fit (only possible through the parity-flipped values): flip all signs
    flip = best_s < 0
    best_s = np.abs(best_s)
    negs = neg.reshape(S, 4, 8)
    negs[flip] ^= True
    xs_f = np.where(flip[:, None], -xs, xs)
    # block scale and 4-bit sub-scales: value = d * (2 ls + 1) * level
    sb = best_s.reshape(nb, 8)
    max_s = sb.max(axis=1)
    d16 = (max_s / f32(31)).astype(np.float16)
    d = d16.astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d[:, None] > 0, _nearest(f32(0.5) * (sb / d[:, None] - f32(1))), 0)
    ls = np.clip(ls, 0, 15).astype(np.uint32)
    s_final = (d[:, None] * (2 * ls + 1).astype(f32)).reshape(S)
    idx, _ = _iq2_pick(xs_f.reshape(-1, 8), wg, np.repeat(s_final, 4))
    idx = idx.reshape(nb, 8, 4).astype(np.uint8)
    bits = negs.reshape(nb, 8, 4, 8)[..., :7].astype(np.uint32)
    sign7 = (bits << np.arange(7, dtype=np.uint32)).sum(axis=-1)  # [nb, 8, 4]
    aux = (sign7 << (np.arange(4, dtype=np.uint32) * 7)).sum(axis=-1) | (ls << 28)
    sub = np.concatenate([idx, np.ascontiguousarray(aux.astype("<u4")).view(np.uint8).reshape(nb, 8, 4)], axis=-1)
    return np.concatenate([_f16_bytes(d16), sub.reshape(nb, 64)], axis=1)


# --------------------------------------------------------------------------- public


def quantize(array: np.ndarray, qtype, importance=None) -> np.ndarray:
    """Quantize float `array` [..., K] (rows along the last axis) into GGUF bytes
    ``[..., row_bytes(qtype, K)]`` uint8.  `importance` ([K]) weights the error."""
    qtype = as_qtype(qtype)
    x = np.asarray(array, dtype=np.float32)
    shape = x.shape
    out_shape = byte_shape(qtype, shape)
    if qtype == QT.F32:
        return np.ascontiguousarray(x.astype("<f4")).view(np.uint8).reshape(out_shape)
    if qtype == QT.F16:
        return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(out_shape)
    if qtype in (QT.BF16, QT.Q4_0, QT.Q4_1):
        import gguf.quants

        return np.asarray(gguf.quants.quantize(x.reshape(-1, shape[-1]), qtype), dtype=np.uint8).reshape(out_shape)
    fn = {QT.Q8_0: _q8_0, QT.Q4_K: _q4_k, QT.Q2_K: _q2_k, QT.IQ2_XXS: _iq2_xxs}.get(qtype)
    if fn is None:
        raise NotImplementedError(f"quantization to {qtype.name} is not implemented")
    rows = x.reshape(-1, shape[-1])
    if qtype == QT.Q8_0:
        return fn(rows).reshape(out_shape)
    return fn(rows, importance).reshape(out_shape)


# --------------------------------------------------------------------------- MLX affine


def quantize_mlx(array: np.ndarray, bits: int, group_size: int = 32):
    """MLX's own affine quantization (``mx.quantize`` of the float16 weights):
    ``(w_q uint32 [..., K*bits/32], scales float16 [..., K/g], biases float16 [..., K/g])``
    as numpy arrays; value = scale * q + bias."""
    import mlx.core as mx

    x = mx.array(np.asarray(array, dtype=np.float32)).astype(mx.float16)
    w_q, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    return np.array(w_q), np.array(scales), np.array(biases)


def affine_to_q4_1(w_q: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """MLX affine weights of group 32 (bits 2 or 4, float16 scales / biases) -> the
    same values as GGUF Q4_1 bytes (d = scale, m = bias, levels as nibbles): a
    lossless container that `ds4mlx.io.quant.repack_for_mlx` turns back into exactly
    these MLX arrays (2-bit levels are packed back as bits = 2)."""
    q = unpack_mlx(w_q, bits)  # [..., K]
    lead, k = q.shape[:-1], q.shape[-1]
    if scales.shape[-1] * 32 != k:
        raise ValueError("the Q4_1 container needs group_size 32")
    g = q.reshape(-1, k // 32, 2, 16)
    qs = (g[:, :, 0, :] | (g[:, :, 1, :] << 4)).astype(np.uint8)  # byte l: value l | value l+16
    d = _f16_bytes(np.asarray(scales, dtype=np.float16).reshape(-1, k // 32))
    m = _f16_bytes(np.asarray(biases, dtype=np.float16).reshape(-1, k // 32))
    blocks = np.concatenate([d, m, qs], axis=-1)  # [rows, K/32, 20]
    return blocks.reshape(*lead, k // 32 * 20)


# --------------------------------------------------------------------------- model recipes

# Routed-expert recipes: (gate, up, down) -> GGUF type, or ("mlx", bits).
EXPERT_RECIPES = {
    "iq2_xxs": (QT.IQ2_XXS, QT.IQ2_XXS, QT.Q2_K),  # ds4's published 2-bit files
    "q2_k": (QT.Q2_K, QT.Q2_K, QT.Q2_K),
    "q4_k": (QT.Q4_K, QT.Q4_K, QT.Q4_K),  # ds4's 4-bit files
    "mlx2": (("mlx", 2),) * 3,
    "mlx4": (("mlx", 4),) * 3,
}
# Dense projections ds4 keeps in Q8_0 (ds4.c weights_validate_layout): HF suffixes.
DS4_Q8_0_SUFFIXES = (
    "self_attn.q_a_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_proj.weight",
    "self_attn.o_a_proj.weight",
    "self_attn.o_b_proj.weight",
    "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight",
    "lm_head.weight",
)


def _as_float(val) -> np.ndarray:
    from ds4mlx.io.quant import MXTensor, QuantizedTensor

    if isinstance(val, (QuantizedTensor, MXTensor)):
        return val.dequantize()
    return np.asarray(val, dtype=np.float32)


def _expert_slices(val):
    """Yield float32 [rows, K] expert matrices of an [E, rows, K] tensor, one at a time."""
    if isinstance(val, QuantizedTensor):
        for e in range(val.shape[0]):
            yield dequantize(val.raw[e], val.qtype, tuple(val.shape[1:]))
    else:
        arr = _as_float(val)
        for e in range(arr.shape[0]):
            yield np.asarray(arr[e], dtype=np.float32)


def _expert_qtype(shape: tuple, kind):
    """The GGUF type an [E, rows, K] expert tensor of `shape` is stored as for `kind`
    (a GGUF type, or ("mlx", bits) stored as Q4_1); bad shapes raise."""
    if len(shape) != 3:
        raise ValueError(f"expected an [E, rows, K] expert tensor, got shape {shape}")
    qtype = QT.Q4_1 if isinstance(kind, tuple) else as_qtype(kind)
    elems = block_size(qtype)[0]
    if shape[-1] % elems:
        raise ValueError(
            f"{qtype.name if not isinstance(kind, tuple) else 'mlx' + str(kind[1])} needs rows "
            f"that are a multiple of {elems} values; these rows have {shape[-1]}"
        )
    return qtype


def quantize_expert_tensor(val, kind, importance: str = "none"):
    """[E, rows, K] float (or QuantizedTensor) -> QuantizedTensor of `kind` (a GGUF
    type, or ("mlx", bits) stored as Q4_1).  `importance` 'energy' uses ds4's
    fallback column weights: sum over the expert's rows of w**2."""
    shape = tuple(int(s) for s in (val.shape if hasattr(val, "shape") else np.shape(val)))
    qtype = _expert_qtype(shape, kind)
    out = np.empty(byte_shape(qtype, shape), dtype=np.uint8)
    for e, w in enumerate(_expert_slices(val)):
        if isinstance(kind, tuple):
            out[e] = affine_to_q4_1(*quantize_mlx(w, kind[1], 32), kind[1])
        else:
            imp = (w * w).sum(axis=0) if importance == "energy" else None
            out[e] = quantize(w, qtype, importance=imp)
    return QuantizedTensor(raw=out, qtype=qtype, shape=shape)


def _deferred_expert_tensor(val, kind, importance: str = "none"):
    """`quantize_expert_tensor(val, kind, importance)` computed only when its bytes
    are read (`write_gguf` writes tensors one at a time: a model is quantized
    without holding it, dequantized or quantized, in memory)."""
    from ds4mlx.io.mapped import LazyTensor, release
    from ds4mlx.io.quant import QuantizedTensor

    shape = tuple(int(s) for s in val.shape)
    qtype = _expert_qtype(shape, kind)

    def load():
        raw = quantize_expert_tensor(val, kind, importance).raw
        release(val)
        return raw

    return QuantizedTensor(raw=LazyTensor(load, byte_shape(qtype, shape), np.uint8), qtype=qtype, shape=shape)


def _deferred_q8_0(val):
    from ds4mlx.io.mapped import LazyTensor
    from ds4mlx.io.quant import QuantizedTensor

    shape = _shape_of(val)
    return QuantizedTensor(
        raw=LazyTensor(lambda: quantize(_as_float(val), QT.Q8_0), byte_shape(QT.Q8_0, shape), np.uint8),
        qtype=QT.Q8_0,
        shape=shape,
    )


def _half_of(val, sl: slice):
    from ds4mlx.io.mapped import LazyTensor

    E, I2, H = (int(s) for s in val.shape)
    return LazyTensor(lambda: _as_float(val)[:, sl], (E, I2 // 2, H), np.float32, sources=(val,))


def quantize_tensors(
    tensors: dict, experts: str, dense: str = "keep", importance: str = "none", down: str | None = None, log=None
) -> dict:
    """HF-named tensors -> new dict with the routed experts quantized by recipe
    `experts` (fused gate_up_proj is split into gate_proj / up_proj) and, with
    dense='q8_0', ds4's Q8_0 projections quantized; everything else as it was.
    The quantized values are computed when `write_gguf` reads them, one tensor at a
    time (QuantizedTensor whose `raw` is a LazyTensor)."""
    from ds4mlx.gguf_families import deepseek_v4 as names

    if experts not in EXPERT_RECIPES:
        raise ValueError(f"--experts must be one of {EXPERT_CHOICES}")
    g_kind, u_kind, d_kind = EXPERT_RECIPES[experts]
    if down is not None:
        d_kind = as_qtype(down)
    log = log or (lambda msg: None)
    out: dict = {}
    for name, val in tensors.items():
        if name.endswith("." + names.FUSED_GATE_UP):
            prefix = name[: -len(names.FUSED_GATE_UP)]
            half = int(val.shape[1]) // 2
            for part, kind, sl in (
                (names.EXPERT_SPLIT[0], g_kind, slice(0, half)),
                (names.EXPERT_SPLIT[1], u_kind, slice(half, None)),
            ):
                out[prefix + part] = _deferred_expert_tensor(_half_of(val, sl), kind, importance)
                log(f"{prefix + part}: {out[prefix + part]!r}")
            continue
        kind = None
        if name.endswith("." + names.EXPERT_SPLIT[0]):
            kind = g_kind
        elif name.endswith("." + names.EXPERT_SPLIT[1]):
            kind = u_kind
        elif name.endswith(".mlp.experts.down_proj"):
            kind = d_kind
        if kind is not None:
            out[name] = _deferred_expert_tensor(val, kind, importance)
            log(f"{name}: {out[name]!r}")
        elif (
            dense == "q8_0"
            and name.endswith(DS4_Q8_0_SUFFIXES)
            and len(_shape_of(val)) == 2
            and _shape_of(val)[-1] % 32 == 0
        ):
            out[name] = _deferred_q8_0(val)
            log(f"{name}: {out[name]!r}")
        else:
            out[name] = val
    return out


def _shape_of(val) -> tuple:
    return tuple(val.shape) if hasattr(val, "shape") else tuple(np.shape(val))


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="model: a ds4 GGUF file or a Hugging Face folder")
    parser.add_argument("out", help="output .gguf path")
    parser.add_argument(
        "--experts",
        choices=EXPERT_CHOICES,
        required=True,
        help="routed experts: iq2_xxs (gate/up IQ2_XXS, down Q2_K: ds4's 2-bit recipe), "
        "q2_k, q4_k (ds4's 4-bit recipe), mlx2 / mlx4 (MLX affine, group 32, "
        "float16 scale+bias, stored losslessly as Q4_1)",
    )
    parser.add_argument(
        "--down",
        choices=("q2_k", "q4_k", "iq2_xxs", "q8_0"),
        default=None,
        help="override the type of the routed down projections",
    )
    parser.add_argument(
        "--dense",
        choices=("keep", "q8_0"),
        default="keep",
        help="q8_0: also quantize the projections ds4 stores as Q8_0 "
        "(attention q/kv/output, shared experts, output head)",
    )
    parser.add_argument(
        "--importance",
        choices=("none", "energy"),
        default="none",
        help="energy: weight errors by each column's energy (ds4's fallback when it has no imatrix)",
    )
    parser.add_argument(
        "--dtype",
        choices=("f32", "f16", "bf16"),
        default="f16",
        help="storage of the remaining float tensors of 2+ dims (1-D stay f32)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only the summary")


def run(args) -> int:
    from pathlib import Path

    from ds4mlx.io.convert import write_gguf
    from ds4mlx.io.modelfile import ModelFileError, reading
    from ds4mlx.io.weights import read_weights

    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"ds4mlx quantize: {out} exists (use --force to overwrite)", file=sys.stderr)
        return 1
    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr))
    try:
        with reading(args.input):
            config, tensors, tok = read_weights(args.input)
        new = quantize_tensors(
            tensors, args.experts, dense=args.dense, importance=args.importance, down=args.down, log=log
        )
        write_gguf(
            out,
            config,
            new,
            tok if tok is not None else False,
            dtype=args.dtype,
            name=f"DeepSeek-V4 (ds4mlx quantize --experts {args.experts})",
        )
    except ModelFileError:
        raise  # the input is broken: one line, exit 2 (cli.py)
    except (FileNotFoundError, ValueError) as e:
        print(f"ds4mlx quantize: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, experts {args.experts})")
    return 0


__all__ = [
    "quantize",
    "quantize_mlx",
    "affine_to_q4_1",
    "quantize_expert_tensor",
    "quantize_tensors",
    "EXPERT_RECIPES",
    "add_arguments",
    "run",
]
