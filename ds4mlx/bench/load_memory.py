"""Load-memory measurement: a synthetic V4 Flash file with the real shapes (fewer
layers) written to disk, then loaded in a fresh process with peak RSS and MLX
peak memory recorded against the final weight bytes (BENCHMARKS.md).

    python -m ds4mlx.bench.load_memory write-gguf /tmp/q2.gguf --layers 3
    python -m ds4mlx.bench.load_memory write-hf /tmp/fp8 --layers 3
    python -m ds4mlx.bench.load_memory measure /tmp/q2.gguf
    python -m ds4mlx.bench.load_memory decode /tmp/q2.gguf --layers 3   # vs the in-memory build (GPU)

`write-gguf` is ds4's q2 layout (IQ2_XXS gate/up experts, Q2_K down experts, F16
matrices, F32 vectors); `write-hf` the official release's (hub names, FP8 E4M3
matrices with 128x128 UE8M0 block scales, FP4 experts with UE8M0 scales per 32,
BF16 embedding / head / norms, sharded with an index).  Values are a cheap
deterministic byte pattern: the point is the bytes, not the model's output.
`measure` prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _model_shapes(layers: int) -> tuple[dict, dict]:
    """(config, {HF in-memory name: shape}) of a V4 Flash with `layers` layers."""
    from .synthetic import v4_flash_config

    cfg = v4_flash_config(layers=layers)
    return cfg, model_shapes(cfg)


def model_shapes(cfg: dict) -> dict:
    """{HF in-memory name: shape} of the deepseek_v4 model `cfg` describes (the fused
    expert banks without their `.weight` suffix, as `convert.write_gguf` takes them)."""
    import mlx.core as mx  # noqa: F401  (the model module needs it)
    from mlx.utils import tree_flatten

    from ..models import deepseek_v4

    model = deepseek_v4.Model(deepseek_v4.ModelArgs.from_dict(cfg))
    shapes = {}
    for k, v in tree_flatten(model.parameters()):  # lazy placeholders: never evaluated
        if k.endswith(("mlp.experts.gate_up_proj.weight", "mlp.experts.down_proj.weight")):
            k = k[: -len(".weight")]
        shapes[k] = tuple(v.shape)
    return shapes


def _pattern(shape, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if np.issubdtype(dt, np.floating):
        return np.full(n, 0.01, dt).reshape(shape)
    if dt == np.uint8:
        return np.full(n, 0x38, np.uint8).reshape(shape)  # FP8 0.25 / FP4 codes 8, 3 / E8M0 2^-71
    return np.zeros(n, dt).reshape(shape)


def write_gguf(path: str, layers: int) -> int:
    from ..io.convert import write_gguf as write
    from ..io.mapped import LazyTensor
    from ..io.quant import QT, QuantizedTensor, byte_shape

    cfg, shapes = _model_shapes(layers)
    tensors = {}
    for k, shape in shapes.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            E, I2, H = shape
            for part in ("gate_proj", "up_proj"):
                bs = byte_shape(QT.IQ2_XXS, (E, I2 // 2, H))
                raw = LazyTensor(lambda bs=bs: _pattern(bs, np.uint8), bs, np.uint8)
                tensors[k.replace("gate_up_proj", part)] = QuantizedTensor(
                    raw=raw, qtype=QT.IQ2_XXS, shape=(E, I2 // 2, H)
                )
        elif k.endswith("mlp.experts.down_proj"):
            bs = byte_shape(QT.Q2_K, shape)
            tensors[k] = QuantizedTensor(
                raw=LazyTensor(lambda bs=bs: _pattern(bs, np.uint8), bs, np.uint8), qtype=QT.Q2_K, shape=shape
            )
        else:
            dt = np.int64 if k.endswith("tid2eid") else np.float32
            tensors[k] = LazyTensor(lambda s=shape, d=dt: _pattern(s, d), shape, dt)
    write(path, cfg, tensors, tokenizer=False, dtype="f16")
    return Path(path).stat().st_size


def write_hf(folder: str, layers: int) -> int:
    import torch
    from safetensors.torch import save_file

    from ..gguf_families import deepseek_v4 as names

    cfg, shapes = _model_shapes(layers)
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    hub_top = {h: c for h, _, c in names.TOP_LEVEL}
    hub_layer = {h: c for h, _, c in names.LAYER}
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    index, total = {}, 0

    def fp8(shape):
        w = torch.from_numpy(_pattern(shape, np.uint8)).view(torch.float8_e4m3fn)
        s = torch.from_numpy(_pattern((-(-shape[0] // 128), -(-shape[1] // 128)), np.uint8)).view(torch.float8_e8m0fnu)
        return w, s

    def fp4(out_dim, in_dim):
        w = torch.from_numpy(_pattern((out_dim, in_dim // 2), np.uint8).view(np.int8))
        s = torch.from_numpy(_pattern((out_dim, in_dim // 32), np.uint8)).view(torch.float8_e8m0fnu)
        return w, s

    def flush(shard: dict, n: int):
        nonlocal total
        fn = f"model-{n:05d}.safetensors"
        save_file(shard, str(out / fn))
        index.update({k: fn for k in shard})
        total += (out / fn).stat().st_size

    shard, n = {}, 0
    for k, shape in shapes.items():
        if k.startswith("model.layers."):
            i, rest = k[len("model.layers.") :].split(".", 1)
            if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
                E = shape[0]
                for x in range(E):
                    if rest.endswith("gate_up_proj"):
                        for w_name in ("w1", "w3"):
                            (
                                shard[f"layers.{i}.ffn.experts.{x}.{w_name}.weight"],
                                shard[f"layers.{i}.ffn.experts.{x}.{w_name}.scale"],
                            ) = fp4(shape[1] // 2, shape[2])
                    else:
                        (
                            shard[f"layers.{i}.ffn.experts.{x}.w2.weight"],
                            shard[f"layers.{i}.ffn.experts.{x}.w2.scale"],
                        ) = fp4(shape[1], shape[2])
                    if x % 64 == 63:  # shards of ~0.6 GB: the writer holds one at a time
                        flush(shard, n)
                        shard, n = {}, n + 1
                continue
            hub = f"layers.{i}.{hub_layer[rest]}"
        else:
            hub = hub_top[k]
        if k.endswith("tid2eid"):
            shard[hub] = torch.zeros(shape, dtype=torch.int32)
        elif len(shape) == 2 and "embed" not in k and "lm_head" not in k and "hc" not in k and "gate.weight" not in k:
            shard[hub], shard[hub[: -len(".weight")] + ".scale"] = fp8(shape)
        else:
            shard[hub] = torch.from_numpy(_pattern(shape, np.float32)).to(torch.bfloat16)
    flush(shard, n)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    (out / "config.json").write_text(json.dumps(cfg))
    return total


def measure(path: str) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..io.loader import load
    from ..io.mapped import peak_rss_bytes

    base_rss = peak_rss_bytes()
    t0 = time.perf_counter()
    model, _ = load(path, dtype=None, verbose=False)
    dt = time.perf_counter() - t0
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.model.parameters()))
    p = Path(path)
    size = p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.safetensors"))
    return {
        "path": path,
        "file_bytes": size,
        "weight_bytes": weight_bytes,
        "load_s": round(dt, 1),
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_before_load": base_rss,
        "mlx_peak_bytes": mx.get_peak_memory(),
        "peak_rss_over_weights": round(peak_rss_bytes() / weight_bytes, 3),
        "mlx_peak_over_weights": round(mx.get_peak_memory() / weight_bytes, 3),
    }


def _progress(t_start: float, what: str) -> None:
    """One line on stderr per phase: a device run that hits its time box still says how far it got
    (a silent run cut by its box says nothing)."""
    print(f"[{time.perf_counter() - t_start:7.1f} s] {what}", file=sys.stderr, flush=True)


def _decode_tps(lm, tokens: int, prompt: int = 64, t_start: float | None = None) -> float:
    """Decode tokens per second after a `prompt`-token prefill (median step)."""
    import statistics

    t_start = time.perf_counter() if t_start is None else t_start
    s = lm.new_session(ctx=4096)
    s.prefill(list(range(2, 2 + prompt)))
    _progress(t_start, f"prefilled {prompt} tokens")
    steps = []
    for i in range(tokens):
        t0 = time.perf_counter()
        s.decode(2 + (i % 1000))  # numpy logits: synchronizes
        steps.append(time.perf_counter() - t0)
        if i < 2:
            _progress(t_start, f"decode step {i + 1}: {steps[-1]:.2f} s")
    _progress(t_start, f"{tokens} decode steps, median {statistics.median(steps):.4f} s")
    return round(1.0 / statistics.median(steps[2:] or steps), 2)


def decode_compare(path: str, layers: int, tokens: int = 24) -> dict:
    """The file loaded from disk vs the same model built in memory
    (bench.synthetic, GGUF IQ2_XXS / Q2_K experts, bf16 rest), both decoding with
    float32 activations: decode t/s of each (the load-memory acceptance figure)."""
    import gc

    import mlx.core as mx

    from ..io.loader import load
    from .synthetic import build_synthetic_v4_flash

    mx.reset_peak_memory()
    t0 = time.perf_counter()
    lm, _ = load(path, verbose=True)  # --dtype auto: float32 activations, weights as stored
    _progress(t0, f"loaded {path}")
    out = {
        "path": path,
        "load_s": round(time.perf_counter() - t0, 1),
        "load_mlx_peak_gb": round(mx.get_peak_memory() / 1e9, 2),
        "file_gb": round(Path(path).stat().st_size / 1e9, 2),
        "file_tps": _decode_tps(lm, tokens, t_start=t0),
    }
    print(json.dumps(out), file=sys.stderr, flush=True)  # the file's half, should the box end next
    del lm
    gc.collect()
    mx.clear_cache()
    mem, _, info = build_synthetic_v4_flash(layers=layers, expert_format="gguf", other_bits=16)
    mem.model.model.activation_dtype = mx.float32
    _progress(t0, "built the same model in memory")
    out.update(memory_build=info, memory_tps=_decode_tps(mem, tokens, t_start=t0))
    out["file_over_memory"] = round(out["file_tps"] / out["memory_tps"], 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds4mlx.bench.load_memory")
    ap.add_argument("what", choices=("write-gguf", "write-hf", "measure", "decode"))
    ap.add_argument("path")
    ap.add_argument("--layers", type=int, default=3)
    a = ap.parse_args(argv)
    if a.what == "measure":
        print(json.dumps(measure(a.path)))
    elif a.what == "decode":
        print(json.dumps(decode_compare(a.path, a.layers)))
    else:
        n = (write_gguf if a.what == "write-gguf" else write_hf)(a.path, a.layers)
        print(json.dumps({"path": a.path, "bytes": n}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
