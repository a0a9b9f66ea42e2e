"""DS4MLX_PREFILL_EXPERTS=dequant (models/prefill_experts.py): MLX-quantized routed experts
at prefill as a dequantized stack + sorted grouped GEMM give gather_qmm's result, in one
block of rows or several, also through SwitchGLU's device-sorted pairs; a wrong value is
an error."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from ds4mlx.models import prefill_experts
from ds4mlx.models.layers import QuantizedSwitchLinear, SwitchGLU


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("max_bytes", [1, 1 << 30])  # one row per block / the whole stack
def test_dequant_path_equals_gather_qmm(monkeypatch, bits, max_bytes):
    E, out, K, P = 8, 48, 256, prefill_experts.MIN_PAIRS
    lin = QuantizedSwitchLinear(K, out, E, group_size=64, bits=bits)
    lin.weight, lin.scales, lin.biases = mx.quantize(mx.random.normal((E, out, K), key=mx.random.key(1)), 64, bits)
    idx = mx.sort(mx.random.randint(0, E, (P,), key=mx.random.key(2)))
    x = mx.random.normal((P, 1, K), key=mx.random.key(3))
    monkeypatch.delenv(prefill_experts.ENV, raising=False)
    want = np.array(lin(x, idx, sorted_indices=True))
    monkeypatch.setenv(prefill_experts.ENV, "dequant")
    monkeypatch.setattr(prefill_experts, "MAX_DEQUANT_BYTES", max_bytes)
    got = np.array(lin(x, idx, sorted_indices=True))
    assert got.shape == want.shape == (P, 1, out)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    monkeypatch.setenv(prefill_experts.ENV, "fast")
    with pytest.raises(ValueError, match=prefill_experts.ENV):
        lin(x, idx, sorted_indices=True)


def test_switch_glu_prefill_agrees(monkeypatch):
    """Through SwitchGLU (pairs sorted on the device, gate_up then down) at prefill size."""
    E, H, inter, T, k = 8, 256, 128, 200, 6  # 1,200 pairs: above MIN_PAIRS
    glu = SwitchGLU(H, inter, E, limit=10.0)
    glu.gate_up_proj.weight = mx.random.normal((E, 2 * inter, H), key=mx.random.key(4)) * 0.05
    glu.down_proj.weight = mx.random.normal((E, H, inter), key=mx.random.key(5)) * 0.05
    nn.quantize(glu, group_size=64, bits=2)
    x = mx.random.normal((1, T, H), key=mx.random.key(6))
    idx = mx.argsort(mx.random.normal((1, T, E), key=mx.random.key(7)), axis=-1)[..., :k]
    monkeypatch.delenv(prefill_experts.ENV, raising=False)
    want = np.array(glu(x, idx))
    monkeypatch.setenv(prefill_experts.ENV, "dequant")
    got = np.array(glu(x, idx))
    assert got.shape == want.shape == (1, T, k, H)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_o_a_proj_prefill_rows_equal_decode_rows(bits):
    """V4's quantized grouped o_a_proj at prefill (each group's rows one matrix) gives,
    row for row, what its one-token path gives."""
    from ds4mlx.models.deepseek_v4 import GroupedLinear

    g = GroupedLinear(128, 4 * 64, 4)
    g.weight = mx.random.normal((256, 128), key=mx.random.key(8))
    q = g.to_quantized(64, bits)
    x = mx.random.normal((1, 37, 4, 128), key=mx.random.key(9))
    chunk = np.array(q(x))
    rows = np.concatenate([np.array(q(x[:, t : t + 1])) for t in range(37)], axis=1)
    assert chunk.shape == rows.shape == (1, 37, 256)
    assert np.abs(chunk - rows).max() <= 1e-5 * max(1.0, np.abs(rows).max())


def test_dense_linear_dequant_equals_quantized_matmul(monkeypatch):
    """DS4MLX_PREFILL_LINEARS=dequant: a QMVLinear fed a chunk gives quantized_matmul's result."""
    from ds4mlx.models.qmv_linear import use_fast_qmv

    lin = nn.Linear(256, 96, bias=False)
    lin.weight = mx.random.normal((96, 256), key=mx.random.key(10))
    box = nn.Sequential(lin)
    nn.quantize(box, group_size=64, bits=4)
    assert use_fast_qmv(box) == 1
    x = mx.random.normal((1, prefill_experts.MIN_ROWS + 3, 256), key=mx.random.key(11))
    monkeypatch.delenv(prefill_experts.LINEARS_ENV, raising=False)
    want = np.array(box(x))
    monkeypatch.setenv(prefill_experts.LINEARS_ENV, "dequant")
    got = np.array(box(x))
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    monkeypatch.setenv(prefill_experts.LINEARS_ENV, "yes")
    with pytest.raises(ValueError, match=prefill_experts.LINEARS_ENV):
        box(x)
