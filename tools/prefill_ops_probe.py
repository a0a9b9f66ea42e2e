"""Where a V4 Flash prefill chunk's attention time goes, op by op, on the GPU.

    python3 tools/prefill_ops_probe.py [--chunk 2048]

The 2026-12-02 prefill profile put 49 % of a 2,048-token chunk in the attention family
(26 ms per layer): the dense 8-bit projections (q_a, q_b, kv, o_a, o_b) and the banded
SDPA with sinks and a mask.  Each op alone, median of a few synchronised runs, bf16:
  * `mx.quantized_matmul` (8-bit, group 64) vs `mx.dequantize` + matmul vs a bf16 matmul
  * the banded SDPA (blocks of 128 queries over W + 128 + N keys, head dim 512, 64 heads)
    with mask + sinks, without sinks, without the mask; the per-query SDPA of CSA past
    index_topk (one query per batch row over its 640 keys).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx


def timed(fn, iters=5) -> float:
    mx.eval(fn())
    mx.synchronize()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def linears(m: int) -> None:
    for name, out_d, in_d in (("q_a", 1024, 4096), ("q_b", 32768, 1024), ("o_b", 4096, 8192), ("kv", 512, 4096)):
        x = mx.random.normal((m, in_d)).astype(mx.bfloat16)
        w = mx.random.normal((out_d, in_d)).astype(mx.bfloat16) * 0.02
        wq, s, b = mx.quantize(w, group_size=64, bits=8)
        mx.eval(x, w, wq, s, b)
        flop = 2 * m * out_d * in_d
        t_q = timed(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=8))
        t_d = timed(lambda: x @ mx.dequantize(wq, s, b, group_size=64, bits=8, dtype=mx.bfloat16).T)
        t_b = timed(lambda: x @ w.T)
        print(
            f"{name} [{m}x{in_d}] @ [{in_d}x{out_d}]: quantized_matmul {t_q:.3f} ms ({flop / t_q / 1e9:.0f} TFLOP/s), "
            f"dequantize + matmul {t_d:.3f} ms, bf16 matmul {t_b:.3f} ms ({flop / t_b / 1e9:.0f} TFLOP/s)",
            flush=True,
        )


def attention(m: int, n_comp: int) -> None:
    nh, d, w, blk = 64, 512, 128, 128
    nb = m // blk
    lk = w + blk + n_comp
    q = (mx.random.normal((nb, nh, blk, d)) * 0.1).astype(mx.bfloat16)
    k = (mx.random.normal((nb, 1, lk, d)) * 0.1).astype(mx.bfloat16)
    mask = mx.random.uniform(shape=(nb, 1, blk, lk)) > 0.3
    sinks = mx.zeros((nh,), mx.bfloat16)
    mx.eval(q, k, mask, sinks)
    sc = d**-0.5
    flop = 4 * nb * nh * blk * lk * d
    for label, kw in (
        ("mask + sinks", dict(mask=mask, sinks=sinks)),
        ("mask", dict(mask=mask)),
        ("sinks", dict(sinks=sinks)),
        ("plain", {}),
    ):
        t = timed(lambda kw=kw: mx.fast.scaled_dot_product_attention(q, k, k, scale=sc, **kw))
        print(
            f"banded SDPA {nb}x[{nh}x{blk}] over {lk} keys, d {d}, {label}: {t:.3f} ms ({flop / t / 1e9:.1f} TFLOP/s)",
            flush=True,
        )

    # the same by hand: two batched matmuls and a softmax (what a fallback would do)
    def by_hand():
        s = (q @ k.swapaxes(-1, -2)) * sc
        s = mx.where(mask, s, -1e9)
        return mx.softmax(s.astype(mx.float32), axis=-1).astype(mx.bfloat16) @ k

    t = timed(by_hand)
    print(f"banded by hand (matmul, where, softmax f32, matmul): {t:.3f} ms ({flop / t / 1e9:.1f} TFLOP/s)", flush=True)
    n = 512
    qp = (mx.random.normal((n, nh, 1, d)) * 0.1).astype(mx.bfloat16)
    kp = (mx.random.normal((n, 1, 640, d)) * 0.1).astype(mx.bfloat16)
    mp = mx.random.uniform(shape=(n, 1, 1, 640)) > 0.1
    mx.eval(qp, kp, mp)
    t = timed(lambda: mx.fast.scaled_dot_product_attention(qp, kp, kp, scale=sc, mask=mp, sinks=sinks))
    print(
        f"per-query SDPA {n} queries x {nh} heads over 640 keys: {t:.3f} ms ({n * 640 * d * 2 / t / 1e6:.0f} GB/s of keys)",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--n-comp", type=int, default=512)
    a = p.parse_args()
    print(f"mlx {mx.__version__} {mx.default_device()}", flush=True)
    linears(a.chunk)
    attention(a.chunk, a.n_comp)


if __name__ == "__main__":
    main()
