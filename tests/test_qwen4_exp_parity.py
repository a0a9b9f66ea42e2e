"""Qwen3.8 Flash Next (transformers `qwen4_exp` text model) MLX graph against transformers
(tiny random models, float32, CPU).

Two oracle configurations (tests/oracle/make_tiny_qwen4_exp.py, default and `--config
long`) together cover Gated DeltaNet layers (grouped and equal key/value heads, silu and
sigmoid output gates, 1 and 3 HF delta-rule chunks), indexed attention with the QSA
indexer (ratio 4 / top-2 and ratio 8 / top-2, partial and full index-head rope), PLE on
two layers each (3-grams x 2 heads, 4-grams x 1 head; EOS resets, also back to back and
across the 63|64 chunk boundary), hyper-connections with hc 4 and 3, normalised and
un-normalised top-k MoE, attention biases and tied embeddings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from ds4mlx.models.base import LanguageModel, family_module
from ds4mlx.models.gated_delta import causal_conv1d, gated_delta, gated_delta_reference
from ds4mlx.models.qwen4_exp import INDEXED, LINEAR, ModelArgs, QSAIndexer

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import chunked_logits, load_case, maxdiff, split_logits  # noqa: E402

CONFIGS = [None, "long"]
TOL = 1e-4
MIN_MARGIN = 3e-4
SCRIPT = "make_tiny_qwen4_exp.py"


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c or "default")
def case(request, oracle):
    folder, lm, ref, summary = load_case(oracle, SCRIPT, request.param)
    return folder, lm, ref, summary, json.loads((folder / "config.json").read_text())


def _eos_positions(ref, cfg) -> list[int]:
    return [i for i, t in enumerate(ref["input_ids"][0].tolist()) if t == cfg["eos_token_id"]]


def test_oracle_has_no_topk_near_ties(case):
    *_, summary, _ = case
    margins = summary["min_topk_margin"]
    assert len(margins) == 2, margins  # the QSA indexer and the router were both exercised
    assert min(margins.values()) >= MIN_MARGIN, margins


def test_oracle_exercises_eos_resets(case):
    _, _, ref, _, cfg = case
    assert len(_eos_positions(ref, cfg)) >= 2
    assert cfg["ple_layer_ids"] and INDEXED in cfg["layer_types"] and LINEAR in cfg["layer_types"]


def test_full_forward_matches_transformers(case):
    _, lm, ref, _, _ = case
    assert maxdiff(lm.logits(ref["input_ids"][0].tolist()), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("chunk", [1, 5, 12, 13, 64])
def test_chunked_forward_all_positions(case, chunk):
    """Every position's logits from a cached, chunked forward equal the full forward
    (chunk 1 is token-by-token decoding from an empty cache)."""
    _, lm, ref, _, _ = case
    ids = ref["input_ids"][0].tolist()
    out = chunked_logits(lm, ids, chunk)
    assert maxdiff(out, ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("side", [0, 1, 2])
def test_chunk_boundaries_at_eos(case, side):
    """Chunks that start at an EOS (side 0), just after it (1) or two after it (2): the
    n-gram history and the PLE conv window carry the reset across chunks."""
    _, lm, ref, _, cfg = case
    ids = ref["input_ids"][0].tolist()
    bounds = sorted({e + side for e in _eos_positions(ref, cfg) if 0 < e + side < len(ids)})
    assert maxdiff(split_logits(lm, ids, bounds), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("chunk", [3, 13])
def test_session_prefill_then_decode(case, chunk):
    """Chunked prefill of P tokens, then token-by-token decode: equal to the full forward and
    to the oracle's own stepwise decode."""
    _, lm, ref, _, _ = case
    ids = ref["input_ids"][0].tolist()
    P, full = int(ref["stepwise_start"]), ref["logits_full"][0]
    s = lm.new_session(ctx=len(ids), chunk=chunk)
    assert maxdiff(s.prefill(ids[:P]), full[P - 1]) <= TOL
    steps = np.stack([s.decode(t) for t in ids[P:]])
    assert maxdiff(steps, full[P:]) <= TOL
    assert maxdiff(steps, ref["logits_stepwise"][0]) <= TOL
    assert s.tokens == ids and len(s) == len(ids)


def test_incremental_last_token(case):
    _, lm, ref, _, _ = case
    ids = ref["input_ids"][0].tolist()
    s = lm.new_session(ctx=len(ids))
    s.prefill(ids[:-1])
    assert maxdiff(s.decode(ids[-1]), ref["logits_incremental_last"][0]) <= TOL


def _snapshot_points(ref, cfg) -> list[int]:
    """Right after an EOS, and the oracle's stepwise start."""
    return [_eos_positions(ref, cfg)[0] + 1, int(ref["stepwise_start"])]


def test_snapshot_restore_decode_bit_exact(case):
    """snapshot -> restore into a fresh session -> decode gives bit-identical logits, and the
    snapshot carries every recurrent state (delta rule, GDN conv, PLE conv, n-gram ids)."""
    _, lm, ref, _, cfg = case
    ids = ref["input_ids"][0].tolist()
    for P in _snapshot_points(ref, cfg):
        end = min(len(ids), P + 24)
        a = lm.new_session(ctx=len(ids), chunk=7)
        a.prefill(ids[:P])
        blob = a.snapshot()
        names = {k for c in a._cache for k in c.state}
        assert names == {"conv", "recurrent", "ple_conv", "ngram", "keys", "values", "index_blocks", "index_tail"}
        want = np.stack([a.decode(t) for t in ids[P:end]])
        b = lm.new_session(ctx=len(ids), chunk=7)
        b.prefill(ids[:3])  # some unrelated state to be replaced
        b.restore(blob)
        assert b.tokens == ids[:P]
        got = np.stack([b.decode(t) for t in ids[P:end]])
        assert np.array_equal(got, want), P
        assert maxdiff(got, ref["logits_full"][0][P:end]) <= TOL
        assert b.nbytes > 0


def test_snapshot_refuses_other_layouts(case):
    _, lm, ref, _, _ = case
    ids = ref["input_ids"][0].tolist()
    s = lm.new_session(ctx=len(ids))
    s.prefill(ids[:10])
    cache = s._cache
    lin = next(c for c in cache if c.meta_state["type"] == LINEAR)
    with pytest.raises(ValueError):
        lin.load({**lin.meta_state, "type": INDEXED}, lin.state)
    att = next(c for c in cache if c.meta_state["type"] == INDEXED)
    with pytest.raises(ValueError):
        att.load({**att.meta_state, "offset": 9}, att.state)


@pytest.mark.parametrize("n", [0, 13, 31])
def test_truncate_then_decode(case, n):
    _, lm, ref, _, _ = case
    ids = ref["input_ids"][0].tolist()
    s = lm.new_session(ctx=len(ids), chunk=11)
    s.prefill(ids)
    s.truncate(n)
    assert s.tokens == ids[:n]
    steps = np.stack([s.decode(t) for t in ids[n : n + 6]])
    assert maxdiff(steps, ref["logits_full"][0][n : n + 6]) <= TOL


def test_indexer_selection_is_live(case):
    """With an unlimited budget the logits move: the oracle sequence exercises the sparse
    QSA path (not only the dense short-context shortcut)."""
    _, lm, ref, _, _ = case
    ids = ref["input_ids"][0].tolist()
    indexers = [m for _, m in lm.model.named_modules() if isinstance(m, QSAIndexer)]
    assert indexers
    saved = [m.topk for m in indexers]
    try:
        for m in indexers:
            m.topk = 10**6
        assert maxdiff(lm.logits(ids), ref["logits_full"][0]) > 1e-2
    finally:
        for m, k in zip(indexers, saved):
            m.topk = k


def test_config_fields_match_transformers(case):
    folder, lm, _, _, cfg = case
    args = ModelArgs.from_dict(cfg)
    assert args.layer_types == cfg["layer_types"]
    assert args.ple_layer_ids == cfg["ple_layer_ids"]
    assert args.rotary_dim == int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"])
    # the PLE hash tables derived from the config are the checkpoint's int64 buffers
    weights = load_file(str(folder / "model.safetensors"))
    for i in cfg["ple_layer_ids"]:
        emb = lm.model.model.layers[i - 1].ple.ple_embedding
        for name, want in emb.buffers().items():
            assert weights[f"model.layers.{i - 1}.ple.ple_embedding.{name}"].tolist() == want


def test_sanitize_rejects_a_foreign_hash_table(oracle):
    folder = oracle(SCRIPT, None)
    cfg = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    key = "model.layers.0.ple.ple_embedding.layer_multipliers"
    weights[key] = weights[key] + 2
    with pytest.raises(ValueError, match="hash table"):
        LanguageModel.from_config(cfg, weights)


def test_vlm_names_and_nested_config(oracle):
    """The VLM checkpoint layout (`qwen4_exp` config with text_config, tensors under
    model.language_model.*, a vision tower to ignore) loads into the same graph."""
    folder = oracle(SCRIPT, None)
    cfg = json.loads((folder / "config.json").read_text())
    ref = np.load(folder / "reference.npz")
    weights = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
        for k, v in load_file(str(folder / "model.safetensors")).items()
    }
    weights["model.visual.patch_embed.weight"] = np.zeros((2, 2), np.float32)
    lm = LanguageModel.from_config({"model_type": "qwen4_exp", "text_config": cfg}, weights)
    assert maxdiff(lm.logits(ref["input_ids"][0].tolist()), ref["logits_full"][0]) <= TOL


def test_legacy_config_keys_fold_like_transformers():
    transformers = pytest.importorskip("transformers")
    legacy = dict(
        num_hidden_layers=6,
        full_attention_interval=3,
        rope_theta=5e6,
        partial_rotary_factor=0.5,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=128,
        indexer_budget=8,
        indexer_compress_ratio=4,
    )
    hf = transformers.Qwen4ExpTextConfig(**legacy)
    args = ModelArgs.from_dict(legacy)
    assert args.layer_types == hf.layer_types
    for k, v in args.rope_parameters.items():
        assert hf.rope_parameters[k] == v, k
    renamed = ModelArgs.from_dict({**legacy, "layer_types": [LINEAR, "full_attention"] * 3})
    assert (
        renamed.layer_types
        == transformers.Qwen4ExpTextConfig(**{**legacy, "layer_types": [LINEAR, "full_attention"] * 3}).layer_types
    )
    with pytest.raises(ValueError):
        ModelArgs.from_dict({**legacy, "ple_layer_ids": [3], "eos_token_id": 1})  # layer 3 is indexed


def test_family_modules():
    assert family_module("qwen4_exp_text").Model is family_module("qwen4_exp").Model


# ----------------------------------------------------------------------------- pieces


def _rand(shape, seed, scale=1.0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale)


@pytest.mark.parametrize("hk,hv", [(2, 4), (3, 3)])
def test_gated_delta_fast_op_matches_reference(hk, hv):
    """mx.fast.gated_delta_update (or its absence) == the plain recurrence, also when the
    sequence is split and the state carried."""
    B, T, Dk, Dv = 1, 23, 16, 8
    q = _rand((B, T, hk, Dk), 0, 0.25)
    k = _rand((B, T, hk, Dk), 1, 0.25)
    v = _rand((B, T, hv, Dv), 2)
    g = -mx.abs(_rand((B, T, hv), 3))
    beta = mx.sigmoid(_rand((B, T, hv), 4))
    y_ref, s_ref = gated_delta_reference(q, k, v, g, beta)
    y1, s1 = gated_delta(q[:, :9], k[:, :9], v[:, :9], g[:, :9], beta[:, :9])
    y2, s2 = gated_delta(q[:, 9:], k[:, 9:], v[:, 9:], g[:, 9:], beta[:, 9:], s1)
    assert maxdiff(mx.concatenate([y1, y2], axis=1), y_ref) <= 1e-5
    assert maxdiff(s2, s_ref) <= 1e-5


@pytest.mark.parametrize("kernel,dilation", [(4, 1), (3, 4)])
def test_causal_conv_carries_state(kernel, dilation):
    x = _rand((1, 17, 5), 5)
    w = _rand((5, kernel), 6)
    full, _ = causal_conv1d(x, w, None, dilation)
    xs = np.array(x)[0]
    want = np.zeros_like(xs)
    for t in range(17):
        for j in range(kernel):
            src = t - (kernel - 1 - j) * dilation
            if src >= 0:
                want[t] += np.array(w)[:, j] * xs[src]
    assert maxdiff(full[0], want) <= 1e-5
    state, outs = None, []
    for a, b in [(0, 1), (1, 6), (6, 7), (7, 17)]:
        y, state = causal_conv1d(x[:, a:b], w, state, dilation)
        outs.append(y)
    assert maxdiff(mx.concatenate(outs, axis=1), full) <= 1e-6


def test_demo_model_loads_and_decodes(tmp_path, monkeypatch):
    """`ds4mlx.load("demo:qwen4_exp")`: the random-weight demo with the DeepSeek tokenizer
    standing in for Qwen's (same EOS id); prefill, decode, snapshot/restore."""
    import ds4mlx
    from ds4mlx.models.qwen4_exp import DEMO_CONFIG

    monkeypatch.setenv("DS4MLX_CACHE", str(tmp_path))
    model, tok = ds4mlx.load("demo:qwen4_exp")
    assert model.args.model_type == "qwen4_exp_text" and model.vocab_size == DEMO_CONFIG["vocab_size"]
    assert tok.eos_id == DEMO_CONFIG["eos_token_id"] == model.args.eos_id
    ids = tok.encode("The quick brown fox.") + [tok.eos_id] + tok.encode("Again")
    s = model.new_session(ctx=64, chunk=4)
    last = s.prefill(ids)
    assert np.isfinite(last).all()
    assert maxdiff(last, model.logits(ids)[-1]) <= TOL
    blob = s.snapshot()
    a = s.decode(int(np.argmax(last)))
    s.restore(blob)
    assert np.array_equal(s.decode(int(np.argmax(last))), a)
