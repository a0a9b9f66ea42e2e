"""Which loader values are routed experts, and reading a few experts of one.

A routed-expert bank is a tensor whose axis 0 is the expert: transformers' fused
`...mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I], the GGUF split
`gate_proj` / `up_proj` (+ `down_proj`), mlx-lm's `experts.switch_mlp.*.weight`.  Hub
checkpoints name each expert on its own (`...mlp.experts.<e>.gate_proj.weight`).
`take_rows(value, ids)` reads the rows `ids` of such a value from its file and nothing
else, whatever the loader handed out (mapped numpy view, LazyTensor, GGUF blocks, MX
bytes), so a slice goes through the loader's own conversion like the whole bank would.
"""

from __future__ import annotations

import logging
import re

import numpy as np

from ..io.mapped import LazyTensor
from ..io.quant import MXTensor, QuantizedTensor
from .fileread import read_rows

log = logging.getLogger(__name__)

# (prefix up to "...layers.<i>.mlp.experts", layer index, the rest of the name)
_EXPERT_NAME = re.compile(r"^((?:.*\.)?layers\.(\d+)\.mlp\.experts)\.(.+)$")
_PER_EXPERT = re.compile(r"^(\d+)\.(.+)$")
_warned: set[str] = set()


def split_expert_tensors(weights: dict, n_layers: int) -> tuple[dict, dict[int, dict]]:
    """(the other tensors, {layer: {name: bank}}): the routed experts of layers below
    `n_layers` (MTP layers past it stay with the rest for the family's sanitize)."""
    rest, experts = {}, {}
    for k, v in weights.items():
        m = _EXPERT_NAME.match(k)
        if m is None or int(m.group(2)) >= n_layers:
            rest[k] = v
            continue
        experts.setdefault(int(m.group(2)), {})[k] = v
    return rest, experts


def expert_count(layer_tensors: dict) -> int:
    """E of one layer's banks (per-expert names counted)."""
    per = set()
    for k, v in layer_tensors.items():
        tail = _EXPERT_NAME.match(k).group(3)
        m = _PER_EXPERT.match(tail)
        if m:
            per.add(int(m.group(1)))
        else:
            return int(v.shape[0])
    return len(per)


def take_rows(value, ids) -> object:
    """Rows `ids` (axis 0) of a loader value, same kind of value, read from its file."""
    ids = [int(i) for i in ids]
    if isinstance(value, np.ndarray):
        got = read_rows(value, ids)  # a mapped view: bounds-checked reads from the file (fileread.py)
        return np.ascontiguousarray(value[ids]) if got is None else got
    if isinstance(value, QuantizedTensor):
        got = read_rows(value.raw, ids)
        return QuantizedTensor(
            raw=np.ascontiguousarray(value.raw[ids]) if got is None else got,
            qtype=value.qtype,
            shape=(len(ids), *value.shape[1:]),
        )
    if isinstance(value, MXTensor):
        return MXTensor(
            weight=take_rows(value.weight, ids),
            scales=take_rows(value.scales, ids),
            mode=value.mode,
            shape=(len(ids), *value.shape[1:]),
        )
    if isinstance(value, LazyTensor) and value.rows is not None:
        return value.rows(ids)
    kind = type(value).__name__
    if kind not in _warned:
        _warned.add(kind)
        log.warning("expert streaming: a %s bank has no per-row read: the whole bank is read per miss", kind)
    return np.ascontiguousarray(np.asarray(value)[ids])


def layer_rows(layer_tensors: dict, ids) -> dict:
    """One layer's banks cut down to experts `ids` (in that order, renumbered 0..n-1)."""
    out = {}
    pos = {int(e): j for j, e in enumerate(ids)}
    for k, v in layer_tensors.items():
        m = _EXPERT_NAME.match(k)
        per = _PER_EXPERT.match(m.group(3))
        if per is None:
            out[k] = take_rows(v, ids)
        elif int(per.group(1)) in pos:
            out[f"{m.group(1)}.{pos[int(per.group(1))]}.{per.group(2)}"] = v
    return out


__all__ = ["split_expert_tensors", "expert_count", "take_rows", "layer_rows"]
