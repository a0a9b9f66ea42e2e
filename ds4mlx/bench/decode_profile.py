"""Where the time of one decode step goes (`ds4mlx bench --profile`).

Each op family is timed alone, on the model's own modules at a real context
depth, and scaled by how often one decode step runs it (e.g. two hyper-connection
calls per layer).  `host` is the Python time to build one step's lazy graph
(`session.step` without evaluating it): whatever the device does, the host pays
that per token.  The sum of the families is compared with a measured step.
(The per-frontier columns of `bench --profile` live in frontier_profile.py.)
"""

from __future__ import annotations

import time
from collections import defaultdict

from ..runtime import stepper
from .clock import synced_seconds


def profile_decode(model, ctx: int = 2048, n: int = 20) -> dict:
    """-> {"families_ms": {family: ms per token}, "step_ms": measured, "detail_us": {...}}"""
    import mlx.core as mx

    from ..kernels.hyper_connection import hc_post
    from ..runtime.forward_context import StepContext
    from ..runtime.sampling import GREEDY, Sampler, SamplingParams

    inner = model.model  # the family Model (LanguageModel.model)
    args = inner.args
    layers = inner.layers
    H, n_hc = args.hidden_size, args.hc_mult
    dtype = layers[0].input_layernorm.weight.dtype if hasattr(layers[0].input_layernorm, "weight") else mx.bfloat16
    session = model.new_session(ctx=ctx + 64, chunk=512)
    session.prefill([(7 * i + 11) % args.vocab_size for i in range(ctx)])
    x = mx.random.normal((1, 1, n_hc, H)).astype(dtype)
    h = mx.random.normal((1, 1, H)).astype(dtype)
    ids = mx.array([[5]])
    mx.eval(x, h, ids)

    detail = {}
    per_type = {}
    for i, layer in enumerate(layers):
        kind = args.layer_types[i]
        if kind in per_type:
            continue
        cache = session.caches[i]

        def attn(layer=layer, cache=cache):
            off = cache.offset
            out = layer.self_attn.forward(h, StepContext.prefill(off, [cache]), cache)
            cache.offset = off  # stay at the same depth: each timed call redoes the same step
            return out

        per_type[kind] = synced_seconds(attn, n)
        detail[f"attention[{kind}]_us"] = per_type[kind] * 1e6
        comp = getattr(layer.self_attn, "compressor", None)
        if comp is not None and hasattr(comp, "indexer"):
            q_res = layer.self_attn.q_a_norm(layer.self_attn.q_a_proj(h))
            mx.eval(q_res)

            def index(ind=comp.indexer, cache=cache, q_res=q_res):
                keys = ind.pool(ind.kv_proj(h), ind.gate_proj(h), cache.index, cache.offset)
                return ind.scores(ind.q_b_proj(q_res), ind.scorer.weights_proj(h), keys, cache.offset)

            detail["indexer_us"] = synced_seconds(index, n) * 1e6
    moe = {}
    for i, layer in enumerate(layers):
        kind = args.mlp_layer_types[i]
        if kind not in moe:
            moe[kind] = synced_seconds(lambda layer=layer: layer.mlp(h, ids), n)
            detail[f"moe[{kind}]_us"] = moe[kind] * 1e6
    hc = layers[0].attn_hc
    post, comb, col = hc(x)
    mx.eval(post, comb, col)
    detail["hc_pre_us"] = synced_seconds(lambda: hc(x), n) * 1e6
    detail["hc_post_us"] = synced_seconds(lambda: hc_post(x, col, post, comb), n) * 1e6
    norm = layers[0].input_layernorm
    detail["rms_norm_us"] = synced_seconds(lambda: norm(h), n) * 1e6
    detail["head_us"] = synced_seconds(lambda: inner.lm_head(inner.model.norm(inner.model.hc_head(x))), n) * 1e6
    logits = mx.random.normal((args.vocab_size,))
    mx.eval(logits)
    sampler = Sampler()
    detail["sample_greedy_us"] = synced_seconds(lambda: sampler.sample(logits, GREEDY), n) * 1e6
    detail["sample_temp_us"] = (
        synced_seconds(lambda: sampler.sample(logits, SamplingParams(temperature=0.8, top_p=0.95)), n) * 1e6
    )

    # one whole step, and the host's share of it (graph construction only)
    tok = mx.array(5)
    snap = session.snapshot()
    build, full = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        out = session.step(tok)
        t1 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        full.append(time.perf_counter() - t0)
        build.append(t1 - t0)
    session.restore(snap)
    step = sorted(full)[len(full) // 2]
    host = sorted(build)[len(build) // 2]
    launches = count_launches(session, tok)

    fam = defaultdict(float)
    for i in range(len(layers)):
        fam["attention"] += per_type[args.layer_types[i]]
        fam["moe"] += moe[args.mlp_layer_types[i]]
    fam["indexer (inside attention)"] = (
        detail.get("indexer_us", 0) / 1e6 * args.layer_types.count("compressed_sparse_attention")
    )
    fam["hyper-connections"] = len(layers) * 2 * (detail["hc_pre_us"] + detail["hc_post_us"]) / 1e6
    fam["norms (2 per layer)"] = len(layers) * 2 * detail["rms_norm_us"] / 1e6
    fam["head (hc_head + norm + lm_head)"] = detail["head_us"] / 1e6
    fam["sampling (greedy)"] = detail["sample_greedy_us"] / 1e6
    fam["host graph build"] = host
    return {
        "ctx": ctx,
        "layers": len(layers),
        "step_ms": step * 1e3,
        "families_ms": {k: v * 1e3 for k, v in fam.items()},
        "sum_ms_excl_indexer": sum(v for k, v in fam.items() if not k.startswith("indexer")) * 1e3,
        "detail_us": {k: round(v, 1) for k, v in detail.items()},
        "decode_mode": stepper.mode() if stepper.supports_static(inner) else "legacy",
        "host_us_per_token": host * 1e6,
        "launches_per_token": launches["total"],
        "launches_per_layer": launches["total"] / len(layers),
        "launch_kinds": launches["kinds"],
    }


# Primitives that are views or metadata changes: they launch no kernel.
NO_LAUNCH = frozenset(
    {
        "Reshape",
        "ExpandDims",
        "Squeeze",
        "Slice",
        "Transpose",
        "Broadcast",
        "Flatten",
        "Unflatten",
        "StopGradient",
        "AsStrided",
        "Depends",
        "Split",
        "View",
    }
)


def graph_primitives(arrays):
    """Counter of the primitive names in the lazy graph behind `arrays` (`mx.export_to_dot`'s
    node labels; array nodes carry none), views included."""
    import io
    import re
    from collections import Counter

    import mlx.core as mx

    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return Counter(lbl.split()[0] for lbl in re.findall(r'label ?= ?"([^"]*)"', buf.getvalue()))


def count_launches(session, token) -> dict:
    """Kernel launches of one decode step, counted on the graph the step hands to MLX.

    The step's lazy outputs (logits and new caches, as `session.step` builds them:
    the compiled step's fused tape, or the legacy per-layer graph) are written with
    `mx.export_to_dot`; every primitive node that is not a view (NO_LAUNCH) counts as
    one launch.  An approximation both ways: a few primitives launch more than one
    kernel (sorts, split-k matmuls) and a contiguous copy may be elided.  The step is
    taken back afterwards (a snapshot round trip), so the session is unchanged."""
    import mlx.core as mx

    snap = session.snapshot()
    mx.eval(session.step(token))  # the first step of a model may evaluate itself (stepper's check)
    session.restore(snap)
    logits = session.step(token)
    outs = [logits] + [a for c in session.caches for a in c.state.values()]
    kinds = graph_primitives(outs)
    session.restore(snap)
    kinds = {k: v for k, v in kinds.items() if k not in NO_LAUNCH}
    return {"total": sum(kinds.values()), "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}


def format_profile(p: dict) -> str:
    lines = [
        f"decode step at ctx {p['ctx']}, {p['layers']} layers: measured {p['step_ms']:.2f} ms/token",
        "| op family | ms / token | share of step |",
        "|---|---:|---:|",
    ]
    for k, v in sorted(p["families_ms"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {k} | {v:.2f} | {100 * v / p['step_ms']:.0f} % |")
    lines.append(
        f"(families summed, indexer counted inside attention: {p['sum_ms_excl_indexer']:.2f} ms; "
        "timed alone, each family pays its own launch latency)"
    )
    lines.append("detail (µs per call): " + ", ".join(f"{k}={v}" for k, v in p["detail_us"].items()))
    if "launches_per_token" in p:
        lines.append(
            f"decode path {p['decode_mode']} ({stepper.MODE_ENV}): {p['launches_per_token']} kernel launches"
            f" per token ({p['launches_per_layer']:.1f} per layer; graph primitives that are not views),"
            f" host {p['host_us_per_token']:.0f} µs per token to enqueue one step"
        )
        top = list(p["launch_kinds"].items())[:12]
        lines.append("launches by primitive: " + ", ".join(f"{k}={v}" for k, v in top))
    return "\n".join(lines)
