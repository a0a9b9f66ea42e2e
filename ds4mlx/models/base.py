"""The family-independent public face of a model.

`LanguageModel` wraps a family's `Model` (models/<family>.py):

* `logits(token_ids) -> np.ndarray [T, V] float32`: one full forward from an empty state;
* `new_session(ctx, chunk) -> Session` (session.py) for prefill / decode / snapshot.

`from_config(config, weights)` builds it from a Hugging Face config dict and tensors named
as transformers' in-memory state dict (the family's `Model.sanitize` maps them); GGUF
quantized tensors (`weights.QuantizedTensor`) become quantized modules (models/quantized.py);
`load_hf_dir(path)` reads `config.json` + `*.safetensors` from a folder.
"""

from __future__ import annotations

import glob
import json
import os

import mlx.core as mx
import numpy as np

from .. import registry
from ..registry import family_module  # noqa: F401  (callers import it from here too)
from ..runtime.session import Session


class LanguageModel:
    session_type = Session  # what new_session builds (distributed/serving.py: rank 0's LeaderSession)

    def __init__(self, model, args=None):
        self.model = model
        self.args = args if args is not None else getattr(model, "args", None)
        self.dtype_policy = None  # dtype_policy.DtypePolicy, set by loader.load
        self.mtp_weights = {}  # MTP tensors (loader.load): `--mtp` builds the head from them

    @property
    def vocab_size(self) -> int:
        return int(self.args.vocab_size)

    @classmethod
    def from_config(
        cls,
        config: dict,
        weights: dict | None = None,
        dtype=None,
        strict: bool = True,
        stream=None,
        path: str = "",
        shard=None,
    ) -> LanguageModel:
        """`stream`: an `experts.StreamConfig` with `enabled`: the routed experts stay in
        the file behind a bounded cache (ds4mlx/experts/); `path` names it in errors.
        `shard`: a `distributed.sharding.Sharding`: this rank's config, tensors and modules."""
        mod = family_module(config.get("model_type", registry.DEFAULT_FAMILY))
        args = mod.ModelArgs.from_dict(config)
        if shard is not None:  # sliced before any tensor is read
            args = shard.args(args)
            weights = None if weights is None else shard.weights(weights)
        model = mod.Model(args)
        if shard is not None:
            shard.install(model)
        detached = None
        if weights is not None and stream is not None and stream.enabled:
            from ..experts.install import detach_experts

            weights, detached = detach_experts(model, weights)
        if weights is not None:
            from .quantized import install_quantized, needs_install
            from .tensor_load import to_mlx, to_mlx_weights

            # one tensor at a time: read, cast, evaluate, release the file's pages
            weights = to_mlx_weights(weights, dtype)
            weights = model.sanitize(weights)
            owned = {}
            if needs_install(weights):  # packed tensors / split experts: models/quantized.py
                weights, owned = install_quantized(model, weights, dtype)
            if dtype is not None:
                weights = {k: to_mlx(v, dtype) for k, v in weights.items()}
            model.load_weights(list(weights.items()) + list(owned.items()), strict=strict)
            if detached:
                from ..experts.install import attach_store
                from .quantized import compute_dtype_of, record_expert_paths

                mx.eval(model.parameters())
                compute = dtype or compute_dtype_of(weights)
                banks = [v for _, _, layer_banks in detached.values() for v in layer_banks.values()]
                record_expert_paths(model, banks, dtype, compute)  # the banner's lines for what the store builds
                attach_store(model, detached, stream, path, dtype, compute, config=config)
        from .qmv_linear import use_fast_qmv

        use_fast_qmv(model)  # decode-sized quantized linears: our mat-vec on a GPU
        mx.eval(model.parameters())
        model.eval()
        return cls(model, args)

    def logits(self, token_ids) -> np.ndarray:
        """Logits [T, V] (float32) of a full forward of `token_ids` from an empty state."""
        ids = mx.array([list(token_ids)], dtype=mx.int32)
        out = self.model(ids)[0]
        return np.array(out.astype(mx.float32))

    def new_session(self, ctx: int = 4096, chunk: int | None = None) -> Session:
        return self.session_type(self.model, ctx=ctx, chunk=chunk)


def load_hf_dir(path: str, dtype=None, shard=None) -> LanguageModel:
    """Build from a folder holding `config.json` and `*.safetensors` (transformers in-memory names)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    weights = {}
    for fn in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        weights.update(mx.load(fn))
    return LanguageModel.from_config(config, weights, dtype=dtype, shard=shard)
