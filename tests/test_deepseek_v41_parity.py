"""DeepSeek V4.1 Flash MLX graph against mlx-lm's `deepseek_v41` (tiny random models, float32, CPU).

Two oracle configurations (tests/oracle/probe_mlx_deepseek_v41.py, default and
`--config mixed`):

* default: ratios 0/4/4/4; layer 1 is the KV, index and candidate-block source, layer 2
  re-scores layer 1's keys inside its candidate blocks, layer 3 reuses both; 40 tokens.
* mixed: ratios 0/4/4/8/8, KV sources 1 and 3, index sources 1, 2 and 3, no candidate
  blocks, YaRN compress rope, live FP4 rounding of the index queries and keys, a 6-token
  window, hc_mult 3; 48 tokens.

mlx-lm is the oracle: the probe saves its parameters (mlx-lm names) and logits; ds4mlx
loads them through `Model.sanitize`.  The probe records the smallest top-k margin of every
argpartition site (router, indexer, candidate blocks) so float noise cannot flip a pick.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.models import deepseek_v41 as v41
from ds4mlx.models.base import LanguageModel, load_hf_dir

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import chunked_logits, load_case, maxdiff  # noqa: E402

PROBE = "probe_mlx_deepseek_v41.py"
CONFIGS = [None, "mixed"]
TOL = 1e-4
MIN_MARGIN = 3e-4
SITES = {None: {"router", "indexer", "candidate_blocks"}, "mixed": {"router", "indexer"}}


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c or "default")
def case(request, oracle):
    return (request.param, *load_case(oracle, PROBE, request.param))


def _reload(folder, **changes) -> LanguageModel:
    cfg = dict(json.loads((folder / "config.json").read_text()), **changes)
    return LanguageModel.from_config(cfg, dict(mx.load(str(folder / "model.safetensors"))))


# ----------------------------------------------------------------------------- the oracle itself


def test_oracle_is_self_consistent_and_has_no_topk_near_ties(case):
    name, _, _, _, summary = case
    assert summary["finite"]
    assert summary["diff_prefill_vs_full"] <= 1e-5 and summary["diff_stepwise_vs_full"] <= 1e-5
    margins = summary["min_topk_margin"]
    assert set(margins) == SITES[name], margins  # every selection site was exercised
    assert min(margins.values()) >= MIN_MARGIN, margins


# ----------------------------------------------------------------------------- parity


def test_full_forward_matches_mlx_lm(case):
    _, _, lm, ref, _ = case
    assert maxdiff(lm.logits(ref["input_ids"][0].tolist()), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("chunk", [1, 3, 5, 7, 13])
def test_chunked_forward_all_positions(case, chunk):
    """Every position's logits from a cached, chunked forward equal the oracle's full forward
    (chunk 1 is token-by-token decoding from an empty cache)."""
    _, _, lm, ref, _ = case
    assert maxdiff(chunked_logits(lm, ref["input_ids"][0].tolist(), chunk), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("chunk", [3, 7])
def test_session_prefill_then_decode(case, chunk):
    """Chunked prefill of P tokens, then token-by-token decode: equal to the full forward and
    to the oracle's own stepwise decode."""
    _, _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    P, full = int(ref["stepwise_start"]), ref["logits_full"][0]
    s = lm.new_session(ctx=len(ids), chunk=chunk)
    assert maxdiff(s.prefill(ids[:P]), full[P - 1]) <= TOL
    steps = np.stack([s.decode(t) for t in ids[P:]])
    assert maxdiff(steps, full[P:]) <= TOL
    assert maxdiff(steps, ref["logits_stepwise"][0]) <= TOL
    assert s.tokens == ids


def test_incremental_last_token(case):
    _, _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    s = lm.new_session(ctx=len(ids))
    s.prefill(ids[:-1])
    assert maxdiff(s.decode(ids[-1]), ref["logits_incremental_last"][0]) <= TOL


# ----------------------------------------------------------------------------- session state


def test_snapshot_restore_rollback_bit_exact(case):
    """A snapshot taken with open compression groups (P % 4 and P % 8 != 0) and a full window,
    restored into a fresh session or rolled back onto the same one, decodes bit-identically."""
    _, _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    P = 22
    s = lm.new_session(ctx=len(ids), chunk=5)
    s.prefill(ids[:P])
    snap = s.snapshot()
    meta = json.loads(snap[20 : 20 + int.from_bytes(snap[12:20], "little")])["layers"]
    kv_layers = [m for m in meta if "comp" in m]
    assert kv_layers and all(m["comp"]["n"] == P // m["comp"]["ratio"] for m in kv_layers)
    first = np.stack([s.decode(t) for t in ids[P:]])

    fresh = lm.new_session(ctx=len(ids), chunk=5)
    fresh.restore(snap)
    assert fresh.tokens == ids[:P]
    assert np.array_equal(np.stack([fresh.decode(t) for t in ids[P:]]), first)

    s.restore(snap)  # roll back the session that went on
    assert np.array_equal(np.stack([s.decode(t) for t in ids[P:]]), first)
    assert maxdiff(first, ref["logits_full"][0][P:]) <= TOL


def test_restore_refuses_another_layout(case, oracle):
    name, _, lm, ref, _ = case
    other = load_hf_dir(str(oracle(PROBE, "mixed" if name is None else None)))
    s = other.new_session(ctx=64)
    s.prefill(ref["input_ids"][0].tolist()[:9])
    with pytest.raises(ValueError):
        lm.new_session(ctx=64).restore(s.snapshot())


def test_truncate_then_continue(case):
    _, _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    full = ref["logits_full"][0]
    s = lm.new_session(ctx=len(ids), chunk=6)
    s.prefill(ids)
    n = 17
    s.truncate(n)
    assert len(s) == n and s.tokens == ids[:n]
    assert maxdiff(s.last_logits, full[n - 1]) <= TOL
    assert maxdiff(np.stack([s.decode(t) for t in ids[n:]]), full[n:]) <= TOL


# ----------------------------------------------------------------------------- the paths are live


@pytest.mark.parametrize("fn", ["fake_fp8", "fake_fp4"])
def test_fake_quantization_is_live(case, fn, monkeypatch):
    """Without the FP8 / FP4 rounding the logits leave the tolerance: the oracle exercises it."""
    _, _, lm, ref, _ = case
    monkeypatch.setattr(v41, fn, lambda x, *a, **k: x)
    assert maxdiff(lm.logits(ref["input_ids"][0].tolist()), ref["logits_full"][0]) > 100 * TOL


def test_candidate_blocks_and_index_topk_are_live(oracle):
    folder = oracle(PROBE, None)
    ref = np.load(folder / "reference.npz")
    ids, full = ref["input_ids"][0].tolist(), ref["logits_full"][0]
    assert maxdiff(_reload(folder, candidate_topk_blocks=100).logits(ids), full) > 100 * TOL
    assert maxdiff(_reload(folder, index_topk=100).logits(ids), full) > 100 * TOL


def test_longer_sequence_chunking_is_self_consistent(case):
    """150 tokens (many groups, candidate blocks and window evictions): chunked == full."""
    _, _, lm, _, _ = case
    ids = np.random.default_rng(7).integers(0, lm.vocab_size, 150).tolist()
    full = lm.logits(ids)
    s = lm.new_session(ctx=len(ids), chunk=11)
    s.prefill(ids[:101])
    assert maxdiff(s.last_logits, full[100]) <= TOL
    assert maxdiff(np.stack([s.decode(t) for t in ids[101:]]), full[101:]) <= TOL


# ----------------------------------------------------------------------------- pieces


def test_fake_quant_matches_mlx_lm_bit_exactly():
    ref = pytest.importorskip("mlx_lm.models.deepseek_v41")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 64)).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0], (64, 1))
    grid = np.array([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0], np.float32)
    ties = np.tile(np.concatenate([grid, -grid[::-1], [6.0]]), (2, 1)).astype(np.float32)  # [2, 32], amax 6
    for a in (mx.array(x), mx.array(ties)):
        assert np.array_equal(np.array(v41.fake_fp8(a, 32)), np.array(ref._fake_quant_fp8(a, 32)))
        for block, e4m3 in ((16, True), (32, False)):
            ours = np.array(v41.fake_fp4(a, block, e4m3_scale=e4m3))
            assert np.array_equal(ours, np.array(ref._fake_quant_fp4(a, block_size=block, e4m3_scale=e4m3)))


def test_hub_checkpoint_names(oracle):
    """DeepSeek's checkpoint names load to the same model (mlx-lm's sanitize checks the renaming)."""
    ref_mod = pytest.importorskip("mlx_lm.models.deepseek_v41")
    folder = oracle(PROBE, None)
    cfg = json.loads((folder / "config.json").read_text())
    weights = dict(mx.load(str(folder / "model.safetensors")))
    hub = _to_hub(weights)
    back = ref_mod.Model(ref_mod.ModelArgs.from_dict(cfg)).sanitize(dict(hub))
    assert set(back) == set(weights) and all(np.array_equal(back[k], weights[k]) for k in weights)
    ids = np.load(folder / "reference.npz")["input_ids"][0].tolist()
    a = LanguageModel.from_config(cfg, hub).logits(ids)
    b = LanguageModel.from_config(cfg, weights).logits(ids)
    assert np.array_equal(a, b)
    hub["layers.1.attn.wq_a.scale"] = mx.ones((1,))
    with pytest.raises(ValueError, match="FP8/FP4"):
        LanguageModel.from_config(cfg, hub)


def _to_hub(weights: dict) -> dict:
    """mlx-lm names -> DeepSeek checkpoint names (the inverse of mlx-lm's renaming)."""
    pairs = [
        (".shared_experts.gate_proj.", ".shared_experts.w1."),
        (".shared_experts.down_proj.", ".shared_experts.w2."),
        (".shared_experts.up_proj.", ".shared_experts.w3."),
        (".self_attn.", ".attn."),
        (".mlp.", ".ffn."),
        (".input_layernorm.", ".attn_norm."),
        (".post_attention_layernorm.", ".ffn_norm."),
        (".attn_hc.", ".hc_attn_"),
        (".ffn_hc.", ".hc_ffn_"),
        (".sinks", ".attn_sink"),
        (".q_a_proj.", ".wq_a."),
        (".q_b_proj.", ".wq_b."),
        (".kv_proj.", ".wkv."),
        (".gate_proj.", ".wgate."),
        (".o_a_proj.", ".wo_a."),
        (".o_b_proj.", ".wo_b."),
        (".q_a_norm.", ".q_norm."),
        (".compressor.kv_norm.", ".compressor.norm."),
        (".indexer.k_proj.", ".indexer.wk."),
        (".gate.e_score_correction_bias", ".gate.bias"),
    ]
    out = {}
    for k, v in weights.items():
        if k == "model.embed_tokens.weight":
            out["embed.weight"] = v
            continue
        if k == "lm_head.weight":
            out["head.weight"] = v
            continue
        name = k[len("model.") :]
        if ".mlp.experts.switch_mlp." in name:
            layer = name.split(".")[1]
            w = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[name.split(".")[-2]]
            for e in range(v.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.{w}.weight"] = v[e]
            continue
        for a, b in pairs:
            name = name.replace(a, b)
        out[name] = v.reshape(-1, v.shape[-1]) if name.endswith(".wo_a.weight") else v
    return out


def test_config_validation():
    base = json.loads(json.dumps(v41.DEMO_CONFIG))
    with pytest.raises(ValueError, match="Engram"):
        v41.ModelArgs.from_dict(dict(base, engram_layer_ids=[2]))
    # an index layer with a smaller ratio than its key source would see unfinished groups
    with pytest.raises(ValueError, match="not complete"):
        v41.ModelArgs.from_dict(dict(base, compress_ratios=[0, 8, 4, 4], candidate_source_layer_id=-1))
    # candidate blocks over ratio-4 keys, read by a layer scoring ratio-8 keys (mlx-lm: broadcast error)
    with pytest.raises(ValueError, match="candidate"):
        v41.ModelArgs.from_dict(
            dict(base, compress_ratios=[0, 4, 8, 8], kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2])
        )
    nested = {"model_type": "deepseek_v41", "text_config": dict(base, model_type="x")}
    assert v41.ModelArgs.from_dict(nested).compress_ratios == base["compress_ratios"]


def test_demo_model_runs():
    cfg = v41.DEMO_CONFIG
    lm = LanguageModel.from_config(cfg, v41.demo_weights(cfg, 1))
    assert lm.vocab_size == 129280
    ids = np.random.default_rng(3).integers(0, 129280, 40).tolist()
    full = lm.logits(ids)
    s = lm.new_session(ctx=64, chunk=9)
    s.prefill(ids[:30])
    steps = np.stack([s.decode(t) for t in ids[30:]])
    assert np.isfinite(full).all() and maxdiff(steps, full[30:]) <= TOL
