"""Qwen3.8 Flash Next in MLX: transformers' `qwen4_exp` text model (Qwen4ExpForCausalLM).

Reference: transformers' modeling_qwen4_exp.py (model_type `qwen4_exp_text`; the VLM
config `qwen4_exp` nests it as `text_config`).  The rope is a rotate-half rope on the first
`head_dim * partial_rotary_factor` channels; its (t, h, w) MRoPE position streams are
equal for text (a plain rope at index + `rope_delta`), and differ on image tokens (the
`input_positions` hook gives them during an image prefill; the caches keep them and
the delta text positions carry after the last image, see `AttentionCache`).

Hidden state: `hc_count` residual streams [B, T, hc, H], all equal to the token
embedding at the start.  One decoder layer:

    x += PLE(x, ids)                                   (PLE layers only, see qwen4_exp_ple)
    mixed, inject = attn_hyper_connection(x);  x += inject_i * mixer(mixed)   per stream i
    mixed, inject = mlp_hyper_connection(x);   x += inject_i * MoE(mixed)

where a gated-residual hyper-connection (Qwen's low-rank variant, not DeepSeek's
Sinkhorn mHC) is

    n      = per-stream RMSNorm (1+w) of x                      [hc, H]
    w_in   = sigmoid(up(silu(down(flat(n)) / hc)))              [hc, H]   (low rank)
    mixed  = mean_i(w_in_i * n_i)                               [H]
    inject = 2 * sigmoid(block_inject(flat(n)) / hc)            [hc]

and the model ends with the same mixer (no inject) and `lm_head`; there is no final norm.

Token mixers:
  * "linear_attention": Gated DeltaNet (conv1d + SiLU over [q|k|v], l2-normalised q/k,
    decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), the gated delta
    rule through `mx.fast.gated_delta_update`, gated RMSNorm with silu(z), out_proj);
  * "indexed_attention": gated GQA (q_proj gives query and a sigmoid output gate per
    head, q/k RMSNorm (1+w), rope) restricted by the QSA indexer: the indexer keys are
    mean-pooled in blocks of `indexer_compress_ratio`, normalised and roped at each
    block's first position; query t keeps the top `indexer_budget / ratio` complete
    blocks by sum_h ReLU(q_h . k_block) / sqrt(d), plus its incomplete tail block.
MoE: softmax router, top-k (renormalised when norm_topk_prob), SwiGLU experts, plus a
shared expert gated by sigmoid(shared_expert_gate(x)).

Caches (`LinearCache` / `AttentionCache`, one per layer) hold all state: the GDN conv
window and delta-rule state, the PLE conv window and n-gram id history, the K/V rows,
the QSA block keys and the raw indexer keys of the incomplete block.

One forward, `Model.forward(ids, ctx)`, for every context kind (runtime/forward_context.py,
docs/forward.md): PREFILL (`model(ids, cache)`; also the legacy decode, a one-token
prefill) runs a chunk over the live caches, its shapes decided by the host-side offset;
DECODE (B sessions' tokens) and CHAIN (a verify) run over the caches' static views,
branch-free in the positions.  The kinds share every module; they part only where the
algorithm does: the attention's chunk (indexer blocks pooled per chunk, MRoPE rows, causal
mask) against its per-row masked write, and the linear layer's batch of rows against its
chain stepped per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..runtime.forward_context import CHAIN, DECODE, PREFILL, StepContext
from ..runtime.steering import ATTN, FFN, steer  # directional steering hook (steering.py)
from .cache import StaticForward, grow_rows
from .causal_lm import BaseModelArgs, CausalLM, ContextForward
from .gated_delta import causal_conv1d, gated_delta, l2_normalize
from .layers import GLUMLP, ActivationDtype, SwitchGLU, default_inv_freq, route_weights, score_fn, topk_indices
from .qwen4_exp_ple import DepthwiseConvWeight, GroupedNorm, PLELayer

MROPE_SECTION_DEFAULT = [11, 11, 10]  # transformers' Qwen4ExpTextRotaryEmbedding, when the config has none
LINEAR = "linear_attention"
INDEXED = "indexed_attention"

# The random-weight demo model (`ds4mlx.load("demo:qwen4_exp")`): the real layer pattern
# (3 Gated DeltaNet layers, then an indexed-attention layer), PLE, hyper-connections and
# MoE, everything scaled down.  Qwen's own tokenizer is not available offline, so the
# demo reuses the DeepSeek V4 tokenizer: hence its vocabulary (129280) and EOS id (1).
DEMO_CONFIG = {
    "model_type": "qwen4_exp_text",
    "vocab_size": 129280,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "layer_types": [LINEAR, LINEAR, LINEAR, INDEXED],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "hc_count": 4,
    "hc_lowrank": 32,
    "ple_layer_ids": [1, 3],
    "ple_embed_dim": 128,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 4096,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 32,
    "indexer_budget": 64,
    "indexer_compress_ratio": 4,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "demo_model": True,
}
_QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


@dataclass
class ModelArgs(BaseModelArgs):
    """Hugging Face `Qwen4ExpTextConfig` fields (same names and defaults)."""

    model_type: str = "qwen4_exp_text"
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    head_dim: int = 256
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    layer_types: list | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: Any = None
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: list | None = None
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    norm_topk_prob: bool = True
    output_gate_type: str | None = None
    # legacy spellings folded in by __post_init__ (as transformers does)
    full_attention_interval: int = 4
    rope_theta: float | None = None
    partial_rotary_factor: float | None = None

    @classmethod
    def from_dict(cls, config: dict) -> ModelArgs:
        if isinstance(config.get("text_config"), dict):  # the VLM config (`qwen4_exp`)
            config = {**config["text_config"], "model_type": "qwen4_exp_text"}
        return super().from_dict(config)

    def __post_init__(self):
        n = self.num_hidden_layers
        self.ple_layer_ids = sorted(set(self.ple_layer_ids or []))
        if self.ple_embed_dim is None:
            self.ple_embed_dim = self.hidden_size
        if self.layer_types is None:
            k = self.full_attention_interval
            self.layer_types = [LINEAR if (i + 1) % k else INDEXED for i in range(n)]
        self.layer_types = [INDEXED if t == "full_attention" else t for t in self.layer_types]
        if len(self.layer_types) != n or set(self.layer_types) - {LINEAR, INDEXED}:
            raise ValueError(f"bad layer_types: {self.layer_types}")
        rp = dict(self.rope_parameters or {})
        rp.setdefault("rope_type", "default")
        rp.setdefault("rope_theta", self.rope_theta if self.rope_theta is not None else 10000.0)
        if self.partial_rotary_factor is not None:
            rp.setdefault("partial_rotary_factor", self.partial_rotary_factor)
        if rp["rope_type"] != "default":
            raise ValueError(f"unsupported rope_type {rp['rope_type']!r}")
        self.rope_parameters = rp
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}")
        if (self.output_gate_type or self.hidden_act) not in ("silu", "sigmoid"):
            raise ValueError(f"unsupported output_gate_type {self.output_gate_type!r}")
        if self.hc_count <= 1:
            raise ValueError("hc_count must be > 1")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if INDEXED in self.layer_types:
            missing = [f for f in _QSA_FIELDS if getattr(self, f) is None]
            if missing:
                raise ValueError(f"indexed_attention layers need {missing}")
            if self.indexer_kv_heads != 1:
                raise ValueError("QSA requires indexer_kv_heads == 1")
            if self.indexer_budget % self.indexer_compress_ratio:
                raise ValueError("indexer_budget must be divisible by indexer_compress_ratio")
            if self.rotary_dim > self.indexer_head_dim:
                raise ValueError("the rope dims must fit the indexer head")
        if self.ple_layer_ids:
            heads = (self.ngram_size - 1) * self.heads_per_ngram
            if heads <= 0 or self.ple_embed_dim % heads:
                raise ValueError("ple_embed_dim must be divisible by (ngram_size-1)*heads_per_ngram")
            bad = [i for i in self.ple_layer_ids if not 1 <= i <= n or self.layer_types[i - 1] != LINEAR]
            if bad:
                raise ValueError(f"ple_layer_ids must name linear_attention layers (one-indexed): {bad}")
            if self.eos_id is None:
                raise ValueError("eos_token_id is required with PLE layers")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope_parameters.get("partial_rotary_factor", 1.0))

    @property
    def eos_id(self) -> int | None:
        e = self.eos_token_id
        if isinstance(e, (list, tuple)):
            return int(e[0]) if e else None
        return None if e is None else int(e)


# ----------------------------------------------------------------------------- caches


class _Rows:
    """A growable [1, ..., cap, D] buffer along axis -2 (capacity in power-of-two buckets,
    models/cache.py: the compiled decode step is traced once per bucket)."""

    def __init__(self):
        self.buf = None
        self.n = 0

    def reserve(self, want: int) -> None:
        self.buf = grow_rows(self.buf, self.n, want, axis=-2)

    def append(self, new: mx.array) -> mx.array:
        k = new.shape[-2]
        if self.buf is None:
            self.buf = mx.zeros((*new.shape[:-2], 0, new.shape[-1]), new.dtype)
        self.reserve(self.n + k)
        self.buf[..., self.n : self.n + k, :] = new
        self.n += k
        return self.buf[..., : self.n, :]

    def live(self) -> mx.array:
        return self.buf[..., : self.n, :]

    def load(self, rows: mx.array | None, cap: int):
        if rows is None:
            self.buf, self.n = None, 0
            return
        n = rows.shape[-2]
        if cap < n:
            raise ValueError("row capacity below row count")
        pad = mx.zeros((*rows.shape[:-2], cap - n, rows.shape[-1]), rows.dtype)
        self.buf, self.n = mx.concatenate([rows, pad], axis=-2), n

    @property
    def cap(self) -> int:
        return 0 if self.buf is None else self.buf.shape[-2]


class LinearCache:
    """State of a Gated DeltaNet layer (and its PLE, if any).

    conv [1, K-1, conv_dim]         the last K-1 inputs of the q/k/v conv
    recurrent [1, Hv, Dv, Dk] f32   the delta-rule state
    ple_conv [1, (Kp-1)*N, hc*H]    PLE only: the last inputs of the dilated conv
    ngram [1, N-1] int32            PLE only: the last N-1 token ids
    Each is None until the first token (zeros / EOS then).
    """

    NAMES = ("conv", "recurrent", "ple_conv", "ngram")

    def __init__(self, ple: bool):
        self.offset = 0
        self.ple = ple
        self.conv = self.recurrent = self.ple_conv = self.ngram = None

    # -- static decode layout: fixed-size (made by `Model.static_state` before the first token)
    def static_state(self, dtype, ahead: int = 1) -> list[mx.array]:
        return [getattr(self, k) for k in self.NAMES[: 4 if self.ple else 2]]

    def commit_static(self, arrays, advance: int = 1) -> None:
        for k in self.NAMES[: 4 if self.ple else 2]:
            setattr(self, k, next(arrays))
        self.offset += advance

    @property
    def state(self) -> dict:
        return {k: getattr(self, k) for k in self.NAMES if getattr(self, k) is not None}

    @property
    def meta_state(self) -> dict:
        return {"type": LINEAR, "offset": self.offset, "ple": self.ple}

    def load(self, meta: dict, arrays: dict):
        if meta.get("type") != LINEAR or bool(meta.get("ple")) != self.ple:
            raise ValueError("layer cache layout mismatch")
        if set(arrays) - set(self.NAMES):
            raise ValueError(f"unexpected cache arrays {sorted(arrays)}")
        self.offset = int(meta["offset"])
        for k in self.NAMES:
            setattr(self, k, arrays.get(k))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state.values())


class AttentionCache:
    """State of an indexed-attention layer.

    keys, values [1, Hkv, L, D]   every position's K/V rows
    index_blocks [1, L // r, d]   the QSA block keys: mean-pooled indexer keys of each
                                  complete block, normalised and roped at the block start
    index_tail [1, L % r, d]      the raw indexer keys of the incomplete block
    """

    NAMES = ("keys", "values", "index_blocks", "index_tail", "mrope")

    def __init__(self, ratio: int):
        self.offset = 0
        self.ratio = ratio
        self.keys, self.values, self.index_blocks = _Rows(), _Rows(), _Rows()
        self.index_tail = None
        # MRoPE: rows [0, mrope.shape[1]) have the explicit (t, h, w) positions `mrope`
        # (an image prompt up to its last image token); row i past them sits at i + rope_delta
        self.mrope: np.ndarray | None = None
        self.rope_delta = 0
        self._step_pos = None  # (key, delta, block position) of static_state, made once per block

    def set_positions(self, table: np.ndarray) -> None:
        """Positions [3, n] of rows [0, n) (an image prompt's get_rope_index)."""
        n = table.shape[1]
        self.rope_delta = int(table[:, -1].max()) + 1 - n if n else 0
        plain = (table == (np.arange(n) + self.rope_delta)[None]).all(axis=0)
        end = int(np.nonzero(~plain)[0].max()) + 1 if (~plain).any() else 0
        self.mrope = np.ascontiguousarray(table[:, :end]) if end else None
        self._step_pos = None

    def plain_from(self, row: int) -> bool:
        """Whether every row from `row` on is a text position (row + rope_delta)."""
        return self.mrope is None or row >= self.mrope.shape[1]

    def positions(self, rows: np.ndarray) -> mx.array:
        """The (t, h, w) positions [3, len(rows)] of `rows`."""
        rows = np.asarray(rows, np.int64)
        out = np.broadcast_to(rows + self.rope_delta, (3, rows.size)).copy()
        if self.mrope is not None:
            known = rows < self.mrope.shape[1]
            out[:, known] = self.mrope[:, rows[known]]
        return mx.array(out.astype(np.int32))

    # -- static decode layout (buffers made by `Model.static_state` before the first token)
    def static_state(self, dtype, ahead: int = 1) -> list[mx.array]:
        """keys, values (grown to hold rows offset .. offset + ahead - 1), index blocks (up to
        that last row's block), and the open block's raw keys padded to r rows (the first
        offset % r live)."""
        r, tail = self.ratio, self.index_tail
        last = self.offset + ahead - 1
        self.keys.reserve(last + 1)
        self.values.reserve(last + 1)
        if self.index_blocks.buf is None:
            self.index_blocks.buf = mx.zeros((1, 0, tail.shape[-1]), tail.dtype)
        self.index_blocks.reserve(last // r + 1)
        pad = mx.zeros((1, r - tail.shape[1], tail.shape[-1]), tail.dtype)
        # the rope position of this row is row + rope_delta (text); the open block's first
        # row may be an image row (a prompt ending just after an image): its (t, h, w)
        key = (self.offset // r, self.rope_delta)
        if self._step_pos is None or self._step_pos[0] != key:  # host work once per block, not per step
            start = np.array([self.offset // r * r])
            self._step_pos = (key, mx.array(self.rope_delta, mx.int32), self.positions(start))
        _, delta, block_pos = self._step_pos
        tail = mx.concatenate([tail, pad], axis=1)
        return [self.keys.buf, self.values.buf, self.index_blocks.buf, tail, delta, block_pos]

    def commit_static(self, arrays, advance: int = 1) -> None:
        self.offset += advance
        self.keys.buf, self.values.buf, self.index_blocks.buf = next(arrays), next(arrays), next(arrays)
        self.keys.n = self.values.n = self.offset
        self.index_blocks.n = self.offset // self.ratio
        self.index_tail = next(arrays)[:, : self.offset % self.ratio]
        next(arrays), next(arrays)  # rope_delta, the open block's position: made per step

    @property
    def state(self) -> dict:
        if self.keys.buf is None:
            return {}
        out = {"keys": self.keys.live(), "values": self.values.live(), "index_tail": self.index_tail}
        if self.index_blocks.buf is not None:
            out["index_blocks"] = self.index_blocks.live()
        if self.mrope is not None:
            out["mrope"] = mx.array(self.mrope.astype(np.int32))
        return out

    @property
    def meta_state(self) -> dict:
        return {
            "type": INDEXED,
            "offset": self.offset,
            "ratio": self.ratio,
            "cap": self.keys.cap,
            "block_cap": self.index_blocks.cap,
            "rope_delta": self.rope_delta,
        }

    def load(self, meta: dict, arrays: dict):
        if meta.get("type") != INDEXED or meta.get("ratio") != self.ratio:
            raise ValueError("layer cache layout mismatch")
        if set(arrays) - set(self.NAMES):
            raise ValueError(f"unexpected cache arrays {sorted(arrays)}")
        n = int(meta["offset"])
        want = {"keys": n, "values": n, "index_blocks": n // self.ratio, "index_tail": n % self.ratio}
        for name, rows in want.items():
            a = arrays.get(name)
            required = rows > 0 or (n > 0 and name != "index_blocks")
            if (a is None and required) or (a is not None and a.shape[-2] != rows):
                raise ValueError("attention cache row count mismatch")
        self.offset = n
        self.keys.load(arrays.get("keys"), int(meta.get("cap", 0)))
        self.values.load(arrays.get("values"), int(meta.get("cap", 0)))
        self.index_blocks.load(arrays.get("index_blocks"), int(meta.get("block_cap", 0)))
        self.index_tail = arrays.get("index_tail")
        mrope = arrays.get("mrope")
        self.mrope = None if mrope is None else np.array(mrope).astype(np.int64)
        self.rope_delta = int(meta.get("rope_delta", 0))
        self._step_pos = None

    @property
    def nbytes(self) -> int:
        total = sum(r.buf.nbytes for r in (self.keys, self.values, self.index_blocks) if r.buf is not None)
        return total + (0 if self.index_tail is None else self.index_tail.nbytes)


# ----------------------------------------------------------------------------- modules


class OffsetRMSNorm(nn.Module):
    """RMSNorm with a (1 + w) weight, w initialised to 0 (Qwen3-Next style)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.fast.rms_norm(x.astype(mx.float32), 1.0 + self.weight.astype(mx.float32), self.eps)
        return y.astype(x.dtype)


class GatedRMSNorm(nn.Module):
    """w * RMSNorm(x) * act(gate) (plain weight, initialised to 1)."""

    def __init__(self, dims: int, eps: float, activation: str):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps
        self._act = nn.silu if activation == "silu" else mx.sigmoid

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        y = mx.fast.rms_norm(x.astype(mx.float32), None, self.eps).astype(x.dtype) * self.weight
        return (y * self._act(gate.astype(mx.float32))).astype(x.dtype)


class HalfRoPE:
    """Rotate-half rope on the first `dims` channels (default inverse frequencies)."""

    def __init__(self, dims: int, theta: float, mrope_section=None):
        self.dims = dims
        self._inv_freq = default_inv_freq(dims, theta).astype(mx.float32)
        self._periods = 1.0 / self._inv_freq
        # the position stream (t 0, h 1, w 2) of each frequency: transformers' interleaved
        # recomposition (frequency i takes h when i % 3 == 1 and i < 3 * section[1], etc.)
        stream = np.zeros(dims // 2, np.int32)
        sec = list(mrope_section or MROPE_SECTION_DEFAULT)
        for k in (1, 2):
            stream[k : sec[k] * 3 : 3] = k
        self._stream = mx.array(stream)

    def at(self, x: mx.array, pos: mx.array) -> mx.array:
        """x [..., L, D] with row j at the (t, h, w) position pos[:, j] (pos [3, L] int)."""
        if self.dims == 0:
            return x
        ang = mx.take(pos, self._stream, axis=0).T.astype(mx.float32) * self._inv_freq  # [L, dims/2]
        cos, sin = mx.cos(ang).astype(x.dtype), mx.sin(ang).astype(x.dtype)
        h = self.dims // 2
        x1, x2, rest = x[..., :h], x[..., h : self.dims], x[..., self.dims :]
        return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)

    def __call__(self, x: mx.array, offset: int = 0, scale: float = 1.0) -> mx.array:
        """x [..., L, D]: row j gets the angle scale * (offset + j) * inv_freq."""
        if self.dims == 0:
            return x
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=scale, offset=offset, freqs=self._periods)


def make_rope(args: ModelArgs) -> HalfRoPE:
    """The rope every attention layer shares; the MTP head builds its own the same way
    (qwen4_exp_mtp.py)."""
    rp = args.rope_parameters
    return HalfRoPE(args.rotary_dim, float(rp["rope_theta"]), rp.get("mrope_section"))


def rope_rows(rope: HalfRoPE, cache: AttentionCache, x: mx.array, start: int) -> mx.array:
    """`rope` on x [..., C, D], the rows [start, start + C) of `cache` (MRoPE-aware)."""
    if cache.plain_from(start):
        return rope(x, offset=start + cache.rope_delta)
    return rope.at(x, cache.positions(np.arange(start, start + x.shape[-2])))


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.hidden_size
        self.Hk, self.Hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.Dk, self.Dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim, self.value_dim = self.Hk * self.Dk, self.Hv * self.Dv
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(H, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.Hv, bias=False)
        self.in_proj_a = nn.Linear(H, self.Hv, bias=False)
        self.conv1d = DepthwiseConvWeight(conv_dim, args.linear_conv_kernel_dim)
        self.dt_bias = mx.ones((self.Hv,))
        self.A_log = mx.zeros((self.Hv,))
        self.norm = GatedRMSNorm(self.Dv, args.rms_norm_eps, args.output_gate_type or args.hidden_act)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)

    def __call__(self, x: mx.array, cache: LinearCache) -> mx.array:
        B, T, _ = x.shape
        qkv, cache.conv = causal_conv1d(self.in_proj_qkv(x), self.conv1d.taps, cache.conv)
        qkv = nn.silu(qkv)
        q = qkv[..., : self.key_dim].reshape(B, T, self.Hk, self.Dk)
        k = qkv[..., self.key_dim : 2 * self.key_dim].reshape(B, T, self.Hk, self.Dk)
        v = qkv[..., 2 * self.key_dim :].reshape(B, T, self.Hv, self.Dv)
        q = l2_normalize(q) * (self.Dk**-0.5)
        k = l2_normalize(k)
        beta = mx.sigmoid(self.in_proj_b(x).astype(mx.float32))
        a = self.in_proj_a(x).astype(mx.float32)
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a + self.dt_bias.astype(mx.float32))
        out, cache.recurrent = gated_delta(q, k, v, g, beta, cache.recurrent)
        z = self.in_proj_z(x).reshape(B, T, self.Hv, self.Dv)
        out = self.norm(out.astype(x.dtype), z)
        return self.out_proj(out.reshape(B, T, self.value_dim))


class QSAIndexer(nn.Module):
    """Picks, per query, the complete key blocks it attends to (plus its tail block), from its
    projection `index_qk_proj(x)`: over a prefill chunk (`chunk`: host positions, the blocks the
    chunk completes pooled at once) or for one static query row (`row`: branch-free in the
    position, the open block pooled every row)."""

    def __init__(self, args: ModelArgs, rope: HalfRoPE):
        super().__init__()
        self.nh, self.d = args.indexer_n_heads, args.indexer_head_dim
        self.ratio = args.indexer_compress_ratio
        self.topk = args.indexer_budget // args.indexer_compress_ratio
        self.index_qk_proj = nn.Linear(args.hidden_size, (self.nh + 1) * self.d, bias=False)
        self.q_layernorm = OffsetRMSNorm(self.d, args.rms_norm_eps)
        self.k_layernorm = OffsetRMSNorm(self.d, args.rms_norm_eps)
        self._rope = rope

    def chunk(self, qk: mx.array, cache: AttentionCache, s: int) -> mx.array | None:
        """Boolean mask [C, L] of the selected keys of the chunk's C queries at rows s.. of
        `cache` (causality included; the cache's blocks and tail advanced), or None when every
        query sees all of its causal keys."""
        B, C, _ = qk.shape
        r, L = self.ratio, s + C
        q = self.q_layernorm(qk[..., : self.nh * self.d].reshape(B, C, self.nh, self.d))
        q = rope_rows(self._rope, cache, q.swapaxes(1, 2), s)  # [B, nh, C, d]
        raw = qk[..., self.nh * self.d :]  # [B, C, d]: indexer keys from position (s // r) * r on
        if cache.index_tail is not None:
            raw = mx.concatenate([cache.index_tail.astype(raw.dtype), raw], axis=1)
        done, nb = s // r, L // r
        if nb > done:  # blocks completed by this chunk
            fresh = raw[:, : (nb - done) * r].astype(mx.float32).reshape(B, nb - done, r, self.d)
            fresh = self.k_layernorm(fresh.mean(axis=2).astype(raw.dtype))
            if cache.plain_from(done * r) and cache.rope_delta == 0:
                fresh = self._rope(fresh[:, None], offset=done, scale=float(r))[:, 0]
            else:  # each block at its first row's (t, h, w) position
                fresh = self._rope.at(fresh[:, None], cache.positions(np.arange(done, nb) * r))[:, 0]
            cache.index_blocks.append(fresh)
        cache.index_tail = raw[:, (nb - done) * r :]
        if nb <= self.topk:  # no query has more complete blocks than the budget
            return None
        blocks = cache.index_blocks.live()[:, None]  # [B, 1, nb, d], block j roped at position j*r
        scores = mx.maximum(q.astype(mx.float32) @ blocks.astype(mx.float32).swapaxes(-1, -2), 0.0)
        scores = scores.sum(axis=1)[0] / math.sqrt(self.d)  # [C, nb]
        t = s + mx.arange(C)[:, None]
        complete = (t + 1) // r  # complete blocks per query
        valid = mx.arange(nb)[None] < complete
        masked = mx.where(valid, scores, -mx.inf)
        idx = topk_indices(masked, self.topk)
        chosen = mx.put_along_axis(mx.zeros((C, nb), mx.bool_), idx, mx.array(True), axis=-1) & valid
        pos = mx.arange(L)[None]
        nbl = -(-L // r)
        chosen = mx.concatenate([chosen, mx.zeros((C, nbl - nb), mx.bool_)], axis=1) if nbl > nb else chosen
        in_block = mx.take(chosen, mx.arange(L) // r, axis=1)
        tail = (pos >= complete * r) & (pos <= t)
        return in_block | tail

    def row(self, qk: mx.array, pos: mx.array, blocks: mx.array, tail: mx.array, valid: mx.array, delta, block_pos):
        """`chunk` for one query at row `pos` (array) over the capacity rows, from its
        `index_qk_proj` output qk [1, 1, (nh + 1) d]: (new blocks, new tail, token mask
        [cap]).  The open block is pooled and written at pos // r whether complete or not (a
        block that is not complete is masked).  The query sits at pos + delta, the open
        block at block_pos [3, 1] (AttentionCache.static_state)."""
        r = self.ratio
        q = self.q_layernorm(qk[..., : self.nh * self.d].reshape(1, 1, self.nh, self.d))
        q = self._rope(q.swapaxes(1, 2), offset=pos + delta)  # [1, nh, 1, d]
        raw = qk[..., self.nh * self.d :]  # [1, 1, d]
        tail = mx.slice_update(tail, raw.astype(tail.dtype), (pos % r).reshape(1), axes=(1,))
        block = self.k_layernorm(tail.astype(mx.float32).mean(axis=1, keepdims=True).astype(raw.dtype))
        block = self._rope.at(block[:, None], block_pos)[:, 0]
        blocks = mx.slice_update(blocks, block.astype(blocks.dtype), (pos // r).reshape(1), axes=(1,))
        nb = blocks.shape[1]
        if nb <= self.topk:
            return blocks, tail, valid
        scores = mx.maximum(q.astype(mx.float32) @ blocks[:, None].astype(mx.float32).swapaxes(-1, -2), 0.0)
        scores = scores.sum(axis=1)[0, 0] / math.sqrt(self.d)  # [nb]
        complete = mx.arange(nb) < (pos + 1) // r
        idx = topk_indices(mx.where(complete, scores, -mx.inf), self.topk)
        chosen = mx.put_along_axis(mx.zeros((nb,), mx.bool_), idx, mx.take(complete, idx), axis=-1)
        tok = mx.arange(valid.shape[0])
        in_block = mx.take(chosen, mx.minimum(tok // r, nb - 1)) & (tok // r < nb)
        return blocks, tail, (in_block | (tok >= ((pos + 1) // r) * r)) & valid


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, rope: HalfRoPE):
        super().__init__()
        H, D = args.hidden_size, args.head_dim
        self.nh, self.nkv, self.D = args.num_attention_heads, args.num_key_value_heads, D
        bias = args.attention_bias
        self.q_proj = nn.Linear(H, self.nh * D * 2, bias=bias)
        self.k_proj = nn.Linear(H, self.nkv * D, bias=bias)
        self.v_proj = nn.Linear(H, self.nkv * D, bias=bias)
        self.o_proj = nn.Linear(self.nh * D, H, bias=bias)
        self.q_norm = OffsetRMSNorm(D, args.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(D, args.rms_norm_eps)
        self.indexer = QSAIndexer(args, rope)
        self._rope = rope

    def __call__(self, x: mx.array, ctx, cache: AttentionCache | None = None) -> mx.array:
        """The attention of x [1, T, H] over `ctx` (runtime/forward_context.py).  The projections
        and the output gate run once for all T tokens; in between, PREFILL attends the chunk
        over the live `cache` (host positions), DECODE / CHAIN each query row t at
        ctx.row_pos[t] over its view (`AttentionCache.static_state`), branch-free in the
        positions and in row order (a chain's row reads the rows before it)."""
        B, T, _ = x.shape
        qg = self.q_proj(x).reshape(B, T, self.nh, 2 * self.D)
        q, gate = qg[..., : self.D], qg[..., self.D :]
        proj = (q, self.k_proj(x), self.v_proj(x), self.indexer.index_qk_proj(x))
        if ctx.kind == PREFILL:
            out = self._chunk(*proj, cache)
        else:
            chain = ctx.kind == CHAIN
            rows = zip(ctx.split(*proj), ctx.row_pos, ctx.views)
            out = ctx.join([self._row(*row, pos, view, chain) for row, pos, view in rows])  # [1, T, nh * D]
        out = out * mx.sigmoid(gate.reshape(B, T, -1).astype(mx.float32)).astype(out.dtype)
        return self.o_proj(out)

    def _chunk(self, q, k, v, qk, cache: AttentionCache) -> mx.array:
        """A prefill chunk's C queries (q [1, C, nh, D], the k_proj, v_proj and indexer
        projections [1, C, ...]) at rows cache.offset.., their K/V appended -> the attention
        output [1, C, nh * D] before the gate."""
        B, C = q.shape[:2]
        s = cache.offset
        mask = self.indexer.chunk(qk, cache, s)
        q = rope_rows(self._rope, cache, self.q_norm(q).swapaxes(1, 2), s)
        k = rope_rows(self._rope, cache, self.k_norm(k.reshape(B, C, self.nkv, self.D)).swapaxes(1, 2), s)
        v = v.reshape(B, C, self.nkv, self.D).swapaxes(1, 2)
        keys, values = cache.keys.append(k), cache.values.append(v)
        if mask is None and C > 1:
            mask = "causal" if s == 0 else (mx.arange(s + C)[None] <= (s + mx.arange(C))[:, None])
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.D**-0.5, mask=mask)
        return out.swapaxes(1, 2).reshape(B, C, self.nh * self.D)

    def _row(self, q, k, v, qk, pos: mx.array, view, chain: bool) -> mx.array:
        """One query row at `pos` (its query [1, 1, nh, D], k_proj, v_proj and indexer
        projections [1, 1, ...]) over its `view` -> the attention output [1, 1, nh * D] before
        the gate."""
        keys, values, blocks, tail, delta, block_pos = (next(view) for _ in range(6))
        valid = mx.arange(keys.shape[-2]) <= pos
        blocks, tail, mask = self.indexer.row(qk, pos, blocks, tail, valid, delta, block_pos)
        at_pos = pos + delta  # the rope position (rows after an image prompt: see AttentionCache)
        q = self._rope(self.q_norm(q).swapaxes(1, 2), offset=at_pos)
        k = self._rope(self.k_norm(k.reshape(1, 1, self.nkv, self.D)).swapaxes(1, 2), offset=at_pos)
        v = v.reshape(1, 1, self.nkv, self.D).swapaxes(1, 2)
        at = pos.reshape(1)
        keys = mx.slice_update(keys, k.astype(keys.dtype), at, axes=(2,))
        values = mx.slice_update(values, v.astype(values.dtype), at, axes=(2,))
        if chain:  # the next row's open block: a new one (a text row) once this row closes it
            r = self.indexer.ratio
            block_pos = mx.where((pos + 1) % r == 0, mx.broadcast_to(pos + 1 + delta, block_pos.shape), block_pos)
        view.put(keys, values, blocks, tail, delta, block_pos)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.D**-0.5, mask=mask[None])
        return out.swapaxes(1, 2).reshape(1, 1, self.nh * self.D)


class SparseMoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.hidden_size
        self.gate = nn.Linear(H, args.num_experts, bias=False)
        self.experts = SwitchGLU(H, args.moe_intermediate_size, args.num_experts, None)
        self.shared_expert = GLUMLP(H, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        self._k, self._norm = args.num_experts_per_tok, args.norm_topk_prob

    def __call__(self, x: mx.array) -> mx.array:
        probs = score_fn(self.gate(x), "softmax")
        idx = topk_indices(probs, self._k)
        w = route_weights(probs, idx, self._norm, 1.0)
        y = self.experts.fused_weighted(x, idx, w)  # GPU decode: two launches
        if y is None:
            y = (self.experts(x, idx) * w[..., None].astype(x.dtype)).sum(axis=-2)
        shared = mx.sigmoid(self.shared_expert_gate(x).astype(mx.float32)).astype(x.dtype) * self.shared_expert(x)
        return y + shared


class GatedResidual(nn.Module):
    """Qwen's low-rank gated-residual hyper-connection (see the module doc)."""

    def __init__(self, args: ModelArgs, inject: bool = True):
        super().__init__()
        hc, H = args.hc_count, args.hidden_size
        self.hc_norm = GroupedNorm(hc, H, args.rms_norm_eps)
        self.input_mix_weight_down = nn.Linear(hc * H, args.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(args.hc_lowrank, hc * H, bias=False)
        if inject:
            self.block_inject_weight = nn.Linear(hc * H, hc, bias=False)
        self._hc, self._inject = hc, inject

    def __call__(self, x: mx.array):
        """x [B, T, hc, H] -> (mixed [B, T, H], inject [B, T, hc] or None)."""
        hc, H = x.shape[-2:]
        n = self.hc_norm(x)
        flat = n.reshape(*n.shape[:-2], hc * H)
        w = mx.sigmoid(self.input_mix_weight_up(nn.silu(self.input_mix_weight_down(flat) / hc)))
        mixed = (w.reshape(n.shape) * n).mean(axis=-2)
        if not self._inject:
            return mixed, None
        return mixed, 2.0 * mx.sigmoid(self.block_inject_weight(flat) / hc)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, idx: int, rope: HalfRoPE):
        super().__init__()
        self.layer_type = args.layer_types[idx]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args, rope)
        self.mlp = SparseMoE(args)
        if idx + 1 in args.ple_layer_ids:
            self.ple = PLELayer(args, args.ple_layer_ids.index(idx + 1))
        self.attn_hyper_connection = GatedResidual(args)
        self.mlp_hyper_connection = GatedResidual(args)
        self.has_ple = idx + 1 in args.ple_layer_ids

    def __call__(self, x: mx.array, ids: mx.array, cache) -> mx.array:
        """The layer over a chunk x [1, C, hc, H] at the cache's position (the MTP head's block)."""
        return self.forward(x, ids, StepContext.prefill(cache.offset, [cache]), cache)

    def forward(self, x: mx.array, ids: mx.array, ctx, cache=None) -> mx.array:
        """The layer over the query rows of `ctx` (runtime/forward_context.py; x [1, T, hc, H],
        ids [1, T]): PREFILL a chunk over the live `cache`, DECODE / CHAIN the rows over their
        views.  Steering edits both sites' outputs on every kind."""
        if self.layer_type == LINEAR:
            x, out, inject = self._linear(x, ids, ctx, cache)
        else:
            mixed, inject = self.attn_hyper_connection(x)
            out = self.self_attn(mixed, ctx, cache)
        out = steer(self, ATTN, out)
        x = x + out[..., None, :] * inject[..., None].astype(out.dtype)
        mixed, inject = self.mlp_hyper_connection(x)
        out = steer(self, FFN, self.mlp(mixed))
        return x + out[..., None, :] * inject[..., None].astype(out.dtype)

    def _linear(self, x: mx.array, ids: mx.array, ctx, cache) -> tuple:
        """PLE and the Gated DeltaNet mixer -> (x after PLE, the mixer's output [1, T, H], its
        inject).  The modules read and replace a state's arrays (`conv`, `recurrent`,
        `ple_conv`, `ngram`): PREFILL the live `cache`'s, one sequence of T tokens (the delta
        rule over the chunk); DECODE the rows' views stacked into one batch of B one-token
        sequences; CHAIN one sequence stepped token by token (the recurrence emits only its
        last state), each token's states put into its row's view."""
        if ctx.kind == CHAIN:
            return self._linear_chain(x, ids, ctx)
        if ctx.kind == PREFILL:
            state = cache
        else:
            n = 4 if self.has_ple else 2
            state = _FixedState.stack([_FixedState(*(next(v) for _ in range(n))) for v in ctx.views])
        if self.has_ple:
            x = x + _tokens(self.ple(_sequences(x, ctx), _sequences(ids, ctx), state), x)
        mixed, inject = self.attn_hyper_connection(x)
        out = _tokens(self.linear_attn(_sequences(mixed, ctx), state), mixed)
        if ctx.kind == DECODE:
            for b, view in enumerate(ctx.views):
                view.put(*state.row(b, ctx.rows).arrays(self.has_ple))
        return x, out, inject

    def _linear_chain(self, x: mx.array, ids: mx.array, ctx) -> tuple:
        """`_linear` of a CHAIN context."""
        n = 4 if self.has_ple else 2
        state = _FixedState(*(next(ctx.views[0]) for _ in range(n)))
        ple_kept = []
        if self.has_ple:
            adds = []
            for xt, idt in ctx.split(x, ids):
                adds.append(self.ple(xt, idt, state))
                ple_kept.append([state.ple_conv, state.ngram])
            x = x + ctx.join(adds)
        mixed, inject = self.attn_hyper_connection(x)
        outs = []
        for t, ((m,), view) in enumerate(zip(ctx.split(mixed), ctx.views)):
            outs.append(self.linear_attn(m, state))
            for _ in range(n if t else 0):
                next(view)  # row t - 1's arrays of this layer (row t's view is chained to them)
            view.put(state.conv, state.recurrent, *(ple_kept[t] if ple_kept else ()))
        return x, ctx.join(outs), inject


class Qwen4ExpTextModel(ActivationDtype, nn.Module):
    # called with (the residual streams after the last layer [1, T, hc, H], before the
    # final mixer, and their first position) by every multi-token forward (prefill,
    # speculative verify); None = off.  The MTP head drafts from these
    # (models/qwen4_exp_mtp.py, speculative/mtp.py).
    stream_hook = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self._rope = make_rope(args)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i, self._rope) for i in range(args.num_hidden_layers)]
        self.hyper_connection_mixer = GatedResidual(args, inject=False)
        self._hc = args.hc_count
        self.input_rows = None  # image input: vision.encoder.ImageRows, set around a prefill
        # image input: `positions(n) -> [3, n]` MRoPE positions of the prompt's rows [0, n)
        # (vision.encoder.PromptPositions), set around the same prefill
        self.input_positions = None

    def forward(self, ids: mx.array, ctx) -> tuple[mx.array, mx.array]:
        """The forward of tokens ids [1, T] over `ctx` (runtime/forward_context.py: a PREFILL
        chunk of one session, T independent sessions' tokens, or one session's next T as a
        chain) -> (hidden [1, T, H], the residual streams after the last layer [1, T, hc, H]).
        PREFILL takes the image hooks' rows and positions, calls `stream_hook` and advances the
        caches; the static kinds leave the rows' new states in their views."""
        h = self.embed(ids)
        caches = ctx.views[0] if ctx.kind == PREFILL else [None] * len(self.layers)
        if ctx.kind == PREFILL:
            h = self._image_inputs(h, ids.shape[1], caches, ctx.row_pos[0])
        x = mx.broadcast_to(h[:, :, None, :], (*h.shape[:2], self._hc, h.shape[-1]))
        for layer, c in zip(self.layers, caches):
            x = layer.forward(x, ids, ctx, c)
        if ctx.kind == PREFILL:
            if self.stream_hook is not None:
                self.stream_hook(x, ctx.row_pos[0])
            for c in caches:
                c.offset += ids.shape[1]
        return self.hyper_connection_mixer(x)[0], x

    def _image_inputs(self, h: mx.array, T: int, caches: list, start: int) -> mx.array:
        """A prefill chunk's embeddings h [1, T, H] at rows start.. with the image tokens' rows
        taken from the vision encoder, and the attention caches given the prompt's (t, h, w)
        positions (the hooks set around an image prefill)."""
        if self.input_rows is not None:
            h = self.input_rows(h, start)
        if self.input_positions is not None:
            table = self.input_positions(start + T)
            for c in caches:
                if isinstance(c, AttentionCache):
                    c.set_positions(table)
        return h


def _sequences(a: mx.array, ctx) -> mx.array:
    """a [1, T, ...] as the recurrent modules' sequences: a prefill's one sequence of T tokens,
    a decode's B rows as B one-token sequences [B, 1, ...]."""
    return a if ctx.kind == PREFILL or a.shape[1] == 1 else a.reshape(a.shape[1], 1, *a.shape[2:])


def _tokens(a: mx.array, like: mx.array) -> mx.array:
    """`_sequences`' inverse: a [B, 1, ...] (or already [1, T, ...]) laid out as `like`'s tokens."""
    return a if a.shape[:2] == like.shape[:2] else a.reshape(*like.shape[:2], *a.shape[2:])


class _FixedState:
    """The arrays the linear and PLE modules read and replace, outside a LinearCache: one
    row's, or B rows' stacked along the batch axis (`stack`, `row`)."""

    def __init__(self, conv, recurrent, ple_conv=None, ngram=None):
        self.conv, self.recurrent, self.ple_conv, self.ngram = conv, recurrent, ple_conv, ngram

    def arrays(self, ple: bool) -> list:
        """In `LinearCache.static_state`'s order."""
        return [self.conv, self.recurrent] + ([self.ple_conv, self.ngram] if ple else [])

    @classmethod
    def stack(cls, rows: list) -> _FixedState:
        if len(rows) == 1:
            return rows[0]
        fields = zip(*(r.arrays(r.ple_conv is not None) for r in rows))
        return cls(*(mx.concatenate(list(f), axis=0) for f in fields))

    def row(self, b: int, B: int) -> _FixedState:
        """Row b of B stacked rows (a slice: a view, no gather)."""
        if B == 1:
            return self
        return _FixedState(*(None if a is None else a[b : b + 1] for a in vars(self).values()))


class Model(ContextForward, StaticForward, CausalLM):
    """Qwen4ExpForCausalLM (text): `model(ids [1, T], cache) -> logits [1, T, V]`, one
    `forward(ids, ctx)` for every context kind (docs/forward.md)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, Qwen4ExpTextModel(args))

    # a chain (a speculative verify) steps each token's recurrences and keeps every row's state
    static_rows_chain = True
    static_steers = True  # steering edits the static forward too (the stepper runs it eagerly)

    def static_dtype(self):
        """The residual stream's dtype (what every cache buffer of the forward is made in)."""
        return self.model.embed(mx.zeros((1, 1), mx.int32)).dtype  # a lazy array's dtype: nothing runs

    def static_state(self, cache: list, ahead: int = 1) -> list:
        """`StaticDecode.static_state`, after making the state a layer's first token makes
        (what None means to the dynamic forward: zeros, an EOS-filled n-gram history)."""
        a, dtype = self.args, self.static_dtype()
        for c in cache:
            if isinstance(c, LinearCache) and c.conv is None:
                conv_dim = 2 * a.linear_num_key_heads * a.linear_key_head_dim
                conv_dim += a.linear_num_value_heads * a.linear_value_head_dim
                c.conv = mx.zeros((1, a.linear_conv_kernel_dim - 1, conv_dim), dtype)
                shape = (1, a.linear_num_value_heads, a.linear_value_head_dim, a.linear_key_head_dim)
                c.recurrent = mx.zeros(shape, mx.float32)
                if c.ple:
                    c.ple_conv = mx.zeros(
                        (1, (a.ple_conv_kernel_size - 1) * a.ngram_size, a.hc_count * a.hidden_size), dtype
                    )
                    c.ngram = mx.full((1, a.ngram_size - 1), a.eos_id, mx.int32)
            elif isinstance(c, AttentionCache) and c.index_tail is None:
                for rows in (c.keys, c.values):
                    rows.buf = mx.zeros((1, a.num_key_value_heads, 0, a.head_dim), dtype)
                c.index_tail = mx.zeros((1, 0, a.indexer_head_dim), dtype)
        return super().static_state(cache, ahead)

    def forward(self, ids: mx.array, ctx, last_only: bool = False):
        """The one forward of ids [1, T] over `ctx` (runtime/forward_context.py `StepContext`).
        PREFILL (a chunk over the live caches, advanced) -> logits [1, T, V] (`last_only`: the
        last token's, [1, 1, V]).  DECODE / CHAIN (pure: T sessions' next tokens, or one
        session's next T chained) -> (logits [T, V], the rows' new states[, the residual
        streams [1, T, hc, H] after the last layer, with ctx.streams: the MTP head's input])."""
        h, streams = self.model.forward(ids, ctx)
        if ctx.kind == PREFILL:
            return self.head(h[:, -1:] if last_only else h)
        logits = self.head(h).squeeze(0)
        news = [v.new for v in ctx.views]
        return (logits, news, streams) if ctx.streams else (logits, news)

    def make_cache(self) -> list:
        a = self.args
        return [
            LinearCache(i + 1 in a.ple_layer_ids) if t == LINEAR else AttentionCache(a.indexer_compress_ratio)
            for i, t in enumerate(a.layer_types)
        ]

    def sanitize(self, weights: dict) -> dict:
        """Map transformers' in-memory state-dict names (text model or VLM) onto this module.

        `mtp.*` (the MTP head: the loader moves those to `mtp_weights` first, for `--mtp`,
        models/qwen4_exp_mtp.py) and the vision tower are dropped.  The PLE int64 buffers are derived from the config; the checkpoint's copies must
        agree with them and are dropped."""
        out = {}
        for k, v in weights.items():
            if k.startswith(("mtp.", "model.visual.")) or ".mtp." in k or "rotary_emb" in k:
                continue
            if k.startswith("model.language_model."):
                k = "model." + k[len("model.language_model.") :]
            if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                k = k + ".weight"
            elif ".ple.ple_embedding." in k and not k.endswith(".weight"):
                layer = int(k.split(".")[2])
                want = self.model.layers[layer].ple.ple_embedding.buffers()[k.rsplit(".", 1)[1]]
                if [int(t) for t in v.tolist()] != want:
                    raise ValueError(f"{k} does not match the config-derived PLE hash table")
                continue
            out[k] = v
        return self.drop_tied_head(out)
