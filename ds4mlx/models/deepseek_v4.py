"""DeepSeek V4 (Flash) in MLX: the graph, its per-layer caches and the weight mapping.

Reference: transformers' `deepseek_v4` (modeling_deepseek_v4.py).  One decoder layer:

    x [B, T, hc, H] --attn_hc(pre)--> collapsed --input_layernorm--> attention --attn_hc(post)--> x
                    --ffn_hc(pre)---> collapsed --post_attention_layernorm--> MoE --ffn_hc(post)--> x

Attention is shared-KV MQA (one K=V head of `head_dim`) over
  * the sliding window: the last `sliding_window` tokens (query included), and
  * for "compressed_sparse_attention" (CSA) layers: compressed entries, one per
    `m` tokens from overlapping 2m-token windows, of which a lightning indexer keeps
    the top `index_topk` per query;
  * for "heavily_compressed_attention" (HCA) layers: all compressed entries, one per
    `m'` tokens from non-overlapping windows.
Query t sees compressed entry w iff w < (t+1)//m.  Each head has a learned sink
logit; the output's rope slice gets the inverse rotation at the query position;
the output projection is grouped low-rank (o_a_proj per group, then o_b_proj).

The MoE is either hash-routed (`tid2eid[token]`) or top-k on sqrtsoftplus scores
plus `e_score_correction_bias`; weights are the chosen scores renormalised times
`routed_scaling_factor`; a shared expert is always added; SwiGLU is clamped at
`swiglu_limit`.

Caches (`LayerCache`, one per layer) hold every piece of state: a ring of the
last `sliding_window` K=V rows, and per compressor (attention, indexer) the
projections of the incomplete window, the previous window's overlap half (CSA),
and the emitted compressed rows.  All control flow depends only on the host-side
position counter, so a decode step never synchronises with the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..kernels import affine_qmv, moe_route
from ..kernels import sparse_attention as _sparse
from ..kernels.attn_prologue import CompressorJob, attn_prologue, attn_prologue_chain, attn_prologue_rows
from ..kernels.compressor_step import compressor_step  # one launch on a GPU, the MLX graph on the CPU
from ..kernels.hyper_connection import hc_post  # fused on a GPU, the reference graph on the CPU
from ..kernels.qmv_hc import DownSumShared
from ..kernels.qmv_hc_route import SiteRouter
from ..runtime.forward_context import CHAIN, DECODE, PREFILL, StepContext
from ..runtime.steering import ATTN, FFN, steer, steered  # directional steering hook (steering.py)
from . import prefill_attention
from .cache import StaticForward, grow_rows, iota, iota_rows
from .causal_lm import BaseModelArgs, CausalLM, ContextForward
from .fused import FusedLinear, fused_or_each, swiglu_of
from .layers import (
    GLUMLP,
    ActivationDtype,
    HyperConnection,
    HyperHead,
    RMSNorm,
    RoPE,
    SwitchGLU,
    attention_factor_from_params,
    inv_freq_from_params,
    rms_norm,
    route_weights,
    score_fn,
    topk_indices,
)

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass
class ModelArgs(BaseModelArgs):
    """Hugging Face `DeepseekV4Config` fields (same names and defaults)."""

    model_type: str = "deepseek_v4"
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    layer_types: list | None = None
    compress_rates: dict | None = None
    compress_rope_theta: float = 160000.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    mlp_layer_types: list | None = None
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    hidden_act: str = "silu"
    rms_norm_eps: float = 1.0e-6
    bos_token_id: int | None = 0
    eos_token_id: Any = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    partial_rotary_factor: float | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    # legacy / hub-checkpoint spellings, folded in by __post_init__ (as transformers does)
    compress_ratios: list | None = None
    compress_rate_csa: int | None = None
    compress_rate_hca: int | None = None
    num_hash_layers: int | None = None
    qk_rope_head_dim: int | None = None
    rope_scaling: dict | None = None

    def __post_init__(self):
        n = self.num_hidden_layers
        rates = dict(self.compress_rates or {CSA: 4, HCA: 128})
        if self.compress_rate_csa is not None:
            rates[CSA] = self.compress_rate_csa
        if self.compress_rate_hca is not None:
            rates[HCA] = self.compress_rate_hca
        self.compress_rates = rates
        if self.layer_types is None and self.compress_ratios is not None:
            self.layer_types = [_RATIO_TO_TYPE[r] for r in self.compress_ratios]
        if self.layer_types is None:
            inter = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            self.layer_types = [HCA] * min(n, 2) + inter
        self.layer_types = list(self.layer_types[:n])
        if self.mlp_layer_types is None:
            nh = self.num_hash_layers if self.num_hash_layers is not None else 3
            self.mlp_layer_types = ["hash_moe"] * min(n, nh) + ["moe"] * max(0, n - nh)
        self.mlp_layer_types = list(self.mlp_layer_types[:n])
        for name, types, allowed in (
            ("layer_types", self.layer_types, (SLIDING, CSA, HCA)),
            ("mlp_layer_types", self.mlp_layer_types, ("hash_moe", "moe")),
        ):
            if len(types) != n or any(t not in allowed for t in types):
                raise ValueError(f"bad {name}: {types}")
        if self.partial_rotary_factor is None:
            self.partial_rotary_factor = (
                self.qk_rope_head_dim / self.head_dim if self.qk_rope_head_dim is not None else 64 / 512
            )
        self.qk_rope_head_dim = int(self.head_dim * self.partial_rotary_factor)
        rp = self.rope_parameters or self.rope_scaling or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            self.rope_parameters = {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
        else:
            yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            if "type" in yarn and "rope_type" not in yarn:
                yarn["rope_type"] = yarn.pop("type")
            main = {"rope_type": "default", "rope_theta": self.rope_theta}
            compress = {**yarn, "rope_theta": self.compress_rope_theta}
            compress.setdefault("rope_type", "default")
            if compress["rope_type"] == "yarn":
                compress.setdefault("attention_factor", 1.0)  # V4 applies no YaRN mscale
            self.rope_parameters = {"main": main, "compress": compress}
        if self.num_attention_heads * self.head_dim % self.o_groups:
            raise ValueError("num_attention_heads*head_dim must be divisible by o_groups")

    def ratio(self, layer_type: str) -> int:
        return 0 if layer_type == SLIDING else int(self.compress_rates[layer_type])


# ----------------------------------------------------------------------------- caches


class CompressorState:
    """Rolling state of one compressor (the attention's or the indexer's) of one layer.

    buf_kv / buf_gate  [1, m, c*D]  projections of the current, incomplete window
                                    (the first `offset % m` rows are live)
    ov_kv / ov_gate    [1, m, D]    CSA only: the previous window's "Ca" half (gate
                                    includes position_bias); zeros / -inf before any
    rows               [1, cap, D]  emitted compressed rows; the first `n` are live
    """

    # capacity grows in power-of-two buckets (models/cache.py): the compiled decode
    # step is traced once per bucket

    def __init__(self, ratio: int, dim: int, overlap: bool):
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        self.buf_kv = self.buf_gate = self.ov_kv = self.ov_gate = self.rows = None
        self.n = 0

    def init(self, dtype):
        c = 2 if self.overlap else 1
        m, d = self.ratio, self.dim
        self.buf_kv = mx.zeros((1, m, c * d), dtype)
        self.buf_gate = mx.zeros((1, m, c * d), dtype)
        if self.overlap:
            self.ov_kv = mx.zeros((1, m, d), dtype)
            self.ov_gate = mx.full((1, m, d), -mx.inf, dtype)
        self.rows = mx.zeros((1, 0, d), dtype)
        self.n = 0

    def reserve(self, want: int) -> None:
        """Make room for `want` rows (the next bucket, live rows copied)."""
        self.rows = grow_rows(self.rows, self.n, want)

    def append(self, new: mx.array) -> mx.array:
        k = new.shape[1]
        self.reserve(self.n + k)
        self.rows[:, self.n : self.n + k] = new
        self.n += k
        return self.rows[:, : self.n]

    def live_rows(self) -> mx.array:
        return self.rows[:, : self.n]

    def arrays(self, prefix: str) -> dict:
        if self.rows is None:
            return {}
        out = {f"{prefix}buf_kv": self.buf_kv, f"{prefix}buf_gate": self.buf_gate, f"{prefix}rows": self.live_rows()}
        if self.overlap:
            out[f"{prefix}ov_kv"], out[f"{prefix}ov_gate"] = self.ov_kv, self.ov_gate
        return out

    def static_arrays(self) -> list[mx.array]:
        """buf_kv, buf_gate, [ov_kv, ov_gate,] rows: this compressor's part of the step state."""
        ov = [self.ov_kv, self.ov_gate] if self.overlap else []
        return [self.buf_kv, self.buf_gate, *ov, self.rows]

    def take_static(self, arrays) -> None:
        """The inverse of `static_arrays`, from an iterator over a step's new state."""
        self.buf_kv, self.buf_gate = next(arrays), next(arrays)
        if self.overlap:
            self.ov_kv, self.ov_gate = next(arrays), next(arrays)
        self.rows = next(arrays)

    def load(self, prefix: str, arrays: dict, n: int, cap: int):
        if f"{prefix}rows" not in arrays:
            self.buf_kv = self.buf_gate = self.ov_kv = self.ov_gate = self.rows = None
            self.n = 0
            return
        self.buf_kv, self.buf_gate = arrays[f"{prefix}buf_kv"], arrays[f"{prefix}buf_gate"]
        if self.overlap:
            self.ov_kv, self.ov_gate = arrays[f"{prefix}ov_kv"], arrays[f"{prefix}ov_gate"]
        rows = arrays[f"{prefix}rows"]
        if rows.shape[1] != n or cap < n:
            raise ValueError("compressed row count mismatch")
        self.rows = mx.concatenate([rows, mx.zeros((1, cap - n, self.dim), rows.dtype)], axis=1)
        self.n = n


class LayerCache:
    """All state of one DeepSeek V4 layer: sliding K=V ring + compressor states.

    ring [1, 1, W, D]: slot j holds the K=V row of the latest position p with p % W == j.
    """

    def __init__(self, layer_type: str, window: int, head_dim: int, ratio: int, index_head_dim: int):
        self.layer_type, self.window, self.head_dim = layer_type, window, head_dim
        self.offset = 0
        self.ring = None
        self.comp = CompressorState(ratio, head_dim, layer_type == CSA) if ratio else None
        self.index = CompressorState(ratio, index_head_dim, True) if layer_type == CSA else None

    # -- sliding window ---------------------------------------------------------------
    def sliding(self, kv: mx.array) -> tuple[mx.array, mx.array | None]:
        """Store this chunk's K=V rows; return (keys [1,1,L,D], mask [C,L] bool or None)."""
        W, s, C = self.window, self.offset, kv.shape[2]
        if self.ring is None:
            self.ring = mx.zeros((1, 1, W, kv.shape[-1]), kv.dtype)
        if C == 1:
            slot = s % W
            self.ring[:, :, slot : slot + 1] = kv
            mask = None if s >= W - 1 else (mx.arange(W) <= s)[None]
            return self.ring, mask
        keys = mx.concatenate([self.ring, kv], axis=2)
        j = mx.arange(W)
        ring_pos = (s - 1) - ((s - 1 - j) % W)  # position held by ring slot j (< 0: empty)
        pos = mx.concatenate([ring_pos, s + mx.arange(C)])
        t = (s + mx.arange(C))[:, None]
        mask = (pos[None] <= t) & (pos[None] > t - W) & (pos[None] >= 0)
        last = (s + C - 1) - ((s + C - 1 - j) % W)  # newest position per slot after the chunk
        self.ring = mx.take(keys, mx.where(last >= s, W + last - s, j), axis=2)
        return keys, mask

    def sliding_blocks(self, kv: mx.array, block: int) -> tuple[mx.array, mx.array]:
        """Prefill's banded form of `sliding`: store the chunk's K=V rows (the same ring
        update) and return, per block of `block` queries, only the keys its band can
        see: (keys [nb, 1, W + block, D], mask [nb, block, W + block] bool), queries
        padded up to nb * block.  Memory and work grow as C * (W + block), not C * (W + C).

        The keys are in position order: index i of the sequence (ring by position, then
        the chunk) holds position s - W + i, and block b's keys are indices
        b*block .. b*block + W + block - 1; query i of the block sees key j iff
        i < j <= i + W (its window) and the key's position is not negative."""
        W, s, C, D = self.window, self.offset, kv.shape[2], kv.shape[-1]
        if self.ring is None:
            self.ring = mx.zeros((1, 1, W, D), kv.dtype)
        j = mx.arange(W)
        by_pos = mx.take(self.ring, (s - W + j) % W, axis=2)  # slot of position s - W + j
        nb = -(-C // block)
        pad = nb * block - C
        seq = mx.concatenate([by_pos, kv] + ([mx.zeros((1, 1, pad, D), kv.dtype)] if pad else []), axis=2)
        idx = (mx.arange(nb) * block)[:, None] + mx.arange(W + block)[None]  # [nb, W + block]
        keys = mx.take(seq[0, 0], idx.reshape(-1), axis=0).reshape(nb, 1, W + block, D)
        i, k = mx.arange(block)[:, None], mx.arange(W + block)[None]
        band = (k > i) & (k <= i + W)  # [block, W + block]
        live = (s - W + idx) >= 0  # [nb, W + block]
        mask = band[None] & live[:, None, :]
        ring_keys = mx.concatenate([self.ring, kv], axis=2)  # the ring update of `sliding`
        last = (s + C - 1) - ((s + C - 1 - j) % W)  # newest position per slot after the chunk
        self.ring = mx.take(ring_keys, mx.where(last >= s, W + last - s, j), axis=2)
        return keys, mask

    def start(self, dtype) -> None:
        """Create the compressors' buffers at their first use (a chunk or a static step)."""
        for st in (self.comp, self.index):
            if st is not None and st.rows is None:
                st.init(dtype)

    # -- static decode layout (the compiled step, ds4mlx/runtime/stepper.py) ---------------------
    def static_state(self, dtype, ahead: int = 1) -> list[mx.array]:
        """Every array of this layer for one decode step at position `offset`, in a fixed
        order (ring, then per compressor `CompressorState.static_arrays`).  Missing
        buffers are created and the row buffers grown so that the step's row
        (offset // ratio) fits: the step writes it unconditionally.  `ahead`: room for
        that many steps (a chain: `Model.static_forward` of a CHAIN context)."""
        if self.ring is None:
            self.ring = mx.zeros((1, 1, self.window, self.head_dim), dtype)
        out = [self.ring]
        self.start(dtype)
        for st in (self.comp, self.index):
            if st is not None:
                st.reserve((self.offset + ahead - 1) // st.ratio + 1)
                out += st.static_arrays()
        # the step's attention metas, all of them out of one launch (kernels/sparse_attention.py)
        caps = [None if st is None else st.rows.shape[1] for st in (self.comp, self.index)]
        _sparse.expect_step(self.window, caps[0] or 0, caps[1])
        return out

    def static_mark(self) -> tuple:
        """(ring, offset): what tells a session that this cache is still the state a chained
        verify committed (`Session.keep_verified`): every step and commit moves one of them."""
        return self.ring, self.offset

    def commit_static(self, arrays, advance: int = 1) -> None:
        """Take a step's new state (an iterator, same order) and move `advance` positions
        (-1: put back the state from before a step)."""
        self.ring = next(arrays)
        self.offset += advance
        for st in (self.comp, self.index):
            if st is not None:
                st.take_static(arrays)
                st.n = self.offset // st.ratio

    # -- snapshot support --------------------------------------------------------------
    @property
    def state(self) -> dict:
        out = {} if self.ring is None else {"ring": self.ring}
        if self.comp is not None:
            out.update(self.comp.arrays("comp."))
        if self.index is not None:
            out.update(self.index.arrays("index."))
        return out

    @property
    def meta_state(self) -> dict:
        meta = {"type": self.layer_type, "offset": self.offset, "window": self.window}
        for name, st in (("comp", self.comp), ("index", self.index)):
            if st is not None:
                meta[name] = {"n": st.n, "cap": 0 if st.rows is None else st.rows.shape[1], "ratio": st.ratio}
        return meta

    def load(self, meta: dict, arrays: dict):
        if meta.get("type") != self.layer_type or meta.get("window") != self.window:
            raise ValueError("layer cache layout mismatch")
        self.offset = int(meta["offset"])
        self.ring = arrays.get("ring")
        for name, st in (("comp", self.comp), ("index", self.index)):
            if st is not None:
                m = meta[name]
                if m["ratio"] != st.ratio:
                    raise ValueError("compress ratio mismatch")
                st.load(f"{name}.", arrays, int(m["n"]), int(m["cap"]))

    @property
    def nbytes(self) -> int:
        """Allocated bytes (compressed rows counted at their capacity)."""
        total = 0 if self.ring is None else self.ring.nbytes
        for st in (self.comp, self.index):
            if st is not None and st.rows is not None:
                arrays = (st.buf_kv, st.buf_gate, st.rows, st.ov_kv, st.ov_gate)
                total += sum(a.nbytes for a in arrays if a is not None)
        return total


# ----------------------------------------------------------------------------- modules


class GroupedLinear(nn.Module):
    """Block-diagonal projection: group g of x [..., G, in] times weight[g] -> [..., G*out].

    weight [G*out, in] as transformers' `o_a_proj.weight`; `nn.quantize` turns it into
    `QuantizedGroupedLinear` (gather_qmm over the G groups)."""

    def __init__(self, in_per_group: int, out_total: int, groups: int):
        super().__init__()
        self.weight = mx.zeros((out_total, in_per_group))
        self.groups = groups

    def __call__(self, x: mx.array) -> mx.array:
        G = self.groups
        w = self.weight.reshape(G, -1, self.weight.shape[-1])  # [G, out, in]
        lead = x.shape[:-2]
        xg = x.reshape(-1, G, x.shape[-1]).swapaxes(0, 1)  # [G, N, in]
        y = xg @ w.swapaxes(-1, -2)  # [G, N, out]
        return y.swapaxes(0, 1).reshape(*lead, -1)

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_):
        q = QuantizedGroupedLinear(self.groups, group_size, bits, mode)
        w = self.weight.reshape(self.groups, -1, self.weight.shape[-1])
        q.weight, q.scales, *biases = mx.quantize(w, group_size, bits, mode=mode)
        q.biases = biases[0] if biases else None
        q.freeze()
        return q


class QuantizedGroupedLinear(nn.Module):
    def __init__(self, groups: int, group_size=None, bits=None, mode="affine"):
        super().__init__()
        self.groups, self.group_size, self.bits, self.mode = groups, group_size, bits, mode
        self.weight = self.scales = self.biases = None

    def __call__(self, x: mx.array) -> mx.array:
        G = self.groups
        lead = x.shape[:-2]
        n = x.size // (G * x.shape[-1])
        if (
            self.mode == "affine"
            and self.biases is not None
            and n * G <= affine_qmv.MAX_PAIRS
            and affine_qmv.kernel_face(x.shape[-1], self.group_size, self.bits) is not None
        ):
            # decode on a GPU: group g is "expert" g of every token, one launch; x [..., G, in]
            # read as n * G flat rows and the output written in the caller's shape (no view nodes)
            y = affine_qmv.gather_qmv(
                x if x.ndim >= 3 else x.reshape(n, G, x.shape[-1]),
                self.weight,
                self.scales,
                self.biases,
                iota_rows(n, G),  # a kept constant: an arange or a broadcast would be a node per token
                group_size=self.group_size,
                bits=self.bits,
                out_shape=(*lead, G * self.weight.shape[1]),
            )
            return y
        if n > 1:  # prefill: group g's n rows as one matrix (M = n), not n mat-vecs
            xg = x.reshape(n, G, x.shape[-1]).swapaxes(0, 1)  # [G, n, in]
            y = mx.gather_qmm(
                xg,
                self.weight,
                self.scales,
                self.biases,
                rhs_indices=mx.arange(G),
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
            )  # [G, n, out]
            return y.swapaxes(0, 1).reshape(*lead, -1)
        xg = x.reshape(-1, G, 1, x.shape[-1]).swapaxes(0, 1)  # [G, N, 1, in]
        y = mx.gather_qmm(
            xg,
            self.weight,
            self.scales,
            self.biases,
            rhs_indices=mx.arange(G).reshape(G, 1),
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )  # [G, N, 1, out]
        return y.squeeze(2).swapaxes(0, 1).reshape(*lead, -1)


class Compressor(nn.Module):
    """Gated pooling of `m`-token windows into one row (HCA), or of overlapping
    2m-token windows (`overlap=True`, CSA and its indexer): row w pools window w-1's
    "Ca" half with window w's "Cb" half.  Rows are RMS-normed and roped (compress
    rope) at position w*m.  Parameter names as transformers' compressors."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, rope: RoPE):
        super().__init__()
        c = 2 if overlap else 1
        self.kv_proj = nn.Linear(hidden, c * dim, bias=False)
        self.gate_proj = nn.Linear(hidden, c * dim, bias=False)
        self.position_bias = mx.zeros((ratio, c * dim))
        self.kv_norm = RMSNorm(dim, eps)
        self._ratio, self._dim, self._overlap, self._rope = ratio, dim, overlap, rope

    def pool(self, kv: mx.array, gate: mx.array, st: CompressorState, s: int) -> mx.array:
        """Feed a chunk's `kv_proj` / `gate_proj` outputs [1, C, c*d] at positions s..s+C-1 into
        the started state `st`; return all live rows [1, N, dim]."""
        m, d, C = self._ratio, self._dim, kv.shape[1]
        b = s % m
        if b:
            kv = mx.concatenate([st.buf_kv[:, :b], kv], axis=1)
            gate = mx.concatenate([st.buf_gate[:, :b], gate], axis=1)
        n_w = (b + C) // m
        usable, rest = n_w * m, (b + C) % m
        if rest:
            st.buf_kv[:, :rest] = kv[:, usable:]
            st.buf_gate[:, :rest] = gate[:, usable:]
        elif n_w:  # the buffer keeps the window the chunk completed, as the static step leaves it
            st.buf_kv[:, :] = kv[:, usable - m : usable]
            st.buf_gate[:, :] = gate[:, usable - m : usable]
        if n_w == 0:
            return st.live_rows()
        win_kv, win_gate = kv[:, :usable], gate[:, :usable]
        w0 = (s - b) // m
        win_kv = win_kv.reshape(1, n_w, m, -1)
        win_gate = win_gate.reshape(1, n_w, m, -1) + self.position_bias.astype(win_gate.dtype)
        if self._overlap:
            ca_kv, cb_kv = win_kv[..., :d], win_kv[..., d:]
            ca_g, cb_g = win_gate[..., :d], win_gate[..., d:]
            prev_kv = mx.concatenate([st.ov_kv[:, None], ca_kv[:, :-1]], axis=1)
            prev_g = mx.concatenate([st.ov_gate[:, None], ca_g[:, :-1]], axis=1)
            st.ov_kv, st.ov_gate = ca_kv[:, -1], ca_g[:, -1]
            win_kv = mx.concatenate([prev_kv, cb_kv], axis=2)
            win_gate = mx.concatenate([prev_g, cb_g], axis=2)
        w = mx.softmax(win_gate.astype(mx.float32), axis=2, precise=True).astype(win_kv.dtype)
        rows = self.kv_norm((win_kv * w).sum(axis=2))  # [1, n_w, d]
        rows = self._rope(rows, offset=w0, scale=float(m))
        return st.append(rows)

    def pool_step(self, kv: mx.array, gate: mx.array, pos: mx.array, state) -> tuple[list, mx.array, mx.array]:
        """`pool` for one token at position `pos` (an int32 array), branch-free.

        kv / gate [1, 1, c*d] are this token's `kv_proj` / `gate_proj` outputs; `state`
        iterates over `CompressorState.static_arrays()`.  The pooled row of the
        window holding `pos` is written at row pos // m when `pos` completes the window
        (an incomplete window's row is not live: the attention and the indexer read
        complete windows only).  One launch on a GPU (kernels/compressor_step.py), the MLX
        graph on the CPU.  Returns (new state arrays, rows [1, cap, d], valid [cap])."""
        m, arrays = self._ratio, [next(state) for _ in range(5 if self._overlap else 3)]
        new = compressor_step(
            kv, gate, pos, arrays, position_bias=self.position_bias, norm=self.kv_norm, rope=self._rope, ratio=m
        )
        rows = new[-1]
        valid = iota(rows.shape[1]) < (pos + 1) // m  # only the plain attention reads it
        return new, rows, valid

    def step_job(self, kv: mx.array, gate: mx.array, state) -> CompressorJob:
        """`pool_step`'s work for one token as a job of the attention prologue
        (kernels/attn_prologue.py), its state arrays taken from `state`."""
        arrays = [next(state) for _ in range(5 if self._overlap else 3)]
        return CompressorJob(kv, gate, arrays, self.position_bias, self.kv_norm, self._rope, self._ratio)


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, n_heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


class Indexer(Compressor):
    """Lightning indexer: its own overlapping compressor at index_head_dim; scores
    sum_h w_h(x) * ReLU(q_h . k) / sqrt(d * n_heads) in float32."""

    def __init__(self, args: ModelArgs, ratio: int, rope: RoPE):
        d, nh = args.index_head_dim, args.index_n_heads
        super().__init__(args.hidden_size, d, ratio, True, args.rms_norm_eps, rope)
        self.q_b_proj = nn.Linear(args.q_lora_rank, nh * d, bias=False)
        self.scorer = IndexerScorer(args.hidden_size, nh)
        self._nh = nh

    BLOCK_ELEMS = 1 << 26  # queries are scored in blocks of at most this many (query, head, row) floats

    def scores(self, q: mx.array, w: mx.array, keys: mx.array, offset) -> mx.array:
        """Index scores [B, C, N] of C queries at positions offset.. (a host int or an int32
        array) over every row of `keys` [B, N, d]; q = q_b_proj(q_res) [B, C, nh*d], w =
        scorer.weights_proj(x) [B, C, nh].  A prefill chunk's queries in blocks."""
        B, C, _ = q.shape
        q = q.reshape(B, C, self._nh, self._dim).swapaxes(1, 2)
        q = self._rope(q, offset=offset).swapaxes(1, 2).astype(mx.float32)  # [B, C, nh, d]
        kT = keys.astype(mx.float32).swapaxes(-1, -2)[:, None]  # [B, 1, d, N]
        w = w.astype(mx.float32) * (self._nh**-0.5 * self._dim**-0.5)
        w = w[:, :, None, :]  # [B, C, 1, nh]
        step = max(1, self.BLOCK_ELEMS // (self._nh * keys.shape[1]))
        if C <= step:
            return (w @ mx.maximum(q @ kT, 0.0)).squeeze(2)
        out = [(w[:, i : i + step] @ mx.maximum(q[:, i : i + step] @ kT, 0.0)).squeeze(2) for i in range(0, C, step)]
        return mx.concatenate(out, axis=1)  # [B, C, N]


class CompressorBranch(Compressor):
    """The compressed-attention branch of a CSA/HCA layer (transformers' `compressor`)."""

    def __init__(self, args: ModelArgs, layer_type: str, rope: RoPE):
        m, csa = args.ratio(layer_type), layer_type == CSA
        super().__init__(args.hidden_size, args.head_dim, m, csa, args.rms_norm_eps, rope)
        if csa:
            self.indexer = Indexer(args, m, rope)
        self._topk = args.index_topk

    def input_layers(self) -> list[nn.Module]:
        """The projections of the layer input this branch runs per token (in `step`'s order)."""
        out = [self.kv_proj, self.gate_proj]
        if self._overlap:
            ind = self.indexer
            out += [ind.kv_proj, ind.gate_proj, ind.scorer.weights_proj]
        return out

    def forward(self, ctx, proj: list, q_b, state, pos: mx.array | None = None):
        """The branch for the queries of `ctx` (runtime/forward_context.py); `proj` holds their
        outputs of `input_layers()`, `q_b` the indexer's q_b_proj output of q_res (CSA).

        PREFILL: pool the chunk into the live, started `LayerCache` `state` at its offset ->
        the chunk's `ChunkRows` (what each prefill attention form picks from).

        DECODE / CHAIN, as MLX ops (a GPU face runs `step_jobs` inside the attention prologue,
        then `step_pick`): one query row at `pos` over its `view` `state`, the compressors' new
        state put into it -> (rows [1, K, D], valid [K]).  HCA (and CSA while the capacity is
        at most index_topk): every capacity row, masked to the live ones.  CSA above it: the
        top index_topk rows by index score, scores of rows that are not live set to -inf, so
        while fewer than index_topk rows are live all of them are picked (and the padding
        picked with them is masked): the same rows a chunk attends."""
        if ctx.kind == PREFILL:
            s = state.offset
            rows = self.pool(proj[0], proj[1], state.comp, s)
            if self._overlap:
                self.indexer.pool(proj[2], proj[3], state.index, s)
            return ChunkRows(self, rows, proj, q_b, state)
        view = state
        st, rows, valid = self.pool_step(proj[0], proj[1], pos, view)
        view.put(*st)
        if not self._overlap:
            return rows, valid
        ist, keys, _ = self.indexer.pool_step(proj[2], proj[3], pos, view)
        view.put(*ist)
        if rows.shape[1] <= self._topk:
            return rows, valid
        scores = mx.where(valid, self.indexer.scores(q_b, proj[4], keys, pos).reshape(-1), -mx.inf)
        idx = topk_indices(scores, self._topk)
        return mx.take(rows, idx, axis=1), mx.take(valid, idx)

    def step_jobs(self, proj: list, view) -> list:
        """One query row's step of each of the branch's compressors (the attention's, then for
        CSA the indexer's: `step`'s state order), their state arrays read from the row's `view`;
        `proj` as `step`'s (kernels/attn_prologue.py runs them with the attention prologue)."""
        jobs = [self.step_job(proj[0], proj[1], view)]
        if self._overlap:
            jobs.append(self.indexer.step_job(proj[2], proj[3], view))
        return jobs

    def step_pick(self, ctx, news: list, projs: list, index_qs: list) -> list:
        """The one-launch attention's (`sparse_attention.attend_at` / `attend_rows`) rows of
        each query row of `ctx` (runtime/forward_context.py) from its compressors' new states
        news[b] (`step_jobs` order): per row (rows [cap, D], idx [1, k] | None, cnt [1] | None).
        Without idx the kernel masks the capacity rows to the (pos + 1) // ratio live ones
        itself.  CSA above index_topk capacity: the top index_topk live rows by index score;
        while fewer rows are live than index_topk, all of them (rows 0 .. live-1, the same set
        `step` attends).  projs[b] as `step_jobs`'; index_qs[b] the indexer's query already
        roped at the row's position [1, nh, 1, d] (kernels/attn_prep.py).

        A chain's rows score the LAST row's indexer rows: a compressed row once written stays
        as it is, so they hold each earlier row's live rows, and each row's position masks
        the rest (the same top-k as its own)."""
        # (squeeze, not [0]: MLX runs an integer index as a gather, a copy of the buffer per token)
        rows = [st[0][-1].squeeze(0) for st in news]
        out = [(r, None, None) for r in rows]
        if not self._overlap:
            return out
        keys = [news[-1][1][-1]] * len(news) if ctx.kind == CHAIN else [st[1][-1] for st in news]
        picks = [b for b, r in enumerate(rows) if r.shape[0] > self._topk]
        pick = lambda seq: [seq[b] for b in picks]  # noqa: E731
        pos = ctx.row_pos if len(picks) == len(rows) else pick(ctx.row_pos)  # every row: one array's views
        sel = self._index_select(pick(index_qs), pick(projs), pick(keys), pos)
        for b, (idx, cnt) in zip(picks, sel):
            out[b] = (rows[b], idx, cnt)
        return out

    def _index_select(self, index_qs: list, projs: list, keys: list, pos: list) -> list:
        """The indexer's scores + top-k of decode rows (queries roped at pos[b], weights
        projs[b][4], keys[b] [1, cap, d]): one launch for several rows where they can share it
        (`index_topk_rows`), else one per row -> per row (idx [1, k], cnt [1])."""
        ind = self.indexer
        qs = [q.squeeze(0) for q in index_qs]
        ws = [pj[4].squeeze(0) for pj in projs]
        views: dict = {}  # one view per array (a chain's rows share one)
        ks = [views.setdefault(id(k), k.squeeze(0)) for k in keys]
        kw = dict(ratio=self._ratio, scale=ind._nh**-0.5 * ind._dim**-0.5, backend=_sparse.step_face())
        ns = [k.shape[0] for k in ks]
        sel = _sparse.index_topk_rows(qs, ws, ks, self._topk, ns=ns, poss=pos, **kw) if len(qs) > 1 else None
        if sel is None:
            sel = [_sparse.index_topk(q, w, k, self._topk, n=n, s=p, **kw) for q, w, k, n, p in zip(qs, ws, ks, ns, pos)]  # fmt: skip
        return sel


class ChunkRows:
    """A PREFILL chunk's compressed rows after `CompressorBranch.forward` pooled them, and
    each query's pick of them in the form each prefill attention takes (`mask`, `per_query`,
    `kernel`).  `proj` / `q_b` as the branch's; query t of the chunk sees row w iff
    w < (s + t + 1) // ratio."""

    def __init__(self, branch: CompressorBranch, rows: mx.array, proj: list, q_b, cache: LayerCache):
        self.branch, self.rows, self.proj, self.q_b, self.cache = branch, rows, proj, q_b, cache
        self.s = cache.offset

    def _causal(self) -> mx.array:
        N, C = self.rows.shape[1], self.proj[0].shape[1]
        return mx.arange(N)[None] < ((self.s + mx.arange(C)) + 1)[:, None] // self.branch._ratio  # [C, N]

    def _scores(self) -> mx.array:
        """The indexer's scores [1, C, N] over its live rows."""
        ind = self.branch.indexer
        return ind.scores(self.q_b, self.proj[4], self.cache.index.live_rows(), self.s)

    def _picks(self) -> bool:
        return self.branch._overlap and self.rows.shape[1] > self.branch._topk

    def mask(self):
        """(rows [1, 1, N, D], mask [C, N] bool), the indexer's top-k a mask over all rows; or
        (None, None) when no row exists yet."""
        if self.rows.shape[1] == 0:
            return None, None
        causal = self._causal()
        if self._picks():
            masked = mx.where(causal[None], self._scores(), -mx.inf)
            idx = topk_indices(masked, self.branch._topk)
            chosen = mx.put_along_axis(mx.zeros(masked.shape, mx.bool_), idx, mx.array(True), axis=-1)
            return self.rows[:, None], chosen[0] & causal
        return self.rows[:, None], causal

    def per_query(self):
        """`mask`, with CSA above index_topk rows returning each query's chosen rows rather
        than a mask over all of them: (rows [1, 1, N, D], causal mask [C, N], False), or (rows
        [C, k, D], valid [C, k], True) for CSA with N > index_topk (valid: the chosen row is
        causal; the same top-k as `mask`), or (None, None, False) when no row exists yet."""
        rows, N, C, k = self.rows, self.rows.shape[1], self.proj[0].shape[1], self.branch._topk
        if N == 0:
            return None, None, False
        causal = self._causal()
        if self._picks():
            idx = topk_indices(mx.where(causal[None], self._scores(), -mx.inf), k)[0]  # [C, k]
            chosen = mx.take(rows[0], idx.reshape(-1), axis=0).reshape(C, k, rows.shape[-1])
            return chosen, mx.take_along_axis(causal, idx, axis=1), True
        return rows[:, None], causal, False

    def kernel(self, face: str):
        """The fused path's pick: for CSA with more rows than index_topk, the indexer's scores
        and each query's top-k (kernels/sparse_attention.py).  Returns (n live rows, idx [C, k]
        | None, cnt [C] | None)."""
        n, b = self.rows.shape[1], self.branch
        if not self._picks():
            return n, None, None
        ind, s = b.indexer, self.s
        B, C, _ = self.q_b.shape
        q = self.q_b.reshape(B, C, ind._nh, ind._dim).swapaxes(1, 2)
        q = ind._rope(q, offset=s)  # [1, nh, C, d]
        scale = ind._nh**-0.5 * ind._dim**-0.5
        scores = _sparse.index_scores(
            q[0], self.proj[4][0], self.cache.index.rows, n=n, s=s, ratio=b._ratio, scale=scale, backend=face
        )
        idx, cnt = _sparse.topk_select(scores, b._topk, s=s, ratio=b._ratio, backend=face)
        return n, idx, cnt


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, ropes: dict):
        super().__init__()
        self.layer_type = args.layer_types[layer_idx]
        nh, D = args.num_attention_heads, args.head_dim
        self.q_a_proj = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.q_b_proj = nn.Linear(args.q_lora_rank, nh * D, bias=False)
        self.kv_proj = nn.Linear(args.hidden_size, D, bias=False)
        self.kv_norm = RMSNorm(D, args.rms_norm_eps)
        self.o_a_proj = GroupedLinear(nh * D // args.o_groups, args.o_groups * args.o_lora_rank, args.o_groups)
        self.o_b_proj = nn.Linear(args.o_groups * args.o_lora_rank, args.hidden_size, bias=False)
        self.sinks = mx.zeros((nh,))
        rope = ropes["main" if self.layer_type == SLIDING else "compress"]
        if self.layer_type != SLIDING:
            self.compressor = CompressorBranch(args, self.layer_type, rope)
        self._nh, self._D, self._eps, self._rope = nh, D, args.rms_norm_eps, rope
        self._groups = args.o_groups

    def _chunk(self, ctx, q_b, kv, more, index_q_b, cache: LayerCache) -> mx.array:
        """A PREFILL chunk's attention (its projections [B, C, ...]) at the host position
        cache.offset over the live `cache` (the ring and compressors advanced; the offset left
        to the model) -> [B, nh, C, D] before the inverse rope."""
        B, C, _ = kv.shape
        s = cache.offset
        q, kv = self._query_key(q_b, kv, s)
        picks = None
        if self.layer_type != SLIDING:
            picks = self.compressor.forward(ctx, more, index_q_b, cache)
        face = _sparse.model_face() if self.layer_type != SLIDING and B == 1 else None
        block = max(cache.window, self.PREFILL_BLOCK)
        if face is None and B == 1 and C > block:  # prefill: the window as a band, query block by block
            return self._banded(q, kv, picks, cache, block)
        keys, mask = cache.sliding(kv)
        if face is not None:  # custom kernels: indexer, top-k and attention (kernels/sparse_attention.py)
            n, idx, cnt = picks.kernel(face)
            return _sparse.sparse_attention(
                q[0],
                keys[0, 0],
                cache.comp.rows,
                idx,
                cnt,
                self.sinks.astype(q.dtype),
                n=n,
                s=s,
                ring_last=s if C == 1 else s - 1,
                window=cache.window,
                ratio=self.compressor._ratio,
                scale=self._D**-0.5,
                backend=face,
            )[None]
        if picks is not None:
            rows, cmask = picks.mask()
            if rows is not None:
                if mask is not None or cmask is not None:
                    Lk, Lc = keys.shape[2], rows.shape[2]
                    mask = mx.ones((C, Lk), mx.bool_) if mask is None else mx.broadcast_to(mask, (C, Lk))
                    cmask = mx.ones((C, Lc), mx.bool_) if cmask is None else cmask
                    mask = mx.concatenate([mask, cmask], axis=1)
                keys = mx.concatenate([keys, rows.astype(keys.dtype)], axis=2)
        return mx.fast.scaled_dot_product_attention(
            q, keys, keys, scale=self._D**-0.5, mask=mask, sinks=self.sinks.astype(q.dtype)
        )

    def _query_key(self, q_b, kv, offset):
        """The queries [B, nh, C, D] and K=V rows [B, 1, C, D] of the q_b_proj / kv_proj outputs
        [B, C, ...] at positions offset.. (a host int or an int32 array): per-head RMS-normed
        queries and the kv-normed rows, both roped."""
        B, C, _ = kv.shape
        q = q_b.reshape(B, C, self._nh, self._D).swapaxes(1, 2)
        q = self._rope(rms_norm(q, None, self._eps), offset=offset)
        return q, self._rope(self.kv_norm(kv)[:, None], offset=offset)

    # prefill queries per attention block (at least the window): each block attends
    # its band of W + block sliding keys plus the compressed rows
    PREFILL_BLOCK = 128

    def _banded(self, q, kv, picks: ChunkRows | None, cache: LayerCache, block: int) -> mx.array:
        """Prefill attention of a chunk (q [1, nh, C, D]) in blocks of `block` queries
        (`LayerCache.sliding_blocks`), the compressed rows and their [C, N] mask (the
        indexer's top-k for CSA) shared by every block; -> [1, nh, C, D]."""
        C = q.shape[2]
        rows, cmask, per_query = (None, None, False) if picks is None else picks.per_query()
        if per_query:  # CSA above index_topk: each query's own W window keys + k chosen rows
            return self._per_query(q, kv, cache, rows, cmask)
        keys, mask = cache.sliding_blocks(kv, block)  # [nb, 1, W+block, D], [nb, block, W+block]
        nb = keys.shape[0]
        pad = nb * block - C
        if self.layer_type != SLIDING:
            if rows is not None:
                N = rows.shape[2]
                cmask = mx.ones((C, N), mx.bool_) if cmask is None else mx.broadcast_to(cmask, (C, N))
                if pad:
                    cmask = mx.concatenate([cmask, mx.zeros((pad, N), mx.bool_)], axis=0)
                rows = mx.broadcast_to(rows.astype(keys.dtype), (nb, 1, N, keys.shape[-1]))
                keys = mx.concatenate([keys, rows], axis=2)
                mask = mx.concatenate([mask, cmask.reshape(nb, block, N)], axis=2)
        nh, D = q.shape[1], q.shape[3]
        if pad:
            q = mx.concatenate([q, mx.zeros((1, nh, pad, D), q.dtype)], axis=2)
        qb = q.reshape(nh, nb, block, D).swapaxes(0, 1)  # [nb, nh, block, D]
        out = prefill_attention.sdpa(
            qb, keys, keys, scale=self._D**-0.5, mask=mask[:, None], sinks=self.sinks.astype(q.dtype)
        )
        return out.swapaxes(0, 1).reshape(1, nh, nb * block, D)[:, :, :C]

    GATHER_ELEMS = 1 << 28  # per-query keys gathered at once (queries x (W + k) x D values)

    def _per_query(self, q, kv, cache: LayerCache, chosen, valid) -> mx.array:
        """Prefill attention where every query has its own keys: the W sliding keys of its
        window (by position; not-yet-written positions masked) and its k chosen
        compressed rows (chosen [C, k, D], valid [C, k]).  Queries in groups of at most
        GATHER_ELEMS gathered values; -> [1, nh, C, D]."""
        W, s, C, D = cache.window, cache.offset, kv.shape[2], kv.shape[-1]
        j = mx.arange(W)
        by_pos = mx.take(cache.ring, (s - W + j) % W, axis=2) if cache.ring is not None else None
        seq = kv[0, 0] if by_pos is None else mx.concatenate([by_pos, kv], axis=2)[0, 0]  # [W + C, D]
        off = 0 if by_pos is None else W  # seq index of chunk position 0
        cache.sliding(kv)  # the ring update (its dense mask is not used)
        k = chosen.shape[1]
        step = max(1, self.GATHER_ELEMS // ((W + k) * D))
        outs = []
        for t0 in range(0, C, step):
            t = mx.arange(t0, min(C, t0 + step))
            pos = t[:, None] - (W - 1) + j[None]  # [n, W] chunk positions of the window's keys
            keys = mx.take(seq, (pos + off).reshape(-1) if off else mx.maximum(pos, 0).reshape(-1), axis=0)
            keys = mx.concatenate([keys.reshape(-1, W, D), chosen[t0 : t0 + step].astype(keys.dtype)], axis=1)
            live = (s + pos) >= 0
            mask = mx.concatenate([live, valid[t0 : t0 + step]], axis=1)[:, None, None, :]  # [n, 1, 1, W + k]
            qt = q[0, :, t0 : t0 + step].swapaxes(0, 1)[:, :, None, :]  # [n, nh, 1, D]
            o = prefill_attention.sdpa(
                qt, keys[:, None], keys[:, None], scale=self._D**-0.5, mask=mask, sinks=self.sinks.astype(q.dtype)
            )  # [n, nh, 1, D]
            outs.append(o[:, :, 0].swapaxes(0, 1))  # [nh, n, D]
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
        return out[None]

    def forward(self, x: mx.array, ctx, cache: LayerCache | None = None, project: bool = True) -> mx.array:
        """The attention of the query rows of `ctx` (runtime/forward_context.py; x [1, T, H]) ->
        [1, T, H].  The projections run once for all rows (`_inputs`), the indexer's too.

        PREFILL: one chunk at the host position cache.offset over the live `cache` (`_chunk`).
        DECODE / CHAIN: row b at ctx.row_pos[b] over ctx.views[b], branch-free in the
        positions; each row's new state arrays are put into its view.  On a GPU each row's
        attention is one launch after its prologue, the rows' in one launch where they can
        share it (session batching, docs/kv-cache.md §11); MLX ops elsewhere (`_row`).
        `project=False`: the output before o_b_proj (the caller runs o_b inside the next mHC
        site's launch)."""
        q_b, index_q_b, kv, more = self._inputs(x, ctx.kind)
        if ctx.kind == PREFILL:
            cache.start(x.dtype)  # the compressors' buffers, at the first chunk
            out = self._chunk(ctx, q_b, kv, more, index_q_b, cache)
            return self._output(out, cache.offset, *x.shape[:2], project)
        B = ctx.rows
        face = _sparse.step_face()
        if face is None:  # MLX ops (the CPU, `DS4MLX_SPARSE_ATTENTION=0`), row by row
            outs = [
                self._row(ctx, *_step_row(b, B, q_b, kv, more, index_q_b), p, view)
                for b, (p, view) in enumerate(zip(ctx.row_pos, ctx.views))
            ]
        else:  # a GPU: attn_prologue then attend_at per row, attend_rows for several
            preps = self._step_prep(face, ctx, q_b, kv, more, index_q_b)
            # window + compressed rows + sinks, and the output's inverse rope, in one launch;
            # q [1, nh, 1, D], ring [1, 1, W, D]: read flat, no view nodes -> [rows, nh, 1, D]
            kw = dict(ratio=self._step_ratio(), scale=self._D**-0.5, out_rope=self._rope)
            # several rows: one launch where they can share it (each row's inputs its own: a
            # chained row reads the ring and rows the rows before it wrote), else one per row
            columns = [list(a) for a in zip(*preps)]  # qs, rings, rows, idxs, cnts
            shared = _sparse.attend_rows(*columns, self.sinks, ctx.row_pos, **kw) if B > 1 else None
            if shared is not None:
                outs = [shared]
            else:
                outs = [_sparse.attend_at(*pr, self.sinks, p, backend=face, **kw) for pr, p in zip(preps, ctx.row_pos)]
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs)  # [B, nh, 1, D]
        return self._output(out, None, 1, B, project)

    def _inputs(self, x: mx.array, kind: str):
        """The projections of x [1, T, H]: (q_b, the indexer's q_b (CSA) or None, kv, the
        compressors' inputs `CompressorBranch.input_layers()`).  A PREFILL chunk's layer by
        layer (matmuls); a static forward's fused where their formats allow (models/fused.py),
        the q_a norm inside q_b's mat-vec on a GPU face (affine_qmv's NORM)."""
        comp = self.compressor if self.layer_type != SLIDING else None
        if kind == PREFILL:
            q_res = self.q_a_norm(self.q_a_proj(x))
            index_q_b = comp.indexer.q_b_proj(q_res) if comp is not None and comp._overlap else None
            more = [] if comp is None else [m(x) for m in comp.input_layers()]
            return self.q_b_proj(q_res), index_q_b, self.kv_proj(x), more
        if getattr(self, "_step_proj", None) is None:  # built once, outside the module tree
            more = [] if comp is None else comp.input_layers()
            self._step_proj = fused_or_each([self.q_a_proj, self.kv_proj, *more])
            index = [comp.indexer.q_b_proj] if comp is not None and comp._overlap else []
            self._step_q_b = fused_or_each([self.q_b_proj, *index])  # CSA: the indexer's query too
        q_a, kv, *more = self._step_proj(x)
        q_b, *index_q_b = self._step_q_b(q_a, norm=(self.q_a_norm.weight, self.q_a_norm.eps))
        return q_b, (index_q_b[0] if index_q_b else None), kv, more

    def _step_ratio(self) -> int:
        return self.compressor._ratio if self.layer_type != SLIDING else 1

    def _step_prep(self, face, ctx, q_b, kv, more, index_q_b) -> list:
        """The GPU step's half before the attention, per query row of `ctx`: (q [1, nh, 1, D],
        the ring with the row's token, the compressed rows, idx, cnt) for `attend_at`; each
        row's new state put into its view.  A row's prologue (query / K=V norms and ropes, the
        ring write, the indexer query's rope: attn_prep) and the layer's compressor steps run
        as one launch (kernels/attn_prologue.py; the indexer shares the layer's compress rope:
        CompressorBranch passes it on).  Independent rows (DECODE, B > 1) share that launch
        where they can (`attn_prologue_rows`), a chain's rows too, each over the state the row
        before it left (`attn_prologue_chain`); one row: one launch.  Then the indexer's top-k
        (`CompressorBranch.step_pick`)."""
        csa = self.layer_type != SLIDING and self.compressor._overlap
        kw = dict(heads=self._nh, index_heads=self.compressor.indexer._nh if csa else 0)
        kw["backend"] = "reference" if face == "reference" else None
        comp = self.compressor if self.layer_type != SLIDING else None
        B, views = ctx.rows, ctx.views
        w, rope, eps = self.kv_norm.weight, self._rope, self._eps
        per_row = [_step_row(b, B, q_b, kv, more, index_q_b if csa else None) for b in range(B)]
        if ctx.kind == DECODE and B > 1:
            rings = [next(v) for v in views]
            jobs = [[] if comp is None else comp.step_jobs(r[2], v) for r, v in zip(per_row, views)]
            iq = index_q_b if csa else None
            heads = attn_prologue_rows(q_b, kv, w, rings, ctx.pos, rope, eps, iq, jobs, **kw)
            for v, (_, ring, _, sts) in zip(views, heads):
                v.put(ring, *[a for st in sts for a in st])
        elif ctx.kind == CHAIN and B > 1:  # one session's chained rows: one launch where it can
            iq = index_q_b if csa else None
            ring, jobs = next(views[0]), [] if comp is None else comp.step_jobs(more, views[0])
            heads = attn_prologue_chain(q_b, kv, w, ring, ctx.pos, rope, eps, iq, jobs, **kw)
            for t, (v, (_, ring, _, sts)) in enumerate(zip(views, heads)):
                if t:  # row t reads what row t - 1 put: the launch's state after row t - 1 already
                    next(v)
                    if comp is not None:
                        comp.step_jobs(more, v)
                v.put(ring, *[a for st in sts for a in st])
        else:
            heads = []
            for (q_r, kv_r, proj, iq), p, v in zip(per_row, ctx.row_pos, views):
                ring = next(v)
                jobs = [] if comp is None else comp.step_jobs(proj, v)
                head = attn_prologue(q_r, kv_r, w, ring, p, rope, eps, iq, jobs, **kw)
                v.put(head[1], *[a for st in head[3] for a in st])  # before the next row reads it
                heads.append(head)
        if comp is None:
            return [(q, ring, None, None, None) for q, ring, _, _ in heads]
        sel = comp.step_pick(ctx, [h[3] for h in heads], [r[2] for r in per_row], [h[2] for h in heads])
        return [(q, ring, *rest) for (q, ring, _, _), rest in zip(heads, sel)]

    def _row(self, ctx, q_b, kv, more, index_q_b, pos, view) -> mx.array:
        """One static query row's attention as MLX ops (the CPU, `DS4MLX_SPARSE_ATTENTION=0`):
        its query and key at `pos`, its ring and compressors' state read from and the new
        state put into its `view` -> [1, nh, 1, D] after the inverse rope."""
        comp = self.compressor if self.layer_type != SLIDING else None
        ring = next(view)
        q, kv = self._query_key(q_b, kv, pos)  # [1, nh, 1, D], [1, 1, 1, D]
        W = ring.shape[2]
        ring = mx.slice_update(ring, kv.astype(ring.dtype), (pos % W).reshape(1), axes=(2,))
        view.put(ring)
        keys, mask = ring, iota(W) <= pos  # slots not written yet are masked
        if comp is not None:
            rows, valid = comp.forward(ctx, more, index_q_b, view, pos)
            keys = mx.concatenate([keys, rows[:, None].astype(keys.dtype)], axis=2)
            mask = mx.concatenate([mask, valid])
        out = mx.fast.scaled_dot_product_attention(
            q, keys, keys, scale=self._D**-0.5, mask=mask[None], sinks=self.sinks.astype(q.dtype)
        )
        return self._rope(out, offset=pos, scale=-1.0)

    def _output(self, out: mx.array, s: int | None, B: int, C: int, project: bool = True) -> mx.array:
        """The output projections of the attention output [B, nh, C, D], after its inverse rope
        at positions s..; s None: the static forward's C query rows (B = 1), each [nh, 1, D]
        with its inverse rope applied already, stacked as out [C, nh, 1, D].  `project=False`:
        o_a_proj's output alone."""
        if s is not None:
            out = self._rope(out, offset=s, scale=-1.0)
        # [B, C, nh, D]; one query, or the step's rows: a reshape, since moving a length-1 axis keeps
        # the memory order (MLX copies a transposed array it reshapes: one copy kernel per layer and token)
        out = out if C == 1 or s is None else out.swapaxes(1, 2)
        out = self.o_a_proj(out.reshape(B, C, self._groups, -1))  # one reshape node, not two
        return self.o_b_proj(out) if project else out


def _step_row(b: int, B: int, q_b, kv, more: list, index_q_b) -> tuple:
    """Query row b's slices of a static forward's projections (each [1, B, ...]): (q_b, kv,
    the compressors' inputs, the indexer's q_b or None); one row's are the arrays themselves."""
    if B == 1:
        return q_b, kv, more, index_q_b
    r = slice(b, b + 1)
    return q_b[:, r], kv[:, r], [m[:, r] for m in more], None if index_q_b is None else index_q_b[:, r]


class Router(nn.Module):
    def __init__(self, args: ModelArgs, hashed: bool):
        super().__init__()
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        if hashed:
            self.tid2eid = mx.zeros((args.vocab_size, args.num_experts_per_tok), mx.int32)
        else:
            self.e_score_correction_bias = mx.zeros((args.n_routed_experts,))
        self._hashed = hashed
        self._k, self._kind, self._scale = args.num_experts_per_tok, args.scoring_func, args.routed_scaling_factor

    def __call__(self, x: mx.array, ids: mx.array) -> tuple[mx.array, mx.array]:
        """(indices [..., k], weights [..., k] f32)."""
        scores = score_fn(x @ self.weight.T.astype(x.dtype), self._kind)
        if self._hashed:
            idx = self.tid2eid[ids]
        else:
            idx = topk_indices(scores + self.e_score_correction_bias.astype(mx.float32), self._k)
        # transformers always renormalises the chosen weights (norm_topk_prob is not read).
        return idx, route_weights(scores, idx, True, self._scale)

    def step(self, x: mx.array, ids: mx.array) -> tuple[mx.array, mx.array]:
        """`__call__` for the static decode step: on a GPU face, for decode-sized rows, the
        whole router (mat-vec, score, top-k or hash lookup, weights) as one launch
        (kernels/moe_route.py; its k slots in descending score order: consumers are
        order-free).  Elsewhere, and on the CPU, exactly `__call__`."""
        face = moe_route.decode_face(x.size // x.shape[-1])
        if face is None:
            return self(x, ids)
        sel = dict(table=self.tid2eid, ids=ids) if self._hashed else dict(bias=self.e_score_correction_bias)
        return moe_route.router(x, self.weight, k=self._k, score=self._kind, scaling=self._scale, normalize=True, **sel)

    def site_router(self, ids: mx.array) -> SiteRouter:
        """`step`'s routing as the mHC site before it may run it (kernels/qmv_hc_route.py)."""
        sel = dict(table=self.tid2eid, ids=ids) if self._hashed else dict(bias=self.e_score_correction_bias)
        return SiteRouter(self.weight, self._k, self._kind, self._scale, **sel)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.gate = Router(args, args.mlp_layer_types[layer_idx] == "hash_moe")
        self.experts = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts, args.swiglu_limit)
        self.shared_experts = GLUMLP(args.hidden_size, args.moe_intermediate_size, args.swiglu_limit)

    def __call__(self, x: mx.array, ids: mx.array) -> mx.array:
        idx, w = self.gate(x, ids)
        y = self.experts.fused_weighted(x, idx, w)  # GPU decode: two launches
        if y is None:
            y = self.experts(x, idx)  # [..., k, H]
            y = (y * w[..., None].astype(y.dtype)).sum(axis=-2)
        return y + self.shared_experts(x)

    def step(self, x: mx.array, ids: mx.array) -> mx.array:
        """`__call__` for the static decode step: the shared expert's gate and up
        projections as one mat-vec where their formats allow (models/fused.py)."""
        routed, shared = self._step_halves(x, ids)
        return routed if shared is None else routed + shared

    def step_pair(self, x: mx.array, ids: mx.array) -> tuple[mx.array, mx.array | None]:
        """`step`'s two halves (routed, shared), for the caller to add inside its next launch
        (hc_post's `out2`); (the sum, None) where the MoE's launches summed them already.  A
        subclass that changes `step` returns (step(x, ids), None)."""
        return self._step_halves(x, ids)

    def _step_halves(self, x: mx.array, ids: mx.array, defer: bool = False, route=None) -> tuple[Any, mx.array | None]:
        se = self.shared_experts
        if getattr(self, "_step_shared", None) is None:  # built once, outside the module tree
            self._step_gate_up = FusedLinear.of([se.gate_proj, se.up_proj])
            self._step_shared = swiglu_of(se.gate_proj, se.up_proj)
        idx, w = route if route is not None else self.gate.step(x, ids)  # `route`: the site's launch ran it
        # GPU decode, affine weights: routed and shared expert in two launches (affine_qmv MODE 3 / 4)
        y = self.experts.fused_weighted_shared(x, idx, w, self._step_gate_up, se.down_proj, se.limit, defer=defer)
        if y is not None:
            return y, None
        y = self.experts.fused_weighted(x, idx, w)  # GPU decode: two launches
        if y is None:
            y = self.experts(x, idx)  # [..., k, H]
            y = (y * w[..., None].astype(y.dtype)).sum(axis=-2)
        return y, se.down_proj(self._step_shared(x, se.limit))


def finish_open_step(x: mx.array, pending) -> mx.array:
    """The last hc_post of a `DecoderLayer.forward` result (streams, pending)."""
    out, post, comb, out2 = pending
    if isinstance(out, DownSumShared):  # an MoE output left for the next site: launched alone
        out = out.value()
    return hc_post(x, out, post, comb, out2=out2)


def _moe_halves(mlp, x: mx.array, ids: mx.array, defer: bool, route=None):
    """``mlp.step_pair(x, ids)``; `defer`: `MoE`'s own leaves its last launch (MODE 4, the down
    projections) to the next mHC site, which runs it inside its own (kernels/qmv_hc.py), as a
    `DownSumShared` where the weights allow; a subclass's step_pair (distributed/) runs as written.
    `route`: (idx, weights) the site's launch computed (`_site_router`), or None."""
    if (defer or route is not None) and type(mlp).step_pair is MoE.step_pair:
        return mlp._step_halves(x, ids, defer=defer, route=route)
    return mlp.step_pair(x, ids)


def _site_router(mlp, ids: mx.array) -> SiteRouter | None:
    """The router `MoE`'s own step would run, for the mHC site before it to run inside its launch
    (kernels/qmv_hc_route.py); None for a subclass's step (distributed/)."""
    if type(mlp).step_pair is MoE.step_pair and type(mlp.gate).step is Router.step:
        return mlp.gate.site_router(ids)
    return None


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, ropes: dict):
        super().__init__()
        self.self_attn = Attention(args, layer_idx, ropes)
        self.mlp = MoE(args, layer_idx)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        hc = (args.hc_mult, args.hidden_size, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def __call__(self, x: mx.array, ids: mx.array, cache: LayerCache) -> mx.array:
        """The layer over a chunk x [1, C, hc, H] at the cache's position, finished (the MTP
        head's block, a pipeline stage)."""
        return finish_open_step(*self.forward(x, None, ids, StepContext.prefill(cache.offset, [cache]), cache))

    def forward(self, x: mx.array, pending, ids: mx.array, ctx, cache: LayerCache | None = None):
        """The layer over the query rows of `ctx` (runtime/forward_context.py), laid out as
        tokens of one row (x [1, T, hc, H]: the mHC and MoE kernels take them as rows),
        without its last hc_post: -> (streams, pending = (out, post, comb, out2)) for the
        caller to finish (`finish_open_step`) or to hand to the next layer as its `pending`,
        whose attention site then runs that hc_post fused with its own projection (one launch
        less per layer on a GPU).  The layer norms are folded into the hc launches.

        The kind picks the attention and the MoE: PREFILL a chunk over the live `cache`
        (host positions; the MoE's prefill matmuls), DECODE / CHAIN the static step over the
        rows' views (the MoE's routed and shared halves added inside the launch that consumes
        them: `out2`).  Steering edits both sites' outputs on every kind."""
        if pending is None:
            post, comb, normed = self.attn_hc(x, norm=self.input_layernorm)
        else:
            out, p, c, out2 = pending
            x, post, comb, normed = self.attn_hc.after_post(x, out, p, c, norm=self.input_layernorm, out2=out2)
        # o_b inside the next site's launch (kernels/qmv_hc.py), where the output is o_b's alone (no
        # steering; not a tensor-parallel attention, whose partial sums meet after o_b)
        if ctx.kind != PREFILL and not steered(self) and type(self.self_attn)._output is Attention._output:
            o_a = self.self_attn.forward(normed, ctx, project=False)
            # the MoE's router inside that launch too, where it takes it (kernels/qmv_hc_route.py)
            router = _site_router(self.mlp, ids)
            x, post, comb, normed, *route = self.ffn_hc.after_linear_post(
                x, self.self_attn.o_b_proj, o_a, post, comb, norm=self.post_attention_layernorm, router=router
            )
            route = route[0] if route else None
        else:
            route = None
            attn = self.self_attn.forward(normed, ctx, cache)
            x, post, comb, normed = self.ffn_hc.after_post(
                x, steer(self, ATTN, attn), post, comb, norm=self.post_attention_layernorm
            )
        if ctx.kind == PREFILL:
            routed, shared = self.mlp(normed, ids), None
        else:
            routed, shared = _moe_halves(self.mlp, normed, ids, defer=not steered(self), route=route)
        if shared is not None and steered(self):
            routed, shared = routed + shared, None  # the edit sees the whole FFN output
        return x, (steer(self, FFN, routed), post, comb, shared)


class DeepseekV4Model(ActivationDtype, nn.Module):
    # called with (the residual streams after the last layer [1, T, hc, H], their first
    # position) by every multi-token forward (prefill, speculative verify); None = off
    stream_hook = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        rd = args.qk_rope_head_dim
        self._ropes = {
            name: RoPE(
                rd,
                inv_freq_from_params(rd, args.rope_parameters[name], args.max_position_embeddings),
                attention_factor_from_params(args.rope_parameters[name], args.max_position_embeddings),
            )
            for name in ("main", "compress")
        }
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i, self._ropes) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hc_head = HyperHead(args.hc_mult, args.hidden_size, args.hc_eps, args.rms_norm_eps)
        self._hc = args.hc_mult

    def ropes(self) -> dict:
        """The "main" and "compress" RoPE tables the layers share (distributed/ rebuilds layers)."""
        return self._ropes

    def __call__(self, ids: mx.array, cache: list[LayerCache]) -> mx.array:
        """A prefill chunk ids [1, T] after the state in `cache` -> the final hidden [1, T, H]."""
        return self.forward(ids, StepContext.prefill(cache[0].offset if cache else 0, cache))[0]

    def forward(self, ids: mx.array, ctx, final_norm: bool = True) -> tuple[mx.array, mx.array]:
        """The forward of tokens ids [1, T] over `ctx` (runtime/forward_context.py: a PREFILL
        chunk of one session, T independent sessions' tokens, or one session's next T as a
        chain) -> (hidden [1, T, H], the residual streams after the last layer [1, T, hc, H]).
        PREFILL advances the caches and calls `stream_hook`; the static kinds leave the rows'
        new states in their views.  `final_norm=False`: the hidden state before the final
        norm (the caller folds it into the head)."""
        h = self.embed(ids)
        x = mx.broadcast_to(h[:, :, None, :], (1, ids.shape[1], self._hc, h.shape[-1]))
        caches = ctx.views[0] if ctx.kind == PREFILL else [None] * len(self.layers)
        pending = None
        for layer, c in zip(self.layers, caches):  # each layer's last hc_post runs inside the next one's first launch
            x, pending = layer.forward(x, pending, ids, ctx, c)
        if pending is not None:
            x = finish_open_step(x, pending)
        if ctx.kind == PREFILL:
            if self.stream_hook is not None:  # the MTP head drafts from these (speculative/mtp.py)
                self.stream_hook(x, ctx.row_pos[0])
            for c in caches:
                c.offset += ids.shape[1]
        h = self.hc_head(x)
        return (self.norm(h) if final_norm else h), x


class Model(ContextForward, StaticForward, CausalLM):
    """DeepseekV4ForCausalLM: `model(ids [1, T], cache) -> logits [1, T, V]`."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, DeepseekV4Model(args))

    def make_cache(self) -> list[LayerCache]:
        a = self.args
        return [LayerCache(t, a.sliding_window, a.head_dim, a.ratio(t), a.index_head_dim) for t in a.layer_types]

    # -- the static forward (ds4mlx/runtime/stepper.py drives it; models/cache.StaticForward) --
    static_rows_chain = True  # static_forward of a CHAIN context: stepper.step_chain
    static_steers = True  # steering edits the static forward too (the stepper runs it eagerly)

    def forward(self, ids: mx.array, ctx, last_only: bool = False):
        """The one forward of ids [1, T] over `ctx` (runtime/forward_context.py `StepContext`).
        PREFILL (a chunk over the live caches, advanced) -> logits [1, T, V] (`last_only`: the
        last token's, [1, 1, V]).  DECODE / CHAIN (pure: T sessions' next tokens, or one
        session's next T as a chain) -> (logits [T, V], the rows' new states[, the residual
        streams [1, T, hc, H] where ctx.streams: the MTP head's input])."""
        if ctx.kind == PREFILL:
            h = self.model.forward(ids, ctx)[0]
            return self.head(h[:, -1:] if last_only else h)
        fold = self.head_folds_norm()
        h, streams = self.model.forward(ids, ctx, final_norm=not fold)
        # (views: an integer index would launch a gather)
        logits = (self.normed_head(h) if fold else self.head(h)).squeeze(0)
        news = [v.new for v in ctx.views]
        return (logits, news, streams) if ctx.streams else (logits, news)

    def head_folds_norm(self) -> bool:
        """Whether the static step runs the final norm inside the head's launch (`normed_head`):
        a quantized lm_head (`QMVLinear`, affine_qmv's NORM on a GPU face)."""
        return not self.args.tie_word_embeddings and hasattr(getattr(self, "lm_head", None), "normed")

    def normed_head(self, h: mx.array) -> mx.array:
        """``self.head(self.model.norm(h))`` with the norm inside the head's mat-vec on a GPU
        face (one launch per token less; the same expression on the CPU)."""
        norm = self.model.norm
        return self.lm_head.normed(h, (norm.weight, norm.eps))

    def sanitize(self, weights: dict) -> dict:
        """Map transformers' in-memory state-dict names onto this module's parameters."""
        out = {}
        for k, v in weights.items():
            if k.startswith("mtp.") or ".mtp." in k or "rotary_emb" in k:
                continue
            if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
                k = k + ".weight"
            elif k.endswith("mlp.gate.tid2eid"):
                v = v.astype(mx.int32) if isinstance(v, mx.array) else mx.array(v).astype(mx.int32)
            out[k] = v
        return self.drop_tied_head(out)
