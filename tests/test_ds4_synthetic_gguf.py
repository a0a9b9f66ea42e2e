"""tools/ds4_synthetic_gguf.py (issue #27): the synthetic q2 GGUF has ds4's layout — the
tensor names ds4.c `weights_bind()` asks for and the types `weights_validate_layout()`
requires, the metadata and tokenizer ds4 reads, finite block scales — and ds4mlx loads and
runs it; tools/ds4_side_by_side.py joins the two engines' CSVs.  Tiny shapes on the CPU
(ds4 itself only takes the real shape; that check was made with ds4's CPU build by hand)."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 4  # two sliding-window layers, then one CSA (ratio 4) and one HCA (ratio 128)


# end to end (servers, several processes or models, whole files): the slow tier, which CI runs second
pytestmark = pytest.mark.slow


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The names ds4.c weights_bind() looks up and the types weights_validate_layout() requires
# of a q2 file (read off ds4.c, not off our quantizer's tables).
Q8_0 = {
    "attn_q_a",
    "attn_q_b",
    "attn_kv",
    "attn_output_a",
    "attn_output_b",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
    "output",
}
F16 = {
    "token_embd",
    "output_hc_fn",
    "hc_attn_fn",
    "hc_ffn_fn",
    "ffn_gate_inp",
    "attn_compressor_ape",
    "attn_compressor_kv",
    "attn_compressor_gate",
    "indexer.attn_q_b",
    "indexer.proj",
    "indexer_compressor_ape",
    "indexer_compressor_kv",
    "indexer_compressor_gate",
}
F32 = {
    "output_hc_base",
    "output_hc_scale",
    "output_norm",
    "hc_attn_scale",
    "hc_attn_base",
    "attn_norm",
    "attn_q_a_norm",
    "attn_kv_a_norm",
    "attn_sinks",
    "attn_compressor_norm",
    "indexer_compressor_norm",
    "hc_ffn_scale",
    "hc_ffn_base",
    "ffn_norm",
    "exp_probs_b",
}
EXPERTS = {"ffn_gate_exps": "IQ2_XXS", "ffn_up_exps": "IQ2_XXS", "ffn_down_exps": "Q2_K"}
LAYER_REQUIRED = [
    "hc_attn_fn",
    "hc_attn_scale",
    "hc_attn_base",
    "attn_norm",
    "attn_q_a",
    "attn_q_a_norm",
    "attn_q_b",
    "attn_kv",
    "attn_kv_a_norm",
    "attn_sinks",
    "attn_output_a",
    "attn_output_b",
    "hc_ffn_fn",
    "hc_ffn_scale",
    "hc_ffn_base",
    "ffn_norm",
    "ffn_gate_inp",
    "ffn_gate_exps",
    "ffn_up_exps",
    "ffn_down_exps",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
]
COMPRESSOR = ["attn_compressor_ape", "attn_compressor_kv", "attn_compressor_gate", "attn_compressor_norm"]
INDEXER = [
    "indexer.attn_q_b",
    "indexer.proj",
    "indexer_compressor_ape",
    "indexer_compressor_kv",
    "indexer_compressor_gate",
    "indexer_compressor_norm",
]
DS4_SPECIALS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
]


def _ratio(il: int) -> int:  # ds4.c ds4_layer_compress_ratio()
    return 0 if il < 2 else (4 if il % 2 == 0 else 128)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds4peer") / "tiny.gguf"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "ds4_synthetic_gguf.py"),
            "--tiny",
            "--layers",
            str(LAYERS),
            "--threads",
            "2",
            str(path),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert path.is_file() and '"layers": 4' in proc.stdout
    return path


@pytest.fixture(scope="module")
def reader(tiny_gguf):
    import gguf

    return gguf.GGUFReader(str(tiny_gguf))


def _base(name: str) -> str:
    """blk.3.indexer.proj.weight -> indexer.proj (ds4's names, weights_bind())."""
    parts = name.split(".")
    return ".".join(parts[2:-1] if parts[0] == "blk" else parts[:-1])


def test_every_tensor_has_ds4s_type(reader):
    seen = {}
    for t in reader.tensors:
        base, kind = _base(t.name), t.tensor_type.name
        seen[t.name] = kind
        if base in EXPERTS:
            assert kind == EXPERTS[base], t.name
        elif base in Q8_0:
            assert kind == "Q8_0", t.name
        elif base in F16:
            assert kind == "F16", t.name
        elif base in F32:
            assert kind == "F32", t.name
        elif base == "ffn_gate_tid2eid":
            assert kind == "I32" and int(t.name.split(".")[1]) < 3, t.name
        else:
            pytest.fail(f"{t.name}: a tensor ds4 does not bind")
    # every name ds4 binds, per layer as its compression ratio asks
    required = [
        "token_embd.weight",
        "output_hc_base.weight",
        "output_hc_fn.weight",
        "output_hc_scale.weight",
        "output_norm.weight",
        "output.weight",
    ]
    for il in range(LAYERS):
        names = LAYER_REQUIRED + (COMPRESSOR if _ratio(il) else []) + (INDEXER if _ratio(il) == 4 else [])
        names += ["ffn_gate_tid2eid"] if il < 3 else []
        required += [f"blk.{il}.{n}.weight" for n in names]
    missing = [n for n in required if n not in seen]
    assert not missing


def _field(reader, key):
    f = reader.fields[key]
    vals = [f.parts[i] for i in f.data]
    if f.types and f.types[-1].name == "STRING":
        return [bytes(v).decode() for v in vals]
    return [v.tolist()[0] if hasattr(v, "tolist") else v for v in vals]


def test_metadata_and_tokenizer_ds4_reads(reader):
    assert _field(reader, "general.architecture") == ["deepseek4"]
    assert _field(reader, "deepseek4.block_count") == [LAYERS]
    assert _field(reader, "deepseek4.attention.compress_ratios") == [_ratio(i) for i in range(LAYERS)]
    assert _field(reader, "deepseek4.hash_layer_count") == [3]
    assert len(_field(reader, "deepseek4.swiglu_clamp_exp")) == LAYERS
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == _field(reader, "deepseek4.vocab_size")[0] == 129280
    assert all(s in tokens for s in DS4_SPECIALS)
    assert len(_field(reader, "tokenizer.ggml.merges")) > 100_000


def test_blocks_are_random_with_finite_scales(reader):
    from ds4mlx.io.quant import as_qtype, dequantize

    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in ("IQ2_XXS", "Q2_K", "Q8_0") or not t.name.startswith("blk.3."):
            continue
        k = int(t.shape[0])  # ggml ne[0]: the row length
        raw = np.asarray(t.data).reshape(-1)
        row_bytes = raw.size // (int(np.prod(t.shape)) // k)
        w = dequantize(raw[: 4 * row_bytes], as_qtype(kind), (4, k))
        assert np.isfinite(w).all(), t.name
        rms_dot = float(np.sqrt((w.astype(np.float64) ** 2).sum(axis=1).mean()))  # |row| = a unit input's output
        assert 0.05 < rms_dot < 20, (t.name, rms_dot)
        assert len(np.unique(raw[:65536])) > 250  # random bytes, not a fill pattern


def test_ds4mlx_loads_and_runs_it(tiny_gguf):
    from ds4mlx.io.loader import load

    lm, tok = load(str(tiny_gguf), verbose=False)
    session = lm.new_session(128)
    logits = np.asarray(session.prefill(tok.encode("the synthetic ds4 file, prefilled and decoded")))
    assert logits.shape == (129280,) and np.isfinite(logits).all()
    nxt = np.asarray(session.decode(int(np.argmax(logits))))
    assert np.isfinite(nxt).all() and not np.array_equal(nxt, logits)


def test_hash_routes_are_distinct_experts():
    routes = _tool("ds4_synthetic_gguf").hash_routes((1000, 6), 16, seed=3)
    assert routes.dtype == np.int32 and routes.min() >= 0 and routes.max() < 16
    assert all(len(set(r)) == 6 for r in routes.tolist())


def _write_csv(path, rows):
    cols = ["ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kvcache_bytes"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows(rows)


def test_side_by_side_joins_by_frontier(tmp_path):
    sbs = _tool("ds4_side_by_side")
    _write_csv(tmp_path / "ds4.csv", [[2048, 2048, 1000.0, 32, 50.0, 1], [4096, 2048, 800.0, 32, 40.0, 2]])
    _write_csv(tmp_path / "ours.csv", [[2048, 2048, 250.0, 32, 25.0, 1]])
    out = tmp_path / "joined.csv"
    assert sbs.main([str(tmp_path / "ds4.csv"), str(tmp_path / "ours.csv"), "--layers", "20", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [r["ctx_tokens"] for r in rows] == ["2048", "4096"]
    assert float(rows[0]["prefill_ratio"]) == 0.25 and float(rows[0]["gen_ratio"]) == 0.5
    assert rows[1]["ds4mlx_gen_tps"] == "" and rows[1]["gen_ratio"] == ""
    table = sbs.markdown(sbs.join(sbs.read_rows(tmp_path / "ds4.csv"), sbs.read_rows(tmp_path / "ours.csv")), 20)
    assert "| 2,048 | 1,000.0 | 250.0 | 0.250 | 50.00 | 25.00 | 0.500 |" in table
    assert "| 4,096 | 800.0 | – | – | 40.00 | – | – |" in table
