"""Random full-size DeepSeek V4 Flash models built directly on the device (no file),
MLX-quantized, to measure speed without real weights (`ds4mlx bench --synthetic`).

Shapes follow the released V4 Flash config: 43 layers (2 sliding-window, then CSA
ratio 4 and HCA ratio 128 alternating), hidden 4096, 64 heads x 512, 256 routed
experts top-6 + 1 shared, vocab 129280 — the same shapes as the mlx-lm anchor in
shared/perf/.  Routed experts are quantized to `expert_bits`, every other linear
(and the embedding) to `other_bits` (16 = keep bfloat16).
"""

from __future__ import annotations

import time

from ..io.demo import CSA, HCA, SLIDING, v4_real_settings
from ..io.quant import expert_spans, random_gguf_blocks
from .roofline import active_weight_bytes


def v4_flash_config(layers: int = 43, experts: int = 256) -> dict:
    ratios = ([0, 0] + [4 if i % 2 == 0 else 128 for i in range(max(layers - 2, 0))])[:layers]
    kinds = {0: SLIDING, 4: CSA, 128: HCA}
    return {
        **v4_real_settings(),
        "hidden_size": 4096,
        "num_hidden_layers": layers,
        "num_attention_heads": 64,
        "head_dim": 512,
        "partial_rotary_factor": 64 / 512,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "moe_intermediate_size": 2048,
        "n_routed_experts": experts,
        "num_experts_per_tok": 6,
        "layer_types": [kinds[r] for r in ratios],
        "mlp_layer_types": ["hash_moe" if i < 3 else "moe" for i in range(layers)],
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "swiglu_limit": 10.0,
        "routed_scaling_factor": 1.5,
    }


def named_normal(name: str, shape, std: float):
    """Deterministic N(0, std²) bf16 values keyed by a tensor's name, so another
    graph (mlx-lm's, in tools/mlxlm_side_by_side.py) can be given the same weights."""
    import zlib

    import mlx.core as mx

    key = mx.random.key(zlib.crc32(name.encode()))
    return (mx.random.normal(tuple(shape), key=key) * std).astype(mx.bfloat16)


def weight_std(name: str, shape) -> float:
    return 0.02 if "embed" in name else shape[-1] ** -0.5


def named_experts(name: str, shape, std: float):
    """`named_normal` for an expert bank [E, ...], generated a `quant.expert_spans` slice at a time."""
    import mlx.core as mx

    return mx.concatenate([named_normal(f"{name}#{i}", (e, *shape[1:]), std) for i, e in expert_spans(shape[0])])


def _gguf_experts(module, seed: int) -> None:
    """Routed experts as ds4's 2-bit GGUF files store them: gate / up IQ2_XXS, down
    Q2_K, computed on the blocks by `kernels.quant_moe` (no float bank is ever made)."""
    from ..models.quantized import GGUFSwitchLinear, SplitSwitchLinear

    experts = getattr(getattr(module, "mlp", None), "experts", None)
    if experts is None:
        return
    e, two_i, h = experts.gate_up_proj.weight.shape
    i = two_i // 2
    experts.gate_up_proj = SplitSwitchLinear(
        GGUFSwitchLinear(random_gguf_blocks("IQ2_XXS", e, i, h, seed), "IQ2_XXS", h),
        GGUFSwitchLinear(random_gguf_blocks("IQ2_XXS", e, i, h, seed + 1), "IQ2_XXS", h),
    )
    experts.down_proj = GGUFSwitchLinear(random_gguf_blocks("Q2_K", e, h, i, seed + 2), "Q2_K", i)


def default_value(name: str, p, n_experts: int, k: int):
    """The synthetic value of parameter `name` (full dotted name) shaped like `p`."""
    import zlib

    import mlx.core as mx

    if name.endswith("tid2eid"):
        # k distinct experts per token: start + j * odd stride (mod E).  (An argsort over
        # [vocab, E] rows breaks MLX CUDA's launch grid: 129280 rows > 65535 blocks.)
        key = mx.random.key(zlib.crc32(name.encode()))
        k1, k2 = mx.random.split(key)
        start = mx.random.randint(0, n_experts, (p.shape[0], 1), key=k1)
        stride = 2 * mx.random.randint(0, max(n_experts // 2, 1), (p.shape[0], 1), key=k2) + 1
        return ((start + stride * mx.arange(k)[None]) % n_experts).astype(p.dtype)
    if p.ndim == 3:
        return named_experts(name, p.shape, weight_std(name, p.shape))
    if p.ndim >= 2:
        return named_normal(name, p.shape, weight_std(name, p.shape))
    if "norm" in name:
        return mx.ones(p.shape, mx.bfloat16)
    return (0.1 * named_normal(name, p.shape, 1.0)).astype(mx.float32)


def _randomize(module, prefix: str, n_experts: int, k: int, value=default_value) -> None:
    """Replace every parameter of `module` by `value(full name, param, ...)` (lazy);
    uint8 GGUF blocks (already random) are kept."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    new = [
        (name, value(prefix + name, p, n_experts, k))
        for name, p in tree_flatten(module.parameters())
        if p.dtype != mx.uint8
    ]
    module.update(tree_unflatten(new))


def _quantize(module, expert_bits: int, other_bits: int) -> None:
    import mlx.nn as nn

    from ..models.layers import SwitchLinear, quantize_switch

    experts = getattr(getattr(module, "mlp", None), "experts", None)
    if experts is not None:
        for name in ("gate_up_proj", "down_proj"):
            if isinstance(getattr(experts, name, None), SwitchLinear):
                setattr(experts, name, quantize_switch(getattr(experts, name), expert_bits))

    def pred(path, m):
        if not hasattr(m, "to_quantized") or isinstance(m, SwitchLinear):
            return False
        w = getattr(m, "weight", None)
        if other_bits >= 16 or w is None or w.shape[-1] % 64:
            return False
        return {"bits": other_bits, "group_size": 64}

    nn.quantize(module, class_predicate=pred)
    from ..models.qmv_linear import use_fast_qmv

    use_fast_qmv(module)  # decode-sized quantized linears: our mat-vec on a GPU


def build_synthetic_v4_flash(
    layers: int | None = None,
    experts: int | None = None,
    expert_bits: int = 2,
    other_bits: int = 8,
    value=default_value,
    overrides: dict | None = None,
    expert_format: str = "mlx",
):
    """-> (LanguageModel, Tokenizer, info dict with sizes and the HBM roofline).

    `expert_format` "mlx": routed experts MLX affine `expert_bits` (gather_qmm);
    "gguf": ds4's 2-bit GGUF layout (IQ2_XXS gate / up, Q2_K down) on the blocks.

    `value(name, param, n_experts, k)` gives each parameter's values (default: keyed
    by name); `overrides` shrinks shapes for CPU smoke tests."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..models.base import LanguageModel, family_module
    from ..runtime.tokenizer import Tokenizer

    cfg = v4_flash_config(layers or 43, experts or 256)
    cfg.update(overrides or {})
    mod = family_module("deepseek_v4")
    args = mod.ModelArgs.from_dict(cfg)
    t0 = time.time()
    model = mod.Model(args)
    parts = [
        ("model.embed_tokens.", model.model.embed_tokens),
        ("model.norm.", model.model.norm),
        ("model.hc_head.", model.model.hc_head),
        ("lm_head.", model.lm_head),
    ]
    parts += [(f"model.layers.{i}.", layer) for i, layer in enumerate(model.model.layers)]
    if expert_format not in ("mlx", "gguf"):
        raise ValueError(f"expert_format must be 'mlx' or 'gguf', not {expert_format!r}")
    for n, (prefix, part) in enumerate(parts):  # one piece at a time: never the whole float model at once
        if expert_format == "gguf":
            _gguf_experts(part, 1000 * n)
        _randomize(part, prefix, args.n_routed_experts, args.num_experts_per_tok, value)
        _quantize(part, expert_bits, other_bits)
        for _, arr in tree_flatten(part.parameters()):  # one tensor per eval keeps launches small
            mx.eval(arr)
    model.eval()
    params = tree_flatten(model.parameters())
    total = sum(p.nbytes for _, p in params)
    active = active_weight_bytes(model, args)
    info = {
        "layers": args.num_hidden_layers,
        "experts": args.n_routed_experts,
        "expert_bits": "iq2_xxs/q2_k" if expert_format == "gguf" else expert_bits,
        "other_bits": other_bits,
        "build_s": round(time.time() - t0, 1),
        "weights_gb": round(total / 1e9, 2),
        "active_gb_per_token": round(active / 1e9, 3),
        "active_bytes_per_token": active,
        "roofline_tps_at_4.8TBps": round(4.8e12 / active, 1),
    }
    return LanguageModel(model, args), Tokenizer.default(), info
