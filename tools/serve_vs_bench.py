"""`ds4mlx serve` decode speed against `ds4mlx bench` at the same context, one process.

    python tools/serve_vs_bench.py --ctx 2048 --gen 64 [--expert-format gguf]

Builds the synthetic V4 Flash model once; runs bench's greedy probe at --ctx (bench.run_bench);
then serves the same model (engine + aiohttp app, as `ds4mlx serve` builds them) on a
local port and streams a greedy /v1/completions request whose prompt is the same
--ctx bench tokens, timing the SSE deltas on the client from the first to the last
(the engine's decode-token counter gives the token count).  Twice: a plain request
(EOS and the stop ids live: the loop keeps one step undoable) and one with ignore_eos.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

from ds4mlx.bench import frontier as bench
from ds4mlx.bench.synthetic import build_synthetic_v4_flash
from ds4mlx.engine import Engine
from ds4mlx.serve.app import BackgroundServer, make_app


def stream(url: str, body: dict) -> tuple[float, int]:
    """(seconds from the first to the last text delta, deltas seen)."""
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    first = last = None
    n = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if any(c.get("text") for c in ev.get("choices", [])):
                last = time.perf_counter()
                first = first or last
                n += 1
    return (last - first) if first else 0.0, n


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--expert-format", choices=["mlx", "gguf"], default="mlx")
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--gen", type=int, default=64)
    a = p.parse_args()
    model, tok, info = build_synthetic_v4_flash(layers=a.layers, expert_format=a.expert_format)
    print(f"# {info}", flush=True)
    row = bench.run_bench(model, tok, [a.ctx], a.gen)[0]
    print(f"bench,{a.expert_format},{a.ctx},{row['gen_tps']}", flush=True)
    prompt = tok.decode(bench.bench_tokens(tok, a.ctx))
    engine = Engine(model, tok, ctx=a.ctx + a.gen + 64, default_max_tokens=a.gen)
    server = BackgroundServer(make_app(engine)).start()
    try:
        for label, extra in (("serve", {}), ("serve_ignore_eos", {"ignore_eos": True})):
            before = engine.stats.decode_tokens
            secs, deltas = stream(
                server.url, {"prompt": prompt, "max_tokens": a.gen, "temperature": 0, "stream": True, **extra}
            )
            tokens = engine.stats.decode_tokens - before
            tps = (tokens - 1) / secs if secs > 0 and tokens > 1 else 0.0
            ratio = tps / row["gen_tps"] if row["gen_tps"] else 0.0
            print(
                f"{label},{a.expert_format},{a.ctx},{tps:.2f},tokens={tokens},deltas={deltas},vs_bench={ratio:.2f}",
                flush=True,
            )
    finally:
        server.stop()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
