"""models/fused.py: projections that read the same input run as one mat-vec.

The loader turns every `nn.QuantizedLinear` into `QMVLinear` (models/qmv_linear.py); the
fusion used to accept the exact class only, so on a loaded model the decode step ran each
projection as its own launch (found on the H200: 7 mat-vecs per CSA layer where one was
meant).  These tests pin that the loaded classes fuse and give the unfused results.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ds4mlx.models.fused import FusedLinear, fused_or_each
from ds4mlx.models.qmv_linear import QMVLinear, use_fast_qmv


def _quantized(sizes, k=128, bits=8):
    mx.random.seed(3)
    holder = nn.Module()
    holder.layers = [nn.Linear(k, n, bias=False) for n in sizes]
    nn.quantize(holder, group_size=64, bits=bits)
    use_fast_qmv(holder)
    return holder.layers


def test_loaded_quantized_linears_fuse_and_match_each():
    layers = _quantized([64, 32, 96])
    assert all(type(m) is QMVLinear for m in layers)
    fused = FusedLinear.of(layers)
    assert fused is not None and fused.quant == (64, 8, "affine")
    x = mx.random.normal((1, 1, 128))
    for got, m in zip(fused(x), layers):
        np.testing.assert_allclose(np.array(got), np.array(m(x)), rtol=1e-5, atol=1e-5)


def test_mixed_quantization_is_not_fused():
    a = _quantized([64], bits=8)
    b = _quantized([32], bits=4)
    assert FusedLinear.of(a + b) is None
    x = mx.random.normal((1, 1, 128))
    outs = fused_or_each(a + b)(x)
    assert [o.shape[-1] for o in outs] == [64, 32]


def test_the_synthetic_models_attention_projections_fuse():
    """The decode step of a loaded (quantized) V4 model builds one fused input projection."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_synthetic import TINY

    from ds4mlx.bench.synthetic import build_synthetic_v4_flash

    lm, _, _ = build_synthetic_v4_flash(layers=3, experts=8, overrides=TINY)
    s = lm.new_session(64)
    s.prefill([5, 6, 7, 8])
    s.decode(9)
    for layer in lm.model.model.layers:
        assert isinstance(layer.self_attn._step_proj, FusedLinear)
        assert isinstance(layer.mlp._step_shared.__self__, FusedLinear)  # its gate_up + SwiGLU
