"""Prefill paths: how routed experts and dense quantized linears run when a forward is
fed many tokens.

`DS4MLX_PREFILL_EXPERTS` picks the routed experts' prefill path (SwitchGLU, for at
least MIN_PAIRS (token, expert) pairs; decode and small chunks keep today's kernels):

* `auto` (default): `grouped` on a GPU, `gather_qmm` on the CPU (reference-exact there);
* `grouped`: per-expert batched GEMMs (models/grouped_experts.py: pairs sorted on the
  device, one host sync per call for the per-expert counts, M = rows per expert);
* `grouped_blocks`: `grouped`, with GGUF banks multiplied on their blocks
  (`kernels.grouped_qmm`: each weight tile decoded once per tile of up to 64 tokens, no
  dequantized copy of the experts); where its GPU face failed its first-use self-test, the
  dequantized slices of `grouped`; on the CPU its reference face (float32). `auto` does not
  pick it until a GPU measurement (tools/prefill_experts_bench.py) says it wins;
* `grouped_blocks_mma`: `grouped_blocks` with the tile products on tensor cores / simdgroup
  matrices (16-bit operands, float32 sums: `grouped_qmm(..., mma=True)`); not `auto`'s either
  until measured;
* `gather_qmm`: the former path, one M = 1 product per pair (`mx.gather_qmm` for MLX
  experts, `kernels.quant_moe.gather_qmm` for GGUF blocks): the CPU's path and the
  oracle the grouped path is tested against.

`DS4MLX_PREFILL_LINEARS` for every dense `QMVLinear` (models/qmv_linear.py) fed at least
MIN_ROWS rows: `dequant` x @ dequantize(W).T, one GEMM, in place of `mx.quantized_matmul`
(`quantized_matmul`); `auto` (default): `dequant` on a GPU (1.8-2.3x MLX's quantized_matmul
at 8 bits on a CUDA GPU's 2,048-row projections, docs/bench-history.md), `quantized_matmul` on the CPU.
"""

from __future__ import annotations

import os

import mlx.core as mx

ENV = "DS4MLX_PREFILL_EXPERTS"
BLOCK_MODES = ("grouped_blocks", "grouped_blocks_mma")  # the grouped path on the GGUF blocks
MODES = ("auto", "grouped", *BLOCK_MODES, "gather_qmm")
# Fewer (token, expert) pairs (a 170-token chunk at top-6): today's kernels (decode-like
# sizes). Reasoned, not swept: tools/prefill_experts_bench.py --chunks times both sides.
MIN_PAIRS = 1024
GPU_DTYPE = mx.float16  # dequantized weights on a GPU for float32 activations (TF32-like mantissa)


LINEARS_ENV = "DS4MLX_PREFILL_LINEARS"
MIN_ROWS = 256  # rows of x (tokens) from which a dense linear is dequantized


def _mode(env: str, allowed: tuple) -> str:
    mode = os.environ.get(env, allowed[0]).strip().lower()
    if mode not in allowed:
        raise ValueError(f"{env} must be one of {', '.join(map(repr, allowed))}, not {mode!r}")
    return mode


def experts_mode() -> str:
    return _mode(ENV, MODES)


def grouped_wanted(pairs: int) -> bool:
    """SwitchGLU's `pairs` (token, expert) pairs as per-expert batched GEMMs?"""
    if pairs < MIN_PAIRS:
        return False
    mode = experts_mode()
    return mode in ("grouped", *BLOCK_MODES) or (mode == "auto" and mx.default_device().type != mx.DeviceType.cpu)


def blocks_wanted() -> bool:
    """GGUF banks of the grouped path multiplied on their blocks (`grouped_blocks`, `grouped_blocks_mma`)?"""
    return experts_mode() in BLOCK_MODES


def mma_wanted() -> bool:
    """...and on tensor cores / simdgroup matrices (`grouped_blocks_mma`)?"""
    return experts_mode() == "grouped_blocks_mma"


def linear_wanted(rows: int) -> bool:
    mode = _mode(LINEARS_ENV, ("auto", "quantized_matmul", "dequant"))
    on_gpu = mx.default_device().type != mx.DeviceType.cpu
    return rows >= MIN_ROWS and (mode == "dequant" or (mode == "auto" and on_gpu))


def _dtype_for(x_dtype):
    if mx.default_device().type == mx.DeviceType.cpu:
        return mx.float32
    return GPU_DTYPE if x_dtype == mx.float32 else x_dtype


def _float32_params(wdt, mode: str, scales, biases):
    """Affine scales / biases in float32 when the weights are dequantized to float32:
    mx.dequantize computes in the scales' type (bf16 scales would round every weight)."""
    if wdt != mx.float32 or mode != "affine":
        return scales, biases
    return scales.astype(mx.float32), None if biases is None else biases.astype(mx.float32)


def dequant_matmul(x, weight, scales, biases, *, group_size: int, bits: int, mode: str) -> mx.array:
    """x [..., K] @ dequantize(weight).T -> [..., out] in x.dtype (one GEMM)."""
    wdt = _dtype_for(x.dtype)
    scales, biases = _float32_params(wdt, mode, scales, biases)
    w = mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits, mode=mode, dtype=wdt)
    return (x.astype(wdt) @ w.T).astype(x.dtype)
