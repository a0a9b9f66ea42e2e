"""Where the compiled decode step's time goes, on the device.

    MLX_PTX_CACHE_DIR=$PWD/.ptxcache python3 tools/decode_probe.py --count-layers 6 --layers 43 --ctx 2048

1. Launch count of the compiled step by primitive on a small full-shape model (the graph
   MLX replays; the first step also compiles every fused kernel: minutes on a fresh machine
   unless the PTX cache travels with the run).
2. On the full model: per step, host time to build the step's lazy graph (the compiled
   function's replay + cache commit), host time of `mx.async_eval` (kernel dispatch), and
   the wait for the device; then the decode loop's pipelined t/s.  Host-bound when build +
   dispatch is near the step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import mlx.core as mx

from ds4mlx.bench.decode_profile import count_launches
from ds4mlx.bench.synthetic import build_synthetic_v4_flash
from ds4mlx.runtime import stepper
from ds4mlx.runtime.decode import decode_tokens, greedy


def say(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def prompt(n, vocab):
    return [(7 * i + 11) % vocab for i in range(n)]


def split_timing(session, steps: int) -> dict:
    """Synchronous steps: host build / dispatch / device wait per step (ms)."""
    build, disp, wait = [], [], []
    tok = mx.array(5, mx.int32)
    for _ in range(steps):
        t0 = time.perf_counter()
        lg = session.step(tok)
        nxt = mx.argmax(lg).astype(mx.int32)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        mx.eval(nxt)
        t3 = time.perf_counter()
        build.append(1e3 * (t1 - t0))
        disp.append(1e3 * (t2 - t1))
        wait.append(1e3 * (t3 - t2))
        tok = nxt
    med = statistics.median
    return {
        "build_ms": med(build),
        "dispatch_ms": med(disp),
        "wait_ms": med(wait),
        "total_ms": med([a + b + c for a, b, c in zip(build, disp, wait)]),
    }


def loop_tps(session, vocab, n: int) -> float:
    logits = session.step(5)
    mx.eval(logits)
    t0 = time.perf_counter()
    k = 0
    for _ in decode_tokens(session, logits, greedy(vocab), limit=n):
        k += 1
    return k / (time.perf_counter() - t0)


def check_attend_at() -> None:
    """The step attention's GPU face against its reference face (V4 Flash shapes, bf16)."""
    from ds4mlx.kernels import sparse_attention as sa

    face = sa.step_face()
    for cap, k, ratio, pos in ((16, None, 128, 2047), (512, None, 4, 1500), (1024, 512, 4, 4000), (1024, 512, 4, 700)):
        q = mx.random.normal((64, 1, 512)).astype(mx.bfloat16)
        ring = mx.random.normal((128, 512)).astype(mx.bfloat16)
        rows = mx.random.normal((cap, 512)).astype(mx.bfloat16)
        sinks = mx.random.normal((64,))
        p = mx.array(pos, mx.int32)
        idx = cnt = None
        if k:
            live = (pos + 1) // ratio
            idx = (mx.random.permutation(min(live, cap))[:k] if live >= k else mx.arange(k)).astype(mx.int32)[None]
            cnt = mx.array([min(live, k)], mx.int32)
        out = [
            sa.attend_at(q, ring, rows, idx, cnt, sinks, p, ratio=ratio, scale=512**-0.5, backend=f)
            for f in (face, "reference")
        ]
        d = mx.abs(out[0].astype(mx.float32) - out[1].astype(mx.float32)).max().item()
        say(f"attend_at {face} vs reference: cap {cap} topk {k} ratio {ratio} pos {pos}: max |diff| {d:.3g}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--count-layers", type=int, default=6)
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--expert-format", default="mlx")
    p.add_argument("--modes", nargs="+", default=["compiled"])
    p.add_argument("--check-kernel", action="store_true", help="attend_at's GPU face vs its reference")
    p.add_argument("--check-plain", action="store_true", help="also the step with DS4MLX_SPARSE_ATTENTION=0; compare")
    a = p.parse_args()
    say("device", mx.default_device(), mx.__version__, "ptx cache", os.environ.get("MLX_PTX_CACHE_DIR"))
    if a.check_kernel:
        check_attend_at()
    if a.count_layers:
        model, tok, info = build_synthetic_v4_flash(layers=a.count_layers, expert_format=a.expert_format)
        vocab = model.model.args.vocab_size
        s = model.new_session(ctx=1024, chunk=512)
        s.prefill(prompt(600, vocab))
        for mode in a.modes:
            os.environ[stepper.MODE_ENV] = mode
            t0 = time.time()
            c = count_launches(s, 5)
            say(
                f"{mode}: {c['total']} launches per token on {a.count_layers} layers "
                f"({c['total'] / a.count_layers:.1f} per layer), first step + count {time.time() - t0:.1f} s"
            )
            say("  by primitive:", ", ".join(f"{k}={v}" for k, v in list(c["kinds"].items())[:40]))
        del model, s
        mx.clear_cache()
    if not a.layers:
        return 0
    t0 = time.time()
    model, tok, info = build_synthetic_v4_flash(layers=a.layers, expert_format=a.expert_format)
    vocab = model.model.args.vocab_size
    say("built", info, f"{time.time() - t0:.1f} s")
    s = model.new_session(ctx=a.ctx + 256, chunk=512)
    t0 = time.time()
    s.prefill(prompt(a.ctx, vocab))
    mx.eval(s.cache_arrays)
    say(f"prefill {a.ctx} tokens: {a.ctx / (time.time() - t0):.1f} t/s")
    snap = s.snapshot()
    runs = [(m, None) for m in a.modes]
    if a.check_plain:  # the same compiled step with its attention as the plain graph, then compare
        runs.append(("compiled", "0"))
    first_logits = {}
    for mode, sparse in runs:
        os.environ[stepper.MODE_ENV] = mode
        if sparse is not None:
            os.environ["DS4MLX_SPARSE_ATTENTION"] = sparse
            stepper.forget(model.model)
            mode = f"{mode} (DS4MLX_SPARSE_ATTENTION={sparse})"
        s.restore(snap)
        t0 = time.time()
        lg = s.step(5)
        mx.eval(lg)
        say(f"{mode}: first step {time.time() - t0:.1f} s")
        seq = [lg.astype(mx.float32)]
        for t in (17, 23, 99):
            seq.append(s.step(t).astype(mx.float32))
        mx.eval(seq)
        first_logits[mode] = seq
        s.restore(snap)
        sp = split_timing(s, a.steps)
        say(
            f"{mode}: synchronous step {sp['total_ms']:.2f} ms = build {sp['build_ms']:.2f} + dispatch "
            f"{sp['dispatch_ms']:.2f} + device wait {sp['wait_ms']:.2f} (medians)"
        )
        s.restore(snap)
        tps = loop_tps(s, vocab, a.gen)
        say(f"{mode}: decode loop {tps:.2f} t/s ({1e3 / tps:.1f} ms/token) at ctx {a.ctx}")
    names = list(first_logits)
    for other in names[1:]:
        d = max(mx.abs(x - y).max().item() for x, y in zip(first_logits[names[0]], first_logits[other]))
        scale = max(mx.abs(x).max().item() for x in first_logits[names[0]])
        say(f"logits of 4 steps from one snapshot: {names[0]} vs {other}: max |diff| {d:.3g} (max |logit| {scale:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
