"""DeepSeek V4 MLX graph against transformers' reference (tiny random models, float32, CPU).

Three oracle configurations (tests/oracle/make_tiny_deepseek_v4.py, default and
`--config long|odd` from tests/oracle/deepseek_v4_configs.py) together cover sliding /
CSA / HCA attention, hash and top-k MoE, YaRN and plain compress rope, binding SwiGLU
clamps, hc_mult 2/3/4, and 40 / 100 / 150-token sequences that cross many compression
blocks and the sliding window.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from ds4mlx.models.base import load_hf_dir
from ds4mlx.models.deepseek_v4 import CSA, HCA, SLIDING, Indexer, ModelArgs

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import chunked_logits, load_case, maxdiff  # noqa: E402

CONFIGS = [None, "long", "odd"]
TOL = 1e-4
MIN_MARGIN = 3e-4


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c or "default")
def case(request, oracle):
    return load_case(oracle, "make_tiny_deepseek_v4.py", request.param)


def test_oracle_has_no_topk_near_ties(case):
    _, _, _, summary = case
    margins = summary["min_topk_margin"]
    assert len(margins) == 2, margins  # router and indexer call sites were both exercised
    assert min(margins.values()) >= MIN_MARGIN, margins


def test_configs_cover_every_layer_and_mlp_type(oracle):
    layer_types, mlp_types = set(), set()
    for name in CONFIGS:
        cfg = json.loads((oracle("make_tiny_deepseek_v4.py", name) / "config.json").read_text())
        layer_types |= set(cfg["layer_types"])
        mlp_types |= set(cfg["mlp_layer_types"])
    assert layer_types == {SLIDING, CSA, HCA}
    assert mlp_types == {"hash_moe", "moe"}


def test_full_forward_matches_transformers(case):
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    assert maxdiff(lm.logits(ids), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("chunk", [1, 3, 7, 13])
def test_chunked_forward_all_positions(case, chunk):
    """Every position's logits from a cached, chunked forward equal the full forward
    (chunk 1 is token-by-token decoding from an empty cache)."""
    _, lm, ref, _ = case
    assert maxdiff(chunked_logits(lm, ref["input_ids"][0].tolist(), chunk), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("chunk", [3, 13])
def test_session_prefill_then_decode(case, chunk):
    """Chunked prefill of P tokens, then token-by-token decode: equal to the full forward and
    to the oracle's own stepwise decode."""
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    P, full = int(ref["stepwise_start"]), ref["logits_full"][0]
    s = lm.new_session(ctx=len(ids), chunk=chunk)
    last = s.prefill(ids[:P])
    assert maxdiff(last, full[P - 1]) <= TOL
    steps = np.stack([s.decode(t) for t in ids[P:]])
    assert maxdiff(steps, full[P:]) <= TOL
    assert maxdiff(steps, ref["logits_stepwise"][0]) <= TOL
    assert s.tokens == ids and len(s) == len(ids)


def test_incremental_last_token(case):
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    s = lm.new_session(ctx=len(ids))
    s.prefill(ids[:-1])
    assert maxdiff(s.decode(ids[-1]), ref["logits_incremental_last"][0]) <= TOL


def test_config_fields_match_transformers(case):
    folder, _, _, _ = case
    cfg = json.loads((folder / "config.json").read_text())
    args = ModelArgs.from_dict(cfg)
    for k in ("layer_types", "mlp_layer_types", "compress_rates", "qk_rope_head_dim", "rope_parameters"):
        assert getattr(args, k) == cfg[k], k


def test_legacy_config_keys_fold_like_transformers():
    transformers = pytest.importorskip("transformers")
    legacy = dict(
        num_hidden_layers=5,
        compress_ratios=[0, 0, 4, 128, 4],
        num_hash_layers=2,
        qk_rope_head_dim=64,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    hf = transformers.DeepseekV4Config(**legacy)
    args = ModelArgs.from_dict(legacy)
    assert args.layer_types == hf.layer_types
    assert args.mlp_layer_types == hf.mlp_layer_types
    assert args.qk_rope_head_dim == hf.qk_rope_head_dim
    for kind in ("main", "compress"):
        for k, v in args.rope_parameters[kind].items():
            assert hf.rope_parameters[kind][k] == v, (kind, k)


def test_quantized_model_matches_dequantized_weights(oracle):
    """nn.quantize turns every projection (experts -> gather_qmm, grouped o_a_proj, linears,
    embedding) into quantized layers; they compute what the float graph computes with the
    dequantized weights."""
    folder = oracle("make_tiny_deepseek_v4.py", None)
    ids = np.load(folder / "reference.npz")["input_ids"][0].tolist()
    quant, dequant = load_hf_dir(str(folder)), load_hf_dir(str(folder))
    nn.quantize(quant.model, group_size=32, bits=4)
    kinds = {type(m).__name__ for _, m in quant.model.named_modules()}
    assert {"QuantizedSwitchLinear", "QuantizedGroupedLinear", "QuantizedLinear", "QuantizedEmbedding"} <= kinds
    shapes = {k: v.shape for k, v in tree_flatten(dequant.model.parameters())}
    updates = [
        (f"{path}.weight", mx.dequantize(m.weight, m.scales, m.biases, 32, 4).reshape(shapes[f"{path}.weight"]))
        for path, m in quant.model.named_modules()
        if type(m).__name__.startswith("Quantized")
    ]
    dequant.model.load_weights(updates, strict=False)
    assert maxdiff(quant.logits(ids), dequant.logits(ids)) <= TOL


def test_indexer_query_blocking(oracle, monkeypatch):
    """Scoring the indexer in small query blocks (bounded memory) changes nothing."""
    folder = oracle("make_tiny_deepseek_v4.py", "long")
    ref = np.load(folder / "reference.npz")
    lm = load_hf_dir(str(folder))
    monkeypatch.setattr(Indexer, "BLOCK_ELEMS", 1000)
    assert maxdiff(lm.logits(ref["input_ids"][0].tolist()), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("chunk", [7, 150])
def test_chunked_prefill_attention_as_matmuls(case, chunk, monkeypatch):
    """DS4MLX_PREFILL_SDPA=matmul (models/prefill_attention.py: the band and per-query
    attention as GEMMs around a float32 softmax) against transformers, chunked."""
    from ds4mlx.models import prefill_attention

    monkeypatch.setenv(prefill_attention.ENV, "matmul")
    _, lm, ref, _ = case
    assert maxdiff(chunked_logits(lm, ref["input_ids"][0].tolist(), chunk), ref["logits_full"][0]) <= TOL
