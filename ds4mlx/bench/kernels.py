"""Micro-benchmark of the custom kernels against the plain MLX graph (run on a GPU).

    python -m ds4mlx.bench.kernels [--layers 8] [--ctx 2560] [--gen 16] [--no-model]
                                           [--qmoe] [--expert-format mlx|gguf]
                                           [--qmv [--qmv-decode-only]] [--qmv-sweep] [--json FILE]

Prints, at DeepSeek V4 Flash shapes (hidden 4096, hc_mult 4, 64 heads x 512, indexer
64 heads x 128, index_topk 512, window 128):

* microseconds per call, plain graph vs kernel, for hc_pre / hc_post (decode and a
  512-token chunk), indexer scores + top-k, and the CSA / HCA attention core; each
  figure twice: ``sync`` (build, launch and wait, one call at a time: what a decode
  step pays when nothing overlaps) and ``batched`` (16 independent calls per
  ``mx.eval``: launch + GPU time, graph building amortised);
* the V4 Flash MoE router, compiled: the plain graph vs MLX's mat-vec + `moe_route`
  and (CUDA) the one launch with the mat-vec folded in;
* one compressor decode step (``--compressor`` alone): the compiled MLX graph vs the
  one-launch kernel (kernels/compressor_step.py) for the CSA attention and indexer
  compressors and HCA's, at a few row capacities;
* the decode step's attention kernels at 2K and 32K context, previous vs current launch
  (``--attn`` runs only these): attn_prep vs the graph it replaces, index_score's rows vs
  heads layout, attend one threadgroup per head + a separate rope vs split keys + the rope
  epilogue (and each split count);
* one CSA attention layer (random weights, 8-bit linears) decoding at --ctx, kernels
  on vs off;
* with ``--qmoe``: GB/s of the quantized-MoE decode mat-vec per GGUF type (IQ2_XXS,
  Q2_K, Q4_K, Q8_0) vs MLX's ``gather_qmm`` at the nearest affine bit width;
* the synthetic V4 Flash model (``ds4mlx bench --synthetic v4-flash --layers N``)
  prefill and decode tokens/s with the kernels on and with ``DS4MLX_KERNELS=reference``;
  ``--expert-format gguf`` gives it ds4's IQ2_XXS / Q2_K expert blocks.

* with ``--qmv``: first V4 Flash's decode-step calls (the MoE gate_up + SwiGLU and
  down + sum, the 8-bit dense projections, wo_a's grouped call): kernel GPU µs and GB/s
  (CUPTI through torch.profiler when torch is installed) beside the µs the pre-v3 kernel
  took in the compiled step (a recorded column; docs/bench-history.md), the dependent
  chain's wall µs per call, one call's latency, the error against MLX; ``--qmv-decode-only`` stops there,
  ``--qmv-sweep`` times `affine_qmv.plan`'s knob variants on those calls.  Then
  a dependent chain of mat-vecs (each call's output is the next
  call's input, weights rotated through a set larger than L2): GB/s for MLX affine
  2 / 4 / 8-bit, ours (`affine_qmv`) vs ``mx.quantized_matmul``, at 4096x4096 and
  8192x8192, 32 experts of 4096x4096 in one launch, the V4 Flash routed-MoE call
  (6 of 256 experts, gate_up + SwiGLU, down + weighted sum) ours vs the
  gather_qmm graph, and the GGUF types (quant_moe) as a dense 4096x4096 chain and
  as the MoE call.

Kernels on / off is `ds4mlx.kernels.dispatch.use_face` ('reference' for off), so
one process measures both; the micro-benchmarks pass the face explicitly.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from ds4mlx.bench.clock import synced_seconds
from ds4mlx.kernels import dispatch
from ds4mlx.kernels import hyper_connection as hck
from ds4mlx.kernels import sparse_attention as sa

BATCH = 16


def kernels(on: bool):
    """Kernels on (each launch picks its face by device, as the models do) or off (the
    pure-MLX reference) for a block; DS4MLX_KERNELS is ignored inside."""
    return dispatch.use_face(None if on else "reference")


def timed(fn, iters: int) -> tuple[float, float]:
    """(sync µs/call, batched µs/call) of fn() -> array(s)."""
    sync = synced_seconds(fn, iters) * 1e6
    reps = max(1, iters // BATCH)
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval([fn() for _ in range(BATCH)])
    mx.synchronize()
    batched = (time.perf_counter() - t0) / (reps * BATCH) * 1e6
    return sync, batched


def row(name: str, plain, kern):
    print(
        f"  {name:44s} plain {plain[0]:9.1f} / {plain[1]:9.1f} µs   kernel {kern[0]:8.1f} / {kern[1]:8.1f} µs"
        f"   x{plain[0] / max(kern[0], 1e-9):6.1f}",
        flush=True,
    )


def bench_hc(iters: int):
    from ds4mlx.kernels import hyper_connection_reference as reference

    n, d = 4, 4096
    k = (2 + n) * n
    print("hyper-connections (sync / batched):")
    for nt, wdt in ((1, mx.bfloat16), (1, mx.float32), (512, mx.bfloat16)):
        x = (mx.random.normal((1, nt, n, d)) * 0.5).astype(mx.bfloat16)
        fn = (mx.random.normal((k, n * d)) * (n * d) ** -0.5).astype(wdt)
        base, scale = mx.random.normal((k,)) * 0.1, mx.array([0.5, 1.0, 2.0])
        kw = dict(sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
        mx.eval(x, fn, base, scale)
        plain = timed(lambda: reference.hc_pre(x, fn, base, scale, **kw), iters)
        kern = timed(lambda: hck.hc_pre(x, fn, base, scale, **kw, backend=dispatch.gpu_backend()), iters)
        row(f"hc_pre  T={nt} fn {'bf16' if wdt == mx.bfloat16 else 'f32'}", plain, kern)
        post, comb, coll = hck.hc_pre(x, fn, base, scale, **kw)
        mx.eval(post, comb, coll)
        plain = timed(lambda: reference.hc_post(x, coll, post, comb), iters)
        kern = timed(lambda: hck.hc_post(x, coll, post, comb, backend=dispatch.gpu_backend()), iters)
        row(f"hc_post T={nt}", plain, kern)


def bench_sparse(iters: int):
    from ds4mlx.models.layers import topk_indices

    face = dispatch.gpu_backend()
    nh, d, nhi, di, w, topk = 64, 512, 64, 128, 128, 512
    print("CSA indexer + top-k, attention core (sync / batched):")
    for n in (2048, 16384):
        s = 4 * n + 3
        q = mx.random.normal((nhi, 1, di)).astype(mx.bfloat16)
        wt = mx.random.normal((1, nhi)).astype(mx.bfloat16)
        keys = mx.random.normal((n, di)).astype(mx.bfloat16)
        mx.eval(q, wt, keys)
        scale = nhi**-0.5 * di**-0.5

        def plain_index():
            kT = keys.astype(mx.float32).T
            sc = (wt.astype(mx.float32) * scale) @ mx.maximum(q.astype(mx.float32)[:, 0] @ kT, 0.0)
            return topk_indices(sc[0], topk)

        def kern_index():
            sc = sa.index_scores(q, wt, keys, n=n, s=s, ratio=4, scale=scale, backend=face)
            return sa.topk_select(sc, topk, s=s, ratio=4, backend=face)

        row(f"indexer scores + top-{topk}, {n} rows", timed(plain_index, iters), timed(kern_index, iters))
    for kind, n, sel in (("CSA", 4096, True), ("HCA", 128, False)):
        s = 4 * n + 3 if sel else 128 * n + 3
        q = mx.random.normal((1, nh, 1, d)).astype(mx.bfloat16)
        ring = mx.random.normal((1, 1, w, d)).astype(mx.bfloat16)
        rows = mx.random.normal((1, n, d)).astype(mx.bfloat16)
        sinks = mx.random.normal((nh,)).astype(mx.bfloat16)
        idx = mx.sort(mx.random.permutation(n)[:topk]).astype(mx.int32)[None] if sel else None
        cnt = mx.array([topk], mx.int32) if sel else None
        mx.eval(q, ring, rows, sinks, *(a for a in (idx, cnt) if a is not None))

        def plain_attn():
            chosen = mx.take(rows, idx[0], axis=1)[:, None] if sel else rows[:, None]
            keys = mx.concatenate([ring, chosen], axis=2)
            return mx.fast.scaled_dot_product_attention(q, keys, keys, scale=d**-0.5, sinks=sinks)

        def kern_attn():
            return sa.sparse_attention(
                q[0],
                ring[0, 0],
                rows[0],
                idx,
                cnt,
                sinks,
                n=n,
                s=s,
                ring_last=s,
                window=w,
                ratio=4 if sel else 128,
                scale=d**-0.5,
                backend=face,
            )

        row(
            f"{kind} attention decode, {w}+{topk if sel else n} keys", timed(plain_attn, iters), timed(kern_attn, iters)
        )
    # prefill: one 512-token chunk at 8K context (plain: masked SDPA over window + chunk + all rows)
    c, n = 512, 2048
    s = 4 * n - c
    q = mx.random.normal((1, nh, c, d)).astype(mx.bfloat16)
    keys = mx.random.normal((1, 1, w + c, d)).astype(mx.bfloat16)
    rows = mx.random.normal((1, n, d)).astype(mx.bfloat16)
    sinks = mx.random.normal((nh,)).astype(mx.bfloat16)
    sc = mx.random.normal((c, n))
    mx.eval(q, keys, rows, sinks, sc)
    idx, cnt = sa.topk_select(sc, topk, s=s, ratio=4, backend=face)
    mask_sel = mx.put_along_axis(mx.zeros((c, n), mx.bool_), idx, mx.array(True), axis=-1)
    mask = mx.concatenate([mx.ones((c, w + c), mx.bool_), mask_sel], axis=1)
    mx.eval(idx, cnt, mask)

    def plain_pre():
        kk = mx.concatenate([keys, rows[:, None]], axis=2)
        return mx.fast.scaled_dot_product_attention(q, kk, kk, scale=d**-0.5, mask=mask, sinks=sinks)

    def kern_pre():
        return sa.sparse_attention(
            q[0],
            keys[0, 0],
            rows[0],
            idx,
            cnt,
            sinks,
            n=n,
            s=s,
            ring_last=s - 1,
            window=w,
            ratio=4,
            scale=d**-0.5,
            backend=face,
        )

    row(
        f"CSA attention prefill chunk {c}, {n} rows",
        timed(plain_pre, max(4, iters // 10)),
        timed(kern_pre, max(4, iters // 10)),
    )


def versus(name: str, old_label: str, old, new_label: str, new):
    print(
        f"  {name:50s} {old_label} {old[0]:8.1f} / {old[1]:8.1f} µs   {new_label} {new[0]:8.1f} / {new[1]:8.1f} µs"
        f"   x{old[0] / max(new[0], 1e-9):5.2f} sync  x{old[1] / max(new[1], 1e-9):5.2f} batched",
        flush=True,
    )


def bench_decode_attention(iters: int, face: str | None = None):
    """The compiled decode step's attention launches at V4 Flash shapes (64 heads x 512, window
    128, indexer 64 x 128, top-512, YaRN compress rope), at 2K and 32K context: what the step
    ran before (the graph of norms / ropes / slice update; index_score's rows layout; attend
    with one threadgroup per head and a separate rope) vs now; attn_prep compiled as the step
    is.  `face`: the GPU's (default) or 'reference' (a smoke run on the CPU)."""
    from ds4mlx.bench.synthetic import v4_flash_config
    from ds4mlx.kernels import attn_prep as ap
    from ds4mlx.models.deepseek_v4 import ModelArgs
    from ds4mlx.models.layers import RoPE, attention_factor_from_params, inv_freq_from_params

    face = face or dispatch.gpu_backend()
    args = ModelArgs.from_dict(v4_flash_config(layers=3))
    nh, d, nhi, di, w, topk = 64, 512, 64, 128, 128, 512
    rd, rp, mpe = args.qk_rope_head_dim, args.rope_parameters["compress"], args.max_position_embeddings
    rope = RoPE(rd, inv_freq_from_params(rd, rp, mpe), attention_factor_from_params(rp, mpe))
    print("decode attention (sync / batched), previous launch vs now:")
    act = mx.float32  # the residual stream's dtype (dtype_policy)
    q_b = mx.random.normal((1, 1, nh * d)).astype(act)
    kv = mx.random.normal((1, 1, d)).astype(act)
    iq_b = mx.random.normal((1, 1, nhi * di)).astype(act)
    kv_w = mx.ones((d,), mx.bfloat16)
    ring = mx.random.normal((1, 1, w, d)).astype(act)
    mx.eval(q_b, kv, iq_b, kv_w, ring)
    old = mx.compile(lambda *a: ap.reference(*a[:5], rope, 1e-6, a[5], heads=nh, index_heads=nhi))
    new = mx.compile(lambda *a: ap.attn_prep(*a[:5], rope, 1e-6, a[5], heads=nh, index_heads=nhi, backend=face))
    for ctx in (2048, 32768):
        at = (q_b, kv, kv_w, ring, mx.array(ctx + 3, mx.int32), iq_b)
        versus(
            f"attn_prep CSA, pos {ctx + 3}",
            "graph",
            timed(lambda: old(*at), iters),
            "kernel",
            timed(lambda: new(*at), iters),
        )
    for ctx in (2048, 32768):
        n = ctx // 4
        q = mx.random.normal((nhi, 1, di)).astype(act)
        wt = mx.random.normal((1, nhi)).astype(act)
        keys = mx.random.normal((n, di)).astype(act)
        mx.eval(q, wt, keys)
        kw = dict(n=n, s=ctx + 3, ratio=4, scale=nhi**-0.5 * di**-0.5, backend=face)
        versus(
            f"index_score, {n} rows (ctx {ctx})",
            "rows ",
            timed(lambda: sa.index_scores(q, wt, keys, **kw, layout="rows"), iters),
            "heads",
            timed(lambda: sa.index_scores(q, wt, keys, **kw, layout="heads"), iters),
        )
    for ctx in (2048, 32768):
        pos = mx.array(ctx + 3, mx.int32)
        q = mx.random.normal((nh, 1, d)).astype(act)
        ring = mx.random.normal((w, d)).astype(act)
        sinks = mx.random.normal((nh,)).astype(mx.bfloat16)
        hca = mx.random.normal((ctx // 128, d)).astype(act)
        csa = mx.random.normal((ctx // 4, d)).astype(act)
        mx.eval(q, ring, sinks, hca, csa)
        layers = [("sliding", None, None, None, 1), ("HCA", hca, None, None, 128)]
        if ctx // 4 > topk:  # CSA above index_topk rows: the selected ones
            idx = mx.sort(mx.random.permutation(ctx // 4)[:topk]).astype(mx.int32)[None]
            layers.append(("CSA", csa, idx, mx.array([topk], mx.int32), 4))
        else:  # every capacity row
            layers.append(("CSA", csa, None, None, 4))
        for kind, rows, idx, cnt, ratio in layers:
            keys = w + (0 if rows is None else (rows.shape[0] if idx is None else idx.shape[1]))
            kw = dict(ratio=ratio, scale=d**-0.5, backend=face)

            def before():
                out = sa.attend_at(q, ring, rows, idx, cnt, sinks, pos, **kw, splits=1)
                return rope(out[None], offset=pos, scale=-1.0)

            def now(splits=None):
                return sa.attend_at(q, ring, rows, idx, cnt, sinks, pos, **kw, out_rope=rope, splits=splits)

            base = timed(before, iters)
            auto = sa.attend_splits(face, 1, keys)
            versus(f"attend {kind}, {keys} keys (ctx {ctx}), split {auto}", "one+rope", base, "now", timed(now, iters))
            if face == "cuda" and keys > w:
                for sp in (1, 2, 4, 8):
                    versus(f"  attend {kind} split {sp}", "one+rope", base, "now", timed(lambda sp=sp: now(sp), iters))


_MLX_BITS = {"IQ2_XXS": 2, "Q2_K": 2, "Q4_K": 4, "Q8_0": 8}


_VIEWS = ("Reshape", "ExpandDims", "Squeeze", "Slice", "Broadcast", "AsStrided", "StopGradient")


def primitives(outputs) -> tuple[int, int]:
    """(primitives, of which views) in the graph of `outputs` (mx.export_to_dot's op nodes):
    MLX spends host time on each primitive of a step, a GPU launch on each non-view."""
    import io
    import re

    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    ops = re.findall(r'label ="([A-Za-z_]+)", shape=rectangle', buf.getvalue())
    return len(ops), sum(op in _VIEWS for op in ops)


def bench_compressor(iters: int):
    """One token through one compressor: the compiled MLX graph (the decode step's before)
    vs the one-launch kernel; both copy the rows buffer (the step returns new arrays).
    Also the primitives each puts in a compiled step."""
    from ds4mlx.kernels import compressor_step as csk

    face = dispatch.gpu_backend()
    print("compressor step, one token, bf16 state (sync / batched):")
    for name, ratio, dim, overlap, cap in (
        ("CSA attention", 4, 512, True, 2048),
        ("CSA indexer", 4, 128, True, 2048),
        ("HCA", 128, 512, False, 256),
        ("CSA attention", 4, 512, True, 32768),
    ):
        kv, gate, state, bias, norm, rope = csk.random_problem(ratio, dim, 64, overlap, cap, 1.0, mx.bfloat16)
        mx.eval(kv, gate, state, bias, norm.parameters(), rope.periods)
        pos = mx.array(ratio * (cap // 2) + ratio // 2, mx.int32)
        kw = dict(position_bias=bias, norm=norm, rope=rope, ratio=ratio)
        graph = mx.compile(lambda kv, gate, pos, *st: csk.reference(kv, gate, pos, list(st), **kw))
        fused = mx.compile(lambda kv, gate, pos, *st: csk.compressor_step(kv, gate, pos, list(st), **kw, backend=face))
        plain = timed(lambda: graph(kv, gate, pos, *state), iters)
        kern = timed(lambda: fused(kv, gate, pos, *state), iters)
        row(f"{name} m={ratio} d={dim}, {cap} rows", plain, kern)
        (pp, pv), (kp, kv_) = primitives(graph(kv, gate, pos, *state)), primitives(fused(kv, gate, pos, *state))
        print(f"    primitives in a compiled step: graph {pp} ({pv} views), kernel {kp} ({kv_} views)", flush=True)


def bench_qmoe(
    iters: int,
    experts: int = 256,
    hidden: int = 4096,
    inter: int = 2048,
    topk: int = 6,
    face: str | None = None,
    types=("IQ2_XXS", "Q2_K", "Q4_K", "Q8_0"),
):
    """Decode mat-vec over `topk` selected experts (V4 Flash shapes): GB/s of weights
    read by `quant_moe.gather_qmv` per GGUF type vs MLX's gather_qmm on an affine
    bank of the nearest bit width (group 64, bfloat16 scales and biases).

    Each call picks a fresh random expert set (the bank is far larger than L2), and
    16 calls go in one ``mx.eval`` (``batched``) — GPU time plus launch overhead;
    ``sync`` is one call per eval, what an unfused decode step pays."""
    from ds4mlx.io.quant import as_qtype, random_gguf_blocks, row_bytes
    from ds4mlx.kernels import quant_moe

    face = face or dispatch.gpu_backend()
    import numpy as np

    rng = np.random.default_rng(7)
    id_sets = [mx.array(rng.permutation(experts)[:topk].astype(np.int32))[None] for _ in range(64)]
    mx.eval(id_sets)
    print(f"quantized MoE decode, {experts} experts, top-{topk}, per call (sync / batched), weights read / time:")
    results = []
    for name, rows, kdim, per_expert_x in (("gate/up", inter, hidden, False), ("down", hidden, inter, True)):
        x = (mx.random.normal((1, topk, kdim) if per_expert_x else (1, kdim)) * 0.5).astype(mx.bfloat16)
        mx.eval(x)
        for tname in types:
            qt = as_qtype(tname)
            blocks = random_gguf_blocks(qt, experts, rows, kdim)
            gb = topk * rows * row_bytes(qt, kdim) / 1e9
            it = iter(range(1 << 30))
            ours = timed(lambda: quant_moe.gather_qmv(x, blocks, qt, id_sets[next(it) % 64], backend=face), iters)
            blocks = None  # free the bank before the next one is built
            bits = _MLX_BITS[tname]
            w = (
                (mx.random.normal((experts, rows, kdim), key=mx.random.key(3)) * kdim**-0.5).astype(mx.bfloat16)
                if experts * rows * kdim < 2**31
                else None
            )
            parts = []
            for e0 in range(0, experts, 16):
                we = (
                    w[e0 : e0 + 16]
                    if w is not None
                    else (mx.random.normal((min(16, experts - e0), rows, kdim)) * kdim**-0.5).astype(mx.bfloat16)
                )
                parts.append(mx.quantize(we, 64, bits))
                mx.eval(parts[-1])
            del w
            wq, sc, bi = (mx.concatenate([p[j] for p in parts]) for j in range(3))
            del parts
            mx.eval(wq, sc, bi)
            gb_mlx = topk * (wq[0].nbytes + sc[0].nbytes + bi[0].nbytes) / 1e9
            xm = x.reshape(topk, 1, kdim) if per_expert_x else x.reshape(1, 1, kdim)
            it2 = iter(range(1 << 30))
            theirs = timed(
                lambda: mx.gather_qmm(
                    xm, wq, sc, bi, rhs_indices=id_sets[next(it2) % 64][0], transpose=True, group_size=64, bits=bits
                ),
                iters,
            )
            wq = sc = bi = None
            mx.clear_cache()
            r = {
                "proj": name,
                "type": tname,
                "bpw": round(gb * 8e9 / (topk * rows * kdim), 3),
                "ours_us": ours,
                "ours_gbs": tuple(gb / (t * 1e-6) for t in ours),
                "mlx_bits": bits,
                "mlx_bpw": round(gb_mlx * 8e9 / (topk * rows * kdim), 3),
                "mlx_us": theirs,
                "mlx_gbs": tuple(gb_mlx / (t * 1e-6) for t in theirs),
            }
            results.append(r)
            print(
                f"  {name:7s} {tname:8s} {r['bpw']:5.2f} bpw: ours {ours[0]:7.1f} / {ours[1]:7.1f} µs "
                f"= {r['ours_gbs'][0]:7.1f} / {r['ours_gbs'][1]:7.1f} GB/s ({r['ours_gbs'][1] / 4800 * 100:4.1f}% of 4.8 TB/s)"
                f" | gather_qmm {bits}-bit {r['mlx_bpw']:4.2f} bpw: {theirs[0]:7.1f} / {theirs[1]:7.1f} µs "
                f"= {r['mlx_gbs'][0]:7.1f} / {r['mlx_gbs'][1]:7.1f} GB/s",
                flush=True,
            )
    return results


# --------------------------------------------------------------------------- dependent-chain mat-vec GB/s

L2_BYTES = 60 << 20  # H200


def _chain(step, calls: int, reps: int = 5) -> float:
    """µs per call of `calls` dependent calls ``x = step(i, x)`` in one eval (median of reps)."""
    times = []
    for r in range(reps + 1):
        mx.synchronize()
        t0 = time.perf_counter()
        x = None
        for i in range(calls):
            x = step(i, x)
        mx.eval(x)
        mx.synchronize()
        if r:  # the first round compiles and warms up
            times.append((time.perf_counter() - t0) / calls * 1e6)
    times.sort()
    return times[len(times) // 2]


def _affine_bank(n: int, rows: int, k_dim: int, bits: int, gs: int = 64, dtype=mx.bfloat16):
    """n random MLX-affine matrices [n, rows, K] (packed words, bf16 scales and biases)
    whose products keep a unit-scale x at unit scale."""
    shape = (n, rows, k_dim * bits // 32)
    # two 16-bit halves: randint over the whole 32-bit range leaves the low bits zero
    wq = mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32) | (
        mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32) << 16
    )
    s = (12.0 / k_dim) ** 0.5 / (1 << bits)
    sc = (mx.random.uniform(0.5, 1.5, (n, rows, k_dim // gs)) * s).astype(dtype)
    bi = (-sc.astype(mx.float32) * ((1 << bits) - 1) / 2).astype(dtype)
    mx.eval(wq, sc, bi)
    return wq, sc, bi


def _gbs(nbytes: float, us: float) -> str:
    return f"{nbytes / (us * 1e-6) / 1e9:8.1f} GB/s ({nbytes / (us * 1e-6) / 4.8e12 * 100:5.1f}%)"


def bench_qmv(calls: int = 64, face: str | None = None, out: list | None = None):
    """Dependent-chain GB/s of the affine mat-vec, ours vs mx.quantized_matmul."""
    from ds4mlx.kernels import affine_qmv as aq

    face = face or dispatch.gpu_backend()
    out = [] if out is None else out
    print(
        f"affine quantized mat-vec, dependent chain of {calls} calls per eval, bf16 x and scales, group 64"
        " (µs per call, weights + scales + biases read per call):"
    )
    for n_dim in (4096, 8192):
        for bits in (2, 4, 8):
            one = n_dim * n_dim * bits // 8 + 2 * 2 * n_dim * n_dim // 64
            n = max(2, -(-3 * L2_BYTES // one))
            wq, sc, bi = _affine_bank(n, n_dim, n_dim, bits)
            x0 = mx.random.normal((1, n_dim)).astype(mx.bfloat16)
            mx.eval(x0)

            def ours(i, x):
                j = i % n
                return aq.qmv(x0 if x is None else x, wq[j], sc[j], bi[j], group_size=64, bits=bits, backend=face)

            def theirs(i, x):
                j = i % n
                return mx.quantized_matmul(
                    x0 if x is None else x, wq[j], sc[j], bi[j], transpose=True, group_size=64, bits=bits
                )

            t_o, t_m = _chain(ours, calls), _chain(theirs, calls)
            print(
                f"  {n_dim}x{n_dim} {bits}-bit: ours {t_o:7.2f} µs = {_gbs(one, t_o)}   "
                f"mx.quantized_matmul {t_m:7.2f} µs = {_gbs(one, t_m)}",
                flush=True,
            )
            out.append({"what": f"{n_dim}x{n_dim}", "bits": bits, "ours_us": t_o, "mlx_us": t_m, "bytes": one})
            wq = sc = bi = None
            mx.clear_cache()
    # one launch over 32 experts of 4096x4096: the kernel's own bandwidth, launch cost amortised
    for bits in (2, 4, 8):
        e, k = 64, 32
        wq, sc, bi = _affine_bank(e, 4096, 4096, bits)
        one = k * (wq[0].nbytes + sc[0].nbytes + bi[0].nbytes)
        rng = __import__("numpy").random.default_rng(1)
        ids = [mx.array(rng.permutation(e)[:k].astype("int32"))[None] for _ in range(8)]
        x0 = mx.random.normal((1, 4096)).astype(mx.bfloat16)
        mx.eval(ids, x0)

        def ours(i, x):
            y = aq.gather_qmv(x0 if x is None else x, wq, sc, bi, ids[i % 8], group_size=64, bits=bits, backend=face)
            return y[0, :1]

        def theirs(i, x):
            xx = (x0 if x is None else x)[:, None, None, :]
            y = mx.gather_qmm(xx, wq, sc, bi, rhs_indices=ids[i % 8], transpose=True, group_size=64, bits=bits)
            return y[0, :1, 0]

        t_o, t_m = _chain(ours, calls // 4), _chain(theirs, calls // 4)
        print(
            f"  32 experts of 4096x4096 {bits}-bit in one call: ours {t_o:7.2f} µs = {_gbs(one, t_o)}   "
            f"gather_qmm {t_m:7.2f} µs = {_gbs(one, t_m)}",
            flush=True,
        )
        out.append({"what": "32x4096x4096", "bits": bits, "ours_us": t_o, "mlx_us": t_m, "bytes": one})
        wq = sc = bi = None
        mx.clear_cache()
    return out


# affine_qmv.plan knob settings the sweep times against the default (tests/test_affine_qmv.py
# checks each computes the same on the GPU)
QMV_PLAN_VARIANTS = {
    "LPT 2": {"LPT": 2},  # half the loads per lane and step: more threadgroups
    "LPT 8 RPW 8/4/4": {"LPT": 8, "RPW": {2: 8, 4: 4, 8: 4}},  # twice the rows per step (~150 registers)
    "3 TG/SM": {"BLOCKS": 3 * 132},  # grids for three resident threadgroups per SM
    "RPW 2/2/1": {"RPW": {2: 2, 4: 2, 8: 1}},  # fewer rows, more chunks per lane (fewer warps along K)
    "4 warps": {"WARPS": 4, "BLOCKS": 4 * 132},  # 128-thread threadgroups
}


def bench_qmv_sweep(face: str | None = None, calls: int = 32, out: list | None = None):
    """The decode shapes' kernel GPU time (CUPTI; chain wall time without torch) for launch
    variants of `affine_qmv.plan`'s knobs, default first: which one to make the default."""
    from ds4mlx.kernels import affine_qmv as aq

    face = face or dispatch.gpu_backend()
    out = [] if out is None else out
    knobs = ("WARPS", "BLOCKS", "LPT", "RPW")
    saved = {k: getattr(aq, k) for k in knobs}
    variants = (("default", {}),) + tuple(QMV_PLAN_VARIANTS.items())
    print(f"affine_qmv plan variants ({'GPU' if _cupti() else 'chain wall'} µs per call, GB/s):")
    try:
        for name, kind, rows, k_dim, bits, _ in QMV_DECODE_SHAPES:
            if kind == "grouped" or (kind == "dense" and rows not in (1024, 32768)):
                continue  # the other shapes' plans are these with a different size
            case = _decode_case(kind, rows, k_dim, bits, face)
            cells = []
            for vname, setting in variants:
                for k in knobs:
                    setattr(aq, k, saved[k])
                for k, v in setting.items():
                    setattr(aq, k, v)
                us = _measure(case, calls)
                t = us["gpu"] if us["gpu"] is not None else us["chain"]
                cells.append(f"{vname} {t:6.1f} µs {case['bytes'] / (t * 1e-6) / 1e9:5.0f}")
                out.append({"what": name, "variant": vname, **us, "bytes": case["bytes"]})
            print(f"  {name}:\n    " + " | ".join(cells), flush=True)
            case = None
            mx.clear_cache()
    finally:
        for k in knobs:
            setattr(aq, k, saved[k])
    return out


# --------------------------------------------------------------------------- decode shapes

# V4 Flash's decode-step calls (bfloat16 activations): name, kind, rows, K, bits, and the pre-v3
# kernel's GPU µs per call measured in the compiled 8-layer step on the H200 (a recorded column,
# docs/bench-history.md; the [1024, 4096] one averages 22 calls per 8 layers with the grouped wo_a)
QMV_DECODE_SHAPES = (
    ("MoE gate_up+SwiGLU 6x[4096,4096] 2-bit", "swiglu", 4096, 4096, 2, 39.0),
    ("MoE down+sum 6x[4096,2048] 2-bit", "down", 4096, 2048, 2, 20.0),
    ("dense [1024,4096] 8-bit", "dense", 1024, 4096, 8, 14.0),
    ("dense [512,4096] 8-bit", "dense", 512, 4096, 8, 12.0),
    ("dense [2048,4096] 8-bit", "dense", 2048, 4096, 8, 11.6),
    ("dense [32768,1024] 8-bit", "dense", 32768, 1024, 8, 21.5),
    ("dense [4096,8192] 8-bit", "dense", 4096, 8192, 8, 21.5),
    ("grouped 8x[1024,4096] 8-bit (wo_a)", "grouped", 1024, 4096, 8, None),
)
KERNEL_NAME = "affine_qmv"  # a substring of the CUDA kernels' names


def _impl(face: str) -> dict:
    """The four entry points of kernels/affine_qmv.py, face fixed."""
    from functools import partial

    from ds4mlx.kernels import affine_qmv

    return {
        f: partial(getattr(affine_qmv, f), backend=face)
        for f in ("qmv", "gather_qmv", "gather_swiglu", "gather_down_sum")
    }


def _decode_case(kind: str, rows: int, k_dim: int, bits: int, face: str, gs: int = 64) -> dict:
    """Weights rotated through more than L2 (MoE: 256 experts, 6 fresh random ones a call),
    bf16 x / scales / biases; `call(impl, i, x)` one call, `link(y)` the next call's x
    (a view, or a tile copy where the output is shorter than K)."""
    import numpy as np

    rng = np.random.default_rng(rows + k_dim + bits)
    ids = [mx.array(rng.permutation(256)[:6].astype(np.int32))[None] for _ in range(64)]
    if kind in ("swiglu", "down"):
        wq, sc, bi = _affine_bank(256, rows, k_dim, bits, gs)
        nbytes = 6 * (wq[0].nbytes + sc[0].nbytes + bi[0].nbytes)
        wts = [mx.softmax(mx.random.normal((1, 6)), axis=-1) for _ in range(64)]
        if kind == "swiglu":
            x0 = mx.random.normal((1, k_dim)).astype(mx.bfloat16)

            def call(f, i, x):
                return f["gather_swiglu"](x, wq, sc, bi, ids[i % 64], limit=10.0, group_size=gs, bits=bits)

            def link(y):
                return y.reshape(1, -1)[:, :k_dim]
        else:
            x0 = mx.random.normal((1, 6, k_dim)).astype(mx.bfloat16)

            def call(f, i, x):
                return f["gather_down_sum"](x, wq, sc, bi, ids[i % 64], wts[i % 64], group_size=gs, bits=bits)

            def link(y):
                return mx.tile(y[:, :k_dim], (1, 6)).reshape(1, 6, k_dim)
    else:
        groups = 8 if kind == "grouped" else 1
        one = groups * (rows * k_dim * bits // 8 + 2 * 2 * rows * k_dim // gs)
        n = max(2, -(-3 * L2_BYTES // one))
        wq, sc, bi = _affine_bank(n * groups, rows, k_dim, bits, gs)
        nbytes = one
        if kind == "grouped":
            x0 = mx.random.normal((1, groups, k_dim)).astype(mx.bfloat16)
            gids = [mx.arange(groups * j, groups * (j + 1), dtype=mx.int32)[None] for j in range(n)]

            def call(f, i, x):
                return f["gather_qmv"](x, wq, sc, bi, gids[i % n], group_size=gs, bits=bits)

            def link(y):
                return mx.tile(y, (1, 1, k_dim // rows)) if rows < k_dim else y[..., :k_dim]
        else:
            x0 = mx.random.normal((1, k_dim)).astype(mx.bfloat16)

            def call(f, i, x):
                j = i % n
                return f["qmv"](x, wq[j], sc[j], bi[j], group_size=gs, bits=bits)

            def link(y):
                return y[:, :k_dim] if rows >= k_dim else mx.tile(y, (1, k_dim // rows))

    mx.eval(x0, ids)
    ref = _impl("reference")
    return {"bytes": nbytes, "x0": x0, "call": call, "link": link, "face": face, "want": call(ref, 0, x0)}


def _cupti():
    """(profile, ProfilerActivity) from torch.profiler when torch is installed: CUPTI records
    every kernel of the process, MLX's too (tools/gpu_time_probe.py)."""
    try:
        from torch.profiler import ProfilerActivity, profile, supported_activities
    except Exception:
        return None
    return (profile, ProfilerActivity) if ProfilerActivity.CUDA in supported_activities() else None


def _gpu_us(run, match: str) -> float | None:
    """Mean GPU µs of the kernels whose name contains `match` while run() executes."""
    tools = _cupti()
    if tools is None:
        return None
    profile, activity = tools
    with profile(activities=[activity.CUDA]) as prof:
        run()
    times, names = [], set()
    for ev in prof.events():
        dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if ev.device_type.name != "CUDA" or dt <= 0:
            continue
        names.add(ev.name[:60])
        if match in ev.name:
            times.append(dt)
    if not times:
        print(f"    (no kernel named *{match}* in the profile; seen: {sorted(names)[:8]})", flush=True)
        return None
    return sum(times) / len(times)


def _measure(case: dict, calls: int = 64, singles: int = 20) -> dict:
    """µs per call: kernel GPU time (CUPTI), dependent chain wall time (`calls` per eval, the
    link op included), single-call latency (build, launch, wait); the result's relative
    error against the reference face."""
    import numpy as np

    f = _impl(case["face"])
    call, link, x0 = case["call"], case["link"], case["x0"]

    def step(i, x):
        return call(f, i, x0 if x is None else link(x))

    chain = _chain(step, calls)

    def run_chain():
        x = None
        for i in range(calls):
            x = step(i, x)
        mx.eval(x)
        mx.synchronize()

    gpu = _gpu_us(run_chain, KERNEL_NAME)
    times = []
    for i in range(singles + 2):
        t0 = time.perf_counter()
        mx.eval(call(f, i, x0))
        times.append((time.perf_counter() - t0) * 1e6)
    single = sorted(times[2:])[len(times[2:]) // 2]
    got, want = (np.array(a.astype(mx.float32)) for a in (call(f, 0, x0), case["want"]))
    err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    return {"gpu": gpu, "chain": chain, "single": single, "err": err}


def bench_qmv_decode(calls: int = 64, face: str | None = None, out: list | None = None):
    """V4 Flash's decode-step mat-vecs through kernels/affine_qmv.py: kernel GPU µs and GB/s
    (weights + scales + biases read per call), the dependent chain's wall µs per call and one
    call's latency, beside the pre-v3 kernel's recorded µs in the compiled step."""
    face = face or dispatch.gpu_backend()
    out = [] if out is None else out
    gpu = "kernel GPU µs (CUPTI)" if _cupti() else "(no torch: no kernel GPU time)"
    print(
        f"decode-step mat-vecs, affine_qmv: {gpu} = GB/s | chain of {calls} wall µs/call |"
        " one call µs | rel. error vs MLX (pre-v3: that kernel's recorded µs in the compiled step)"
    )
    for name, kind, rows, k_dim, bits, step_us in QMV_DECODE_SHAPES:
        case = _decode_case(kind, rows, k_dim, bits, face)
        m = _measure(case, calls)
        g = "    n/a" if m["gpu"] is None else f"{m['gpu']:7.2f} = {case['bytes'] / (m['gpu'] * 1e-6) / 1e9:6.0f}"
        pre = "" if step_us is None else f"  (pre-v3 {step_us:g} µs)"
        print(
            f"  {name:36s} {case['bytes'] / 1e6:6.2f} MB  {g} | {m['chain']:6.1f} | {m['single']:6.1f} | "
            f"{m['err']:.1e}{pre}",
            flush=True,
        )
        out.append({"what": name, "bytes": case["bytes"], "new": m, "pre_v3_us": step_us})
        case = None
        mx.clear_cache()
    return out


ROWS_SHAPES = [(1024, 4096, 8), (4096, 8192, 8), (32768, 1024, 8), (4096, 4096, 2)]  # (N, K, bits)


def bench_qmv_rows(calls: int = 64, face: str | None = None, out: list | None = None):
    """Batched decode's dense mat-vecs of B = 1..8 x rows: one launch with XR rows a threadgroup
    (each weight read once for them) against one row a threadgroup z slice (XR_MAX = 1, each
    row re-reading the weights): wall µs per call over `calls` independent calls (matrices
    in rotation past L2, `_affine_bank`), and weight GB/s counted once per call."""
    from ds4mlx.kernels import affine_qmv as aq

    face = face or dispatch.gpu_backend()
    out = [] if out is None else out
    print("dense mat-vecs of B rows: µs per call (weight GB/s) | XR rows a threadgroup | one row a slice | speed-up")
    for n, k, bits in ROWS_SHAPES:
        one = n * k * bits // 8 + 2 * 2 * n * k // 64
        m = max(2, -(-3 * L2_BYTES // one))
        wq, sc, bi = _affine_bank(m, n, k, bits)
        for b in (1, 2, 4, 8):
            xs = [mx.random.normal((b, k), key=mx.random.key(100 + i)).astype(mx.bfloat16) for i in range(8)]
            mx.eval(xs)
            res = {}
            for label, xr in (("rows", aq.XR_MAX), ("one", 1)):
                keep, aq.XR_MAX = aq.XR_MAX, xr
                try:

                    def run():
                        ys = [
                            aq.qmv(xs[i % 8], wq[i % m], sc[i % m], bi[i % m], group_size=64, bits=bits, backend=face)
                            for i in range(calls)
                        ]
                        mx.eval(ys)

                    run()  # first use: compile
                    t0 = time.perf_counter()
                    run()
                    res[label] = (time.perf_counter() - t0) / calls * 1e6
                finally:
                    aq.XR_MAX = keep
            gbs = {w: one / (us * 1e-6) / 1e9 for w, us in res.items()}
            print(
                f"  {n:6d}x{k:<5d} {bits}-bit B={b}: {res['rows']:8.1f} ({gbs['rows']:5.0f}) | "
                f"{res['one']:8.1f} ({gbs['one']:5.0f}) | x{res['one'] / res['rows']:.2f}",
                flush=True,
            )
            out.append(
                {"what": f"rows_{n}x{k}_{bits}bit_B{b}", "bytes": one, "rows_us": res["rows"], "one_us": res["one"]}
            )
        wq = sc = bi = None
        mx.clear_cache()
    return out


def bench_moe_call(
    calls: int = 32,
    face: str | None = None,
    out: list | None = None,
    experts: int = 256,
    hidden: int = 4096,
    inter: int = 2048,
    topk: int = 6,
    gguf=("IQ2_XXS", "Q2_K"),
    dense_dim: int = 4096,
):
    """The V4 Flash routed-MoE decode call as a dependent chain: x -> gate_up + SwiGLU ->
    down + weighted sum -> x.  MLX 2-bit affine: ours (2 launches) vs the gather_qmm
    graph the model runs today; GGUF gate/up `gguf[0]`, down `gguf[1]` (quant_moe)."""
    import numpy as np

    from ds4mlx.io.quant import as_qtype, random_gguf_blocks, row_bytes
    from ds4mlx.kernels import affine_qmv as aq
    from ds4mlx.kernels import quant_moe
    from ds4mlx.models.layers import clamped_swiglu

    face = face or dispatch.gpu_backend()
    out = [] if out is None else out
    rng = np.random.default_rng(5)
    ids = [mx.array(rng.permutation(experts)[:topk].astype(np.int32))[None] for _ in range(64)]
    wts = [mx.softmax(mx.random.normal((1, topk)), axis=-1) for _ in range(64)]
    x0 = mx.random.normal((1, hidden)).astype(mx.bfloat16)
    mx.eval(ids, wts, x0)
    print(
        f"routed MoE decode call, {experts} experts, top-{topk}, hidden {hidden}, intermediate {inter}, "
        f"dependent chain of {calls} calls:"
    )
    for bits in (2, 4):
        gu = _affine_bank(experts, 2 * inter, hidden, bits)
        dn = _affine_bank(experts, hidden, inter, bits)
        nbytes = topk * sum(a[0].nbytes for a in gu + dn)

        def ours(i, x):
            x = x0 if x is None else x
            h = aq.gather_swiglu(x, *gu, ids[i % 64], limit=10.0, group_size=64, bits=bits, backend=face)
            return aq.gather_down_sum(h, *dn, ids[i % 64], wts[i % 64], group_size=64, bits=bits, backend=face)

        def theirs(i, x):
            x = (x0 if x is None else x)[:, None, None, :]
            g = mx.gather_qmm(x, *gu, rhs_indices=ids[i % 64], transpose=True, group_size=64, bits=bits)
            h = clamped_swiglu(g[..., :inter], g[..., inter:], 10.0)
            y = mx.gather_qmm(h, *dn, rhs_indices=ids[i % 64], transpose=True, group_size=64, bits=bits)[..., 0, :]
            return (y * wts[i % 64][..., None].astype(y.dtype)).sum(axis=-2)

        t_o, t_m = _chain(ours, calls), _chain(theirs, calls)
        print(
            f"  MLX {bits}-bit: ours {t_o:7.2f} µs = {_gbs(nbytes, t_o)}   gather_qmm graph {t_m:7.2f} µs = "
            f"{_gbs(nbytes, t_m)}",
            flush=True,
        )
        out.append({"what": "moe_call", "bits": bits, "ours_us": t_o, "mlx_us": t_m, "bytes": nbytes})
        gu = dn = None
        mx.clear_cache()
    qg, qd = as_qtype(gguf[0]), as_qtype(gguf[1])
    gate = random_gguf_blocks(qg, experts, inter, hidden)
    up = random_gguf_blocks(qg, experts, inter, hidden, seed=2)
    down = random_gguf_blocks(qd, experts, hidden, inter, seed=3)
    nbytes = topk * (2 * inter * row_bytes(qg, hidden) + hidden * row_bytes(qd, inter))

    def gguf_call(i, x):
        x = x0 if x is None else x
        g = quant_moe.gather_qmv(x, gate, qg, ids[i % 64], backend=face)
        u = quant_moe.gather_qmv(x, up, qg, ids[i % 64], backend=face)
        h = clamped_swiglu(g, u, 10.0)
        y = quant_moe.gather_qmv(h, down, qd, ids[i % 64], backend=face)
        return (y * wts[i % 64][..., None].astype(y.dtype)).sum(axis=-2)

    t_g = _chain(gguf_call, calls)
    print(
        f"  GGUF {qg.name} gate/up, {qd.name} down (quant_moe, 3 launches + graph): {t_g:7.2f} µs = "
        f"{_gbs(nbytes, t_g)}",
        flush=True,
    )
    out.append(
        {"what": "moe_call_gguf", "bits": f"{qg.name}/{qd.name}", "ours_us": t_g, "mlx_us": None, "bytes": nbytes}
    )
    gate = up = down = None
    mx.clear_cache()
    # GGUF dense 4096x4096 (one expert): the non-expert linears' formats
    dd = dense_dim
    x0 = mx.random.normal((1, dd)).astype(mx.bfloat16)
    zero = mx.zeros((1, 1), mx.int32)
    for tname in ("Q8_0", "Q4_K", "Q2_K", "IQ2_XXS"):
        qt = as_qtype(tname)
        one = dd * row_bytes(qt, dd)
        n = max(2, -(-3 * L2_BYTES // one))
        bank = random_gguf_blocks(qt, n, dd, dd)
        mx.eval(bank, x0)

        def dense(i, x, bank=bank, qt=qt, n=n):
            x = x0 if x is None else x
            return quant_moe.gather_qmv(x, bank[i % n : i % n + 1], qt, zero, backend=face)[:, 0]

        t_d = _chain(dense, calls * 2)
        print(f"  GGUF {tname} {dd}x{dd} mat-vec chain: {t_d:7.2f} µs = {_gbs(one, t_d)}", flush=True)
        out.append({"what": f"{dd}x{dd}_gguf", "bits": tname, "ours_us": t_d, "mlx_us": None, "bytes": one})
        bank = None
        mx.clear_cache()
    return out


def _random_weights(module, seed: int = 1):
    """bf16 N(0, 1/fan_in) matrices (8-bit quantized where MLX can), unit norms, small vectors."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    mx.random.seed(seed)
    new = []
    for name, p in tree_flatten(module.parameters()):
        if p.ndim >= 2:
            new.append((name, (mx.random.normal(p.shape) * p.shape[-1] ** -0.5).astype(mx.bfloat16)))
        elif "norm" in name:
            new.append((name, mx.ones(p.shape, mx.bfloat16)))
        else:
            new.append((name, (0.1 * mx.random.normal(p.shape)).astype(mx.float32)))
    module.update(tree_unflatten(new))

    def pred(_, m):
        w = getattr(m, "weight", None)
        return hasattr(m, "to_quantized") and w is not None and w.shape[-1] % 64 == 0

    nn.quantize(module, group_size=64, bits=8, class_predicate=pred)


def bench_route(iters: int):
    """The V4 Flash router (256 experts, top-6, hidden 4096, bf16 weight, float32 x) as the
    compiled decode step runs it: the plain graph, MLX's mat-vec + the route kernel, and
    (CUDA) the one launch with the mat-vec folded in."""
    from ds4mlx.kernels import moe_route as mr

    face = dispatch.gpu_backend()
    e, h, k = 256, 4096, 6
    w = (mx.random.normal((e, h)) * h**-0.5).astype(mx.bfloat16)
    bias = mx.random.normal((e,)) * 0.1
    table = mx.random.randint(0, e, (1024, k)).astype(mx.int32)
    print("MoE router, compiled (sync / batched):")
    for n, hashed in ((1, False), (1, True), (16, False)):
        x = mx.random.normal((1, n, h))
        ids = mx.random.randint(0, 1024, (1, n)).astype(mx.int32)
        mx.eval(w, bias, table, x, ids)
        sel = dict(table=table, ids=ids) if hashed else dict(bias=bias)
        kw = dict(k=k, score="sqrtsoftplus", scaling=1.5, **sel)
        plain = mx.compile(lambda x: mr.reference(mr.router_logits(x, w), **kw))
        split = mx.compile(lambda x: mr.router(x, w, **kw, backend=face, fold=False))
        name = f"router n={n} {'hash' if hashed else 'bias'}"
        row(f"{name}: gemv + route", timed(lambda: plain(x), iters), timed(lambda: split(x), iters))
        if mr.fold_takes(face, x, w):
            fold = mx.compile(lambda x: mr.router(x, w, **kw, backend=face, fold=True))
            row(f"{name}: one launch (fold)", timed(lambda: plain(x), iters), timed(lambda: fold(x), iters))


def bench_csa_layer(ctx: int, iters: int):
    """One CSA Attention module (random weights, 8-bit linears) decoding at `ctx`."""
    from ds4mlx.bench.synthetic import v4_flash_config
    from ds4mlx.models.deepseek_v4 import CSA, Attention, LayerCache, ModelArgs
    from ds4mlx.models.layers import RoPE, attention_factor_from_params, inv_freq_from_params

    ctx -= ctx % 4  # decode at a position that emits no compressed row: repeated steps keep the shapes

    args = ModelArgs.from_dict(v4_flash_config(layers=3))
    li = args.layer_types.index(CSA)
    rd, rp = args.qk_rope_head_dim, args.rope_parameters["compress"]
    rope = RoPE(
        rd,
        inv_freq_from_params(rd, rp, args.max_position_embeddings),
        attention_factor_from_params(rp, args.max_position_embeddings),
    )
    attn = Attention(args, li, {"main": rope, "compress": rope})
    _random_weights(attn)
    mx.eval(attn.parameters())
    print(f"one CSA attention layer, decode at {ctx} tokens (sync ms/step):")
    for on in (False, True):
        with kernels(on):
            cache = LayerCache(CSA, args.sliding_window, args.head_dim, args.ratio(CSA), args.index_head_dim)
            for i in range(0, ctx, 512):
                c = min(512, ctx - i)
                x = (mx.random.normal((1, c, args.hidden_size)) * 0.5).astype(mx.bfloat16)
                mx.eval(attn(x, cache))
                cache.offset += c
            x = (mx.random.normal((1, 1, args.hidden_size)) * 0.5).astype(mx.bfloat16)
            for _ in range(3):
                mx.eval(attn(x, cache))
            mx.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                mx.eval(attn(x, cache))  # the same position again: the caches' shapes stay put
            mx.synchronize()
            print(f"  kernels {'on ' if on else 'off'}: {(time.perf_counter() - t0) / iters * 1e3:8.3f} ms", flush=True)


def bench_model(layers: int, ctx: int, gen: int, expert_format: str = "mlx"):
    from ds4mlx.bench.frontier import run_bench
    from ds4mlx.bench.synthetic import build_synthetic_v4_flash

    model, tok, info = build_synthetic_v4_flash(layers=layers, expert_format=expert_format)
    print(f"synthetic V4 Flash, {layers} layers: {info}", flush=True)
    for on in (False, True):
        with kernels(on):
            rows = run_bench(model, tok, [ctx], gen)
        mx.clear_cache()  # the off run's dequantized temporaries must not crowd the on run
        r = rows[-1]
        print(
            f"  kernels {'on ' if on else 'off'}: prefill {r['prefill_tps']:8.2f} t/s   decode {r['gen_tps']:7.2f} t/s"
            f"   ({1e3 / max(r['gen_tps'], 1e-9):7.2f} ms/token)",
            flush=True,
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--layers", type=int, default=8, help="synthetic model layers (43 = the full model)")
    p.add_argument("--ctx", type=int, default=2560, help="synthetic model context (> 4*index_topk: CSA selects)")
    p.add_argument("--layer-ctx", type=int, default=8192, help="context of the one-layer CSA decode figure")
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--no-micro", action="store_true")
    p.add_argument(
        "--attn",
        action="store_true",
        help="only the decode attention micro-benchmarks (attn_prep, index_score, attend at 2K and 32K)",
    )
    p.add_argument("--no-layer", action="store_true")
    p.add_argument("--no-model", action="store_true")
    p.add_argument("--qmoe", action="store_true", help="the quantized-MoE GB/s table")
    p.add_argument("--compressor", action="store_true", help="only the compressor-step figures")
    p.add_argument(
        "--qmv",
        action="store_true",
        help="the decode shapes through affine_qmv (GPU time, chain, one call), then the dependent-chain"
        " mat-vec GB/s table (affine 2/4/8, the MoE call, GGUF types)",
    )
    p.add_argument("--qmv-rows", action="store_true", help="dense mat-vecs of 1..8 x rows: one launch vs a row a slice")
    p.add_argument("--json", help="write the --qmv rows to this file")
    p.add_argument(
        "--qmv-sweep",
        action="store_true",
        help="affine_qmv plan variants (LPT, RPW, BLOCKS, WARPS) on the decode shapes",
    )
    p.add_argument(
        "--qmv-decode-only",
        action="store_true",
        help="with --qmv: only the decode shapes' table (not the square chains, MoE call, GGUF types)",
    )
    p.add_argument(
        "--expert-format",
        choices=["mlx", "gguf"],
        default="mlx",
        help="synthetic model's routed experts: MLX 2-bit affine, or ds4's IQ2_XXS / Q2_K blocks",
    )
    a = p.parse_args(argv)
    face = dispatch.gpu_backend()
    if face is None:
        print("ds4mlx.bench.kernels: no MLX GPU backend (the kernels only run on a GPU)")
        return 2
    print(f"ds4mlx.bench.kernels on {mx.default_device()} ({face})", flush=True)
    if a.compressor:
        bench_compressor(a.iters)
        return 0
    if a.attn:
        bench_decode_attention(a.iters)
        return 0
    rows = []
    if a.qmv:
        rows += bench_qmv_decode()
    if a.qmv_sweep:
        rows += bench_qmv_sweep()
    if a.qmv_rows:
        rows += bench_qmv_rows()
    if a.qmv and not a.qmv_decode_only:
        rows += bench_qmv()
        bench_moe_call(out=rows)
    if rows and a.json:
        import json

        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.qmoe:
        bench_qmoe(a.iters)
    if not a.no_micro:
        bench_hc(a.iters)
        bench_sparse(a.iters)
        bench_route(a.iters)
        bench_compressor(a.iters)
        bench_decode_attention(a.iters)
    if not a.no_layer:
        bench_csa_layer(a.layer_ctx, max(10, a.iters // 4))
    if not a.no_model:
        bench_model(a.layers, a.ctx, a.gen, a.expert_format)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
