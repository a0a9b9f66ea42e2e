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
from ..kernels.activations import clamped_swiglu, rms_normed


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

    def __call__(self, x: mx.array, norm: tuple | None = None) -> list[mx.array]:
        """The layers' outputs of x, or (norm = (weight, eps)) of ``mx.fast.rms_norm(x, *norm)``,
        the norm inside the mat-vec's launch on a GPU face."""
        a = self.arrays
        if self.quant is not None and self.quant[2] == "affine" and "biases" in a:
            gs, bits, _ = self.quant
            y = affine_qmv.qmv(x, a["weight"], a["scales"], a["biases"], group_size=gs, bits=bits, norm=norm)
            return mx.split(y, self.splits, axis=-1)
        x = rms_normed(x, norm)
        if self.quant is None:
            y = x @ a["weight"].T
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

    def swiglu(self, x: mx.array, limit: float | None) -> mx.array:
        """``clamped_swiglu(gate, up, limit)`` of a (gate, up) pair of equal widths: on a GPU
        one launch (affine_qmv's gate_up + SwiGLU mode over a one-expert bank) where the
        split mat-vec and the elementwise SwiGLU were two; elsewhere the plain expression."""
        a, q = self.arrays, self.quant
        fused = (
            q is not None
            and q[2] == "affine"
            and "biases" in a
            and len(self.splits) == 1
            and 2 * self.splits[0] == a["weight"].shape[0]
            and x.size == x.shape[-1]  # one token (decode)
            and affine_qmv.kernel_face(x.shape[-1], q[0], q[1], moe=True) is not None
        )
        if not fused:
            g, u = self(x)
            return clamped_swiglu(g, u, limit)
        if getattr(self, "_one_expert", None) is None:  # the one-expert bank's ids [[0]], a constant
            self._one_expert = mx.zeros((1, 1), mx.int32)
            mx.eval(self._one_expert)
        gs, bits, _ = q
        h = affine_qmv.gather_swiglu(
            x.reshape(1, -1),
            a["weight"][None],
            a["scales"][None],
            a["biases"][None],
            self._one_expert,
            limit=limit,
            group_size=gs,
            bits=bits,
        )
        return h.reshape(*x.shape[:-1], self.splits[0])


def swiglu_of(gate: nn.Module, up: nn.Module):
    """A callable (x, limit) -> clamped_swiglu(gate(x), up(x), limit): `FusedLinear.swiglu`
    when the two fuse."""
    fused = FusedLinear.of([gate, up])
    if fused is not None:
        return fused.swiglu
    return lambda x, limit: clamped_swiglu(gate(x), up(x), limit)


def fused_or_each(layers):
    """A callable (x, norm=None) -> [layer(x') for layer in layers], x' = x or, with norm =
    (weight, eps), ``mx.fast.rms_norm(x, *norm)``: fused when `FusedLinear.of` can."""
    fused = FusedLinear.of(layers)
    if fused is not None:
        return fused
    layers = list(layers)
    if len(layers) == 1 and hasattr(layers[0], "normed"):  # one mat-vec (QMVLinear): the norm inside it
        return lambda x, norm=None: [layers[0](x) if norm is None else layers[0].normed(x, norm)]

    return lambda x, norm=None: [m(rms_normed(x, norm)) for m in layers]
