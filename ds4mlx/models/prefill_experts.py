"""Prefill of MLX-quantized weights as dequantized GEMMs (issue #14): routed experts
(grouped GEMMs) and, separately switched, the dense quantized linears.

At prefill a chunk's (token, expert) pairs, sorted by expert, touch nearly every
expert of a layer: instead of `mx.gather_qmm` (quantized tiles), the expert stack is
dequantized once per chunk and the pairs run through `mx.gather_mm(...,
sorted_indices=True)`, MLX's grouped GEMM (tensor cores on CUDA).  Opt-in while the
two are compared on the H200: `DS4MLX_PREFILL_EXPERTS=dequant` (default `gather_qmm`:
MLX's own quantized gather).  The stack is dequantized in blocks of output rows of at
most MAX_DEQUANT_BYTES (every block: the same grouped GEMM for those output columns).

`DS4MLX_PREFILL_LINEARS=dequant` does the same for every dense `QMVLinear`
(models/qmv_linear.py) fed at least MIN_ROWS rows: x @ dequantize(W).T, one GEMM, in
place of `mx.quantized_matmul` (default `quantized_matmul`).
"""

from __future__ import annotations

import os

import mlx.core as mx

ENV = "DS4MLX_PREFILL_EXPERTS"
MIN_PAIRS = 1024  # fewer (token, expert) pairs: gather_qmm (decode-like sizes)
MAX_DEQUANT_BYTES = 6 << 30
GPU_DTYPE = mx.float16  # dequantized weights on a GPU for float32 activations (TF32-like mantissa)


LINEARS_ENV = "DS4MLX_PREFILL_LINEARS"
MIN_ROWS = 256  # rows of x (tokens) from which a dense linear is dequantized


def _mode(env: str, default: str) -> str:
    mode = os.environ.get(env, default).strip().lower()
    if mode not in (default, "dequant"):
        raise ValueError(f"{env} must be {default!r} or 'dequant', not {mode!r}")
    return mode


def wanted(pairs: int, sorted_indices: bool) -> bool:
    return _mode(ENV, "gather_qmm") == "dequant" and sorted_indices and pairs >= MIN_PAIRS


def linear_wanted(rows: int) -> bool:
    return rows >= MIN_ROWS and _mode(LINEARS_ENV, "quantized_matmul") == "dequant"


def _dtype_for(x_dtype):
    if mx.default_device().type == mx.DeviceType.cpu:
        return mx.float32
    return GPU_DTYPE if x_dtype == mx.float32 else x_dtype


def dequant_matmul(x, weight, scales, biases, *, group_size: int, bits: int, mode: str) -> mx.array:
    """x [..., K] @ dequantize(weight).T -> [..., out] in x.dtype (one GEMM)."""
    wdt = _dtype_for(x.dtype)
    w = mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits, mode=mode, dtype=wdt)
    return (x.astype(wdt) @ w.T).astype(x.dtype)


def dequant_gather_mm(x, weight, scales, biases, indices, *, group_size: int, bits: int, mode: str) -> mx.array:
    """x [P, 1, K] (pairs in expert order), indices [P] ascending -> [P, 1, out] in x.dtype."""
    wdt = _dtype_for(x.dtype)
    E, rows = weight.shape[0], weight.shape[1]
    K = x.shape[-1]
    step = max(1, min(rows, MAX_DEQUANT_BYTES // max(E * K * wdt.size, 1)))
    xs = x.astype(wdt)
    outs = []
    for r0 in range(0, rows, step):
        sl = slice(r0, r0 + step)
        w = mx.dequantize(
            weight[:, sl],
            scales[:, sl],
            None if biases is None else biases[:, sl],
            group_size=group_size,
            bits=bits,
            mode=mode,
            dtype=wdt,
        )  # [E, rows', K]
        outs.append(mx.gather_mm(xs, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=True))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)
    return out.astype(x.dtype)
