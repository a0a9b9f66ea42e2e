"""GLM 5.2 (`glm-dsa`, llama.cpp / ds4 glm-dsa) and GLM 5.3 Flash (ds4's `glm5-next`)."""

from __future__ import annotations

import re

from .base import (
    HF_LAYER_RE,
    Family,
    GGUFMeta,
    kda_conv_rule,
    kv_b_join,
    kv_b_split,
    make_rule,
    matrix_rules,
    row_parts,
    to_f32,
    tok_ids,
    trunk_kv,
)


# ============================================================================= GLM DSA (GLM 5.2 / 5.3 attention)
def _glm_dsa_attention(with_pool: bool) -> list:
    """DSA MLA + indexer names shared by glm-dsa (llama.cpp / ds4 glm-dsa) and ds4's GLM 5.3."""
    kv_b = make_rule(
        "self_attn.kv_b_proj.weight", "attn_k_b.weight", "attn_v_b.weight", split=kv_b_split, join=kv_b_join
    )
    rules = [
        *matrix_rules("self_attn.q_a_proj", "attn_q_a"),
        make_rule("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
        *matrix_rules("self_attn.q_b_proj", "attn_q_b"),
        *matrix_rules("self_attn.kv_a_proj_with_mqa", "attn_kv_a_mqa"),
        make_rule("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"),
        kv_b,
        *matrix_rules("self_attn.o_proj", "attn_output"),
        make_rule("self_attn.indexer.wq_b.weight", "indexer.attn_q_b.weight"),
        make_rule("self_attn.indexer.wk.weight", "indexer.attn_k.weight"),
        make_rule("self_attn.indexer.k_norm.weight", "indexer.k_norm.weight"),
        make_rule("self_attn.indexer.k_norm.bias", "indexer.k_norm.bias"),
        make_rule("self_attn.indexer.weights_proj.weight", "indexer.proj.weight"),
    ]
    if with_pool:  # glm53_quantize.py add_dsa_attention: indexer.pool_ape / pool_gate
        rules += [
            make_rule("self_attn.indexer.index_kpool_compress_ape", "indexer.pool_ape.weight"),
            make_rule("self_attn.indexer.index_kpool_compress_gate", "indexer.pool_gate.weight"),
        ]
    return rules


_GLM_FFN = [
    make_rule("input_layernorm.weight", "attn_norm.weight"),
    make_rule("post_attention_layernorm.weight", "ffn_norm.weight"),
    *[make_rule(f"mlp.{p}_proj.weight", f"ffn_{p}.weight") for p in ("gate", "up", "down")],
    make_rule("mlp.gate.weight", "ffn_gate_inp.weight"),
    make_rule("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
    *[make_rule(f"mlp.shared_experts.{p}_proj.weight", f"ffn_{p}_shexp.weight") for p in ("gate", "up", "down")],
    *[make_rule(f"mlp.experts.{p}_proj", f"ffn_{p}_exps.weight") for p in ("gate", "up", "down")],
]
_GLM_TOP = [
    make_rule("model.embed_tokens.weight", "token_embd.weight"),
    make_rule("model.norm.weight", "output_norm.weight"),
    make_rule("lm_head.weight", "output.weight"),
]


def _leading(types: list, value: str) -> int:
    n = 0
    for t in types:
        if t != value:
            break
        n += 1
    return n


def _glm_dsa_kv(config: dict, args) -> list:
    a = "glm-dsa"
    n = args.num_hidden_layers
    rope = args.rope_parameters or {}
    kv = [
        (f"{a}.context_length", int(args.max_position_embeddings), "u32"),
        (f"{a}.embedding_length", args.hidden_size, "u32"),
        (f"{a}.block_count", n, "u32"),
        (f"{a}.nextn_predict_layers", 0, "u32"),
        (f"{a}.vocab_size", args.vocab_size, "u32"),
        (f"{a}.feed_forward_length", args.intermediate_size, "u32"),
        (f"{a}.expert_feed_forward_length", args.moe_intermediate_size, "u32"),
        (f"{a}.leading_dense_block_count", _leading(args.mlp_layer_types[:n], "dense"), "u32"),
        (f"{a}.expert_count", args.n_routed_experts, "u32"),
        (f"{a}.expert_used_count", args.num_experts_per_tok, "u32"),
        (f"{a}.expert_shared_count", args.n_shared_experts, "u32"),
        (f"{a}.expert_group_count", args.n_group, "u32"),
        (f"{a}.expert_group_used_count", args.topk_group, "u32"),
        (f"{a}.expert_weights_scale", float(args.routed_scaling_factor), "f32"),
        (f"{a}.expert_weights_norm", bool(args.norm_topk_prob), "bool"),
        (f"{a}.expert_gating_func", 2, "u32"),  # sigmoid (llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID)
        (f"{a}.attention.head_count", args.num_attention_heads, "u32"),
        (f"{a}.attention.head_count_kv", 1, "u32"),  # MLA, absorbed: one latent KV head
        (f"{a}.attention.key_length", args.kv_lora_rank + args.qk_rope_head_dim, "u32"),
        (f"{a}.attention.value_length", args.kv_lora_rank, "u32"),
        (f"{a}.attention.key_length_mla", args.qk_nope_head_dim + args.qk_rope_head_dim, "u32"),
        (f"{a}.attention.value_length_mla", args.v_head_dim, "u32"),
        (f"{a}.attention.q_lora_rank", args.q_lora_rank, "u32"),
        (f"{a}.attention.kv_lora_rank", args.kv_lora_rank, "u32"),
        (f"{a}.attention.layer_norm_rms_epsilon", float(args.rms_norm_eps), "f32"),
        (f"{a}.attention.indexer.head_count", args.index_n_heads, "u32"),
        (f"{a}.attention.indexer.key_length", args.index_head_dim, "u32"),
        (f"{a}.attention.indexer.top_k", args.index_topk, "u32"),
        (f"{a}.attention.indexer.types", list(args.indexer_types[:n]), "arr_str"),  # extension
        (f"{a}.rope.dimension_count", args.qk_rope_head_dim, "u32"),
        (f"{a}.rope.freq_base", float(rope.get("rope_theta", 10000.0)), "f32"),
    ]
    if rope.get("rope_type", "default") != "default":  # llama.cpp's rope.scaling.* keys
        kv += [(f"{a}.rope.scaling.type", str(rope["rope_type"]), "str")]
        for key, field_, kind in _ROPE_SCALING:
            if rope.get(field_) is not None:
                kv.append((f"{a}.rope.scaling.{key}", rope[field_], kind))
        if rope.get("mscale_all_dim") is not None:
            kv.append((f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * float(rope["mscale_all_dim"]), "f32"))
    return kv


# llama.cpp rope.scaling.* keys <- HF rope_parameters fields; the last two are ds4mlx
# extensions (llama.cpp keeps only 0.1 * mscale_all_dim, as yarn_log_multiplier).
_ROPE_SCALING = (
    ("factor", "factor", "f32"),
    ("original_context_length", "original_max_position_embeddings", "u32"),
    ("yarn_beta_fast", "beta_fast", "f32"),
    ("yarn_beta_slow", "beta_slow", "f32"),
    ("mscale", "mscale", "f32"),
    ("mscale_all_dim", "mscale_all_dim", "f32"),
)


def _rope_from_kv(g: GGUFMeta) -> dict:
    rope = {"rope_type": "default", "rope_theta": float(g("rope.freq_base", 10000.0))}
    kind = g("rope.scaling.type", None)
    if kind and kind not in ("none", "default"):
        rope["rope_type"] = kind
        for key, field_, k in _ROPE_SCALING:
            v = g(f"rope.scaling.{key}", None)
            if v is not None:
                rope[field_] = int(v) if k == "u32" else float(v)
        if "mscale_all_dim" not in rope and g("rope.scaling.yarn_log_multiplier", None) is not None:
            rope["mscale_all_dim"] = to_f32(float(g("rope.scaling.yarn_log_multiplier")) / 0.1)
    return rope


def _glm_routing(g: GGUFMeta) -> dict:
    """The MoE router's config fields, spelled alike by glm-dsa and glm5-next."""
    return {
        "n_routed_experts": int(g("expert_count")),
        "n_shared_experts": int(g("expert_shared_count", 1)),
        "num_experts_per_tok": int(g("expert_used_count")),
        "n_group": int(g("expert_group_count", 1)),
        "topk_group": int(g("expert_group_used_count", 1)),
        "routed_scaling_factor": float(g("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(g("expert_weights_norm", True)),
    }


def _glm_dsa_derive(meta: dict) -> dict:
    """glm-dsa keys -> GlmMoeDsaConfig fields (every layer runs its own indexer unless
    the indexer.types extension says otherwise, as in llama.cpp's GGUFs)."""
    g = GGUFMeta(meta, "glm-dsa")
    n = int(g("block_count")) - int(g("nextn_predict_layers", 0))
    rope = int(g("rope.dimension_count", 64))
    c = {
        "model_type": "glm_moe_dsa",
        "vocab_size": int(g("vocab_size")),
        "hidden_size": int(g("embedding_length")),
        "intermediate_size": int(g("feed_forward_length")),
        "moe_intermediate_size": int(g("expert_feed_forward_length")),
        "num_hidden_layers": n,
        "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": int(g("attention.head_count")),
        **_glm_routing(g),
        "first_k_dense_replace": int(g("leading_dense_block_count", 0)),
        "q_lora_rank": int(g("attention.q_lora_rank")),
        "kv_lora_rank": int(g("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(g("attention.key_length_mla")) - rope,
        "v_head_dim": int(g("attention.value_length_mla")),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "index_n_heads": int(g("attention.indexer.head_count")),
        "index_head_dim": int(g("attention.indexer.key_length")),
        "index_topk": int(g("attention.indexer.top_k")),
        "indexer_types": list(g("attention.indexer.types", ["full"] * n)),
        "rope_parameters": _rope_from_kv(g),
        "max_position_embeddings": int(g("context_length", 202752)),
        "tie_word_embeddings": False,
    }
    c.update(tok_ids(meta))
    return c


GLM_MOE_DSA = Family(
    name="glm_moe_dsa",
    arch="glm-dsa",
    model_types=("glm_moe_dsa",),
    display="GLM-5.2",
    top=_GLM_TOP,
    layer=_glm_dsa_attention(with_pool=False) + _GLM_FFN,
    keep_f32=("ffn_gate_inp.weight",),
    kv_fn=_glm_dsa_kv,
    derive_fn=_glm_dsa_derive,
)


# ============================================================================= GLM 5.3 Flash
# glm53_quantize.py: add_mhc (hc_*), add_linear_attention (kda_*), add_dsa_attention, add_ffn.
def _kda_channels(args):
    c = args.linear_num_heads * args.linear_head_dim
    return (c, c, c)


_kda_conv_split, _kda_conv_join = row_parts(_kda_channels)
_GLM53_LAYER = [
    *[make_rule(f"{s}_hc.{p}", f"hc_{s}_{p}.weight") for s in ("attn", "ffn") for p in ("fn", "base", "scale")],
    *matrix_rules("self_attn.q_proj", "kda_q"),
    *matrix_rules("self_attn.k_proj", "kda_k"),
    *matrix_rules("self_attn.v_proj", "kda_v"),
    kda_conv_rule("self_attn.conv1d.weight", _kda_conv_split, _kda_conv_join),
    make_rule("self_attn.forget_gate.f_a_proj.weight", "kda_f_a.weight"),
    make_rule("self_attn.forget_gate.f_b_proj.weight", "kda_f_b.weight"),
    make_rule("self_attn.forget_gate.dt_bias", "kda_dt_bias.weight"),
    make_rule("self_attn.forget_gate.A_log", "kda_a_log.weight"),
    make_rule("self_attn.b_proj.weight", "kda_beta.weight"),
    make_rule("self_attn.g_a_proj.weight", "kda_g_a.weight"),
    make_rule("self_attn.g_b_proj.weight", "kda_g_b.weight"),
    make_rule("self_attn.o_norm.weight", "kda_o_norm.weight"),
    *_glm_dsa_attention(with_pool=True),
    *_GLM_FFN,
]
# self_attn.o_proj is `kda_output` in KDA layers and `attn_output` in DSA layers
# (add_linear_attention / add_dsa_attention): `_Glm53Family` renames it to one of these
# two layer-type-specific stand-ins before the lookup (and back after reading).
_GLM53_LAYER = [r for r in _GLM53_LAYER if not r.hf.startswith("self_attn.o_proj.")]
_GLM53_LAYER += [
    make_rule(f"{tag}.{leaf}", f"{g}.{leaf}")
    for tag, g in (("kda_o", "kda_output"), ("dsa_o", "attn_output"))
    for leaf in ("weight", "bias")
]


def _glm5_next_kv(config: dict, args) -> list:
    a = "glm5-next"
    n = args.num_hidden_layers
    return [
        *trunk_kv(a, args),
        (f"{a}.feed_forward_length", args.intermediate_size, "u32"),
        (f"{a}.expert_feed_forward_length", args.moe_intermediate_size, "u32"),
        (f"{a}.expert_count", args.n_routed_experts, "u32"),
        (f"{a}.expert_used_count", args.num_experts_per_tok, "u32"),
        (f"{a}.expert_shared_count", args.n_shared_experts, "u32"),
        (f"{a}.leading_dense_block_count", _leading(args.mlp_layer_types[:n], "dense"), "u32"),
        (f"{a}.expert_weights_scale", float(args.routed_scaling_factor), "f32"),
        (f"{a}.expert_weights_norm", bool(args.norm_topk_prob), "bool"),
        (f"{a}.swiglu_limit", float(args.swiglu_limit or 0.0), "f32"),
        (f"{a}.attention.layer_norm_rms_epsilon", float(args.rms_norm_eps), "f32"),
        (f"{a}.attention.head_count", args.num_attention_heads, "u32"),
        (f"{a}.attention.key_length", args.qk_nope_head_dim + args.qk_rope_head_dim, "u32"),
        (f"{a}.attention.value_length", args.v_head_dim, "u32"),
        (f"{a}.attention.q_lora_rank", args.q_lora_rank, "u32"),
        (f"{a}.attention.kv_lora_rank", args.kv_lora_rank, "u32"),
        (f"{a}.attention.rope_dimension_count", args.qk_rope_head_dim, "u32"),
        (f"{a}.attention.indexer.head_count", args.index_n_heads, "u32"),
        (f"{a}.attention.indexer.key_length", args.index_head_dim, "u32"),
        (f"{a}.attention.indexer.top_k", args.index_topk, "u32"),
        (f"{a}.attention.indexer.pool_size", args.index_kpool, "u32"),
        (f"{a}.attention.indexer.types", list(args.indexer_types[:n]), "arr_str"),  # extension
        (f"{a}.linear_attention.head_count", args.linear_num_heads, "u32"),
        (f"{a}.linear_attention.head_dimension", args.linear_head_dim, "u32"),
        (f"{a}.linear_attention.conv_kernel", args.linear_conv_kernel_dim, "u32"),
        *(
            [(f"{a}.linear_attention.gate_lower_bound", float(args.linear_lower_bound), "f32")]
            if args.linear_lower_bound is not None
            else []
        ),
        (f"{a}.layer_types", [0 if t == "linear_attention" else 1 for t in args.layer_types[:n]], "arr_u32"),
        (f"{a}.mlp_layer_types", list(args.mlp_layer_types[:n]), "arr_str"),  # extension
        (f"{a}.hyper_connection.count", args.hc_mult, "u32"),
        (f"{a}.hyper_connection.sinkhorn_iterations", args.hc_sinkhorn_iters, "u32"),
        (f"{a}.hyper_connection.epsilon", float(args.hc_eps), "f32"),
        (f"{a}.expert_group_count", args.n_group, "u32"),  # extension (llama.cpp key)
        (f"{a}.expert_group_used_count", args.topk_group, "u32"),  # extension (llama.cpp key)
    ]


def _glm5_next_derive(meta: dict) -> dict:
    g = GGUFMeta(meta, "glm5-next")
    n = int(g("trunk_block_count", int(g("block_count")) - int(g("nextn_predict_layers", 0))))
    rope = int(g("attention.rope_dimension_count", 0))
    lt = [int(t) for t in g("layer_types")][:n]
    dense = int(g("leading_dense_block_count", 0))
    c = {
        "model_type": "glm5_next_text",
        "vocab_size": int(g("vocab_size")),
        "hidden_size": int(g("embedding_length")),
        "intermediate_size": int(g("feed_forward_length")),
        "moe_intermediate_size": int(g("expert_feed_forward_length")),
        "num_hidden_layers": n,
        "layer_types": ["linear_attention" if t == 0 else "indexed_attention" for t in lt],
        "mlp_layer_types": list(g("mlp_layer_types", ["dense"] * dense + ["sparse"] * (n - dense))),
        "indexer_types": list(g("attention.indexer.types", ["full"] * n)),
        "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": int(g("attention.head_count")),
        "q_lora_rank": int(g("attention.q_lora_rank")),
        "kv_lora_rank": int(g("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(g("attention.key_length")) - rope,
        "v_head_dim": int(g("attention.value_length")),
        **_glm_routing(g),
        "swiglu_limit": float(g("swiglu_limit", 10.0)),
        "index_topk": int(g("attention.indexer.top_k")),
        "index_kpool": int(g("attention.indexer.pool_size")),
        "index_n_heads": int(g("attention.indexer.head_count")),
        "index_head_dim": int(g("attention.indexer.key_length")),
        "linear_num_heads": int(g("linear_attention.head_count")),
        "linear_head_dim": int(g("linear_attention.head_dimension")),
        "linear_conv_kernel_dim": int(g("linear_attention.conv_kernel", 4)),
        "linear_lower_bound": g("linear_attention.gate_lower_bound", None),
        "hc_mult": int(g("hyper_connection.count", 4)),
        "hc_sinkhorn_iters": int(g("hyper_connection.sinkhorn_iterations", 20)),
        "hc_eps": float(g("hyper_connection.epsilon", 1e-6)),
        "max_position_embeddings": int(g("context_length", 1048576)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": False,
    }
    c.update(tok_ids(meta))
    return c


class _Glm53Family(Family):
    """GLM 5.3: `self_attn.o_proj` -> `kda_o` / `dsa_o` by layer type (see _GLM53_LAYER)."""

    def canonical(self, config, tensors):
        out = super().canonical(config, tensors)
        args = self.args(config)
        res = {}
        for k, v in out.items():
            x = HF_LAYER_RE.match(k)
            if x and x.group(2) in ("self_attn.o_proj.weight", "self_attn.o_proj.bias"):
                i = int(x.group(1))
                tag = "kda_o" if args.layer_types[i] == "linear_attention" else "dsa_o"
                k = f"model.layers.{i}.{tag}.{x.group(2).rsplit('.', 1)[1]}"
            res[k] = v
        return res

    def from_gguf(self, config, names, get):
        tensors, unknown = super().from_gguf(config, names, get)
        for k in [k for k in tensors if re.match(r"^model\.layers\.\d+\.(kda_o|dsa_o)\.", k)]:
            layer, _, leaf = k[len("model.layers.") :].split(".", 2)
            tensors[f"model.layers.{layer}.self_attn.o_proj.{leaf}"] = tensors.pop(k)
        return tensors, unknown


GLM5_NEXT = _Glm53Family(
    name="glm5_next",
    arch="glm5-next",
    model_types=("glm5_next", "glm5_next_text"),
    display="GLM-5.3-Flash",
    top=_GLM_TOP,
    layer=_GLM53_LAYER,
    keep_f32=("ffn_gate_inp.weight", "_conv.weight"),
    kv_fn=_glm5_next_kv,
    derive_fn=_glm5_next_derive,
)
