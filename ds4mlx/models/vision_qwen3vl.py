"""The Qwen3-VL vision tower in MLX (transformers `Qwen3VLVisionModel`; the Qwen3.8
family's `Qwen4ExpVisionModel` is the same tower without the deepstack mergers).

pixels [N, C*T*P*P] (block order, vision_preprocess.py) -> patch embedding (the Conv3d
with kernel == stride is one linear over each patch) + the learned position grid
resampled bilinearly to the image's grid -> `depth` pre-norm ViT blocks (2D axial
rope, attention within each image only) -> spatial merge (m*m neighbouring patches
concatenated) + projector MLP into the language model's width.  The deepstack
mergers give the extra features some layers hand to the language model.

Weights arrive under transformers' in-memory names (`blocks.0.attn.qkv.weight`,
`merger.linear_fc1.weight`, ...), optionally under a `model.visual.` / `visual.` prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

PREFIXES = ("model.visual.", "visual.", "vision_tower.")


@dataclass
class VisionArgs:
    """transformers' `Qwen3VLVisionConfig` fields (the names of its config.json)."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list = field(default_factory=list)  # qwen4_exp_vision has none
    rope_parameters: dict | None = None

    @classmethod
    def from_dict(cls, cfg: dict) -> VisionArgs:
        cfg = dict(cfg.get("vision_config", cfg))
        cfg.setdefault("depth", cfg.get("num_hidden_layers", cls.depth))
        cfg.setdefault("num_heads", cfg.get("num_attention_heads", cls.num_heads))
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in cfg.items() if k in names})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rope_theta(self) -> float:
        return float((self.rope_parameters or {}).get("rope_theta", 10000.0))

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings**0.5)


_ACT = {
    "gelu_pytorch_tanh": lambda x: nn.gelu_approx(x),
    "gelu": nn.gelu,
    "silu": nn.silu,
    "quick_gelu": nn.gelu_fast_approx,
}


def block_positions(gh: int, gw: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch in spatial-merge-block order (m*m blocks, row-major)."""
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    shape = (gh // m, m, gw // m, m)
    return rows.reshape(shape).transpose(0, 2, 1, 3).ravel(), cols.reshape(shape).transpose(0, 2, 1, 3).ravel()


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    # bilinear, align_corners=True: endpoints map onto the table's endpoints
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    lo = np.floor(src)
    taps = np.clip(lo.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - lo[:, None] - np.arange(2)), 0, None).astype(np.float32)
    return taps, weights


def position_taps(gh: int, gw: int, m: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices [N, 4] into the flattened side x side position table and their weights."""
    row, col = block_positions(gh, gw, m)
    ht, hw = _axis_taps(row, gh, side)
    wt, ww = _axis_taps(col, gw, side)
    return (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4), (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)


class VisionAttention(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.num_heads = a.num_heads
        self.qkv = nn.Linear(a.hidden_size, 3 * a.hidden_size, bias=True)
        self.proj = nn.Linear(a.hidden_size, a.hidden_size, bias=True)
        self.scale = a.head_dim**-0.5

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array | None) -> mx.array:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).transpose(1, 2, 0, 3)  # 3 x [H, N, d]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = mx.fast.scaled_dot_product_attention(q[None], k[None], v[None], scale=self.scale, mask=mask)
        return self.proj(o[0].transpose(1, 0, 2).reshape(n, -1))


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class VisionMLP(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.linear_fc1 = nn.Linear(a.hidden_size, a.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(a.intermediate_size, a.hidden_size, bias=True)
        self.act = _ACT[a.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(a.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(a.hidden_size, eps=1e-6)
        self.attn = VisionAttention(a)
        self.mlp = VisionMLP(a)

    def __call__(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """m*m neighbouring patches -> one language-model token (norm before or after the shuffle)."""

    def __init__(self, a: VisionArgs, postshuffle_norm: bool):
        super().__init__()
        self.width = a.hidden_size * a.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.width if postshuffle_norm else a.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width, bias=True)
        self.linear_fc2 = nn.Linear(self.width, a.out_hidden_size, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x.reshape(-1, self.width)) if self.postshuffle_norm else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.proj = nn.Linear(a.patch_dim, a.hidden_size, bias=True)  # the Conv3d, kernel == stride

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)


@dataclass
class VisionOutput:
    embeddings: mx.array  # [tokens, out_hidden_size]: one row per merged token, images in order
    deepstack: list  # one [tokens, out_hidden_size] per deepstack layer
    hidden: mx.array  # [patches, hidden_size]: the last block's output (before merging)


class Qwen3VLVision(nn.Module):
    # the tower's activations follow the language model's dtype policy (vision/load.py sets it):
    # float32 under --dtype auto, whatever its weights' type; None = the weights' type
    activation_dtype = None

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = [VisionBlock(args) for _ in range(args.depth)]
        self.merger = PatchMerger(args, postshuffle_norm=False)
        self.deepstack_merger_list = [PatchMerger(args, postshuffle_norm=True) for _ in args.deepstack_visual_indexes]
        quarter = args.head_dim // 2
        self._inv_freq = 1.0 / (args.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))

    def _rope(self, grids) -> tuple[mx.array, mx.array]:
        m = self.args.spatial_merge_size
        pos = np.concatenate([np.tile(np.stack(block_positions(gh, gw, m), -1), (t, 1)) for t, gh, gw in grids])
        freqs = pos[..., None].astype(np.float32) * self._inv_freq  # [N, 2, d/4]
        freqs = np.concatenate([freqs[:, 0], freqs[:, 1]], -1)
        freqs = np.concatenate([freqs, freqs], -1)  # [N, d]
        return mx.array(np.cos(freqs))[None], mx.array(np.sin(freqs))[None]

    def _pos_embed(self, grids) -> mx.array:
        parts = []
        for t, gh, gw in grids:
            idx, w = position_taps(gh, gw, self.args.spatial_merge_size, self.args.grid_side)
            e = (self.pos_embed(mx.array(idx)) * mx.array(w)[:, :, None]).sum(1)
            parts.append(mx.tile(e, (t, 1)) if t > 1 else e)
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]

    @staticmethod
    def _mask(grids) -> mx.array | None:
        lengths = [t * gh * gw for t, gh, gw in grids]
        if len(lengths) == 1:
            return None
        owner = np.repeat(np.arange(len(lengths)), lengths)
        return mx.array(owner[:, None] == owner[None, :])  # attention stays inside each image

    def __call__(self, pixels: mx.array, grids: list[tuple[int, int, int]]) -> VisionOutput:
        """pixels [N, patch_dim] of the images in `grids` order; grids: (t, h, w) in patches each."""
        grids = [tuple(int(v) for v in g) for g in grids]
        dt = self.activation_dtype or self.patch_embed.proj.weight.dtype
        x = self.patch_embed(pixels.astype(dt))
        x = x + self._pos_embed(grids).astype(x.dtype)
        cos, sin = self._rope(grids)
        mask = self._mask(grids)
        deepstack = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, mask)
            if i in self.args.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.args.deepstack_visual_indexes.index(i)](x))
        return VisionOutput(self.merger(x), deepstack, x)

    def tokens_for(self, grid: tuple[int, int, int]) -> int:
        t, gh, gw = grid
        return t * gh * gw // self.args.spatial_merge_size**2

    @staticmethod
    def sanitize(weights: dict) -> dict:
        """transformers names -> this module's parameters (prefix stripped, Conv3d flattened)."""
        out = {}
        for k, v in weights.items():
            for p in PREFIXES:
                if k.startswith(p):
                    k = k[len(p) :]
                    break
            if k == "patch_embed.proj.weight" and v.ndim == 5:
                v = v.reshape(v.shape[0], -1)
            out[k] = v
        return out


def load_weights(model: Qwen3VLVision, weights: dict) -> Qwen3VLVision:
    arrays = {k: v if isinstance(v, mx.array) else mx.array(np.asarray(v)) for k, v in weights.items()}
    model.load_weights(list(Qwen3VLVision.sanitize(arrays).items()), strict=True)
    mx.eval(model.parameters())
    return model


def load_hf_dir(path: str | Path) -> Qwen3VLVision:
    """An HF folder (config.json with a `vision_config`, or the vision config itself, plus
    *.safetensors) -> the vision tower; only the vision tensors are read."""
    folder = Path(path)
    args = VisionArgs.from_dict(json.loads((folder / "config.json").read_text()))
    weights: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in mx.load(str(f)).items():
            if any(k.startswith(p) for p in PREFIXES) or not k.startswith(("model.", "lm_head")):
                weights[k] = v
    return load_weights(Qwen3VLVision(args), weights)


def demo_args(out_hidden_size: int) -> VisionArgs:
    """A tiny random tower for the demo models (`--vision demo`): 2 blocks, 32-px tokens."""
    return VisionArgs(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=out_hidden_size,
        num_position_embeddings=64,
        deepstack_visual_indexes=[],
    )


def demo_tower(out_hidden_size: int, seed: int = 0) -> Qwen3VLVision:
    mx.random.seed(seed)
    model = Qwen3VLVision(demo_args(out_hidden_size))
    mx.eval(model.parameters())
    return model
