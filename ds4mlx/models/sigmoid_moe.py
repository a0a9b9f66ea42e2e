"""DeepSeek-V3-style mixture of experts (GLM 5.x): sigmoid router with a score-correction
bias and group-limited top-k, routed SwiGLU experts plus always-on shared experts.

Router (transformers' `GlmMoeDsaTopkRouter` / `Glm5NextTextTopkRouter`), in float32:

    scores = sigmoid(x @ W^T)
    choice = scores + e_score_correction_bias
    n_group > 1: each group's score is the sum of its two best `choice` values; only the
                 `topk_group` best groups stay eligible (the others are set to -inf)
    idx    = top-k(choice)
    w      = scores[idx] (renormalised + 1e-20 if norm_topk_prob) * routed_scaling_factor

The experts are `layers.SwitchGLU` (fused gate/up as transformers stores them) and the
shared experts a `layers.GLUMLP` of `moe_intermediate_size * n_shared_experts`; both
SwiGLUs are clamped at `limit` when one is given (GLM 5.3) and plain otherwise (GLM 5.2).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..kernels import moe_route
from .layers import GLUMLP, SwitchGLU, route_weights, topk_indices


class TopkRouter(nn.Module):
    def __init__(
        self,
        hidden: int,
        n_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        scaling: float,
    ):
        super().__init__()
        if n_experts % n_group:
            raise ValueError("n_routed_experts must be divisible by n_group")
        if n_group > 1 and n_experts // n_group < 2:
            raise ValueError("group-limited routing needs >= 2 experts per group")
        if not 1 <= topk_group <= n_group:
            raise ValueError("topk_group must be in [1, n_group]")
        self.weight = mx.zeros((n_experts, hidden))
        self.e_score_correction_bias = mx.zeros((n_experts,))
        self._k, self._groups, self._topk_group = top_k, n_group, topk_group
        self._norm, self._scale = norm_topk_prob, scaling

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(indices [..., k], weights [..., k] float32)."""
        scores = mx.sigmoid(x.astype(mx.float32) @ self.weight.astype(mx.float32).T)
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        idx = topk_indices(moe_route.group_limited(choice, self._groups, self._topk_group), self._k)
        return idx, route_weights(scores, idx, self._norm, self._scale)

    def step(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """`__call__` for a decode step: on a GPU face, for decode-sized rows, one launch
        (kernels/moe_route.py: sigmoid, bias, group-limited top-k, weights; its k slots in
        descending order, consumers are order-free).  Elsewhere exactly `__call__`."""
        if moe_route.decode_face(x.size // x.shape[-1]) is None:
            return self(x)
        return moe_route.router(
            x.astype(mx.float32),
            self.weight,
            k=self._k,
            score="sigmoid",
            scaling=self._scale,
            normalize=self._norm,
            bias=self.e_score_correction_bias,
            groups=self._groups,
            topk_group=self._topk_group,
        )


class MoE(nn.Module):
    """Routed experts + shared experts (transformers' names: gate, experts, shared_experts)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        n_experts: int,
        n_shared: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        scaling: float,
        limit: float | None,
    ):
        super().__init__()
        self.gate = TopkRouter(hidden, n_experts, top_k, n_group, topk_group, norm_topk_prob, scaling)
        self.experts = SwitchGLU(hidden, intermediate, n_experts, limit)
        self.shared_experts = GLUMLP(hidden, intermediate * n_shared, limit)

    def __call__(self, x: mx.array) -> mx.array:
        return self._forward(x, self.gate(x))

    def step(self, x: mx.array) -> mx.array:
        """`__call__` for a decode step: the router as one launch on a GPU (`TopkRouter.step`)."""
        return self._forward(x, self.gate.step(x))

    def _forward(self, x: mx.array, routing) -> mx.array:
        idx, w = routing
        y = self.experts.fused_weighted(x, idx, w)  # GPU decode: two launches
        if y is None:
            y = self.experts(x, idx)  # [..., k, H]
            y = (y * w[..., None].astype(y.dtype)).sum(axis=-2)
        return y + self.shared_experts(x)


def mlp_step(mlp: nn.Module, x: mx.array) -> mx.array:
    """A layer's MLP (`layer_mlp`) in a decode step: `MoE.step` (the router in one launch on
    a GPU) or the dense MLP."""
    return mlp.step(x) if isinstance(mlp, MoE) else mlp(x)


def layer_mlp(args, i: int, limit: float | None = None) -> nn.Module:
    """Layer `i`'s MLP from a GLM 5.x config: `MoE` where `mlp_layer_types[i]` is "sparse",
    else a dense `GLUMLP` of `intermediate_size`; every SwiGLU clamped at `limit` if given."""
    if args.mlp_layer_types[i] == "sparse":
        return MoE(
            args.hidden_size,
            args.moe_intermediate_size,
            args.n_routed_experts,
            args.n_shared_experts,
            args.num_experts_per_tok,
            args.n_group,
            args.topk_group,
            args.norm_topk_prob,
            args.routed_scaling_factor,
            limit,
        )
    return GLUMLP(args.hidden_size, args.intermediate_size, limit)


def sanitize_experts(weights: dict) -> dict:
    """transformers' fused experts (`...mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
    [E, H, I]) -> SwitchGLU parameters; per-expert hub names
    (`...mlp.experts.<e>.{gate,up,down}_proj.weight`) are stacked into the same layout."""
    out, per_expert = {}, {}
    for k, v in weights.items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            out[k + ".weight"] = v
            continue
        parts = k.split(".")
        if (
            len(parts) >= 4
            and parts[-4] == "experts"
            and parts[-3].isdigit()
            and parts[-1] == "weight"
            and parts[-2] in ("gate_proj", "up_proj", "down_proj")
        ):
            prefix = ".".join(parts[:-3])
            per_expert.setdefault(prefix, {}).setdefault(int(parts[-3]), {})[parts[-2]] = v
            continue
        out[k] = v
    for prefix, experts in per_expert.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))) or any(len(experts[e]) != 3 for e in ids):
            raise ValueError(f"incomplete per-expert weights under {prefix}")
        out[f"{prefix}.gate_up_proj.weight"] = mx.stack(
            [mx.concatenate([experts[e]["gate_proj"], experts[e]["up_proj"]], axis=0) for e in ids]
        )
        out[f"{prefix}.down_proj.weight"] = mx.stack([experts[e]["down_proj"] for e in ids])
    return out
