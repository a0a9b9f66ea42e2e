"""Putting the expert store into a model being loaded (`LanguageModel.from_config`).

`detach_experts(model, weights)` runs before the resident load: the routed-expert
banks are taken out of `weights` (they stay in the file) and each MoE layer's
`mlp.experts` placeholder is swapped for an empty module, so nothing allocates all E
experts.  `attach_store(...)` runs after it: the budget is resolved, a `LayerCache`
per layer built (its slab read from the file) and its `StreamedExperts` installed.
"""

from __future__ import annotations

import os
import sys

import mlx.nn as nn
from mlx.utils import tree_flatten

from ..models.layers import SwitchGLU
from .budget import GIB, StreamConfig, auto_budget_bytes
from .build import ExpertShape
from .fit import resident_bytes
from .rows import expert_count, split_expert_tensors
from .store import ExpertStore, LayerCache, file_bytes, read_profile


def _experts_modules(model) -> dict[int, tuple[str, SwitchGLU]]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, SwitchGLU) and name.endswith("mlp.experts") and ".layers." in f".{name}":
            parts = name.split(".")
            out[int(parts[parts.index("layers") + 1])] = (name, m)
    return out


def _set(root, path: str, new) -> None:
    obj = root
    parts = path.split(".")
    for p in parts[:-1]:
        obj = obj[int(p)] if isinstance(obj, list) else obj[p]
    setattr(obj, parts[-1], new)


def detach_experts(model, weights: dict) -> tuple[dict, dict]:
    """(weights without the routed experts, {layer: (module path, placeholder's shape, banks)})."""
    mods = _experts_modules(model)
    n_layers = len(model.layers)
    rest, banks = split_expert_tensors(weights, n_layers)
    detached = {}
    for layer, (path, placeholder) in sorted(mods.items()):
        if layer not in banks:
            continue
        _set(model, path, nn.Module())  # no E-expert zeros ever evaluated
        detached[layer] = (path, ExpertShape.of(placeholder), banks[layer])
    missing = [l for l in banks if l not in detached]
    if missing:
        raise ValueError(f"routed experts for layer {missing[0]} but the model has no experts module there")
    return rest, detached


def _layer_slots(n_layers: int, n_experts: int, total: int, pin: bool, floor: int, full=None) -> list[int]:
    """Slots per MoE layer for a budget of `total` experts: as many whole (pinned: no
    misses, no host sync) layers, first layers first, as leave every other layer at
    least `floor` slots (a token's top-k), the rest shared evenly (at least 1 each).
    `full`: exactly that many whole layers instead (ds4's --ssd-streaming-full-layers)."""
    floor = max(1, min(floor, n_experts))
    pinned = 0
    if full is not None:
        pinned = max(0, min(n_layers, int(full)))
    elif pin:
        while pinned < n_layers and (pinned + 1) * n_experts + (n_layers - pinned - 1) * floor <= total:
            pinned += 1
    left = n_layers - pinned
    per = max(1, min(n_experts, (total - pinned * n_experts) // left)) if left else n_experts
    return [n_experts] * pinned + [per] * left


def attach_store(
    model, detached: dict, cfg: StreamConfig, path: str, cast_dtype, compute_dtype, read_filter=None, config=None
):
    """Build and install the store; returns it (also `model.expert_store`)."""
    store = ExpertStore(model, path, cast_dtype, compute_dtype, read_filter)
    store.prefetch = cfg.prefetch
    order = {}
    if cfg.profile and os.path.exists(cfg.profile):
        order = read_profile(cfg.profile)
    if cfg.profile:
        import atexit

        store.profile_path = cfg.profile
        atexit.register(store.close)  # serve / eval / chat end without a finish() call
    layers = sorted(detached)
    counts = {l: expert_count(detached[l][2]) for l in layers}
    # the budget is in loaded bytes (a float16 file's experts are float32 on the CPU)
    per_expert = {l: sum(resident_bytes(v, cast_dtype) for v in detached[l][2].values()) // counts[l] for l in layers}
    mean_bytes = max(1, sum(per_expert.values()) // max(1, len(layers)))
    E = max(counts.values()) if counts else 0
    why = ""
    if cfg.per_layer is not None:
        slots = [min(counts[l], max(1, cfg.per_layer)) for l in layers]
        why = f"{cfg.per_layer} per layer"
    else:
        if cfg.count is not None:
            total, why = cfg.count, f"{cfg.count} experts"
        else:
            if cfg.gb is not None:
                budget, why = int(cfg.gb * GIB), f"{cfg.gb:g} GiB"
            else:
                from ..io.inspect_model import kv_bytes

                resident = sum(int(a.nbytes) for _, a in tree_flatten(model.parameters()))
                kv = kv_bytes(config, cfg.ctx) or 0
                budget, why = auto_budget_bytes(resident, kv, cfg)
            total = budget // mean_bytes
        floor = int(getattr(getattr(model, "args", None), "num_experts_per_tok", 1) or 1)
        slots = _layer_slots(len(layers), E, int(total), cfg.pin_layers, floor, cfg.full_layers)
    for l, s in zip(layers, slots):
        first = order.get(l, [0])[0] if order.get(l) else 0
        store.layers[l] = LayerCache(store, l, detached[l][2], counts[l], detached[l][1], s, first)
    for prev, nxt in zip(layers, layers[1:]):
        store.layers[prev].next_layer = store.layers[nxt]
    for l in layers:
        _set(model, detached[l][0], store.layers[l].module)
    store.stats.preload_done = store.stats.preload_total = 0
    if cfg.preload:
        store.preload(order, cfg.preload)
    cap = sum(slots)
    store.budget_line = (
        f"ds4mlx: expert streaming: {cap}/{sum(counts.values())} experts resident "
        f"({store.resident_bytes() / GIB:.2f} GiB; budget {why}), "
        f"{sum(c.pinned for c in store.layers.values())} of {len(layers)} MoE layers pinned, "
        f"{mean_bytes / 2**20:.2f} MiB per expert loaded, "
        f"{sum(file_bytes(v) for l in layers for v in detached[l][2].values()) / max(1, sum(counts.values())) / 2**20:.2f} MiB in the file"
    )
    print(store.budget_line, file=sys.stderr)
    model.expert_store = store
    return store


__all__ = ["detach_experts", "attach_store"]
