"""The machinery shared by the family tables: `Rule` (one HF tensor <-> GGUF tensors),
`Family` (a family's names, keys and rearrangements), the exact rearrangements, and
metadata helpers.  See the package docstring for the families and their sources."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..io.quant import QuantizedTensor

CONFIG_KEY = "ds4mlx.hf_config"
GGML_MAX_NAME = 64  # bytes, NUL included
FUSED_GATE_UP = "mlp.experts.gate_up_proj"
EXPERT_SPLIT = ("mlp.experts.gate_proj", "mlp.experts.up_proj")

HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_ATTN_BIAS_RE = re.compile(r"^blk\.\d+\.attn_(q|q_a|k|v|kv_a_mqa|output)\.bias$")
_PER_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


# ----------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Rule:
    """One HF tensor <-> one or more GGUF tensors.

    `hf` / `gguf` are full names for top-level rules and the part after
    `model.layers.N.` / `blk.N.` for layer rules.  `split(arr, args) -> [arr, ...]`
    and `join([arr, ...], args) -> arr` rearrange the data (None: 1:1, as is; such
    rules also carry GGUF quantized tensors)."""

    hf: str
    gguf: tuple
    split: Callable | None = None
    join: Callable | None = None


def make_rule(hf: str, *gguf: str, split=None, join=None) -> Rule:
    return Rule(hf, tuple(gguf), split, join)


def matrix_rules(hf_stem: str, gguf_stem: str, split=None, join=None, bias: bool = True) -> list[Rule]:
    """`X.weight` -> `Y.weight` (and `X.bias` -> `Y.bias`); a split applies to both (axis 0)."""
    out = [
        Rule(
            f"{hf_stem}.weight",
            (f"{gguf_stem}.weight",) if isinstance(gguf_stem, str) else tuple(f"{g}.weight" for g in gguf_stem),
            split,
            join,
        )
    ]
    if bias:
        out.append(
            Rule(
                f"{hf_stem}.bias",
                (f"{gguf_stem}.bias",) if isinstance(gguf_stem, str) else tuple(f"{g}.bias" for g in gguf_stem),
                split,
                join,
            )
        )
    return out


def to_f32(x: float) -> float:
    return float(np.format_float_positional(np.float32(x), unique=True, trim="0"))


# --- rearrangements (all exact) ------------------------------------------------------
def kda_conv_rule(hf: str, split, join) -> Rule:
    """A linear-attention layer's one short convolution over its q, k, v channels -> ds4's
    three `kda_*_conv` tensors (`split` / `join` cut the channels into the three)."""
    return make_rule(hf, "kda_q_conv.weight", "kda_k_conv.weight", "kda_v_conv.weight", split=split, join=join)


def row_parts(sizes: Callable):
    """Split along axis 0 into `sizes(args)` rows; join concatenates."""

    def split(a, args):
        s = sizes(args)
        if a.shape[0] != sum(s):
            raise ValueError(f"expected {sum(s)} rows, got shape {tuple(a.shape)}")
        return [np.ascontiguousarray(p) for p in np.split(a, np.cumsum(s)[:-1], axis=0)]

    def join(parts, args):
        return np.concatenate(parts, axis=0)

    return split, join


def _kv_b(args):
    return args.num_attention_heads, args.qk_nope_head_dim, args.v_head_dim


def kv_b_split(w, args):
    """kv_b_proj [H*(nope+v), r] -> attn_k_b [H, r, nope], attn_v_b [H, v, r]."""
    h, nope, v = _kv_b(args)
    if w.ndim != 2 or w.shape[0] != h * (nope + v):
        raise ValueError(f"kv_b_proj: expected [{h * (nope + v)}, r], got {tuple(w.shape)}")
    per = w.reshape(h, nope + v, w.shape[1])
    return [np.ascontiguousarray(per[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(per[:, nope:])]


def kv_b_join(parts, args):
    k_b, v_b = parts
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])


def deinterleave_split(a, args):
    """q_proj rows, per head [query (D) | gate (D)] -> query rows, gate rows."""
    nh, d = args.num_attention_heads, args.head_dim
    x = a.reshape(nh, 2, d, *a.shape[1:])
    return [
        np.ascontiguousarray(x[:, 0].reshape(nh * d, *a.shape[1:])),
        np.ascontiguousarray(x[:, 1].reshape(nh * d, *a.shape[1:])),
    ]


def deinterleave_join(parts, args):
    q, g = parts
    nh, d = args.num_attention_heads, args.head_dim
    rest = q.shape[1:]
    return np.stack([q.reshape(nh, d, *rest), g.reshape(nh, d, *rest)], axis=1).reshape(2 * nh * d, *rest)


def plus_one_split(w, args):
    """(1 + w) RMSNorm weight -> 1 + w (float32, ds4's `norm_plus_one`).  Read back as
    (1 + w) - 1, the model's 1 + that is 1 + w again bit for bit: fl(s - 1) is exact for
    s >= 0.5 (Sterbenz), and for s < 0.5 the sum 1 + w was itself exact."""
    return [np.asarray(w, dtype=np.float32) + np.float32(1.0)]


def plus_one_join(parts, args):
    return np.asarray(parts[0], dtype=np.float32) - np.float32(1.0)


def squeeze_split(a, args):
    return [np.ascontiguousarray(a.reshape(-1))]


def unsqueeze_join(parts, args):
    return parts[0].reshape(1, -1)


def flatten_groups_split(a, args):
    """mlx-lm o_a_proj [G, out, in] -> ds4 attn_output_a [G*out, in] (2-D passes)."""
    return [np.ascontiguousarray(a.reshape(-1, a.shape[-1]))]


def identity_join(parts, args):
    return parts[0]


# ----------------------------------------------------------------------------- metadata helpers
# Metadata entries are (key, value, kind) tuples, kinds as convert._add_kv:
# u32 u64 f32 bool str arr_u32 arr_u64 arr_i32 arr_f32 arr_str.


def num_kind(v) -> str:
    return "u32" if float(v).is_integer() and 0 <= float(v) < 2**32 else "f32"


def text_part(config: dict) -> dict:
    """The text-model part of a config (VLM configs nest it as `text_config`)."""
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) else config


def trunk_kv(arch: str, args) -> list:
    """The size keys that open a ds4 `*-next` GGUF's metadata: the trunk's block count (no
    MTP blocks), context, width and vocabulary."""
    a, n = arch, args.num_hidden_layers
    return [
        (f"{a}.block_count", n, "u32"),
        (f"{a}.trunk_block_count", n, "u32"),
        (f"{a}.nextn_predict_layers", 0, "u32"),
        (f"{a}.context_length", int(args.max_position_embeddings), "u64"),
        (f"{a}.embedding_length", args.hidden_size, "u32"),
        (f"{a}.vocab_size", args.vocab_size, "u32"),
    ]


def tok_ids(meta: dict) -> dict:
    out = {}
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        out["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    if meta.get("tokenizer.ggml.eos_token_id") is not None:
        out["eos_token_id"] = int(meta["tokenizer.ggml.eos_token_id"])
    return out


class GGUFMeta:
    """`meta[f"{arch}.{key}"]` with a clear error for a missing key."""

    def __init__(self, meta: dict, arch: str):
        self.meta, self.arch = meta, arch

    def __call__(self, key: str, default: Any = KeyError):
        v = self.meta.get(f"{self.arch}.{key}")
        if v is None:
            if default is KeyError:
                raise ValueError(f"GGUF metadata key {self.arch}.{key} is missing")
            return default
        return v


# ----------------------------------------------------------------------------- families
@dataclass
class Family:
    """One model family's GGUF scheme (see the package docstring)."""

    name: str  # ds4mlx family (models/<name>.py)
    arch: str  # GGUF general.architecture
    model_types: tuple  # HF model_type values
    display: str
    top: list
    layer: list
    config_key: str = CONFIG_KEY
    fuse_experts: bool = True  # float ffn_{gate,up}_exps -> fused gate_up_proj on read
    # from_gguf leaves float experts split; the reader fuses them lazily (weights.py)
    lazy_expert_fuse: bool = False
    drop: tuple = ()  # HF name suffixes that are derived from the config (not written)
    keep_f32: tuple = ()  # GGUF name suffixes kept F32 when writing f16/bf16 (as ds4 does)
    kv_fn: Callable | None = None  # (config, args) -> [(key, value, kind)]
    derive_fn: Callable | None = None  # (meta) -> config (no config JSON key)
    _maps: dict = field(default_factory=dict, repr=False)

    # -- tables
    def _index(self):
        if not self._maps:
            hf_top = {r.hf: r for r in self.top}
            hf_layer = {r.hf: r for r in self.layer}
            g_top = {g: (r, i) for r in self.top for i, g in enumerate(r.gguf)}
            g_layer = {g: (r, i) for r in self.layer for i, g in enumerate(r.gguf)}
            if (
                len(g_top) != sum(len(r.gguf) for r in self.top)
                or len(g_layer) != sum(len(r.gguf) for r in self.layer)
                or len(hf_top) != len(self.top)
                or len(hf_layer) != len(self.layer)
            ):
                raise AssertionError(f"{self.name}: name table is not one-to-one")  # pragma: no cover
            self._maps = {"hf_top": hf_top, "hf_layer": hf_layer, "g_top": g_top, "g_layer": g_layer}
        return self._maps

    def hf_rule(self, name: str):
        """HF name -> (rule, layer index or None), or None."""
        m = self._index()
        if name in m["hf_top"]:
            return m["hf_top"][name], None
        x = HF_LAYER_RE.match(name)
        if x and x.group(2) in m["hf_layer"]:
            return m["hf_layer"][x.group(2)], int(x.group(1))
        return None

    def gguf_rule(self, name: str):
        """GGUF name -> (rule, part index, layer index or None), or None."""
        m = self._index()
        if name in m["g_top"]:
            r, i = m["g_top"][name]
            return r, i, None
        x = _GGUF_LAYER_RE.match(name)
        if x and x.group(2) in m["g_layer"]:
            r, i = m["g_layer"][x.group(2)]
            return r, i, int(x.group(1))
        return None

    def hf_to_gguf(self, name: str) -> tuple | None:
        """HF name -> its GGUF name(s), or None."""
        hit = self.hf_rule(name)
        if hit is None:
            return None
        rule, i = hit
        return tuple(g if i is None else f"blk.{i}.{g}" for g in rule.gguf)

    def gguf_to_hf(self, name: str) -> str | None:
        hit = self.gguf_rule(name)
        if hit is None:
            return None
        rule, _, i = hit
        return rule.hf if i is None else f"model.layers.{i}.{rule.hf}"

    # -- config
    def args(self, config: dict):
        from ..registry import family_module

        return family_module(config.get("model_type", self.model_types[0])).ModelArgs.from_dict(config)

    def config_to_kv(self, config: dict) -> list:
        kv = [("general.architecture", self.arch, "str")]
        if self.config_key:
            kv.append((self.config_key, json.dumps(config, sort_keys=True), "str"))
        kv += self.kv_fn(config, self.args(config))
        return kv

    def config_from_kv(self, meta: dict, tensor_names=None) -> dict:
        """The config recorded in the GGUF (its JSON key), else derived from the family's
        keys (and from `tensor_names`, when given: no `output.weight` = tied embeddings)."""
        raw = meta.get(self.config_key)
        if raw:
            try:
                cfg = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"GGUF key {self.config_key} is not valid JSON: {e}") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"GGUF key {self.config_key} is not a JSON object")
            return cfg
        cfg = self.derive_fn(meta)
        if tensor_names is not None and "token_embd.weight" in tensor_names:
            cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
            cfg["attention_bias"] = any(_ATTN_BIAS_RE.match(n) for n in tensor_names)
        return cfg

    # -- tensors
    def canonical(self, config: dict, tensors: dict) -> dict:
        """The names a HF folder may use -> the names of this table: VLM prefix dropped,
        vision / MTP / rotary buffers and config-derived buffers skipped, per-expert hub
        tensors stacked, fused gate_up_proj split."""
        n = int(text_part(config).get("num_hidden_layers", 1 << 30))
        out, per_expert = {}, {}
        for k, v in tensors.items():
            if k.startswith("model.language_model."):
                k = "model." + k[len("model.language_model.") :]
            if (
                k.startswith(("model.visual.", "visual.", "model.vision", "mtp.", "model.mtp."))
                or "rotary_emb" in k
                or k.endswith(self.drop)
            ):
                continue
            x = HF_LAYER_RE.match(k)
            if x and int(x.group(1)) >= n:  # MTP layers appended after the trunk
                continue
            e = _PER_EXPERT_RE.match(k)
            if e and self.fuse_experts:
                per_expert.setdefault(e.group(1), {}).setdefault(e.group(3), {})[int(e.group(2))] = v
                continue
            if k.endswith("." + FUSED_GATE_UP) and self.fuse_experts:
                if isinstance(v, QuantizedTensor):
                    raise ValueError(f"{k}: a fused quantized gate_up_proj cannot be split; pass gate_proj/up_proj")
                arr = np.asarray(v)
                if arr.ndim != 3 or arr.shape[1] % 2:
                    raise ValueError(f"{k}: expected [E, 2I, H], got {arr.shape}")
                half = arr.shape[1] // 2
                prefix = k[: -len(FUSED_GATE_UP)]
                out[prefix + EXPERT_SPLIT[0]] = arr[:, :half]
                out[prefix + EXPERT_SPLIT[1]] = arr[:, half:]
                continue
            out[k] = v
        if getattr(self.args(config), "tie_word_embeddings", False) and "model.embed_tokens.weight" in out:
            out.pop("lm_head.weight", None)  # tied: no output.weight (llama.cpp / ds4 convention)
        for prefix, parts in per_expert.items():
            for part, rows in parts.items():
                ids = sorted(rows)
                if ids != list(range(len(ids))):
                    raise ValueError(f"{prefix}: experts of {part}_proj are incomplete ({ids[:8]}...)")
                out[f"{prefix}.{part}_proj"] = np.stack([np.asarray(rows[i]) for i in ids])
        return out

    def to_gguf(self, config: dict, tensors: dict) -> list:
        """HF-named tensors -> [(GGUF name, value)] (values: numpy arrays or QuantizedTensor)."""
        args = self.args(config)
        items, unknown = [], []
        for name, val in self.canonical(config, tensors).items():
            hit = self.hf_rule(name)
            if hit is None:
                unknown.append(name)
                continue
            rule, i = hit
            gnames = [g if i is None else f"blk.{i}.{g}" for g in rule.gguf]
            if rule.split is None:
                vals = [val]
            else:
                if isinstance(val, QuantizedTensor):
                    raise ValueError(
                        f"{name}: a quantized tensor cannot be rearranged into {gnames}; convert from float weights"
                    )
                vals = rule.split(np.asarray(val), args)
            for g, v in zip(gnames, vals):
                if len(g.encode()) >= GGML_MAX_NAME:
                    raise ValueError(f"GGUF tensor name {g!r} is {len(g.encode())} bytes (ggml allows 63)")
                items.append((g, v))
        if unknown:
            raise ValueError(
                f"tensors with no {self.arch} GGUF name: {unknown[:8]}{' ...' if len(unknown) > 8 else ''}"
            )
        return items

    def from_gguf(self, config: dict, names, get) -> tuple[dict, list]:
        """GGUF tensor names + `get(name) -> value` -> ({HF name: value}, [unknown names])."""
        args = None
        tensors, groups, unknown = {}, {}, []
        for gname in names:
            hit = self.gguf_rule(gname)
            if hit is None:
                unknown.append(gname)
                continue
            rule, part, i = hit
            hf = rule.hf if i is None else f"model.layers.{i}.{rule.hf}"
            if rule.join is None:
                tensors[hf] = get(gname)
            else:
                groups.setdefault((hf, rule), {})[part] = get(gname)
        for (hf, rule), parts in groups.items():
            if sorted(parts) != list(range(len(rule.gguf))):
                missing = [g for j, g in enumerate(rule.gguf) if j not in parts]
                raise ValueError(f"{hf}: GGUF tensors {missing} are missing")
            vals = [parts[j] for j in range(len(rule.gguf))]
            if any(isinstance(v, QuantizedTensor) for v in vals):
                warnings.warn(f"{hf}: dequantizing {[v for v in rule.gguf]} to rebuild it")
                vals = [v.dequantize() if isinstance(v, QuantizedTensor) else v for v in vals]
            if args is None:
                args = self.args(config)
            tensors[hf] = rule.join([np.asarray(v) for v in vals], args)
        if self.fuse_experts:
            _fuse_experts(tensors)
        return tensors, unknown


def _fuse_experts(tensors: dict) -> None:
    """Float gate_proj + up_proj [E, I, H] -> gate_up_proj [E, 2I, H] (quantized stay split)."""
    gname, uname = EXPERT_SPLIT
    for key in [k for k in tensors if k.endswith("." + gname)]:
        prefix = key[: -len(gname)]
        g, u = tensors.get(key), tensors.get(prefix + uname)
        if isinstance(g, np.ndarray) and isinstance(u, np.ndarray) and g.dtype == u.dtype and g.shape == u.shape:
            tensors[prefix + FUSED_GATE_UP] = np.concatenate([g, u], axis=1)
            del tensors[key], tensors[prefix + uname]
