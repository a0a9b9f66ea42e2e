"""DeepSeek V4.1 Flash: ds4's `deepseek41` GGUFs (see the package docstring)."""

from __future__ import annotations

from .base import Family, flatten_groups_split, identity_join, make_rule, num_kind, text_part, tok_ids

# ============================================================================= DeepSeek V4.1
# Tensor names: antirez/ds4 gguf-tools/deepseek41_quantize.py build_plan().  HF side:
# mlx-lm's deepseek_v41 names (what models/deepseek_v41.py and its demo use).
_V41_TOP = [
    make_rule("model.embed_tokens.weight", "token_embd.weight"),
    make_rule("model.norm.weight", "output_norm.weight"),
    make_rule("lm_head.weight", "output.weight"),
]
_V41_LAYER = [
    *[make_rule(f"{s}_hc.{p}", f"hc_{s}_{p}.weight") for s in ("attn", "ffn") for p in ("fn", "base", "scale")],
    make_rule("input_layernorm.weight", "attn_norm.weight"),
    make_rule("post_attention_layernorm.weight", "ffn_norm.weight"),
    make_rule("self_attn.sinks", "attn_sinks.weight"),
    make_rule("self_attn.q_a_proj.weight", "attn_q_a.weight"),
    make_rule("self_attn.q_b_proj.weight", "attn_q_b.weight"),
    make_rule("self_attn.q_a_norm.weight", "attn_q_a_norm.weight"),
    make_rule("self_attn.kv_proj.weight", "attn_kv.weight"),
    make_rule("self_attn.kv_norm.weight", "attn_kv_a_norm.weight"),
    make_rule("self_attn.o_a_proj.weight", "attn_output_a.weight", split=flatten_groups_split, join=identity_join),
    make_rule("self_attn.o_b_proj.weight", "attn_output_b.weight"),
    make_rule("self_attn.compressor.kv_proj.weight", "attn_compressor_kv.weight"),
    make_rule("self_attn.compressor.kv_norm.weight", "attn_compressor_norm.weight"),
    make_rule("self_attn.compressor.gate_proj.weight", "attn_compressor_gate.weight"),
    make_rule("self_attn.indexer.k_proj.weight", "indexer.attn_k.weight"),
    make_rule("self_attn.indexer.k_norm.weight", "indexer.k_norm.weight"),
    make_rule("self_attn.indexer.q_b_proj.weight", "indexer.attn_q_b.weight"),
    make_rule("self_attn.indexer.weights_proj.weight", "indexer.proj.weight"),
    make_rule("mlp.gate.weight", "ffn_gate_inp.weight"),
    make_rule("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
    *[make_rule(f"mlp.shared_experts.{p}_proj.weight", f"ffn_{p}_shexp.weight") for p in ("gate", "up", "down")],
    *[make_rule(f"mlp.experts.switch_mlp.{p}_proj.weight", f"ffn_{p}_exps.weight") for p in ("gate", "up", "down")],
]

# deepseek41_metadata.py metadata(): per-field keys (u32 / f32 / str / bool / u32 arrays).
_V41_U32 = (
    "vocab_size",
    "hidden_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "max_position_embeddings",
    "sliding_window",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "candidate_source_layer_id",
    "candidate_topk_blocks",
    "candidate_block_size",
    "hc_mult",
    "hc_sinkhorn_iters",
    "rope_theta",
    "compress_rope_theta",
)
_V41_F32 = ("rms_norm_eps", "hc_eps", "swiglu_limit", "routed_scaling_factor")
_V41_STR = ("scoring_func", "hidden_act", "topk_method")
_V41_ARR = ("kv_source_layer_ids", "index_source_layer_ids")
_V41_ROPE = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")


def _v41_kv(config: dict, args) -> list:
    a, t = "deepseek41", text_part(config)

    def val(k):
        return t.get(k, getattr(args, k, None))

    kv = []
    for k in _V41_U32:
        v = val(k)
        if v is not None and not (isinstance(v, int) and v < 0):
            kv.append((f"{a}.{k}", v, num_kind(v)))
    kv += [(f"{a}.{k}", float(val(k)), "f32") for k in _V41_F32 if val(k) is not None]
    kv += [(f"{a}.{k}", str(val(k)), "str") for k in _V41_STR if val(k) is not None]
    if val("norm_topk_prob") is not None:
        kv.append((f"{a}.norm_topk_prob", bool(val("norm_topk_prob")), "bool"))
    n = int(val("num_hidden_layers"))
    kv.append((f"{a}.compress_ratios", [int(r) for r in (val("compress_ratios") or [])][:n], "arr_u32"))
    kv += [(f"{a}.{k}", [int(x) for x in (val(k) or [])], "arr_u32") for k in _V41_ARR]
    rs = val("rope_scaling")
    if isinstance(rs, dict):
        kv += [(f"{a}.rope_scaling.{k}", float(rs[k]), "f32") for k in _V41_ROPE if rs.get(k) is not None]
    return kv


def _v41_derive(meta: dict) -> dict:
    """deepseek41.* keys (named after the HF fields) -> config; ds4's own GGUFs also
    carry the whole config in deepseek41.config, which config_from_kv prefers."""
    a = "deepseek41"
    c = {"model_type": "deepseek_v41"}
    for k in _V41_U32 + _V41_F32 + _V41_STR + ("norm_topk_prob", "compress_ratios") + _V41_ARR:
        v = meta.get(f"{a}.{k}")
        if v is not None:
            c[k] = int(v) if k in _V41_U32 and float(v).is_integer() else v
    if f"{a}.num_hidden_layers" not in meta:
        raise ValueError(f"GGUF metadata key {a}.num_hidden_layers (or {a}.config) is missing")
    rs = {k: meta[f"{a}.rope_scaling.{k}"] for k in _V41_ROPE if meta.get(f"{a}.rope_scaling.{k}") is not None}
    if rs:
        if "original_max_position_embeddings" in rs:
            rs["original_max_position_embeddings"] = int(rs["original_max_position_embeddings"])
        c["rope_scaling"] = {"type": "yarn", **rs}
    c.update(tok_ids(meta))
    return c


DEEPSEEK_V41 = Family(
    name="deepseek_v41",
    arch="deepseek41",
    model_types=("deepseek_v41",),
    display="DeepSeek-V4.1",
    top=_V41_TOP,
    layer=_V41_LAYER,
    config_key="deepseek41.config",
    fuse_experts=False,
    keep_f32=("ffn_gate_inp.weight",),
    kv_fn=_v41_kv,
    derive_fn=_v41_derive,
)
