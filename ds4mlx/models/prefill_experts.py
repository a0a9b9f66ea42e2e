"""Prefill of MLX-quantized routed experts as dequantized grouped GEMMs (issue #14).

At prefill a chunk's (token, expert) pairs, sorted by expert, touch nearly every
expert of a layer: instead of `mx.gather_qmm` (quantized tiles), the expert stack is
dequantized once per chunk and the pairs run through `mx.gather_mm(...,
sorted_indices=True)`, MLX's grouped GEMM (tensor cores on CUDA).  Opt-in while the
two are compared on the H200: `DS4MLX_PREFILL_EXPERTS=dequant` (default `gather_qmm`:
MLX's own quantized gather).  The stack is dequantized in blocks of output rows of at
most MAX_DEQUANT_BYTES (every block: the same grouped GEMM for those output columns).
"""

from __future__ import annotations

import os

import mlx.core as mx

ENV = "DS4MLX_PREFILL_EXPERTS"
MIN_PAIRS = 1024  # fewer (token, expert) pairs: gather_qmm (decode-like sizes)
MAX_DEQUANT_BYTES = 6 << 30
GPU_DTYPE = mx.float16  # dequantized weights on a GPU for float32 activations (TF32-like mantissa)


def wanted(pairs: int, sorted_indices: bool) -> bool:
    mode = os.environ.get(ENV, "gather_qmm").strip().lower()
    if mode not in ("gather_qmm", "dequant"):
        raise ValueError(f"{ENV} must be 'gather_qmm' or 'dequant', not {mode!r}")
    return mode == "dequant" and sorted_indices and pairs >= MIN_PAIRS


def dequant_gather_mm(x, weight, scales, biases, indices, *, group_size: int, bits: int, mode: str) -> mx.array:
    """x [P, 1, K] (pairs in expert order), indices [P] ascending -> [P, 1, out] in x.dtype."""
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    wdt = mx.float32 if on_cpu else (GPU_DTYPE if x.dtype == mx.float32 else x.dtype)
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
