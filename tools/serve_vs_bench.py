"""`ds4mlx serve` decode speed against `ds4mlx bench` at the same context, one process.

    python tools/serve_vs_bench.py --ctx 2048 --gen 64 [--expert-format gguf]
    python tools/serve_vs_bench.py --engine --layers 20 --ctx 2048 --gen 128   # no HTTP
    python tools/serve_vs_bench.py --engine --model demo --ctx 256 --gen 32    # the CPU demo

With --engine the same prompt goes straight to the `Engine` as a `Job` (as the HTTP
adapters build it, raw completions), its events read from the engine's queue: the
engine's own cost against bench's plain loop, without HTTP, SSE or the client.  A short
untimed job first compiles the engine session's traces.  --model (a path, or `demo`)
replaces the synthetic V4 Flash.

Builds the synthetic V4 Flash model once; runs bench's greedy probe at --ctx (bench.run_bench);
then serves the same model (engine + aiohttp app, as `ds4mlx serve` builds them) on a
local port and streams a greedy /v1/completions request whose prompt is the same
--ctx bench tokens, timing the SSE deltas on the client from the first to the last
(the engine's decode-token counter gives the token count).  Twice: a plain request
(EOS and the stop ids live: the loop keeps one step undoable) and one with ignore_eos.
"""

from __future__ import annotations

import argparse
import sys

from ds4mlx.bench import frontier as bench
from ds4mlx.bench.engine_host import engine_job, stream
from ds4mlx.bench.synthetic import build_synthetic_v4_flash
from ds4mlx.engine import Engine


def engine_busy(engine, prompt: str, ids: list[int], gen: int) -> str:
    """One more ignore_eos job under the CUDA profiler: GPU-busy and wall ms per token (its wall
    time slowed by the profiler's host work), or why it can not be told here."""
    from ds4mlx.bench import gpu_timer

    why = gpu_timer.unavailable()
    if why is not None:
        return f"n/a ({why})"
    (secs, tokens), per = gpu_timer.kernel_times(lambda: engine_job(engine, prompt, ids, gen, True))
    busy = sum(t for _, t in per.values()) / 1e3  # µs -> ms, the whole job (its prefill included)
    return f"busy_ms_per_token={busy / tokens:.3f} (prefill included),profiled_wall_ms_per_token={1e3 * secs / max(tokens - 1, 1):.3f}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--expert-format", choices=["mlx", "gguf"], default="mlx")
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--engine", action="store_true", help="the engine in process (a Job, no HTTP) instead of serve")
    p.add_argument("--model", help="a model path or `demo` instead of the synthetic V4 Flash")
    p.add_argument(
        "--profile",
        action="store_true",
        help="with --engine: bench's row with its profile columns (bench --profile), and the engine's "
        "GPU-busy ms per token from one more job under the CUDA profiler (n/a elsewhere)",
    )
    a = p.parse_args()
    if a.model:
        from ds4mlx import load

        model, tok = load(a.model)
        label = a.model
    else:
        model, tok, info = build_synthetic_v4_flash(layers=a.layers, expert_format=a.expert_format)
        print(f"# {info}", flush=True)
        label = a.expert_format
    profile = None
    if a.profile:
        from ds4mlx.bench.frontier_profile import FrontierProfile

        profile = FrontierProfile.for_model(model)
        print(f"# profile: {profile.describe()}", flush=True)
    row = bench.run_bench(model, tok, [a.ctx], a.gen, profile=profile)[0]
    cols = "".join(f",{k}={row[k]}" for k in bench.PROFILE_COLUMNS if k in row)
    print(f"bench,{label},{a.ctx},{row['gen_tps']}{cols}", flush=True)
    ids = bench.bench_tokens(tok, a.ctx)
    prompt = tok.decode(ids)
    engine = Engine(model, tok, ctx=a.ctx + a.gen + 64, default_max_tokens=a.gen)
    if a.engine:
        try:
            engine_job(engine, prompt, ids, 4, True)  # untimed: the engine session's traces
            for name, ignore_eos in (("engine", False), ("engine_ignore_eos", True)):
                secs, tokens = engine_job(engine, prompt, ids, a.gen, ignore_eos)
                tps = (tokens - 1) / secs if secs > 0 and tokens > 1 else 0.0
                ratio = tps / row["gen_tps"] if row["gen_tps"] else 0.0
                print(f"{name},{label},{a.ctx},{tps:.2f},tokens={tokens},vs_bench={ratio:.2f}", flush=True)
            if a.profile:
                print(f"engine_gpu_busy,{label},{a.ctx},{engine_busy(engine, prompt, ids, a.gen)}", flush=True)
        finally:
            engine.close()
        return 0
    from ds4mlx.serve.app import BackgroundServer, make_app

    server = BackgroundServer(make_app(engine)).start()
    try:
        for name, extra in (("serve", {}), ("serve_ignore_eos", {"ignore_eos": True})):
            before = engine.stats.decode_tokens
            secs, deltas, _ = stream(
                server.url,
                {"prompt": prompt, "max_tokens": a.gen, "temperature": 0, "think": False, "stream": True, **extra},
            )
            tokens = engine.stats.decode_tokens - before
            tps = (tokens - 1) / secs if secs > 0 and tokens > 1 else 0.0
            ratio = tps / row["gen_tps"] if row["gen_tps"] else 0.0
            print(
                f"{name},{label},{a.ctx},{tps:.2f},tokens={tokens},deltas={deltas},vs_bench={ratio:.2f}",
                flush=True,
            )
    finally:
        server.stop()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
