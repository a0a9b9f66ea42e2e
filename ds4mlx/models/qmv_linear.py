"""`nn.QuantizedLinear` whose decode-sized calls run our affine mat-vec on a GPU.

MLX's quantized mat-vec takes about the same time at 2, 4 and 8 bits on a CUDA GPU
(docs/bench-history.md); `kernels.affine_qmv.qmv` reads the packed weights at bandwidth.  `QMVLinear`
is a drop-in subclass (same parameters, same results up to float32 summation
order): up to `affine_qmv.MAX_ROWS` rows of x on a GPU face go to the kernel, the
rest (prefill, the CPU, non-affine modes) to ``mx.quantized_matmul`` as before.
`use_fast_qmv(model)` switches every plain `nn.QuantizedLinear` of a model (the
lm_head too) in place, and every `nn.QuantizedEmbedding` to `QMVEmbedding` (its
`as_linear`, a tied head, likewise); the loader and the synthetic-model builder call it.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..kernels import affine_qmv
from ..kernels.activations import rms_normed
from . import prefill_experts


class QMVLinear(nn.QuantizedLinear):
    def normed(self, x: mx.array, norm: tuple) -> mx.array:
        """``self(mx.fast.rms_norm(x, *norm))``, norm = (weight, eps): on a GPU face the norm
        runs inside the mat-vec's launch (affine_qmv's NORM)."""
        biases = self.get("biases")
        if self.mode != "affine" or biases is None or "bias" in self:
            return self(rms_normed(x, norm))
        return affine_qmv.qmv(
            x, self["weight"], self["scales"], biases, group_size=self.group_size, bits=self.bits, norm=norm
        )

    def __call__(self, x: mx.array) -> mx.array:
        biases = self.get("biases")
        if self.mode != "affine" or biases is None:
            return super().__call__(x)
        if prefill_experts.linear_wanted(
            x.size // max(x.shape[-1], 1)
        ):  # prefill: one dequantized GEMM (prefill_experts.linear_wanted)
            y = prefill_experts.dequant_matmul(
                x, self["weight"], self["scales"], biases, group_size=self.group_size, bits=self.bits, mode=self.mode
            )
            return y + self["bias"] if "bias" in self else y
        y = affine_qmv.qmv(x, self["weight"], self["scales"], biases, group_size=self.group_size, bits=self.bits)
        if "bias" in self:
            y = y + self["bias"]
        return y


class QMVEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose `as_linear` (a tied output head) runs like `QMVLinear`."""

    def as_linear(self, x: mx.array) -> mx.array:
        biases = self.get("biases")
        if self.mode != "affine" or biases is None:
            return super().as_linear(x)
        return affine_qmv.qmv(x, self["weight"], self["scales"], biases, group_size=self.group_size, bits=self.bits)


def use_fast_qmv(model: nn.Module) -> int:
    """Make every `nn.QuantizedLinear` / `nn.QuantizedEmbedding` (exactly those classes)
    of `model` a `QMVLinear` / `QMVEmbedding`; returns how many.  Parameters and their
    names do not change."""
    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:
            m.__class__ = QMVLinear
            n += 1
        elif type(m) is nn.QuantizedEmbedding:
            m.__class__ = QMVEmbedding
            n += 1
    return n
