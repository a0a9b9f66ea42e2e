"""distributed/slicing.py: a rank's part of each kind of loader value equals the same
part of the whole tensor (GGUF blocks and MX bytes compared after dequantization)."""

from __future__ import annotations

import gguf.quants
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4mlx.distributed.slicing import take
from ds4mlx.io.mapped import LazyTensor
from ds4mlx.io.quant import MXTensor, QuantizedTensor

RNG = np.random.default_rng(0)
FUSED = [(2, 5), (8 + 2, 8 + 5)]  # a gate/up split: rows 2:5 of each half of 16


def whole() -> np.ndarray:
    return RNG.standard_normal((3, 16, 64)).astype(np.float32)


@pytest.mark.parametrize("axis,ranges", [(0, [(1, 3)]), (1, FUSED), (2, [(32, 64)])])
def test_numpy_mlx_and_lazy_parts(axis, ranges):
    w = whole()
    want = np.concatenate([w[(slice(None),) * axis + (slice(a, b),)] for a, b in ranges], axis=axis)
    assert np.array_equal(take(w, axis, ranges), want)
    assert np.array_equal(np.array(take(mx.array(w), axis, ranges)), want)
    lazy = take(LazyTensor(lambda: w, w.shape, w.dtype), axis, ranges)
    assert lazy.shape == want.shape
    assert np.array_equal(lazy.load(), want) and np.array_equal(np.array(lazy.to_mlx()), want)


@pytest.mark.parametrize("axis,ranges", [(0, [(1, 3)]), (1, FUSED), (2, [(32, 64)])])
def test_gguf_blocks_part(axis, ranges):
    w = whole()
    q = QuantizedTensor(raw=gguf.quants.quantize(w, QT.Q8_0), qtype=QT.Q8_0, shape=w.shape)
    part = take(q, axis, ranges)
    full = q.dequantize()
    want = np.concatenate([full[(slice(None),) * axis + (slice(a, b),)] for a, b in ranges], axis=axis)
    assert part.shape == want.shape
    assert np.array_equal(part.dequantize(), want)


def test_gguf_split_off_a_block_boundary_is_refused():
    w = whole()
    q = QuantizedTensor(raw=gguf.quants.quantize(w, QT.Q8_0), qtype=QT.Q8_0, shape=w.shape)
    with pytest.raises(ValueError, match="blocks"):
        take(q, 2, [(16, 48)])


@pytest.mark.parametrize("mode", ["mxfp8", "mxfp4"])
def test_mx_bytes_part(mode):
    bits = 8 if mode == "mxfp8" else 4
    w = whole()
    q, scales = mx.quantize(mx.array(w), group_size=32, bits=bits, mode=mode)
    t = MXTensor(weight=np.array(q).view(np.uint8), scales=np.array(scales), mode=mode, shape=w.shape)
    part = take(t, 2, [(32, 64)])
    assert part.shape == (3, 16, 32)

    def values(weight, s):
        out = mx.dequantize(mx.array(weight).view(mx.uint32), mx.array(s), group_size=32, bits=bits, mode=mode)
        return np.array(out.astype(mx.float32))

    assert np.array_equal(values(part.weight, part.scales), values(t.weight, t.scales)[..., 32:64])
