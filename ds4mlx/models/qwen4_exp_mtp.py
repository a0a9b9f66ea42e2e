"""The Qwen3.8 Flash Next (`qwen4_exp`) multi-token-prediction head, for `--mtp`.

transformers' Qwen4Exp models ignore the checkpoint's `mtp.*` tensors; the loader keeps
them in `model.mtp_weights`.  This family's hyper-connections change Qwen3-Next's MTP
neck (one `fc` on [embedding ; hidden]): the head drafts from the target's residual
streams x_i [hc, H] after the last layer, before the final mixer, and fuses them per
stream.  Written from SGLang's `models/qwen4_exp_mtp.py` (Qwen4ExpForCausalLMMTP,
`_fuse_residual_linear_shared`) and `models/qwen4_exp.py` (Qwen4ExpModel with
is_nextn: one full-attention layer, no PLE, its own final mixer): for target position i
and the next token t_{i+1},

    e   = fc_embedding(pre_fc_norm_embedding(embed(t_{i+1})))           [H]
    s   = pre_fc_norm_hidden(flat(x_i)) viewed as [hc, H]                (one (1+w) RMSNorm
                                                                          over all hc*H)
    y   = e + fc_hidden(s_j)  for each stream j                         [hc, H]
    y'  = DecoderLayer(y) at position i      (qwen4_exp.DecoderLayer: indexed attention
                                              with the QSA indexer, MoE, hyper-connections)
    logits(t_{i+2}) = lm_head(hyper_connection_mixer(y'))               (lm_head shared)

Checkpoint names: `mtp.fc_embedding`, `mtp.fc_hidden`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.hyper_connection_mixer.*`.  The
layer keeps its own attention cache over the MTP positions (no window).  A recursive
draft (depth > 1) feeds y' back as the next position's streams (SGLang's
`hc_hidden_states`).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from .qwen4_exp import INDEXED, AttentionCache, DecoderLayer, GatedResidual, ModelArgs, OffsetRMSNorm, make_rope

OWN = ("fc_embedding", "fc_hidden", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "hyper_connection_mixer")


def layer_args(args: ModelArgs) -> ModelArgs:
    """The target's args for the MTP layer alone: one indexed-attention layer, no PLE."""
    return dataclasses.replace(args, num_hidden_layers=1, layer_types=[INDEXED], ple_layer_ids=[])


class MTPHead(nn.Module):
    window = None  # the MTP layer attends every MTP position (speculative/mtp.py)

    def __init__(self, args: ModelArgs):
        super().__init__()
        hc, H, eps = args.hc_count, args.hidden_size, args.rms_norm_eps
        self.args = args
        self.layer = DecoderLayer(layer_args(args), 0, make_rope(args))
        self.pre_fc_norm_embedding = OffsetRMSNorm(H, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(hc * H, eps)
        self.fc_embedding = nn.Linear(H, H, bias=False)
        self.fc_hidden = nn.Linear(H, H, bias=False)
        self.hyper_connection_mixer = GatedResidual(args, inject=False)

    def make_cache(self) -> AttentionCache:
        return AttentionCache(self.args.indexer_compress_ratio)

    def __call__(self, streams: mx.array, next_ids: mx.array, embed, cache: AttentionCache):
        """streams [1, T, hc, H] of positions cache.offset.., next_ids [1, T] the tokens after
        them, `embed` the model's embedding -> (new streams [1, T, hc, H], hidden [1, T, H])."""
        B, T, hc, H = streams.shape
        e = self.fc_embedding(self.pre_fc_norm_embedding(embed(next_ids).astype(streams.dtype)))
        s = self.pre_fc_norm_hidden(streams.reshape(B, T, hc * H)).reshape(B, T, hc, H)
        x = self.layer(e[:, :, None, :] + self.fc_hidden(s), next_ids, cache)
        cache.offset += T
        return x, self.hyper_connection_mixer(x)[0]


def make_head(args: ModelArgs, names=()) -> MTPHead:
    return MTPHead(args)


def head_param_name(name: str, args: ModelArgs | None = None) -> str | None:
    """`mtp.<name>` -> this module's parameter name; None for a second MTP layer (only the
    first one drafts) or a name outside `mtp.`."""
    if not name.startswith("mtp."):
        return None
    rest = name[len("mtp.") :]
    if rest.split(".")[0] in OWN:
        return rest
    if not rest.startswith("layers.0."):
        return None
    rest = "layer." + rest[len("layers.0.") :]
    if rest.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        rest += ".weight"
    return rest


def head_weights(tensors: dict, args: ModelArgs) -> dict:
    """The checkpoint's `mtp.*` tensors -> this module's parameters."""
    out = {}
    for k, v in tensors.items():
        name = head_param_name(k, args)
        if name is not None and "rotary_emb" not in name:
            out[name] = v
    return out


def init_kind(name: str) -> str:
    """How a random head draws parameter `name` (speculative/mtp.py random_head): this
    family's norms are (1 + w) with w around 0."""
    return "small" if name.endswith("norm.weight") else "normal"
