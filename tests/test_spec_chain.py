"""DeepSeek V4's verify chain as a GPU runs it (`stepper.step_chain`: one session's k + 1 tokens
as the compiled step's rows, row t over the state row t - 1 leaves), checked on the CPU.

* Launches (ds4mlx.bench.census, CUDA's faces counted on the CPU): the rows share every weight
  read of the step (the projections, the MoE, the head: the same launches as one step) and the
  indexer's scores + top-k (one launch for all rows); what stays per row is budgeted.
* Numbers: with the kernels on their reference faces in the GPU step's structure, the rows'
  shared indexer launch (over the last row's indexer rows) gives the plain steps' logits, in
  float32 and under the GPU weight policy (16-bit weights, float32 activations); greedy
  speculation under that policy gives plain greedy decoding's tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from ds4mlx.bench.census import decode_census
from ds4mlx.bench.synthetic import build_synthetic_v4_flash
from ds4mlx.kernels import attn_prologue, sparse_attention
from ds4mlx.models import deepseek_v4
from ds4mlx.models.layers import set_activation_dtype
from ds4mlx.runtime import stepper

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from launch_census import NARROW  # noqa: E402
from parity_helpers import load_case, maxdiff  # noqa: E402
from spec_helpers import compiled_small_buckets  # noqa: E402, F401  (autouse)

TOL = 1e-4


@pytest.fixture(scope="module")
def census_model():
    model, _, _ = build_synthetic_v4_flash(layers=4, experts=16, overrides=NARROW)  # CSA, HCA, 2 x SWA
    return model


@pytest.mark.usefixtures("cpu_unless_gpu_test")
@pytest.mark.parametrize("tokens", [2, 4])
def test_verify_chain_shares_the_steps_weight_launches(census_model, tokens, monkeypatch):
    from ds4mlx.kernels import qmv_hc

    # the chain's o_b and MoE down inside the mHC launches, as once their GPU tests pass (qmv_hc.AUTO_ROWS)
    monkeypatch.setattr(qmv_hc, "AUTO_ROWS", 8)
    one = decode_census(census_model, 2048)
    chain = decode_census(census_model, 2048, chain=tokens)
    k, k1 = chain["kernels"], one["kernels"]
    # every weight of the step read in launches shared by the rows: projections, MoE, mHC, head
    # (o_b and the MoE's down with the next mHC site: kernels/qmv_hc.py)
    for name in ("ds4mlx_affine_qmv[MODE=0]", "ds4mlx_affine_qmv2_gu[MODE=3]", "ds4mlx_affine_qmv2_down[MODE=4]"):
        assert k[name] == k1[name]
    for name in ("ds4mlx_affine_qmv2_down_hc[MODE=4]", "ds4mlx_hc_dots_pre"):
        assert k[name] == k1[name]
    # one token's router runs inside o_b's launch (kernels/qmv_hc_route.py); the rows' in one launch a layer
    layers = k1["ds4mlx_affine_qmv_hc_route[MODE=0]"]
    assert k["ds4mlx_affine_qmv_hc[MODE=0]"] == k["ds4mlx_moe_fold"] == layers and "ds4mlx_moe_fold" not in k1
    assert k[f"ds4mlx_attend_rows{tokens}"] == 4 and "ds4mlx_attend" not in k  # the rows' attention: one launch
    # the CSA layer's indexer over every row in one launch
    assert k[f"ds4mlx_index_topk_rows{tokens}"] == 1 and "ds4mlx_index_topk" not in k
    # every layer's prologue: one launch for the chain's rows, row t's ring and compressor states
    # those after rows 0..t (the sliding layers' attn_prep_chain, the compressed layers'
    # attn_prologue_chain with their compressor steps in it)
    assert k[f"ds4mlx_attn_prep_chain{tokens}"] == k1["ds4mlx_attn_prep"] and "ds4mlx_attn_prep" not in k
    for name in ("ds4mlx_attn_prologue1", "ds4mlx_attn_prologue2"):
        assert k[f"{name}_chain{tokens}"] == k1[name] and name not in k
    assert "ds4mlx_compressor_step" not in k
    # every row's attention and indexer metas: one multiply-add over the rows' positions, as one step's
    metas = lambda c: sum(v for name, v in c["mlx"].items() if name.endswith("MultiplyAdd"))  # noqa: E731
    assert metas(chain) == metas(one) == 1
    assert not chain["fills"]
    assert chain["total"] == one["total"] + layers  # a verify of any length: one step's launches and the routers


@pytest.mark.usefixtures("cpu_unless_gpu_test")
def test_verify_chain_census_pinned(census_model):
    """The chain's launch count on the 4-layer census model (CSA, HCA, 2 sliding), with
    qmv_hc's default (its rows wait for their GPU test: o_b and the MoE's down apart from the
    mHC site, as in the batched step) and as once they pass: a verify of 4 tokens costs 54 and
    47 launches against one step's 43, whose router runs inside o_b's launch (69 and 62 before the
    prologues and the metas ran once for the chain)."""
    from ds4mlx.kernels import qmv_hc

    assert decode_census(census_model, 2048, chain=4)["total"] <= 54
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qmv_hc, "AUTO_ROWS", 8)
        assert decode_census(census_model, 2048, chain=4)["total"] <= 47


def _bf16_weights(lm):
    """`lm` with every float weight rounded to bfloat16 and kept so (the GPU policy: weights as
    stored, float32 activations; the loader's `dtype=None`)."""
    cast = lambda a: a.astype(mx.bfloat16) if mx.issubdtype(a.dtype, mx.floating) else a  # noqa: E731
    lm.model.update(tree_map(cast, lm.model.parameters()))
    mx.eval(lm.model.parameters())
    set_activation_dtype(lm.model, mx.float32)  # what the loader sets from the policy
    assert lm.model.model.embed_tokens.weight.dtype == mx.bfloat16
    stepper.forget(lm.model)
    return lm


@pytest.fixture(params=["float32", "bf16-weights"])
def v4(request, oracle, monkeypatch):
    """(the tiny V4 oracle model, its ids) with the GPU step's structure on the reference faces
    and the rows' indexer launch stood in by its per-row reference (recorded in `calls`)."""
    _, lm, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", "long")
    if request.param == "bf16-weights":
        lm = _bf16_weights(lm)
    stepper.forget(lm.model)
    request.addfinalizer(lambda: stepper.forget(lm.model))
    monkeypatch.setattr(sparse_attention, "FORCE_FACE", "reference")
    calls = []
    real = sparse_attention.index_topk

    def rows_reference(qs, ws, keys, k, *, ns, poss, ratio, scale, backend=None):
        calls.append((len(qs), len({id(x) for x in keys})))
        if len(qs) < 2:
            return None
        kw = dict(ratio=ratio, scale=scale, backend="reference")
        return [real(q, w, kk, k, n=n, s=p, **kw) for q, w, kk, n, p in zip(qs, ws, keys, ns, poss)]

    monkeypatch.setattr(sparse_attention, "index_topk_rows", rows_reference)

    def chain_reference(*args, **kw):
        calls.append(("attn_prologue_chain", len(args[8])))  # (the chain's compressors)
        return attn_prologue.attn_prologue_chain(*args, **{**kw, "backend": "reference"})

    # the kernel's meaning (test_kernel_attn_prologue): each row over the state the row before it left
    monkeypatch.setattr(deepseek_v4, "attn_prologue_chain", chain_reference)
    return lm, ref["input_ids"][0].tolist(), calls


def test_chain_logits_equal_plain_steps(v4):
    lm, ids, calls = v4
    n = len(ids)
    plain = lm.new_session(ctx=n + 8, chunk=5)
    plain.prefill(ids[:4])
    want = np.stack([plain.decode(t) for t in ids[4:n]])
    s = lm.new_session(ctx=n + 8, chunk=5)
    s.prefill(ids[:4])
    got, pos = [s.decode(ids[4])[None]], 5  # the static step's first run: it is then checked
    for k in (1, 4, 2, 3, 4, 1, 3, 4):  # windows across the sliding window and the compressors' boundaries
        if pos + k + 1 > n:
            break
        got.append(np.array(s.verify(ids[pos : pos + k + 1])))
        pos += k + 1
    got = np.concatenate(got)
    assert maxdiff(got, want[: len(got)]) <= TOL
    # every layer's chain launch was taken: sliding (no compressor), HCA (one), CSA (two)
    assert {c[1] for c in calls if c[0] == "attn_prologue_chain"} == {0, 1, 2}
    calls = [c for c in calls if c[0] != "attn_prologue_chain"]
    # the rows' indexer launch was taken, every row over one (the last row's) indexer rows
    chained = [c for c in calls if c[0] > 1]
    assert chained and all(distinct == 1 for _, distinct in chained)


def test_greedy_speculation_equals_plain_greedy(v4):
    from ds4mlx.runtime.decode import decode_tokens, greedy
    from ds4mlx.speculative.acceptance import GreedyRule
    from ds4mlx.speculative.drafter import ScriptedDrafter
    from ds4mlx.speculative.loop import SpeculativeLoop

    lm, ids, _ = v4
    prompt, n = ids[:6], 40
    s = lm.new_session(ctx=len(prompt) + n + 8)
    want = list(decode_tokens(s, s.prefill(prompt), greedy(lm.vocab_size), limit=n))
    full = prompt + want

    def drafts(ctx, k):  # right but for one rotating position: rounds keep 0..k drafts
        at = len(ctx) % (k + 2)
        return [(t + 1) % lm.vocab_size if i == at else t for i, t in enumerate(full[len(ctx) : len(ctx) + k])]

    t = lm.new_session(ctx=len(prompt) + n + 8)
    loop = SpeculativeLoop(t, t.prefill(prompt), ScriptedDrafter(drafts), GreedyRule(lm.vocab_size), depth=3, limit=n)
    assert list(loop) == want
    assert 0 < loop.stats.accepted < loop.stats.drafted
