"""DeepSeek V4.1's DSpark block drafter (the checkpoint's `mtp.<stage>.*`) in MLX.

DeepSeek V4.1 checkpoints keep `num_nextn_predict_layers` (the stage count), but their
`mtp.*` tensors are not V4's next-n layer (deepseek_v4_mtp.py): they draft a whole block
of `dspark_block_size` tokens in one pass.

Reference: DeepSeek's own V4.1 `inference/model.py` (DSparkBlock, DSparkAttention,
DSparkMarkovHead, DSparkConfidenceHead, Transformer.forward / forward_spec), read in a
byte-identical vendored copy ("Vendored from huggingface.co/deepseek-ai/DeepSeek-V4.1-Flash,
revision dba1be0a40aa45a94ad051997016db3960a90277, file inference/model.py") found through
the code index.  vllm-ascend's `vllm_ascend/models/deepseek_v41/dspark.py`
(DeepseekV41DSparkModel, DeepseekV41DSparkDecoderLayer) was read for the checkpoint layout
and agrees on every point below; where it differs it only renames (its `markov_w1/w2` are
the checkpoint's `markov_head.embed/head`).  Every part follows DeepSeek's file:

* **Captured target states** (Transformer.forward): for each layer i in
  `dspark_target_layer_ids`, the mean over the hc streams of the streams *entering*
  layer i, concatenated in layer order -> [T, len(ids) * H].
* **Stage 0's projection** (DSparkBlock.forward_embed): main_x = main_norm(main_proj(.)),
  shared by every stage.
* **Stages** (DSparkBlock = a V4.1 decoder block): the same mHC (shifted `pre`, one-hot
  stream 0 first), attention norm, MoE (`dspark_n_routed_experts` /
  `dspark_n_activated_experts` override the counts when set) and parameter layout as
  deepseek_v41.DecoderLayer; only the attention differs.
* **DSparkAttention**: window only (the stage layer's compress ratio must be 0).  Each
  stage makes its own window keys from main_x with its own kv_proj / kv_norm, roped at the
  target positions and FP8-rounded like any window K=V; the block's queries (positions
  p+1 .. p+block, p the newest captured position) see the newest `sliding_window` of those
  and *all* block positions (no causal mask inside the block), with the learned sinks,
  the inverse rope on the output and the grouped low-rank output projection.
* **Block input** (forward_embed): [last accepted token, noise, ..., noise]
  (`dspark_noise_token_id`) through the target's embedding, copied to the hc streams.
* **Head** (DSparkBlock.forward_head, last stage): h = collapse with the last FFN's pre;
  logits = target lm_head(norm(h)) (float32); position i adds the Markov bias
  markov_head.head(markov_head.embed(token_i)), token_0 the accepted token and token_i+1
  the draft picked from position i's biased logits (sequential: the bias needs the pick);
  confidence_i = confidence_head.proj([h_i ; markov_embed_i]) in float32.

Parameter names: DSpark's own parts keep the checkpoint's names (`mtp.0.main_proj`,
`mtp.0.main_norm`, `mtp.<last>.norm`, `.markov_head.embed`, `.markov_head.head`,
`.confidence_head.proj`); the decoder-block parts use deepseek_v41's (mlx-lm) names,
`dspark_weights` maps a hub checkpoint's `mtp.*` onto them.

The reference drafts one target position per round (its decode step); `observe` takes any
number of positions (a prefill chunk, or the tokens a verify accepted), keeping each
stage's newest `sliding_window` keys, which is the same window.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..kernels.hyper_connection import hc_collapse, hc_post
from .deepseek_v41 import HUB_PARTS, Attention, DecoderLayer, ModelArgs, fake_fp8
from .layers import RMSNorm, RoPE, default_inv_freq

RANDOM_SEED = 20261202


@dataclass
class DSparkArgs:
    """The config's DSpark keys (names as DeepSeek's hub config.json)."""

    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple = ()
    dspark_markov_rank: int = 256
    num_nextn_predict_layers: int = 1  # the stage count (DeepSeek's ModelArgs: n_mtp_layers)
    dspark_n_routed_experts: int = 0  # 0: the target's count
    dspark_n_activated_experts: int = 0

    @classmethod
    def from_config(cls, config: dict) -> DSparkArgs:
        if "text_config" in config:  # the multimodal hub config nests the text model
            config = config["text_config"]
        names = {f.name for f in dataclasses.fields(cls)}
        vals = {k: v for k, v in config.items() if k in names}
        if "num_nextn_predict_layers" not in vals and "n_mtp_layers" in config:
            vals["num_nextn_predict_layers"] = config["n_mtp_layers"]
        return cls(**vals)

    def __post_init__(self):
        self.dspark_target_layer_ids = tuple(int(i) for i in (self.dspark_target_layer_ids or ()))
        if int(self.dspark_block_size) < 1:
            raise ValueError(f"dspark_block_size must be >= 1 (got {self.dspark_block_size}): no DSpark drafter")
        if not self.dspark_target_layer_ids:
            raise ValueError("DSpark needs dspark_target_layer_ids (the target layers whose inputs it attends to)")
        if int(self.num_nextn_predict_layers) < 1:
            raise ValueError(
                f"DSpark needs at least one stage (num_nextn_predict_layers={self.num_nextn_predict_layers})"
            )
        if int(self.dspark_markov_rank) < 1:
            raise ValueError(f"dspark_markov_rank must be >= 1 (got {self.dspark_markov_rank})")

    @property
    def stages(self) -> int:
        return int(self.num_nextn_predict_layers)

    def check(self, target: ModelArgs) -> None:
        """Refuse a DSpark config that does not fit its target."""
        n = target.num_hidden_layers
        bad = [i for i in self.dspark_target_layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"dspark_target_layer_ids {bad} are not layers of the target (0..{n - 1})")
        if len(set(self.dspark_target_layer_ids)) != len(self.dspark_target_layer_ids):
            raise ValueError(f"dspark_target_layer_ids {list(self.dspark_target_layer_ids)} repeat a layer")
        if not 0 <= self.dspark_noise_token_id < target.vocab_size:
            raise ValueError(f"dspark_noise_token_id {self.dspark_noise_token_id} is outside the vocabulary")
        for s in range(self.stages):
            if target.ratio(n + s):
                raise ValueError(
                    f"DSpark stage {s} (layer {n + s}) has compress ratio {target.ratio(n + s)}: it must be 0"
                )

    def stage_args(self, target: ModelArgs) -> ModelArgs:
        """The target's args with the stages' expert counts."""
        return dataclasses.replace(
            target,
            n_routed_experts=self.dspark_n_routed_experts or target.n_routed_experts,
            num_experts_per_tok=self.dspark_n_activated_experts or target.num_experts_per_tok,
        )


class DSparkCache:
    """Per stage, the window keys [1, 1, <=W, D] of the newest captured target positions;
    `offset` = the number of target positions captured (the block starts there)."""

    def __init__(self, stages: int, window: int):
        self.keys: list[mx.array | None] = [None] * stages
        self.window = window
        self.offset = 0

    def append(self, stage: int, keys: mx.array) -> None:
        old = self.keys[stage]
        keys = keys if old is None else mx.concatenate([old, keys.astype(old.dtype)], axis=2)
        self.keys[stage] = keys[:, :, -self.window :]


class DSparkAttention(Attention):
    """Window-only attention of a block over the target's window keys plus itself."""

    def window_keys(self, main_x: mx.array, offset: int) -> mx.array:
        """K=V rows [1, 1, T, D] of the captured positions offset.. (main_x [1, T, H])."""
        return fake_fp8(self._rope(self.kv_norm(self.kv_proj(main_x))[:, None], offset=offset), 32)

    def __call__(self, x: mx.array, window: mx.array | None, offset: int) -> mx.array:
        B, C, _ = x.shape
        q_res = self.q_a_norm(self.q_a_proj(x))
        q, keys = self._query_key(self.q_b_proj(q_res), self.kv_norm(self.kv_proj(x)), offset)
        if window is not None:
            keys = mx.concatenate([window.astype(keys.dtype), keys], axis=2)
        out = self._attend(q, keys, None, offset)  # no mask: the block sees all of itself
        return self.o_b_proj(self.o_a_proj(out.reshape(B, C, self._groups, -1)))


class DSparkMarkovHead(nn.Module):
    """Low-rank bigram bias: head(embed(previous token)) -> [V]."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.head = nn.Linear(rank, vocab, bias=False)

    def __call__(self, token: mx.array) -> tuple[mx.array, mx.array]:
        """token [n] -> (bias [n, V] float32, markov embedding [n, rank] float32)."""
        e = self.embed(token).astype(mx.float32)
        return self.head(e).astype(mx.float32), e


class DSparkConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=False)

    def __call__(self, h: mx.array, markov: mx.array) -> mx.array:
        joined = mx.concatenate([h.astype(mx.float32), markov.astype(mx.float32)], axis=-1)
        return (joined @ self.proj.weight.astype(mx.float32).T)[..., 0]  # float32, as the reference


class DSparkStage(DecoderLayer):
    """One `mtp.<stage>`: a V4.1 decoder block with DSparkAttention; stage 0 also owns the
    capture projection, the last stage the norm and the Markov and confidence heads."""

    def __init__(self, target: ModelArgs, dspark: DSparkArgs, stage: int, ropes: dict):
        args = dspark.stage_args(target)
        layer = target.num_hidden_layers + stage
        super().__init__(args, layer, ropes)
        self.self_attn = DSparkAttention(args, layer, ropes)
        H = target.hidden_size
        if stage == 0:
            self.main_proj = nn.Linear(H * len(dspark.dspark_target_layer_ids), H, bias=False)
            self.main_norm = RMSNorm(H, target.rms_norm_eps)
        if stage == dspark.stages - 1:
            self.norm = RMSNorm(H, target.rms_norm_eps)
            self.markov_head = DSparkMarkovHead(target.vocab_size, dspark.dspark_markov_rank)
            self.confidence_head = DSparkConfidenceHead(H + dspark.dspark_markov_rank)

    def __call__(self, x: mx.array, pre: mx.array, window: mx.array | None, offset: int):
        attn_pre, post, comb = self.attn_hc.mix(x)
        x = hc_post(x, self.self_attn(self.input_layernorm(hc_collapse(x, pre)), window, offset), post, comb)
        ffn_pre, post, comb = self.ffn_hc.mix(x)
        x = hc_post(x, self.mlp(self.post_attention_layernorm(hc_collapse(x, attn_pre))), post, comb)
        return x, ffn_pre


def argmax_pick(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


class DSparkHead(nn.Module):
    """The stages `mtp.0 .. mtp.<n-1>`; embedding and lm_head are the target's (passed in)."""

    def __init__(self, target: ModelArgs, dspark: DSparkArgs):
        super().__init__()
        dspark.check(target)
        d = target.qk_rope_head_dim
        ropes = {"main": RoPE(d, default_inv_freq(d, target.rope_theta))}  # window only: no YaRN
        self.mtp = [DSparkStage(target, dspark, s, ropes) for s in range(dspark.stages)]
        self.args, self.dspark = target, dspark
        self._hc = target.hc_mult

    def make_cache(self) -> DSparkCache:
        return DSparkCache(self.dspark.stages, self.args.sliding_window)

    def observe(self, captured: mx.array, cache: DSparkCache) -> None:
        """Take the captured states [1, T, len(ids) * H] of target positions cache.offset.."""
        main_x = self.mtp[0].main_norm(self.mtp[0].main_proj(captured))
        for s, stage in enumerate(self.mtp):
            cache.append(s, stage.self_attn.window_keys(main_x, cache.offset))
        cache.offset += captured.shape[1]

    def draft_block(
        self,
        captured: mx.array | None,
        token,
        cache: DSparkCache,
        embed: Callable,
        lm_head: Callable,
        pick: Callable[[mx.array], mx.array] = argmax_pick,
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Draft the block after `token` (the last accepted one, at position cache.offset
        once `captured` [1, T, len(ids)*H] or None is observed) -> (logits [block, V] float32
        with the Markov bias, confidences [block] float32, draft tokens [block]); token i+1
        is `pick` of row i.  Lazy: nothing is evaluated here."""
        if captured is not None and captured.shape[1]:
            self.observe(captured, cache)
        if cache.offset == 0:
            raise ValueError("DSpark drafts after a captured target position: observe one first")
        bs = self.dspark.dspark_block_size
        token = mx.array(token, mx.int32).reshape(1)
        ids = mx.concatenate([token, mx.full((bs - 1,), self.dspark.dspark_noise_token_id, mx.int32)])[None]
        h = embed(ids)
        B, C, H = h.shape
        x = mx.broadcast_to(h[:, :, None, :], (B, C, self._hc, H))
        pre = mx.broadcast_to((mx.arange(self._hc) == 0).astype(mx.float32), (B, C, self._hc))
        for stage, window in zip(self.mtp, cache.keys):
            x, pre = stage(x, pre, window, cache.offset)
        last = self.mtp[-1]
        h = hc_collapse(x, pre)[0]  # [block, H]
        base = lm_head(last.norm(h)).astype(mx.float32)
        rows, marks, drafts, prev = [], [], [], token
        for i in range(bs):  # sequential: position i's bias is made from the token picked at i-1
            bias, e = last.markov_head(prev)
            row = base[i] + bias[0]
            prev = pick(row).astype(mx.int32).reshape(1)
            rows.append(row)
            marks.append(e[0])
            drafts.append(prev)
        confidence = last.confidence_head(h, mx.stack(marks))
        return mx.stack(rows), confidence, mx.concatenate(drafts)


def random_head(target: ModelArgs, dspark: DSparkArgs, seed: int = RANDOM_SEED, dtype=None) -> DSparkHead:
    """A drafter with random weights: matrices N(0, 1/fan_in), norms and mHC scales ~1,
    sinks / mHC / router biases ~0.1, the Markov embedding N(0, 1) (so its bias moves the argmax)."""
    from mlx.utils import tree_flatten, tree_unflatten

    head = DSparkHead(target, dspark)
    key = mx.random.key(seed)
    params = []
    for name, p in tree_flatten(head.parameters()):
        key, sub = mx.random.split(key)
        want = dtype if dtype is not None and mx.issubdtype(p.dtype, mx.floating) else p.dtype
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            v = 1.0 + 0.1 * mx.random.normal(p.shape, key=sub)
        elif name.endswith("_hc.scale"):  # distinct per mix, so a swapped scale shows
            v = 1.0 + 0.2 * mx.random.normal(p.shape, key=sub)
        elif p.ndim == 1:  # sinks, router bias, mHC base
            v = 0.1 * mx.random.normal(p.shape, key=sub)
        elif name.endswith("markov_head.embed.weight"):
            v = mx.random.normal(p.shape, key=sub)
        else:
            v = mx.random.normal(p.shape, key=sub) * p.shape[-1] ** -0.5
        params.append((name, v.astype(want)))
    head.update(tree_unflatten(params))
    mx.eval(head.parameters())
    return head


# ----------------------------------------------------------------------------- hub checkpoint names

_HUB_EXPERT = re.compile(r"mtp\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight")


def dspark_weights(tensors: dict) -> dict:
    """A hub checkpoint's `mtp.<s>.*` (unquantized) -> DSparkHead parameter names: the
    block parts renamed as deepseek_v41 renames a layer's, per-expert w1/w3 fused into
    `gate_up_proj`, w2 stacked into `down_proj`; `mtp.<s>.embed/head` (DeepSeek's
    Transformer hands the stages its own) and the VL router bias are dropped."""
    out, experts = {}, {}
    for k, v in tensors.items():
        if not k.startswith("mtp.") or k.endswith(".gate.bias_vl") or k.split(".")[2] in ("embed", "head"):
            continue
        if k.endswith(".scale") and f"{k[: -len('.scale')]}.weight" in tensors:
            raise ValueError(f"{k}: FP8/FP4 DSpark tensors are not supported yet (dequantize first)")
        m = _HUB_EXPERT.fullmatch(k)
        if m:
            experts.setdefault(f"mtp.{m.group(1)}.mlp.experts", {}).setdefault(m.group(3), {})[int(m.group(2))] = v
            continue
        name = k
        for a, b in HUB_PARTS:
            name = name.replace(a, b)
        out[name] = v
    for prefix, parts in experts.items():
        if set(parts) != {"w1", "w2", "w3"}:
            raise ValueError(f"{prefix}: incomplete expert projections {sorted(parts)}")
        w1, w2, w3 = ([part[e] for e in sorted(part)] for part in (parts["w1"], parts["w2"], parts["w3"]))
        out[f"{prefix}.gate_up_proj.weight"] = mx.concatenate([mx.stack(w1), mx.stack(w3)], axis=1)
        out[f"{prefix}.down_proj.weight"] = mx.stack(w2)
    return out
