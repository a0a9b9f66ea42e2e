"""Decode and prefill of the synthetic V4 Flash on the device, frontier by frontier.

    python3 tools/frontier_probe.py --label new --expert-format mlx --ctx 2048 32768 --gpu-busy

One model build; for each context (ascending) the prompt is prefilled up to it (the
segment's prefill t/s), then from one snapshot: the synchronous step split (host build,
dispatch, device wait), the pipelined decode loop's t/s, and (first context, --gpu-busy)
the GPU's busy time per step and its kernel count from PyTorch's CUPTI profiler.  One
CSV row per context, so the same script run over an older tree (PYTHONPATH) compares.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_probe import loop_tps, split_timing  # noqa: E402

from ds4mlx.bench.synthetic import build_synthetic_v4_flash  # noqa: E402


def say(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def fast_forward(session, ctx: int) -> None:
    """Put every layer cache at position `ctx` with random contents (V4 layout): what the
    decode step reads and writes there has the same shapes and row counts as after a real
    prefill, so its speed is the same; used where prefilling 32K tokens would take longer
    than the device session (GGUF experts).  The values are meaningless."""
    key = mx.random.key(ctx)
    ctx -= 1  # the last position goes through the model below (the session then has logits)
    for c in session.caches:
        dt, d = mx.bfloat16, c.head_dim
        meta, arrays = {"type": c.layer_type, "offset": ctx, "window": c.window}, {}
        arrays["ring"] = mx.random.normal((1, 1, c.window, d), key=key).astype(dt)
        for name, st in (("comp", c.comp), ("index", c.index)):
            if st is None:
                continue
            n, w = ctx // st.ratio, 2 if st.overlap else 1
            meta[name] = {"n": n, "cap": max(n + 1, 256), "ratio": st.ratio}
            arrays[f"{name}.buf_kv"] = mx.random.normal((1, st.ratio, w * st.dim), key=key).astype(dt)
            arrays[f"{name}.buf_gate"] = mx.random.normal((1, st.ratio, w * st.dim), key=key).astype(dt)
            arrays[f"{name}.rows"] = mx.random.normal((1, n, st.dim), key=key).astype(dt)
            if st.overlap:
                arrays[f"{name}.ov_kv"] = mx.random.normal((1, st.ratio, st.dim), key=key).astype(dt)
                arrays[f"{name}.ov_gate"] = mx.random.normal((1, st.ratio, st.dim), key=key).astype(dt)
        c.load(meta, arrays)
    session._tokens = [11] * ctx  # a tool's shortcut: the session's length is its position
    mx.eval(session.cache_arrays())
    mx.eval(session.step(11))


def gpu_busy(session, steps: int, top: int = 0) -> tuple[float, float, float]:
    """(GPU busy ms per step, kernels per step, wall ms per synchronous step); prints the
    `top` kernels by GPU time per step."""
    from ds4mlx.bench.gpu_timer import kernel_times

    tok = mx.array(5, mx.int32)
    snap = session.snapshot()
    # one untimed step first: sessions 6 and 7 counted 84 copy_gg_nd of 4-D bfloat16 arrays in
    # the 8 profiled steps (3 ms a step on average), most likely the first step after the
    # restore copying the restored cache arrays once; the decode loop does not restore
    mx.eval(session.step(tok))
    walls = []

    def run():
        for _ in range(steps):
            t0 = time.perf_counter()
            mx.eval(session.step(tok))
            walls.append(1e3 * (time.perf_counter() - t0))

    _, per = kernel_times(run)
    session.restore(snap)
    busy, n = sum(t for _, t in per.values()), sum(c for c, _ in per.values())
    for name, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {t / steps:9.1f} us  x{c / steps:6.1f}  {name}", flush=True)
    return busy / 1e3 / steps, n / steps, statistics.median(walls)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--label", default="tree")
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--expert-format", default="mlx")
    p.add_argument("--ctx", type=int, nargs="+", default=[2048, 32768])
    p.add_argument("--gen", type=int, default=48)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warm", type=int, default=24, help="untimed decode tokens before each context's timing")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--gpu-busy", action="store_true")
    p.add_argument("--top", type=int, default=0, help="with --gpu-busy: list this many kernels")
    p.add_argument("--no-decode", action="store_true", help="prefill only")
    p.add_argument("--fake-context", action="store_true", help="jump the caches to each context (no prefill)")
    p.add_argument("--tiny", action="store_true", help="narrow shapes and 16 experts (a CPU smoke run)")
    p.add_argument(
        "--descending",
        action="store_true",
        help="largest context first (with --fake-context): is 2K slower than 32K because it runs first?",
    )
    a = p.parse_args()
    t0 = time.time()
    tiny = dict(hidden_size=256, num_attention_heads=4, head_dim=64, partial_rotary_factor=0.5, q_lora_rank=64)
    tiny.update(o_groups=2, o_lora_rank=64, moe_intermediate_size=256, index_n_heads=4, index_head_dim=32)
    model, _, info = build_synthetic_v4_flash(
        layers=a.layers,
        expert_format=a.expert_format,
        experts=16 if a.tiny else None,
        overrides=dict(tiny, index_topk=8) if a.tiny else None,
    )
    vocab = model.model.args.vocab_size
    roof = info.get("roofline_tps_at_4.8TBps") or 0.0
    say(f"{a.label}: built {a.layers} layers, experts {a.expert_format} in {time.time() - t0:.1f} s; {info}")
    prompt = [(7 * i + 11) % vocab for i in range(max(a.ctx))]
    if not a.fake_context:  # MLX compiles every kernel at first use (minutes on a fresh machine): not timed
        t0 = time.time()
        warm = model.new_session(ctx=2 * a.chunk, chunk=a.chunk)
        warm.prefill(prompt[: 2 * a.chunk])
        del warm
        say(f"{a.label}: warm-up prefill of two chunks {time.time() - t0:.1f} s")
    s = model.new_session(ctx=max(a.ctx) + a.gen + 64, chunk=a.chunk)
    done = 0
    print(
        "label,expert_format,ctx,prefill_tps,decode_tps,ms_per_token,build_ms,dispatch_ms,wait_ms,roofline_pct",
        flush=True,
    )
    for ctx in sorted(a.ctx, reverse=a.descending):
        t0 = time.time()
        if a.fake_context:
            fast_forward(s, ctx)
            pf = 0.0
        else:
            s.prefill(prompt[done:ctx])
            mx.eval(s.cache_arrays())
            pf = (ctx - done) / (time.time() - t0)
        done = ctx
        say(
            f"{a.label}: {'jumped' if a.fake_context else 'prefilled'} to {ctx}: {pf:.1f} t/s, {time.time() - t0:.1f} s"
        )
        if a.no_decode:
            print(f"{a.label},{a.expert_format},{ctx},{pf:.1f},,,,,,", flush=True)
            continue
        snap = s.snapshot()
        t0 = time.time()
        mx.eval(s.step(5))
        say(f"{a.label}: first step at {ctx}: {time.time() - t0:.1f} s")
        # every restore is materialised before anything is timed: its arrays are lazy (the
        # session-6 profile counted their copies, 84 copy_gg_nd, inside the first timed step)
        back = lambda: (s.restore(snap), mx.eval(s.cache_arrays()))  # noqa: E731
        back()
        loop_tps(s, vocab, a.warm)  # untimed: MLX's allocator and caches settle (the first
        back()  # context measured slower than 32K in session 6)
        sp = split_timing(s, a.steps)
        back()
        tps = loop_tps(s, vocab, a.gen)
        back()
        print(
            f"{a.label},{a.expert_format},{ctx},{pf:.1f},{tps:.2f},{1e3 / tps:.2f},{sp['build_ms']:.2f},"
            f"{sp['dispatch_ms']:.2f},{sp['wait_ms']:.2f},{100 * tps / roof if roof else 0:.1f}",
            flush=True,
        )
        if a.gpu_busy and ctx == min(a.ctx):  # (with --descending: the last context)
            busy, kern, wall = gpu_busy(s, a.steps, a.top)
            say(
                f"{a.label}: GPU busy {busy:.2f} ms per step, {kern:.0f} kernels per step "
                f"({kern / a.layers:.1f} per layer), synchronous wall {wall:.2f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
