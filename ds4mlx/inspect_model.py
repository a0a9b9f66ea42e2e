"""`ds4mlx inspect FILE`: what a model file holds and what serving it needs.

Reads only headers (GGUF metadata and tensor infos, safetensors headers), once:
nothing is loaded, but the file is checked as a load would check it (the family's
metadata and tensor names mapped: `weights.read_gguf_file`; the folder's config.json
and safetensors headers), so a broken path is one line naming it and exit 2, as for
every command (modelfile.py).  Prints the family, the tensor count, a histogram of storage types
(tensors, bytes), the weight bytes read per decoded token (every dense tensor,
plus k of the E routed experts of each MoE layer), and the memory serving it
takes at `--ctx` tokens: the weights (as the loader keeps them: packed types as
stored) plus the KV cache (DeepSeek V4's float32 sliding window, compressed rows
and indexer rows).  Refuses (exit 2) when that exceeds this machine's memory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

GB = 1e9
HEADROOM = 0.9  # of the machine's memory usable for one model (the OS and the server need the rest)
EXPERT_MARKERS = ("_exps.", ".experts.")  # routed expert banks (GGUF ds4 names, HF / hub names)
EMBED_NAMES = ("token_embd.", "embed.", "model.embed_tokens.")  # one row read per token


def _gguf_tensors(path: Path):
    from .weights import GGUFFile, read_gguf_file

    g = GGUFFile(path)
    config, _, _ = read_gguf_file(g, with_tokenizer=False)  # the family mapping, checked as a load would
    rows = [(t.name, t.ggml_type.name, t.nbytes) for t in g.tensors.values()]
    return g.metadata.get("general.architecture", "?"), rows, config


def _hf_tensors(folder: Path):
    from .weights import SafetensorsFile, read_hf_config, safetensors_files

    cfg = read_hf_config(folder)
    rows = []
    for p in safetensors_files(folder):
        f = SafetensorsFile(p)
        for k in f.keys():
            shape = f.shape(k)
            n = 1
            for s in shape:
                n *= int(s)
            dt = f.dtype(k)
            rows.append((k, dt, n * _ST_BYTES.get(dt, 1)))
    if not rows:
        raise ValueError(f"{folder}: no tensors found in the safetensors files")
    return cfg.get("model_type", "?"), rows, cfg


_ST_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "BOOL": 1,
}


def kv_bytes(config: dict | None, ctx: int) -> int | None:
    """DeepSeek V4 KV cache bytes at `ctx` tokens (float32, as models/deepseek_v4.LayerCache
    keeps it): per layer the sliding window ring, plus ctx/rate compressed rows
    (CSA / HCA) and, for CSA, ctx/rate indexer rows.  None for other families."""
    if not config or config.get("model_type", "deepseek_v4") != "deepseek_v4" or "layer_types" not in config:
        return None
    from .models.deepseek_v4 import ModelArgs

    a = ModelArgs.from_dict(config)
    total = 0
    for t in a.layer_types:
        rows = a.sliding_window * a.head_dim
        r = a.ratio(t)
        if r:
            rows += -(-ctx // r) * a.head_dim
            if t == "compressed_sparse_attention":
                rows += -(-ctx // r) * a.index_head_dim
        total += rows * 4
    return total


def machine_memory() -> int:
    """Bytes of memory a model can use here: the GPU's (MLX device info) or the RAM."""
    try:
        import mlx.core as mx

        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        if mx.default_device() != mx.cpu and info.get("memory_size"):
            return int(info["memory_size"])
    except Exception:  # noqa: BLE001 - no GPU info: fall back to the RAM
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def summarize(path, ctx: int = 32768) -> dict:
    path = Path(path)
    from .weights import is_model_folder

    # a missing path, a device, a FIFO, a symlink loop: refused by what it is
    arch, rows, config = _hf_tensors(path) if is_model_folder(path) else _gguf_tensors(path)
    hist: dict[str, list] = {}
    for _, t, nb in rows:
        h = hist.setdefault(t, [0, 0])
        h[0] += 1
        h[1] += nb
    weights = sum(nb for *_, nb in rows)
    experts = sum(
        nb
        for name, _, nb in rows
        if any(m in name for m in EXPERT_MARKERS) and "shexp" not in name and "shared" not in name
    )
    k = int((config or {}).get("num_experts_per_tok") or 0)
    E = int((config or {}).get("n_routed_experts") or (config or {}).get("num_experts") or 0)
    embed = sum(nb for name, _, nb in rows if name.startswith(EMBED_NAMES))
    vocab = int((config or {}).get("vocab_size") or 0)
    per_token = weights - experts - embed + (experts * k // E if E else experts) + (embed // vocab if vocab else embed)
    kv = kv_bytes(config, ctx)
    need = weights + (kv or 0)
    return {
        "path": str(path),
        "family": arch,
        "tensors": len(rows),
        "types": {t: {"tensors": n, "bytes": b} for t, (n, b) in sorted(hist.items(), key=lambda x: -x[1][1])},
        "weight_bytes": weights,
        "bytes_per_token": per_token,
        "ctx": ctx,
        "kv_bytes": kv,
        "serve_bytes": need,
        "machine_bytes": machine_memory(),
    }


def add_arguments(parser) -> None:
    parser.add_argument("file", help="GGUF file or Hugging Face folder")
    parser.add_argument("--ctx", type=int, default=32768, help="context length to size the KV cache for")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args) -> int:
    from .modelfile import reading

    with reading(args.file):
        s = summarize(args.file, args.ctx)
    if args.json:
        print(json.dumps(s))
    else:
        print(f"{s['path']}: family {s['family']}, {s['tensors']} tensors, {s['weight_bytes'] / GB:.2f} GB of weights")
        for t, h in s["types"].items():
            print(f"  {t:<10} {h['tensors']:>6} tensors  {h['bytes'] / GB:9.3f} GB")
        print(f"bytes read per decoded token: {s['bytes_per_token'] / GB:.3f} GB")
        kv = "unknown for this family" if s["kv_bytes"] is None else f"{s['kv_bytes'] / GB:.2f} GB"
        print(
            f"serving at --ctx {s['ctx']}: weights {s['weight_bytes'] / GB:.2f} GB + KV cache {kv} "
            f"= {s['serve_bytes'] / GB:.2f} GB; this machine: {s['machine_bytes'] / GB:.1f} GB"
        )
    if s["serve_bytes"] > HEADROOM * s["machine_bytes"]:
        print(
            f"ds4mlx inspect: {s['path']} needs {s['serve_bytes'] / GB:.1f} GB to serve at --ctx {s['ctx']} but "
            f"this machine has {s['machine_bytes'] / GB:.1f} GB ({HEADROOM:.0%} usable): it cannot hold it; "
            "use a machine with more memory, a smaller quantization, or SSD streaming of the experts",
            file=sys.stderr,
        )
        return 2
    return 0


__all__ = ["summarize", "kv_bytes", "machine_memory", "add_arguments", "run"]
