"""Which float types a loaded model computes and stores in.

ds4 keeps activations in float32 (the residual stream, norms, attention softmax,
router) and multiplies them with its 16-bit / quantized weights.  So does ds4mlx by
default: `--dtype auto` = float32 activations; float weights stay in the file's own
type on a GPU (F16 / BF16: half the bytes, and MLX promotes each matmul to float32),
and are widened to float32 on the CPU (MLX's CPU 16-bit matmuls are ~10x slower).
Quantized weights stay quantized either way.  `--dtype bfloat16` (or float16,
float32) sets both activations and float weights to that type: faster on a GPU,
at the cost of 16-bit rounding in the residual stream (logits move by 0.3-2.6 on
the tiny test models).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# name -> mx dtype attribute (mlx is imported only when a policy is resolved, so the
# CLI's argument parsing does not load it)
DTYPE_NAMES = {
    "float32": "float32",
    "f32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "f16": "float16",
    "fp16": "float16",
}
CHOICES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class DtypePolicy:
    activations: object  # mx.Dtype of the residual stream (norms, softmax, router are float32 regardless)
    weights: object  # mx.Dtype float weights are cast to, or None: as stored in the file

    def describe(self) -> str:
        w = "as stored in the file" if self.weights is None else _name(self.weights)
        tf32 = os.environ.get("MLX_ENABLE_TF32", "1") != "0"
        products = " (float32 matmuls as TF32: MLX_ENABLE_TF32)" if tf32 and self.activations_f32 else ""
        return (
            f"activations {_name(self.activations)}{products} (residual stream; norms, softmax, router in float32), "
            f"float weights {w}, quantized weights kept quantized"
        )

    @property
    def activations_f32(self) -> bool:
        return _name(self.activations) == "float32"


def _name(dt) -> str:
    return str(dt).rsplit(".", 1)[-1]


def resolve(dtype="auto") -> DtypePolicy:
    """'auto' / None / a name in DTYPE_NAMES / an mx.Dtype -> DtypePolicy."""
    import mlx.core as mx

    if dtype is None:
        return DtypePolicy(mx.float32, None)
    if isinstance(dtype, str):
        key = dtype.lower()
        if key == "auto":
            on_cpu = mx.default_device() == mx.cpu
            return DtypePolicy(mx.float32, mx.float32 if on_cpu else None)
        if key not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r} (choose one of {', '.join(CHOICES)})")
        dtype = getattr(mx, DTYPE_NAMES[key])
    if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):
        raise ValueError(f"not a float dtype: {dtype!r}")
    return DtypePolicy(dtype, dtype)


def add_argument(parser) -> None:
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=CHOICES,
        help="compute dtype: auto = float32 activations as ds4, float weights as stored "
        "(float32 on the CPU); float32 / bfloat16 / float16 set both",
    )


__all__ = ["DtypePolicy", "resolve", "add_argument", "CHOICES"]
