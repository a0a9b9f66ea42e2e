"""Weights I/O: ds4 GGUF files and Hugging Face safetensors folders.

`read_weights(path) -> (config, tensors, tokenizer)`:

* `config` is the canonical DeepseekV4Config dict (`gguf_names.normalize_config`):
  the HF field names, legacy fields folded in, defaults filled.
* `tensors` maps Hugging Face *in-memory* names (the keys of the oracle's
  model.safetensors, e.g. `model.layers.0.mlp.experts.gate_up_proj`) to
  - numpy arrays: F32 and F16 are zero-copy views of the memory-mapped file;
    BF16 comes back as a float32 copy (numpy has no bfloat16; no ml_dtypes
    dependency); `mlp.gate.tid2eid` is int64 (GGUF stores I32: a small copy);
  - `QuantizedTensor(raw, qtype, shape)` for GGUF quantized types: `raw` is the
    uint8 view of the file bytes shaped [..., bytes_per_row], `shape` the logical
    numpy-order shape; `.dequantize()` calls `ds4mlx.quant.dequantize`.
  Routed experts: when ds4's split `ffn_gate_exps` / `ffn_up_exps` are float they
  are concatenated into the fused `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows
  first, a copy).  When they are quantized they are handed out split, as
  `mlp.experts.gate_proj` and `mlp.experts.up_proj` [E, I, H] (no copy), because
  quantized rows cannot be fused without rewriting the whole expert bank.
* `tokenizer` is a `ds4mlx.tokenizer.Tokenizer` from the GGUF's tokenizer.ggml.*
  metadata or the folder's tokenizer.json, else None.

Errors are ValueError / FileNotFoundError with a message naming the file.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import gguf_names as names

GGUF_MAGIC = b"GGUF"


# ----------------------------------------------------------------------------- types
@dataclass(frozen=True)
class QuantizedTensor:
    """A GGUF block-quantized tensor, still in its file bytes.

    raw:   np.ndarray uint8, shape [..., bytes_per_row] (a view of the mmap)
    qtype: gguf.GGMLQuantizationType
    shape: logical shape in numpy order (ggml `ne` reversed), e.g. [E, I, H]
    """

    raw: np.ndarray
    qtype: Any
    shape: tuple

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def dequantize(self) -> np.ndarray:
        """float32 array of `shape` (via ds4mlx.quant)."""
        from . import quant  # imported lazily: quant.py is another module's job

        return quant.dequantize(self.raw, self.qtype, tuple(self.shape))

    def __repr__(self) -> str:
        name = getattr(self.qtype, "name", self.qtype)
        return f"QuantizedTensor({name}, shape={tuple(self.shape)}, {self.nbytes} bytes)"


# ----------------------------------------------------------------------------- GGUF
def _clean_value(v, vtype, subtype=None):
    from gguf import GGUFValueType

    if vtype == GGUFValueType.FLOAT32:
        return names._f32(v)
    if vtype == GGUFValueType.ARRAY and subtype == GGUFValueType.FLOAT32:
        return [names._f32(x) for x in v]
    if vtype == GGUFValueType.BOOL:
        return bool(v)
    return v


def gguf_metadata(reader) -> dict:
    """GGUF metadata as {key: python value}: from a path, a `GGUFFile` or a
    `gguf.GGUFReader` (GGUF.* header fields skipped; float32 values rounded to
    their shortest decimal, so 1e-6 reads back as 1e-6)."""
    from gguf import GGUFValueType

    if isinstance(reader, (str, os.PathLike)):
        return GGUFFile(reader).metadata
    if isinstance(getattr(reader, "metadata", None), dict):
        return reader.metadata

    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if not field.types:
            continue
        main = field.types[0]
        sub = field.types[-1] if main == GGUFValueType.ARRAY else None
        if main == GGUFValueType.ARRAY and sub not in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            # numeric arrays: one numpy part per element; concatenate quickly
            parts = [field.parts[i] for i in field.data]
            val = np.concatenate(parts).tolist() if parts else []
        else:
            val = field.contents()
        out[key] = _clean_value(val, main, sub)
    return out


# GGUF value types (gguf.GGUFValueType): scalar struct formats
_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_F32 = 8, 9, 6


class GGUFTensorInfo:
    __slots__ = ("name", "ne", "ggml_type", "offset", "nbytes")

    def __init__(self, name, ne, ggml_type, offset, nbytes):
        self.name, self.ne, self.ggml_type, self.offset, self.nbytes = name, ne, ggml_type, offset, nbytes

    @property
    def shape(self) -> tuple:
        """numpy-order shape (ggml ne reversed)."""
        return tuple(reversed(self.ne))


class GGUFFile:
    """Fast memory-mapped GGUF v2/v3 parser (metadata as python values, tensors as
    numpy views of the mapping).  `gguf.GGUFReader` builds one numpy object per
    token string and needs ~10 s for DeepSeek's 129k-token vocabulary; this takes
    a fraction of a second."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            magic = f.read(4)
            if magic != GGUF_MAGIC:
                raise ValueError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = size
        try:
            self._parse()
        except (struct.error, IndexError, OverflowError, UnicodeDecodeError, MemoryError) as e:
            raise ValueError(f"{self.path}: truncated or corrupt GGUF header ({type(e).__name__}: {e})") from None

    # -- low level
    def _u32(self):
        (v,) = struct.unpack_from("<I", self._mm, self._pos)
        self._pos += 4
        return v

    def _u64(self):
        (v,) = struct.unpack_from("<Q", self._mm, self._pos)
        self._pos += 8
        return v

    def _str(self):
        n = self._u64()
        if self._pos + n > self.size:
            raise IndexError("string runs past the end of the file")
        b = self._mm[self._pos : self._pos + n]
        self._pos += n
        return b.decode("utf-8", errors="surrogateescape")

    def _value(self, vtype):
        if vtype == _GGUF_STRING:
            return self._str()
        if vtype == _GGUF_ARRAY:
            sub = self._u32()
            n = self._u64()
            if sub == _GGUF_STRING:
                return [self._str() for _ in range(n)]
            if sub == _GGUF_ARRAY:
                return [self._value(_GGUF_ARRAY) for _ in range(n)]
            if sub not in _GGUF_NP:
                raise ValueError(f"unknown GGUF array type {sub}")
            dt = np.dtype(_GGUF_NP[sub])
            if self._pos + n * dt.itemsize > self.size:
                raise IndexError("array runs past the end of the file")
            arr = np.frombuffer(self._mm, dtype=dt, count=n, offset=self._pos)
            self._pos += n * dt.itemsize
            vals = arr.tolist()
            return [names._f32(v) for v in vals] if sub == _GGUF_F32 else vals
        fmt = _GGUF_SCALAR.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {vtype}")
        (v,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return names._f32(v) if vtype == _GGUF_F32 else v

    def _parse(self):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self._pos = 4
        self.version = self._u32()
        if self.version not in (2, 3):
            raise ValueError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors = self._u64()
        n_kv = self._u64()
        if n_tensors > 10_000_000 or n_kv > 10_000_000:
            raise ValueError(f"{self.path}: corrupt GGUF header (tensor/kv counts {n_tensors}/{n_kv})")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = self._str()
            self.metadata[key] = self._value(self._u32())
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            nd = self._u32()
            if nd > 8:
                raise ValueError(f"{self.path}: tensor {name!r} has {nd} dimensions")
            ne = tuple(self._u64() for _ in range(nd))
            t = self._u32()
            off = self._u64()
            try:
                qt = GGMLQuantizationType(t)
            except ValueError:
                raise ValueError(f"{self.path}: tensor {name!r} has unknown ggml type {t}") from None
            block, tsize = GGML_QUANT_SIZES[qt]
            n = int(np.prod(ne, dtype=np.int64)) if ne else 1
            if n % block:
                raise ValueError(f"{self.path}: tensor {name!r} size {n} is not a multiple of its block {block}")
            infos.append(GGUFTensorInfo(name, ne, qt, off, n // block * tsize))
        align = int(self.metadata.get("general.alignment", 32) or 32)
        self.data_start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for ti in infos:
            ti.offset += self.data_start
            if ti.name in self.tensors:
                raise ValueError(f"{self.path}: duplicated tensor {ti.name!r}")
            if ti.offset + ti.nbytes > self.size:
                raise ValueError(
                    f"{self.path}: truncated GGUF file: tensor {ti.name!r} needs bytes "
                    f"{ti.offset}..{ti.offset + ti.nbytes} but the file has {self.size}"
                )
            self.tensors[ti.name] = ti

    # -- tensors
    def tensor(self, name: str):
        """numpy view (float / int types), float32 array (BF16), or QuantizedTensor."""
        from gguf.constants import GGMLQuantizationType as Q
        from gguf.quants import quant_shape_to_byte_shape

        ti = self.tensors[name]
        shape = ti.shape
        plain = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8,
                 Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}
        if ti.ggml_type in plain:
            dt = np.dtype(plain[ti.ggml_type])
            return np.frombuffer(self._mm, dtype=dt, count=ti.nbytes // dt.itemsize, offset=ti.offset).reshape(shape)
        if ti.ggml_type == Q.BF16:
            u16 = np.frombuffer(self._mm, dtype=np.uint16, count=ti.nbytes // 2, offset=ti.offset).reshape(shape)
            return bf16_to_f32(u16)
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=ti.nbytes, offset=ti.offset)
        raw = raw.reshape(quant_shape_to_byte_shape(shape, ti.ggml_type))
        return QuantizedTensor(raw=raw, qtype=ti.ggml_type, shape=shape)


def read_gguf(path: str | os.PathLike, with_tokenizer: bool = True):
    """ds4 GGUF -> (config, tensors, tokenizer).  Tensors are mmap views."""
    g = GGUFFile(path)
    meta = g.metadata
    path = g.path
    if int(meta.get("split.count", 1) or 1) > 1:
        raise ValueError(f"{path}: split GGUF files (split.count={meta['split.count']}) are not supported")
    try:
        config = names.config_from_gguf_kv(meta)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: bad deepseek4 metadata ({e})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None

    tensors: dict[str, Any] = {}
    unknown = []
    for tname in g.tensors:
        hf = names.gguf_to_hf(tname)
        if hf is None:
            unknown.append(tname)
            continue
        val = g.tensor(tname)
        if hf.endswith(names.INT_TENSORS) and isinstance(val, np.ndarray):
            val = val.astype(np.int64)
        tensors[hf] = val
    if unknown:
        warnings.warn(f"{path}: {len(unknown)} GGUF tensors with no HF name were skipped: {unknown[:5]}")
    _fuse_experts(tensors)

    tok = None
    if with_tokenizer and "tokenizer.ggml.tokens" in meta:
        from .tokenizer import Tokenizer

        tok = Tokenizer.from_gguf_fields(meta)
    return config, tensors, tok


def _fuse_experts(tensors: dict) -> None:
    """gate_proj + up_proj (split, float) -> gate_up_proj [E, 2I, H]."""
    gname, uname = names.EXPERT_SPLIT
    for key in [k for k in tensors if k.endswith("." + gname)]:
        prefix = key[: -len(gname)]
        ukey = prefix + uname
        g, u = tensors.get(key), tensors.get(ukey)
        if isinstance(g, np.ndarray) and isinstance(u, np.ndarray) and g.dtype == u.dtype and g.shape == u.shape:
            tensors[prefix + names.FUSED_GATE_UP] = np.concatenate([g, u], axis=1)
            del tensors[key], tensors[ukey]


# ----------------------------------------------------------------------------- safetensors
_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "U16": np.uint16,
    "U32": np.uint32,
    "U64": np.uint64,
    "BOOL": np.bool_,
    "BF16": np.uint16,  # converted to float32 on read
    "F8_E4M3": np.uint8,  # raw; hub FP8 weights are dequantized with their .scale
    "F8_E8M0": np.uint8,  # raw; UE8M0 scales
}


class SafetensorsFile:
    """Minimal memory-mapped safetensors reader (numpy views, no torch)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{self.path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n <= 0 or 8 + n > size or n > 100_000_000:
                raise ValueError(f"{self.path}: not a safetensors file (bad header length {n})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path}: bad safetensors header ({e})") from None
        self._start = 8 + n
        self._size = size
        header.pop("__metadata__", None)
        self.header: dict = header
        self._mm = None
        for name, info in header.items():
            a, b = info.get("data_offsets", (0, -1))
            if self._start + b > size or b < a:
                raise ValueError(f"{self.path}: truncated safetensors file (tensor {name!r})")

    def keys(self):
        return self.header.keys()

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def raw(self, name: str) -> np.ndarray:
        info = self.header[name]
        dt = info["dtype"]
        if dt not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {dt}")
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self._size else b""
        a, b = info["data_offsets"]
        arr = np.frombuffer(self._mm, dtype=_ST_DTYPES[dt], count=(b - a) // np.dtype(_ST_DTYPES[dt]).itemsize,
                            offset=self._start + a)
        return arr.reshape(info["shape"])

    def get(self, name: str) -> np.ndarray:
        arr = self.raw(name)
        if self.header[name]["dtype"] == "BF16":
            return bf16_to_f32(arr)
        return arr


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _e8m0_to_f32(e: np.ndarray) -> np.ndarray:
    # ds4 gguf-tools/deepseek4-quantize.c e8m0_to_f32: 0 -> 2^-127 (0x00400000), else 2^(e-127)
    e = e.astype(np.uint32)
    bits = np.where(e == 0, np.uint32(0x00400000), e << 23).astype(np.uint32)
    return bits.view(np.float32)


def _e4m3fn_table() -> np.ndarray:
    # ds4 gguf-tools/deepseek4-quantize.c e4m3fn_to_f32 (NaN 0x7f/0xff -> 0)
    t = np.zeros(256, np.float32)
    for x in range(256):
        a = x & 0x7F
        s = -1.0 if x & 0x80 else 1.0
        if a == 0 or a == 0x7F:
            t[x] = 0.0 * s
            continue
        e, m = (x >> 3) & 0xF, x & 7
        t[x] = s * (m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return t


_FP4_TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def dequant_fp8(w: np.ndarray, scale: np.ndarray, block=(128, 128)) -> np.ndarray:
    """Hub FP8 E4M3 weight [out, in] with UE8M0 (or float) 128x128 block scales -> float32."""
    vals = _e4m3fn_table()[w.astype(np.uint8)]
    s = _e8m0_to_f32(scale) if scale.dtype == np.uint8 else scale.astype(np.float32)
    s = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[: w.shape[0], : w.shape[1]]
    return vals * s


def dequant_fp4(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Hub FP4 E2M1 expert weight [out, in/2] (low nibble first) with UE8M0 scales
    per 32 inputs -> float32 [out, in] (deepseek4-quantize.c dequant_fp4_weight)."""
    q = w.view(np.uint8)
    out = np.empty((q.shape[0], q.shape[1] * 2), np.float32)
    out[:, 0::2] = _FP4_TABLE[q & 0x0F]
    out[:, 1::2] = _FP4_TABLE[q >> 4]
    s = _e8m0_to_f32(scale) if scale.dtype == np.uint8 else scale.astype(np.float32)
    return (out.reshape(out.shape[0], -1, 32) * s[:, :, None]).reshape(out.shape)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: bad safetensors index ({e})") from None
        files = sorted(set(wm.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards listed in model.safetensors.index.json are missing: {missing[:3]}")
        return [folder / f for f in files]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    return files


def read_hf(folder: str | os.PathLike, with_tokenizer: bool = True):
    """HF folder (config.json + *.safetensors) -> (config, tensors, tokenizer).

    Accepts transformers' in-memory names (the oracle), and the hub-checkpoint
    names of deepseek-ai/DeepSeek-V4-Flash (`layers.N.attn.wq_a.weight`, per-expert
    `ffn.experts.X.w1/w2/w3`): those are renamed, experts stacked and fused, and
    FP8 / FP4 weights dequantized to float32 with their `.scale` (eagerly: fine for
    small checkpoints and conversion, far too big for the full 284B model).
    MTP (`mtp.*`) tensors are skipped."""
    folder = Path(folder)
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
    config = names.normalize_config(raw_cfg)

    files = [SafetensorsFile(p) for p in _safetensors_files(folder)]
    where = {k: f for f in files for k in f.keys()}
    tensors: dict[str, Any] = {}
    experts: dict[tuple[str, int], dict[int, np.ndarray]] = {}
    skipped = []
    for key, f in where.items():
        if key.endswith(".scale") and key[: -len(".scale")] + ".weight" in where:
            continue  # consumed with its weight
        base = key[len("model."):] if key.startswith("model.mtp.") else key
        if base.startswith("mtp."):
            skipped.append(key)
            continue
        m = names.HUB_EXPERT_RE.match(key[len("model."):] if key.startswith("model.layers.") else key)
        if m:
            arr = _hub_weight(f, where, key)
            hf = f"model.layers.{m.group(1)}.{names.HUB_EXPERT_TO_HF[m.group(3)]}"
            experts.setdefault((hf, int(m.group(1))), {})[int(m.group(2))] = arr
            continue
        if names.hf_to_gguf(key) is not None or key.endswith("." + names.FUSED_GATE_UP):
            hf = key
        else:
            hf = names.hub_to_hf(key)
        if hf is None:
            skipped.append(key)
            continue
        arr = _hub_weight(f, where, key)
        if hf.endswith(names.INT_TENSORS):
            arr = arr.astype(np.int64)
        tensors[hf] = arr
    for (hf, _), per in experts.items():
        n = len(per)
        if sorted(per) != list(range(n)):
            raise ValueError(f"{folder}: experts of {hf} are incomplete ({sorted(per)[:8]}...)")
        tensors[hf] = np.stack([per[i] for i in range(n)])
    if skipped:
        warnings.warn(f"{folder}: {len(skipped)} tensors skipped (MTP or unknown names): {skipped[:5]}")
    _fuse_experts(tensors)
    if not tensors:
        raise ValueError(f"{folder}: no DeepSeek V4 tensors found in the safetensors files")

    tok = None
    if with_tokenizer and (folder / "tokenizer.json").is_file():
        from .tokenizer import Tokenizer

        tok = Tokenizer.from_file(folder / "tokenizer.json")
    return config, tensors, tok


def _hub_weight(f: SafetensorsFile, where: dict, key: str) -> np.ndarray:
    dt = f.dtype(key)
    if dt in ("F8_E4M3", "I8") or (dt == "U8" and key.endswith(".weight")):
        skey = key[: -len(".weight")] + ".scale"
        if skey not in where:
            if dt == "F8_E4M3":
                raise ValueError(f"{f.path}: FP8 tensor {key!r} has no {skey!r}")
            return f.get(key)
        scale = where[skey].raw(skey)
        if where[skey].dtype(skey) == "BF16":
            scale = bf16_to_f32(scale)
        w = f.raw(key)
        return dequant_fp8(w, scale) if dt == "F8_E4M3" else dequant_fp4(w, scale)
    return f.get(key)


# ----------------------------------------------------------------------------- dispatch
def read_weights(path: str | os.PathLike, with_tokenizer: bool = True):
    """GGUF file or HF folder -> (config, tensors, tokenizer or None)."""
    path = Path(path)
    if path.is_dir():
        return read_hf(path, with_tokenizer=with_tokenizer)
    if path.is_file():
        return read_gguf(path, with_tokenizer=with_tokenizer)
    raise FileNotFoundError(f"no such model file or folder: {path}")


def is_gguf(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


__all__ = [
    "QuantizedTensor",
    "read_weights",
    "read_gguf",
    "read_hf",
    "gguf_metadata",
    "SafetensorsFile",
    "bf16_to_f32",
    "dequant_fp8",
    "dequant_fp4",
    "is_gguf",
]
