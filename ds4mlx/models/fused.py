"""Several bias-free linear layers that read the same input, run as one mat-vec.

At decode every projection is a launch of its own whose cost barely depends on its
size (the quantized mat-vec is latency-bound at one token), so the static decode step
multiplies once by the row-wise concatenation of the weights and splits the result.
`FusedLinear.of(layers)` builds it when every layer is an `nn.Linear` (no bias, one
dtype) or every one an `nn.QuantizedLinear` (or `QMVLinear`, its decode subclass) with
the same quantization (group size, bits, mode, scale dtype, no bias), and returns None
otherwise (the caller then calls the layers one by one).  Affine weights run through
`kernels.affine_qmv.qmv` (our mat-vec on a GPU face, MLX's on the CPU), as `QMVLinear`.  It is a plain object, not an `nn.Module`, so it never shows
in the model's parameters or weight files; it holds a copy of the weights (the
originals stay for prefill).
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn

from ..kernels import affine_qmv


class FusedLinear:
    def __init__(self, arrays: dict, splits: list[int], quant: tuple | None):
        mx.eval(arrays)  # constants: built once (possibly while a step is traced), never per step
        self.arrays, self.splits, self.quant = arrays, splits, quant

    @classmethod
    def of(cls, layers) -> FusedLinear | None:
        layers = list(layers)
        if len(layers) < 2 or any("bias" in m for m in layers):
            return None
        sizes = [m.weight.shape[0] for m in layers]
        splits = list(itertools.accumulate(sizes))[:-1]
        if all(type(m) is nn.Linear for m in layers):
            if len({m.weight.dtype for m in layers}) != 1 or len({m.weight.shape[1] for m in layers}) != 1:
                return None
            return cls({"weight": mx.concatenate([m.weight for m in layers])}, splits, None)
        # QMVLinear (models/qmv_linear.py) is what every quantized linear is after loading
        if all(isinstance(m, nn.QuantizedLinear) for m in layers):
            keys = {(m.group_size, m.bits, m.mode, m.scales.dtype, m.weight.shape[1], "biases" in m) for m in layers}
            if len(keys) != 1:
                return None
            arrays = {
                k: mx.concatenate([m[k] for m in layers]) for k in ("weight", "scales", "biases") if k in layers[0]
            }
            m = layers[0]
            return cls(arrays, splits, (m.group_size, m.bits, m.mode))
        return None

    def __call__(self, x: mx.array) -> list[mx.array]:
        a = self.arrays
        if self.quant is None:
            y = x @ a["weight"].T
        elif self.quant[2] == "affine" and "biases" in a:
            gs, bits, _ = self.quant
            y = affine_qmv.qmv(x, a["weight"], a["scales"], a["biases"], group_size=gs, bits=bits)
        else:
            gs, bits, mode = self.quant
            y = mx.quantized_matmul(
                x,
                a["weight"],
                scales=a["scales"],
                biases=a.get("biases"),
                transpose=True,
                group_size=gs,
                bits=bits,
                mode=mode,
            )
        return mx.split(y, self.splits, axis=-1)


def fused_or_each(layers):
    """A callable x -> [layer(x) for layer in layers]: fused when `FusedLinear.of` can."""
    fused = FusedLinear.of(layers)
    if fused is not None:
        return fused
    layers = list(layers)
    return lambda x: [m(x) for m in layers]
