"""This rank's part of one tensor, taken before the tensor is read.

A part is a list of (start, stop) ranges along one axis, concatenated (one range for a
plain split; two for a fused gate/up projection whose gate and up rows are split
alike).  Each loader value keeps its kind, so the loader converts it as before:

* numpy views of the mapping (GGUF F32 / F16): sliced views, only the part's pages read;
* `QuantizedTensor` (GGUF blocks): the raw rows sliced; along the last (input) axis the
  ranges must fall on block boundaries;
* `MXTensor` (FP8 / FP4 with UE8M0 scales): weight and scales sliced alike (32-value
  groups on the last axis);
* `mx.array`: sliced (an already loaded safetensors dict);
* `LazyTensor` (BF16 GGUF, safetensors): read whole when the loader asks, then sliced
  (one tensor at a time, so the peak is one full tensor).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..io.mapped import LazyTensor
from ..io.quant import MX_GROUP, MXTensor, QuantizedTensor, block_size

Ranges = list[tuple[int, int]]


def shape_of(value) -> tuple:
    return tuple(int(s) for s in value.shape)


def _index(ndim: int, axis: int, a: int, b: int) -> tuple:
    return (slice(None),) * axis + (slice(a, b),)


def _numpy(arr: np.ndarray, axis: int, ranges: Ranges) -> np.ndarray:
    parts = [arr[_index(arr.ndim, axis, a, b)] for a, b in ranges]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


def _mlx(arr: mx.array, axis: int, ranges: Ranges) -> mx.array:
    parts = [arr[_index(arr.ndim, axis, a, b)] for a, b in ranges]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def _scaled(ranges: Ranges, per: int, what: str, num: int = 1) -> Ranges:
    """Ranges of values -> ranges of storage units holding `per` values (times num bytes)."""
    if any(a % per or b % per for a, b in ranges):
        raise ValueError(f"{what}: a split at {ranges} does not fall on {per}-value blocks")
    return [(a // per * num, b // per * num) for a, b in ranges]


def take(value, axis: int, ranges: Ranges):
    """`value` restricted to `ranges` along `axis`, as the same kind of loader value."""
    shape = list(shape_of(value))
    axis = axis % len(shape)
    shape[axis] = sum(b - a for a, b in ranges)
    if isinstance(value, np.ndarray):
        return _numpy(value, axis, ranges)
    if isinstance(value, mx.array):
        return _mlx(value, axis, ranges)
    if isinstance(value, QuantizedTensor):
        raw_ranges = ranges
        if axis == len(shape) - 1:
            elems, nbytes = block_size(value.qtype)
            raw_ranges = _scaled(ranges, elems, "GGUF blocks", nbytes)
        return QuantizedTensor(raw=_numpy(value.raw, axis, raw_ranges), qtype=value.qtype, shape=tuple(shape))
    if isinstance(value, MXTensor):
        w_ranges = s_ranges = ranges
        if axis == len(shape) - 1:
            per_byte = 2 if value.mode == "mxfp4" else 1
            w_ranges = _scaled(ranges, per_byte, "MX bytes")
            s_ranges = _scaled(ranges, MX_GROUP, "MX scale groups")
        return MXTensor(
            weight=_numpy(np.asarray(value.weight), axis, w_ranges),
            scales=_numpy(np.asarray(value.scales), axis, s_ranges),
            mode=value.mode,
            shape=tuple(shape),
        )
    if isinstance(value, LazyTensor):
        return LazyTensor(
            lambda: _numpy(value.load(), axis, ranges),
            shape,
            value.dtype,
            to_mlx=lambda: _mlx(value.to_mlx(), axis, ranges),
            sources=value.sources,
        )
    return _numpy(np.asarray(value), axis, ranges)
