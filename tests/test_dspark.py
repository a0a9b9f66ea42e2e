"""DeepSeek V4.1's DSpark block drafter (ds4mlx/models/deepseek_v41_dspark.py).

The MLX graph is checked against `reference_draft`, a float32 torch forward in this file
written from DeepSeek's V4.1 `inference/model.py` (the vendored copy of
huggingface.co/deepseek-ai/DeepSeek-V4.1-Flash@dba1be0a, inference/model.py):
Transformer.forward_spec -> DSparkBlock.forward_embed (main_proj / main_norm, the
[token, noise...] block), Block.forward (hc_mixes + hc_split_sinkhorn, hc_pre, hc_post,
the `pre` of one sublayer used by the next), DSparkAttention.forward at start_pos > 0
(window of main KV + the whole block, attn_sink, inverse rope, grouped wo_a), MoE / Gate /
Expert, and DSparkBlock.forward_head (Markov bias per position from the previous pick,
confidence over [hidden; markov embed]).  `hc_split_sinkhorn` lives in DeepSeek's
kernel file, not model.py: it is written from the ports that spell it out (the same
sigmoid / 2*sigmoid / softmax+eps Sinkhorn in each).  act_quant (FP8 e4m3, one
power-of-two scale per 32 channels) is emulated with torch's float8_e4m3fn.

Tiny config: hidden 64, vocab 512, 4 target layers, 3 target layer ids, 2 stages, block 4,
window 8 (11 captured positions, so the window is cut), head_dim 32 (the FP8 rounding of
the keys is live).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from ds4mlx.models.deepseek_v41 import ModelArgs
from ds4mlx.models.deepseek_v41_dspark import DSparkArgs, DSparkHead, dspark_weights, random_head

TARGET = dict(
    model_type="deepseek_v41",
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    o_groups=2,
    o_lora_rank=16,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    rms_norm_eps=1e-6,
    sliding_window=8,
    compress_ratios=[0, 4, 4, 4],
    kv_source_layer_ids=[1],
    index_source_layer_ids=[1, 2],
    index_n_heads=2,
    index_head_dim=16,
    index_topk=3,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    max_position_embeddings=256,
)
DSPARK = dict(
    dspark_block_size=4,
    dspark_noise_token_id=511,
    dspark_target_layer_ids=[1, 2, 3],
    dspark_markov_rank=16,
    num_nextn_predict_layers=2,
)


def make(target=None, dspark=None, seed=3):
    args = ModelArgs.from_dict({**TARGET, **(target or {})})
    d = DSparkArgs.from_config({**DSPARK, **(dspark or {})})
    return args, d, random_head(args, d, seed)


def shared_io(args, seed=7):
    """The target's embedding and lm_head (DSpark borrows both)."""
    mx.random.seed(seed)
    embed = nn.Embedding(args.vocab_size, args.hidden_size)
    head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
    embed.weight = mx.random.normal(embed.weight.shape)
    head.weight = mx.random.normal(head.weight.shape) * args.hidden_size**-0.5
    return embed, head


# ----------------------------------------------------------------------------- torch reference


def t_rms(x, w, eps):
    import torch

    x = x.float()
    return w * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))


def t_rope(x, pos, rd, theta, inverse=False):
    """apply_rotary_emb: adjacent pairs of the last rd channels as complex numbers; x [T, ..., d]."""
    import torch

    freqs = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    cis = torch.polar(torch.ones(len(pos), rd // 2), torch.outer(pos.float(), freqs))
    if inverse:
        cis = cis.conj()
    cis = cis.view(len(pos), *[1] * (x.dim() - 2), rd // 2)
    z = torch.view_as_complex(x[..., -rd:].float().contiguous().unflatten(-1, (-1, 2)))
    out = x.clone()
    out[..., -rd:] = torch.view_as_real(z * cis).flatten(-2)
    return out


def t_act_quant(x, block=32):
    """act_quant: FP8 e4m3 with one ue8m0 (power-of-two) scale per `block` channels."""
    import torch

    if x.shape[-1] % block:
        return x
    b = x.unflatten(-1, (-1, block))
    amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    q = (b / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return q.flatten(-2)


def t_hc_mixes(x, fn, scale, base, n, iters, hc_eps, norm_eps):
    """Block.hc_mixes + hc_split_sinkhorn: x [T, n, d] -> pre [T, n], post [T, n], comb [T, n, n]."""
    import torch

    flat = x.flatten(1)
    mixes = (flat @ fn.T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = (mixes[:, 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n)).softmax(-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def t_hc_pre(x, pre):
    return (pre.unsqueeze(-1) * x).sum(1)


def t_hc_post(out, residual, post, comb):
    return post.unsqueeze(-1) * out.unsqueeze(1) + (comb.unsqueeze(-1) * residual.unsqueeze(2)).sum(1)


def t_moe(x, p, a, n_experts, k):
    """MoE: Gate (sqrtsoftplus, bias picks, unbiased weights renormalised, route_scale),
    clamped SwiGLU experts, one shared expert."""
    import torch

    scores = torch.sqrt(torch.nn.functional.softplus(x @ p["mlp.gate.weight"].T))
    idx = (scores + p["mlp.gate.e_score_correction_bias"]).topk(k, dim=-1).indices
    w = scores.gather(1, idx)
    if a.norm_topk_prob and k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * a.routed_scaling_factor
    I, lim = a.moe_intermediate_size, a.swiglu_limit

    def expert(x, w1, w3, w2, weight=None):
        gate, up = x @ w1.T, x @ w3.T
        up, gate = up.clamp(-lim, lim), gate.clamp(max=lim)
        h = torch.nn.functional.silu(gate) * up
        return (h if weight is None else weight * h) @ w2.T

    gu, down = p["mlp.experts.gate_up_proj.weight"], p["mlp.experts.down_proj.weight"]
    y = torch.zeros_like(x)
    for e in range(n_experts):
        rows, slot = torch.where(idx == e)
        if len(rows):
            y[rows] += expert(x[rows], gu[e, :I], gu[e, I:], down[e], w[rows, slot, None])
    sh = "mlp.shared_experts."
    return y + expert(x, p[sh + "gate_proj.weight"], p[sh + "up_proj.weight"], p[sh + "down_proj.weight"])


def t_attention(x, main_x, p, a, start_pos):
    """DSparkAttention.forward at start_pos > 0 (main_x [T, H]: positions 0..T-1; the block
    sits at T..T+C-1; the window holds the newest `sliding_window` main positions)."""
    import torch

    C, T = x.shape[0], main_x.shape[0]
    nh, D, rd, eps, W = a.num_attention_heads, a.head_dim, a.qk_rope_head_dim, a.rms_norm_eps, a.sliding_window
    block_pos, main_pos = torch.arange(start_pos, start_pos + C), torch.arange(T)
    qr = t_rms(x @ p["self_attn.q_a_proj.weight"].T, p["self_attn.q_a_norm.weight"], eps)
    q = t_rope((qr @ p["self_attn.q_b_proj.weight"].T).view(C, nh, D), block_pos, rd, a.rope_theta)

    def kv_of(h, pos):
        kv = t_rms(h @ p["self_attn.kv_proj.weight"].T, p["self_attn.kv_norm.weight"], eps)
        return t_act_quant(t_rope(kv, pos, rd, a.rope_theta))

    kv = torch.cat([kv_of(main_x, main_pos)[-W:], kv_of(x, block_pos)])  # every query sees all of it
    scores = torch.einsum("chd,ld->chl", q, kv) * D**-0.5
    sink = p["self_attn.sinks"].view(1, nh, 1).expand(C, nh, 1)
    weights = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    o = t_rope(torch.einsum("chl,ld->chd", weights, kv), block_pos, rd, a.rope_theta, inverse=True)
    G, R = a.o_groups, a.o_lora_rank
    wo_a = p["self_attn.o_a_proj.weight"].view(G, R, -1)
    o = torch.einsum("cgd,grd->cgr", o.reshape(C, G, -1), wo_a).flatten(1)
    return o @ p["self_attn.o_b_proj.weight"].T


def reference_draft(params, a, d, embed_w, head_w, captured, token):
    """Transformer.forward_spec for one block after `captured` [T, n_ids*H] (start_pos T-1)
    -> (biased logits [bs, V], confidence [bs], drafts [bs])."""
    import torch

    eps, n, bs = a.rms_norm_eps, a.hc_mult, d.dspark_block_size
    stage = [{k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"mtp.{s}.")} for s in range(d.stages)]
    main_x = t_rms(captured @ stage[0]["main_proj.weight"].T, stage[0]["main_norm.weight"], eps)
    ids = torch.tensor([token] + [d.dspark_noise_token_id] * (bs - 1))
    x = embed_w[ids].unsqueeze(1).repeat(1, n, 1)
    pre = torch.zeros(bs, n)
    pre[:, 0] = 1.0
    hc = (n, a.hc_sinkhorn_iters, a.hc_eps, eps)
    experts = (d.dspark_n_routed_experts or a.n_routed_experts, d.dspark_n_activated_experts or a.num_experts_per_tok)
    for p in stage:
        attn_pre, post, comb = t_hc_mixes(x, p["attn_hc.fn"], p["attn_hc.scale"], p["attn_hc.base"], *hc)
        h = t_attention(t_rms(t_hc_pre(x, pre), p["input_layernorm.weight"], eps), main_x, p, a, captured.shape[0])
        x = t_hc_post(h, x, post, comb)
        pre, post, comb = t_hc_mixes(x, p["ffn_hc.fn"], p["ffn_hc.scale"], p["ffn_hc.base"], *hc)
        h = t_moe(t_rms(t_hc_pre(x, attn_pre), p["post_attention_layernorm.weight"], eps), p, a, *experts)
        x = t_hc_post(h, x, post, comb)
    last = stage[-1]
    h = t_hc_pre(x, pre)
    logits = t_rms(h, last["norm.weight"], eps) @ head_w.T
    prev, rows, marks, drafts = token, [], [], []
    for i in range(bs):
        e = last["markov_head.embed.weight"][prev]
        rows.append(logits[i] + e @ last["markov_head.head.weight"].T)
        marks.append(e)
        prev = int(rows[-1].argmax())
        drafts.append(prev)
    conf = (torch.cat([h, torch.stack(marks)], -1) @ last["confidence_head.proj.weight"].T).squeeze(-1)
    return torch.stack(rows), conf, drafts


def to_torch(module) -> dict:
    import torch

    return {k: torch.from_numpy(np.array(v.astype(mx.float32))) for k, v in tree_flatten(module.parameters())}


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("chunks", [(11,), (7, 4), (3, 1, 1, 6)])
def test_draft_block_matches_torch_reference(chunks):
    import torch

    args, d, head = make()
    embed, lm_head = shared_io(args)
    T = sum(chunks)
    captured = mx.random.normal((1, T, len(d.dspark_target_layer_ids) * args.hidden_size), key=mx.random.key(11))
    cache = head.make_cache()
    at = 0
    for c in chunks[:-1]:  # earlier rounds' captured positions: only the window keys stay
        head.observe(captured[:, at : at + c], cache)
        at += c
    token = 42
    logits, conf, drafts = head.draft_block(captured[:, at:], token, cache, embed, lm_head)
    mx.eval(logits, conf, drafts)
    assert logits.shape == (d.dspark_block_size, args.vocab_size) and logits.dtype == mx.float32
    assert conf.shape == (d.dspark_block_size,) and conf.dtype == mx.float32
    assert drafts.shape == (d.dspark_block_size,)
    assert cache.offset == T and all(k.shape[2] == args.sliding_window for k in cache.keys)

    with torch.no_grad():
        ref_logits, ref_conf, ref_drafts = reference_draft(
            to_torch(head),
            args,
            d,
            torch.from_numpy(np.array(embed.weight)),
            torch.from_numpy(np.array(lm_head.weight)),
            torch.from_numpy(np.array(captured[0])),
            token,
        )
    np.testing.assert_allclose(np.array(logits), ref_logits.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.array(conf), ref_conf.numpy(), atol=1e-4, rtol=0)
    assert np.array(drafts).tolist() == ref_drafts


def test_markov_bias_and_window_matter():
    """Guards against a reference and a graph that agree by ignoring an input: the
    previous token and the captured states both change the block's logits."""
    args, d, head = make()
    embed, lm_head = shared_io(args)
    captured = mx.random.normal((1, 5, 3 * args.hidden_size), key=mx.random.key(1))
    a, _, _ = head.draft_block(captured, 10, head.make_cache(), embed, lm_head)
    b, _, _ = head.draft_block(captured, 11, head.make_cache(), embed, lm_head)
    c, _, _ = head.draft_block(captured * 2.0 + 1.0, 10, head.make_cache(), embed, lm_head)
    assert float(mx.abs(a - b).max()) > 1e-2
    assert float(mx.abs(a - c).max()) > 1e-2


def test_stage_parameters_carry_the_checkpoint_names():
    args, d, head = make(dspark={"num_nextn_predict_layers": 3})
    names = {k for k, _ in tree_flatten(head.parameters())}
    assert {"mtp.0.main_proj.weight", "mtp.0.main_norm.weight"} <= names
    assert {
        "mtp.2.norm.weight",
        "mtp.2.markov_head.embed.weight",
        "mtp.2.markov_head.head.weight",
        "mtp.2.confidence_head.proj.weight",
    } <= names
    assert not any(k.startswith(("mtp.1.main", "mtp.0.markov", "mtp.1.norm", "mtp.0.confidence")) for k in names)
    shapes = dict((k, v.shape) for k, v in tree_flatten(head.parameters()))
    assert shapes["mtp.0.main_proj.weight"] == (64, 3 * 64)
    assert shapes["mtp.2.markov_head.embed.weight"] == (512, 16)
    assert shapes["mtp.2.markov_head.head.weight"] == (512, 16)
    assert shapes["mtp.2.confidence_head.proj.weight"] == (1, 64 + 16)


def test_stage_expert_counts_override():
    _, _, head = make(dspark={"dspark_n_routed_experts": 6, "dspark_n_activated_experts": 3})
    assert head.mtp[0].mlp.gate.weight.shape == (6, 64)
    assert head.mtp[0].mlp.gate._k == 3


def _hub_names(head: DSparkHead) -> dict:
    """The drafter's parameters under DeepSeek's checkpoint names (the inverse of dspark_weights)."""
    from ds4mlx.models.deepseek_v41 import HUB_PARTS

    out = {}
    for k, v in tree_flatten(head.parameters()):
        if k.endswith("mlp.experts.gate_up_proj.weight"):
            stage = k.split(".")[1]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"mtp.{stage}.ffn.experts.{e}.w1.weight"] = v[e, :inter]
                out[f"mtp.{stage}.ffn.experts.{e}.w3.weight"] = v[e, inter:]
            continue
        if k.endswith("mlp.experts.down_proj.weight"):
            stage = k.split(".")[1]
            for e in range(v.shape[0]):
                out[f"mtp.{stage}.ffn.experts.{e}.w2.weight"] = v[e]
            continue
        name = k
        for a, b in reversed(HUB_PARTS):
            name = name.replace(b, a)
        out[name] = v
    return out


def test_hub_names_load_into_the_drafter():
    args, d, head = make()
    hub = _hub_names(head)
    assert "mtp.0.attn.wq_a.weight" in hub and "mtp.1.hc_ffn_fn" in hub and "mtp.0.attn.attn_sink" in hub
    hub["mtp.0.embed.weight"] = mx.zeros((4, 4))  # the shared embedding: dropped
    fresh = DSparkHead(args, d)
    fresh.load_weights(list(dspark_weights(hub).items()), strict=True)
    for (k, v), (k2, v2) in zip(tree_flatten(head.parameters()), tree_flatten(fresh.parameters())):
        assert k == k2 and mx.array_equal(v, v2), k


# ----------------------------------------------------------------------------- config validation


def test_bad_block_size_is_refused():
    with pytest.raises(ValueError, match="dspark_block_size must be >= 1"):
        DSparkArgs.from_config({**DSPARK, "dspark_block_size": 0})


def test_missing_target_layer_ids_are_refused():
    cfg = {k: v for k, v in DSPARK.items() if k != "dspark_target_layer_ids"}
    with pytest.raises(ValueError, match="needs dspark_target_layer_ids"):
        DSparkArgs.from_config(cfg)


def test_target_layer_ids_outside_the_target_are_refused():
    args = ModelArgs.from_dict(TARGET)
    with pytest.raises(ValueError, match=r"dspark_target_layer_ids \[4\] are not layers"):
        DSparkHead(args, DSparkArgs.from_config({**DSPARK, "dspark_target_layer_ids": [2, 4]}))


def test_compressed_stage_is_refused():
    args = ModelArgs.from_dict({**TARGET, "compress_ratios": [0, 4, 4, 4, 0, 4]})
    with pytest.raises(ValueError, match="stage 1 .* compress ratio 4"):
        DSparkHead(args, DSparkArgs.from_config(DSPARK))


def test_hub_config_keys():
    """The multimodal hub config nests the text model; DeepSeek's own ModelArgs calls the
    stage count n_mtp_layers."""
    d = DSparkArgs.from_config({"text_config": {**DSPARK, "unrelated": 1}})
    assert (d.dspark_block_size, d.stages, d.dspark_target_layer_ids) == (4, 2, (1, 2, 3))
    d = DSparkArgs.from_config(
        {**{k: v for k, v in DSPARK.items() if k != "num_nextn_predict_layers"}, "n_mtp_layers": 3}
    )
    assert d.stages == 3


def test_drafting_needs_a_captured_position():
    args, d, head = make()
    embed, lm_head = shared_io(args)
    with pytest.raises(ValueError, match="observe one first"):
        head.draft_block(None, 1, head.make_cache(), embed, lm_head)


def test_long_offset_stays_finite():
    """Confidences and logits stay finite at a long offset (rope angles well past the window)."""
    args, d, head = make()
    embed, lm_head = shared_io(args)
    cache = head.make_cache()
    cache.offset = 10_000
    logits, conf, _ = head.draft_block(mx.ones((1, 2, 3 * 64)), 3, cache, embed, lm_head)
    assert bool(mx.isfinite(logits).all()) and bool(mx.isfinite(conf).all())
    assert math.isfinite(float(mx.logsumexp(logits[0])))
