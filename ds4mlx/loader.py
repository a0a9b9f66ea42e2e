"""Path -> (model, tokenizer).  The one place that joins weights I/O, the model
family and the tokenizer; `ds4mlx.load` is its public face."""
from __future__ import annotations

import os

import mlx.core as mx

from .models.base import LanguageModel
from .tokenizer import Tokenizer
from .weights import read_weights


def default_dtype():
    """float32 on the CPU (MLX's CPU bf16 matmul is ~10x slower), the file's own
    16-bit type on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else None


def load(path=None, dtype="auto"):
    """Load a GGUF file or a Hugging Face folder; `None` is the built-in demo model."""
    if path is None:
        from .demo import demo_model_path

        path = demo_model_path()
    path = os.fspath(path)
    config, tensors, tokenizer = read_weights(path)
    if dtype == "auto":
        dtype = default_dtype()
    model = LanguageModel.from_config(config, tensors, dtype=dtype)
    model.path = path
    model.config = config
    if tokenizer is None:
        tokenizer = Tokenizer.default()
    return model, tokenizer
