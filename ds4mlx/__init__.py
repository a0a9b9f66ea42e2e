"""ds4mlx: an MLX inference engine for the DeepSeek V4 Flash family."""
from __future__ import annotations

__version__ = "0.1.0"


def load(path=None):
    """Load `(model, tokenizer)` from a GGUF file or a Hugging Face folder
    (config.json + *.safetensors).  `path=None` loads the built-in demo model."""
    from .loader import load as _load

    return _load(path)


__all__ = ["load", "__version__"]
