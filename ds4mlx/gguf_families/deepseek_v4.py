"""Name and metadata tables: Hugging Face deepseek_v4 <-> ds4 GGUF.

Three spellings of every DeepSeek V4 tensor:

* HF in-memory (transformers `DeepseekV4ForCausalLM.state_dict()`, the oracle's
  model.safetensors): `model.layers.3.self_attn.q_a_proj.weight`.  This is what
  `weights.read_weights` hands out (DEVELOPERS.md contract).
* ds4 GGUF: `blk.3.attn_q_a.weight`.  Sources:
  - antirez/ds4 `ds4.c` `weights_bind()` (the names ds4 requires when it loads
    its published GGUFs) and `weights_validate_layout()` (their ggml shapes);
  - antirez/ds4 `gguf-tools/deepseek4-quantize.c` `top_map[]` / `layer_map[]`
    (the GGUF name <-> hub-checkpoint name table ds4 uses to regenerate its GGUFs
    from the official safetensors) and `parse_expert_tensor()` for
    `blk.N.ffn_{gate,up,down}_exps.weight` <- `layers.N.ffn.experts.X.w{1,3,2}`.
* hub checkpoint (deepseek-ai/DeepSeek-V4-Flash safetensors): `layers.3.attn.wq_a.weight`.
  HF in-memory <- hub is transformers' `conversion_mapping.py` "deepseek_v4"
  (pure renames + fusing the per-expert w1/w3 into gate_up_proj, w2 into down_proj).

Layouts: GGUF stores ggml `ne` reversed with respect to the numpy / torch shape
(deepseek4-quantize.c `check_reversed_shape`: ne[i] == shape[nd-1-i]) and the
bytes are the same row-major data, so `gguf.GGUFWriter.add_tensor(numpy)` /
`GGUFReader` round-trip the HF shapes with no transpose.  Only the routed
experts change layout: HF fuses `gate_up_proj` [E, 2I, H] (gate rows first) while
ds4 stores `ffn_gate_exps` and `ffn_up_exps` [E, I, H] separately; `down_proj`
[E, H, I] is `ffn_down_exps` as is.  `mlp.gate.tid2eid` is int64 in HF and I32 in
GGUF (deepseek4-quantize.c `i64_to_i32`, ds4.c expects DS4_TENSOR_I32).

Metadata: `deepseek4.*` keys as read by ds4.c `config_validate_model()`,
`validate_compress_ratio_metadata()`, `validate_swiglu_clamp_metadata()` and the
model summary printer; `expert_gating_func` (4 = sqrt(softplus)) is written by
llama.cpp's DeepSeek4 converter and present in published DeepSeek4 GGUFs, ds4 does
not read it.  HF config fields that no ds4 key can express are stored as JSON in
the extra key `ds4mlx.hf_config_overrides` (ds4 ignores unknown keys).
"""

from __future__ import annotations

import copy
import json
import re

import numpy as np

from ..io.mapped import LazyTensor
from ..io.quant import MXTensor, QuantizedTensor
from .base import EXPERT_SPLIT, FUSED_GATE_UP, Family, make_rule, to_f32

ARCH = "deepseek4"
OVERRIDES_KEY = "ds4mlx.hf_config_overrides"

# ----------------------------------------------------------------------------- tensors
# (HF in-memory suffix, ds4 GGUF suffix, hub-checkpoint suffix)
TOP_LEVEL: tuple[tuple[str, str, str], ...] = (
    ("model.embed_tokens.weight", "token_embd.weight", "embed.weight"),
    ("model.norm.weight", "output_norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight", "head.weight"),
    ("model.hc_head.hc_base", "output_hc_base.weight", "hc_head_base"),
    ("model.hc_head.hc_fn", "output_hc_fn.weight", "hc_head_fn"),
    ("model.hc_head.hc_scale", "output_hc_scale.weight", "hc_head_scale"),
)

# Per layer: HF `model.layers.{i}.<a>`, GGUF `blk.{i}.<b>`, hub `layers.{i}.<c>`.
LAYER: tuple[tuple[str, str, str], ...] = (
    ("attn_hc.base", "hc_attn_base.weight", "hc_attn_base"),
    ("attn_hc.fn", "hc_attn_fn.weight", "hc_attn_fn"),
    ("attn_hc.scale", "hc_attn_scale.weight", "hc_attn_scale"),
    ("ffn_hc.base", "hc_ffn_base.weight", "hc_ffn_base"),
    ("ffn_hc.fn", "hc_ffn_fn.weight", "hc_ffn_fn"),
    ("ffn_hc.scale", "hc_ffn_scale.weight", "hc_ffn_scale"),
    ("self_attn.sinks", "attn_sinks.weight", "attn.attn_sink"),
    ("self_attn.q_a_proj.weight", "attn_q_a.weight", "attn.wq_a.weight"),
    ("self_attn.q_b_proj.weight", "attn_q_b.weight", "attn.wq_b.weight"),
    ("self_attn.q_a_norm.weight", "attn_q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.kv_proj.weight", "attn_kv.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn_kv_a_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.o_a_proj.weight", "attn_output_a.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn_output_b.weight", "attn.wo_b.weight"),
    ("self_attn.compressor.position_bias", "attn_compressor_ape.weight", "attn.compressor.ape"),
    ("self_attn.compressor.kv_proj.weight", "attn_compressor_kv.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn_compressor_gate.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.kv_norm.weight", "attn_compressor_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "indexer.attn_q_b.weight", "attn.indexer.wq_b.weight"),
    (
        "self_attn.compressor.indexer.scorer.weights_proj.weight",
        "indexer.proj.weight",
        "attn.indexer.weights_proj.weight",
    ),
    ("self_attn.compressor.indexer.position_bias", "indexer_compressor_ape.weight", "attn.indexer.compressor.ape"),
    (
        "self_attn.compressor.indexer.kv_proj.weight",
        "indexer_compressor_kv.weight",
        "attn.indexer.compressor.wkv.weight",
    ),
    (
        "self_attn.compressor.indexer.gate_proj.weight",
        "indexer_compressor_gate.weight",
        "attn.indexer.compressor.wgate.weight",
    ),
    (
        "self_attn.compressor.indexer.kv_norm.weight",
        "indexer_compressor_norm.weight",
        "attn.indexer.compressor.norm.weight",
    ),
    ("input_layernorm.weight", "attn_norm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight", "ffn_norm.weight"),
    ("mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight", "ffn.shared_experts.w2.weight"),
    ("mlp.gate.weight", "ffn_gate_inp.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "exp_probs_b.bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn_gate_tid2eid.weight", "ffn.gate.tid2eid"),
    # Routed experts, split form.  HF in-memory fuses gate+up into gate_up_proj;
    # `mlp.experts.gate_proj` / `up_proj` are the split names this package uses for
    # quantized experts (which cannot be concatenated without copying them).
    ("mlp.experts.gate_proj", "ffn_gate_exps.weight", None),
    ("mlp.experts.up_proj", "ffn_up_exps.weight", None),
    ("mlp.experts.down_proj", "ffn_down_exps.weight", None),
)
INT_TENSORS = ("mlp.gate.tid2eid",)
# hub per-expert tensors: layers.{i}.ffn.experts.{x}.w{1,2,3}.weight
HUB_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
HUB_EXPERT_TO_HF = {"w1": "mlp.experts.gate_proj", "w3": "mlp.experts.up_proj", "w2": "mlp.experts.down_proj"}

_TOP_HF2G = {h: g for h, g, _ in TOP_LEVEL}
_TOP_G2HF = {g: h for h, g, _ in TOP_LEVEL}
_TOP_HUB2HF = {c: h for h, _, c in TOP_LEVEL}
_LAYER_HF2G = {h: g for h, g, _ in LAYER}
_LAYER_G2HF = {g: h for h, g, _ in LAYER}
_LAYER_HUB2HF = {c: h for h, _, c in LAYER if c is not None}
# what transformers' save_pretrained writes for the same tensor (its conversion
# renames `.norm.` -> `.kv_norm.`, and writes it back reversed)
_LAYER_HUB2HF["attn.norm.weight"] = "self_attn.kv_norm.weight"
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_HUB_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def hf_to_gguf(name: str) -> str | None:
    """HF in-memory name -> ds4 GGUF name (None if unknown; the fused
    gate_up_proj has no single GGUF name: see `EXPERT_SPLIT`)."""
    if name in _TOP_HF2G:
        return _TOP_HF2G[name]
    m = _HF_LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_HF2G:
        return f"blk.{m.group(1)}.{_LAYER_HF2G[m.group(2)]}"
    return None


def gguf_to_hf(name: str) -> str | None:
    """ds4 GGUF name -> HF in-memory name (split names for ffn_gate/up_exps)."""
    if name in _TOP_G2HF:
        return _TOP_G2HF[name]
    m = _GGUF_LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_G2HF:
        return f"model.layers.{m.group(1)}.{_LAYER_G2HF[m.group(2)]}"
    return None


def hub_to_hf(name: str) -> str | None:
    """Hub-checkpoint name (deepseek-ai safetensors) -> HF in-memory name.
    Per-expert w1/w2/w3 tensors are handled by `HUB_EXPERT_RE`."""
    if name in _TOP_HUB2HF:
        return _TOP_HUB2HF[name]
    m = _HUB_LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_HUB2HF:
        return f"model.layers.{m.group(1)}.{_LAYER_HUB2HF[m.group(2)]}"
    return None


# ----------------------------------------------------------------------------- config
GATING_FUNC = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_*
GATING_FUNC_INV = {v: k for k, v in GATING_FUNC.items()}

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

# DeepseekV4Config defaults (transformers 5.23 configuration_deepseek_v4.py).
CONFIG_DEFAULTS: dict = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "num_experts_per_tok": 6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000.0,
    "layer_types": None,
    "compress_rates": None,
    "compress_rope_theta": 160000.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1.0e-6,
    "mlp_layer_types": None,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_nextn_predict_layers": 1,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1.0e-6,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "rope_parameters": None,
    "partial_rotary_factor": None,
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
}
CONFIG_FIELDS = tuple(CONFIG_DEFAULTS) + ("qk_rope_head_dim",)
_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_RATIO_TO_TYPE = {0: SWA, 4: CSA, 128: HCA}


def _clean_rope(d: dict) -> dict:
    d = dict(d)
    if "type" in d:
        d.setdefault("rope_type", d["type"])
        del d["type"]
    return d


def normalize_config(raw: dict) -> dict:
    """HF config.json dict -> canonical DeepseekV4Config dict.

    Mirrors `DeepseekV4Config.__post_init__` (transformers 5.23): legacy hub
    fields `compress_ratios`, `compress_rate_csa/hca`, `num_hash_layers`,
    `qk_rope_head_dim`, `rope_scaling` are folded into `layer_types`,
    `compress_rates`, `mlp_layer_types`, `partial_rotary_factor`,
    `rope_parameters{main,compress}`.  Only model fields are kept (plus
    `model_type` and the derived `qk_rope_head_dim`); HF bookkeeping keys
    (architectures, dtype, transformers_version, quantization_config, ...) are
    dropped."""
    raw = copy.deepcopy(dict(raw))
    mt = raw.get("model_type", "deepseek_v4")
    if mt not in ("deepseek_v4",):
        raise ValueError(f"unsupported model_type {mt!r}: this reader handles deepseek_v4 only")
    c = {k: copy.deepcopy(v) for k, v in CONFIG_DEFAULTS.items()}
    for k in CONFIG_DEFAULTS:
        if k in raw:
            c[k] = raw[k]
    n = int(c["num_hidden_layers"])

    if c["compress_rates"] is None:
        c["compress_rates"] = dict(_DEFAULT_COMPRESS_RATES)
    else:
        c["compress_rates"] = dict(c["compress_rates"])
    if raw.get("compress_rate_csa") is not None:
        c["compress_rates"][CSA] = raw["compress_rate_csa"]
    if raw.get("compress_rate_hca") is not None:
        c["compress_rates"][HCA] = raw["compress_rate_hca"]

    if c["layer_types"] is None and raw.get("compress_ratios") is not None:
        try:
            c["layer_types"] = [_RATIO_TO_TYPE[int(r)] for r in raw["compress_ratios"]]
        except KeyError as e:
            raise ValueError(f"compress_ratios contains an unknown ratio {e}") from None
    if c["layer_types"] is None:
        inter = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        c["layer_types"] = [HCA] * min(n, 2) + inter
    c["layer_types"] = list(c["layer_types"][:n])

    if c["mlp_layer_types"] is None:
        nh = raw.get("num_hash_layers")
        nh = 3 if nh is None else int(nh)
        c["mlp_layer_types"] = ["hash_moe"] * min(n, nh) + ["moe"] * max(0, n - nh)
    c["mlp_layer_types"] = list(c["mlp_layer_types"][:n])

    if c["partial_rotary_factor"] is None:
        qk = raw.get("qk_rope_head_dim")
        c["partial_rotary_factor"] = qk / c["head_dim"] if qk is not None else 64 / 512
    c["qk_rope_head_dim"] = int(c["head_dim"] * c["partial_rotary_factor"])

    rp = c["rope_parameters"]
    if rp is None and isinstance(raw.get("rope_scaling"), dict):
        rp = dict(raw["rope_scaling"])
    rp = rp or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        c["rope_parameters"] = {"main": _clean_rope(rp["main"]), "compress": _clean_rope(rp["compress"])}
    else:
        yarn = _clean_rope({k: v for k, v in rp.items() if k not in ("main", "compress")})
        yarn.pop("rope_theta", None)
        main = {
            "rope_type": "default",
            "rope_theta": c["rope_theta"],
            "partial_rotary_factor": c["partial_rotary_factor"],
        }
        comp = {**yarn, "rope_theta": c["compress_rope_theta"], "partial_rotary_factor": c["partial_rotary_factor"]}
        comp.setdefault("rope_type", "default")
        if comp["rope_type"] == "yarn":
            comp.setdefault("attention_factor", 1.0)
        c["rope_parameters"] = {"main": main, "compress": comp}
    return c


def config_to_gguf_kv(cfg: dict) -> list[tuple[str, object, str]]:
    """Canonical config -> [(key, value, gguf type)] in ds4's `deepseek4.*` keys.
    Type names: u32, u64, f32, bool, str, arr_i32, arr_f32."""
    c = normalize_config(cfg)
    a = ARCH
    n = int(c["num_hidden_layers"])
    kv: list[tuple[str, object, str]] = [
        ("general.architecture", a, "str"),
        (f"{a}.context_length", int(c["max_position_embeddings"]), "u32"),
        (f"{a}.embedding_length", int(c["hidden_size"]), "u32"),
        (f"{a}.block_count", n, "u32"),
        (f"{a}.vocab_size", int(c["vocab_size"]), "u32"),
        (f"{a}.attention.head_count", int(c["num_attention_heads"]), "u32"),
        (f"{a}.attention.head_count_kv", int(c["num_key_value_heads"]), "u32"),
        (f"{a}.attention.key_length", int(c["head_dim"]), "u32"),
        (f"{a}.attention.value_length", int(c["head_dim"]), "u32"),
        (f"{a}.rope.dimension_count", int(c["qk_rope_head_dim"]), "u32"),
        (f"{a}.attention.q_lora_rank", int(c["q_lora_rank"]), "u32"),
        (f"{a}.attention.output_lora_rank", int(c["o_lora_rank"]), "u32"),
        (f"{a}.attention.output_group_count", int(c["o_groups"]), "u32"),
        (f"{a}.expert_count", int(c["n_routed_experts"]), "u32"),
        (f"{a}.expert_used_count", int(c["num_experts_per_tok"]), "u32"),
        (f"{a}.expert_feed_forward_length", int(c["moe_intermediate_size"]), "u32"),
        (f"{a}.expert_shared_count", int(c["n_shared_experts"]), "u32"),
    ]
    mlp = c["mlp_layer_types"]
    n_hash = 0
    while n_hash < len(mlp) and mlp[n_hash] == "hash_moe":
        n_hash += 1
    kv.append((f"{a}.hash_layer_count", n_hash, "u32"))
    if c["scoring_func"] in GATING_FUNC:
        kv.append((f"{a}.expert_gating_func", GATING_FUNC[c["scoring_func"]], "u32"))
    kv += [
        (f"{a}.attention.sliding_window", int(c["sliding_window"]), "u32"),
        (f"{a}.attention.indexer.head_count", int(c["index_n_heads"]), "u32"),
        (f"{a}.attention.indexer.key_length", int(c["index_head_dim"]), "u32"),
        (f"{a}.attention.indexer.top_k", int(c["index_topk"]), "u32"),
        (f"{a}.hyper_connection.count", int(c["hc_mult"]), "u32"),
        (f"{a}.hyper_connection.sinkhorn_iterations", int(c["hc_sinkhorn_iters"]), "u32"),
        (f"{a}.hyper_connection.epsilon", float(c["hc_eps"]), "f32"),
    ]
    rates = {SWA: 0, **c["compress_rates"]}
    kv.append((f"{a}.attention.compress_ratios", [int(rates[t]) for t in c["layer_types"]], "arr_i32"))
    kv.append((f"{a}.swiglu_clamp_exp", [float(c["swiglu_limit"] or 0.0)] * n, "arr_f32"))
    kv += [
        (f"{a}.rope.freq_base", float(c["rope_parameters"]["main"].get("rope_theta", c["rope_theta"])), "f32"),
        (f"{a}.attention.compress_rope_freq_base", float(c["compress_rope_theta"]), "f32"),
        (f"{a}.expert_weights_scale", float(c["routed_scaling_factor"]), "f32"),
        (f"{a}.expert_weights_norm", bool(c["norm_topk_prob"]), "bool"),
        (f"{a}.attention.layer_norm_rms_epsilon", float(c["rms_norm_eps"]), "f32"),
    ]
    comp = c["rope_parameters"]["compress"]
    if comp.get("rope_type") == "yarn":
        kv += [
            (f"{a}.rope.scaling.type", "yarn", "str"),
            (f"{a}.rope.scaling.factor", float(comp["factor"]), "f32"),
            (f"{a}.rope.scaling.original_context_length", int(comp["original_max_position_embeddings"]), "u32"),
            (f"{a}.rope.scaling.yarn_beta_fast", float(comp.get("beta_fast", 32.0)), "f32"),
            (f"{a}.rope.scaling.yarn_beta_slow", float(comp.get("beta_slow", 1.0)), "f32"),
        ]
    # Fields the ds4 keys cannot carry exactly go into one JSON override.
    derived = config_from_gguf_kv(
        {k: (to_f32(v) if t == "f32" else ([to_f32(x) for x in v] if t == "arr_f32" else v)) for k, v, t in kv},
        apply_overrides=False,
    )
    overrides = {k: c[k] for k in CONFIG_FIELDS if k in c and derived.get(k) != c[k]}
    if overrides:
        kv.append((OVERRIDES_KEY, json.dumps(overrides, sort_keys=True), "str"))
    return kv


def config_from_gguf_kv(meta: dict, apply_overrides: bool = True) -> dict:
    """GGUF metadata (key -> python value, f32 already rounded) -> canonical config.

    Fields without a ds4 key take DeepseekV4Config defaults (bos 0, eos 1, ...)
    unless `ds4mlx.hf_config_overrides` says otherwise."""
    a = meta.get("general.architecture", ARCH)
    if a != ARCH:
        raise ValueError(f"unsupported GGUF architecture {a!r} (expected {ARCH!r})")

    def get(key, default=None):
        return meta.get(f"{a}.{key}", default)

    def need(key):
        v = meta.get(f"{a}.{key}")
        if v is None:
            raise ValueError(f"GGUF metadata key {a}.{key} is missing")
        return v

    n = int(need("block_count"))
    ratios = get("attention.compress_ratios")
    ratios = [0] * n if ratios is None else [int(r) for r in ratios][:n]
    nonzero = sorted({r for r in ratios if r})
    rates = dict(_DEFAULT_COMPRESS_RATES)
    if len(nonzero) >= 2:
        rates = {CSA: nonzero[0], HCA: nonzero[-1]}
    elif len(nonzero) == 1:
        rates[CSA if nonzero[0] == 4 else HCA] = nonzero[0]
    r2t = {0: SWA, rates[CSA]: CSA, rates[HCA]: HCA}
    layer_types = [r2t.get(r, HCA) for r in ratios]
    n_hash = int(get("hash_layer_count", 0))
    head_dim = int(need("attention.key_length"))
    rot = int(get("rope.dimension_count", head_dim * 64 // 512))
    prf = rot / head_dim
    clamp = get("swiglu_clamp_exp")
    swiglu = float(clamp[0]) if clamp else CONFIG_DEFAULTS["swiglu_limit"]
    rope_theta = float(get("rope.freq_base", CONFIG_DEFAULTS["rope_theta"]))
    comp_theta = float(get("attention.compress_rope_freq_base", CONFIG_DEFAULTS["compress_rope_theta"]))
    main = {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": prf}
    if get("rope.scaling.type", "yarn" if get("rope.scaling.factor") is not None else None) == "yarn":
        comp = {
            "rope_type": "yarn",
            "factor": float(get("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length", 0)),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
            "attention_factor": 1.0,
            "rope_theta": comp_theta,
            "partial_rotary_factor": prf,
        }
    else:
        comp = {"rope_type": "default", "rope_theta": comp_theta, "partial_rotary_factor": prf}
    gating = get("expert_gating_func")
    c = {k: copy.deepcopy(v) for k, v in CONFIG_DEFAULTS.items()}
    c.update(
        {
            "vocab_size": int(need("vocab_size")),
            "hidden_size": int(need("embedding_length")),
            "moe_intermediate_size": int(need("expert_feed_forward_length")),
            "num_hidden_layers": n,
            "num_attention_heads": int(need("attention.head_count")),
            "num_key_value_heads": int(get("attention.head_count_kv", 1)),
            "head_dim": head_dim,
            "q_lora_rank": int(need("attention.q_lora_rank")),
            "num_experts_per_tok": int(need("expert_used_count")),
            "n_routed_experts": int(need("expert_count")),
            "n_shared_experts": int(get("expert_shared_count", 1)),
            "scoring_func": GATING_FUNC_INV.get(int(gating), "sqrtsoftplus") if gating is not None else "sqrtsoftplus",
            "norm_topk_prob": bool(get("expert_weights_norm", True)),
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
            "max_position_embeddings": int(get("context_length", CONFIG_DEFAULTS["max_position_embeddings"])),
            "rope_theta": rope_theta,
            "layer_types": layer_types,
            "compress_rates": rates,
            "compress_rope_theta": comp_theta,
            "hc_mult": int(get("hyper_connection.count", 4)),
            "hc_sinkhorn_iters": int(get("hyper_connection.sinkhorn_iterations", 20)),
            "hc_eps": float(get("hyper_connection.epsilon", 1e-6)),
            "mlp_layer_types": ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash),
            "swiglu_limit": swiglu,
            "sliding_window": int(get("attention.sliding_window", CONFIG_DEFAULTS["sliding_window"])),
            "o_groups": int(need("attention.output_group_count")),
            "o_lora_rank": int(need("attention.output_lora_rank")),
            "index_n_heads": int(get("attention.indexer.head_count", CONFIG_DEFAULTS["index_n_heads"])),
            "index_head_dim": int(get("attention.indexer.key_length", CONFIG_DEFAULTS["index_head_dim"])),
            "index_topk": int(get("attention.indexer.top_k", CONFIG_DEFAULTS["index_topk"])),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_parameters": {"main": main, "compress": comp},
            "partial_rotary_factor": prf,
            "qk_rope_head_dim": rot,
        }
    )
    if apply_overrides and meta.get(OVERRIDES_KEY):
        try:
            c.update(json.loads(meta[OVERRIDES_KEY]))
        except json.JSONDecodeError as e:
            raise ValueError(f"GGUF key {OVERRIDES_KEY} is not valid JSON: {e}") from None
    return c


# ----------------------------------------------------------------------------- MTP
# ds4's MTP block (ds4.c mtp_weights_bind): `mtp.0.<layer tensor>` plus the head's
# own e_proj / h_proj / enorm / hnorm / norm / hc_head_*; kept, under `mtp.0.<HF
# layer name>` (or the ds4 name for the head's own), for speculative decoding.
MTP_PREFIX = "mtp."


def mtp_hf_name(gguf_name: str) -> str:
    """`mtp.N.attn_q_a.weight` -> `mtp.N.self_attn.q_a_proj.weight`; the MTP head's
    own tensors (e_proj, enorm, hc_head_fn, ...) keep their ds4 names."""
    _, n, rest = gguf_name.split(".", 2)
    hf = gguf_to_hf(f"blk.{n}.{rest}")
    return f"mtp.{n}." + hf[len(f"model.layers.{n}.") :] if hf else gguf_name


# ----------------------------------------------------------------------------- the family table
class DeepseekV4Family(Family):
    """DeepSeek V4 as a `gguf_families` table like the others: the names are TOP_LEVEL /
    LAYER, the metadata ds4's `deepseek4.*` keys (`config_to_gguf_kv` /
    `config_from_gguf_kv`, no config JSON key).  Reading and writing keep V4's lazy
    expert handling: a fused float bank is written as two halves read when written, and
    read split (`lazy_expert_fuse`: weights.py fuses it when the loader asks), never
    copied whole up front."""

    def config_to_kv(self, config: dict) -> list:
        return config_to_gguf_kv(config)

    def config_from_kv(self, meta: dict, tensor_names=None) -> dict:
        return config_from_gguf_kv(meta)

    def to_gguf(self, config: dict, tensors: dict) -> list:
        """HF in-memory name -> [(ds4 GGUF name, value)], splitting gate_up_proj."""
        out, unknown = [], []
        for name, val in tensors.items():
            if name.endswith("." + FUSED_GATE_UP):
                prefix = name[: -len(FUSED_GATE_UP)]
                if isinstance(val, QuantizedTensor):
                    raise ValueError(f"{name}: a fused quantized gate_up_proj cannot be split; pass gate_proj/up_proj")
                shape = tuple(val.shape)
                if len(shape) != 3 or shape[1] % 2:
                    raise ValueError(f"{name}: expected [E, 2I, H], got {shape}")
                half = shape[1] // 2
                for part, sl in zip(EXPERT_SPLIT, (slice(0, half), slice(half, None))):
                    out.append((hf_to_gguf(prefix + part), _half(val, sl, (shape[0], half, shape[2]))))
                continue
            g = hf_to_gguf(name)
            if g is None:
                unknown.append(name)
                continue
            out.append((g, val))
        if unknown:
            raise ValueError(f"tensors with no ds4 GGUF name: {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
        return out

    def from_gguf(self, config: dict, names, get) -> tuple[dict, list]:
        """GGUF tensor names (MTP ones included) -> ({HF name: value}, [unknown names]);
        the routed experts stay split (see `lazy_expert_fuse`)."""
        tensors, unknown = {}, []
        for tname in names:
            hf = gguf_to_hf(tname) if not tname.startswith(MTP_PREFIX) else mtp_hf_name(tname)
            if hf is None:
                unknown.append(tname)
                continue
            val = get(tname)
            if hf.endswith(INT_TENSORS) and isinstance(val, np.ndarray):
                val = _int64_lazy(val)
            tensors[hf] = val
        return tensors, unknown


def _half(val, sl: slice, shape) -> LazyTensor:
    """One half of a fused [E, 2I, H] bank, read when written."""
    dt = np.float32 if isinstance(val, MXTensor) else val.dtype

    def read():
        full = val.dequantize() if isinstance(val, MXTensor) else np.asarray(val)
        return full[:, sl]

    return LazyTensor(read, shape, dt, sources=(val,))


def _int64_lazy(val: np.ndarray) -> LazyTensor:
    return LazyTensor(lambda: val.astype(np.int64), val.shape, np.int64, sources=(val,))


DEEPSEEK_V4 = DeepseekV4Family(
    name="deepseek_v4",
    arch=ARCH,
    model_types=("deepseek_v4",),
    display="DeepSeek-V4",
    top=[make_rule(hf, g) for hf, g, _ in TOP_LEVEL],
    layer=[make_rule(hf, g) for hf, g, _ in LAYER],
    config_key="",
    lazy_expert_fuse=True,
)


__all__ = [
    "ARCH",
    "DEEPSEEK_V4",
    "MTP_PREFIX",
    "mtp_hf_name",
    "TOP_LEVEL",
    "LAYER",
    "FUSED_GATE_UP",
    "EXPERT_SPLIT",
    "hf_to_gguf",
    "gguf_to_hf",
    "hub_to_hf",
    "normalize_config",
    "config_to_gguf_kv",
    "config_from_gguf_kv",
]
