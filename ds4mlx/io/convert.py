"""`ds4mlx convert HF_DIR OUT.gguf`: Hugging Face model folder -> ds4-style GGUF.

Every family writes its own table's names and metadata keys (`ds4mlx.gguf_families`,
picked from the config's `model_type`; DeepSeek V4: ds4's `deepseek4`).  The tokenizer is
written as `tokenizer.ggml.*` (HF_DIR/tokenizer.json if present, else the default
DeepSeek V4 tokenizer).

`write_gguf(path, config, tensors, tokenizer, dtype="f32")` is the Python entry
the demo model and the quantizer use.  Float dtypes: "f32", "f16", "bf16" apply to
tensors of 2 or more dimensions; 1-D tensors (norms, sinks, hc base/scale, router
bias) always stay F32 as in ds4's GGUFs (ds4.c `weights_validate_layout`), integer
tensors (tid2eid) are I32.  `QuantizedTensor` values are written as they are
(their bytes and ggml type).  Fused `gate_up_proj` is split into ds4's
`ffn_gate_exps` / `ffn_up_exps`.  The other families also keep the tensors ds4
stores as F32 (routers, conv kernels, ...: `Family.keep_f32`) in F32.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from .mapped import release
from .quant import MXTensor, QuantizedTensor

DTYPES = ("f32", "f16", "bf16")


def _f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit pattern (round to nearest even, NaN kept)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded = np.where(nan, ((u >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)
    return rounded


def _values(val) -> np.ndarray:
    """numpy values of a tensor handed out by `weights.read_weights` (MXTensor: float32)."""
    return val.dequantize() if isinstance(val, MXTensor) else np.asarray(val)


def _plan(gname: str, val, dtype: str, keep_f32) -> tuple:
    """(info shape, info numpy dtype, nbytes, raw ggml type or None, make) for one
    tensor, without reading it: `make()` reads and converts it when it is written."""
    import gguf

    if isinstance(val, QuantizedTensor):
        raw_shape = tuple(val.raw.shape)
        return raw_shape, np.uint8, int(np.prod(raw_shape)), val.qtype, lambda: np.ascontiguousarray(val.raw)
    shape = tuple(int(x) for x in val.shape)
    n = int(np.prod(shape, dtype=np.int64))
    src_dt = np.dtype(np.float32 if isinstance(val, MXTensor) else val.dtype)
    if gname.endswith("ffn_gate_tid2eid.weight") or np.issubdtype(src_dt, np.integer):
        return shape, np.int32, 4 * n, None, lambda: np.ascontiguousarray(_values(val).astype(np.int32))
    if len(shape) < 2 or dtype == "f32" or gname.endswith(keep_f32):
        return shape, np.float32, 4 * n, None, lambda: np.ascontiguousarray(_values(val), dtype=np.float32)
    if dtype == "f16":
        return (
            shape,
            np.float16,
            2 * n,
            None,
            lambda: np.ascontiguousarray(_values(val), dtype=np.float32).astype(np.float16),
        )
    return (
        shape,
        np.uint16,
        2 * n,
        gguf.GGMLQuantizationType.BF16,
        lambda: _f32_to_bf16_bits(np.ascontiguousarray(_values(val), dtype=np.float32)),
    )


def _add_kv(writer, key: str, value, kind: str) -> None:
    from gguf import GGUFValueType

    if kind == "u32":
        writer.add_uint32(key, int(value))
    elif kind == "u64":
        writer.add_uint64(key, int(value))
    elif kind == "f32":
        writer.add_float32(key, float(value))
    elif kind == "bool":
        writer.add_bool(key, bool(value))
    elif kind == "str":
        writer.add_string(key, str(value))
    elif kind == "arr_i32":
        writer.add_key_value(key, [int(v) for v in value], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    elif kind == "arr_f32":
        writer.add_key_value(key, [float(v) for v in value], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    elif kind == "arr_u32":
        writer.add_key_value(key, [int(v) for v in value], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
    elif kind == "arr_u64":
        writer.add_key_value(key, [int(v) for v in value], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT64)
    elif kind == "arr_str":
        writer.add_key_value(key, [str(v) for v in value], GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    else:  # pragma: no cover - table bug
        raise ValueError(f"unknown metadata kind {kind}")


def write_gguf(path, config: dict, tensors: dict, tokenizer=None, dtype: str = "f32", name: str | None = None) -> Path:
    """Write a ds4-style GGUF.  `tensors` uses HF in-memory names (numpy arrays,
    anything np.asarray accepts, or QuantizedTensor).  `tokenizer=None` writes the
    default DeepSeek V4 tokenizer; pass `False` to write none.  The scheme (tensor
    names, metadata keys) follows `config["model_type"]`."""
    import gguf

    from .. import gguf_families

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    path = Path(path)
    family = gguf_families.for_config(config)
    if tokenizer is None:
        from ..runtime.tokenizer import Tokenizer

        tokenizer = Tokenizer.default()
    items = family.to_gguf(config, tensors)
    kv = family.config_to_kv(config)
    arch, keep_f32, default_name = family.arch, family.keep_f32, f"{family.display} (ds4mlx convert)"

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        writer.add_name(name or default_name)
        writer.add_file_type(
            {
                "f32": gguf.LlamaFileType.ALL_F32,
                "f16": gguf.LlamaFileType.MOSTLY_F16,
                "bf16": gguf.LlamaFileType.MOSTLY_BF16,
            }[dtype]
        )
        for key, value, kind in kv:
            if key == "general.architecture":
                continue  # GGUFWriter writes it
            _add_kv(writer, key, value, kind)
        if tokenizer is not False:
            tokenizer.write_gguf(writer)

        # tensor infos first, then each tensor read, converted, written and released
        # in turn: the file is written without holding the model
        plans = [(gname, val, _plan(gname, val, dtype, keep_f32)) for gname, val in items]
        for gname, _, (shape, np_dt, nbytes, raw, _) in plans:
            writer.add_tensor_info(gname, shape, np.dtype(np_dt), nbytes, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for gname, val, (*_, make) in plans:
            writer.write_tensor_data(make())
            release(val)
    finally:
        writer.close()
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    parser.add_argument("hf_dir", help="Hugging Face folder: config.json + *.safetensors (+ tokenizer.json)")
    parser.add_argument("out", help="output .gguf path")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="f32", help="storage type of 2-D+ float tensors (1-D stay f32; default f32)"
    )
    parser.add_argument("--name", default=None, help="general.name to record")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")


def run(args) -> int:
    from ..runtime.tokenizer import Tokenizer
    from .modelfile import ModelFileError, reading
    from .weights import read_hf

    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"ds4mlx convert: {out} exists (use --force to overwrite)", file=sys.stderr)
        return 1
    try:
        with reading(args.hf_dir):
            config, tensors, tok = read_hf(args.hf_dir)
        if tok is None:
            tok = Tokenizer.default()
        vocab = (config.get("text_config") if isinstance(config.get("text_config"), dict) else config).get("vocab_size")
        if vocab is not None and tok.vocab_size < int(vocab):
            print(
                f"ds4mlx convert: note: tokenizer has {tok.vocab_size} tokens, model vocab_size is {vocab}",
                file=sys.stderr,
            )
        write_gguf(out, config, tensors, tok, dtype=args.dtype, name=args.name)
    except ModelFileError:
        raise  # the input is broken: one line, exit 2 (cli.py)
    except (FileNotFoundError, ValueError) as e:
        print(f"ds4mlx convert: error: {e}", file=sys.stderr)
        return 1
    n = len(tensors)
    print(f"wrote {out} ({n} HF tensors, {out.stat().st_size / 1e6:.1f} MB, dtype {args.dtype})")
    return 0


__all__ = ["write_gguf", "add_arguments", "run", "DTYPES"]
