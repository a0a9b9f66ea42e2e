"""transformers' on-disk checkpoint names -> its in-memory names (non-DeepSeek families).

`save_pretrained` (transformers 5.x) runs its weight conversion in reverse: fused
expert tensors are written per expert (`mlp.experts.N.gate_proj.weight`), some
modules under their checkpoint names (GLM 5.3's `self_attn.A_log`, not
`self_attn.forget_gate.A_log`), concatenated tensors split (`q_conv1d` / `k_conv1d`
/ `v_conv1d`, `ngram_embedding.shard_N`).  `to_memory_names` undoes that, per
family, so a model folder a user saved with transformers loads like the oracle's
state dict.  The rules (the registry's `checkpoint_renames` / `checkpoint_concats` columns)
mirror transformers' conversion_mapping.py for these model types; tensors already under
in-memory names pass through unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .. import registry

_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<i>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _merge_experts(tensors: dict) -> dict:
    """Per-expert gate/up/down -> `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]."""
    groups: dict[tuple[str, str], dict[int, Any]] = {}
    out = {}
    for k, v in tensors.items():
        m = _EXPERT.match(k)
        if m is None:
            out[k] = v
        else:
            groups.setdefault((m["base"], m["proj"]), {})[int(m["i"])] = v
    for (base, proj), per in groups.items():
        if sorted(per) != list(range(len(per))):
            raise ValueError(f"experts of {base}.{proj} are incomplete ({sorted(per)[:8]}...)")
        groups[(base, proj)] = np.stack([np.asarray(per[i]) for i in range(len(per))])
    for (base, proj), arr in groups.items():
        if proj == "down_proj":
            out[f"{base}.down_proj"] = arr
        elif proj == "gate_proj":
            up = groups.get((base, "up_proj"))
            if up is None:
                raise ValueError(f"{base}: gate_proj experts without up_proj")
            out[f"{base}.gate_up_proj"] = np.concatenate([arr, up], axis=1)
    return out


def _concatenate(tensors: dict, pattern: str, order, target: str, axis: int) -> dict:
    rx = re.compile(pattern)
    groups: dict[str, dict[str, Any]] = {}
    out = {}
    for k, v in tensors.items():
        m = rx.match(k)
        if m is None:
            out[k] = v
        else:
            groups.setdefault(m["base"], {})[m["part"]] = v
    for base, parts in groups.items():
        keys = list(order) if order is not None else sorted(parts, key=int)
        if set(keys) != set(parts):
            raise ValueError(f"{base}: expected the parts {keys}, found {sorted(parts)}")
        out[target.format(base=base)] = np.concatenate([np.asarray(parts[p]) for p in keys], axis=axis)
    return out


def to_memory_names(model_type: str, tensors: dict) -> dict:
    """A family's checkpoint tensors under transformers' in-memory names."""
    fam = registry.family_of(model_type)
    if fam is None or not (fam.checkpoint_renames or fam.checkpoint_concats):
        return tensors
    renames, concats = fam.checkpoint_renames, fam.checkpoint_concats
    if any(_EXPERT.match(k) for k in tensors):
        tensors = _merge_experts(tensors)
    for pattern, order, target, axis in concats:
        tensors = _concatenate(tensors, pattern, order, target, axis)
    if renames:
        compiled = [(re.compile(p), r) for p, r in renames]
        renamed = {}
        for k, v in tensors.items():
            for rx, repl in compiled:
                k = rx.sub(repl, k)
            renamed[k] = v
        tensors = renamed
    return tensors
