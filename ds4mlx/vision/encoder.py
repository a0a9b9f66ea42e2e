"""A loaded vision tower + what the language model needs from it (docs/vision.md §2-§3).

* `VisionEncoder.block_ids(image)`: the image's token block, `vision_start`, one
  `image_pad` per merged token, `vision_end` (Qwen3-VL layout);
* `VisionEncoder.rows(image)`: the encoder output for the pad tokens [n, hidden], from the
  LRU cache (cache.py) when the same bytes were encoded before;
* `tokenize(tokenizer, text, images, encoder)`: rendered text with image markers ->
  token ids + one `ImageSpan` per image (where its block sits, its fingerprint);
* `ImageRows`: the hook the language model's embedding step calls during a prefill to
  put the encoder rows at the pad positions (models/qwen4_exp.py `input_rows`);
* `mrope_positions`: the 3D (t, h, w) rope positions of a prompt with image blocks, as
  transformers' `get_rope_index` for the Qwen3.8 family.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..chat import images as chat_images
from ..models import vision_preprocess as vp
from .cache import EncoderCache


@dataclass(frozen=True)
class ImageTokenIds:
    start: int
    pad: int
    end: int


@dataclass(frozen=True)
class ImageSpan:
    start: int  # absolute position of the block's vision_start token
    length: int  # tokens in the block (start + pads + end)
    fingerprint: str  # sha256 of the image bytes + the encoder identity
    grid: tuple[int, int, int]  # (t, h, w) in patches

    @property
    def pads(self) -> range:
        return range(self.start + 1, self.start + self.length - 1)


class VisionEncoder:
    def __init__(self, tower, ids: ImageTokenIds, name: str, cache: EncoderCache | None = None):
        self.tower, self.ids, self.name = tower, ids, name
        self.cache = cache if cache is not None else EncoderCache()
        a = tower.args
        self._geometry = (a.patch_size, a.spatial_merge_size, a.temporal_patch_size)
        self.identity = hashlib.sha256(f"{name}|{a}".encode()).hexdigest()[:16]

    def grid_for(self, image: chat_images.ImageInput) -> tuple[int, int, int]:
        patch, merge, _ = self._geometry
        h, w = vp.target_size(image.height, image.width, patch, merge, vp.MIN_TOKENS, vp.max_tokens())
        return (1, h // patch, w // patch)

    def n_tokens(self, image: chat_images.ImageInput) -> int:
        return self.tower.tokens_for(self.grid_for(image))

    def block_ids(self, image: chat_images.ImageInput) -> list[int]:
        return [self.ids.start] + [self.ids.pad] * self.n_tokens(image) + [self.ids.end]

    def fingerprint(self, image: chat_images.ImageInput) -> str:
        return hashlib.sha256((image.fingerprint + self.identity).encode()).hexdigest()

    def rows(self, image: chat_images.ImageInput) -> mx.array:
        """[n_tokens, out_hidden] float32 encoder output of the image (cached by its bytes)."""

        def compute():
            patch, merge, temporal = self._geometry
            p = vp.preprocess(image.image(), patch_size=patch, merge_size=merge, temporal_patch_size=temporal)
            out = self.tower(mx.array(p.pixels), [p.grid]).embeddings.astype(mx.float32)
            mx.eval(out)
            return out, out.nbytes

        return self.cache.get_or_compute(image.data, compute)


def tokenize(tokenizer, text: str, images: list, encoder: VisionEncoder) -> tuple[list[int], list[ImageSpan]]:
    """Token ids of `text` with each image marker replaced by the image's token block."""
    ids: list[int] = []
    spans: list[ImageSpan] = []
    for piece in chat_images.split_markers(text, images):
        if isinstance(piece, str):
            ids += tokenizer.encode(piece)
            continue
        block = encoder.block_ids(piece)
        spans.append(ImageSpan(len(ids), len(block), encoder.fingerprint(piece), encoder.grid_for(piece)))
        ids += block
    return ids, spans


class ImageRows:
    """Embedding rows to put at absolute positions during a prefill.

    Called as `hook(h [1, T, H], offset)` by the model's embedding step, `offset` the
    position of h's first token; rows outside [offset, offset + T) wait for their chunk."""

    def __init__(self, positions: np.ndarray, rows: mx.array):
        self.positions = np.asarray(positions, np.int64)
        self.rows = rows

    @classmethod
    def for_spans(cls, spans: list[ImageSpan], rows: list[mx.array]) -> ImageRows:
        pos = np.concatenate([np.arange(s.pads.start, s.pads.stop) for s in spans])
        return cls(pos, mx.concatenate(rows) if len(rows) > 1 else rows[0])

    def __call__(self, h: mx.array, offset: int) -> mx.array:
        t = h.shape[1]
        sel = np.nonzero((self.positions >= offset) & (self.positions < offset + t))[0]
        if sel.size == 0:
            return h
        local = mx.array(self.positions[sel] - offset)
        h[:, local] = self.rows[mx.array(sel)].astype(h.dtype)[None]
        return h


class PromptPositions:
    """The model's `input_positions` hook: `hook(n) -> [3, n]` MRoPE positions of a
    prompt's rows [0, n) (its image spans anywhere in it)."""

    def __init__(self, spans: list[ImageSpan], merge: int):
        self.spans, self.merge = list(spans), merge

    def __call__(self, n: int) -> np.ndarray:
        whole = max([n] + [s.start + s.length for s in self.spans])  # a chunk may end inside an image
        return mrope_positions(whole, self.spans, self.merge)[:, :n]


def mrope_positions(n_tokens: int, spans: list[ImageSpan], merge: int) -> np.ndarray:
    """[3, n_tokens] (t, h, w) positions: text advances all three by one per token; an
    image's pad tokens sit on their merged grid offset by the running position, which
    then moves on by max(grid_h, grid_w) (transformers' Qwen3.5 / qwen4_exp get_rope_index;
    the vision_start / vision_end tokens are text)."""
    out = np.zeros((3, n_tokens), np.int64)
    cur, i = 0, 0
    for s in sorted(spans, key=lambda s: s.start):
        first, stop = s.pads.start, s.pads.stop
        out[:, i:first] = np.arange(first - i) + cur
        cur += first - i
        t, gh, gw = s.grid[0], s.grid[1] // merge, s.grid[2] // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[0, first:stop] = tt.ravel() + cur
        out[1, first:stop] = hh.ravel() + cur
        out[2, first:stop] = ww.ravel() + cur
        cur += max(gh, gw)
        i = stop
    out[:, i:] = np.arange(n_tokens - i) + cur
    return out
