"""GLM 5.2 (transformers `glm_moe_dsa`, GlmMoeDsaForCausalLM) in MLX.

A plain pre-norm decoder:

    x = x + self_attn(input_layernorm(x))           MLA + DSA (models/mla.py)
    x = x + mlp(post_attention_layernorm(x))        dense SwiGLU or MoE (models/sigmoid_moe.py)

Per layer `indexer_types[i]` is "full" (the layer runs its own token-level DSA indexer)
or "shared" (it reuses the selection of the layer before it, which may itself be
inherited).  Query t attends every causal key while t < index_topk, then the
`index_topk` best ones.  Rope is interleaved on the trailing `qk_rope_head_dim` channels
of the MLA heads and on the *leading* ones of the indexer heads.  Note transformers'
quirks kept here: `q_a_layernorm` / `kv_a_layernorm` use eps 1e-6 whatever
`rms_norm_eps` says, and the config's `head_dim` is the rope dim.

Caches: one `mla.MLACache` per layer (latent, roped key slice, indexer keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..runtime.forward_context import PREFILL, StepContext
from ..runtime.steering import ATTN, FFN, steer  # directional steering hook (steering.py)
from .cache import BackboneForward
from .causal_lm import BaseModelArgs, CausalLM
from .layers import ActivationDtype, RMSNorm, RoPE, attention_factor_from_params, inv_freq_from_params
from .mla import DSAIndexer, MLAAttention, MLACache, indexer_types_from
from .sigmoid_moe import layer_mlp, sanitize_experts


@dataclass
class ModelArgs(BaseModelArgs):
    """Hugging Face `GlmMoeDsaConfig` fields (same names and defaults)."""

    model_type: str = "glm_moe_dsa"
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: Any = 1
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    mlp_layer_types: list | None = None
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    mlp_bias: bool = False
    head_dim: int = 64
    first_k_dense_replace: int = 3
    layer_types: list | None = None
    indexer_types: list | None = None
    # legacy / hub spellings folded in by __post_init__ (as transformers does)
    index_topk_pattern: Any = None
    index_topk_freq: int | None = None
    index_skip_topk_offset: int | None = None
    num_experts: int | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.num_experts is not None:
            self.n_routed_experts = self.num_experts
        if self.indexer_types is None:
            self.indexer_types = indexer_types_from(
                self.index_topk_pattern, self.index_topk_freq, self.index_skip_topk_offset, n
            )
        self.indexer_types = list(self.indexer_types)
        if len(self.indexer_types) < n or any(t not in ("full", "shared") for t in self.indexer_types[:n]):
            raise ValueError(f"bad indexer_types: {self.indexer_types}")
        if self.indexer_types[0] != "full":
            raise ValueError("layer 0 must run its own indexer (indexer_types[0] == 'full')")
        self.head_dim = self.qk_rope_head_dim
        if self.mlp_layer_types is None:
            k = min(self.first_k_dense_replace, n)
            self.mlp_layer_types = ["dense"] * k + ["sparse"] * (n - k)
        self.mlp_layer_types = list(self.mlp_layer_types)
        if len(self.mlp_layer_types) < n or any(t not in ("dense", "sparse") for t in self.mlp_layer_types[:n]):
            raise ValueError(f"bad mlp_layer_types: {self.mlp_layer_types}")
        if self.layer_types is None:
            self.layer_types = ["indexed_attention"] * n
        rp = dict(self.rope_parameters or self.rope_scaling or {})
        if "type" in rp and "rope_type" not in rp:
            rp["rope_type"] = rp.pop("type")
        rp.setdefault("rope_type", "default")
        rp.setdefault("rope_theta", self.rope_theta if self.rope_theta is not None else 10000.0)
        self.rope_parameters = rp
        if self.q_lora_rank is None:
            raise ValueError("q_lora_rank is required")

    @property
    def softmax_scale(self) -> float:
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        rp = self.rope_parameters
        if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
            factor = rp["factor"]
            m = 0.1 * rp["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale = scale * m * m
        return scale


def make_rope(args: ModelArgs) -> RoPE | None:
    """The interleaved rope every layer shares (None without rope dims); the MTP head
    builds its own the same way (glm_moe_dsa_mtp.py)."""
    r, rp = args.qk_rope_head_dim, args.rope_parameters
    if not r:
        return None
    return RoPE(
        r,
        inv_freq_from_params(r, rp, args.max_position_embeddings),
        attention_factor_from_params(rp, args.max_position_embeddings),
    )


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, i: int, rope: RoPE):
        super().__init__()
        indexer = None
        if args.indexer_types[i] == "full":
            indexer = DSAIndexer(
                args.hidden_size,
                args.q_lora_rank,
                args.index_n_heads,
                args.index_head_dim,
                args.index_topk,
                rope,
                args.qk_rope_head_dim,
            )
        self.self_attn = MLAAttention(
            hidden=args.hidden_size,
            n_heads=args.num_attention_heads,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            bias=args.attention_bias,
            q_norm_eps=1e-6,
            kv_norm_eps=1e-6,
            scale=args.softmax_scale,
            rope=rope,
            indexer=indexer,
        )
        self.mlp = layer_mlp(args, i)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x, cache: MLACache, prev):
        """The layer over a chunk x [1, C, H] at the cache's position (the MTP head's block)."""
        return self.forward(x, StepContext.prefill(cache.offset, [cache]), prev, cache)

    def forward(self, x, ctx, prev, cache: MLACache | None = None):
        """The layer over the query rows of `ctx` (runtime/forward_context.py; x [1, T, H]): a
        PREFILL chunk over the live `cache`, or the static rows over their views -> (x, the
        selection a "shared" layer after it inherits: `prev` and it as `MLAAttention.forward`'s)."""
        h, sel = self.self_attn.forward(self.input_layernorm(x), ctx, prev, cache)
        x = x + steer(self, ATTN, h)
        return x + steer(self, FFN, self.mlp(self.post_attention_layernorm(x))), sel


class GlmMoeDsaModel(ActivationDtype, nn.Module):
    # called with (the final hidden states [1, T, H] after the final norm, their first
    # position) by every multi-token forward (prefill, speculative verify); None = off.
    # The MTP head drafts from these (models/glm_moe_dsa_mtp.py, speculative/mtp.py).
    stream_hook = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self._rope = make_rope(args)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i, self._rope) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, ids: mx.array, ctx) -> mx.array:
        """The forward of tokens ids [1, T] over `ctx` (runtime/forward_context.py: a PREFILL
        chunk of one session, T sessions' next tokens, or one session's next T as a chain) ->
        hidden [1, T, H] after the final norm.  PREFILL advances the caches and calls
        `stream_hook`; the static kinds leave the rows' new states in their views (the
        selections a "shared" layer inherits kept per row)."""
        x = self.embed(ids)
        caches = ctx.views[0] if ctx.kind == PREFILL else [None] * len(self.layers)
        sel = None
        for layer, c in zip(self.layers, caches):
            x, sel = layer.forward(x, ctx, sel, c)
        h = self.norm(x)
        if ctx.kind == PREFILL:
            if self.stream_hook is not None:
                self.stream_hook(h, ctx.row_pos[0])
            for c in caches:
                c.offset += ids.shape[1]
        return h


class Model(BackboneForward, CausalLM):
    """GlmMoeDsaForCausalLM: `model(ids [1, T], cache) -> logits [1, T, V]`, the PREFILL kind of
    its one `forward(ids, ctx)` (models/cache.py `BackboneForward`)."""

    static_rows_chain = True  # the MLA rows append only: a chain's row t reads row t - 1's buffers
    static_steers = True  # steering edits the static forward too (the stepper runs it eagerly)

    def __init__(self, args: ModelArgs):
        super().__init__(args, GlmMoeDsaModel(args))

    def make_cache(self) -> list[MLACache]:
        a = self.args
        return [
            MLACache(
                a.kv_lora_rank, a.qk_rope_head_dim, "dsa" if a.indexer_types[i] == "full" else None, a.index_head_dim
            )
            for i in range(a.num_hidden_layers)
        ]

    def sanitize(self, weights: dict) -> dict:
        """transformers' in-memory names (or per-expert hub names) -> this module's parameters;
        MTP layers (index >= num_hidden_layers: the loader moves them to `mtp_weights`
        first, see `is_mtp_tensor`) and rotary buffers are dropped."""
        n = self.args.num_hidden_layers
        out = {}
        for k, v in weights.items():
            if "rotary_emb" in k:
                continue
            if k.startswith("model.layers."):
                if int(k.split(".")[2]) >= n:
                    continue
            out[k] = v
        out = sanitize_experts(out)
        return self.drop_tied_head(out)


def is_mtp_tensor(name: str, config: dict) -> bool:
    """Whether tensor `name` belongs to a next-n (MTP) layer: GLM 4.5 / 5.x checkpoints
    store it as `model.layers.{i}.*` with i >= num_hidden_layers.  The loader keeps those
    in `model.mtp_weights` for `--mtp` (glm_moe_dsa_mtp.py) instead of the decoder."""
    parts = name.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return False
    return int(parts[2]) >= int(config.get("num_hidden_layers", ModelArgs.num_hidden_layers))


# The demo model (ds4mlx.load("demo:glm_moe_dsa")): GLM 5.2's architecture scaled down, random
# weights.  GLM's own tokenizer is not available offline, so the demo reuses the DeepSeek
# tokenizer; hence vocab_size 129280 and DeepSeek's bos/eos ids.
DEMO_CONFIG = {
    "model_type": "glm_moe_dsa",
    "vocab_size": 129280,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "index_topk": 64,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "indexer_types": ["full", "shared", "full", "shared"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "demo_model": True,
}
