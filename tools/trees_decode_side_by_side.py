"""CPU decode of a family's demo in two source trees, side by side in one run.

    python tools/trees_decode_side_by_side.py --before /tmp/main-tree --after . \\
        [--family deepseek_v4] [--tokens 192] [--prompt 64] [--rounds 6] [--modes compiled legacy]

Each (round, mode, tree) is a fresh process importing ds4mlx from that tree (a `git worktree`
of the previous commit, read-only, is the usual "before"); the trees alternate ABBA so neither
always runs first.  A process loads the demo, prefills a fixed prompt, takes four steps (the
first step's check and the trace), then times `--tokens` greedy steps.  Printed per run and as
medians: wall tokens/s and the process's CPU ms per token (less sensitive to other work on a
shared machine than the wall time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def child(family: str, mode: str, tokens: int, prompt_len: int) -> None:
    import mlx.core as mx

    import ds4mlx
    from ds4mlx.runtime import stepper

    os.environ[stepper.MODE_ENV] = mode
    lm, _ = ds4mlx.load("demo" if family == "deepseek_v4" else f"demo:{family}")
    prompt = [11 + (i * 7) % 500 for i in range(prompt_len)]
    s = lm.new_session(ctx=prompt_len + tokens + 8)
    y = mx.argmax(mx.array(s.prefill(prompt)))
    for _ in range(4):
        y = mx.argmax(s.step(y))
    mx.eval(y)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(tokens):
        y = mx.argmax(s.step(y))
        mx.async_eval(y)
    mx.eval(y)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"{tokens / wall:.3f} {1e3 * cpu / tokens:.3f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--before", help="the tree to compare against (required)")
    p.add_argument("--after", default=".")
    p.add_argument("--family", default="deepseek_v4")
    p.add_argument("--tokens", type=int, default=192)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--modes", nargs="+", default=["compiled"])
    p.add_argument("--child", nargs=2, metavar=("FAMILY", "MODE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.tokens, a.prompt)
        return 0
    if not a.before:
        p.error("--before is required")
    trees = [("before", os.path.abspath(a.before)), ("after", os.path.abspath(a.after))]
    me = os.path.abspath(__file__)
    got: dict = {}
    print("round,mode,tree,tok_s,cpu_ms_per_token", flush=True)
    for r in range(a.rounds):
        for mode in a.modes:
            for name, root in trees if r % 2 == 0 else trees[::-1]:
                argv = [sys.executable, me, "--child", a.family, mode, "--tokens", str(a.tokens)]
                argv += ["--prompt", str(a.prompt)]
                env = {**os.environ, "PYTHONPATH": root}
                out = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
                if out.returncode:
                    print(f"# {name} {mode} failed: {out.stderr.strip()[-400:]}", file=sys.stderr)
                    continue
                tps, cpu = (float(v) for v in out.stdout.split()[-2:])
                got.setdefault((mode, name), []).append((tps, cpu))
                print(f"{r},{mode},{name},{tps:.2f},{cpu:.2f}", flush=True)
    for (mode, name), runs in sorted(got.items()):
        tps = statistics.median(t for t, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"# {mode} {name}: median {tps:.2f} tok/s, {cpu:.2f} cpu ms/token over {len(runs)} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
