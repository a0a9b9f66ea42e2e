"""`--vision FILE|DIR|demo` -> a VisionEncoder for the loaded language model.

* `demo`: a tiny random Qwen3-VL tower (models/vision_qwen3vl.demo_tower) projecting into
  the model's width, with image token ids taken from the unused top of the vocabulary,
  so the whole image path runs with nothing downloaded;
* a Hugging Face folder (config.json with a `vision_config` or the vision config itself,
  *.safetensors): the vision tensors and the config's image token ids.

Only families whose embedding step takes encoder rows (`input_rows`) accept images.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..models import vision_qwen3vl as Q
from .encoder import ImageTokenIds, VisionEncoder

DEMO = "demo"


class VisionLoadError(ValueError):
    pass


def backbone_of(model):
    """The family backbone that holds `embed_tokens` (a LanguageModel, a Model or a backbone)."""
    m = getattr(model, "model", model)
    m = getattr(m, "model", m)
    return m


def supports_vision(model) -> bool:
    return hasattr(backbone_of(model), "input_rows")


def _demo_ids(vocab_size: int) -> ImageTokenIds:
    return ImageTokenIds(start=vocab_size - 3, pad=vocab_size - 2, end=vocab_size - 1)


def _config_ids(cfg: dict, vocab_size: int) -> ImageTokenIds:
    keys = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
    if not all(isinstance(cfg.get(k), int) for k in keys):
        return _demo_ids(vocab_size)
    ids = ImageTokenIds(*(cfg[k] for k in keys))
    if max(ids.start, ids.pad, ids.end) >= vocab_size:
        raise VisionLoadError(f"image token ids {ids} are outside the model's vocabulary ({vocab_size})")
    return ids


def load_vision(spec: str, model) -> VisionEncoder:
    """The encoder for `model` (a LanguageModel) from a --vision argument."""
    if not supports_vision(model):
        raise VisionLoadError("--vision needs a model family that takes image input (Qwen3.8: qwen4_exp)")
    args = getattr(model, "args", None) or backbone_of(model).args
    hidden, vocab = int(args.hidden_size), int(args.vocab_size)
    if spec == DEMO:
        return VisionEncoder(Q.demo_tower(hidden), _demo_ids(vocab), name="demo")
    path = Path(spec)
    if path.is_dir() and (path / "config.json").exists():
        cfg = json.loads((path / "config.json").read_text())
        tower = Q.load_hf_dir(path)
        if tower.args.out_hidden_size != hidden:
            raise VisionLoadError(
                f"the vision tower projects to {tower.args.out_hidden_size}, the model's width is {hidden}"
            )
        return VisionEncoder(tower, _config_ids(cfg, vocab), name=str(path.resolve()))
    if path.suffix == ".gguf":
        raise VisionLoadError(f"{spec}: llama.cpp mmproj GGUF vision files are not supported yet; use an HF folder")
    raise VisionLoadError(f"{spec}: not a vision encoder (an HF folder with config.json, or 'demo')")
