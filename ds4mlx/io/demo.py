"""The built-in demo model: the real DeepSeek V4 Flash architecture and tokenizer,
tiny and with RANDOM weights, so a newcomer can watch the whole pipeline (server,
streaming, tools, cache) run without downloading anything.  Its text is gibberish."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from .. import registry

DEMO_NOTICE = "demo model: real DeepSeek V4 Flash architecture and tokenizer, RANDOM weights (output is gibberish)"
_ARCHITECTURES = {
    "deepseek_v4": "DeepSeek V4 Flash",
    "deepseek_v41": "DeepSeek V4.1 Flash",
    "glm_moe_dsa": "GLM 5.2",
    "glm5_next": "GLM 5.3 Flash",
    "qwen4_exp": "Qwen3.8 Flash Next",
}


def notice(model) -> str:
    """The banner of a loaded demo model, naming its own architecture (the other families'
    demos use DeepSeek's tokenizer: theirs are not bundled)."""
    config = getattr(model, "config", None) or {}
    fam = registry.family_of(config.get("model_type"))
    key = fam.key if fam is not None else registry.DEFAULT_FAMILY
    if key == registry.DEFAULT_FAMILY:
        return DEMO_NOTICE
    name = _ARCHITECTURES.get(key, key)
    return f"demo model: {name} architecture, DeepSeek's tokenizer, RANDOM weights (output is gibberish)"


# The demo's output limit where neither the request nor the command line sets one: random
# weights never write an end of turn, so without it an answer would run to the context's end.
DEMO_MAX_TOKENS = 256


def limit_notice(tokens: int) -> str:
    return f"demo model: answers stop after {tokens} tokens unless a request sets max_tokens (--tokens N)"


SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def v4_real_settings() -> dict:
    """The V4 Flash settings the demo and the synthetic bench model keep real: vocabulary,
    one KV head, one shared expert, compression rates and window, hyper-connections, rope,
    norm and special ids (a fresh dict: callers may edit their config)."""
    return {
        "model_type": "deepseek_v4",
        "vocab_size": 129280,
        "num_key_value_heads": 1,
        "n_shared_experts": 1,
        "compress_rates": {CSA: 4, HCA: 128},
        "sliding_window": 128,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
    }


# Real V4 Flash ratios, window, rope and vocabulary; everything else scaled down.
DEMO_CONFIG = {
    **v4_real_settings(),
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 64,
    "demo_model": True,
}
DEMO_SEED = 20261130
DEMO_VERSION = 1


def _cache_dir() -> Path:
    root = os.environ.get("DS4MLX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ds4mlx"
    )
    return Path(root)


def demo_config(family: str = registry.DEFAULT_FAMILY) -> dict:
    """The demo config of a family: ours for the GGUF demo (V4), the family module's
    DEMO_CONFIG otherwise."""
    if registry.family(family).demo_format == "gguf":
        return DEMO_CONFIG
    from ..models.base import family_module

    cfg = getattr(family_module(family), "DEMO_CONFIG", None)
    if cfg is None:
        raise ValueError(f"no demo model for family {family!r}")
    return cfg


def demo_weights(config: dict = DEMO_CONFIG, seed: int = DEMO_SEED) -> dict[str, np.ndarray]:
    """Deterministic random weights under transformers' in-memory names.  A family
    module may define `demo_weights(config, seed)` for tensors this generic recipe
    cannot fill (integer tables, ...)."""
    from mlx.utils import tree_flatten

    from ..models.base import family_module

    mod = family_module(config["model_type"])
    if hasattr(mod, "demo_weights"):
        return mod.demo_weights(config, seed)
    args = mod.ModelArgs.from_dict(config)
    shapes = {k: v.shape for k, v in tree_flatten(mod.Model(args).parameters())}
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        hf_name = (
            name[: -len(".weight")]
            if name.endswith((".mlp.experts.gate_up_proj.weight", ".mlp.experts.down_proj.weight"))
            else name
        )
        if name.endswith("tid2eid"):
            e, k = args.n_routed_experts, args.num_experts_per_tok
            out[hf_name] = np.stack([rng.permutation(e)[:k] for _ in range(shape[0])]).astype(np.int64)
        elif len(shape) >= 2:
            std = 0.02 if "embed" in name else 1.0 / np.sqrt(shape[-1])
            out[hf_name] = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
        elif "norm" in name:
            out[hf_name] = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        else:  # sinks, biases, hyper-connection base/scale
            out[hf_name] = (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return out


def _build_hf_folder(path: Path, config: dict) -> Path:
    """Other families: a Hugging Face folder (config.json, model.safetensors, the
    DeepSeek tokenizer.json), written to a temp dir and renamed into place."""
    import shutil

    from safetensors.numpy import save_file

    from ..runtime.tokenizer import default_tokenizer_json

    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        save_file(demo_weights(config), str(tmp / "model.safetensors"))
        shutil.copy(default_tokenizer_json(), tmp / "tokenizer.json")
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_demo_model(path: Path) -> Path:
    """Write the demo GGUF (F16 weights, real tokenizer) atomically to `path`."""
    from ..runtime.tokenizer import Tokenizer
    from .convert import write_gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        write_gguf(
            tmp,
            DEMO_CONFIG,
            demo_weights(),
            tokenizer=Tokenizer.default(),
            dtype="f16",
            name="ds4mlx demo (random weights)",
        )
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _tag(family: str = registry.DEFAULT_FAMILY) -> str:
    blob = json.dumps([demo_config(family), DEMO_SEED, DEMO_VERSION], sort_keys=True).encode()
    return hashlib.sha1(blob).hexdigest()[:10]


def demo_model_path(family: str = registry.DEFAULT_FAMILY, quiet: bool = False) -> str:
    """The demo model of a family in the user cache dir, built on first use
    (a GGUF for DeepSeek V4, a Hugging Face folder for the other families)."""
    gguf = registry.family(family).demo_format == "gguf"
    if gguf:
        path = _cache_dir() / f"demo-v4flash-{_tag()}.gguf"
    else:
        path = _cache_dir() / f"demo-{family}-{_tag(family)}"
    if not path.exists():
        if not quiet:
            print(f"ds4mlx: building the {family} {DEMO_NOTICE.split(': ', 1)[0]} at {path}", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        build_demo_model(path) if gguf else _build_hf_folder(path, demo_config(family))
    return str(path)


def add_arguments(parser) -> None:
    parser.add_argument(
        "--family",
        default=registry.DEFAULT_FAMILY,
        choices=tuple(registry.BY_KEY),
        help=f"model family (default {registry.DEFAULT_FAMILY})",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")


def run(args) -> int:
    import shutil

    path = Path(demo_model_path(args.family, quiet=True)) if not args.force else None
    if args.force:
        tag = _tag(args.family)
        for p in (_cache_dir() / f"demo-v4flash-{tag}.gguf", _cache_dir() / f"demo-{args.family}-{tag}"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        path = Path(demo_model_path(args.family))
    print(path)
    print(f"({DEMO_NOTICE})", file=sys.stderr)
    return 0
