"""Turn a model file's tensors into MLX arrays one at a time.

`weights.read_weights` hands out mapped numpy views, `LazyTensor`s and packed
tensors (`QuantizedTensor`, `MXTensor`).  `to_mlx_weights` makes each float / int
tensor its final MLX array (cast to the policy's weight dtype), evaluates it and
releases the file pages it read before touching the next, so a load never holds
the file and the weights (or a tensor's two dtypes) at once.  Packed tensors pass
through untouched: `models.quantized.install_quantized` converts them, also one
at a time.
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import numpy as np

from ..io.mapped import LazyTensor, fill, release
from ..io.quant import MXTensor, QuantizedTensor

PACKED = (QuantizedTensor, MXTensor)


CHUNK_BYTES = 1 << 26  # a mapped tensor bigger than this is copied this many bytes at a time


def _chunked(view: np.ndarray, dtype) -> mx.array:
    """A big mapped numpy view -> mx.array, a block of rows at a time, each block's
    pages released once copied: the peak is the result plus one block (the
    embedding and output head of V4 Flash are 1 GB each)."""
    rows = max(1, CHUNK_BYTES // max(1, view.nbytes // view.shape[0]))

    def piece(a, b):
        def make():
            part = view[a:b]
            m = mx.array(part)
            if dtype is not None and m.dtype != dtype:
                m = m.astype(dtype)
            mx.eval(m)
            release(part)
            return m

        return make

    probe = mx.array(view[:1])
    out_dt = dtype if dtype is not None and mx.issubdtype(probe.dtype, mx.floating) else probe.dtype
    return fill(
        view.shape,
        out_dt,
        [
            (slice(a, min(a + rows, view.shape[0])), piece(a, min(a + rows, view.shape[0])))
            for a in range(0, view.shape[0], rows)
        ],
    )


def to_mlx(value, dtype=None) -> mx.array:
    """One tensor -> evaluated mx.array (floats cast to `dtype` unless None); the
    mapped pages behind `value` are released."""
    if isinstance(value, np.ndarray) and value.nbytes > CHUNK_BYTES and value.ndim >= 1 and value.shape[0] > 1:
        cast = dtype if np.issubdtype(value.dtype, np.floating) else None
        a = _chunked(value, cast)
        mx.eval(a)
        release(value)
        return a
    if isinstance(value, mx.array):
        a = value
    elif isinstance(value, LazyTensor):
        a = value.to_mlx()
    else:
        a = mx.array(np.asarray(value))
    if dtype is not None and mx.issubdtype(a.dtype, mx.floating) and a.dtype != dtype:
        a = a.astype(dtype)
    mx.eval(a)
    release(value)
    return a


def to_mlx_weights(weights: dict, dtype=None) -> dict:
    """{name: tensor} -> {name: mx.array}, one tensor at a time; packed tensors kept."""
    return {k: v if isinstance(v, PACKED) else to_mlx(v, dtype) for k, v in weights.items()}


def packed_to_mlx(value):
    """A packed tensor with its bytes moved into MLX (for weights kept but not
    installed in modules, e.g. the MTP block): QuantizedTensor.raw / MXTensor
    weight + scales become uint8 mx.arrays."""
    if isinstance(value, QuantizedTensor):
        out = QuantizedTensor(raw=to_mlx(value.raw), qtype=value.qtype, shape=tuple(value.shape))
    elif isinstance(value, MXTensor):
        out = MXTensor(
            weight=to_mlx(value.weight), scales=to_mlx(value.scales), mode=value.mode, shape=tuple(value.shape)
        )
    else:
        return to_mlx(value)
    release(value)
    return out


class KeptTensors(Mapping):
    """A file's tensors kept aside as the loader handed them out (mapped views, lazy or
    packed tensors: nothing read yet), each made MLX (`packed_to_mlx`) at its first access
    and kept.  The MTP head's tensors (`model.mtp_weights`): a model never run with `--mtp`
    does not hold them in memory (GLM 5.x's next-n layer is one MoE layer of the model)."""

    def __init__(self, raw: dict):
        self._raw, self._done = dict(raw), {}

    def __getitem__(self, name):
        if name not in self._done:
            self._done[name] = packed_to_mlx(self._raw[name])
        return self._done[name]

    def __iter__(self):
        return iter(self._raw)

    def __len__(self):
        return len(self._raw)


__all__ = ["to_mlx", "to_mlx_weights", "packed_to_mlx", "KeptTensors"]
