"""The GLM 5.x multi-token-prediction head (`num_nextn_predict_layers: 1`), for `--mtp`.

GLM 4.5 / 5.x checkpoints store their next-n layer after the decoder's, as
`model.layers.{num_hidden_layers}.*` (transformers drops it; the loader keeps it in
`model.mtp_weights`, see glm_moe_dsa.is_mtp_tensor).  The graph is DeepSeek-V3's MTP
module, written here from vLLM's `glm4_moe_mtp.py` / `deepseek_mtp.py`
(Glm4MoeMultiTokenPredictorLayer, DeepSeekMultiTokenPredictorLayer): for target position
i with final hidden state h_i (the target model's output, after its final norm: what vLLM
hands its drafter) and the next token t_{i+1},

    e  = embed(t_{i+1}), zeroed at position 0     (vLLM: "masking inputs at position 0")
    x  = eh_proj([enorm(e) ; hnorm(h_i)])          (concat order: embedding first)
    x' = DecoderLayer(x) at position i             (one full GLM layer: MLA + its own DSA
                                                    indexer, routed MoE)
    logits(t_{i+2}) = head(shared_head.norm(x'))   (the model's lm_head, unless the
                                                    checkpoint carries shared_head.head)

The layer keeps its own MLA cache over the MTP positions (full attention, no window).  A
recursive draft (depth > 1) feeds x' back as the next position's hidden state, as
vLLM's proposer does.  The embedding is the model's unless the checkpoint carries the
layer's own `embed_tokens`.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from .glm_moe_dsa import DecoderLayer, ModelArgs, make_rope
from .layers import RMSNorm
from .mla import MLACache
from .sigmoid_moe import sanitize_experts

OWN = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


def layer_args(args: ModelArgs) -> ModelArgs:
    """The target's args with one more layer, the MTP one: its own indexer, routed MoE."""
    n = args.num_hidden_layers
    return dataclasses.replace(
        args,
        num_hidden_layers=n + 1,
        indexer_types=[*args.indexer_types[:n], "full"],
        mlp_layer_types=[*args.mlp_layer_types[:n], "sparse"],
    )


class SharedHead(nn.Module):
    """`shared_head`: the final norm, and the output head when the checkpoint has its own."""

    def __init__(self, args: ModelArgs, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if own_head:
            self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)


class MTPHead(nn.Module):
    window = None  # the MTP layer attends every MTP position (speculative/mtp.py)

    def __init__(self, args: ModelArgs, own_head: bool = False, own_embed: bool = False):
        super().__init__()
        H = args.hidden_size
        self.args = args
        self.block = DecoderLayer(layer_args(args), args.num_hidden_layers, make_rope(args))
        self.enorm = RMSNorm(H, args.rms_norm_eps)
        self.hnorm = RMSNorm(H, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = SharedHead(args, own_head)
        if own_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, H)

    @property
    def lm_head(self):
        """The checkpoint's own `shared_head.head`, or None (the model's lm_head)."""
        return self.shared_head.get("head")

    def make_cache(self) -> MLACache:
        a = self.args
        return MLACache(a.kv_lora_rank, a.qk_rope_head_dim, "dsa", a.index_head_dim)

    def __call__(self, hidden: mx.array, next_ids: mx.array, embed, cache: MLACache):
        """hidden [1, T, H] of positions cache.offset.., next_ids [1, T] the tokens after
        them, `embed` the model's embedding -> (x' [1, T, H], normed [1, T, H])."""
        e = (self.embed_tokens if "embed_tokens" in self else embed)(next_ids).astype(hidden.dtype)
        if cache.offset == 0:  # vLLM masks the embedding at position 0
            e = mx.concatenate([mx.zeros_like(e[:, :1]), e[:, 1:]], axis=1)
        x = self.eh_proj(mx.concatenate([self.enorm(e), self.hnorm(hidden)], axis=-1))
        x, _ = self.block(x, cache, None)
        cache.offset += next_ids.shape[1]
        return x, self.shared_head.norm(x)


def make_head(args: ModelArgs, names=()) -> MTPHead:
    """The head for checkpoint tensors `names` (the optional own output head / embedding)."""
    own = {head_param_name(k, args) for k in names}
    return MTPHead(args, own_head="shared_head.head.weight" in own, own_embed="embed_tokens.weight" in own)


def head_param_name(name: str, args: ModelArgs) -> str | None:
    """`model.layers.{N}.<rest>` (N = num_hidden_layers) -> this module's parameter name;
    None for another layer (a second next-n layer: only the first one drafts)."""
    prefix = f"model.layers.{args.num_hidden_layers}."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix) :]
    return rest if rest.split(".")[0] in OWN else "block." + rest


def head_weights(tensors: dict, args: ModelArgs) -> dict:
    """The checkpoint's MTP tensors -> this module's parameters (experts stacked/fused as
    the decoder's, models/sigmoid_moe.py)."""
    out = {}
    for k, v in tensors.items():
        name = head_param_name(k, args)
        if name is not None and "rotary_emb" not in name:
            out[name] = v
    return sanitize_experts(out)


def init_kind(name: str) -> str:
    """How a random head draws parameter `name` (speculative/mtp.py random_head)."""
    if name.endswith(("norm.weight", "layernorm.weight")):
        return "unit"
    if "e_score_correction_bias" in name:
        return "small"
    return "normal"
