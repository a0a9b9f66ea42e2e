"""The checks behind `ds4mlx inspect` (inspect_model.py prints the summary): what a model file
or folder holds, without building the model.

A GGUF: architecture, name, metadata and tensor counts, tensor bytes and types,
the vocabulary size, and the family config it maps to (its metadata checked as
a load would).  A Hugging Face folder: model_type, the config's sizes, and the
safetensors headers (names, dtypes; no tensor data is read).  A broken path is
one line naming it and exit 2, as for every command (modelfile.py).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "n_routed_experts",
    "num_experts",
    "max_position_embeddings",
)


def add_arguments(p) -> None:
    p.add_argument("path", help="GGUF file or Hugging Face folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _gguf(path: Path) -> dict:
    from .weights import GGUFFile, read_gguf

    g = GGUFFile(path)
    meta = g.metadata
    config, _, _ = read_gguf(path, with_tokenizer=False)  # the family mapping, checked as a load would
    types = Counter(t.ggml_type.name for t in g.tensors.values())
    return {
        "format": "gguf",
        "architecture": meta.get("general.architecture"),
        "name": meta.get("general.name"),
        "metadata_keys": len(meta),
        "tensors": len(g.tensors),
        "tensor_bytes": sum(t.nbytes for t in g.tensors.values()),
        "tensor_types": dict(types),
        "vocab": len(meta.get("tokenizer.ggml.tokens") or []),
        "config": {k: config[k] for k in CONFIG_KEYS if k in config},
    }


def _hf(folder: Path) -> dict:
    from .weights import SafetensorsFile, read_hf_config, safetensors_files

    config = read_hf_config(folder)
    files = [SafetensorsFile(p) for p in safetensors_files(folder)]
    types = Counter(f.dtype(k) for f in files for k in f.keys())
    if not types:
        raise ValueError(f"{folder}: no tensors found in the safetensors files")
    return {
        "format": "hf",
        "model_type": config.get("model_type"),
        "files": len(files),
        "tensors": sum(types.values()),
        "tensor_types": dict(types),
        "tokenizer": (folder / "tokenizer.json").is_file(),
        "config": {k: config[k] for k in CONFIG_KEYS if k in config},
    }


def describe(path) -> dict:
    from .modelfile import reading

    p = Path(path)
    with reading(p):
        if p.is_dir():
            return {"path": str(p), **_hf(p)}
        if not p.is_file():
            raise FileNotFoundError(f"no such model file or folder: {p}")
        return {"path": str(p), **_gguf(p)}


def run(args) -> int:
    info = describe(args.path)
    if args.json:
        print(json.dumps(info, ensure_ascii=False))
        return 0
    for k, v in info.items():
        print(f"{k:>14}: {json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v}")
    sys.stdout.flush()
    return 0


__all__ = ["describe", "add_arguments", "run"]
