"""Directional steering: a runtime edit of each decoder layer's attention and FFN
outputs along one direction per layer (the dir-steering README of antirez/ds4,
ds4.c `cpu_directional_steering_project_rows`):

    y = y - scale * v[layer] * dot(v[layer], y)

Positive scale removes the direction, negative amplifies it.  ds4's flags:
`--dir-steering-file FILE`, `--dir-steering-ffn F` (1 when a file is given),
`--dir-steering-attn F` (0).  A scale of 0 skips the edit entirely, so the graph
is the unsteered one, bit for bit.

File format (dir-steering/tools/build_direction.py): a flat little-endian
float32 matrix [n_layers, hidden_size], one (normalized) direction per layer,
no header; a `.json` beside it holds metadata (`FORMAT`).

The models call `steer(self, site, y)` where a decoder layer produces its
attention (`ATTN`) and FFN (`FFN`) outputs, before they enter the residual /
hyper-connection.  `install(model, steering)` attaches one `LayerSteer` to
every layer (a plain attribute, not an MLX parameter).  `identity(model)` is
part of the session fingerprint and the disk KV cache's model id, so state
computed under one steering is never reused under another.

`build_direction` is ds4's extractor: the mean last-prompt-row activation of
the target prompts minus that of the contrast prompts, per layer, normalized
(and by default made orthogonal to the contrast mean).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

__all__ = [
    "ATTN",
    "FFN",
    "FORMAT",
    "Steering",
    "SteeringError",
    "LayerSteer",
    "steer",
    "steered",
    "install",
    "identity",
    "read_directions",
    "write_directions",
    "build_direction",
    "read_prompt_lines",
    "layers_of",
    "installed",
    "check_scale",
    "load",
]

ATTN = "attn"
FFN = "ffn"
FORMAT = "ds4-directional-steering-v1"
SCALE_LIMIT = 100.0  # ds4 parses the scales in [-100, 100]
COMPONENTS = {"ffn_out": FFN, "attn_out": ATTN}  # build_direction.py --component


class SteeringError(ValueError):
    """A steering file or scale that cannot be used with the loaded model."""


@dataclass
class Steering:
    """Directions [n_layers, hidden] float32 and the two scales."""

    directions: np.ndarray
    ffn: float = 1.0
    attn: float = 0.0
    path: str | None = None

    @property
    def active(self) -> bool:
        return self.ffn != 0.0 or self.attn != 0.0

    def identity(self) -> str | None:
        """A hash of the directions and the scales; None when no edit happens."""
        if not self.active:
            return None
        h = hashlib.sha1(np.ascontiguousarray(self.directions, dtype="<f4").tobytes())
        h.update(json.dumps([float(self.ffn), float(self.attn)]).encode())
        return "steer-" + h.hexdigest()[:16]

    def describe(self) -> str:
        name = os.path.basename(self.path) if self.path else "directions"
        return f"{name} ffn={self.ffn:g} attn={self.attn:g}"


@dataclass
class LayerSteer:
    """One layer's direction and scales; `record` (steer build) collects the last
    row of a site's output instead of editing it."""

    direction: mx.array | None
    ffn: float = 0.0
    attn: float = 0.0
    record: dict | None = None
    record_site: str = FFN

    def edit(self, site: str, y: mx.array) -> mx.array:
        if self.record is not None:
            if site == self.record_site:
                self.record.setdefault("rows", []).append(y.reshape(-1, y.shape[-1])[-1].astype(mx.float32))
            return y
        scale = self.ffn if site == FFN else self.attn
        if scale == 0.0 or self.direction is None:
            return y
        v = self.direction
        yf = y.astype(mx.float32)
        dot = (yf * v).sum(axis=-1, keepdims=True)
        return (yf - (scale * dot) * v).astype(y.dtype)


def steer(layer, site: str, y: mx.array) -> mx.array:
    """The models' hook: `y` edited by the layer's steering (unchanged without one)."""
    s = vars(layer).get("steering")
    return y if s is None else s.edit(site, y)


def steered(layer) -> bool:
    """Whether `steer` edits this layer's outputs (a model that splits a site's output in
    parts sums them first)."""
    return vars(layer).get("steering") is not None


def layers_of(model) -> list:
    """The decoder layers of a loaded model (LanguageModel, CausalLM or backbone)."""
    for obj in (model, getattr(model, "model", None), getattr(getattr(model, "model", None), "model", None)):
        layers = getattr(obj, "layers", None) if obj is not None else None
        if isinstance(layers, list) and layers:
            return layers
    raise SteeringError("the model exposes no decoder layers to steer")


def _hidden_size(model) -> int:
    for obj in (model, getattr(model, "model", None)):
        args = getattr(obj, "args", None)
        if args is not None and getattr(args, "hidden_size", None):
            return int(args.hidden_size)
    raise SteeringError("the model's hidden size is unknown")


def check_scale(name: str, v: float) -> float:
    v = float(v)
    if not np.isfinite(v) or abs(v) > SCALE_LIMIT:
        raise SteeringError(f"invalid value for {name}: {v} (expected -{SCALE_LIMIT:g}..{SCALE_LIMIT:g})")
    return v


def read_directions(path: str, n_layers: int, hidden: int) -> np.ndarray:
    """A steering file as [n_layers, hidden] float32; its size must match exactly."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise SteeringError(f"cannot open steering file {path}: {e.strerror or e}") from None
    want = n_layers * hidden * 4
    if size != want:
        raise SteeringError(f"{path}: {size} bytes, expected {want} ({n_layers} layers x {hidden} float32)")
    return np.fromfile(path, dtype="<f4").reshape(n_layers, hidden).astype(np.float32)


def write_directions(path: str, directions: np.ndarray) -> None:
    np.ascontiguousarray(directions, dtype="<f4").tofile(path)


def load(model, path: str, ffn: float | None = None, attn: float | None = None) -> Steering:
    """A steering file for `model` with ds4's defaults (ffn 1 when neither scale is
    given, attn 0)."""
    if ffn is None and attn is None:
        ffn = 1.0
    ffn = check_scale("--dir-steering-ffn", 0.0 if ffn is None else ffn)
    attn = check_scale("--dir-steering-attn", 0.0 if attn is None else attn)
    dirs = read_directions(path, len(layers_of(model)), _hidden_size(model))
    return Steering(dirs, ffn=ffn, attn=attn, path=path)


def install(model, steering: Steering | None) -> None:
    """Attach `steering` to every layer of `model` (None or zero scales: remove it).
    Call it between jobs, never while the model runs."""
    layers = layers_of(model)
    if steering is None or not steering.active:
        for layer in layers:
            vars(layer).pop("steering", None)
        _set_identity(model, None)
        return
    if steering.directions.shape != (len(layers), _hidden_size(model)):
        raise SteeringError(
            f"steering directions have shape {tuple(steering.directions.shape)}, "
            f"the model needs ({len(layers)}, {_hidden_size(model)})"
        )
    rows = [mx.array(steering.directions[i]) for i in range(len(layers))]
    mx.eval(rows)  # evaluated here: the engine's worker thread must not meet lazy arrays
    for layer, v in zip(layers, rows):
        layer.steering = LayerSteer(v, ffn=steering.ffn, attn=steering.attn)
    _set_identity(model, steering)


def _set_identity(model, steering: Steering | None) -> None:
    # kept on both wrapper levels: sessions see the CausalLM, the disk cache the LanguageModel
    for obj in (model, getattr(model, "model", None)):
        if obj is not None:
            obj._steering_identity = steering.identity() if steering is not None else None  # a plain attribute
            obj.__dict__["_steering"] = steering


def installed(model) -> Steering | None:
    """The steering `install` put on `model` (None: unsteered)."""
    for obj in (model, getattr(model, "model", None)):
        s = getattr(obj, "__dict__", {}).get("_steering") if obj is not None else None
        if s is not None:
            return s
    return None


def identity(model) -> str | None:
    """The installed steering's identity (None: unsteered)."""
    for obj in (model, getattr(model, "model", None)):
        if obj is not None:
            ident = getattr(obj, "__dict__", {}).get("_steering_identity")
            if isinstance(ident, str) and ident:
                return ident
    return None


# ---------------------------------------------------------------- steer build


def read_prompt_lines(path: str) -> list[str]:
    """One prompt per non-empty line, `#` comments skipped (build_direction.py)."""
    with open(path, encoding="utf-8") as f:
        prompts = [s.strip() for s in f.read().splitlines()]
    prompts = [s for s in prompts if s and not s.startswith("#")]
    if not prompts:
        raise SteeringError(f"{path}: no prompts found")
    return prompts


def _normalize(v: np.ndarray) -> np.ndarray:
    n = float(np.sqrt(np.dot(v, v)))
    return v / n if n > 0 else v


@dataclass
class BuildResult:
    directions: np.ndarray
    pairs: int
    meta: dict = field(default_factory=dict)


def capture(model, ids: Sequence[int], site: str) -> np.ndarray:
    """[n_layers, hidden] float32: each layer's `site` output at the last prompt row."""
    layers = layers_of(model)
    saved = [vars(layer).get("steering") for layer in layers]
    records = [{} for _ in layers]
    try:
        for layer, rec in zip(layers, records):
            layer.steering = LayerSteer(None, record=rec, record_site=site)
        inner = getattr(model, "model", model)
        mx.eval(inner(mx.array([list(ids)], dtype=mx.int32)))
    finally:
        for layer, s in zip(layers, saved):
            if s is None:
                vars(layer).pop("steering", None)
            else:
                layer.steering = s
    return np.stack([np.array(rec["rows"][-1]) for rec in records]).astype(np.float32)


def build_direction(
    model,
    encode: Callable[[str], list[int]],
    good: Sequence[str],
    bad: Sequence[str],
    *,
    render: Callable[[str], str],
    component: str = "ffn_out",
    pair_normalize: bool = False,
    orthogonalize: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> BuildResult:
    """ds4's build_direction.py on an in-process model: prompts paired in order
    (the longer list cut to the shorter), `render(prompt)` the chat prompt text."""
    if component not in COMPONENTS:
        raise SteeringError(f"unknown component {component!r} (expected one of {', '.join(COMPONENTS)})")
    site = COMPONENTS[component]
    n = min(len(good), len(bad))
    if n == 0:
        raise SteeringError("steer build needs at least one prompt in each file")
    good_sum = bad_sum = pair_sum = None
    for i in range(n):
        g = capture(model, encode(render(good[i])), site).astype(np.float64)
        b = capture(model, encode(render(bad[i])), site).astype(np.float64)
        good_sum = g if good_sum is None else good_sum + g
        bad_sum = b if bad_sum is None else bad_sum + b
        if pair_normalize:
            d = np.stack([_normalize(row) for row in g - b])
            pair_sum = d if pair_sum is None else pair_sum + d
        if progress is not None:
            progress(i + 1, n)
    good_mean, bad_mean = good_sum / n, bad_sum / n
    out = []
    for layer in range(good_mean.shape[0]):
        d = _normalize(pair_sum[layer] / n) if pair_normalize else _normalize(good_mean[layer] - bad_mean[layer])
        if orthogonalize:
            base = _normalize(bad_mean[layer])
            d = _normalize(d - np.dot(d, base) * base)
        out.append(d)
    dirs = np.stack(out).astype(np.float32)
    meta = {
        "format": FORMAT,
        "shape": list(dirs.shape),
        "component": component,
        "pair_normalize": bool(pair_normalize),
        "orthogonalize_control_mean": bool(orthogonalize),
        "note": "runtime positive scale suppresses this direction; negative scale amplifies it",
    }
    return BuildResult(dirs, n, meta)
