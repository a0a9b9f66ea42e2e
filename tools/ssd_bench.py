"""SSD expert streaming bench: prefill and decode t/s against the expert
cache budget, with hit rates and bytes read per token, on a file-backed synthetic
DeepSeek V4 model (random weights, written once as a GGUF, then read by
`--stream-experts` like a real file).

    PYTHONPATH=$PWD python3 tools/ssd_bench.py                       # this CPU, small model
    PYTHONPATH=$PWD python3 tools/ssd_bench.py --layers 12 --experts 256 --hidden 1024 \
        --inter 512 --out /big/disk/ssd-bench.gguf --budgets 10,25,50,100   # the H200 version

Rows: the resident model (all experts in memory) and one per budget (percent of all
routed experts, cache spread by the store's own policy: whole layers pinned where the
budget covers them, an even share elsewhere).  Routing on random weights is close to
uniform (a worst case: real models reuse experts far more).  The file is read through
the page cache: a first pass after writing it is warm; pass --drop-caches (root) for
cold reads.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import sys
import time
from pathlib import Path

import numpy as np

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def synthetic_config(layers: int, experts: int, hidden: int, inter: int, topk: int, vocab: int) -> dict:
    from ds4mlx.io.demo import DEMO_CONFIG

    pattern = [SLIDING, CSA, HCA, CSA]
    return dict(
        DEMO_CONFIG,
        vocab_size=vocab,
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_hidden_layers=layers,
        n_routed_experts=experts,
        num_experts_per_tok=topk,
        layer_types=[pattern[i % 4] for i in range(layers)],
        mlp_layer_types=["hash_moe" if i < min(3, layers // 4) else "moe" for i in range(layers)],
        demo_model=False,
    )


# ds4's q2 expert types and their f16 scale: near 1/sqrt(hidden) per value, so float32
# activations stay finite through a deep random model.
Q2_EXPERTS = {"gate_proj": ("IQ2_XXS", 6e-4), "up_proj": ("IQ2_XXS", 6e-4), "down_proj": ("Q2_K", 3e-4)}


def lazy_weights(cfg: dict, seed: int, expert_format: str = "f16") -> dict:
    """The demo recipe's random weights (ds4mlx.io.demo.demo_weights), each tensor made
    only when the writer asks for it: a file far larger than this host's memory can be
    written (each tensor seeded by its name, so a rebuild is the same file).
    expert_format "q2": the routed experts as ds4's q2 files store them (IQ2_XXS gate /
    up, Q2_K down), random blocks."""
    import zlib

    from mlx.utils import tree_flatten

    from ds4mlx.io.mapped import LazyTensor
    from ds4mlx.io.quant import QT, QuantizedTensor, byte_shape, random_block_bytes
    from ds4mlx.models.base import family_module

    mod = family_module(cfg["model_type"])
    args = mod.ModelArgs.from_dict(cfg)
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(mod.Model(args).parameters())}  # lazy zeros: no memory
    fused = (".mlp.experts.gate_up_proj.weight", ".mlp.experts.down_proj.weight")
    out = {}

    def expert(name, part, shape):
        if expert_format != "q2":
            return None
        qt, scale = Q2_EXPERTS[part]

        def blocks(name=name, shape=shape):
            return random_block_bytes(qt, shape, np.random.default_rng([seed, zlib.crc32(name.encode())]), scale)

        bs = byte_shape(QT[qt], shape)
        return QuantizedTensor(raw=LazyTensor(blocks, bs, np.uint8), qtype=QT[qt], shape=shape)

    for name, shape in sorted(shapes.items()):
        hf = name[: -len(".weight")] if name.endswith(fused) else name

        def make(name=name, shape=shape):
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            if name.endswith("tid2eid"):
                e, k = args.n_routed_experts, args.num_experts_per_tok
                return np.stack([rng.permutation(e)[:k] for _ in range(shape[0])]).astype(np.int64)
            if len(shape) >= 2:
                std = 0.02 if "embed" in name else 1.0 / np.sqrt(shape[-1])
                return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
            if "norm" in name:
                return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
            return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

        dt = np.int64 if name.endswith("tid2eid") else np.float32
        if hf.endswith(".mlp.experts.gate_up_proj"):  # written split: one half at a time
            half = (shape[0], shape[1] // 2, shape[2])
            base = hf[: -len("gate_up_proj")]
            for part in ("gate_proj", "up_proj"):
                out[base + part] = expert(base + part, part, half) or LazyTensor(
                    lambda n=base + part, h=half: make(n, h), half, dt
                )
            continue
        out[hf] = (hf.endswith(".mlp.experts.down_proj") and expert(hf, "down_proj", shape)) or LazyTensor(
            make, shape, dt
        )
    return out


def build(path: Path, cfg: dict, seed: int = 11, expert_format: str = "f16") -> None:
    from ds4mlx.io.convert import write_gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write_gguf(tmp, cfg, lazy_weights(cfg, seed, expert_format), tokenizer=False, dtype="f16")
    os.replace(tmp, path)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def measure(lm, prompt: list[int], gen: int, chunk: int) -> dict:
    import mlx.core as mx

    from ds4mlx.experts.cli import stats_of

    s = lm.new_session(ctx=len(prompt) + gen + 8, chunk=chunk)
    st0 = stats_of(lm) or {}
    t0 = time.perf_counter()
    logits = s.prefill(prompt)
    mx.synchronize()
    pre_s = time.perf_counter() - t0
    st1 = stats_of(lm) or {}
    t0 = time.perf_counter()
    tok = int(np.argmax(logits))
    for _ in range(gen):
        tok = int(np.argmax(s.decode(tok)))
    dec_s = time.perf_counter() - t0
    st2 = stats_of(lm) or {}

    def delta(a, b, k):
        return (b.get(k) or 0) - (a.get(k) or 0)

    def rate(a, b):
        h, m = delta(a, b, "hits"), delta(a, b, "misses")
        return round(h / (h + m), 4) if h + m else None

    return {
        "prefill_tps": round(len(prompt) / pre_s, 2),
        "decode_tps": round(gen / dec_s, 2),
        "prefill_hit_rate": rate(st0, st1),
        "decode_hit_rate": rate(st1, st2),
        "prefill_bytes_per_token": delta(st0, st1, "bytes_read") // max(1, len(prompt)),
        "decode_bytes_per_token": delta(st1, st2, "bytes_read") // max(1, gen),
        "read_ms_p50": st2.get("read_ms_p50"),
        "read_ms_p99": st2.get("read_ms_p99"),
        "resident_expert_bytes": st2.get("resident_bytes"),
    }


COLUMNS = [
    "budget_pct",
    "cache_experts",
    "total_experts",
    "pinned_layers",
    "prefill_tokens",
    "gen_tokens",
    "prefill_tps",
    "decode_tps",
    "prefill_hit_rate",
    "decode_hit_rate",
    "prefill_bytes_per_token",
    "decode_bytes_per_token",
    "read_ms_p50",
    "read_ms_p99",
    "resident_expert_bytes",
    "file_bytes",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument(
        "--shapes",
        choices=("args", "v4-flash"),
        default="args",
        help="v4-flash: DeepSeek V4 Flash's real shapes with --layers layers (the other size flags ignored)",
    )
    p.add_argument(
        "--expert-format",
        choices=("f16", "q2"),
        default="f16",
        help="q2: routed experts in ds4's q2 types (IQ2_XXS gate/up, Q2_K down), random blocks",
    )
    p.add_argument("--out", default="/tmp/ds4mlx-ssd-bench.gguf", help="the synthetic GGUF (built if missing)")
    p.add_argument("--budgets", default="10,25,50,100", help="cache budgets, percent of all routed experts")
    p.add_argument("--prompt", type=int, default=256, help="prefill tokens")
    p.add_argument("--gen", type=int, default=32, help="decoded tokens")
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--csv", default="-")
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before each row (root)")
    p.add_argument("--no-resident", action="store_true", help="skip the all-resident row")
    p.add_argument("--build-only", action="store_true", help="write the file and stop")
    a = p.parse_args(argv)

    import ds4mlx
    from ds4mlx.experts import StreamConfig

    if a.shapes == "v4-flash":
        from ds4mlx.bench.synthetic import v4_flash_config

        cfg = v4_flash_config(layers=a.layers)
        a.experts, a.vocab = cfg["n_routed_experts"], cfg["vocab_size"]
    else:
        cfg = synthetic_config(a.layers, a.experts, a.hidden, a.inter, a.topk, a.vocab)
    path = Path(a.out)
    if not path.exists():
        t0 = time.perf_counter()
        build(path, cfg, expert_format=a.expert_format)
        print(
            f"ssd_bench: wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
        )
    if a.build_only:
        return 0
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(2, a.vocab, a.prompt)]
    total = a.experts * (a.layers)
    rows = []
    plans = ([] if a.no_resident else [None]) + [float(b) for b in a.budgets.split(",")]
    for pct in plans:
        if a.drop_caches:
            drop_caches()
        stream = None
        if pct is not None:
            stream = StreamConfig(enabled=True, count=max(1, int(round(total * pct / 100))), ctx=a.prompt + a.gen + 8)
        t_load = time.perf_counter()
        lm, _ = ds4mlx.load(str(path), verbose=False, stream=stream)
        print(f"ssd_bench: budget {pct}: loaded in {time.perf_counter() - t_load:.1f} s", file=sys.stderr, flush=True)
        store = getattr(lm.model, "expert_store", None)
        measure(lm, prompt[: a.chunk], 2, a.chunk)  # warm-up: first-use kernels, not in the row
        if store is not None:  # the warm-up's cache contents stay (a server is warm too); counters are deltas
            pass
        row = {
            "budget_pct": "resident" if pct is None else pct,
            "cache_experts": total if store is None else sum(c.capacity for c in store.layers.values()),
            "total_experts": total if store is None else sum(c.E for c in store.layers.values()),
            "pinned_layers": a.layers if store is None else sum(c.pinned for c in store.layers.values()),
            "prefill_tokens": a.prompt,
            "gen_tokens": a.gen,
            "file_bytes": path.stat().st_size,
        }
        row.update(measure(lm, prompt, a.gen, a.chunk))
        if store is not None:
            store.close()
        print("ssd_bench: " + ", ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr)
        rows.append(row)
        del lm, store
        gc.collect()
    out = open(a.csv, "w", newline="") if a.csv != "-" else sys.stdout
    w = csv.DictWriter(out, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    if out is not sys.stdout:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
