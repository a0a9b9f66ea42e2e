"""Image -> the Qwen3-VL tower's input (transformers' Qwen2-VL image processor, PIL path).

The image is resized (Pillow, bicubic) so both sides are multiples of patch*merge
(32 px for Qwen3-VL) and its token count lies in the budget (64..1024 tokens by default,
DS4MLX_IMAGE_MAX_TOKENS raises the ceiling), scaled to [0, 1], normalised with
mean = std = 0.5, and cut into patches in spatial-merge-block order, each patch
repeated `temporal_patch_size` times (a still image is a two-frame clip).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image

MIN_TOKENS = 64
MAX_TOKENS = 1024
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)
MAX_ASPECT = 200  # transformers refuses more extreme images


class ImageGeometryError(ValueError):
    """The image cannot be cut into patches (aspect ratio beyond MAX_ASPECT)."""


def max_tokens() -> int:
    return int(os.environ.get("DS4MLX_IMAGE_MAX_TOKENS") or MAX_TOKENS)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' qwen2_vl smart_resize: sides multiples of `factor`, area in range."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageGeometryError(f"absolute aspect ratio must be smaller than {MAX_ASPECT}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass
class Patches:
    pixels: np.ndarray  # float32 [t*gh*gw, C*T*P*P]
    grid: tuple[int, int, int]  # (t, gh, gw) in patches
    size: tuple[int, int]  # resized (height, width) in pixels


def target_size(height: int, width: int, patch: int, merge: int, min_tok: int, max_tok: int) -> tuple[int, int]:
    factor = patch * merge
    return smart_resize(height, width, factor, min_tok * factor * factor, max_tok * factor * factor)


def preprocess(
    image: Image.Image,
    *,
    patch_size: int = 16,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    min_tokens: int = MIN_TOKENS,
    max_tokens_: int | None = None,
) -> Patches:
    rgb = image.convert("RGB")
    h, w = target_size(rgb.height, rgb.width, patch_size, merge_size, min_tokens, max_tokens_ or max_tokens())
    if (h, w) != (rgb.height, rgb.width):
        rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
    x = np.asarray(rgb, dtype=np.float32) / 255.0
    x = ((x - np.array(MEAN, np.float32)) / np.array(STD, np.float32)).transpose(2, 0, 1)  # [C, H, W]
    return Patches(
        patchify(x, patch_size, merge_size, temporal_patch_size), (1, h // patch_size, w // patch_size), (h, w)
    )


def patchify(x: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """[C, H, W] -> [gh*gw, C*temporal*patch*patch], patches in m*m-block order."""
    c, h, w = x.shape
    gh, gw = h // patch, w // patch
    p = x.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch).transpose(1, 4, 2, 5, 0, 3, 6)
    p = np.broadcast_to(p[:, :, :, :, :, None], (*p.shape[:5], temporal, *p.shape[5:]))
    return np.ascontiguousarray(p.reshape(gh * gw, c * temporal * patch * patch), dtype=np.float32)
