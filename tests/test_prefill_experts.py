"""Prefill paths of models/prefill_experts.py: V4's grouped o_a_proj at prefill equals its
one-token rows; DS4MLX_PREFILL_LINEARS=dequant gives quantized_matmul's result; a wrong value
is an error."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from ds4mlx.models import prefill_experts

# on a GPU (tools/device.sh gpu-tests runs this file there) the dequantized weights
# are float16: a float16-rounding bound instead of the CPU's float32 one
REL = 1e-4 if mx.default_device().type == mx.DeviceType.cpu else 4e-3


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
    assert np.abs(got - want).max() <= REL * max(1.0, np.abs(want).max())
    monkeypatch.setenv(prefill_experts.LINEARS_ENV, "yes")
    with pytest.raises(ValueError, match=prefill_experts.LINEARS_ENV):
        box(x)
