"""Weights I/O: ds4 GGUF files and Hugging Face safetensors folders.

`read_weights(path) -> (config, tensors, tokenizer)`:

* `config` is the canonical DeepseekV4Config dict (`gguf_names.normalize_config`):
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
    numpy-order shape; `.dequantize()` calls `ds4mlx.quant.dequantize`.
  Routed experts: when ds4's split `ffn_gate_exps` / `ffn_up_exps` are float they
  are concatenated into the fused `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows
  first, a copy).  When they are quantized they are handed out split, as
  `mlp.experts.gate_proj` and `mlp.experts.up_proj` [E, I, H] (no copy), because
  quantized rows cannot be fused without rewriting the whole expert bank.
* `tokenizer` is a `ds4mlx.tokenizer.Tokenizer` from the GGUF's tokenizer.ggml.*
  metadata or the folder's tokenizer.json, else None.

GGUF files are read with `gguf.GGUFReader` (a subclass that keeps its parse
fast), safetensors with `safetensors.safe_open`.  Errors are ValueError /
FileNotFoundError with a message naming the file.
"""
from __future__ import annotations

import json
import os
import struct
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
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


def _field_value(field):
    """A `gguf.ReaderField` as a python value: strings decoded, numeric arrays as
    lists (one np.concatenate instead of one object per element), float32 values
    rounded to their shortest decimal (1e-6 reads back as 1e-6)."""
    V = gguf.GGUFValueType
    main = field.types[0]
    parts = field.parts
    if main == V.STRING:
        return parts[-1].tobytes().decode("utf-8", errors="surrogateescape")
    if main != V.ARRAY:
        v = parts[-1].tolist()[0]
        return names._f32(v) if main == V.FLOAT32 else v
    sub = field.types[-1] if len(field.types) > 1 else None
    if sub is None or not field.data:
        return []
    if len(field.types) > 2:  # nested arrays: gguf flattens them
        return field.contents()
    if sub == V.STRING:
        return [parts[i].tobytes().decode("utf-8", errors="surrogateescape") for i in field.data]
    vals = np.concatenate([parts[i] for i in field.data]).tolist()
    return [names._f32(v) for v in vals] if sub == V.FLOAT32 else vals


def _fields_metadata(fields) -> dict:
    return {k: _field_value(f) for k, f in fields.items() if not k.startswith("GGUF.") and f.types}


def gguf_metadata(reader) -> dict:
    """GGUF metadata as {key: python value}: from a path, a `GGUFFile` or a
    `gguf.GGUFReader` (GGUF.* header fields skipped; float32 values rounded to
    their shortest decimal, so 1e-6 reads back as 1e-6)."""
    if isinstance(reader, (str, os.PathLike)):
        return GGUFFile(reader).metadata
    if isinstance(getattr(reader, "metadata", None), dict):
        return reader.metadata
    return _fields_metadata(reader.fields)


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
        raise ValueError(f"{path}: corrupt GGUF header (claims {n_tensors} tensors and {n_kv} metadata entries, "
                         f"more than a file of {size} bytes can hold)")


_PLAIN_GGML = ("F32", "F16", "F64", "I8", "I16", "I32", "I64")


class GGUFFile:
    """A GGUF file read with `gguf.GGUFReader`: `.metadata` {key: python value},
    `.tensors` {name: GGUFTensorInfo}, `.tensor(name)`; tensor data stays in the
    memory mapping.  `.reader` is the underlying `gguf.GGUFReader`."""

    def __init__(self, path: str | os.PathLike):
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
        self.metadata: dict = _fields_metadata(self.reader.fields)
        self.tensors: dict[str, GGUFTensorInfo] = {t.name: GGUFTensorInfo(t) for t in self.reader.tensors}

    def tensor(self, name: str):
        """numpy view (float / int types), float32 array (BF16), or QuantizedTensor."""
        ti = self.tensors[name]
        qt = ti.ggml_type
        if qt.name in _PLAIN_GGML:
            return ti.data  # typed and shaped by gguf
        if qt == gguf.GGMLQuantizationType.BF16:
            return bf16_to_f32(ti.data.view(np.uint16).reshape(ti.shape))
        return QuantizedTensor(raw=ti.data, qtype=qt, shape=ti.shape)


def read_gguf(path: str | os.PathLike, with_tokenizer: bool = True):
    """ds4 GGUF -> (config, tensors, tokenizer).  Tensors are mmap views (except the
    few a family rebuilds from several GGUF tensors).  `general.architecture` picks
    the scheme: `deepseek4` (gguf_names) or one of gguf_families."""
    g = GGUFFile(path)
    meta = g.metadata
    path = g.path
    if int(meta.get("split.count", 1) or 1) > 1:
        raise ValueError(f"{path}: split GGUF files (split.count={meta['split.count']}) are not supported")
    from . import gguf_families

    family = gguf_families.for_arch(meta.get("general.architecture", names.ARCH))
    if family is not None:
        return _read_family_gguf(g, family, with_tokenizer)
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


def _read_family_gguf(g: "GGUFFile", family, with_tokenizer: bool):
    """A GGUF of another family (`gguf_families`) -> (config, tensors, tokenizer)."""
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
            raise FileNotFoundError(f"{folder}: shards listed in model.safetensors.index.json are missing: {missing[:3]}")
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
    `ffn.experts.X.w1/w2/w3`): those are renamed, experts stacked and fused, and
    FP8 / FP4 weights dequantized to float32 with their `.scale` (eagerly: fine for
    small checkpoints and conversion, far too big for the full 284B model).
    MTP (`mtp.*`) tensors are skipped."""
    folder = Path(folder)
    raw_cfg = read_hf_config(folder)
    files = [SafetensorsFile(p) for p in safetensors_files(folder)]
    if raw_cfg.get("model_type", "deepseek_v4") not in DEEPSEEK_V4_TYPES:
        return _read_hf_other(folder, raw_cfg, files, with_tokenizer)
    config = names.normalize_config(raw_cfg)

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

    return config, tensors, _folder_tokenizer(folder, with_tokenizer)


DEEPSEEK_V4_TYPES = ("deepseek_v4",)


def _folder_tokenizer(folder: Path, with_tokenizer: bool):
    if with_tokenizer and (folder / "tokenizer.json").is_file():
        from .tokenizer import Tokenizer

        return Tokenizer.from_file(folder / "tokenizer.json")
    return None


def _read_hf_other(folder: Path, config: dict, files: list, with_tokenizer: bool):
    """Other families: the config as written and the tensors under their own
    (transformers in-memory) names; the family's `Model.sanitize` maps them."""
    from .checkpoint_names import to_memory_names

    tensors = {k: f.get(k) for f in files for k in f.keys()}
    if not tensors:
        raise ValueError(f"{folder}: no tensors found in the safetensors files")
    try:  # a folder written by transformers' save_pretrained has its checkpoint names
        tensors = to_memory_names(str(config.get("model_type", "")), tensors)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
    return config, tensors, _folder_tokenizer(folder, with_tokenizer)


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
