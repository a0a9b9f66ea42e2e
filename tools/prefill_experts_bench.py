"""One layer's routed experts at prefill, old path vs per-expert batched GEMMs.

    python3 tools/prefill_experts_bench.py                      # V4 Flash shapes, 2,048 tokens
    python3 tools/prefill_experts_bench.py --chunks 128,512,2048 --formats mlx2

V4 Flash shapes: 256 experts, top-6, 4096 -> 2048 (gate, up) -> 4096 (down), SwiGLU
clamp 10. Formats: `mlx2` / `mlx4` (MLX affine, group 64, bf16 scales) and `gguf`
(ds4's files: IQ2_XXS gate / up, Q2_K down, on the blocks). Random weights made on the
device (packed words / blocks directly: no float bank), bf16 activations (`--dtype`).

Per format and chunk: `grouped` (DS4MLX_PREFILL_EXPERTS=grouped: models/grouped_experts.py;
MLX affine: gather_qmm with M = cap), for MLX formats `grouped-dequant` (the same batches,
the experts dequantized in slices + cuBLAS: grouped_experts.AFFINE_VIA_DEQUANT), for `gguf`
`grouped_blocks` (the same batches multiplied on the GGUF blocks: kernels/grouped_qmm.py) and
`grouped_blocks_mma` (the same on tensor cores: grouped_qmm's mma variant), then
`gather_qmm` (today's path: one M = 1 product per (token, expert) pair), each one
SwitchGLU call evaluated and synchronised, median of `--iters` after a warm-up; ms,
TFLOP/s (2 x pairs x (4096 x 4096 + 2048 x 4096) multiply-adds), the peak memory above
the weights, and the largest difference between the two. `routing` is the grouped path's
sort + count + host sync alone. The grouped path runs first: if today's path fails (the
GGUF one has not run on a GPU at these shapes) the new figure is already printed.
Expected: well under a minute on an H200 after MLX's first-use kernel compilation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

H, INTER, EXPERTS, TOP = 4096, 2048, 256, 6  # --small: 512, 256, 16, 6 (a CPU smoke run)


def say(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def affine_bank(out_dims: int, in_dims: int, bits: int, seed: int):
    """A QuantizedSwitchLinear of random packed words, bf16 scales and biases, made 16
    experts per launch (a whole bank in one launch overflows MLX CUDA's grid)."""
    import mlx.core as mx

    from ds4mlx.models.layers import QuantizedSwitchLinear

    q = QuantizedSwitchLinear(in_dims, 128, 1, 64, bits)  # placeholder arrays, replaced below
    words, groups = in_dims * bits // 32, in_dims // 64
    parts = []
    for e0 in range(0, EXPERTS, 16):
        e = min(16, EXPERTS - e0)
        k1, k2 = mx.random.split(mx.random.key(seed * 1000 + e0))
        w = mx.random.randint(0, 256, (e, out_dims, words * 4), key=k1).astype(mx.uint8)
        s = (mx.random.uniform(0.5, 1.5, (e, out_dims, groups), key=k2) * 0.02).astype(mx.bfloat16)
        parts.append((w.view(mx.uint32).reshape(e, out_dims, words), s, (-s * ((2**bits - 1) / 2)).astype(mx.bfloat16)))
        mx.eval(parts[-1])
    q.weight, q.scales, q.biases = (mx.concatenate([p[i] for p in parts]) for i in range(3))
    mx.eval(q.weight, q.scales, q.biases)
    return q


def build(fmt: str):
    import mlx.core as mx

    from ds4mlx.io.quant import random_gguf_blocks
    from ds4mlx.models.layers import SwitchGLU
    from ds4mlx.models.quantized import GGUFSwitchLinear, SplitSwitchLinear

    glu = SwitchGLU(H, INTER, EXPERTS, limit=10.0)  # lazy placeholders, replaced below (never evaluated)
    if fmt.startswith("mlx"):
        bits = int(fmt[3:])
        glu.gate_up_proj = affine_bank(2 * INTER, H, bits, 1)
        glu.down_proj = affine_bank(H, INTER, bits, 2)
    elif fmt == "gguf":
        glu.gate_up_proj = SplitSwitchLinear(
            GGUFSwitchLinear(random_gguf_blocks("IQ2_XXS", EXPERTS, INTER, H, 1), "IQ2_XXS", H),
            GGUFSwitchLinear(random_gguf_blocks("IQ2_XXS", EXPERTS, INTER, H, 2), "IQ2_XXS", H),
        )
        glu.down_proj = GGUFSwitchLinear(random_gguf_blocks("Q2_K", EXPERTS, H, INTER, 3), "Q2_K", INTER)
    else:
        raise SystemExit(f"unknown format {fmt!r}")
    mx.eval(glu.parameters())
    return glu


def timed(fn, iters: int) -> float:
    import mlx.core as mx

    mx.eval(fn())  # warm-up: first-use kernel compilation
    mx.synchronize()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def routing_only(x, idx):
    """The grouped path's sort + count + host sync, alone."""
    import mlx.core as mx
    import numpy as np

    flat = idx.reshape(-1).astype(mx.int32)
    order = mx.argsort(flat)
    counts = mx.zeros((EXPERTS,), mx.int32).at[flat].add(1)
    np.array(counts)
    return order


def split_gguf(glu, case: dict, dtype, iters: int) -> None:
    """Where the GGUF grouped path's time goes: one slice of experts dequantized (as
    grouped_experts.sliced_per_expert does, MAX_SLICE_BYTES at a time) against the bytes
    it writes, that slice's batched GEMM alone on already dequantized weights, and the same
    product on the blocks (grouped_qmm, the grouped_blocks mode)."""
    import mlx.core as mx

    from ds4mlx.kernels import grouped_qmm, quant_moe
    from ds4mlx.models import grouped_experts

    cap = max(1, (case["chunk"] * TOP) // EXPERTS)  # the mean rows per expert
    for name, lin in (("gate", glu.gate_up_proj.gate_proj), ("down", glu.down_proj)):
        out, k = lin.weight.shape[1], lin.input_dims
        s = max(1, min(EXPERTS, grouped_experts.MAX_SLICE_BYTES // (out * k * 2)))
        ids = mx.arange(s, dtype=mx.int32)
        ms = timed(lambda: quant_moe.gather_dequantize(lin.weight, lin.qtype, ids, dtype), iters)
        gb = s * out * k * 2 / 1e9
        rd = s * lin.weight.shape[1] * lin.weight.shape[2] / 1e9
        say(
            f"  {name} {lin.qtype.name}: dequant {s} experts [{out}x{k}] {ms:.2f} ms ({gb:.2f} GB written, {rd:.2f} GB read: {(gb + rd) / ms:.0f} GB/s)"
        )
        w = quant_moe.gather_dequantize(lin.weight, lin.qtype, ids, dtype)
        x = mx.random.normal((s, cap, k)).astype(dtype)
        mx.eval(w, x)
        gms = timed(lambda: x @ w.swapaxes(1, 2), iters)
        say(
            f"  {name}: batched GEMM [{s}x{cap}x{k}] @ [{k}x{out}] {gms:.2f} ms ({2 * s * cap * k * out / gms / 1e9:.1f} TFLOP/s)"
        )
        w = None
        for mma in (False, True):
            qms = timed(lambda mma=mma: grouped_qmm.grouped_qmm(x, lin.weight, lin.qtype, ids, mma=mma), iters)
            say(
                f"  {name}: grouped_qmm{' mma' if mma else ''} on the blocks, same product, {qms:.2f} ms "
                f"({2 * s * cap * k * out / qms / 1e9:.1f} TFLOP/s; the dequant + GEMM above: {ms + gms:.2f} ms)"
            )
        x = None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", default="2048", help="tokens per chunk, comma-separated")
    p.add_argument("--formats", default="mlx2,gguf", help="mlx2, mlx4, gguf (comma-separated)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--no-old", action="store_true", help="skip today's path")
    p.add_argument("--small", action="store_true", help="small shapes (a CPU smoke run)")
    p.add_argument("--split", action="store_true", help="GGUF: the dequantization and the GEMMs timed apart")
    a = p.parse_args(argv)
    if a.small:
        global H, INTER, EXPERTS
        H, INTER, EXPERTS = 512, 256, 16

    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from ds4mlx.models import grouped_experts, prefill_experts

    prefill_experts.MIN_PAIRS = 1  # the grouped path at every chunk size asked for
    dtype = getattr(mx, a.dtype)
    say(f"mlx {mx.__version__}, {mx.default_device()}, activations {a.dtype}")

    def run(glu, case: dict, mode: str) -> None:
        """Time one path on one chunk; keep its output for the comparison."""
        os.environ[prefill_experts.ENV] = mode.split("-")[0]
        grouped_experts.AFFINE_VIA_DEQUANT = mode == "grouped-dequant"
        x, idx = case["x"], case["idx"]
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        try:
            ms = timed(lambda: glu(x, idx), a.iters)
            out = glu(x, idx).astype(mx.float32)
            mx.eval(out)
        except Exception as e:  # noqa: BLE001 - report and go on to the next case
            say(f"  chunk {case['chunk']} {mode}: FAILED {type(e).__name__}: {e}")
            return
        finally:
            grouped_experts.AFFINE_VIA_DEQUANT = False
        peak = (mx.get_peak_memory() - base) / 2**30
        case["outs"][mode] = out
        say(
            f"  chunk {case['chunk']:5d} {mode:18s} {ms:9.2f} ms  {case['flop'] / ms / 1e9:7.2f} TFLOP/s"
            f"  peak +{peak:.2f} GiB"
        )

    for fmt in a.formats.split(","):
        glu = build(fmt)
        wbytes = sum(v.nbytes for _, v in tree_flatten(glu.parameters()))
        say(f"{fmt}: {wbytes / 2**30:.2f} GiB of expert weights")
        cases = []
        for chunk in (int(c) for c in a.chunks.split(",")):
            x = (mx.random.normal((1, chunk, H), key=mx.random.key(chunk)) * 0.5).astype(dtype)
            scores = mx.random.normal((1, chunk, EXPERTS), key=mx.random.key(chunk + 1))
            idx = mx.argpartition(-scores, kth=TOP - 1, axis=-1)[..., :TOP].astype(mx.int32)
            mx.eval(x, idx)
            pairs = chunk * TOP
            counts = np.bincount(np.array(idx).reshape(-1), minlength=EXPERTS)
            lay = grouped_experts.layout(counts)
            say(
                f"  chunk {chunk}: {pairs} pairs, experts used {int((counts > 0).sum())}, max count "
                f"{counts.max()}, cap {lay.cap}, batches {lay.batches}, padded rows {lay.batches * lay.cap}; "
                f"routing (sort + count + host sync) {timed(lambda: routing_only(x, idx), a.iters):.2f} ms"
            )
            flop = 2.0 * pairs * (H * 2 * INTER + INTER * H)
            cases.append({"chunk": chunk, "x": x, "idx": idx, "flop": flop, "outs": {}})
        if a.split and fmt == "gguf":
            split_gguf(glu, cases[-1], dtype, a.iters)
        modes = ["grouped"] + (
            ["grouped-dequant"] if fmt.startswith("mlx") else ["grouped_blocks", "grouped_blocks_mma"]
        )
        for case in cases:  # the new paths first, every chunk: today's may fail (GGUF untried here)
            for mode in modes:
                run(glu, case, mode)
        for case in [] if a.no_old else cases:
            run(glu, case, "gather_qmm")
            outs = case["outs"]
            if "gather_qmm" in outs:
                m = mx.abs(outs["gather_qmm"]).max().item()
                for mode in (k for k in modes if k in outs):
                    d = mx.abs(outs[mode] - outs["gather_qmm"]).max().item()
                    say(f"  chunk {case['chunk']:5d} max |{mode} - gather_qmm| = {d:.3g} (max |out| {m:.3g})")
        glu = cases = None  # free the bank before the next format's
        mx.clear_cache()
    os.environ.pop(prefill_experts.ENV, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
