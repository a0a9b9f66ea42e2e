"""ds4mlx: an MLX inference engine for the DeepSeek V4 Flash family."""

from __future__ import annotations

__version__ = "0.1.0"


def load(path=None, dtype="auto", mtp=None, verbose=True, stream=None):
    """Load `(model, tokenizer)` from a GGUF file or a Hugging Face folder
    (config.json + *.safetensors).  `path=None` loads the built-in demo model.
    `dtype`: "auto" (float32 activations, as ds4), "float32", "bfloat16", "float16";
    `mtp`: ds4's separate MTP support GGUF (see `loader.load`); `stream`: an
    `ds4mlx.experts.StreamConfig` for SSD expert streaming."""
    from .loader import load as _load

    return _load(path, dtype=dtype, mtp=mtp, verbose=verbose, stream=stream)


__all__ = ["load", "__version__"]
