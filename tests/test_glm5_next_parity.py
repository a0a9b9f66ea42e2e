"""GLM 5.3 Flash (transformers `glm5_next`, text model `glm5_next_text`) MLX graph against
transformers (tiny random models, float32, CPU).

Two oracle configurations (tests/oracle/make_tiny_glm5_next.py, default and `--config
long`) together cover KDA linear attention (bounded and unbounded forget gate, conv
kernels 4 and 3, one partial and three delta-rule chunks of 64 over 40 / 150 tokens),
NoPE MLA with the k-pool DSA indexer (kpool 4 / 8, two picked pools plus the tail),
"shared" indexed layers right after a full one (layers 1-2, and 0-1), mHC with
hc_mult 4 and 2, clamped SwiGLU dense and MoE layers, plain and group-limited routing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from ds4mlx.models.base import LanguageModel, family_module, load_hf_dir
from ds4mlx.models.glm5_next import INDEXED, LINEAR, ModelArgs
from ds4mlx.models.kda import LinearCache, kda_chunked, kda_recurrent, l2norm, short_conv
from ds4mlx.models.mla import MLAAttention, MLACache

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import chunked_logits, load_case, maxdiff  # noqa: E402

CONFIGS = [None, "long"]
TOL = 1e-4
MIN_MARGIN = 3e-4
SCRIPT = "make_tiny_glm5_next.py"


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c or "default")
def case(request, oracle):
    return load_case(oracle, SCRIPT, request.param)


def test_oracle_has_no_topk_near_ties(case):
    *_, summary = case
    margins = summary["min_topk_margin"]
    assert len(margins) >= 2, margins  # the k-pool indexer and the router were both exercised
    assert min(margins.values()) >= MIN_MARGIN, margins


def test_configs_cover_both_mixers_and_several_chunks(oracle):
    lengths, bounds = [], set()
    for name in CONFIGS:
        folder = oracle(SCRIPT, name)
        cfg = json.loads((folder / "config.json").read_text())
        T = np.load(folder / "reference.npz")["input_ids"].shape[1]
        assert {LINEAR, INDEXED} <= set(cfg["layer_types"]) and cfg["index_topk"] < T
        types = zip(cfg["layer_types"], cfg["indexer_types"])
        assert any(lt == INDEXED and it == "shared" for lt, it in types)
        lengths.append(T)
        bounds.add(cfg["linear_lower_bound"])
    assert max(lengths) > 2 * 64 and bounds == {-5.0, None}


def test_full_forward_matches_transformers(case):
    _, lm, ref, _ = case
    assert maxdiff(lm.logits(ref["input_ids"][0].tolist()), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("chunk", [1, 3, 7, 13, 64])
def test_chunked_forward_all_positions(case, chunk):
    """Every position's logits from a cached, chunked forward equal the full forward
    (chunk 1 is token-by-token decoding with the recurrent KDA form from an empty cache)."""
    _, lm, ref, _ = case
    assert maxdiff(chunked_logits(lm, ref["input_ids"][0].tolist(), chunk), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
@pytest.mark.parametrize("chunk", [1, 9])
def test_both_mla_forms(case, monkeypatch, form, chunk):
    _, lm, ref, _ = case
    monkeypatch.setattr(MLAAttention, "EXPAND_MIN_QUERIES", 1 if form == "expanded" else 10**9)
    ids = ref["input_ids"][0].tolist()
    assert maxdiff(chunked_logits(lm, ids, chunk), ref["logits_full"][0]) <= TOL
    assert maxdiff(lm.logits(ids), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("chunk", [3, 13])
def test_session_prefill_then_decode(case, chunk):
    """Chunked prefill of P tokens, then token-by-token decode: equal to the full forward and
    to the oracle's own stepwise decode."""
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    P, full = int(ref["stepwise_start"]), ref["logits_full"][0]
    s = lm.new_session(ctx=len(ids), chunk=chunk)
    assert maxdiff(s.prefill(ids[:P]), full[P - 1]) <= TOL
    steps = np.stack([s.decode(t) for t in ids[P:]])
    assert maxdiff(steps, full[P:]) <= TOL
    assert maxdiff(steps, ref["logits_stepwise"][0]) <= TOL
    assert s.tokens == ids


def test_incremental_last_token(case):
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    s = lm.new_session(ctx=len(ids), chunk=7)
    s.prefill(ids[:-1])
    assert maxdiff(s.decode(ids[-1]), ref["logits_incremental_last"][0]) <= TOL


def test_snapshot_restore_is_bit_exact(case):
    """snapshot -> decode; restore (fresh session, and rollback of the same one) -> decode gives
    bit-identical logits.  The snapshot holds the KDA conv context and recurrent state, the
    MLA latents and the k-pool indexer's pools and incomplete-pool buffers."""
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    P = int(ref["stepwise_start"])
    a = lm.args
    s = lm.new_session(ctx=len(ids), chunk=7)
    s.prefill(ids[:P])
    for i, c in enumerate(s._cache):
        if a.layer_types[i] == LINEAR:
            assert isinstance(c, LinearCache) and set(c.state) == {"conv", "recurrent"}
            assert c.state["recurrent"].dtype == mx.float32
        else:
            assert isinstance(c, MLACache)
            want = {"latent"} | ({"pools", "pool_k", "pool_gate"} if a.indexer_types[i] == "full" else set())
            assert set(c.state) == want and c.state["latent"].shape[1] == P
    blob = s.snapshot()
    first = np.stack([s.decode(t) for t in ids[P:]])
    s.restore(blob)  # rollback
    again = np.stack([s.decode(t) for t in ids[P:]])
    fresh = lm.new_session(ctx=len(ids))
    fresh.restore(blob)
    assert fresh.tokens == ids[:P]
    other = np.stack([fresh.decode(t) for t in ids[P:]])
    assert np.array_equal(first, again) and np.array_equal(first, other)
    assert maxdiff(first, ref["logits_full"][0][P:]) <= TOL


def test_snapshot_mid_chunk_then_prefill(case):
    """A snapshot taken in the middle of a k-pool / delta-rule chunk, restored, then continued
    with a multi-token prefill: equal to the uninterrupted session."""
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    s = lm.new_session(ctx=len(ids), chunk=5)
    s.prefill(ids[:11])
    blob = s.snapshot()
    want = s.prefill(ids[11:])
    t = lm.new_session(ctx=len(ids), chunk=5)
    t.restore(blob)
    assert np.array_equal(t.prefill(ids[11:]), want)
    assert maxdiff(want, ref["logits_full"][0][-1]) <= TOL


def test_truncate_then_decode(case):
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    P, full = int(ref["stepwise_start"]), ref["logits_full"][0]
    s = lm.new_session(ctx=len(ids), chunk=11)
    s.prefill(ids)
    s.truncate(P)
    assert len(s) == P and maxdiff(s.last_logits, full[P - 1]) <= TOL
    assert maxdiff(np.stack([s.decode(t) for t in ids[P:]]), full[P:]) <= TOL


def test_config_fields_match_transformers(case):
    folder, _, _, _ = case
    cfg = json.loads((folder / "config.json").read_text())
    args = ModelArgs.from_dict(cfg)
    for k in ("layer_types", "indexer_types", "mlp_layer_types", "head_dim", "linear_lower_bound"):
        assert getattr(args, k) == cfg[k], k
    assert cfg["model_type"] == "glm5_next_text"
    assert family_module("glm5_next_text").Model is family_module("glm5_next").Model


def test_config_defaults_and_validation_like_transformers():
    transformers = pytest.importorskip("transformers")
    for kw in ({}, {"linear_attn_config": {"num_heads": 8, "head_dim": 32, "short_conv_kernel_size": 3}}):
        hf = transformers.Glm5NextTextConfig(num_hidden_layers=9, pad_token_id=None, **kw)
        args = ModelArgs.from_dict({"num_hidden_layers": 9, **kw})
        for k in (
            "layer_types",
            "indexer_types",
            "mlp_layer_types",
            "linear_num_heads",
            "linear_head_dim",
            "linear_conv_kernel_dim",
            "linear_lower_bound",
            "head_dim",
        ):
            assert getattr(args, k) == getattr(hf, k), k
    bad = dict(num_hidden_layers=3, layer_types=[INDEXED, LINEAR, INDEXED], indexer_types=["full", "full", "shared"])
    with pytest.raises(ValueError, match="shared"):
        ModelArgs.from_dict(bad)
    with pytest.raises(ValueError):
        ModelArgs.from_dict({"qk_rope_head_dim": 64})


def test_vlm_checkpoint_layout_loads(oracle):
    """A `glm5_next` VLM config (text fields under text_config) with the tensors under
    `model.language_model.` plus a vision tower gives the same logits."""
    folder = oracle(SCRIPT, None)
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    vlm_w = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v for k, v in w.items()
    }
    vlm_w["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 3), np.float32)
    vlm_cfg = {"model_type": "glm5_next", "text_config": cfg, "vision_config": {}, "tie_word_embeddings": False}
    ids = np.load(folder / "reference.npz")["input_ids"][0].tolist()
    assert np.array_equal(LanguageModel.from_config(vlm_cfg, vlm_w).logits(ids), load_hf_dir(str(folder)).logits(ids))


def test_kda_chunked_matches_transformers_and_recurrent():
    """kda_chunked / kda_recurrent against transformers' torch reference functions, with a
    carried initial state and a sequence that ends in a partial chunk."""
    torch = pytest.importorskip("torch")
    from transformers.models.glm5_next import modeling_glm5_next as hf

    rng = np.random.default_rng(0)
    B, T, H, D = 1, 150, 3, 16
    q, k, v = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(3))
    g = (-5.0 / (1 + np.exp(-rng.standard_normal((B, T, H, D))))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
    s0 = (0.1 * rng.standard_normal((B, H, D, D))).astype(np.float32)
    tt = [torch.from_numpy(a) for a in (q, k, v, g, beta, s0)]
    want_o, want_s = hf.chunk_kimi_delta_attention(
        *tt[:5], initial_state=tt[5], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    mq, mk = l2norm(mx.array(q)) * D**-0.5, l2norm(mx.array(k))
    args = (mq, mk, mx.array(v), mx.array(g), mx.array(beta), mx.array(s0))
    o, s = kda_chunked(*args)
    assert maxdiff(o, want_o.numpy()) <= 1e-5 and maxdiff(s, want_s.numpy()) <= 1e-5
    o2, s2 = kda_recurrent(*args)
    assert maxdiff(o2, o) <= 1e-5 and maxdiff(s2, s) <= 1e-5


@pytest.mark.parametrize("group_elems", [None, 1])
def test_kda_chunked_is_stable_with_correlated_keys(monkeypatch, group_elems):
    """Nearly parallel keys, slow decay, large beta: the intra-chunk system is badly scaled
    (power-series inverses blow up to ~1e13 here); forward substitution stays at float32
    noise.  group_elems=1 solves one chunk at a time."""
    from ds4mlx.models import kda as kda_mod

    if group_elems is not None:
        monkeypatch.setattr(kda_mod, "GROUP_ELEMS", group_elems)
    rng = np.random.default_rng(3)
    B, T, H, D = 1, 150, 2, 16
    base = rng.standard_normal((1, 1, H, D))
    k = l2norm(mx.array((base + 0.05 * rng.standard_normal((B, T, H, D))).astype(np.float32)))
    q = l2norm(mx.array(rng.standard_normal((B, T, H, D)).astype(np.float32))) * D**-0.5
    v = mx.array(rng.standard_normal((B, T, H, D)).astype(np.float32))
    g = mx.array((-0.01 * rng.uniform(size=(B, T, H, D))).astype(np.float32))
    beta = mx.array(rng.uniform(0.5, 1.0, size=(B, T, H)).astype(np.float32))
    o, s = kda_recurrent(q, k, v, g, beta, None)
    o2, s2 = kda_chunked(q, k, v, g, beta, None)
    assert maxdiff(o2, o) <= 1e-5 and maxdiff(s2, s) <= 1e-5
    o3, s3 = kda_chunked(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], None)
    o4, s4 = kda_chunked(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], s3, chunk=16)
    assert maxdiff(mx.concatenate([o3, o4], axis=1), o) <= 1e-5 and maxdiff(s4, s) <= 1e-5


def test_short_conv_carries_context():
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((1, 17, 6)).astype(np.float32))
    w = mx.array(rng.standard_normal((6, 1, 4)).astype(np.float32))
    full, _ = short_conv(x, w, None)
    state, outs = None, []
    for a, b in [(0, 1), (1, 6), (6, 7), (7, 17)]:
        y, state = short_conv(x[:, a:b], w, state)
        outs.append(y)
    assert maxdiff(mx.concatenate(outs, axis=1), full) <= 1e-6


def test_demo_model_loads_and_decodes(tmp_path, monkeypatch):
    """`ds4mlx.load("demo:glm5_next")`: random weights, the DeepSeek tokenizer standing in for
    GLM's; prefill, decode, snapshot/restore."""
    import ds4mlx
    from ds4mlx.models.glm5_next import DEMO_CONFIG

    monkeypatch.setenv("DS4MLX_CACHE", str(tmp_path))
    model, tok = ds4mlx.load("demo:glm5_next")
    assert model.args.model_type == "glm5_next_text" and model.vocab_size == DEMO_CONFIG["vocab_size"]
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 2)
    s = model.new_session(ctx=128, chunk=5)
    last = s.prefill(ids)
    assert np.isfinite(last).all() and maxdiff(last, model.logits(ids)[-1]) <= TOL
    blob = s.snapshot()
    a = s.decode(int(np.argmax(last)))
    s.restore(blob)
    assert np.array_equal(s.decode(int(np.argmax(last))), a)
