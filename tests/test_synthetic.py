"""The synthetic V4 Flash builder (`ds4mlx bench --synthetic`) at tiny shapes on CPU:
both expert formats build, route and give finite logits; GGUF blocks decode finite."""

from __future__ import annotations

import numpy as np
import pytest

from ds4mlx.bench.synthetic import build_synthetic_v4_flash
from ds4mlx.io.quant import as_qtype, dequantize, random_gguf_blocks
from ds4mlx.models.layers import QuantizedSwitchLinear
from ds4mlx.models.quantized import GGUFSwitchLinear, SplitSwitchLinear

TINY = dict(
    hidden_size=256,
    num_attention_heads=4,
    head_dim=64,
    partial_rotary_factor=0.5,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=64,
    moe_intermediate_size=256,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=8,
)


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "Q2_K", "Q4_K", "Q8_0"])
def test_random_gguf_blocks_decode_finite(qtype):
    b = random_gguf_blocks(qtype, 3, 4, 512)
    w = dequantize(np.array(b).reshape(-1), as_qtype(qtype), (12, 512))
    assert np.isfinite(w).all() and np.abs(w).max() > 0


@pytest.mark.parametrize("fmt", ["mlx", "gguf"])
def test_synthetic_builds_and_runs(fmt):
    lm, tok, info = build_synthetic_v4_flash(layers=4, experts=16, overrides=TINY, expert_format=fmt)
    experts = lm.model.model.layers[3].mlp.experts
    if fmt == "gguf":
        assert isinstance(experts.gate_up_proj, SplitSwitchLinear)
        assert experts.gate_up_proj.gate_proj.qtype.name == "IQ2_XXS" and experts.down_proj.qtype.name == "Q2_K"
        assert isinstance(experts.down_proj, GGUFSwitchLinear) and info["expert_bits"] == "iq2_xxs/q2_k"
    else:
        assert isinstance(experts.down_proj, QuantizedSwitchLinear) and info["expert_bits"] == 2
    session = lm.new_session(128)
    logits = session.prefill(tok.encode("a tiny synthetic model, prefilled and decoded"))
    logits = np.asarray(logits)
    assert logits.shape == (129280,) and np.isfinite(logits).all()
    assert np.isfinite(np.asarray(session.decode(int(np.argmax(logits))))).all()


def test_synthetic_rejects_unknown_format():
    with pytest.raises(ValueError, match="expert_format"):
        build_synthetic_v4_flash(layers=1, experts=8, overrides=TINY, expert_format="fp8")
