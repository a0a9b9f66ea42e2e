"""Extra tiny DeepSeek-V4 oracle configurations for `make_tiny_deepseek_v4.py --config NAME`.

Each entry overrides the default CONFIG of make_tiny_deepseek_v4.py (`config`) and may set
the reference sequence length (`seq_len`), the stepwise-decode start (`stepwise_start`) and
the torch seed used before the model is built (`seed`, default 0).  Together with the
default config they cover every attention type (sliding, CSA, HCA), both MLP kinds (hash_moe,
moe), YaRN and plain compress rope, binding SwiGLU clamps, several hc_mult values and
sequences that cross many compression blocks and the sliding window.

Every config was checked to give min_topk_margin >= 3e-4 (see NOTES.md, "Top-k ties").
"""

CONFIGS = {
    # 150 tokens: 37 CSA rows (ratio 4, top-6), 9 HCA rows (ratio 16), window 16.
    "long": dict(
        seq_len=150,
        stepwise_start=61,
        seed=0,
        config=dict(
            hidden_size=64,
            moe_intermediate_size=24,
            num_hidden_layers=4,
            num_attention_heads=8,
            head_dim=16,
            partial_rotary_factor=0.5,  # qk_rope_head_dim 8 == index_head_dim: whole indexer head roped
            q_lora_rank=24,
            o_groups=4,
            o_lora_rank=8,
            n_routed_experts=8,
            num_experts_per_tok=3,
            layer_types=[
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "sliding_attention",
                "compressed_sparse_attention",
            ],
            mlp_layer_types=["moe", "hash_moe", "moe", "hash_moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            sliding_window=16,
            index_n_heads=16,
            index_head_dim=8,
            index_topk=6,
            hc_mult=3,
            hc_sinkhorn_iters=10,
            rope_theta=5000.0,
            compress_rope_theta=40000.0,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 16,
                "beta_slow": 2,
            },
            max_position_embeddings=512,
            swiglu_limit=0.5,  # small enough that the clamps bind
            initializer_range=0.25,  # larger scores: top-k margins >= 3e-4 at 150 tokens
        ),
    ),
    # 100 tokens, odd ratios: CSA ratio 3 (33 rows, top-4), HCA ratio 6, window 5, hc_mult 2,
    # sigmoid router, plain (non-YaRN) compress rope, tied embeddings, one o-group.
    "odd": dict(
        seq_len=100,
        stepwise_start=37,
        seed=0,
        config=dict(
            hidden_size=32,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=2,
            head_dim=24,
            partial_rotary_factor=1 / 3,  # qk_rope_head_dim 8
            q_lora_rank=16,
            o_groups=1,
            o_lora_rank=16,
            n_routed_experts=6,
            num_experts_per_tok=2,
            scoring_func="sigmoid",
            routed_scaling_factor=2.0,
            layer_types=[
                "heavily_compressed_attention",
                "compressed_sparse_attention",
                "sliding_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 6},
            sliding_window=5,
            index_n_heads=16,
            index_head_dim=12,
            index_topk=4,
            hc_mult=2,
            hc_sinkhorn_iters=20,
            rope_theta=10000.0,
            compress_rope_theta=160000.0,
            rope_parameters=None,
            max_position_embeddings=256,
            swiglu_limit=1.0,
            tie_word_embeddings=True,
            initializer_range=0.2,  # top-k margins >= 3e-4
        ),
    ),
}
