"""Tensors that stay in their file until the loader asks for them, one at a time.

A model file is read through a memory mapping (GGUF: `gguf.GGUFReader`'s
`np.memmap`) or lazily per tensor (safetensors: `mx.load`).  The loader turns
each tensor into its final MLX array and then calls `release(value)`: the pages
of the mapping it read are handed back to the kernel (`madvise(MADV_DONTNEED)`;
they stay in the page cache, no longer in this process's resident set), so the
peak resident memory of a load is about the final weights plus one tensor, not
the file plus the weights.

MLX has no way to wrap a mapped buffer without copying it, so even on Apple's
unified memory each tensor is copied once into an MLX buffer; what the file's
mapping held is released right after.

`LazyTensor` is a tensor computed on demand from mapped or lazily loaded parts
(two expert halves concatenated, a BF16 tensor widened, a safetensors tensor
not yet read): `np.asarray(t)` / `t.load()` gives numpy, `t.to_mlx()` an MLX
array made without a float32 detour where the parts allow it.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np

_PAGE = mmap.PAGESIZE


class LazyTensor:
    """A tensor of `shape` / `dtype` (numpy dtype of `load()`), computed when asked.

    `load()` -> numpy array; `to_mlx()` -> mx.array (by default `mx.array(load())`);
    `sources`: the mapped numpy views it reads, released by `release(t)`;
    `rows(ids)` (optional) -> numpy array of just the rows `ids` of axis 0, read without
    the rest (the SSD expert store reads one expert at a time: ds4mlx/experts/)."""

    __slots__ = ("shape", "dtype", "_load", "_to_mlx", "sources", "rows")

    def __init__(self, load: Callable[[], np.ndarray], shape, dtype, to_mlx=None, sources=(), rows=None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self._load = load
        self._to_mlx = to_mlx
        self.sources = tuple(sources)
        self.rows = rows

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def load(self) -> np.ndarray:
        return self._load()

    def to_mlx(self):
        if self._to_mlx is not None:
            return self._to_mlx()
        import mlx.core as mx

        return mx.array(self._load())

    def __array__(self, dtype=None, copy=None):
        a = self._load()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"LazyTensor({self.dtype}, shape={self.shape})"


def fill(shape, dtype, pieces):
    """An mx.array of `shape` built from `pieces` = [(index, make)], each `make()`
    an array for `out[index]`, evaluated and dropped one at a time: MLX donates the
    output's buffer to each slice update, so the peak is the result plus one piece
    (where `mx.stack` / `mx.concatenate` would hold every input and the result)."""
    import mlx.core as mx

    out = mx.zeros(shape, dtype)
    for idx, make in pieces:
        out[idx] = make()
        mx.eval(out)
    return out


def memmap_of(arr: np.ndarray):
    """The `np.memmap` a numpy view reads from (None for any other array)."""
    base = arr
    while isinstance(base, np.ndarray) and not isinstance(base, np.memmap):
        base = base.base
    return base if isinstance(base, np.memmap) and getattr(base, "_mmap", None) is not None else None


def release_array(arr) -> None:
    """Drop the resident pages of the mapping behind numpy view `arr` (no-op for
    an array that is not a view of an `np.memmap`).  The data stay valid: a later
    read faults them back in from the page cache or the file."""
    if not isinstance(arr, np.ndarray) or arr.nbytes == 0:
        return
    mm = memmap_of(arr)
    if mm is None:
        return
    # np.memmap maps from an allocation-granularity boundary at or before its offset
    mm_start = mm.ctypes.data - (mm.offset % mmap.ALLOCATIONGRANULARITY)
    lo = arr.ctypes.data - mm_start
    hi = lo + arr.nbytes
    lo -= lo % _PAGE
    hi = min(hi, len(mm._mmap))
    if hi <= lo:
        return
    try:
        mm._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (AttributeError, OSError, ValueError):
        pass  # a platform without madvise keeps the pages: correct, only more resident


def release(value) -> None:
    """Release the mapped pages behind a loader value: numpy view, LazyTensor, or
    anything with a `.raw` view (QuantizedTensor) or `.sources`."""
    if isinstance(value, np.ndarray):
        release_array(value)
        return
    for src in getattr(value, "sources", ()) or ():
        release(src)
    raw = getattr(value, "raw", None)
    if isinstance(raw, np.ndarray):
        release_array(raw)


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM on Linux, ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


__all__ = ["LazyTensor", "fill", "memmap_of", "release", "release_array", "peak_rss_bytes"]
