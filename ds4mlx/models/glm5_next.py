"""GLM 5.3 Flash, text model (transformers `glm5_next` / `glm5_next_text`) in MLX.

One decoder layer, with mHC hyper-connections (`hc_mult` residual streams, as DeepSeek V4):

    x [B, T, hc, H] --attn_hc(pre)--> collapsed --input_layernorm--> mixer --attn_hc(post)--> x
                    --ffn_hc(pre)---> collapsed --post_attention_layernorm--> MLP --ffn_hc(post)--> x

and the final collapse is an unweighted mean over the streams, then `norm`.

The mixer is, per `layer_types[i]`:
* "linear_attention": KDA (models/kda.py).  q, k, v projections -> short causal conv + SiLU
  -> l2-normalised q, k (q scaled by Dk^-1/2); per-channel forget gate
  `g = linear_lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))` (or, without a
  bound, `-exp(A_log) * softplus(.)`); `beta = sigmoid(b_proj(x))`; output
  `o_proj(RMSNorm(o) * sigmoid(g_b(g_a(x))))` per head.  Chunked form for prefill,
  recurrent form for 1-token decode.
* "indexed_attention": NoPE MLA with GLM 5.3's k-pool DSA indexer (models/mla.py).  A
  "shared" indexed layer reuses the selection of the layer right before it, which must
  be an indexed "full" layer (transformers raises otherwise).

MLPs: "dense" SwiGLU or MoE (models/sigmoid_moe.py), every SwiGLU clamped at `swiglu_limit`.

Caches: `kda.LinearCache` (conv context + recurrent state) or `mla.MLACache` per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..kernels.hyper_connection import hc_post  # fused on a GPU
from ..runtime.forward_context import PREFILL, LiveView
from ..runtime.steering import ATTN, FFN, steer  # directional steering hook (steering.py)
from .cache import BackboneForward
from .causal_lm import BaseModelArgs, CausalLM
from .kda import LinearCache, kda, l2norm, short_conv
from .layers import ActivationDtype, HyperConnection, RMSNorm
from .mla import KPoolIndexer, MLAAttention, MLACache, indexer_types_from
from .sigmoid_moe import layer_mlp, sanitize_experts

LINEAR, INDEXED = "linear_attention", "indexed_attention"


@dataclass
class ModelArgs(BaseModelArgs):
    """Hugging Face `Glm5NextTextConfig` fields (same names and defaults).  A full
    `Glm5NextConfig` (model_type "glm5_next") is read through its `text_config`."""

    model_type: str = "glm5_next_text"
    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 154820
    bos_token_id: int | None = None
    eos_token_id: Any = None
    tie_word_embeddings: bool = False
    mlp_layer_types: list | None = None
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    head_dim: int = 0
    layer_types: list | None = None
    indexer_types: list | None = None
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    # legacy / hub spellings folded in by __post_init__ (as transformers does)
    index_topk_pattern: Any = None
    index_topk_freq: int | None = None
    index_skip_topk_offset: int | None = None
    linear_attn_config: dict | None = None

    @classmethod
    def from_dict(cls, config: dict) -> ModelArgs:
        if isinstance(config.get("text_config"), dict):  # the VLM config: its text part
            outer = {k: config[k] for k in ("tie_word_embeddings",) if k in config}
            config = {**outer, **config["text_config"]}
        return super().from_dict(config)

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] * min(3, n) + ["sparse"] * max(0, n - 3)
        if self.layer_types is None:
            self.layer_types = [LINEAR if i % 4 != 3 else INDEXED for i in range(n)]
        self.layer_types = [INDEXED if t == "full_attention" else t for t in self.layer_types]
        if self.indexer_types is None:
            self.indexer_types = indexer_types_from(
                self.index_topk_pattern, self.index_topk_freq, self.index_skip_topk_offset, n
            )
        la = self.linear_attn_config
        if la is not None:
            self.linear_head_dim = la.get("head_dim", self.linear_head_dim)
            self.linear_num_heads = la.get("num_heads", self.linear_num_heads)
            self.linear_conv_kernel_dim = la.get("short_conv_kernel_size", self.linear_conv_kernel_dim)
            self.linear_lower_bound = la.get("gate_lower_bound", self.linear_lower_bound)
            if la.get("safe_gate", True) and self.linear_lower_bound is None:
                self.linear_lower_bound = -5.0
        self.head_dim = self.qk_rope_head_dim
        for name, types, allowed in (
            ("layer_types", self.layer_types, (LINEAR, INDEXED)),
            ("mlp_layer_types", self.mlp_layer_types, ("dense", "sparse")),
            ("indexer_types", self.indexer_types, ("full", "shared")),
        ):
            if len(types) < n or any(t not in allowed for t in types[:n]):
                raise ValueError(f"bad {name}: {types}")
        if self.num_attention_heads != self.num_key_value_heads:
            raise ValueError("num_attention_heads must equal num_key_value_heads")
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            raise ValueError("index_topk must be a positive multiple of index_kpool")
        if self.q_lora_rank is None:
            raise ValueError("q_lora_rank is required")
        if self.qk_rope_head_dim:
            raise ValueError("GLM 5.3 attention is NoPE: qk_rope_head_dim must be 0")
        if not self.index_kpool_always_select_tail:
            # transformers then leaves the first index_kpool-1 queries with no key at all, and
            # its eager mask makes them attend uniformly to every key, future ones included.
            raise ValueError("index_kpool_always_select_tail=False is not supported")
        for i in range(n):
            if self.layer_types[i] == INDEXED and self.indexer_types[i] == "shared":
                if i == 0 or self.layer_types[i - 1] != INDEXED or self.indexer_types[i - 1] != "full":
                    raise ValueError(f"shared indexed layer {i} must directly follow an indexed 'full' layer")

    def hands_on_selection(self, i: int) -> bool:
        """Whether indexed layer i passes its selection to layer i+1 (transformers' next_skip_topk)."""
        nxt = self.indexer_types[min(i + 1, len(self.indexer_types) - 1)]
        return self.layer_types[i] == INDEXED and self.indexer_types[i] == "full" and nxt == "shared"


# ----------------------------------------------------------------------------- KDA


class ShortConv(nn.Module):
    """Depthwise causal conv parameters, torch layout [channels, 1, kernel]."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel))


class ForgetGate(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H, D = args.linear_num_heads, args.linear_head_dim
        self.f_a_proj = nn.Linear(args.hidden_size, D, bias=False)
        self.f_b_proj = nn.Linear(D, H * D, bias=False)
        self.dt_bias = mx.zeros((H * D,))
        self.A_log = mx.zeros((H,))
        self._H, self._D, self._lb = H, D, args.linear_lower_bound

    def __call__(self, x: mx.array) -> mx.array:
        """Per-channel log decay [B, T, H, D] (float32, <= 0)."""
        f = self.f_b_proj(self.f_a_proj(x)).astype(mx.float32) + self.dt_bias.astype(mx.float32)
        f = f.reshape(*x.shape[:2], self._H, self._D)
        rate = mx.exp(self.A_log.astype(mx.float32))[:, None]
        if self._lb is not None:
            return self._lb * mx.sigmoid(rate * f)
        return -rate * nn.softplus(f)


class GatedRMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        y = mx.fast.rms_norm(x.astype(mx.float32), self.weight.astype(mx.float32), self.eps)
        return y * mx.sigmoid(gate.astype(mx.float32))


class LinearAttention(nn.Module):
    """KDA mixer (transformers' `Glm5NextTextLinearAttention`; same parameter names)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        H, D, hid = args.linear_num_heads, args.linear_head_dim, args.hidden_size
        self.q_proj = nn.Linear(hid, H * D, bias=False)
        self.k_proj = nn.Linear(hid, H * D, bias=False)
        self.v_proj = nn.Linear(hid, H * D, bias=False)
        self.conv1d = ShortConv(3 * H * D, args.linear_conv_kernel_dim)
        self.forget_gate = ForgetGate(args)
        self.b_proj = nn.Linear(hid, H, bias=False)
        self.g_a_proj = nn.Linear(hid, D, bias=False)
        self.g_b_proj = nn.Linear(D, H * D, bias=False)
        self.o_norm = GatedRMSNorm(D, args.rms_norm_eps)
        self.o_proj = nn.Linear(H * D, hid, bias=False)
        self._H, self._D = H, D

    def forward(self, x: mx.array, ctx, cache: LinearCache | None = None) -> mx.array:
        """The mixer over the query rows of `ctx` (runtime/forward_context.py `StepContext`;
        x [1, T, hidden]): PREFILL one row, the chunk, over the live `cache` (the chunked
        recurrence); DECODE / CHAIN row t over ctx.views[t]'s conv and recurrent state.  The
        projections and gates run once for all rows; each row's short conv and recurrence run
        over its own state, in row order (a chain's row t continues row t - 1's state)."""
        views = [LiveView(cache, ("conv", "recurrent"))] if ctx.kind == PREFILL else ctx.views
        convs = []
        for (m,), view in zip(ctx.split(self._mixed(x)), views):
            out, conv = short_conv(m, self.conv1d.weight, next(view))
            view.put(conv)
            convs.append(out)
        outs = []
        for row, view in zip(ctx.split(*self._recurrence_inputs(x, ctx.join(convs))), views):
            o, state = kda(*row, next(view))
            view.put(state)
            outs.append(o)
        return self._output(x, ctx.join(outs))

    def _mixed(self, x: mx.array) -> mx.array:
        """The q, k, v projections side by side [B, C, 3 * H * D]: the short conv's input."""
        return mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)

    def _recurrence_inputs(self, x: mx.array, mixed: mx.array) -> tuple:
        """(q, k, v, g, beta) of the recurrence from the input x and the short conv's output."""
        B, C, _ = x.shape
        H, D = self._H, self._D
        q, k, v = (mixed[..., i * H * D : (i + 1) * H * D].reshape(B, C, H, D) for i in range(3))
        q = l2norm(q) * D**-0.5
        k = l2norm(k)
        g = self.forget_gate(x)
        beta = mx.sigmoid(self.b_proj(x).astype(mx.float32))
        return q, k, v, g, beta

    def _output(self, x: mx.array, o: mx.array) -> mx.array:
        """The recurrence's output o [B, C, H, Dv] gated, normed and projected back."""
        B, C, _ = x.shape
        H, D = self._H, self._D
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(B, C, H, D)
        o = self.o_norm(o, gate).astype(x.dtype).reshape(B, C, H * D)
        return self.o_proj(o)


# ----------------------------------------------------------------------------- layers


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        self.block_type = args.layer_types[i]
        if self.block_type == LINEAR:
            self.self_attn = LinearAttention(args)
        else:
            indexer = None
            if args.indexer_types[i] == "full":
                indexer = KPoolIndexer(
                    args.hidden_size,
                    args.q_lora_rank,
                    args.index_n_heads,
                    args.index_head_dim,
                    args.index_topk,
                    args.index_kpool,
                )
            self.self_attn = MLAAttention(
                hidden=args.hidden_size,
                n_heads=args.num_attention_heads,
                q_lora_rank=args.q_lora_rank,
                kv_lora_rank=args.kv_lora_rank,
                qk_nope_head_dim=args.qk_nope_head_dim,
                qk_rope_head_dim=0,
                v_head_dim=args.v_head_dim,
                bias=args.attention_bias,
                q_norm_eps=args.rms_norm_eps,
                kv_norm_eps=args.rms_norm_eps,
                scale=args.qk_nope_head_dim**-0.5,
                rope=None,
                indexer=indexer,
            )
        self.mlp = layer_mlp(args, i, args.swiglu_limit)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        hc = (args.hc_mult, args.hidden_size, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)
        self._hands_on = args.hands_on_selection(i)

    def forward(self, x: mx.array, ctx, prev, cache=None):
        """The layer over the query rows of `ctx` (runtime/forward_context.py; x [1, T, hc, H]):
        a PREFILL chunk over the live `cache`, or the static rows over their views -> (x, the
        selection the next layer inherits, or None; `prev` the one this layer got)."""
        post, comb, collapsed = self.attn_hc(x)
        h = self.input_layernorm(collapsed)
        sel = None
        if self.block_type == LINEAR:
            h = self.self_attn.forward(h, ctx, cache)
        else:
            h, sel = self.self_attn.forward(h, ctx, prev, cache)
        x, post, comb, collapsed = self.ffn_hc.after_post(x, steer(self, ATTN, h), post, comb)
        x = hc_post(x, steer(self, FFN, self.mlp(self.post_attention_layernorm(collapsed))), post, comb)
        return x, sel if self._hands_on else None


class Glm5NextTextModel(ActivationDtype, nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self._hc = args.hc_mult

    def forward(self, ids: mx.array, ctx) -> mx.array:
        """The forward of tokens ids [1, T] over `ctx` (runtime/forward_context.py: a PREFILL
        chunk of one session, T sessions' next tokens, or one session's next T as a chain) ->
        hidden [1, T, H] after the final norm.  PREFILL advances the caches; the static kinds
        leave the rows' new states in their views."""
        h = self.embed(ids)
        x = mx.broadcast_to(h[:, :, None, :], (*h.shape[:2], self._hc, h.shape[-1]))
        caches = ctx.views[0] if ctx.kind == PREFILL else [None] * len(self.layers)
        sel = None
        for layer, c in zip(self.layers, caches):
            x, sel = layer.forward(x, ctx, sel, c)
        if ctx.kind == PREFILL:
            for c in caches:
                c.offset += ids.shape[1]
        return self.norm(x.mean(axis=2))


class Model(BackboneForward, CausalLM):
    """Glm5NextTextModel + lm_head: `model(ids [1, T], cache) -> logits [1, T, V]`, the PREFILL
    kind of its one `forward(ids, ctx)` (models/cache.py `BackboneForward`)."""

    # a chain's rows step the KDA recurrence one token each (every row's state kept) and
    # append to the MLA rows: row t reads row t - 1's state
    static_rows_chain = True
    static_steers = True  # steering edits the static forward too (the stepper runs it eagerly)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Glm5NextTextModel(args))

    def static_state(self, cache: list, ahead: int = 1) -> list:
        a = self.args
        H, D = a.linear_num_heads, a.linear_head_dim
        for c in cache:  # the linear layers' zero state (what None means) before their first step
            if isinstance(c, LinearCache) and c.conv is None:
                c.conv = mx.zeros((1, a.linear_conv_kernel_dim - 1, 3 * H * D), self.static_dtype())
                c.recurrent = mx.zeros((1, H, D, D), mx.float32)
        return super().static_state(cache, ahead)

    def make_cache(self) -> list:
        a = self.args
        out = []
        for i in range(a.num_hidden_layers):
            if a.layer_types[i] == LINEAR:
                out.append(LinearCache())
            else:
                full = a.indexer_types[i] == "full"
                out.append(
                    MLACache(
                        a.kv_lora_rank, 0, "kpool" if full else None, a.index_head_dim, a.index_kpool if full else 0
                    )
                )
        return out

    def sanitize(self, weights: dict) -> dict:
        """transformers' in-memory names -> this module's parameters.

        Accepts the text model under `model.` (what a text causal LM holds) or the VLM's
        `model.language_model.` prefix; vision tower, MTP layers (index >= num_hidden_layers)
        and `shared_head` tensors are dropped.  Per-expert hub names are stacked."""
        n = self.args.num_hidden_layers
        out = {}
        for k, v in weights.items():
            if k.startswith("model.language_model."):
                k = "model." + k[len("model.language_model.") :]
            elif k.startswith(("model.visual.", "visual.", "model.vision")):
                continue
            if "rotary_emb" in k or ".shared_head." in k:
                continue
            if k.startswith("model.layers.") and int(k.split(".")[2]) >= n:
                continue
            out[k] = v
        out = sanitize_experts(out)
        return self.drop_tied_head(out)


# The demo model (ds4mlx.load("demo:glm5_next")): GLM 5.3 Flash's architecture scaled down
# (KDA + k-pool DSA MLA + mHC), random weights.  GLM's own tokenizer is not available
# offline, so the demo reuses the DeepSeek tokenizer; hence vocab_size 129280 and
# DeepSeek's bos/eos ids.
DEMO_CONFIG = {
    "model_type": "glm5_next_text",
    "vocab_size": 129280,
    "pad_token_id": None,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "layer_types": [LINEAR, INDEXED, INDEXED, LINEAR],
    "indexer_types": ["full", "full", "shared", "full"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 0,
    "qk_nope_head_dim": 64,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.5,
    "index_topk": 64,
    "index_kpool": 16,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "linear_num_heads": 4,
    "linear_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "swiglu_limit": 10.0,
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "demo_model": True,
}
