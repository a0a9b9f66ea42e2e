"""The compiled decode step's launches as on CUDA (ds4mlx.bench.census), counted on the CPU:
a launch budget, so that a change that adds launches per token shows up in CI, not on the
next GPU run (the H200 profile of 2026-12-02 found 147 gathers per token from `rows[0]`
indexing, an arange per layer and the RoPE periods recomputed per token)."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.bench.census import decode_census
from ds4mlx.bench.synthetic import build_synthetic_v4_flash
from ds4mlx.kernels import dispatch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from launch_census import NARROW  # noqa: E402

pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


@pytest.fixture(scope="module")
def census():
    model, _, _ = build_synthetic_v4_flash(layers=4, experts=16, overrides=NARROW)  # CSA, HCA, 2 x SWA
    return decode_census(model, 2048)


def test_no_launch_hides_in_indexing(census):
    mlx = census["mlx"]
    assert mlx.get("Gather", 0) <= 1  # the embedding's only: `a[0]` is a gather in MLX, a view is not
    assert "Arange" not in mlx and "Concatenate" not in mlx  # constants and buffers live outside the step
    assert not [k for k in mlx if "Power" in k]  # the RoPE periods are evaluated once
    # the attention kernels' position metas: one multiply-add per step (was one per distinct meta: 4)
    assert mlx.get("CompiledBroadcastMultiplyAdd", 0) <= 1


def test_kernels_per_layer(census):
    k = census["kernels"]
    assert k["ds4mlx_attend"] == 4  # one attention launch per layer
    # one prologue launch per layer: attn_prep (sliding), with the compressor steps (attn_prologue:
    # HCA one compressor, CSA the attention's and the indexer's; was attn_prep + 1 or 2 compressor_step)
    assert k["ds4mlx_attn_prep"] == 2 and k["ds4mlx_attn_prologue1"] == k["ds4mlx_attn_prologue2"] == 1
    assert "ds4mlx_compressor_step" not in k
    # the CSA layer's indexer: scores and top-k in one launch (its last threadgroup runs the top-k)
    assert k["ds4mlx_index_topk"] == 1 and not {"ds4mlx_index_score_heads", "ds4mlx_topk"} & set(k)
    # the MoE in two launches per layer, routed and shared expert together (two weight banks): gate_up +
    # SwiGLU of both, then the routed down + weighted sum + the shared down (was 4: MODE 1 x 2, 2, 0)
    assert k["ds4mlx_affine_qmv2_gu[MODE=3]"] == 4
    assert k["ds4mlx_affine_qmv[MODE=0]"] == 12  # fused q_a + kv + compressors, q_b, o_a
    assert not {"ds4mlx_affine_qmv[MODE=1]", "ds4mlx_affine_qmv[MODE=2]"} & set(k)
    # no mHC site has a launch of its own but layer 0's hc_pre and the head's (2), and the last hc_post:
    # o_b's mat-vec runs hc_post + the next hc_pre (kernels/qmv_hc.py), so does every MoE's down
    # launch but the last layer's (was: a hc_post_dots_pre launch at each of the 7 sites between)
    # o_b's launch routes the token too (kernels/qmv_hc_route.py: was a moe_fold launch per layer)
    assert k["ds4mlx_affine_qmv_hc_route[MODE=0]"] == 4 and k["ds4mlx_affine_qmv2_down_hc[MODE=4]"] == 3
    assert not {"ds4mlx_affine_qmv_hc[MODE=0]", "ds4mlx_moe_fold", "ds4mlx_moe_route"} & set(k)
    assert k["ds4mlx_affine_qmv2_down[MODE=4]"] == 1 and k["ds4mlx_hc_post"] == 1
    assert k["ds4mlx_hc_dots_pre"] == 2 and "ds4mlx_hc_post_dots_pre" not in k
    assert not {"ds4mlx_hc_dots", "ds4mlx_hc_post_dots", "ds4mlx_hc_pre"} & set(k)  # (the two-launch split)


def test_launch_budget(census):
    # today's counts (47: the router apart from o_b's launch; 54: o_b and the MoE's down apart from the
    # next mHC site; 57: the compressor steps outside the attention prologue; 58: index_topk; 66: the
    # MoE's shared expert in the routed experts' launches; 69: the metas in one launch; the mHC tails:
    # 68 / 78 before): raise them only with a reason
    assert sum(census["kernels"].values()) <= 36
    assert not census["fills"]  # no launch asks MLX to fill its outputs (init_value): tickets reset themselves
    assert census["total"] <= 43
    assert census["total"] / census["layers"] <= 10.75


@pytest.mark.slow
def test_launch_budget_at_20_layers():
    """The budget as issue reports read it: 20 layers (9 CSA, 9 HCA, 2 sliding), one row: at most 9
    launches a layer (179: 8.95; 199 = 9.95 before the router ran inside o_b's launch, 238 = 11.90
    before o_b and the MoE's down ran inside the mHC launches)."""
    model, _, _ = build_synthetic_v4_flash(layers=20, experts=16, overrides=NARROW)
    c = decode_census(model, 2048)
    assert c["total"] <= 179 and c["total"] / c["layers"] <= 9.0


def test_batched_rows_share_the_attention_launch(census, monkeypatch):
    """Session batching: 3 sessions' step in one forward (stepper.step_rows) launches each
    layer's attention prologue with its compressors (attn_prologue_rows; sliding layers:
    attn_prep_rows), indexer scores + top-k (index_topk_rows) and attention (attend_rows) once
    for the 3 rows, as the projections, the MoE and the mHC launches: a launch count of one
    row's step.  The rows' o_b and MoE down inside the mHC launches (kernels/qmv_hc.py) count
    as they will once their GPU tests pass; until then (qmv_hc.AUTO_ROWS) rows keep two launches."""
    from ds4mlx.kernels import qmv_hc

    model, _, _ = build_synthetic_v4_flash(layers=4, experts=16, overrides=NARROW)
    default = decode_census(model, 2048, rows=3)["kernels"]
    assert "ds4mlx_affine_qmv_hc[MODE=0]" not in default and "ds4mlx_affine_qmv2_down_hc[MODE=4]" not in default
    monkeypatch.setattr(qmv_hc, "AUTO_ROWS", 8)
    rows = decode_census(model, 2048, rows=3)
    k, one = rows["kernels"], census["kernels"]
    assert k["ds4mlx_attend_rows3"] == 4 and k["ds4mlx_attn_prep_rows3"] == 2  # the sliding layers'
    # the compressed layers' prologues with their compressors' rows (attn_prologue_rows: HCA 1, CSA 2)
    assert k["ds4mlx_attn_prologue1_rows3"] == k["ds4mlx_attn_prologue2_rows3"] == 1
    assert k["ds4mlx_index_topk_rows3"] == 1
    assert not {"ds4mlx_attend", "ds4mlx_attn_prep", "ds4mlx_compressor_step", "ds4mlx_index_topk"} & set(k)
    assert not [name for name in k if name.startswith("ds4mlx_compressor_step")]
    for name in ("ds4mlx_affine_qmv[MODE=0]", "ds4mlx_affine_qmv2_gu[MODE=3]"):
        assert k[name] == one[name]
    # o_b's launch takes one token's router only (kernels/qmv_hc_route.py): the rows' routers are a
    # launch of their own per layer
    assert k["ds4mlx_affine_qmv_hc[MODE=0]"] == one["ds4mlx_affine_qmv_hc_route[MODE=0]"] == k["ds4mlx_moe_fold"]
    assert k["ds4mlx_affine_qmv2_down_hc[MODE=4]"] == one["ds4mlx_affine_qmv2_down_hc[MODE=4]"]
    # per extra row only its attention metas' multiply-add; at 8 rows 160 launches before
    # attend_rows, 128 with it, 107 with compressor_step_rows, 71 with attn_prep_rows (and the
    # rows' logits as views), 64 with index_topk_rows (one row: 57), 61 with attn_prologue_rows (one row: 54);
    # one row's router runs inside o_b's launch, the rows' in one launch a layer
    assert rows["total"] <= census["total"] + 2 + rows["layers"]


def test_placeholders_are_undone(census):
    """The census patches the kernel launcher and the backend choice only while it counts."""
    assert dispatch.Kernel.__call__.__qualname__ == "Kernel.__call__"
    if dispatch.gpu_backend() is None:
        assert dispatch.backend(mx.cpu) == "reference"


@pytest.fixture(scope="module")
def gguf_census():
    model, _, _ = build_synthetic_v4_flash(layers=4, experts=16, overrides=NARROW, expert_format="gguf")
    return decode_census(model, 2048)


def test_gguf_routed_experts_take_two_launches_per_layer(gguf_census, census):
    """ds4's GGUF experts (IQ2_XXS gate / up, Q2_K down): gate + up + SwiGLU in one launch,
    down + weighted sum in another (quant_moe's fused modes), as the MLX experts (was 7:
    two mat-vecs, a Concatenate, the SwiGLU, the down mat-vec, the weighting, a Sum)."""
    k, mlx = gguf_census["kernels"], gguf_census["mlx"]
    routed = {name: n for name, n in k.items() if "qmv" in name and "affine" not in name}
    assert routed == {"ds4mlx_qmv_swiglu_iq2_xxs": 4, "ds4mlx_qmv_down_sum_q2_k": 4}
    assert "Concatenate" not in mlx and mlx.get("Sum", 0) <= 1  # the final norm's only
    # the shared expert (MLX 8-bit) in today's two launches of its own: no two-bank modes for GGUF experts
    assert k["ds4mlx_affine_qmv[MODE=1]"] == 4 and k["ds4mlx_affine_qmv[MODE=0]"] == 16  # o_b: in qmv_hc
    # their down launch is not MODE 4: each FFN site keeps its own mHC launch
    assert k["ds4mlx_hc_post_dots_pre"] == 3 and "ds4mlx_affine_qmv2_down_hc[MODE=4]" not in k
    assert not [name for name in k if "qmv2" in name]
    # the same model with MLX experts, but for those two (was +20) and the FFN sites' own mHC launches
    assert gguf_census["total"] <= census["total"] + 2 * gguf_census["layers"] + gguf_census["layers"] - 1


def test_float_shared_expert_keeps_its_own_launches(census):
    """A float (unquantized) shared expert: the routed experts in their own two launches (MODE 1,
    MODE 2), the shared expert as MLX matmuls, no two-bank modes."""
    import mlx.nn as nn

    model, _, _ = build_synthetic_v4_flash(layers=4, experts=16, overrides=NARROW)
    for layer in model.model.model.layers:
        se = layer.mlp.shared_experts
        for name in ("gate_proj", "up_proj", "down_proj"):
            q = getattr(se, name)
            lin = nn.Linear(q.weight.shape[1] * 32 // q.bits, q.weight.shape[0], bias=False)
            lin.weight = mx.dequantize(q.weight, q.scales, q["biases"], q.group_size, q.bits)
            setattr(se, name, lin)
    c = decode_census(model, 2048)
    k = c["kernels"]
    assert k["ds4mlx_affine_qmv[MODE=1]"] == k["ds4mlx_affine_qmv[MODE=2]"] == 4
    assert not [name for name in k if "qmv2" in name]
    assert c["mlx"].get("Matmul", 0) >= 8  # the shared gate_up and down per layer


def _quantized_head(model):
    """`model` (LanguageModel of the synthetic V4) with an 8-bit lm_head, as a converted
    checkpoint has (the synthetic keeps it float)."""
    import mlx.nn as nn

    from ds4mlx.models.qmv_linear import use_fast_qmv

    m = model.model
    m.lm_head = nn.QuantizedLinear.from_linear(m.lm_head, group_size=64, bits=8)
    mx.eval(m.lm_head.parameters())
    use_fast_qmv(m)
    assert m.head_folds_norm()
    return model


def test_final_norm_runs_inside_a_quantized_head(census):
    """With a quantized lm_head the final RMSNorm is the head mat-vec's NORM (one launch per
    token less on a GPU: MLX's rms_norm kernel), and the head is our mat-vec, not a Matmul."""
    model, _, _ = build_synthetic_v4_flash(layers=4, experts=16, overrides=NARROW)
    c = decode_census(_quantized_head(model), 2048)
    mlx = c["mlx"]
    assert c["kernels"]["ds4mlx_affine_qmv[MODE=0]"] == census["kernels"]["ds4mlx_affine_qmv[MODE=0]"] + 1
    assert not {"Matmul", "Square", "Sum", "AsType"} & set(mlx) and not [k for k in mlx if "Rsqrt" in k]
    # the Matmul became our mat-vec; the norm's 4 CPU nodes (one rms_norm kernel on CUDA) are gone
    assert c["total"] == census["total"] - 4


def test_folded_head_step_equals_the_unfolded_one(monkeypatch):
    """The compiled step's logits with the norm folded into the quantized head equal (bit for
    bit on the CPU: the same two ops) those of head(norm(h)), over a few steps."""
    from ds4mlx.models import deepseek_v4
    from ds4mlx.runtime import stepper

    model, _, _ = build_synthetic_v4_flash(layers=2, experts=16, overrides=NARROW)
    model = _quantized_head(model)
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    outs, calls = [], []
    for fold in (True, False):
        stepper.forget(model.model)  # a new trace for each
        monkeypatch.setattr(deepseek_v4.Model, "head_folds_norm", lambda self, f=fold: calls.append(f) or f)
        s = model.new_session(ctx=64)
        s.prefill([3, 1, 4, 1, 5])
        outs.append(np.stack([np.array(s.decode(t)) for t in (9, 2, 6, 5)]))
    assert np.array_equal(outs[0], outs[1]) and set(calls) == {True, False}
