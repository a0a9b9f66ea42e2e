"""Weights I/O: ds4 GGUF files and Hugging Face safetensors folders.

`read_weights(path) -> (config, tensors, tokenizer)`:

* `config` is the canonical DeepseekV4Config dict (`gguf_families.deepseek_v4.normalize_config`):
  the HF field names, legacy fields folded in, defaults filled.  Other families
  (`gguf_families`: DeepSeek V4.1, GLM 5.2 / 5.3, Qwen3.8) give their config as
  written: the HF folder's config.json, or the config recorded in the GGUF.
* `tensors` maps Hugging Face *in-memory* names (the keys of the oracle's
  model.safetensors, e.g. `model.layers.0.mlp.experts.gate_up_proj`) to
  - numpy arrays: GGUF F32 and F16 are zero-copy views of the memory-mapped
    file (safetensors tensors are copies made by the `safetensors` library);
    BF16 comes back as a float32 copy (numpy has no bfloat16; no ml_dtypes
    dependency); `mlp.gate.tid2eid` is int64 (GGUF stores I32: a small copy);
  - `QuantizedTensor(raw, qtype, shape)` for GGUF quantized types: `raw` is the
    uint8 view of the file bytes shaped [..., bytes_per_row], `shape` the logical
    numpy-order shape; `.dequantize()` calls `ds4mlx.io.quant.dequantize`.
  Routed experts: when ds4's split `ffn_gate_exps` / `ffn_up_exps` are float they
  are concatenated into the fused `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows
  first, a copy).  When they are quantized they are handed out split, as
  `mlp.experts.gate_proj` and `mlp.experts.up_proj` [E, I, H] (no copy), because
  quantized rows cannot be fused without rewriting the whole expert bank.
* `tokenizer` is a `ds4mlx.runtime.tokenizer.Tokenizer` from the GGUF's tokenizer.ggml.*
  metadata or the folder's tokenizer.json, else None.

GGUF files are read with `gguf.GGUFReader` (a subclass that keeps its parse
fast), safetensors with `safetensors.safe_open`.  Errors are ValueError /
FileNotFoundError with a message naming the file.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import sys
import warnings
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ..gguf_families import deepseek_v4 as names
from ..gguf_families.deepseek_v4 import MTP_PREFIX, mtp_hf_name
from ..gguf_families.metadata import fields_metadata
from .mapped import LazyTensor, fill, release
from .quant import FP4_TABLE, MX_GROUP, MXTensor, QuantizedTensor, e4m3fn_table, e8m0_to_f32
from .split_names import SPLIT_GGUF, part_name

GGUF_MAGIC = b"GGUF"


# ----------------------------------------------------------------------------- GGUF
class _TruncatedGGUF(ValueError):
    pass


class _GGUFReader(gguf.GGUFReader):
    """`gguf.GGUFReader`, made fast enough for a 129k-token vocabulary.

    The library parses the header through one small slice of its `np.memmap` per
    value (~650k for DeepSeek's vocabulary and merges).  Two changes, the parsing
    itself stays the library's:

    * the mapping is stored as a plain ndarray view of the memmap (same buffer,
      still zero-copy): every slice of a memmap runs `memmap.__array_finalize__`,
      which dominated the read;
    * `_get` (the library's slice-and-view helper) is re-stated with the dtype
      lookup cached and the no-op byte-order view skipped (about half of what
      remained), and with a bounds check, so a truncated file fails with a
      clear "truncated" error rather than a numpy view/index error, and a
      corrupt array length cannot run past the end of the file."""

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, value) -> None:
        self._mapped = value.view(np.ndarray)

    _dtypes: dict = {}
    _native = "<" if sys.byteorder == "little" else ">"

    def _get(self, offset, dtype, count=1, override_order=None):
        dt = self._dtypes.get(dtype)
        if dt is None:
            dt = self._dtypes[dtype] = np.dtype(dtype)
        offset, count = int(offset), int(count)
        end = offset + dt.itemsize * count
        if end > self._mapped.shape[0]:
            raise _TruncatedGGUF(f"needs bytes up to {end} but the file has {self._mapped.shape[0]}")
        arr = self._mapped[offset:end].view(dt)
        order = self.byte_order if override_order is None else override_order
        if order == "I" or order == self._native:
            return arr
        return arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs, raw_type):
        """An array of strings or of scalars in one pass, with the parts, data indices, types
        and size the library's per-element recursion gives (one view per element: a 129k
        vocabulary, its merges and scores were most of a small model's load); bounds checked
        as `_get` does.  Any other value, and a byte-swapped file, take the library's path."""
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count = int(raw_itype[0]), int(alen[0])
        offs = orig_offs + 12
        parts = [raw_itype, alen]
        if itype == gguf.GGUFValueType.STRING:
            mapped, size = self._mapped, self._mapped.shape[0]
            len_dt = np.dtype(np.uint64)
            unpack = struct.Struct("<Q" if sys.byteorder == "little" else ">Q").unpack_from
            for _ in range(count):
                if offs + 8 > size:
                    raise _TruncatedGGUF(f"needs bytes up to {offs + 8} but the file has {size}")
                end = offs + 8 + unpack(mapped, offs)[0]
                if end > size:
                    raise _TruncatedGGUF(f"needs bytes up to {end} but the file has {size}")
                parts.append(mapped[offs : offs + 8].view(len_dt))
                parts.append(mapped[offs + 8 : end])
                offs = end
            data = list(range(3, 2 + 2 * count, 2))
        else:
            try:
                nptype = self.gguf_scalar_to_np.get(gguf.GGUFValueType(itype))
            except ValueError:
                nptype = None
            if nptype is None:  # nested arrays, unknown types: the library's path (and errors)
                return super()._get_field_parts(orig_offs, raw_type)
            vals = self._get(offs, nptype, count)
            parts += list(vals.reshape(count, 1))
            offs += int(vals.nbytes)
            data = list(range(2, 2 + count))
        types = [gguf.GGUFValueType.ARRAY] + ([gguf.GGUFValueType(itype)] if count else [])
        return offs - orig_offs, parts, data, types


def gguf_metadata(reader) -> dict:
    """GGUF metadata as {key: python value}: from a path, a `GGUFFile` or a
    `gguf.GGUFReader` (GGUF.* header fields skipped; float32 values rounded to
    their shortest decimal, so 1e-6 reads back as 1e-6)."""
    if isinstance(reader, (str, os.PathLike)):
        return GGUFFile(reader).metadata
    if isinstance(getattr(reader, "metadata", None), dict):
        return reader.metadata
    return fields_metadata(reader.fields)


class GGUFTensorInfo:
    """One tensor of a `GGUFFile`: `ne` (ggml order), `shape` (numpy order),
    `ggml_type`, absolute byte `offset`, `nbytes`, and `data` (the reader's
    memory-mapped view: typed for float/int types, uint8 bytes otherwise)."""

    __slots__ = ("name", "ne", "ggml_type", "offset", "nbytes", "data")

    def __init__(self, rt):
        self.name = rt.name
        self.ne = tuple(int(x) for x in rt.shape)
        self.ggml_type = rt.tensor_type
        self.offset = int(rt.data_offset)
        self.nbytes = int(rt.n_bytes)
        self.data = rt.data

    @property
    def shape(self) -> tuple:
        """numpy-order shape (ggml ne reversed)."""
        return tuple(reversed(self.ne))


# The fewest bytes one metadata entry (key length, value type, a 1-byte value) and one
# tensor description (name length, n_dims, type, offset) take in a GGUF header.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8


def _check_gguf_counts(path: Path, head: bytes, size: int) -> None:
    """Refuse counts the file cannot hold before the reader loops over them."""
    if len(head) < 24:
        raise ValueError(f"{path}: truncated GGUF file (header needs 24 bytes, the file has {size})")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
    if version & 0xFFFF == 0:  # a big-endian GGUF (gguf reads those too)
        version, n_tensors, n_kv = struct.unpack_from(">IQQ", head, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES > size - 24:
        raise ValueError(
            f"{path}: corrupt GGUF header (claims {n_tensors} tensors and {n_kv} metadata entries, "
            f"more than a file of {size} bytes can hold)"
        )


_PLAIN_GGML = ("F32", "F16", "F64", "I8", "I16", "I32", "I64")


class GGUFFile:
    """A GGUF file read with `gguf.GGUFReader`: `.metadata` {key: python value},
    `.tensors` {name: GGUFTensorInfo}, `.tensor(name)`; tensor data stays in the
    memory mapping.  `.reader` is the underlying `gguf.GGUFReader` (of the first part of
    a split GGUF, which reads as one file: `.parts` its files)."""

    def __init__(self, path: str | os.PathLike, split_part: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        with open(self.path, "rb") as f:
            head = f.read(24)
            size = os.fstat(f.fileno()).st_size
        magic = head[:4]
        if magic != GGUF_MAGIC:  # also the empty file, which np.memmap refuses
            raise ValueError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        _check_gguf_counts(self.path, head, size)
        try:
            self.reader = _GGUFReader(self.path)
        except _TruncatedGGUF as e:
            raise ValueError(f"{self.path}: truncated GGUF file ({e})") from None
        except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, MemoryError) as e:
            raise ValueError(f"{self.path}: corrupt or unsupported GGUF file ({type(e).__name__}: {e})") from None
        self.metadata: dict = fields_metadata(self.reader.fields)
        self.tensors: dict[str, GGUFTensorInfo] = {t.name: GGUFTensorInfo(t) for t in self.reader.tensors}
        self.parts = [self.path]
        if not split_part and int(self.metadata.get("split.count", 1) or 1) > 1:
            self._join_split_parts()

    def _join_split_parts(self) -> None:
        """A split GGUF (llama.cpp's gguf-split: NAME-00001-of-0000N.gguf, the metadata in the
        first part, `split.no` / `split.count` / `split.tensors.count` in each) read as one
        file: every part's tensors, the first part's metadata."""
        count, no = int(self.metadata["split.count"]), int(self.metadata.get("split.no", 0) or 0)
        m = SPLIT_GGUF.match(self.path.name)
        if not m or int(m["count"]) != count:
            raise ValueError(
                f"{self.path}: part of a split GGUF (split.count={count}) not named NAME-00001-of-{count:05d}.gguf"
            )
        name = lambda i: self.path.with_name(part_name(m["stem"], i, count))  # noqa: E731
        if no != 0:
            raise ValueError(
                f"{self.path}: part {no + 1} of {count} of a split GGUF; load its first part, {name(1).name}"
            )
        for i in range(2, count + 1):
            part = GGUFFile(name(i), split_part=True)
            if int(part.metadata.get("split.no", -1)) != i - 1 or int(part.metadata.get("split.count", 0)) != count:
                raise ValueError(
                    f"{part.path}: not part {i} of {count} of {self.path.name} (its split.no / split.count)"
                )
            clash = next((t for t in part.tensors if t in self.tensors), None)
            if clash is not None:
                raise ValueError(f"{part.path}: tensor {clash} is in an earlier part too")
            self.tensors.update(part.tensors)
            self.parts.append(part.path)
        want = self.metadata.get("split.tensors.count")
        if want is not None and int(want) != len(self.tensors):
            raise ValueError(
                f"{self.path}: the split's {count} parts hold {len(self.tensors)} tensors, split.tensors.count says {want}"
            )

    def tensor(self, name: str):
        """numpy view (float / int types), float32 array (BF16), or QuantizedTensor."""
        ti = self.tensors[name]
        qt = ti.ggml_type
        if qt.name in _PLAIN_GGML:
            return ti.data  # typed and shaped by gguf
        if qt == gguf.GGMLQuantizationType.BF16:
            return _bf16_lazy(ti.data.view(np.uint16).reshape(ti.shape))
        return QuantizedTensor(raw=ti.data, qtype=qt, shape=ti.shape)


def _bf16_lazy(bits: np.ndarray) -> LazyTensor:
    """BF16 bits (a mapped view) -> float32 for numpy, bfloat16 for MLX (no float32 detour)."""

    def to_mlx():
        import mlx.core as mx

        return mx.array(bits).view(mx.bfloat16)

    return LazyTensor(lambda: bf16_to_f32(bits), bits.shape, np.float32, to_mlx=to_mlx, sources=(bits,))


def read_gguf(path: str | os.PathLike, with_tokenizer: bool = True):
    """ds4 GGUF -> (config, tensors, tokenizer).  Tensors are mmap views (except the
    few a family rebuilds from several GGUF tensors).  `general.architecture` picks
    the family table (gguf_families; an unknown one is read as DeepSeek V4's `deepseek4`)."""
    return read_gguf_file(GGUFFile(path), with_tokenizer)


def read_gguf_file(g: GGUFFile, with_tokenizer: bool = True):
    """`read_gguf` of a GGUF already opened (`inspect` reads its headers too)."""
    meta = g.metadata
    from .. import gguf_families

    family = gguf_families.for_arch(meta.get("general.architecture", "")) or gguf_families.default()
    return _read_family_gguf(g, family, with_tokenizer)


def read_mtp_gguf(path: str | os.PathLike) -> dict:
    """ds4's separate MTP support GGUF (`--mtp FILE`) -> {name: tensor} under the
    names `read_gguf` gives a main file's MTP tensors (mapped views / QuantizedTensor)."""
    g = GGUFFile(path)
    if any(k.startswith(("deepseek4.dspark.", "dspark.")) for k in g.metadata) or any(
        t.startswith("dspark.") for t in g.tensors
    ):  # speculative/dspark_support.py reads those
        raise ValueError(f"{g.path}: ds4's DSpark support file, not an MTP one (pass it as --dspark --mtp-model FILE)")
    tensors = {mtp_hf_name(t): g.tensor(t) for t in g.tensors if t.startswith(MTP_PREFIX)}
    if not tensors:
        raise ValueError(f"{g.path}: no MTP tensors (mtp.*) in this GGUF file")
    return tensors


def _read_family_gguf(g: GGUFFile, family, with_tokenizer: bool):
    """A GGUF of one `gguf_families` table -> (config, tensors, tokenizer)."""
    meta, path = g.metadata, g.path
    try:
        config = family.config_from_kv(meta, list(g.tensors))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: bad {family.arch} metadata ({e})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    try:
        tensors, unknown = family.from_gguf(config, list(g.tensors), g.tensor)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if unknown:
        warnings.warn(f"{path}: {len(unknown)} GGUF tensors with no HF name were skipped: {unknown[:5]}")
    if family.lazy_expert_fuse:
        _fuse_experts(tensors)
    tok = None
    if with_tokenizer and "tokenizer.ggml.tokens" in meta:
        from ..runtime.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf_fields(meta)
    return config, tensors, tok


def _fuse_experts(tensors: dict) -> None:
    """gate_proj + up_proj (split, float) -> gate_up_proj [E, 2I, H], concatenated
    when the loader asks for it (a LazyTensor: no copy of the whole bank up front)."""
    gname, uname = names.EXPERT_SPLIT
    for key in [k for k in tensors if k.endswith("." + gname)]:
        prefix = key[: -len(gname)]
        ukey = prefix + uname
        g, u = tensors.get(key), tensors.get(ukey)
        if _is_float_array(g) and _is_float_array(u) and g.dtype == u.dtype and g.shape == u.shape:
            tensors[prefix + names.FUSED_GATE_UP] = _concat_lazy(g, u, axis=1)
            del tensors[key], tensors[ukey]


def _is_float_array(v) -> bool:
    return isinstance(v, (np.ndarray, LazyTensor)) and np.issubdtype(v.dtype, np.floating)


def _concat_lazy(a, b, axis: int) -> LazyTensor:
    shape = list(a.shape)
    shape[axis] += b.shape[axis]

    def to_mlx():
        pre = (slice(None),) * axis
        n = a.shape[axis]
        held = [_as_mlx(a)]  # read first to learn its MLX dtype; popped so fill drops it
        release(a)
        dt = held[0].dtype

        def second():
            m = _as_mlx(b)
            release(b)
            return m

        return fill(shape, dt, [(pre + (slice(0, n),), held.pop), (pre + (slice(n, None),), second)])

    def rows(ids):  # the expert store's per-expert read (axis 0 is the expert axis)
        from ..experts.rows import take_rows

        return np.concatenate([take_rows(a, ids), take_rows(b, ids)], axis=axis)

    return LazyTensor(
        lambda: np.concatenate([np.asarray(a), np.asarray(b)], axis=axis),
        shape,
        a.dtype,
        to_mlx=to_mlx,
        sources=(a, b),
        rows=rows if axis > 0 else None,
    )


def _as_mlx(v):
    import mlx.core as mx

    return v.to_mlx() if isinstance(v, LazyTensor) else mx.array(v)


# ----------------------------------------------------------------------------- safetensors
# dtypes numpy has (read with safe_open(framework="numpy"))
_ST_NUMPY = {"F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64", "BOOL"}
# dtypes numpy lacks: read as raw bits (numpy dtype given) through mlx or safetensors.deserialize
_ST_RAW = {
    "BF16": "uint16",  # converted to float32 by get()
    "F8_E4M3": "uint8",  # raw; hub FP8 weights are dequantized with their .scale
    "F8_E8M0": "uint8",  # raw; UE8M0 scales
}


class SafetensorsFile:
    """One .safetensors file, read with the `safetensors` library.

    `raw(name)`: numpy array (numpy dtypes via `safe_open(framework="numpy")`;
    BF16 as uint16 bits and F8 as uint8 bytes via `mx.load`, which reads them
    lazily, or `safetensors.deserialize` for a file mlx cannot load).
    `get(name)`: the same with BF16 turned into float32."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        try:
            self._f = safe_open(str(self.path), framework="numpy")
        except SafetensorError as e:
            raise ValueError(f"{self.path}: truncated or corrupt safetensors file ({e})") from None
        self._dtypes = {k: self._f.get_slice(k).get_dtype() for k in self._f.keys()}
        self._raw = None
        self._mx = None

    def shape(self, name: str) -> tuple:
        return tuple(self._f.get_slice(name).get_shape())

    def lazy(self, name: str) -> LazyTensor:
        """The tensor, read when asked: numpy via `get`, MLX via `mlx` (BF16 stays bfloat16)."""
        dt = self._dtypes[name]
        np_dt = np.float32 if dt == "BF16" else (_ST_RAW.get(dt) or _numpy_dtype(dt))
        rows = None if dt in _ST_RAW or dt == "BF16" else (lambda ids: self.rows(name, ids))
        return LazyTensor(lambda: self.get(name), self.shape(name), np_dt, to_mlx=lambda: self.mlx(name), rows=rows)

    def rows(self, name: str, ids) -> np.ndarray:
        """Rows `ids` of axis 0 of a numpy-dtype tensor, each read on its own
        (`get_slice`): the SSD expert store's read of a few experts of a bank."""
        sl = self._f.get_slice(name)
        return np.concatenate([sl[int(i) : int(i) + 1] for i in ids], axis=0)

    def lazy_raw(self, name: str) -> LazyTensor:
        """The tensor's raw values (F8 as uint8 bytes), read when asked."""
        dt = self._dtypes[name]

        def to_mlx():
            a = self.mlx(name)
            return a.view(_mx_raw_dtype(dt)) if dt in _ST_RAW else a

        return LazyTensor(lambda: self.raw(name), self.shape(name), _ST_RAW.get(dt) or _numpy_dtype(dt), to_mlx=to_mlx)

    def mlx(self, name: str):
        """The tensor as a lazy mx.array read from the file by `mx.load` (no mapping
        of the whole file); a file mlx cannot load (F64) falls back to numpy."""
        import mlx.core as mx

        if not self._mx or name not in self._mx:
            try:
                self._mx = mx.load(str(self.path), format="safetensors")
            except (RuntimeError, ValueError):
                self._mx = {}
        if name in self._mx:
            return self._mx.pop(name)  # not kept: the loader frees each tensor once converted
        return mx.array(self.get(name))

    def keys(self):
        return self._dtypes.keys()

    def dtype(self, name: str) -> str:
        return self._dtypes[name]

    def raw(self, name: str) -> np.ndarray:
        dt = self._dtypes[name]
        if dt in _ST_NUMPY:
            return self._f.get_tensor(name)
        if dt not in _ST_RAW:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {dt}")
        if self._raw is None:
            self._raw = self._load_raw()
        val = self._raw[name]
        if isinstance(val, dict):  # safetensors.deserialize entry
            return np.frombuffer(val["data"], dtype=_ST_RAW[dt]).reshape(val["shape"])
        import mlx.core as mx

        return np.array(val.view(getattr(mx, _ST_RAW[dt])), copy=True)

    def _load_raw(self) -> dict:
        """name -> lazily loaded mx.array (mx.load), or, when mlx cannot load the
        file (it has no F64), -> `safetensors.deserialize` entry with raw bytes."""
        import mlx.core as mx

        try:
            return mx.load(str(self.path), format="safetensors")
        except (RuntimeError, ValueError):
            from safetensors import SafetensorError, deserialize

            try:
                return {k: v for k, v in deserialize(self.path.read_bytes()) if v["dtype"] in _ST_RAW}
            except SafetensorError as e:
                raise ValueError(f"{self.path}: truncated or corrupt safetensors file ({e})") from None

    def get(self, name: str) -> np.ndarray:
        arr = self.raw(name)
        if self._dtypes[name] == "BF16":
            return bf16_to_f32(arr)
        return arr


def _numpy_dtype(st_dtype: str) -> np.dtype:
    return np.dtype(
        {
            "F64": "float64",
            "F32": "float32",
            "F16": "float16",
            "I64": "int64",
            "I32": "int32",
            "I16": "int16",
            "I8": "int8",
            "U8": "uint8",
            "U16": "uint16",
            "U32": "uint32",
            "U64": "uint64",
            "BOOL": "bool",
        }[st_dtype]
    )


def _mx_raw_dtype(st_dtype: str):
    import mlx.core as mx

    return getattr(mx, _ST_RAW[st_dtype])


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def dequant_fp8(w: np.ndarray, scale: np.ndarray, block=(128, 128)) -> np.ndarray:
    """Hub FP8 E4M3 weight [out, in] with UE8M0 (or float) block scales -> float32."""
    vals = e4m3fn_table()[w.astype(np.uint8)]
    s = e8m0_to_f32(scale) if scale.dtype == np.uint8 else scale.astype(np.float32)
    s = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[: w.shape[0], : w.shape[1]]
    return vals * s


def dequant_fp4(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Hub FP4 E2M1 expert weight [out, in/2] (low nibble first) with UE8M0 scales
    per 32 inputs -> float32 [out, in] (deepseek4-quantize.c dequant_fp4_weight)."""
    q = w.view(np.uint8)
    out = np.empty((q.shape[0], q.shape[1] * 2), np.float32)
    out[:, 0::2] = FP4_TABLE[q & 0x0F]
    out[:, 1::2] = FP4_TABLE[q >> 4]
    s = e8m0_to_f32(scale) if scale.dtype == np.uint8 else scale.astype(np.float32)
    return (out.reshape(out.shape[0], -1, 32) * s[:, :, None]).reshape(out.shape)


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's safetensors shards (the index's, else every *.safetensors)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: bad safetensors index ({e})") from None
        files = sorted(set(wm.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{folder}: shards listed in model.safetensors.index.json are missing: {missing[:3]}"
            )
        return [folder / f for f in files]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    return files


def read_hf_config(folder: Path) -> dict:
    """A Hugging Face folder's config.json, checked to be a JSON object."""
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        raw_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_path}: invalid JSON ({e})") from None
    if not isinstance(raw_cfg, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object")
    return raw_cfg


def read_hf(folder: str | os.PathLike, with_tokenizer: bool = True):
    """HF folder (config.json + *.safetensors) -> (config, tensors, tokenizer).

    Accepts transformers' in-memory names (the oracle), and the hub-checkpoint
    names of deepseek-ai/DeepSeek-V4-Flash (`layers.N.attn.wq_a.weight`, per-expert
    `ffn.experts.X.w1/w2/w3`): those are renamed and the experts stacked.  Nothing
    is read here: every value is a `LazyTensor` (read when the loader asks, one at a
    time) or, for FP8 / FP4 weights with UE8M0 scales, an `MXTensor` (the file's
    bytes, loaded as MLX mxfp8 / mxfp4 layers, never widened to float32).  The FP8
    block size is `quantization_config.weight_block_size` (default 128 x 128) and
    every scale tensor's grid is checked against it.  MTP (`mtp.*`) tensors are kept
    under their hub names."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    raw_cfg = read_hf_config(folder)
    files = [SafetensorsFile(p) for p in safetensors_files(folder)]
    if raw_cfg.get("model_type", names.DEEPSEEK_V4.model_types[0]) not in names.DEEPSEEK_V4.model_types:
        return _read_hf_other(folder, raw_cfg, files, with_tokenizer)
    config = names.normalize_config(raw_cfg)
    block = fp8_block_size(raw_cfg, cfg_path)

    where = {k: f for f in files for k in f.keys()}
    tensors: dict[str, Any] = {}
    experts: dict[tuple[str, int], dict[int, Any]] = {}
    skipped = []
    for key, f in where.items():
        if key.endswith(".scale") and key[: -len(".scale")] + ".weight" in where:
            continue  # consumed with its weight
        base = key[len("model.") :] if key.startswith("model.mtp.") else key
        if base.startswith(MTP_PREFIX):
            tensors[base] = _hub_weight(f, where, key, block)
            continue
        m = names.HUB_EXPERT_RE.match(key[len("model.") :] if key.startswith("model.layers.") else key)
        if m:
            hf = f"model.layers.{m.group(1)}.{names.HUB_EXPERT_TO_HF[m.group(3)]}"
            experts.setdefault((hf, int(m.group(1))), {})[int(m.group(2))] = _hub_weight(f, where, key, block)
            continue
        if names.hf_to_gguf(key) is not None or key.endswith("." + names.FUSED_GATE_UP):
            hf = key
        else:
            hf = names.hub_to_hf(key)
        if hf is None:
            skipped.append(key)
            continue
        val = _hub_weight(f, where, key, block)
        if hf.endswith(names.INT_TENSORS):
            val = _lazy_int64(val)
        tensors[hf] = val
    banks = {}
    for (hf, _), per in experts.items():
        n = len(per)
        if sorted(per) != list(range(n)):
            raise ValueError(f"{folder}: experts of {hf} are incomplete ({sorted(per)[:8]}...)")
        banks[hf] = [per[i] for i in range(n)]
    gname, uname = names.EXPERT_SPLIT
    for key in [k for k in banks if k.endswith(gname)]:
        prefix = key[: -len(gname)]
        g, u = banks[key], banks.get(prefix + uname)
        if u is not None and len(g) == len(u) and _same_mx(g + u):
            # gate and up of each expert side by side, then stacked: the fused bank is
            # built once, expert by expert (no split copy to concatenate later)
            tensors[prefix + names.FUSED_GATE_UP] = _stack([_cat_mx(a, b) for a, b in zip(g, u)])
            del banks[key], banks[prefix + uname]
    for hf, parts in banks.items():
        tensors[hf] = _stack(parts)
    if skipped:
        warnings.warn(f"{folder}: {len(skipped)} tensors with unknown names skipped: {skipped[:5]}")
    _fuse_experts(tensors)
    if not tensors:
        raise ValueError(f"{folder}: no DeepSeek V4 tensors found in the safetensors files")

    return config, tensors, _folder_tokenizer(folder, with_tokenizer)


def fp8_block_size(raw_cfg: dict, where="config.json") -> tuple[int, int]:
    """The FP8 weights' scale block [rows, cols]: config.json's
    `quantization_config.weight_block_size` (DeepSeek's release: [128, 128])."""
    qc = raw_cfg.get("quantization_config") or {}
    bs = qc.get("weight_block_size", [128, 128]) if isinstance(qc, dict) else [128, 128]
    if (
        not isinstance(bs, (list, tuple))
        or len(bs) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in bs)
    ):
        raise ValueError(f"{where}: quantization_config.weight_block_size must be two positive integers, not {bs!r}")
    return int(bs[0]), int(bs[1])


def _folder_tokenizer(folder: Path, with_tokenizer: bool):
    if with_tokenizer and (folder / "tokenizer.json").is_file():
        from ..runtime.tokenizer import Tokenizer

        return Tokenizer.from_file(folder / "tokenizer.json")
    return None


def _read_hf_other(folder: Path, config: dict, files: list, with_tokenizer: bool):
    """Other families: the config as written and the tensors under their own
    (transformers in-memory) names; the family's `Model.sanitize` maps them."""
    from .checkpoint_names import to_memory_names

    tensors = {k: f.lazy(k) for f in files for k in f.keys()}
    if not tensors:
        raise ValueError(f"{folder}: no tensors found in the safetensors files")
    try:  # a folder written by transformers' save_pretrained has its checkpoint names
        tensors = to_memory_names(str(config.get("model_type", "")), tensors)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
    return config, tensors, _folder_tokenizer(folder, with_tokenizer)


def _lazy_int64(val) -> LazyTensor:
    return LazyTensor(lambda: np.asarray(val).astype(np.int64), val.shape, np.int64, sources=(val,))


def _hub_weight(f: SafetensorsFile, where: dict, key: str, block: tuple[int, int]):
    """One hub tensor: LazyTensor, or MXTensor for FP8 / FP4 with UE8M0 scales."""
    dt = f.dtype(key)
    if dt in ("F8_E4M3", "I8") or (dt == "U8" and key.endswith(".weight")):
        skey = key[: -len(".weight")] + ".scale"
        if skey not in where:
            if dt == "F8_E4M3":
                raise ValueError(f"{f.path}: FP8 tensor {key!r} has no {skey!r}")
            return f.lazy(key)
        sf = where[skey]
        wshape, sshape = f.shape(key), sf.shape(skey)
        fp8 = dt == "F8_E4M3"
        rows, cols = wshape[0], wshape[1] * (1 if fp8 else 2)
        grid = block if fp8 else (1, MX_GROUP)
        want = (-(-rows // grid[0]), -(-cols // grid[1]))
        if len(wshape) != 2 or tuple(sshape) != want:
            what = (
                f"{grid[0]}x{grid[1]} blocks (config.json quantization_config.weight_block_size)"
                if fp8
                else "FP4 groups of 32 inputs"
            )
            raise ValueError(
                f"{sf.path}: scale {skey!r} has grid {'x'.join(map(str, sshape))} but weight "
                f"{key!r} {rows}x{cols} in {what} needs {want[0]}x{want[1]}"
            )
        if sf.dtype(skey) in ("F8_E8M0", "U8") and cols % MX_GROUP == 0 and (not fp8 or grid[1] % MX_GROUP == 0):
            w_raw, s_raw = f.lazy_raw(key), sf.lazy_raw(skey)
            if fp8:  # one scale per 32 inputs: the block scale repeated (uint8, small)
                s_raw = _repeat_scales(s_raw, grid, rows, cols)
            return MXTensor(weight=w_raw, scales=s_raw, mode="mxfp8" if fp8 else "mxfp4", shape=(rows, cols))

        def dequant():  # float (non power-of-two) scales, or a width MLX's groups cannot tile
            scale = sf.get(skey)
            w = f.raw(key)
            return dequant_fp8(w, scale, grid) if fp8 else dequant_fp4(w, scale)

        return LazyTensor(dequant, (rows, cols), np.float32)
    return f.lazy(key)


def _repeat_scales(s_raw: LazyTensor, grid, rows: int, cols: int) -> LazyTensor:
    def load():
        s = np.asarray(s_raw)
        return np.repeat(np.repeat(s, grid[0], axis=0), grid[1] // MX_GROUP, axis=1)[:rows, : cols // MX_GROUP]

    def to_mlx():
        import mlx.core as mx

        s = s_raw.to_mlx()
        return mx.repeat(mx.repeat(s, grid[0], axis=0), grid[1] // MX_GROUP, axis=1)[:rows, : cols // MX_GROUP]

    return LazyTensor(load, (rows, cols // MX_GROUP), np.uint8, to_mlx=to_mlx)


def _same_mx(parts: list) -> bool:
    return all(isinstance(p, MXTensor) and p.mode == parts[0].mode and p.shape == parts[0].shape for p in parts)


def _cat_mx(a: MXTensor, b: MXTensor) -> MXTensor:
    """Two MXTensors [out, in] -> one [out_a + out_b, in] (rows of a first)."""
    return MXTensor(
        weight=_concat_lazy(a.weight, b.weight, axis=0),
        scales=_concat_lazy(a.scales, b.scales, axis=0),
        mode=a.mode,
        shape=(a.shape[0] + b.shape[0], *a.shape[1:]),
    )


def _stack(parts: list):
    """Per-expert tensors -> one [E, ...] tensor, stacked when the loader asks."""
    p0 = parts[0]
    if isinstance(p0, MXTensor) and all(isinstance(p, MXTensor) and p.mode == p0.mode for p in parts):
        return MXTensor(
            weight=_stack_lazy([p.weight for p in parts]),
            scales=_stack_lazy([p.scales for p in parts]),
            mode=p0.mode,
            shape=(len(parts), *p0.shape),
        )
    parts = [LazyTensor(p.dequantize, p.shape, np.float32) if isinstance(p, MXTensor) else p for p in parts]
    return _stack_lazy(parts)


def _stack_lazy(parts: list) -> LazyTensor:
    def to_mlx():
        held = [_as_mlx(parts[0])]  # read first to learn its MLX shape and dtype
        shape, dt = (len(parts), *held[0].shape), held[0].dtype
        rest = [(i, (lambda p=p: _as_mlx(p))) for i, p in enumerate(parts) if i]
        return fill(shape, dt, [(0, held.pop)] + rest)

    return LazyTensor(
        lambda: np.stack([np.asarray(p) for p in parts]),
        (len(parts), *parts[0].shape),
        parts[0].dtype,
        to_mlx=to_mlx,
        sources=tuple(parts),
    )


# ----------------------------------------------------------------------------- dispatch
def read_weights(path: str | os.PathLike, with_tokenizer: bool = True):
    """GGUF file or HF folder -> (config, tensors, tokenizer or None)."""
    path = Path(path)
    if is_model_folder(path):
        return read_hf(path, with_tokenizer=with_tokenizer)
    return read_gguf(path, with_tokenizer=with_tokenizer)


def is_model_folder(path: str | os.PathLike) -> bool:
    """True for a folder, False for a regular file; any other path is refused by what it is
    (missing, a device, a FIFO, a symlink loop: the OSError as raised), never opened."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"no such model file or folder: {path}") from None
    if stat.S_ISDIR(mode):
        return True
    if stat.S_ISREG(mode):
        return False
    kind = (
        "a character device" if stat.S_ISCHR(mode)
        else "a block device" if stat.S_ISBLK(mode)
        else "a FIFO" if stat.S_ISFIFO(mode)
        else "a socket"
    )  # fmt: skip
    raise ValueError(f"{path}: {kind}, not a model file (GGUF) or folder (config.json + safetensors)")


def is_gguf(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


__all__ = [
    "read_weights",
    "is_model_folder",
    "read_gguf",
    "read_gguf_file",
    "read_hf",
    "gguf_metadata",
    "SafetensorsFile",
    "bf16_to_f32",
    "dequant_fp8",
    "dequant_fp4",
    "is_gguf",
]
