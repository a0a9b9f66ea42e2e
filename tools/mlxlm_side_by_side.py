"""ds4mlx vs mlx-lm on the same V4 Flash shapes, the same bits and, where the two
graphs coincide, the same weights; one process, one model at a time.

mlx-lm 0.32.2 has no DeepSeek V4 class; its `deepseek_v41` is the anchor's graph
(shared/perf/).  Both models get every tensor from `named_normal(canonical name)`:
embedding, attention projections and norms, sinks, hyper-connection mixers, router,
routed experts (our fused gate_up = their gate ++ up, row for row, so the 2-bit
groups are identical), shared experts, final norm and lm_head.  What differs (and so
is not shared): the compressors and the lightning indexer (V4.1 derives index keys
from the compressed KV), the hyper head, and the 3 hash-routed MoE layers of V4
(V4.1 routes every layer by top-k).  Protocol = the anchor's: prefill the prompt in
512-token chunks, 4 warm-up decode steps, then `--gen` greedy tokens with one step
in flight.  Needs mlx-lm (`pip install mlx-lm==0.32.2`).

  python tools/mlxlm_side_by_side.py --layers 43 --prompt 2048 --gen 32 --which both
  python tools/mlxlm_side_by_side.py --tiny --which both --check   # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ds4mlx.bench.synthetic import default_value, named_experts, named_normal, v4_flash_config, weight_std

TINY = dict(
    hidden_size=256,
    num_attention_heads=4,
    head_dim=64,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=64,
    moe_intermediate_size=64,
    index_n_heads=4,
    index_head_dim=64,
    index_topk=16,
    vocab_size=129280,
    partial_rotary_factor=0.25,
)


def ours_value(name, p, n_experts, k):
    """Our parameter `name` -> values; coinciding tensors use mlx-lm's name as the key."""
    if name.endswith(".mlp.experts.gate_up_proj.weight"):
        base = name.replace("experts.gate_up_proj.weight", "experts.switch_mlp.")
        e, two_i, h = p.shape
        g = named_experts(base + "gate_proj.weight", (e, two_i // 2, h), h**-0.5)
        u = named_experts(base + "up_proj.weight", (e, two_i // 2, h), h**-0.5)
        return mx.concatenate([g, u], axis=1)
    if name.endswith(".mlp.experts.down_proj.weight"):
        return named_experts(
            name.replace("experts.down_proj", "experts.switch_mlp.down_proj"), p.shape, p.shape[-1] ** -0.5
        )
    if name.endswith("self_attn.o_a_proj.weight"):  # ours [G*O, I] == theirs [G, O, I] reshaped
        return named_normal(name, p.shape, p.shape[-1] ** -0.5)
    return default_value(name, p, n_experts, k)


def theirs_value(name, p, n_experts, k):
    if name.endswith("self_attn.o_a_proj.weight") and p.ndim == 3:
        g, o, i = p.shape
        return named_normal(name, (g * o, i), i**-0.5).reshape(g, o, i)
    if p.ndim == 3:
        return named_experts(name, p.shape, weight_std(name, p.shape))
    if p.ndim >= 2:
        return named_normal(name, p.shape, weight_std(name, p.shape))
    return default_value(name, p, n_experts, k)


def build_mlxlm(cfg: dict, expert_bits: int, other_bits: int):
    from mlx_lm.models.deepseek_v41 import Model, ModelArgs

    kinds = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    ratios = tuple(kinds[t] for t in cfg["layer_types"])
    args = ModelArgs.from_dict(
        dict(
            model_type="deepseek_v41",
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            head_dim=cfg["head_dim"],
            q_lora_rank=cfg["q_lora_rank"],
            qk_rope_head_dim=int(cfg["head_dim"] * cfg["partial_rotary_factor"]),
            o_groups=cfg["o_groups"],
            o_lora_rank=cfg["o_lora_rank"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            n_routed_experts=cfg["n_routed_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            rms_norm_eps=1e-6,
            sliding_window=cfg["sliding_window"],
            compress_ratios=ratios,
            kv_source_layer_ids=tuple(i for i, r in enumerate(ratios) if r),
            index_source_layer_ids=tuple(i for i, r in enumerate(ratios) if r == 4),
            candidate_source_layer_id=-1,
            index_n_heads=cfg["index_n_heads"],
            index_head_dim=cfg["index_head_dim"],
            index_topk=cfg["index_topk"],
            hc_mult=cfg["hc_mult"],
            hc_sinkhorn_iters=cfg["hc_sinkhorn_iters"],
            max_position_embeddings=cfg["max_position_embeddings"],
        )
    )
    model = Model(args)
    inner = model.model if hasattr(model, "model") else model.language_model

    def pred(path, m):  # the anchor's predicate
        if not hasattr(m, "to_quantized"):
            return False
        if "switch_mlp" in path:
            return {"bits": expert_bits, "group_size": 64}
        w = getattr(m, "weight", None)
        if w is None or w.shape[-1] % 64:
            return False
        return {"bits": other_bits, "group_size": 64}

    pieces = [("model.embed_tokens.", inner.embed_tokens), ("model.norm.", inner.norm), ("lm_head.", model.lm_head)]
    pieces += [(f"model.layers.{i}.", layer) for i, layer in enumerate(inner.layers)]
    n, k = args.n_routed_experts, args.num_experts_per_tok
    for prefix, part in pieces:
        vals = [(nm, theirs_value(prefix + nm, p, n, k)) for nm, p in tree_flatten(part.parameters())]
        part.update(tree_unflatten(vals))
        nn.quantize(part, class_predicate=lambda p, m, pre=prefix: pred(pre + p, m))
        mx.eval(part.parameters())
    mx.eval(model.parameters())
    return model


def run_protocol(forward_chunk, decode_step, prompt: list[int], gen: int) -> dict:
    mx.synchronize()
    t = time.perf_counter()
    logits = None
    for s in range(0, len(prompt), 512):
        logits = forward_chunk(prompt[s : s + 512])
        mx.eval(logits)
    mx.synchronize()
    pre = time.perf_counter() - t
    y = mx.argmax(logits.reshape(-1, logits.shape[-1])[-1])
    for _ in range(4):
        y = decode_step(y)
        mx.eval(y)
    mx.synchronize()
    t = time.perf_counter()
    nxt = decode_step(y)
    mx.async_eval(nxt)
    for _ in range(gen - 1):
        cur = nxt
        nxt = decode_step(cur)
        mx.async_eval(nxt)
        mx.eval(cur)
    mx.eval(nxt)
    mx.synchronize()
    dec = time.perf_counter() - t
    return {
        "prompt": len(prompt),
        "prefill_tps": round(len(prompt) / pre, 1),
        "decode_tps": round(gen / dec, 2),
        "decode_ms_per_token": round(1000 * dec / gen, 2),
    }


def sizes(model, n_experts, k, vocab) -> dict:
    params = tree_flatten(model.parameters())
    total = sum(p.nbytes for _, p in params)
    expert = sum(p.nbytes for n, p in params if "switch_mlp" in n or ".mlp.experts." in n)
    embed = sum(p.nbytes for n, p in params if "embed_tokens" in n)
    active = (total - expert - embed) + expert * k / n_experts + embed / vocab
    return {
        "weights_gb": round(total / 1e9, 2),
        "active_gb_per_token": round(active / 1e9, 3),
        "roofline_tps_at_4.8TBps": round(4.8e12 / active, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--expert-bits", type=int, default=2)
    ap.add_argument("--other-bits", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--which", choices=["both", "ours", "mlxlm"], default="both")
    ap.add_argument("--tiny", action="store_true", help="small shapes for a CPU smoke test")
    ap.add_argument("--check", action="store_true", help="check the shared weights give equal block outputs")
    a = ap.parse_args()
    over = dict(TINY) if a.tiny else {}
    cfg = v4_flash_config(a.layers, a.experts)
    cfg.update(over)
    prompt = [(31 * i + 7) % cfg["vocab_size"] for i in range(a.prompt)]
    results = {}
    ours = None
    if a.which in ("both", "ours"):
        ours, results["ds4mlx"] = _run_ours(a, over, prompt)
        print(json.dumps({"ds4mlx": results["ds4mlx"]}), flush=True)
    if a.which in ("both", "mlxlm"):
        keep_ours = a.check and ours is not None
        if not keep_ours:
            ours = None
            gc.collect()
            mx.clear_cache()
        t0 = time.time()
        theirs = build_mlxlm(cfg, a.expert_bits, a.other_bits)
        if keep_ours:
            print(json.dumps({"check": check_shared(ours.model, theirs)}), flush=True)
        cache = theirs.make_cache()
        r = run_protocol(
            lambda ids: theirs(mx.array([ids]), cache=cache)[:, -1, :],
            lambda y: mx.argmax(theirs(y.reshape(1, 1), cache=cache)[:, -1, :], axis=-1),
            prompt,
            a.gen,
        )
        r.update(
            sizes(theirs, cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["vocab_size"]),
            build_s=round(time.time() - t0, 1),
            device=str(mx.default_device()),
        )
        results["mlx-lm deepseek_v41"] = r
        print(json.dumps({"mlx-lm deepseek_v41": r}), flush=True)
    if len(results) == 2:
        o, t = results["ds4mlx"], results["mlx-lm deepseek_v41"]
        print(
            json.dumps(
                {
                    "ratio": {
                        "prefill": round(o["prefill_tps"] / t["prefill_tps"], 2),
                        "decode": round(o["decode_tps"] / t["decode_tps"], 2),
                    }
                }
            ),
            flush=True,
        )


def _run_ours(a, over, prompt):
    """Build and measure ours; returns (model, result).  The session dies here, so
    dropping the model frees its memory before mlx-lm's is built."""
    from ds4mlx.bench.synthetic import build_synthetic_v4_flash

    t0 = time.time()
    ours, _, info = build_synthetic_v4_flash(
        a.layers, a.experts, a.expert_bits, a.other_bits, value=ours_value, overrides=over
    )
    sess = ours.new_session(ctx=a.prompt + a.gen + 16, chunk=512)
    r = run_protocol(lambda ids: _ours_chunk(sess, ids), lambda y: mx.argmax(sess.step(y)), prompt, a.gen)
    r.update(info, build_s=round(time.time() - t0, 1), device=str(mx.default_device()))
    return ours, r


def _ours_chunk(sess, ids):
    """One prefill chunk through the session (its own chunking is the same 512)."""
    sess.prefill(ids)
    return sess._logits


def check_shared(ours, theirs) -> dict:
    """Same weights where the graphs coincide: the stored (quantized) arrays of the
    shared tensors are identical, and a top-k MoE block gives the same output."""
    mine = dict(tree_flatten(ours.parameters()))
    other = dict(tree_flatten(theirs.parameters()))
    same, differ = 0, []
    for name, a in other.items():
        ours_name = name.replace("experts.switch_mlp.", "experts.")
        if ours_name.endswith(
            (
                "experts.gate_proj.weight",
                "experts.up_proj.weight",
                "experts.gate_proj.scales",
                "experts.up_proj.scales",
                "experts.gate_proj.biases",
                "experts.up_proj.biases",
            )
        ):
            fused = mine.get(
                ours_name.replace("gate_proj", "gate_up_proj")
                .replace("up_proj", "gate_up_proj")
                .replace("gate_gate_up_proj", "gate_up_proj")
            )
            if fused is None:
                continue
            half = fused.shape[1] // 2
            b = fused[:, :half] if ".gate_proj." in ours_name else fused[:, half:]
        else:
            b = mine.get(ours_name)
            if b is None:
                continue
            if b.shape != a.shape and b.size == a.size:
                b = b.reshape(a.shape)
        if b.shape == a.shape and bool(mx.array_equal(a, b)):
            same += 1
        else:
            differ.append(name)
    out = {"identical_shared_tensors": same, "differing": differ[:10]}
    H = ours.args.hidden_size
    x = (mx.random.normal((1, 5, H), key=mx.random.key(1)) * 0.5).astype(mx.bfloat16)
    inner = theirs.model if hasattr(theirs, "model") else theirs.language_model
    if "moe" not in ours.args.mlp_layer_types:
        return out
    i = ours.args.mlp_layer_types.index("moe")
    ma = ours.model.layers[i].mlp(x, mx.array([[1, 2, 3, 4, 5]]))
    mb = inner.layers[i].mlp(x)
    out[f"moe_layer{i}_max_abs_diff"] = float(mx.abs(ma.astype(mx.float32) - mb.astype(mx.float32)).max())
    out["moe_output_max_abs"] = float(mx.abs(ma.astype(mx.float32)).max())
    return out


if __name__ == "__main__":
    main()
