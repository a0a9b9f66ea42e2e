"""Qwen3.8 Flash Next: ds4's `qwen38-next` GGUFs (see the package docstring)."""

from __future__ import annotations

from .base import (
    CONFIG_KEY,
    Family,
    GGUFMeta,
    deinterleave_join,
    deinterleave_split,
    kda_conv_rule,
    make_rule,
    matrix_rules,
    plus_one_join,
    plus_one_split,
    row_parts,
    squeeze_split,
    tok_ids,
    trunk_kv,
    unsqueeze_join,
)


# ============================================================================= Qwen3.8 Flash Next
# qwen38_quantize.py: add_hc, add_gdn, add_qsa, add_ffn, add_ple_projections, build_plan.
def _gdn_sizes(args):
    k = args.linear_num_key_heads * args.linear_key_head_dim
    return (k, k, args.linear_num_value_heads * args.linear_value_head_dim)


def _qsa_index_sizes(args):
    return (args.indexer_n_heads * args.indexer_head_dim, args.indexer_head_dim)


_gdn_split, _gdn_join = row_parts(_gdn_sizes)
_idx_split, _idx_join = row_parts(_qsa_index_sizes)
_PLUS1 = {"split": plus_one_split, "join": plus_one_join}


def _qwen_hc(hf_prefix: str, g_prefix: str, inject: bool) -> list:
    rules = [
        make_rule(f"{hf_prefix}.input_mix_weight_down.weight", f"{g_prefix}_down.weight"),
        make_rule(f"{hf_prefix}.input_mix_weight_up.weight", f"{g_prefix}_up.weight"),
        make_rule(f"{hf_prefix}.hc_norm.weight", f"{g_prefix}_norm.weight", **_PLUS1),
    ]
    if inject:
        rules.append(make_rule(f"{hf_prefix}.block_inject_weight.weight", f"{g_prefix}_inject.weight"))
    return rules


_QWEN_TOP = [
    make_rule("model.embed_tokens.weight", "token_embd.weight"),
    make_rule("lm_head.weight", "output.weight"),
    *_qwen_hc("model.hyper_connection_mixer", "output_hc", inject=False),
]
_QWEN_LAYER = [
    *_qwen_hc("attn_hyper_connection", "hc_attn", inject=True),
    *_qwen_hc("mlp_hyper_connection", "hc_ffn", inject=True),
    # Gated DeltaNet (add_gdn)
    *matrix_rules("linear_attn.in_proj_qkv", ("kda_q", "kda_k", "kda_v"), split=_gdn_split, join=_gdn_join),
    kda_conv_rule("linear_attn.conv1d.weight", _gdn_split, _gdn_join),
    *matrix_rules("linear_attn.in_proj_z", "kda_gate"),
    *matrix_rules("linear_attn.in_proj_a", "kda_alpha"),
    *matrix_rules("linear_attn.in_proj_b", "kda_beta"),
    make_rule("linear_attn.A_log", "kda_a_log.weight"),
    make_rule("linear_attn.dt_bias", "kda_dt_bias.weight"),
    make_rule("linear_attn.norm.weight", "kda_o_norm.weight"),
    *matrix_rules("linear_attn.out_proj", "kda_output"),
    # QSA attention (add_qsa)
    *matrix_rules("self_attn.q_proj", ("attn_q", "attn_gate"), split=deinterleave_split, join=deinterleave_join),
    *matrix_rules("self_attn.k_proj", "attn_k"),
    *matrix_rules("self_attn.v_proj", "attn_v"),
    make_rule("self_attn.q_norm.weight", "attn_q_norm.weight", **_PLUS1),
    make_rule("self_attn.k_norm.weight", "attn_k_norm.weight", **_PLUS1),
    *matrix_rules("self_attn.o_proj", "attn_output"),
    make_rule(
        "self_attn.indexer.index_qk_proj.weight",
        "indexer.q_proj.weight",
        "indexer.k_proj.weight",
        split=_idx_split,
        join=_idx_join,
    ),
    make_rule("self_attn.indexer.q_layernorm.weight", "indexer.q_norm.weight", **_PLUS1),
    make_rule("self_attn.indexer.k_layernorm.weight", "indexer.k_norm.weight", **_PLUS1),
    # MoE (add_ffn)
    make_rule("mlp.gate.weight", "ffn_gate_inp.weight"),
    make_rule("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight", split=squeeze_split, join=unsqueeze_join),
    *[make_rule(f"mlp.experts.{p}_proj", f"ffn_{p}_exps.weight") for p in ("gate", "up", "down")],
    *[make_rule(f"mlp.shared_expert.{p}_proj.weight", f"ffn_{p}_shexp.weight") for p in ("gate", "up", "down")],
    # PLE (add_ple_projections; the n-gram table is ds4's sidecar per_layer_token_embd)
    make_rule("ple.conv1d.weight", "ple_conv1d.weight"),
    make_rule("ple.key_proj.weight", "ple_key.weight"),
    make_rule("ple.value_proj.weight", "ple_value.weight"),
    make_rule("ple.norm_conv.weight", "ple_norm_conv.weight", **_PLUS1),
    make_rule("ple.norm_key.weight", "ple_norm_key.weight", **_PLUS1),
    make_rule("ple.norm_query.weight", "ple_norm_query.weight", **_PLUS1),
    make_rule("ple.ple_embedding.ngram_embedding.weight", "ple_token_embd.weight"),  # extension
]
_QWEN_PLE_BUFFERS = (
    ".ple.ple_embedding.layer_multipliers",
    ".ple.ple_embedding.ngram_heads_offsets",
    ".ple.ple_embedding.ngram_heads_vocab_sizes",
)


def _qwen_kv(config: dict, args) -> list:
    from ..models.qwen4_exp_ple import head_tables, layer_multipliers

    a = "qwen38-next"
    n = args.num_hidden_layers
    kv = [
        *trunk_kv(a, args),
        (f"{a}.expert_feed_forward_length", args.moe_intermediate_size, "u32"),
        (f"{a}.expert_shared_feed_forward_length", args.shared_expert_intermediate_size, "u32"),  # extension
        (f"{a}.expert_count", args.num_experts, "u32"),
        (f"{a}.expert_used_count", args.num_experts_per_tok, "u32"),
        (f"{a}.expert_shared_count", 1, "u32"),
        (f"{a}.expert_weights_scale", 1.0, "f32"),
        (f"{a}.expert_weights_norm", bool(args.norm_topk_prob), "bool"),
        (f"{a}.swiglu_limit", 0.0, "f32"),
        (f"{a}.attention.layer_norm_rms_epsilon", float(args.rms_norm_eps), "f32"),
        (f"{a}.attention.head_count", args.num_attention_heads, "u32"),
        (f"{a}.attention.head_count_kv", args.num_key_value_heads, "u32"),
        (f"{a}.attention.key_length", args.head_dim, "u32"),
        (f"{a}.attention.value_length", args.head_dim, "u32"),
        (f"{a}.attention.rope_dimension_count", args.rotary_dim, "u32"),
        (f"{a}.rope.freq_base", float(args.rope_parameters["rope_theta"]), "f32"),
        (f"{a}.linear_attention.head_count", args.linear_num_value_heads, "u32"),
        (f"{a}.linear_attention.qk_head_count", args.linear_num_key_heads, "u32"),
        (f"{a}.linear_attention.head_dimension", args.linear_key_head_dim, "u32"),
        (f"{a}.linear_attention.value_head_dimension", args.linear_value_head_dim, "u32"),  # extension
        (f"{a}.linear_attention.conv_kernel", args.linear_conv_kernel_dim, "u32"),
        (f"{a}.linear_attention.output_gate", args.output_gate_type or args.hidden_act, "str"),  # extension
        (f"{a}.hyper_connection.count", args.hc_count, "u32"),
        (f"{a}.hyper_connection.low_rank", args.hc_lowrank, "u32"),
        (f"{a}.hyper_connection.epsilon", float(args.rms_norm_eps), "f32"),
        (f"{a}.layer_types", [0 if t == "linear_attention" else 1 for t in args.layer_types[:n]], "arr_u32"),
    ]
    if "indexed_attention" in args.layer_types:
        kv += [
            (f"{a}.attention.indexer.head_count", args.indexer_n_heads, "u32"),
            (f"{a}.attention.indexer.key_length", args.indexer_head_dim, "u32"),
            (f"{a}.attention.indexer.top_k", args.indexer_budget, "u32"),
            (f"{a}.attention.indexer.pool_size", args.indexer_compress_ratio, "u32"),
        ]
    if args.ple_layer_ids:
        heads = (args.ngram_size - 1) * args.heads_per_ngram
        sizes, offsets = head_tables(args.ngram_vocab_size_base, heads, 0)
        kv += [
            (f"{a}.ple.ngram_size", args.ngram_size, "u32"),
            (f"{a}.ple.heads_per_ngram", args.heads_per_ngram, "u32"),
            (f"{a}.ple.row_length", args.ple_embed_dim // heads, "u32"),
            (f"{a}.ple.conv_kernel", args.ple_conv_kernel_size, "u32"),
            (f"{a}.ple.layer", args.ple_layer_ids[0] - 1, "u32"),  # ds4: one PLE layer, 0-based
            (f"{a}.ple.layers", [i - 1 for i in args.ple_layer_ids], "arr_u32"),  # extension: all of them
            (f"{a}.ple.eos_token_id", args.eos_id, "u32"),
            (
                f"{a}.ple.layer_multipliers",
                layer_multipliers(args.vocab_size, args.ngram_size, 0, args.seed),
                "arr_u64",
            ),
            (f"{a}.ple.head_offsets", offsets, "arr_u64"),
            (f"{a}.ple.head_vocab_sizes", sizes, "arr_u64"),
        ]
    return kv


def _qwen_derive(meta: dict) -> dict:
    """qwen38-next keys -> Qwen4ExpTextConfig fields.  The PLE hash tables are checked
    against the ones the config yields (default seed, first head size as the n-gram
    vocabulary base); a mismatch is an error rather than a silently different model."""
    from ..models.qwen4_exp_ple import head_tables, layer_multipliers

    q = GGUFMeta(meta, "qwen38-next")
    n = int(q("trunk_block_count", q("block_count")))
    lt = [int(t) for t in q("layer_types")][:n]
    head_dim = int(q("attention.key_length"))
    c = {
        "model_type": "qwen4_exp_text",
        "vocab_size": int(q("vocab_size")),
        "hidden_size": int(q("embedding_length")),
        "num_hidden_layers": n,
        "layer_types": ["linear_attention" if t == 0 else "indexed_attention" for t in lt],
        "num_attention_heads": int(q("attention.head_count")),
        "num_key_value_heads": int(q("attention.head_count_kv")),
        "head_dim": head_dim,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(q("rope.freq_base", 10000000.0)),
            "partial_rotary_factor": int(q("attention.rope_dimension_count", head_dim)) / head_dim,
        },
        "linear_conv_kernel_dim": int(q("linear_attention.conv_kernel", 4)),
        "output_gate_type": q("linear_attention.output_gate", None),
        "linear_key_head_dim": int(q("linear_attention.head_dimension")),
        "linear_value_head_dim": int(q("linear_attention.value_head_dimension", q("linear_attention.head_dimension"))),
        "linear_num_key_heads": int(q("linear_attention.qk_head_count")),
        "linear_num_value_heads": int(q("linear_attention.head_count")),
        "num_experts": int(q("expert_count")),
        "num_experts_per_tok": int(q("expert_used_count")),
        "moe_intermediate_size": int(q("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(q("expert_shared_feed_forward_length", q("expert_feed_forward_length"))),
        "norm_topk_prob": bool(q("expert_weights_norm", True)),
        "hc_count": int(q("hyper_connection.count", 4)),
        "hc_lowrank": int(q("hyper_connection.low_rank")),
        "rms_norm_eps": float(q("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(q("context_length", 262144)),
        "tie_word_embeddings": False,
    }
    if 1 in lt:
        c.update(
            {
                "indexer_n_heads": int(q("attention.indexer.head_count")),
                "indexer_kv_heads": 1,
                "indexer_head_dim": int(q("attention.indexer.key_length")),
                "indexer_budget": int(q("attention.indexer.top_k")),
                "indexer_compress_ratio": int(q("attention.indexer.pool_size")),
            }
        )
    c.update(tok_ids(meta))
    if q("ple.layer", None) is not None:
        layers = [int(x) for x in q("ple.layers", [q("ple.layer")])]
        ngram, hpn = int(q("ple.ngram_size")), int(q("ple.heads_per_ngram"))
        heads = (ngram - 1) * hpn
        sizes = [int(x) for x in q("ple.head_vocab_sizes")]
        c.update(
            {
                "ple_layer_ids": [i + 1 for i in layers],
                "ple_embed_dim": int(q("ple.row_length")) * heads,
                "ple_conv_kernel_size": int(q("ple.conv_kernel", 4)),
                "ngram_size": ngram,
                "heads_per_ngram": hpn,
                "ngram_vocab_size_base": sizes[0],
                "eos_token_id": int(q("ple.eos_token_id", c.get("eos_token_id", 0))),
            }
        )
        want_sizes, _ = head_tables(sizes[0], heads, 0)
        want_mult = layer_multipliers(c["vocab_size"], ngram, 0, 1234)
        if want_sizes != sizes or want_mult != [int(x) for x in q("ple.layer_multipliers")]:
            raise ValueError(
                f"qwen38-next PLE hash tables do not follow from the default seed; this GGUF needs the {CONFIG_KEY} key"
            )
    return c


QWEN4_EXP = Family(
    name="qwen4_exp",
    arch="qwen38-next",
    model_types=("qwen4_exp", "qwen4_exp_text"),
    display="Qwen3.8-Flash-Next",
    top=_QWEN_TOP,
    layer=_QWEN_LAYER,
    drop=_QWEN_PLE_BUFFERS,
    keep_f32=(
        "ffn_gate_inp.weight",
        "_conv.weight",
        "ple_conv1d.weight",
        "_inject.weight",
        "kda_alpha.weight",
        "kda_beta.weight",
    ),
    kv_fn=_qwen_kv,
    derive_fn=_qwen_derive,
)
