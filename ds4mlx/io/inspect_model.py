"""`ds4mlx inspect FILE`: what a model file holds and what serving it needs.

Reads only headers (GGUF metadata and tensor infos, safetensors headers), once:
nothing is loaded, but the file is checked as a load would check it (the family's
metadata and tensor names mapped: `weights.read_gguf_file`; the folder's config.json
and safetensors headers), so a broken path is one line naming it and exit 2, as for
every command (modelfile.py).  Prints the family, the tensor count, a histogram of storage types
(tensors, bytes), how a `--dtype auto` load on this machine keeps each quantized type
(GGUF blocks / MLX affine repack / dequantized, and whether exactly), the weight bytes read per decoded token (every dense tensor,
plus k of the E routed experts of each MoE layer), and the memory serving it
takes at `--ctx` tokens: the weights (as the loader keeps them: packed types as
stored) plus the KV cache (DeepSeek V4's float32 sliding window, compressed rows
and indexer rows), and the verdict a load applies (memory_fit.py): refused (exit 2), in
one line naming the --ctx that would fit and --stream-experts, when that exceeds what a
model may use here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .memory_fit import GB, budget, machine_memory, verdict

EXPERT_MARKERS = ("_exps.", ".experts.")  # routed expert banks (GGUF ds4 names, HF / hub names)
EMBED_NAMES = ("token_embd.", "embed.", "model.embed_tokens.")  # one row read per token


def _gguf_tensors(path: Path):
    from .weights import GGUFFile, read_gguf_file

    g = GGUFFile(path)
    config, _, _ = read_gguf_file(g, with_tokenizer=False)  # the family mapping, checked as a load would
    rows = [(t.name, t.ggml_type.name, t.nbytes) for t in g.tensors.values()]
    shapes = [(t.name, t.ggml_type.name, len(t.shape)) for t in g.tensors.values()]
    return g.metadata.get("general.architecture", "?"), rows, config, shapes


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
    return cfg.get("model_type", "?"), rows, cfg, []


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
    from ..models.deepseek_v4 import ModelArgs

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


def summarize(path, ctx: int = 32768) -> dict:
    path = Path(path)
    from .weights import is_model_folder

    # a missing path, a device, a FIFO, a symlink loop: refused by what it is
    arch, rows, config, shapes = _hf_tensors(path) if is_model_folder(path) else _gguf_tensors(path)
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
    cap = int((config or {}).get("max_position_embeddings") or 1 << 20)
    v = verdict(weights, lambda c: kv_bytes(config, c), ctx, budget(), cap)
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
        "budget_bytes": v.budget.bytes,
        "fits": v.fits,
        "max_ctx": v.max_ctx,
        "verdict": v,
        "weight_paths": weight_paths(shapes),
    }


def weight_paths(shapes) -> list[str]:
    """How `--dtype auto` on this machine keeps each quantized GGUF type (`models.quantized.file_paths`):
    float weights widened to float32 on the CPU, kept as stored on a GPU (the file's most common
    float matrix type)."""
    import mlx.core as mx

    from ..models.quantized import file_paths

    if not shapes:
        return []
    compute = mx.float32
    if mx.default_device() != mx.cpu:
        floats = [t for _, t, nd in shapes if nd >= 2 and t in ("F32", "F16", "BF16")]
        top = max(set(floats), key=floats.count) if floats else "F32"
        compute = {"F16": mx.float16, "BF16": mx.bfloat16}.get(top, mx.float32)
    return file_paths(shapes, compute, exact=True)


def add_arguments(parser) -> None:
    parser.add_argument("file", help="GGUF file or Hugging Face folder")
    parser.add_argument("--ctx", type=int, default=32768, help="context length to size the KV cache for")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args) -> int:
    from .modelfile import reading

    with reading(args.file):
        s = summarize(args.file, args.ctx)
    v = s.pop("verdict")
    if args.json:
        print(json.dumps(s))
    else:
        print(f"{s['path']}: family {s['family']}, {s['tensors']} tensors, {s['weight_bytes'] / GB:.2f} GB of weights")
        for t, h in s["types"].items():
            print(f"  {t:<10} {h['tensors']:>6} tensors  {h['bytes'] / GB:9.3f} GB")
        if s["weight_paths"]:
            print("quantized types as a --dtype auto load here keeps them:")
        for line in s["weight_paths"]:
            print(f"  {line}")
        print(f"bytes read per decoded token: {s['bytes_per_token'] / GB:.3f} GB")
        print(f"serving: {v.line()}")
    if not v.fits:
        print(f"ds4mlx inspect: {v.refusal(s['path'])}", file=sys.stderr)
        return 2
    return 0


__all__ = ["summarize", "kv_bytes", "machine_memory", "add_arguments", "run"]
