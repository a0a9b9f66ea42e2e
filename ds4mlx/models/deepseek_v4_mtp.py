"""The DeepSeek V4 multi-token-prediction head (`num_nextn_predict_layers: 1`, tensors `mtp.0.*`).

Written from DeepSeek's reference inference code for V4 (`inference/model.py`, MTPBlock)
and the DeepSeek-V3 technical report (section 2.2, MTP modules): for target position i with residual
streams x_i [hc, H] (after the last layer, before the output hyper-head) and the next
token t_{i+1},

    e   = enorm(embed(t_{i+1}))                      (embedding shared with the model)
    x   = e_proj(e)[None] + h_proj(hnorm(x_i))       (V4: two projections summed; V3's
                                                      eh_proj on the concatenation is the same map)
    x'  = Block(x) at position i                     (one full V4 layer: sliding-window
                                                      attention, no indexer, routed MoE + mHC)
    logits(t_{i+2}) = lm_head(norm(hc_head_mtp(x')))  (output head shared; its own hc_head)

The block's attention keeps its own sliding-window cache over the MTP positions.  A
recursive draft (depth > 1) feeds x' back as the next position's streams.
"""

from __future__ import annotations

import dataclasses
import logging

import mlx.core as mx
import mlx.nn as nn

from ..runtime.forward_context import CHAIN, ForwardContext, StepContext
from .deepseek_v4 import SLIDING, DecoderLayer, LayerCache, ModelArgs, finish_open_step
from .layers import HyperHead, RMSNorm, RoPE, attention_factor_from_params, inv_freq_from_params

log = logging.getLogger(__name__)

HEAD_OWN = ("e_proj", "h_proj", "enorm", "hnorm", "norm")


def block_args(args: ModelArgs) -> ModelArgs:
    """The target's args with one more layer: the MTP block (sliding attention, routed MoE)."""
    return dataclasses.replace(
        args,
        num_hidden_layers=args.num_hidden_layers + 1,
        layer_types=[*args.layer_types, SLIDING],
        mlp_layer_types=[*args.mlp_layer_types, "moe"],
    )


class MTPHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        ext = block_args(args)
        rd = args.qk_rope_head_dim
        ropes = {
            name: RoPE(
                rd,
                inv_freq_from_params(rd, args.rope_parameters[name], args.max_position_embeddings),
                attention_factor_from_params(args.rope_parameters[name], args.max_position_embeddings),
            )
            for name in ("main", "compress")
        }
        H = args.hidden_size
        self.args = args
        self.window = int(args.sliding_window)  # the block's attention window (speculative/mtp.py)
        self.block = DecoderLayer(ext, args.num_hidden_layers, ropes)
        self.e_proj = nn.Linear(H, H, bias=False)
        self.h_proj = nn.Linear(H, H, bias=False)
        self.enorm = RMSNorm(H, args.rms_norm_eps)
        self.hnorm = RMSNorm(H, args.rms_norm_eps)
        self.norm = RMSNorm(H, args.rms_norm_eps)
        self.hc_head = HyperHead(args.hc_mult, H, args.hc_eps, args.rms_norm_eps)
        self._step = None  # `step`'s compiled function (built at its first call; False: it failed)

    def make_cache(self) -> LayerCache:
        a = self.args
        return LayerCache(SLIDING, a.sliding_window, a.head_dim, 0, a.index_head_dim)

    def __call__(self, streams: mx.array, next_ids: mx.array, embed, cache: LayerCache):
        """streams [1, T, hc, H] of positions cache.offset.., next_ids [1, T] the tokens after
        them, `embed` the model's embedding -> (new streams [1, T, hc, H], hidden [1, T, H])."""
        x = self.block(self._input(streams, next_ids, embed), next_ids, cache)
        cache.offset += next_ids.shape[1]
        return x, self.norm(self.hc_head(x))

    CHAIN_MAX = 8  # `step` takes a round's catch-up of at most this many positions (a trace per count)

    def step(self, streams: mx.array, next_ids: mx.array, embed, cache: LayerCache):
        """`__call__` as the target's compiled decode step runs a layer: one position (a
        recursive draft) or a round's few (the catch-up: the positions chained as a verify's
        rows, each over the ring the one before it left), the block's static step over the
        cache's ring, compiled (a trace per ring layout and count; the first call eager, as the
        stepper's: a kernel self-tests at its first use).  More than CHAIN_MAX positions (the
        first catch-up after a prefill): the forward."""
        T = next_ids.shape[1]
        if self._step is False or T > self.CHAIN_MAX:
            return self(streams, next_ids, embed, cache)
        at = ForwardContext.decode([cache.offset]) if T == 1 else ForwardContext.chain(cache.offset, T)
        args = (streams, next_ids, at.pos_array(), *cache.static_state(streams.dtype, T))
        if self._step is None:
            try:
                mx.eval(self.static_step(embed, *args))
            except Exception:  # a backend without one of the step's ops: the head's forward, as before
                log.warning("the MTP head's static step failed; it drafts through its forward", exc_info=True)
                self._step = False
                return self(streams, next_ids, embed, cache)
            self._step = mx.compile(lambda *a: self.static_step(embed, *a))
        x, hid, *new = self._step(*args)
        cache.commit_static(iter(new), T)
        return x, hid

    def static_step(self, embed, streams, next_ids, pos, *state):
        """`step`'s pure function (compiled there; bench/census.py traces it): streams and
        next_ids of the positions `pos` (an int32 scalar: one; [T]: a chain), the cache's
        `static_state` -> (new streams, hidden, the state after the last position)."""
        if pos.ndim == 0:
            ctx = StepContext.one(pos, list(state))
        else:
            ctx = StepContext.of(CHAIN, pos, list(state), len(state))
        x = finish_open_step(*self.block.forward(self._input(streams, next_ids, embed), None, next_ids, ctx))
        return (x, self.norm(self.hc_head(x)), *ctx.views[-1].new)

    def _input(self, streams: mx.array, next_ids: mx.array, embed) -> mx.array:
        e = self.enorm(embed(next_ids).astype(streams.dtype))
        return self.e_proj(e)[:, :, None, :] + self.h_proj(self.hnorm(streams))


def head_param_name(name: str) -> str | None:
    """`mtp.0.<name>` (ds4 GGUF: the layer's tensors under transformers names, the head's
    own under ds4's) -> this module's parameter name; None for another MTP depth."""
    if not name.startswith("mtp.0."):
        return None
    rest = name[len("mtp.0.") :]
    for own in HEAD_OWN:
        if rest == own or rest.startswith(own + "."):
            return rest if "." in rest else rest + ".weight"
    for ds4, ours in (("hc_head_fn", "hc_fn"), ("hc_head_base", "hc_base"), ("hc_head_scale", "hc_scale")):
        if rest.split(".")[0] == ds4:
            return f"hc_head.{ours}"
    if rest.endswith("mlp.experts.gate_up_proj") or rest.endswith("mlp.experts.down_proj"):
        rest += ".weight"
    return "block." + rest


def make_head(args: ModelArgs, names=()) -> MTPHead:
    return MTPHead(args)


def head_weights(tensors: dict, args: ModelArgs | None = None) -> dict:
    """The `mtp.*` tensors -> this module's parameters (`head_param_name`)."""
    out = {}
    for k, v in tensors.items():
        name = head_param_name(k)
        if name is not None:
            out[name] = v
    return out


def init_kind(name: str) -> str:
    """How a random head draws parameter `name` (speculative/mtp.py random_head)."""
    if name.endswith(("norm.weight", "layernorm.weight")):
        return "unit"
    if "e_score_correction_bias" in name or name.endswith("hc_base"):
        return "small"
    if name.endswith("hc_scale"):
        return "ones"
    return "normal"
