"""The DeepSeek V4 family's plans (models/deepseek_v4.py): per rank, its config, its
part of every weight and the modules where partial results meet.

tp   heads h0:h1 of the rank's attention (q_b_proj rows, sinks) and the o-groups that
     hold them (o_a_proj rows, o_b_proj columns); columns i0:i1 of the shared expert
     and of every routed expert (gate / up rows, down columns).  The K=V head, the
     compressors, the indexer, the router and the hyper-connections are replicated
     (one shared KV head: splitting it saves nothing).  The attention output and the
     MoE output are partial sums: one all_sum each, two per layer.
ep   routed experts e0:e1 (each rank scores all of them and keeps the top-k weights of
     the ones it owns), the shared expert's columns i0:i1; attention replicated.  The
     MoE output is the one all_sum per layer.
pipeline  layers l0:l1 (renumbered from 0 in the rank's config); rank 0 also holds the
     embedding and the output head.  The residual stream is received from the previous
     rank, run through the rank's layers and sent to the next; the last stage's output
     comes back to rank 0 as an all_sum in float32 (every other rank adds zeros that
     wait on its send).  The other ranks' "logits" are that hidden state: only rank 0
     samples.
Only rank 0 holds the output head (every plan): the other ranks' "logits" are their
final hidden state, never sampled.
"""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx
import mlx.nn as nn

from ..models.deepseek_v4 import Attention, DeepseekV4Model, MoE, finish_open_step
from ..models.layers import GLUMLP, SwitchGLU
from ..runtime.forward_context import PREFILL
from .plan import Plan
from .slicing import take

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_OUTER = ("model.embed_tokens.", "lm_head.")  # rank 0 of a pipeline only


# ----------------------------------------------------------------------------- modules


class TensorParallelAttention(Attention):
    """This rank's heads; the output projection's partial sums are added over the group."""

    def __init__(self, args, layer_idx: int, ropes: dict, group):
        super().__init__(args, layer_idx, ropes)
        self._group = group

    def _output(self, out: mx.array, s, B: int, C: int, project: bool = True) -> mx.array:
        # the layer never asks for o_a alone here: the partial sums meet after o_b (DecoderLayer.forward)
        assert project, "a tensor-parallel attention projects through o_b before its all_sum"
        return mx.distributed.all_sum(super()._output(out, s, B, C), group=self._group)


class TensorParallelMoE(MoE):
    """This rank's columns of every expert; the partial MoE output is added over the group."""

    def __init__(self, args, layer_idx: int, group):
        super().__init__(args, layer_idx)
        self._group = group

    def __call__(self, x: mx.array, ids: mx.array) -> mx.array:
        return mx.distributed.all_sum(super().__call__(x, ids), group=self._group)

    def step(self, x: mx.array, ids: mx.array) -> mx.array:
        return mx.distributed.all_sum(super().step(x, ids), group=self._group)

    def step_pair(self, x: mx.array, ids: mx.array):
        return self.step(x, ids), None  # the halves are summed before the all_sum


class ExpertParallelMoE(MoE):
    """Routed experts [first, first + count) and the shared expert's columns of this rank;
    the router is whole.  Top-k slots owned by another rank get weight 0 here (their
    index is clamped into the local range, the product discarded)."""

    def __init__(self, args, layer_idx: int, plan: Plan, group):
        super().__init__(args, layer_idx)
        e0, e1 = plan.block(args.n_routed_experts, "n_routed_experts")
        i0, i1 = plan.block(args.moe_intermediate_size, "moe_intermediate_size")
        self.experts = SwitchGLU(args.hidden_size, args.moe_intermediate_size, e1 - e0, args.swiglu_limit)
        self.shared_experts = GLUMLP(args.hidden_size, i1 - i0, args.swiglu_limit)
        self._first, self._count, self._group = e0, e1 - e0, group

    def _routed(self, x: mx.array, ids: mx.array) -> mx.array:
        idx, w = self.gate(x, ids)
        local = idx.astype(mx.int32) - self._first
        mine = (local >= 0) & (local < self._count)
        local, w = mx.where(mine, local, 0), mx.where(mine, w, 0.0)
        y = self.experts.fused_weighted(x, local, w)
        if y is None:
            y = self.experts(x, local)
            y = (y * w[..., None].astype(y.dtype)).sum(axis=-2)
        return y

    def __call__(self, x: mx.array, ids: mx.array) -> mx.array:
        return mx.distributed.all_sum(self._routed(x, ids) + self.shared_experts(x), group=self._group)

    def step(self, x: mx.array, ids: mx.array) -> mx.array:
        return self(x, ids)

    def step_pair(self, x: mx.array, ids: mx.array):
        return self.step(x, ids), None


class Passthrough(nn.Module):
    """The output head of a pipeline rank other than 0: its result is not sampled."""

    def __call__(self, h: mx.array) -> mx.array:
        return h


class PipelineStage(DeepseekV4Model):
    """Layers [l0, l1) of the model (its config holds only those); rank 0 embeds and
    applies the final norm.  See the module doc for the hand-over."""

    def __init__(self, args, plan: Plan, group):
        super().__init__(args)
        self._plan, self._group = plan, group
        if not plan.leader:
            self.pop("embed_tokens")

    def _stream_dtype(self):
        return self.activation_dtype or self.norm.weight.dtype

    def _enter(self, ids: mx.array) -> mx.array:
        B, T = ids.shape
        if self._plan.leader:
            h = self.embed(ids)  # ActivationDtype: the policy's dtype on every path
            return mx.broadcast_to(h[:, :, None, :], (B, T, self._hc, h.shape[-1]))
        shape = (B, T, self._hc, self.norm.weight.shape[0])
        x = mx.distributed.recv(shape, mx.float32, self._plan.rank - 1, group=self._group)
        return x.astype(self._stream_dtype())

    def _leave(self, x: mx.array, final_norm: bool = True) -> mx.array:
        p = self._plan
        if p.rank < p.size - 1:
            sent = mx.distributed.send(x.astype(mx.float32), p.rank + 1, group=self._group)
            mine = mx.depends([mx.zeros(x.shape, mx.float32)], [sent])[0]
        else:
            mine = x.astype(mx.float32)
        out = mx.distributed.all_sum(mine, group=self._group).astype(x.dtype)
        if not p.leader:
            return out
        h = self.hc_head(out)
        return self.norm(h) if final_norm else h  # (final_norm=False: the head folds it in)

    def forward(self, ids: mx.array, ctx, final_norm: bool = True) -> tuple[mx.array, mx.array]:
        """`DeepseekV4Model.forward` over this stage's layers (the residual stream's dtype as
        there: ActivationDtype), each layer finished on its own: the stream crosses ranks after
        the last."""
        x = self._enter(ids)
        caches = ctx.views[0] if ctx.kind == PREFILL else [None] * len(self.layers)
        for layer, c in zip(self.layers, caches):
            x = finish_open_step(*layer.forward(x, None, ids, ctx, c))
        if ctx.kind == PREFILL:
            for c in caches:
                c.offset += ids.shape[1]
        return self._leave(x, final_norm), x


# ----------------------------------------------------------------------------- the plan


def layer_range(n_layers: int, plan: Plan) -> tuple[int, int]:
    """Pipeline stage of `plan.rank`: contiguous, the first n % size ranks one layer more."""
    if n_layers < plan.size:
        raise ValueError(f"pipeline: {n_layers} layers cannot fill {plan.size} stages")
    base, extra = divmod(n_layers, plan.size)
    start = plan.rank * base + min(plan.rank, extra)
    return start, start + base + (1 if plan.rank < extra else 0)


def _check_tp(args, plan: Plan) -> None:
    plan.block(args.num_attention_heads, "num_attention_heads")
    plan.block(args.o_groups, "o_groups")
    plan.block(args.moe_intermediate_size, "moe_intermediate_size")


def shard_args(args, plan: Plan):
    """The rank's ModelArgs: what its modules are built with."""
    n = plan.size
    tie = args.tie_word_embeddings and plan.leader  # only rank 0 samples: the others hold no head
    if plan.kind == "tp":
        _check_tp(args, plan)
        return dataclasses.replace(
            args,
            num_attention_heads=args.num_attention_heads // n,
            o_groups=args.o_groups // n,
            moe_intermediate_size=args.moe_intermediate_size // n,
            tie_word_embeddings=tie,
        )
    if plan.kind == "ep":
        plan.block(args.n_routed_experts, "n_routed_experts")
        plan.block(args.moe_intermediate_size, "moe_intermediate_size")
        return dataclasses.replace(args, tie_word_embeddings=tie)
    l0, l1 = layer_range(args.num_hidden_layers, plan)
    return dataclasses.replace(
        args,
        num_hidden_layers=l1 - l0,
        layer_types=args.layer_types[l0:l1],
        mlp_layer_types=args.mlp_layer_types[l0:l1],
        tie_word_embeddings=tie,
    )


def _parts(args, plan: Plan, rest: str):
    """(axis, ranges) of the layer tensor named `rest` (after "model.layers.N."), or None: whole."""
    name = rest.removesuffix(".weight")
    I = args.moe_intermediate_size
    if plan.kind in ("tp", "ep") and name.startswith("mlp.shared_experts."):
        i0, i1 = plan.block(I, "moe_intermediate_size")
        return (1, [(i0, i1)]) if name.endswith("down_proj") else (0, [(i0, i1)])
    if plan.kind == "ep" and name.startswith("mlp.experts."):
        return 0, [plan.block(args.n_routed_experts, "n_routed_experts")]
    if plan.kind != "tp":
        return None
    i0, i1 = plan.block(I, "moe_intermediate_size")
    D, o = args.head_dim, args.o_lora_rank
    h0, h1 = plan.block(args.num_attention_heads, "num_attention_heads")
    g0, g1 = plan.block(args.o_groups, "o_groups")
    return {
        "self_attn.q_b_proj": (0, [(h0 * D, h1 * D)]),
        "self_attn.sinks": (0, [(h0, h1)]),
        "self_attn.o_a_proj": (0, [(g0 * o, g1 * o)]),
        "self_attn.o_b_proj": (1, [(g0 * o, g1 * o)]),
        "mlp.experts.gate_up_proj": (1, [(i0, i1), (I + i0, I + i1)]),
        "mlp.experts.gate_proj": (1, [(i0, i1)]),
        "mlp.experts.up_proj": (1, [(i0, i1)]),
        "mlp.experts.down_proj": (2, [(i0, i1)]),
    }.get(name)


def shard_weights(weights: dict, args, plan: Plan) -> dict:
    """The rank's tensors (transformers' in-memory names; `args` the whole model's),
    each sliced before anything reads it."""
    out = {}
    if plan.kind == "pipeline":
        l0, l1 = layer_range(args.num_hidden_layers, plan)
    for k, v in weights.items():
        m = _LAYER.match(k)
        if k.startswith("lm_head.") and not plan.leader:
            continue
        if plan.kind == "pipeline":
            if m is None:
                if plan.leader or not k.startswith(_OUTER):
                    out[k] = v
            elif l0 <= int(m.group(1)) < l1:
                out[f"model.layers.{int(m.group(1)) - l0}.{m.group(2)}"] = v
            continue
        part = _parts(args, plan, m.group(2)) if m else None
        out[k] = v if part is None else take(v, *part)
    return out


def install(model, args, plan: Plan, group) -> None:
    """Swap the rank's modules in (before its weights are loaded: the names stay)."""
    if not plan.leader:
        model.lm_head = Passthrough()
    if plan.kind == "pipeline":
        model.model = PipelineStage(args, plan, group)
        return
    backbone = model.model
    for i, layer in enumerate(backbone.layers):
        if plan.kind == "tp":
            layer.self_attn = TensorParallelAttention(args, i, backbone.ropes(), group)
            layer.mlp = TensorParallelMoE(args, i, group)
        else:
            layer.mlp = ExpertParallelMoE(args, i, plan, group)
