"""The disk KV cache benchmark: per prompt length, a cold prefill against snapshot + store
and lookup + restore into a fresh session, and the checkpoint size (BENCHMARKS.md)::

    python -m ds4mlx.bench.kv bench --tokens 8192 32768
    python -m ds4mlx.bench.kv bench --synthetic v4-flash --tokens 32768   # full-size random weights
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from ..kv.cache import model_identity, routed_expert_bits
from ..kv.store import KVStore


def bench(
    lengths: Sequence[int],
    model_path: str | None = None,
    directory: str | None = None,
    chunk: int | None = None,
    model=None,
) -> list[dict]:
    """Per prompt length: cold prefill time vs snapshot + store and lookup +
    restore time (fresh session), plus the checkpoint size.  `model`: a
    (LanguageModel, Tokenizer) pair already built (the synthetic model); else
    `model_path` is loaded (the demo model when None).  `chunk`: the prefill chunk
    (default: prefill_chunk.default_chunk(), as ds4mlx serve)."""
    import tempfile

    import mlx.core as mx
    import numpy as np

    from .. import load

    model, tok = model if model is not None else load(model_path)
    text = open(
        os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "bench_text.txt"), encoding="utf-8"
    ).read()
    base = tok.encode(text)
    out = []
    for n in lengths:
        ids = (base * (n // max(1, len(base)) + 1))[:n]
        ctx = n + 1024
        with tempfile.TemporaryDirectory(dir=directory) as d:
            store = KVStore(d, 1 << 40, model_identity(model), routed_expert_bits(model), ctx, 1)
            s = model.new_session(ctx, chunk=chunk)
            t0, c0 = time.perf_counter(), time.process_time()
            s.prefill(ids)
            prefill_s, prefill_cpu_s = time.perf_counter() - t0, time.process_time() - c0
            key = tok.decode_bytes(ids)
            t0 = time.perf_counter()
            payload = s.snapshot()
            snap_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            store.store(key, n, payload, "cold")
            store_s = time.perf_counter() - t0
            r = model.new_session(ctx, chunk=chunk)
            t0 = time.perf_counter()
            cp = store.lookup(key + b" more")
            lookup_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            r.restore(cp.payload)
            mx.eval(r.cache_arrays())  # the restored state is materialised
            restore_s = time.perf_counter() - t0
            exact = bool(np.array_equal(r.last_logits, s.last_logits)) and r.tokens == s.tokens
            out.append(
                {
                    "tokens": n,
                    "prefill_s": prefill_s,
                    "prefill_cpu_s": prefill_cpu_s,
                    "snapshot_s": snap_s,
                    "store_s": store_s,
                    "lookup_s": lookup_s,
                    "restore_s": restore_s,
                    "file_mib": os.path.getsize(cp.path) / 2**20,
                    "exact": exact,
                }
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m ds4mlx.bench.kv", description="disk KV cache benchmark")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="restore time vs re-prefill time")
    b.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    b.add_argument("-m", "--model", default=None, help="model (default: the demo model)")
    b.add_argument("--dir", default=None, help="where to put the temporary store")
    b.add_argument("--chunk", type=int, default=None, help="prefill chunk (default as ds4mlx serve: 2048 on a GPU)")
    b.add_argument("--synthetic", choices=["v4-flash"], help="random full-size V4 Flash (as ds4mlx bench)")
    b.add_argument("--expert-format", choices=["mlx", "gguf"], default="mlx", help="--synthetic: routed experts")
    b.add_argument("--layers", type=int, default=None, help="--synthetic: number of layers (default 43)")
    args = p.parse_args(argv)
    built = None
    if args.synthetic:
        from .synthetic import build_synthetic_v4_flash

        lm, tok, info = build_synthetic_v4_flash(layers=args.layers, expert_format=args.expert_format)
        print(f"synthetic V4 Flash: {info}", flush=True)
        built = (lm, tok)
    print(
        "| prompt tokens | re-prefill s (CPU s) | snapshot s | store s | lookup s | restore s | lookup+restore s "
        "| speed-up | file MiB | exact |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in bench(args.tokens, args.model, args.dir, args.chunk, model=built):
        load_s = r["lookup_s"] + r["restore_s"]
        print(
            f"| {r['tokens']:,} | {r['prefill_s']:.2f} ({r['prefill_cpu_s']:.1f}) | {r['snapshot_s']:.3f} | "
            f"{r['store_s']:.3f} | "
            f"{r['lookup_s']:.3f} | {r['restore_s']:.3f} | {load_s:.3f} | {r['prefill_s'] / load_s:.0f}x | "
            f"{r['file_mib']:.1f} | {'yes' if r['exact'] else 'NO'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
