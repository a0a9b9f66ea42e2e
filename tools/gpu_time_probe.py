"""Device time vs host time of the compiled decode step, kernel by kernel.

    python3 tools/gpu_time_probe.py --layers 8 --ctx 2048 --steps 10

The decode step was read as host-bound from its host timings alone (build + dispatch ~=
step time).  This measures the other side: PyTorch's profiler (CUPTI) records every
kernel the process runs, MLX's included, so the GPU's busy time per step and the
kernels that fill it are known.  Also: how a custom kernel's host cost depends on the
length of its source (MLX hashes the whole source on every launch).
"""

from __future__ import annotations

import argparse
import statistics
import time


def say(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def source_length_probe(n_ops: int = 400) -> None:
    """Host µs per launch of a chain of custom kernels, short source vs padded to 16 KB."""
    import mlx.core as mx

    body = "unsigned int i = threadIdx.x + blockIdx.x * blockDim.x; if (i < 1024) out[i] = inp[i] * 1.0001f + 1.0f;"
    for pad in (0, 16000):
        k = mx.fast.cuda_kernel(
            name=f"probe_chain_{pad}",
            input_names=["inp"],
            output_names=["out"],
            header="// " + "x" * pad + "\n",
            source=body,
        )

        def chain(x):
            for _ in range(n_ops):
                x = k(
                    inputs=[x],
                    output_shapes=[x.shape],
                    output_dtypes=[x.dtype],
                    grid=(x.size, 1, 1),
                    threadgroup=(256, 1, 1),
                )[0]
            return x

        f = mx.compile(chain)
        x = mx.ones((1024,), mx.float32)
        mx.eval(f(x))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            mx.eval(f(x))
            ts.append(time.perf_counter() - t0)
        say(f"custom-kernel chain, source padded by {pad} B: {1e6 * min(ts) / n_ops:.2f} µs per launch")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--expert-format", default="mlx")
    p.add_argument("--top", type=int, default=45)
    a = p.parse_args()

    import mlx.core as mx
    import torch

    from ds4mlx.bench.gpu_timer import kernel_times
    from ds4mlx.bench.synthetic import build_synthetic_v4_flash

    say("mlx", mx.__version__, mx.default_device(), "torch", torch.__version__)
    source_length_probe()
    t0 = time.time()
    model, _, info = build_synthetic_v4_flash(layers=a.layers, expert_format=a.expert_format)
    vocab = model.model.args.vocab_size
    say("built", a.layers, "layers", f"{time.time() - t0:.1f} s")
    s = model.new_session(ctx=a.ctx + 256, chunk=2048)
    t0 = time.time()
    s.prefill([(7 * i + 11) % vocab for i in range(a.ctx)])
    say(f"prefill {a.ctx}: {time.time() - t0:.1f} s")
    tok = mx.array(5, mx.int32)
    for _ in range(3):  # compile + warm
        mx.eval(s.step(tok))
    walls, builds = [], []

    def steps():
        for _ in range(a.steps):
            t0 = time.perf_counter()
            lg = s.step(tok)
            t1 = time.perf_counter()
            mx.eval(lg)
            t2 = time.perf_counter()
            builds.append(1e3 * (t1 - t0))
            walls.append(1e3 * (t2 - t0))

    _, per = kernel_times(steps)
    busy = sum(t for _, t in per.values())
    n = sum(c for c, _ in per.values())
    st = a.steps
    say(
        f"{a.layers} layers, ctx {a.ctx}: synchronous step {statistics.median(walls):.2f} ms wall "
        f"(build {statistics.median(builds):.2f} ms); GPU busy {busy / 1e3 / st:.2f} ms per step; "
        f"{n / st:.0f} kernels per step ({n / st / a.layers:.1f} per layer)"
    )
    say("kernels by GPU time per step (µs, count per step):")
    for k, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"  {t / st:9.1f} µs  x{c / st:6.1f}  {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
