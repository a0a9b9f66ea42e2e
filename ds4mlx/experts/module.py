"""The routed-experts module of a streamed layer: the family's `SwitchGLU` math over a
slab of cache slots instead of all E experts.

The family's MoE calls `experts(x, indices)` / `experts.fused_weighted(...)` as on a
resident model.  Here the layer's cache (store.LayerCache) first makes the experts in
`indices` resident in the slab, then the unchanged SwitchGLU computation gathers from
the slab by slot index (`slot_of[indices]`): one slab per layer, so a compiled or
batched step can later take the slot table as an input.
"""

from __future__ import annotations

import mlx.core as mx

from ..models.layers import SwitchGLU


class StreamedExperts(SwitchGLU):
    """gate_up_proj / down_proj hold `capacity` slots; `cache` decides what is in them."""

    def __init__(self, slab: SwitchGLU, cache):
        super(SwitchGLU, self).__init__()  # nn.Module's: the projections come from the slab
        self.gate_up_proj = slab.gate_up_proj
        self.down_proj = slab.down_proj
        self._intermediate = slab.intermediate
        self._limit = slab.limit
        self._cache = cache  # a plain attribute: not a parameter, not a child module

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self._cache.run(x, indices)

    def slots_forward(self, x: mx.array, slots: mx.array) -> mx.array:
        """The SwitchGLU forward over slot indices (what `run` calls)."""
        return SwitchGLU.__call__(self, x, slots)

    def fused_weighted(self, x, indices, weights):
        return None  # the GPU two-launch path indexes all E experts: not here

    def set_slab(self, params: dict) -> None:
        """Swap in new slab arrays ({"gate_up_proj.weight": ..., ...}) at once."""
        from mlx.utils import tree_unflatten

        self.update(tree_unflatten(list(params.items())))


__all__ = ["StreamedExperts"]
