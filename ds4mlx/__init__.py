"""ds4mlx: an MLX inference engine for the DeepSeek V4 Flash family."""

from __future__ import annotations

import os

# MLX's CUDA backend records kernels into CUDA graphs of at most N ops / M MB of inputs; its
# H100/H200 defaults (100 ops, 1000 MB) end a graph at every routed-MoE call (the expert
# tensors alone exceed 1000 MB), so a decode step became ~40 graphs; 400 ops and no byte bound
# decode 1.55x faster (docs/bench-history.md: the compiled step's graph settings).  Read once when
# MLX creates its first stream, so they must be set before mlx.core is used; the user's
# own values win.  No effect on Metal or the CPU.
os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "400")
os.environ.setdefault("MLX_MAX_MB_PER_BUFFER", "1000000")
# float32 activations mean float32 products (dtype_policy, docs/numerics.md): MLX's CUDA (and
# Apple M5) matmuls otherwise run float32 GEMMs as TF32, ~1e-3 relative per product, so a
# prefill (GEMM) and a decode step (mat-vec, full float32) of the same tokens disagree by
# ~4e-3 in logits at two layers and flip near-tied compressed-row selections past that
# (H100, synthetic V4 Flash).  The user's own value wins.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

__version__ = "0.1.0"


def load(path=None, dtype="auto", mtp=None, verbose=True, stream=None, ctx=None):
    """Load `(model, tokenizer)` from a GGUF file, a Hugging Face folder
    (config.json + *.safetensors) or a hub name (`org/repo[:file]`, `ds4mlx pull`'s names)
    already in the local hub cache.  `path=None` loads the built-in demo model.
    `dtype`: "auto" (float32 activations, as ds4), "float32", "bfloat16", "float16";
    `mtp`: ds4's separate MTP support GGUF (see `loader.load`); `stream`: an
    `ds4mlx.experts.StreamConfig` for SSD expert streaming; `ctx`: check (and on a Mac
    wire) the memory for this context (io/memory_fit.py)."""
    from .io.loader import load as _load

    return _load(path, dtype=dtype, mtp=mtp, verbose=verbose, stream=stream, ctx=ctx)


__all__ = ["load", "__version__"]
