"""DeepSeek V4.1 Flash in MLX: the graph, its per-layer caches and the weight mapping.

Reference (the oracle): mlx-lm 0.32.2's `deepseek_v41` (there is no transformers class).
What differs from our DeepSeek V4 graph (deepseek_v4.py), whose pieces are reused:

* **Layer roles instead of layer types.**  `compress_ratios[i]` (0 = sliding window
  only) and three id lists decide what layer i does:
  - a *KV source* (`kv_source_layer_ids`, ratio > 0) pools each full group of `ratio`
    tokens (non-overlapping, softmax-gated, no position bias; ratio 1 = one row per
    token) into one compressed K=V row;
  - an *index source* (`index_source_layer_ids`) runs a lightning indexer: if it is
    also a KV source it makes index keys from its own pooled latents, otherwise it
    re-scores the keys of the latest KV+index source with its own query;
  - the *candidate source* (`candidate_source_layer_id`) also keeps, per query, the
    `candidate_topk_blocks` best blocks of `candidate_block_size` index keys (the
    newest, partly filled block always); later index layers score only inside them;
  - any other layer with a ratio reuses the latest compressed KV and the latest top-k.
  The sharing follows execution order, exactly as mlx-lm's `shared` dict does.
* **Attention**: shared-KV MQA over the sliding window (`sliding_window` rows, query
  included) plus the top-`index_topk` compressed rows; learned sinks; no per-head
  query norm; inverse rope on the output; grouped low-rank output projection.
* **Fake quantization** as the reference runtime does: window K=V rounded through FP8
  e4m3 (32-channel power-of-two blocks), compressed KV through FP4 e2m1 (16-channel
  blocks, e4m3 scales), index queries and keys through FP4 (32-channel, power-of-two
  scales).  A block rounding is skipped when the channel count is not a multiple of it.
* **Hyper-connections** are shifted by one block: a block collapses the streams with the
  `pre` weights computed *before the previous block* (layer 0's attention: stream 0),
  and the model output is the collapse with the last FFN block's `pre` (no hc_head).
* **MoE**: top-k only (no hash layers), `gate_temp`, `norm_topk_prob` honoured, one
  shared expert, clamped SwiGLU.

Engram (`engram_layer_ids`) is refused: neither the seeds nor any reference describe
it (mlx-lm refuses it too), so there is nothing to implement or verify against.

Where this graph deliberately departs from mlx-lm (only in cases mlx-lm leaves to
argpartition's tie order or to out-of-range reads, never in the oracle configs):
a top-k pick whose score is -inf (fewer candidates than `index_topk`) is dropped
instead of attended, and a top-k index past the compressed KV it is applied to is
dropped.  Layouts whose meaning depends on chunking (an index layer with a smaller
ratio than its key source: it would see unfinished groups) or that mlx-lm cannot run
(candidate masks over index keys of another ratio) raise ValueError.

Caches (`LayerCache`, one per layer; the V4 ring and `CompressorState` reused) hold
the sliding-window ring, and for KV sources the open group's projections (float32)
and the emitted compressed rows (and index keys).  Top-k picks and candidate masks
are recomputed every forward, so they are not state.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..kernels.hyper_connection import hc_collapse, hc_post  # hc_post fused on a GPU
from ..runtime.forward_context import PREFILL, StepContext
from ..runtime.steering import ATTN, FFN, steer  # directional steering hook (steering.py)
from .cache import StaticForward
from .causal_lm import BaseModelArgs, CausalLM, ContextForward
from .deepseek_v4 import CompressorState, GroupedLinear
from .deepseek_v4 import LayerCache as _V4LayerCache
from .layers import (
    GLUMLP,
    ActivationDtype,
    HyperConnection,
    RMSNorm,
    RoPE,
    SwitchGLU,
    default_inv_freq,
    route_weights,
    score_fn,
    topk_indices,
    yarn_inv_freq,
)


@dataclass
class ModelArgs(BaseModelArgs):
    """mlx-lm's / the hub config's DeepSeek V4.1 fields (same names and defaults)."""

    model_type: str = "deepseek_v41"
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1280
    qk_rope_head_dim: int = 64
    o_groups: int = 8
    o_lora_rank: int = 1024
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    sliding_window: int = 128
    compress_ratios: list = dataclasses.field(default_factory=list)
    kv_source_layer_ids: list = dataclasses.field(default_factory=list)
    index_source_layer_ids: list = dataclasses.field(default_factory=list)
    compress_rope_theta: float = 160000.0
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 1048576
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: list = dataclasses.field(default_factory=list)
    bos_token_id: int | None = 0
    eos_token_id: Any = 1
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, config: dict) -> ModelArgs:
        if "text_config" in config:  # the multimodal hub config nests the text model
            config = {**config["text_config"], "model_type": config.get("model_type", "deepseek_v41")}
        return super().from_dict(config)

    def __post_init__(self):
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            setattr(self, name, [int(v) for v in (getattr(self, name) or ())])
        if self.engram_layer_ids:
            raise ValueError(
                f"layers {self.engram_layer_ids} use Engram memory, which ds4mlx does not implement: "
                "no description or reference of it exists to build and verify against"
            )
        if self.tie_word_embeddings:
            raise ValueError("deepseek_v41 has an untied lm_head")
        if self.num_attention_heads * self.head_dim % self.o_groups:
            raise ValueError("num_attention_heads*head_dim must be divisible by o_groups")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError("index_head_dim must be >= qk_rope_head_dim (the indexer is roped too)")
        self._check_layout()

    def ratio(self, i: int) -> int:
        return self.compress_ratios[i] if i < len(self.compress_ratios) else 0

    def _check_layout(self):
        """Walk the layers as the forward does; refuse layouts with no chunk-independent meaning."""
        kv, index = set(self.kv_source_layer_ids), set(self.index_source_layer_ids)
        keys_from = cand_keys_from = None  # the KV+index source whose index keys are current
        for i in range(self.num_hidden_layers):
            r = self.ratio(i)
            if not r:
                continue
            if i in kv and i in index:
                keys_from = i
            if i in index and keys_from is not None:
                if r < self.ratio(keys_from):
                    raise ValueError(
                        f"index layer {i} (ratio {r}) scores the index keys of layer {keys_from} "
                        f"(ratio {self.ratio(keys_from)}): it would see groups that are not complete"
                    )
                if cand_keys_from is not None and self.ratio(cand_keys_from) != self.ratio(keys_from):
                    raise ValueError(
                        f"index layer {i} reads candidate blocks over layer {cand_keys_from}'s index keys "
                        f"but scores layer {keys_from}'s, which have another compress ratio"
                    )
                if i == self.candidate_source_layer_id and self.candidate_topk_blocks > 0:
                    cand_keys_from = keys_from


# ----------------------------------------------------------------------------- fake quantization


def fake_fp8(x: mx.array, block: int = 32) -> mx.array:
    """Round x through FP8 e4m3 with one power-of-two scale per `block` channels."""
    if x.shape[-1] % block:
        return x
    b = x.astype(mx.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = mx.maximum(mx.abs(b).max(axis=-1, keepdims=True), 1e-4)
    scale = mx.power(2.0, mx.ceil(mx.log2(amax / 448.0)))
    q = mx.from_fp8(mx.to_fp8(mx.clip(b / scale, -448.0, 448.0)), mx.float32) * scale
    return q.reshape(x.shape).astype(x.dtype)


def _round_e2m1(v: mx.array) -> mx.array:
    """Round |v| <= 6 to the FP4 e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even."""
    mag = mx.abs(v)
    step = mx.where(mag < 2.0, 0.5, mx.where(mag < 4.0, 1.0, 2.0))
    return mx.sign(v) * mx.round(mag / step) * step


def fake_fp4(x: mx.array, block: int, e4m3_scale: bool = False) -> mx.array:
    """Round x through FP4 e2m1 per `block` channels, the scale a power of two or an e4m3 value."""
    if x.shape[-1] % block:
        return x
    b = x.astype(mx.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    floor = 6.0 * 2.0**-9 if e4m3_scale else 6.0 * 2.0**-126
    amax = mx.maximum(mx.abs(b).max(axis=-1, keepdims=True), floor)
    if e4m3_scale:
        scale = mx.from_fp8(mx.to_fp8(amax / 6.0), mx.float32)
    else:
        scale = mx.power(2.0, mx.ceil(mx.log2(amax / 6.0)))
    q = _round_e2m1(mx.clip(b / scale, -6.0, 6.0)) * scale
    return q.reshape(x.shape).astype(x.dtype)


# ----------------------------------------------------------------------------- caches


class LayerCache(_V4LayerCache):
    """One layer's state: the V4 sliding-window ring (`sliding`, snapshot plumbing), plus
    for a KV source `comp` (open group's float32 projections, compressed rows) and, if it
    is an index source too, `index` (its index keys; the buffers are unused)."""

    def __init__(self, role: str, window: int, head_dim: int, ratio: int, index_head_dim: int):
        super().__init__(role, window, head_dim, 0, index_head_dim)
        if "kv" in role.split("+"):
            self.comp = CompressorState(ratio, head_dim, False)
            if "index" in role.split("+"):
                self.index = CompressorState(ratio, index_head_dim, False)

    def start(self, dtype) -> None:
        """Create the compressor states at their first use: float32 open-group buffers (the
        reference pools in float32), rows in `dtype`."""
        for st in (self.comp, self.index):
            if st is not None and st.rows is None:
                st.init(mx.float32)
                st.rows = mx.zeros((1, 0, st.dim), dtype)


# ----------------------------------------------------------------------------- modules


class Compressor(nn.Module):
    """Gated pooling of each full group of `ratio` tokens (ratio 1: one row per token)."""

    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.kv_proj = nn.Linear(args.hidden_size, args.head_dim, bias=False)
        if ratio > 1:
            self.gate_proj = nn.Linear(args.hidden_size, args.head_dim, bias=False)
        self.kv_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self._ratio = ratio

    def forward(self, ctx, x: mx.array, state, pos) -> tuple:
        """Feed x [1, C, H] at positions pos.. -> (the latents [1, n, D] of the groups it pools,
        the index of the first of them).  PREFILL: `state` the live `CompressorState`, pos a
        host int; the groups the chunk closes (None, 0 for none).  DECODE / CHAIN, one token,
        branch-free: `state` the row's view (its open-group buffers read and the new ones put
        back), pos an int32 array; the latent of the group holding pos, complete or not."""
        m = self._ratio
        prefill = ctx.kind == PREFILL
        buf_kv, buf_gate = (state.buf_kv, state.buf_gate) if prefill else (next(state), next(state))
        if m == 1:
            if not prefill:
                state.put(buf_kv, buf_gate)
            return self.kv_norm(self.kv_proj(x)), pos
        h = x.astype(mx.float32)  # the reference pools in float32
        kv, gate = self.kv_proj(h), self.gate_proj(h)
        if prefill:
            kv, gate = self._chunk_groups(kv, gate, state, pos)
            if kv is None:
                return None, 0
        else:
            b = (pos % m).reshape(1)
            buf_kv = mx.slice_update(buf_kv, kv.astype(buf_kv.dtype), b, axes=(1,))
            buf_gate = mx.slice_update(buf_gate, gate.astype(buf_gate.dtype), b, axes=(1,))
            state.put(buf_kv, buf_gate)
            kv, gate = buf_kv[:, None], buf_gate[:, None]
        latent = (kv * mx.softmax(gate, axis=2, precise=True)).sum(axis=2)
        return self.kv_norm(latent.astype(x.dtype)), pos // m

    def _chunk_groups(self, kv, gate, st: CompressorState, s: int) -> tuple:
        """A chunk's projections [1, C, D] at host positions s.. with the open group's buffered
        rows before them -> the full groups' [1, n, m, D] each (None, None for none); the rest
        buffered."""
        m, C = self._ratio, kv.shape[1]
        b = s % m  # rows of the open group already buffered
        if b:
            kv = mx.concatenate([st.buf_kv[:, :b], kv], axis=1)
            gate = mx.concatenate([st.buf_gate[:, :b], gate], axis=1)
        n, rest = (b + C) // m, (b + C) % m
        if rest:
            st.buf_kv[:, :rest] = kv[:, n * m :]
            st.buf_gate[:, :rest] = gate[:, n * m :]
        if n == 0:
            return None, None
        return kv[:, : n * m].reshape(1, n, m, -1), gate[:, : n * m].reshape(1, n, m, -1)


class Indexer(nn.Module):
    """Lightning indexer: score_t(j) = sum_h w_h(x_t) / sqrt(nh) * ReLU(q_th . k_j) / sqrt(d)
    in float32 over the visible index keys (and candidate blocks); keep the top `index_topk`."""

    BLOCK_ELEMS = 1 << 26  # queries are scored in blocks of at most this many (query, head, key) floats

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        nh, d = args.index_n_heads, args.index_head_dim
        self.q_b_proj = nn.Linear(args.q_lora_rank, nh * d, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, nh, bias=False)
        if layer in args.kv_source_layer_ids:  # only a KV source makes index keys
            self.k_proj = nn.Linear(args.head_dim, d, bias=False)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self._nh, self._d, self._topk, self._ratio = nh, d, args.index_topk, args.ratio(layer)
        self._cand = layer == args.candidate_source_layer_id and args.candidate_topk_blocks > 0
        self._cand_blocks, self._cand_size = args.candidate_topk_blocks, args.candidate_block_size

    def make_keys(self, latent: mx.array, first: int, rope: RoPE) -> mx.array:
        k = rope(self.k_norm(self.k_proj(latent)), offset=first, scale=float(self._ratio))
        return fake_fp4(k, 32)

    def scores(self, x: mx.array, q_res: mx.array, keys: mx.array, s: int, rope: RoPE) -> mx.array:
        B, C, _ = x.shape
        q = self.q_b_proj(q_res).reshape(B, C, self._nh, self._d).swapaxes(1, 2)
        q = fake_fp4(rope(q, offset=s), 32).swapaxes(1, 2).astype(mx.float32)  # [B, C, nh, d]
        kT = keys.astype(mx.float32).swapaxes(-1, -2)[:, None]  # [B, 1, d, N]
        w = self.weights_proj(x).astype(mx.float32) * self._nh**-0.5  # [B, C, nh]
        step = max(1, self.BLOCK_ELEMS // (self._nh * keys.shape[1]))
        out = []
        for i in range(0, C, step):
            sc = mx.maximum(q[:, i : i + step] @ kT, 0.0) * self._d**-0.5  # [B, c, nh, N]
            out.append((sc * w[:, i : i + step, :, None]).sum(axis=2))
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=1)  # [B, C, N]

    def forward(self, ctx, x, q_res, keys, kvalid, candidates, pos, rope: RoPE):
        """The top-k picks of the queries x [1, C, H] at positions pos.. over the index `keys`
        [1, N, d] (None: none yet) -> ((idx [1, C, k] int32, picked [1, C, k] bool: the pick
        has a finite score), the candidate mask to share or None).  PREFILL: pos a host int,
        the live keys.  DECODE / CHAIN: one query, pos an int32 array, every capacity row of
        `keys`, kvalid [cap] the live ones."""
        B, C, _ = x.shape
        N = 0 if keys is None else keys.shape[1]
        if N == 0:
            return (mx.zeros((B, C, 0), mx.int32), mx.zeros((B, C, 0), mx.bool_)), candidates
        scores = self.scores(x, q_res, keys, pos, rope)  # [B, C, N]
        if ctx.kind == PREFILL:
            visible_n = ((pos + 1 + mx.arange(C)) // self._ratio)[:, None]  # [C, 1]: keys whose group has ended
            visible = mx.arange(N)[None] < visible_n
        else:
            visible_n = ((pos + 1) // self._ratio).reshape(1, 1)
            visible = (mx.arange(N)[None] < visible_n) & kvalid
        scores = mx.where(visible, scores, -mx.inf)
        if self._cand:
            candidates = self._candidate_blocks(scores, visible_n)
        elif candidates is not None:
            scores = mx.where(candidates, scores, -mx.inf)
        idx = topk_indices(scores, min(self._topk, N)).astype(mx.int32)
        return (idx, mx.take_along_axis(scores, idx, axis=-1) > -mx.inf), candidates

    def _candidate_blocks(self, scores: mx.array, visible_n: mx.array) -> mx.array:
        """[B, C, N] bool: keys in the query's best blocks (block score = max key score);
        the block holding the newest visible key always counts."""
        size, N = self._cand_size, scores.shape[-1]
        nb = -(-N // size)
        padded = mx.pad(scores, [(0, 0), (0, 0), (0, nb * size - N)], constant_values=-mx.inf)
        blocks = padded.reshape(*scores.shape[:2], nb, size).max(axis=-1)
        newest = mx.where(visible_n > 0, (visible_n - 1) // size, -1)
        blocks = mx.where(mx.arange(nb)[None] == newest, mx.inf, blocks)
        chosen = topk_indices(blocks, min(self._cand_blocks, nb))
        keep = mx.take_along_axis(blocks, chosen, axis=-1) > -mx.inf
        mask = mx.put_along_axis(mx.zeros(blocks.shape, mx.bool_), chosen, keep, axis=-1)
        return mx.repeat(mask, size, axis=-1)[..., :N]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, ropes: dict):
        super().__init__()
        nh, D = args.num_attention_heads, args.head_dim
        self.q_a_proj = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.q_b_proj = nn.Linear(args.q_lora_rank, nh * D, bias=False)
        self.kv_proj = nn.Linear(args.hidden_size, D, bias=False)
        self.kv_norm = RMSNorm(D, args.rms_norm_eps)
        self.o_a_proj = GroupedLinear(nh * D // args.o_groups, args.o_groups * args.o_lora_rank, args.o_groups)
        self.o_b_proj = nn.Linear(args.o_groups * args.o_lora_rank, args.hidden_size, bias=False)
        self.sinks = mx.zeros((nh,))
        self._ratio = args.ratio(layer)
        # parameters exist whenever the layer is listed (as in mlx-lm); they act only with a ratio
        self._kv_source = layer in args.kv_source_layer_ids
        self._index_source = layer in args.index_source_layer_ids
        if self._kv_source:
            self.compressor = Compressor(args, self._ratio)
        if self._index_source:
            self.indexer = Indexer(args, layer)
        self._rope = ropes["compress" if self._ratio else "main"]
        self._nh, self._D, self._groups = nh, D, args.o_groups

    def forward(self, x: mx.array, ctx, shareds: list, cache: LayerCache | None = None) -> mx.array:
        """The attention of the query rows of `ctx` (runtime/forward_context.py; x [1, T, H]) ->
        [1, T, H]; shareds[b] carries row b's compressed KV, index keys and picks between
        layers.  The projections run once for all rows.  PREFILL: one chunk at the host
        position cache.offset over the live `cache` (`_chunk`).  DECODE / CHAIN: row b at
        ctx.row_pos[b] over the static layout of ctx.views[b], branch-free in the positions,
        each row's new state arrays put into its view (`_row`)."""
        q_res = self.q_a_norm(self.q_a_proj(x))
        q_b, kv = self.q_b_proj(q_res), self.kv_norm(self.kv_proj(x))
        if ctx.kind == PREFILL:
            out = self._chunk(ctx, x, q_res, q_b, kv, cache, shareds[0])
        else:
            rows = zip(ctx.split(x, q_res, q_b, kv), ctx.row_pos, ctx.views, shareds)
            out = ctx.join([self._row(ctx, *row, pos, view, shared) for row, pos, view, shared in rows])
        B, T = x.shape[:2]
        return self.o_b_proj(self.o_a_proj(out.reshape(B, T, self._groups, -1)))  # out [B, T, nh, D]

    def _query_key(self, q_b, kv, offset):
        """The roped queries [B, nh, C, D] and the roped, FP8-rounded K=V rows [B, 1, C, D] of
        the q_b_proj / normed kv_proj outputs [B, C, ...] at positions offset.. (a host int or
        an int32 array)."""
        B, C, _ = kv.shape
        q = self._rope(q_b.reshape(B, C, self._nh, self._D).swapaxes(1, 2), offset=offset)
        return q, fake_fp8(self._rope(kv[:, None], offset=offset), 32)

    def _attend(self, q, keys, mask, offset) -> mx.array:
        """The attention core in float32 (learned sinks), the output's inverse rope at offset..
        -> [B, C, nh, D]."""
        out = mx.fast.scaled_dot_product_attention(
            q.astype(mx.float32),
            keys.astype(mx.float32),
            keys.astype(mx.float32),
            scale=self._D**-0.5,
            mask=mask,
            sinks=self.sinks.astype(mx.float32),
        ).astype(q.dtype)
        return self._rope(out, offset=offset, scale=-1.0).swapaxes(1, 2)

    def _chunk(self, ctx, x, q_res, q_b, kv, cache: LayerCache, shared: dict) -> mx.array:
        """A PREFILL chunk's attention at the host position cache.offset over the live `cache`
        (its ring and compressed rows advanced; the offset left to the model) -> [B, C, nh, D]."""
        s = cache.offset
        q, kv = self._query_key(q_b, kv, s)
        keys, mask = cache.sliding(kv)
        if self._ratio:
            if self._kv_source:
                self._compress(ctx, x, cache, s, shared)
            if self._index_source:
                (idx, picked), cands = self.indexer.forward(
                    ctx, x, q_res, shared.get("index_keys"), None, shared.get("candidates"), s, self._rope
                )
                shared["topk"] = mx.where(picked, idx, -1)
                if self.indexer._cand:
                    shared["candidates"] = cands
            rows, topk = shared.get("kv_rows"), shared.get("topk")
            if rows is not None and rows.shape[1] and topk is not None and topk.shape[-1]:
                keys, mask = self._with_compressed(keys, mask, rows, topk)
        return self._attend(q, keys, mask, s)

    def _row(self, ctx, x, q_res, q_b, kv, pos: mx.array, view, shared: dict) -> mx.array:
        """One static query row's attention at `pos` (x, q_res, and the q_b_proj / normed
        kv_proj outputs [1, 1, ...]) over its `view` -> [1, 1, nh, D]."""
        q, kv = self._query_key(q_b, kv, pos)  # [1, nh, 1, D], [1, 1, 1, D]
        ring = next(view)
        W = ring.shape[2]
        ring = mx.slice_update(ring, kv.astype(ring.dtype), (pos % W).reshape(1), axes=(2,))
        view.put(ring)
        keys, mask = ring, mx.arange(W) <= pos
        if self._ratio:
            if self._kv_source:
                self._compress(ctx, x, view, pos, shared)
            if self._index_source and "index_keys" in shared:
                ik, ivalid = shared["index_keys"]
                (idx, picked), cands = self.indexer.forward(
                    ctx, x, q_res, ik, ivalid, shared.get("candidates"), pos, self._rope
                )
                shared["topk"] = (idx.reshape(-1), picked.reshape(-1))
                if self.indexer._cand:
                    shared["candidates"] = cands
            if "kv_rows" in shared and "topk" in shared:
                (rows, rvalid), (idx, picked) = shared["kv_rows"], shared["topk"]
                cap = rows.shape[1]
                safe = mx.minimum(idx, cap - 1)
                valid = picked & (idx < cap) & mx.take(rvalid, safe)  # picks past the KV are dropped
                chosen = mx.take(rows, mx.where(valid, safe, 0), axis=1)[:, None]  # [1, 1, k, D]
                keys = mx.concatenate([keys, chosen.astype(keys.dtype)], axis=2)
                mask = mx.concatenate([mask, valid])
        return self._attend(q, keys, mask[None], pos)

    def _compress(self, ctx, x, state, pos, shared: dict) -> None:
        """A KV source's compressed rows (and, as an index source too, its index keys) of the
        queries x at positions pos.., published in `shared`.  PREFILL: `state` the live cache,
        the rows of the groups the chunk closes appended.  DECODE / CHAIN: `state` the row's
        view, the open group's row written at its index whether or not the group is complete
        (a row that is not live yet is masked)."""
        prefill = ctx.kind == PREFILL
        if prefill:
            state.start(x.dtype)
        latent, first = self.compressor.forward(ctx, x, state.comp if prefill else state, pos)
        rows = state.comp.rows if prefill else next(state)
        row = None if latent is None else self._rope(latent, offset=first, scale=float(self._ratio))
        row = None if row is None else fake_fp4(row, 16, e4m3_scale=True).astype(rows.dtype)
        key = None
        if self._index_source and latent is not None:
            key = self.indexer.make_keys(latent, first, self._rope)
        if prefill:
            if row is not None:
                state.comp.append(row)
                if key is not None:
                    state.index.append(key.astype(state.index.rows.dtype))
            shared["kv_rows"] = state.comp.live_rows().astype(x.dtype)
            if self._index_source:
                shared["index_keys"] = state.index.live_rows()
            return
        at = first.reshape(1)
        rows = mx.slice_update(rows, row, at, axes=(1,))
        view = state
        view.put(rows)
        valid = mx.arange(rows.shape[1]) < (pos + 1) // self._ratio
        shared["kv_rows"] = (rows.astype(x.dtype), valid)
        if self._index_source:
            ibuf_kv, ibuf_gate, keys = next(view), next(view), next(view)
            keys = mx.slice_update(keys, key.astype(keys.dtype), at, axes=(1,))
            view.put(ibuf_kv, ibuf_gate, keys)
            shared["index_keys"] = (keys, valid)

    def _with_compressed(self, keys, mask, rows, topk):
        """Append the picked compressed rows to the window keys and mask."""
        C, W, N = topk.shape[1], keys.shape[2], rows.shape[1]
        valid = (topk >= 0) & (topk < N)
        # attend every row, masked to each query's picks
        slots = mx.where(valid, topk, N)[0]  # [C, k]; N is a scratch column
        sel = mx.put_along_axis(mx.zeros((C, N + 1), mx.bool_), slots, mx.array(True), axis=-1)[:, :N]
        win = mx.broadcast_to(mx.ones((1, W), mx.bool_) if mask is None else mask, (C, W))
        keys = mx.concatenate([keys, rows[:, None].astype(keys.dtype)], axis=2)
        return keys, mx.concatenate([win, sel], axis=1)


class Router(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        self.e_score_correction_bias = mx.zeros((args.n_routed_experts,))
        self._k, self._kind, self._temp = args.num_experts_per_tok, args.scoring_func, args.gate_temp
        self._norm, self._scale = args.norm_topk_prob and args.num_experts_per_tok > 1, args.routed_scaling_factor

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        scores = score_fn(logits / self._temp if self._temp != 1.0 else logits, self._kind)
        idx = topk_indices(scores + self.e_score_correction_bias.astype(mx.float32), self._k)
        return idx, route_weights(scores, idx, self._norm, self._scale)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Router(args)
        self.experts = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts, args.swiglu_limit)
        self.shared_experts = GLUMLP(args.hidden_size, args.moe_intermediate_size, args.swiglu_limit)

    def __call__(self, x: mx.array) -> mx.array:
        idx, w = self.gate(x)
        y = self.experts.fused_weighted(x, idx, w)  # GPU decode: two launches
        y = (self.experts(x, idx).astype(mx.float32) * w[..., None]).sum(axis=-2) if y is None else y.astype(mx.float32)
        return (y + self.shared_experts(x).astype(mx.float32)).astype(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, ropes: dict):
        super().__init__()
        self.self_attn = Attention(args, layer, ropes)
        self.mlp = MoE(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        hc = (args.hc_mult, args.hidden_size, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def __call__(self, x: mx.array, pre: mx.array, cache: LayerCache, shared: dict):
        """`forward` of a chunk x [1, C, n, H] at the cache's position; `shared` the picks the
        forward's earlier layers published."""
        return self.forward(x, pre, StepContext.prefill(cache.offset, [cache]), [shared], cache)

    def forward(self, x: mx.array, pre: mx.array, ctx, shareds: list, cache: LayerCache | None = None):
        """The layer over the query rows of `ctx` (runtime/forward_context.py): x [1, T, n, H]
        streams, pre [1, T, n] the previous block's collapse weights, shareds[b] row b's
        picks between layers.  PREFILL: a chunk over the live `cache`; DECODE / CHAIN: the
        static step over the rows' views.  Steering edits both sites' outputs on every kind."""
        attn_pre, post, comb = self.attn_hc.mix(x)
        normed = self.input_layernorm(hc_collapse(x, pre))
        out = self.self_attn.forward(normed, ctx, shareds, cache)
        x = hc_post(x, steer(self, ATTN, out), post, comb)
        ffn_pre, post, comb = self.ffn_hc.mix(x)
        x = hc_post(x, steer(self, FFN, self.mlp(self.post_attention_layernorm(hc_collapse(x, attn_pre)))), post, comb)
        return x, ffn_pre


def _ropes(args: ModelArgs) -> dict:
    """Window-only layers: plain rope at rope_theta.  Compressing layers: compress_rope_theta
    with the YaRN frequencies of rope_scaling, attention factor 1 (V4.1 applies no mscale)."""
    d = args.qk_rope_head_dim
    sc = args.rope_scaling or {}
    factor = float(sc.get("factor", 1.0))
    if factor == 1.0:
        compress = default_inv_freq(d, args.compress_rope_theta)
    else:
        compress = yarn_inv_freq(
            d,
            args.compress_rope_theta,
            factor,
            int(sc.get("original_max_position_embeddings", args.max_position_embeddings)),
            float(sc.get("beta_fast", 32)),
            float(sc.get("beta_slow", 1)),
        )
    return {"main": RoPE(d, default_inv_freq(d, args.rope_theta)), "compress": RoPE(d, compress)}


class DeepseekV41Model(ActivationDtype, nn.Module):
    # the DSpark drafter's capture (speculative/dspark.py): every multi-token forward calls
    # capture_hook(states [1, T, len(capture_layers) * H], first position, ids [1, T]) with the
    # mean over the streams entering each of `capture_layers`, in layer order; None = off
    capture_hook = None
    capture_layers: tuple = ()

    def __init__(self, args: ModelArgs):
        super().__init__()
        self._ropes = _ropes(args)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i, self._ropes) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self._hc = args.hc_mult

    def forward(self, ids: mx.array, ctx) -> mx.array:
        """The forward of tokens ids [1, T] over `ctx` (runtime/forward_context.py: a PREFILL
        chunk of one session, T sessions' next tokens, or one session's next T as a chain) ->
        hidden [1, T, H].  PREFILL advances the caches and feeds `capture_hook`; DECODE and
        CHAIN leave the rows' new states in their views, the layers' shared picks kept per
        row."""
        h = self.embed(ids)
        T = ids.shape[1]
        x = mx.broadcast_to(h[:, :, None, :], (1, T, self._hc, h.shape[-1]))
        pre = mx.broadcast_to((mx.arange(self._hc) == 0).astype(mx.float32), (1, T, self._hc))
        prefill = ctx.kind == PREFILL
        caches = ctx.views[0] if prefill else [None] * len(self.layers)
        shareds = [{} for _ in range(ctx.rows)]
        captured = []
        for i, (layer, c) in enumerate(zip(self.layers, caches)):
            if prefill and self.capture_hook is not None and i in self.capture_layers:
                captured.append(x.mean(axis=2))  # the layer's input, not its output
            x, pre = layer.forward(x, pre, ctx, shareds, c)
        if captured:
            self.capture_hook(mx.concatenate(captured, axis=-1), ctx.row_pos[0], ids)
        if prefill:
            for c in caches:
                c.offset += T
        return self.norm(hc_collapse(x, pre))


class Model(ContextForward, StaticForward, CausalLM):
    """DeepSeek V4.1 Flash: `model(ids [1, T], cache) -> logits [1, T, V]`."""

    static_steers = True  # steering edits the static forward too (the stepper runs it eagerly)

    def __init__(self, args: ModelArgs):
        super().__init__(args, DeepseekV41Model(args))

    # a verify as a CHAIN context (stepper.step_chain): off by default, since the static step
    # (and so a chain) is up to ~1e-2 off the PREFILL forward's logits where a verify through the
    # PREFILL forward is not.  Not a growing drift: the two differ ~2e-6 by summation order (a
    # step's mat-vecs and gathered top-k rows against a chunk's matmuls and masks), which now and
    # then crosses an FP8 / FP4 fake-quant rounding boundary of a K=V or compressed row; the
    # logits jump until that row leaves the attention (without the fake quantizers: ~2e-6)
    chain_verify = False

    @property
    def static_rows_chain(self) -> bool:
        """Whether a verify runs as a CHAIN context: `chain_verify`, and no DSpark drafter
        captures the backbone's states (those come from the PREFILL forward only)."""
        return self.chain_verify and self.model.capture_hook is None

    def forward(self, ids: mx.array, ctx, last_only: bool = False):
        """The one forward of ids [1, T] over `ctx` (runtime/forward_context.py `StepContext`).
        PREFILL (a chunk over the live caches, advanced) -> logits [1, T, V] (`last_only`: the
        last token's).  DECODE / CHAIN (pure: T sessions' next tokens, or one session's next T
        as a chain, row t over the state row t - 1 left) -> (logits [T, V], the rows' new
        states)."""
        h = self.model.forward(ids, ctx)
        if ctx.kind == PREFILL:
            return self.head(h[:, -1:] if last_only else h)
        return self.head(h).squeeze(0), [v.new for v in ctx.views]

    def make_cache(self) -> list[LayerCache]:
        a = self.args
        kv, index = set(a.kv_source_layer_ids), set(a.index_source_layer_ids)
        caches = []
        for i in range(a.num_hidden_layers):
            r = a.ratio(i)
            roles = ["v41"] + (["kv"] if r and i in kv else []) + (["index"] if r and i in kv and i in index else [])
            role = "+".join(roles)
            caches.append(LayerCache(role, a.sliding_window, a.head_dim, r, a.index_head_dim))
        return caches

    def sanitize(self, weights: dict) -> dict:
        """mlx-lm's parameter names (as the oracle saves them) or the hub checkpoint's
        (unquantized tensors only) -> this module's parameters."""
        if not any(k.startswith("model.") for k in weights):
            weights = _from_hub(weights)
        out, experts = {}, {}
        for k, v in weights.items():
            m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.switch_mlp\.(gate|up|down)_proj\.weight", k)
            if m:
                experts.setdefault(m.group(1), {})[m.group(2)] = v
                continue
            if k.endswith("self_attn.o_a_proj.weight") and v.ndim == 3:  # [G, out, in] -> [G*out, in]
                v = v.reshape(-1, v.shape[-1])
            out[k] = v
        for prefix, parts in experts.items():
            if set(parts) != {"gate", "up", "down"}:
                raise ValueError(f"{prefix}: incomplete expert projections {sorted(parts)}")
            out[f"{prefix}.gate_up_proj.weight"] = mx.concatenate([parts["gate"], parts["up"]], axis=1)
            out[f"{prefix}.down_proj.weight"] = parts["down"]
        return out


# ----------------------------------------------------------------------------- hub checkpoint names

_HUB_DROP = ("vision.", "aligner.", "image_", "mtp.")
HUB_PARTS = [  # (hub name fragment, mlx-lm name fragment), applied in order
    (".attn.", ".self_attn."),
    (".ffn.", ".mlp."),
    (".attn_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".hc_attn_", ".attn_hc."),
    (".hc_ffn_", ".ffn_hc."),
    (".attn_sink", ".sinks"),
    (".wq_a.", ".q_a_proj."),
    (".wq_b.", ".q_b_proj."),
    (".wkv.", ".kv_proj."),
    (".wgate.", ".gate_proj."),
    (".wo_a.", ".o_a_proj."),
    (".wo_b.", ".o_b_proj."),
    (".q_norm.", ".q_a_norm."),
    (".compressor.norm.", ".compressor.kv_norm."),
    (".indexer.wk.", ".indexer.k_proj."),
    (".gate.bias", ".gate.e_score_correction_bias"),
    (".shared_experts.w1.", ".shared_experts.gate_proj."),
    (".shared_experts.w2.", ".shared_experts.down_proj."),
    (".shared_experts.w3.", ".shared_experts.up_proj."),
]
_HUB_EXPERT = re.compile(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight")
_EXPERT_PROJ = {"w1": "gate", "w2": "down", "w3": "up"}


def _from_hub(weights: dict) -> dict:
    """DeepSeek's checkpoint names -> mlx-lm's.  FP8/FP4 tensors (with `.scale`) are refused:
    dequantize them first (not supported yet)."""
    out, experts = {}, {}
    for k, v in weights.items():
        if k.startswith(_HUB_DROP) or ".engram." in k or k.endswith(".gate.bias_vl"):
            continue
        if k.endswith(".scale") and f"{k[: -len('.scale')]}.weight" in weights:
            raise ValueError(f"{k}: FP8/FP4 hub checkpoints are not supported yet (dequantize first)")
        m = _HUB_EXPERT.fullmatch(k)
        if m:
            layer, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
            experts.setdefault((layer, _EXPERT_PROJ[w]), {})[e] = v
            continue
        if k == "embed.weight":
            out["model.embed_tokens.weight"] = v
        elif k == "head.weight":
            out["lm_head.weight"] = v
        else:
            name = f"model.{k}"
            for a, b in HUB_PARTS:
                name = name.replace(a, b)
            out[name] = v
    for (layer, proj), rows in experts.items():
        stacked = mx.stack([rows[e] for e in sorted(rows)])
        out[f"model.layers.{layer}.mlp.experts.switch_mlp.{proj}_proj.weight"] = stacked
    return out


# ----------------------------------------------------------------------------- demo model

# Real V4.1 Flash vocabulary, window and rope bases; a tiny body.  Layer plan: window only,
# then a KV+index+candidate source, a re-indexing layer and a reuse layer (as mlx-lm's tests).
DEMO_CONFIG = {
    "model_type": "deepseek_v41",
    "vocab_size": 129280,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 64,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "o_groups": 2,
    "o_lora_rank": 32,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-6,
    "sliding_window": 128,
    "compress_ratios": [0, 4, 4, 4],
    "kv_source_layer_ids": [1],
    "index_source_layer_ids": [1, 2],
    "candidate_source_layer_id": 1,
    "candidate_topk_blocks": 16,
    "candidate_block_size": 8,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 64,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "demo_model": True,
}


def demo_weights(config: dict, seed: int) -> dict:
    """Deterministic random weights under mlx-lm's names (what `sanitize` takes)."""
    import numpy as np
    from mlx.utils import tree_flatten

    args = ModelArgs.from_dict(config)
    shapes = dict((k, v.shape) for k, v in tree_flatten(Model(args).parameters()))
    names = {}
    for k, shape in shapes.items():  # back to mlx-lm's layout: unfused experts, [G, out, in] o_a_proj
        if k.endswith("mlp.experts.gate_up_proj.weight"):
            e, two_i, h = shape
            base = k[: -len("gate_up_proj.weight")] + "switch_mlp."
            names[base + "gate_proj.weight"] = names[base + "up_proj.weight"] = (e, two_i // 2, h)
        elif k.endswith("mlp.experts.down_proj.weight"):
            names[k.replace("experts.down_proj", "experts.switch_mlp.down_proj")] = shape
        elif k.endswith("o_a_proj.weight"):
            names[k] = (args.o_groups, shape[0] // args.o_groups, shape[1])
        else:
            names[k] = shape
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(names):
        shape = names[name]
        if len(shape) >= 2:
            std = 0.02 if "embed" in name else 1.0 / np.sqrt(shape[-1])
            out[name] = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
        elif "norm" in name:
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        else:  # sinks, router bias, hyper-connection base/scale
            out[name] = (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return out
