"""Decode speed before / after the compiled static step, one process, one model build.

    python tools/decode_before_after.py --expert-format mlx --ctx 2048 32768 --gen 32

Builds the synthetic V4 Flash model once, then walks `ds4mlx.bench.run_bench` over the
frontiers once per DS4MLX_DECODE mode (legacy = the per-layer forward, compiled = the
static step under mx.compile) and prints one CSV line per (mode, frontier) plus the
compiled step's profile (launches and host µs per token) at the first frontier.
"""

from __future__ import annotations

import argparse
import os
import sys

from ds4mlx.bench import frontier as bench
from ds4mlx.bench.decode_profile import format_profile, profile_decode
from ds4mlx.bench.synthetic import build_synthetic_v4_flash
from ds4mlx.runtime import stepper


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--expert-format", choices=["mlx", "gguf"], default="mlx")
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--ctx", type=int, nargs="+", default=[2048, 32768])
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--modes", nargs="+", default=["legacy", "compiled"], choices=stepper.MODES)
    p.add_argument("--time-budget", type=float, default=None, help="seconds per mode")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    model, tok, info = build_synthetic_v4_flash(layers=a.layers, expert_format=a.expert_format)
    print(f"# {info}", flush=True)
    print("mode,expert_format,ctx_tokens,gen_tps,ms_per_token,roofline_pct", flush=True)
    roof = info.get("roofline_tps_at_4.8TBps")
    for mode in a.modes:
        os.environ[stepper.MODE_ENV] = mode
        rows = bench.run_bench(
            model,
            tok,
            a.ctx,
            a.gen,
            time_budget=a.time_budget,
            log=lambda r: print(f"#   {r}", file=sys.stderr, flush=True),
        )
        for r in rows:
            tps = float(r["gen_tps"])
            pct = f"{100 * tps / roof:.1f}" if roof else ""
            print(
                f"{mode},{a.expert_format},{r['ctx_tokens']},{tps:.2f},{1e3 / tps if tps else 0:.2f},{pct}", flush=True
            )
        if a.profile:
            print(format_profile(profile_decode(model, ctx=a.ctx[0])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
