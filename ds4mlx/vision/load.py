"""`--vision FILE|DIR|demo` -> a VisionEncoder for the loaded language model.

* `demo`: a tiny random Qwen3-VL tower (models/vision_qwen3vl.demo_tower) projecting into
  the model's width, with image token ids taken from the unused top of the vocabulary,
  so the whole image path runs with nothing downloaded;
* a Hugging Face folder (config.json with a `vision_config` or the vision config itself,
  *.safetensors): the vision tensors (and the config's image token ids);
* a llama.cpp mmproj GGUF (projector `qwen3vl_merger`, vision/mmproj.py).

The image token ids: the HF config's, else the tokenizer's `<|vision_start|>`,
`<|image_pad|>`, `<|vision_end|>`; `demo` falls back to the top of the vocabulary.

Only families whose embedding step takes encoder rows (`input_rows`) accept images.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..chat.families import qwen
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


def _tokenizer_ids(tokenizer) -> ImageTokenIds | None:
    to_id = getattr(tokenizer, "token_to_id", None)
    if to_id is None:
        return None
    ids = [to_id(s) for s in (qwen.VISION_START, qwen.IMAGE_PAD, qwen.VISION_END)]
    return ImageTokenIds(*ids) if all(isinstance(i, int) for i in ids) else None


def _token_ids(cfg: dict, tokenizer, vocab_size: int, demo: bool) -> ImageTokenIds:
    keys = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
    if all(isinstance(cfg.get(k), int) for k in keys):
        ids = ImageTokenIds(*(cfg[k] for k in keys))
    else:
        ids = _tokenizer_ids(tokenizer)
        if ids is None:
            if not demo:
                raise VisionLoadError(
                    "the tokenizer has no image tokens (<|vision_start|> <|image_pad|> <|vision_end|>)"
                )
            ids = _demo_ids(vocab_size)
    if max(ids.start, ids.pad, ids.end) >= vocab_size:
        raise VisionLoadError(f"image token ids {ids} are outside the model's vocabulary ({vocab_size})")
    return ids


def load_vision(spec: str, model, tokenizer=None) -> VisionEncoder:
    """The encoder for `model` (a LanguageModel) from a --vision argument."""
    if not supports_vision(model):
        raise VisionLoadError("--vision needs a model family that takes image input (Qwen3.8: qwen4_exp)")
    args = getattr(model, "args", None) or backbone_of(model).args
    hidden, vocab = int(args.hidden_size), int(args.vocab_size)
    # the tower computes in the language model's activation dtype (the banner's), whatever its weights'
    act = getattr(getattr(model, "dtype_policy", None), "activations", None)
    if spec == DEMO:
        tower = Q.demo_tower(hidden)
        tower.activation_dtype = act
        return VisionEncoder(tower, _token_ids({}, tokenizer, vocab, demo=True), name="demo")
    path = Path(spec)
    cfg: dict = {}
    if path.is_dir() and (path / "config.json").exists():
        cfg = json.loads((path / "config.json").read_text())
        tower = Q.load_hf_dir(path)
    elif path.is_file() and path.suffix == ".gguf":
        from .mmproj import load_mmproj

        tower = load_mmproj(path)
    else:
        raise VisionLoadError(f"{spec}: not a vision encoder (an HF folder, an mmproj .gguf, or 'demo')")
    if tower.args.out_hidden_size != hidden:
        raise VisionLoadError(
            f"the vision tower projects to {tower.args.out_hidden_size}, the model's width is {hidden}"
        )
    tower.activation_dtype = act
    return VisionEncoder(tower, _token_ids(cfg, tokenizer, vocab, demo=False), name=str(path.resolve()))
