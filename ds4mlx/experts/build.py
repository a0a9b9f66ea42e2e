"""A layer's routed experts, some of them, as the module the resident model would hold.

`build_experts(model, layer, banks, ids, ...)` cuts the layer's banks down to experts
`ids` (rows.layer_rows) and runs them through the loader's own steps, in the order
`LanguageModel.from_config` runs them (cast, the family's sanitize, quantized modules
for GGUF / MX bytes, cast of the float rest), into a detached `SwitchGLU` of len(ids)
experts.  Every step is per expert row, so the result is bit for bit the rows `ids`
of what a resident load would hold.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..models.layers import SwitchGLU
from ..models.quantized import install_quantized, needs_install
from ..models.tensor_load import to_mlx, to_mlx_weights
from .rows import layer_rows


def _shadow(layer: int, experts: nn.Module) -> nn.Module:
    """A module tree holding `experts` at `model.layers.<layer>.mlp.experts`, the path the
    sanitized names carry, so `install_quantized` and `load_weights` work unchanged."""
    root, backbone, mlp = nn.Module(), nn.Module(), nn.Module()
    layers = [nn.Module() for _ in range(layer + 1)]
    mlp.experts = experts
    layers[layer].mlp = mlp
    backbone.layers = layers
    root.model = backbone
    return root


class ExpertShape(NamedTuple):
    """What a slot module needs from the family's `mlp.experts` placeholder.  Only this is
    kept: the placeholder's own parameters are lazy zeros of all E experts, which the
    loader's `materialize` would evaluate if anything still reached them (a 20-layer V4
    Flash: 516 GB of float32 zeros, more than a GPU holds)."""

    hidden: int
    intermediate: int
    limit: object

    @classmethod
    def of(cls, placeholder: SwitchGLU) -> ExpertShape:
        return cls(int(placeholder.down_proj.weight.shape[1]), int(placeholder.intermediate), placeholder.limit)


def build_experts(model, layer: int, banks: dict, ids, like: ExpertShape, cast_dtype, compute_dtype, read_filter=None):
    """SwitchGLU of experts `ids` of `layer` (evaluated), shaped like `like` (the
    family's placeholder's hidden / intermediate / clamp).  `read_filter(layer, rows)`
    sees the rows read from the file before conversion (fault injection in tests)."""
    rows = layer_rows(banks, ids)
    if read_filter is not None:
        rows = read_filter(layer, rows)
    experts = SwitchGLU(like.hidden, like.intermediate, len(ids), like.limit)
    root = _shadow(layer, experts)
    w = to_mlx_weights(rows, cast_dtype)
    w = model.sanitize(w)
    owned = {}
    if needs_install(w):
        w, owned = install_quantized(root, w, cast_dtype, stored=compute_dtype)
    if cast_dtype is not None:
        w = {k: to_mlx(v, cast_dtype) for k, v in w.items()}
    root.load_weights(list(w.items()) + list(owned.items()), strict=True)
    experts = root.model.layers[layer].mlp.experts
    mx.eval(experts.parameters())
    for name, arr in tree_flatten(experts.parameters()):
        if arr.shape[0] != len(ids):
            raise ValueError(f"layer {layer} experts: {name} has {arr.shape[0]} rows for {len(ids)} experts")
    return experts


__all__ = ["ExpertShape", "build_experts"]
