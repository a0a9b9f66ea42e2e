"""The one-launch MoE router (ds4mlx/kernels/moe_route.py).

CPU: the reference face is the model's graph (Router.__call__) and agrees with float64
math; the shared GPU kernel text (`route`, `fold`), compiled with g++ (emulated
threadgroups, test_kernel_emulation.py), against float64 math: the same experts (as a
set) and weights; ties go to the lowest index; the slots come in descending order of the
selection value; the CUDA faces compile with nvcc for sm_90; `Router.step` hands the
router's arguments to the kernel on a GPU face and is `__call__` elsewhere.
GPU (``-m gpu``): both kernels against the reference face at V4 Flash shapes (1..16
tokens, hash layers, bf16 / f32 weights, sigmoid / softmax with 512 experts), and the
tiny V4 models' compiled decode with the kernels on vs off.

Stated bounds: weights within 1e-5 relative of float64 (a k-term sum and one division in
float32, the score function's exp / log rounding); the fold's logits are float32 sums
of H products (|d| <= (H + 2) u sum |x w|), far below the gaps of the test inputs.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from test_kernel_emulation import run_on_cpu  # noqa: E402  (tests/ is on sys.path under pytest)

from ds4mlx.kernels import dispatch
from ds4mlx.kernels import moe_route as mr

# exactness claims are about MLX's CPU kernels; `gpu` tests keep the default device
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


# ------------------------------------------------------------------ float64 oracle


def scores64(logits, score):
    lg = np.asarray(logits, np.float64)
    if score == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(lg, 0.0))
    if score == "sigmoid":
        return 1.0 / (1.0 + np.exp(-lg))
    z = np.exp(lg - lg.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def route64(logits, k, score, scaling, normalize=True, bias=None, table=None, ids=None, groups=1, topk_group=1):
    """-> (idx [n, k] in the kernel's slot order, weights [n, k], gap [n]: the selection
    value's margin between the k-th and (k+1)-th expert (and between the kept and dropped
    groups), inf for hash routing)."""
    sc = scores64(logits, score).reshape(-1, np.shape(logits)[-1])
    n, e = sc.shape
    choice = sc + (0.0 if bias is None else np.asarray(bias, np.float64))
    group_gap = np.full(n, np.inf)
    if groups > 1 and topk_group < groups:
        grouped = choice.reshape(n, groups, -1)
        top2 = -np.sort(-np.sort(grouped, axis=-1)[..., -2:].sum(-1), axis=-1)  # [n, G] descending
        group_gap = top2[:, topk_group - 1] - top2[:, topk_group]
        keep = top2[:, topk_group - 1 : topk_group]
        gsum = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
        choice = np.where((gsum >= keep)[..., None], grouped, -np.inf).reshape(n, e)
    if table is not None:
        idx = np.asarray(table)[np.asarray(ids).reshape(-1)]
        gap = np.full(n, np.inf)
    else:
        idx = np.stack([sorted(range(e), key=lambda j: (-choice[t, j], j))[:k] for t in range(n)])
        srt = -np.sort(-choice, axis=-1)
        gap = srt[:, k - 1] - srt[:, k] if k < e else np.full(n, np.inf)
        gap = np.minimum(np.where(np.isnan(gap), np.inf, gap), group_gap)
    w = np.take_along_axis(sc, idx, axis=-1)
    if normalize:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return idx, w * scaling, gap


def assert_routing(idx, w, want_idx, want_w, ordered=True):
    idx, w = np.asarray(idx), np.asarray(w, np.float64)
    if ordered:
        assert np.array_equal(idx, want_idx), (idx, want_idx)
        np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-7)
        return
    og, ow = np.argsort(idx, axis=-1), np.argsort(want_idx, axis=-1)
    assert np.array_equal(np.take_along_axis(idx, og, -1), np.take_along_axis(want_idx, ow, -1))
    np.testing.assert_allclose(np.take_along_axis(w, og, -1), np.take_along_axis(want_w, ow, -1), rtol=1e-5, atol=1e-7)


def problem(n, e, h, k, seed, vocab=50):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(np.float32)
    w = (rng.standard_normal((e, h)) * h**-0.5).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.1).astype(np.float32)
    table = np.stack([rng.permutation(e)[:k] for _ in range(vocab)]).astype(np.int32)
    ids = rng.integers(0, vocab, n).astype(np.int32)
    return x, w, bias, table, ids


# ------------------------------------------------------------------ the reference face


SELECTIONS = ["bias", "hash", "plain", "grouped"]


@pytest.mark.parametrize("score", mr.SCORES)
@pytest.mark.parametrize("selection", SELECTIONS)
def test_reference_face_is_the_model_graph_and_float64(score, selection):
    x, w, bias, table, ids = problem(4, 40, 32, 6, seed=len(score) + len(selection))
    logits = mx.array(x) @ mx.array(w).T
    kw = dict(k=6, score=score, scaling=1.5)
    if selection in ("bias", "grouped"):
        kw["bias"] = mx.array(bias)
    elif selection == "hash":
        kw.update(table=mx.array(table), ids=mx.array(ids))
    if selection == "grouped":
        kw.update(groups=5, topk_group=2)
    got = mr.route(logits, **kw, backend="reference")
    want = mr.reference(logits, **kw)
    assert all(mx.array_equal(g, wn).item() for g, wn in zip(got, want))
    i64, w64, gap = route64(
        np.array(logits),
        6,
        score,
        1.5,
        True,
        kw.get("bias"),
        kw.get("table"),
        kw.get("ids"),
        kw.get("groups", 1),
        kw.get("topk_group", 1),
    )
    assert np.all(gap > 1e-5)
    assert_routing(got[0], got[1], i64, w64, ordered=selection == "hash")


def test_router_step_is_call_off_the_gpu(oracle):
    """On the CPU (the reference face) `Router.step` is `Router.__call__`, primitive for primitive."""
    from parity_helpers import load_case

    _, lm, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", "long")
    x = mx.random.normal((1, 3, lm.model.args.hidden_size), key=mx.random.key(3))
    ids = mx.array(ref["input_ids"][:, :3].astype(np.int32))
    for layer in lm.model.model.layers:
        gate = layer.mlp.gate
        a, b = gate(x, ids), gate.step(x, ids)
        assert all(mx.array_equal(p, q).item() for p, q in zip(a, b))


def test_router_step_hands_its_arguments_to_the_kernel(oracle, monkeypatch):
    """On a GPU face `Router.step` calls `moe_route.router` with the layer's weight, k,
    scoring, scale and its bias or hash table + token ids (checked here through the
    reference face)."""
    from parity_helpers import load_case

    _, lm, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", "long")
    calls = []

    def fake_router(x, weight, **kw):
        calls.append(kw)
        kw.pop("backend", None)
        return mr.reference(mr.router_logits(x, weight), **kw)

    monkeypatch.setattr(mr, "decode_face", lambda rows: "cuda" if rows <= mr.MAX_ROWS else None)
    monkeypatch.setattr(mr, "router", fake_router)
    x = mx.random.normal((1, 2, lm.model.args.hidden_size), key=mx.random.key(4))
    ids = mx.array(ref["input_ids"][:, :2].astype(np.int32))
    args = lm.model.args
    for layer in lm.model.model.layers:
        gate = layer.mlp.gate
        want = gate(x, ids)
        got = gate.step(x, ids)
        assert_routing(got[0], got[1], np.array(want[0]), np.array(want[1]), ordered=False)
        kw = calls[-1]
        assert kw["k"] == args.num_experts_per_tok and kw["score"] == args.scoring_func
        assert kw["scaling"] == args.routed_scaling_factor and kw["normalize"] is True
        assert ("table" in kw and kw["table"] is not None) == hasattr(gate, "tid2eid")
    assert len(calls) == len(lm.model.model.layers)
    big = mx.zeros((1, mr.MAX_ROWS + 1, args.hidden_size))
    lm.model.model.layers[-1].mlp.gate.step(big, mx.zeros((1, mr.MAX_ROWS + 1), mx.int32))
    assert len(calls) == len(lm.model.model.layers)  # more rows than a decode step: the plain graph


def test_decode_face_rows(monkeypatch):
    """The decode step routes with the kernel on a GPU face for up to MAX_ROWS tokens, with
    the reference face's plain graph otherwise."""
    monkeypatch.setattr(mr, "_face", lambda backend: "cuda")
    assert mr.decode_face(1) == "cuda" and mr.decode_face(mr.MAX_ROWS) == "cuda"
    assert mr.decode_face(mr.MAX_ROWS + 1) is None
    monkeypatch.setattr(mr, "_face", lambda backend: "reference")
    assert mr.decode_face(1) is None


@pytest.mark.parametrize("script", ["make_tiny_glm_moe_dsa.py", "make_tiny_glm5_next.py"])
def test_glm_router_step(oracle, script, monkeypatch):
    """GLM 5.x's sigmoid router (`sigmoid_moe.TopkRouter`, group-limited in the tiny GLM 5.2
    model): `step` is `__call__` off the GPU; on a GPU face it hands the group rule, the
    renormalisation flag and the scale to `moe_route.router` (checked through the
    reference face), and `MoE.step` equals `MoE.__call__`."""
    from parity_helpers import load_case

    from ds4mlx.models import sigmoid_moe

    _, lm, _, _ = load_case(oracle, script, None)
    moes = [m for _, m in lm.model.named_modules() if isinstance(m, sigmoid_moe.MoE)]
    assert moes
    x = mx.random.normal((1, 3, moes[0].gate.weight.shape[1]), key=mx.random.key(5))
    for moe in moes:
        a, b = moe.gate(x), moe.gate.step(x)
        assert all(mx.array_equal(p, q).item() for p, q in zip(a, b))
        assert mx.array_equal(moe(x), moe.step(x)).item()
        assert mx.array_equal(moe(x), sigmoid_moe.mlp_step(moe, x)).item()
    calls = []

    def fake_router(x, weight, **kw):
        calls.append(kw)
        return mr.reference(mr.router_logits(x, weight), **kw)

    monkeypatch.setattr(mr, "decode_face", lambda rows: "cuda")
    monkeypatch.setattr(mr, "router", fake_router)
    for moe in moes:
        want = moe.gate(x)
        got = moe.gate.step(x)
        assert_routing(got[0], got[1], np.array(want[0]), np.array(want[1]), ordered=False)
        kw = calls[-1]
        assert kw["score"] == "sigmoid" and kw["groups"] == moe.gate._groups
        assert kw["topk_group"] == moe.gate._topk_group and kw["normalize"] == moe.gate._norm
    assert any(kw["groups"] > 1 and kw["topk_group"] < kw["groups"] for kw in calls) or "glm5_next" in script


# ------------------------------------------------------------------ sources


@pytest.mark.parametrize("kind", ["route", "fold"])
def test_metal_and_cuda_share_one_description(kind):
    sec = dispatch.sections(mr.SOURCE)
    mh, mb = mr.kernel_sources(kind, "metal")
    ch, cb = mr.kernel_sources(kind, "cuda")
    assert mh.endswith(sec["common"]) and ch.endswith(sec["common"])
    assert mb.endswith(sec[kind] + sec["core"]) and cb.endswith(sec[kind] + sec["core"])
    for word in ("device ", "threadgroup ", "simd_sum", "as_type", " uint ", "metal::"):
        assert word not in cb, word  # the face-specific words live in the common section's #if blocks


# ------------------------------------------------------------------ the shared GPU text, compiled for the CPU


GROUPING = {"grouped": (4, 2)}  # selection -> (groups, topk_group); else (1, 1)


def _consts(e, k, score, selection, normalize, threads):
    groups, topg = GROUPING.get(selection, (1, 1))
    return {
        "E": e,
        "K": k,
        "SCORE": mr.SCORES.index(score),
        "BIAS": selection in ("bias", "grouped"),
        "HASH": selection == "hash",
        "NORM": normalize,
        "GROUPS": groups,
        "TOPG": topg,
        "THREADS": threads,
    }


def _want(logits, k, score, selection, normalize, scaling, bias, table, ids):
    b = bias if selection in ("bias", "grouped") else None
    t, i = (table, ids) if selection == "hash" else (None, None)
    return route64(logits, k, score, scaling, normalize, b, t, i, *GROUPING.get(selection, (1, 1)))


def _selection_arrays(selection, bias, table, ids):
    return {
        "bias": bias if selection in ("bias", "grouped") else np.zeros(1, np.float32),
        "table": table if selection == "hash" else np.zeros(1, np.int32),
        "ids": ids if selection == "hash" else np.zeros(1, np.int32),
    }


def _emu_route(tmp_path, logits, k, score, selection, normalize, scaling, bias, table, ids, threads):
    n, e = logits.shape
    sec = dispatch.sections(mr.SOURCE)
    consts = _consts(e, k, score, selection, normalize, threads)
    consts["TL"] = np.float32
    return run_on_cpu(
        tmp_path,
        sec["common"],
        sec["route"] + sec["core"],
        inputs={"logits": logits, **_selection_arrays(selection, bias, table, ids), "prm": np.float32([scaling])},
        outputs={"idx": ((n, k), np.int32), "wts": ((n, k), np.float32)},
        consts=consts,
        groups=(1, n, 1),
        threads=threads,
    )


ROUTE_CASES = [  # (n, e, k, threads, score, selection, normalize)
    (3, 256, 6, 256, "sqrtsoftplus", "bias", True),  # V4 Flash
    (2, 256, 6, 256, "sqrtsoftplus", "hash", True),
    (3, 100, 8, 64, "sqrtsoftplus", "plain", True),  # two experts per thread, a ragged last one
    (2, 128, 8, 64, "sigmoid", "bias", False),
    (2, 72, 4, 32, "softmax", "plain", True),
    (1, 6, 6, 32, "sigmoid", "bias", True),  # k = E: every expert
    (3, 256, 8, 256, "sigmoid", "grouped", True),  # GLM 5.x-style: 2 of 4 groups of 64, then top-8
    (2, 40, 6, 32, "sigmoid", "grouped", False),  # 10 experts per group, two per thread
]


@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: "n{}_e{}_k{}_t{}_{}_{}_{}".format(*c))
@pytest.mark.slow_after(1)
def test_shared_route_text(case, tmp_path):
    n, e, k, threads, score, selection, normalize = case
    _, _, bias, table, ids = problem(n, e, 8, k, seed=e + k)
    logits = np.random.default_rng(e).standard_normal((n, e)).astype(np.float32) * 2.0
    got = _emu_route(tmp_path, logits, k, score, selection, normalize, 1.5, bias, table, ids, threads)
    want_idx, want_w, gap = _want(logits, k, score, selection, normalize, 1.5, bias, table, ids)
    assert np.all(gap > 1e-5)
    assert_routing(got["idx"], got["wts"], want_idx, want_w)  # slots in descending order of the selection value


def test_shared_route_text_ties_and_nans(tmp_path):
    """Exact ties go to the lowest expert index; NaN logits still fill every slot with a
    distinct expert (order keys: a total order), never an out-of-range index."""
    e, k = 64, 6
    logits = np.zeros((3, e), np.float32)
    logits[0, [9, 40]] = 3.0  # 2 winners, then 62 tied experts
    logits[1] = np.round(np.random.default_rng(2).standard_normal(e), 0)  # many ties in a few values
    logits[2] = np.nan
    logits[2, [5, 7]] = 1.0
    got = _emu_route(tmp_path, logits, k, "sqrtsoftplus", "plain", True, 1.0, None, None, None, 64)
    assert got["idx"][0].tolist() == [9, 40, 0, 1, 2, 3]
    assert got["idx"][1].tolist() == sorted(range(e), key=lambda j: (-logits[1, j], j))[:k]
    assert len(set(got["idx"][2].tolist())) == k and all(0 <= i < e for i in got["idx"][2])


def _bf16_pack(w32):
    """-> (the bf16 values as float32, their bits packed two per uint32 as MLX lays out bf16)."""
    bits = (w32.view(np.uint32) + 0x8000) & 0xFFFF0000  # round half up is enough for test data
    vals = bits.view(np.float32)
    return vals, (bits >> 16).astype(np.uint16).view(np.uint32)


def _emu_fold(tmp_path, x, w_in, e, k, score, selection, normalize, scaling, bias, table, ids, threads, rpt, wb, xb=4):
    """x float32 [n, h], or (xb == 2) its bf16 bits packed two per uint32 [n, h / 2]."""
    n, h = x.shape[0], x.shape[1] * (2 if xb == 2 else 1)
    sec = dispatch.sections(mr.SOURCE)
    nb = -(-e // rpt)
    consts = _consts(e, k, score, selection, normalize, threads)
    consts.update({"H": h, "RPT": rpt, "NB": nb, "WB": wb, "XB": xb})
    return run_on_cpu(
        tmp_path,
        sec["common"],
        sec["fold"] + sec["core"],
        inputs={
            "x": x,
            "w": w_in,
            **_selection_arrays(selection, bias, table, ids),
            "prm": np.float32([scaling]),
            "tickets": np.zeros(n + 2, np.uint32),  # the persistent buffer: zero at launch
        },
        outputs={"idx": ((n, k), np.int32), "wts": ((n, k), np.float32), "scratch": ((n, e), np.float32)},
        consts=consts,
        groups=(nb, n, 1),
        threads=threads,
        inout=("tickets",),
    )


FOLD_CASES = [  # (n, e, h, k, threads, rpt, score, selection, bf16 weight, bf16 x)
    (2, 72, 1024, 6, 128, 2, "sqrtsoftplus", "bias", False, False),  # 2 warps per row along H, 2 steps each
    (2, 72, 1024, 6, 128, 2, "sqrtsoftplus", "hash", True, False),
    (1, 51, 128, 4, 64, 2, "softmax", "plain", True, False),  # a ragged last threadgroup (51 logits, 2 per group)
    (2, 64, 256, 6, 64, 2, "sigmoid", "grouped", False, False),
    (1, 256, 4096, 6, 256, mr.FOLD_RPT, "sqrtsoftplus", "bias", True, False),  # V4 Flash, the launch's own shape
    (1, 256, 4096, 6, 256, mr.FOLD_RPT, "sqrtsoftplus", "bias", True, True),  # ... with the decode step's bf16 x
    (2, 51, 128, 4, 64, 2, "softmax", "hash", True, True),
]


def _round_bf16(a):
    """float64 -> the nearest bfloat16 (ties to even), as float64."""
    u = np.asarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("case", FOLD_CASES, ids=lambda c: "n{}_e{}_h{}_k{}_t{}_r{}_{}_{}_w{}_x{}".format(*c))
@pytest.mark.slow_after(1)
def test_shared_fold_text(case, tmp_path):
    n, e, h, k, threads, rpt, score, selection, bf16, bf16_x = case
    x, w, bias, table, ids = problem(n, e, h, k, seed=e + h)
    w_vals, w_in = _bf16_pack(w) if bf16 else (w, w)
    x_vals, x_in = _bf16_pack(x) if bf16_x else (x, x)
    got = _emu_fold(
        tmp_path, x_in, w_in, e, k, score, selection, True, 1.5, bias, table, ids, threads, rpt,
        2 if bf16 else 4, 2 if bf16_x else 4,
    )  # fmt: skip
    logits = x_vals.astype(np.float64) @ w_vals.astype(np.float64).T
    if bf16_x:  # each logit rounded to bf16 (a float32 sum in another order may round to a neighbour)
        assert np.all(got["scratch"][:, :e] == _round_bf16(got["scratch"][:, :e]))
        np.testing.assert_allclose(got["scratch"][:, :e], logits, rtol=2.0**-8, atol=(h + 2) * 2.0**-23 * 8 * h**0.5)
        logits = got["scratch"][:, :e].astype(np.float64)  # the routing of those logits
    else:
        np.testing.assert_allclose(got["scratch"][:, :e], logits, rtol=0, atol=(h + 2) * 2.0**-23 * 8 * h**0.5)
    assert not got["tickets"].any()  # zero again: the threadgroup that counted last reset it
    want_idx, want_w, gap = _want(logits, k, score, selection, True, 1.5, bias, table, ids)
    assert np.all(gap > 1e-4)
    assert_routing(got["idx"], got["wts"], want_idx, want_w)


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc (no GPU)


NVCC_CASES = [
    ("route", "bias", "float32"),
    ("route", "hash", "bfloat16"),
    ("route", "plain", "float32"),
    ("route", "grouped", "float32"),
    ("fold", "bias", "bfloat16"),
    ("fold", "grouped", "bfloat16"),
    ("fold", "hash", "float32"),
    ("fold", "bias", "bfloat16 x"),
]


@pytest.mark.parametrize("kind,selection,dtype", NVCC_CASES)
@pytest.mark.slow_after(1)
def test_cuda_face_compiles_with_nvcc(kind, selection, dtype, tmp_path):
    """The exact CUDA translation unit mx.fast.cuda_kernel builds at V4 Flash shapes, compiled
    for sm_90 (H200) by nvcc with warnings as errors (the g++ emulation checks the logic)."""
    from test_kernel_emulation import nvcc_compile

    family = [_cuda_source(*case) for case in NVCC_CASES]
    nvcc_compile(tmp_path, _cuda_source(kind, selection, dtype), family=family)


def _cuda_source(kind, selection, dtype):
    from test_kernel_emulation import mlx_cuda_source

    f, i = "float32", "int32"
    h, b = mr.kernel_sources(kind, "cuda")
    sel = {"bias": f, "table": i, "ids": i, "prm": f}
    tmpl = mr.launch_template(
        256,
        6,
        "sigmoid" if selection == "grouped" else "sqrtsoftplus",
        True,
        mx.zeros((1,)) if selection in ("bias", "grouped") else None,
        mx.zeros((1, 6), mx.int32) if selection == "hash" else None,
        *((8, 4) if selection == "grouped" else (1, 1)),
    )
    tmpl = [(n, str(v).rsplit(".", 1)[-1] if isinstance(v, mx.Dtype) else v) for n, v in tmpl]
    if kind == "route":
        ins, outs = {"logits": dtype, **sel}, {"idx": i, "wts": f}
        tmpl.append(("TL", dtype))
    else:
        x_dt, dtype = ("bfloat16", "bfloat16") if dtype == "bfloat16 x" else (f, dtype)
        ins, outs = {"x": x_dt, "w": dtype, **sel, "tickets": "uint32"}, {"idx": i, "wts": f, "scratch": f}
        tmpl += [("TW", dtype), ("WB", 2 if dtype == "bfloat16" else 4), ("XB", 2 if x_dt == "bfloat16" else 4)]
        tmpl += [("H", 4096), ("RPT", mr.FOLD_RPT)]
        tmpl.append(("NB", 256 // mr.FOLD_RPT))
    return mlx_cuda_source(f"moe_{kind}", h, b, ins, outs, tmpl)


# ------------------------------------------------------------------ GPU (the lent H200)


def _gpu_face():
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    return face


GPU_CASES = [  # (n, e, h, k, score, selection, weight dtype)
    (1, 256, 4096, 6, "sqrtsoftplus", "bias", "bfloat16"),  # V4 Flash decode
    (1, 256, 4096, 6, "sqrtsoftplus", "hash", "bfloat16"),
    (4, 256, 4096, 6, "sqrtsoftplus", "bias", "float32"),
    (16, 256, 4096, 6, "sqrtsoftplus", "bias", "bfloat16"),  # session batching's widest step
    (3, 512, 2048, 8, "sigmoid", "bias", "bfloat16"),
    (3, 512, 2048, 10, "softmax", "plain", "float32"),
    (2, 72, 64, 6, "sqrtsoftplus", "hash", "float32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "n{}_e{}_h{}_k{}_{}_{}_{}".format(*c))
@pytest.mark.parametrize("fold", [False, True])
def test_gpu_router_equals_reference(case, fold):
    face = _gpu_face()
    n, e, h, k, score, selection, wdt = case
    if fold and face != "cuda":
        pytest.skip("the fold runs on CUDA only")
    x, w, bias, table, ids = problem(n, e, h, k, seed=n + e + k)
    xm, wm = mx.array(x)[None], mx.array(w).astype(getattr(mx, wdt))
    kw = dict(k=k, score=score, scaling=1.5)
    if selection == "bias":
        kw["bias"] = mx.array(bias)
    elif selection == "hash":
        kw.update(table=mx.array(table), ids=mx.array(ids)[None])
    with mx.stream(mx.cpu):
        want = mr.reference(mr.router_logits(xm, wm), **kw)
        mx.eval(want)
    logits64 = x.astype(np.float64) @ np.array(wm.astype(mx.float32), np.float64).T
    *_, gap = route64(logits64, k, score, 1.5, True, kw.get("bias"), table if selection == "hash" else None, ids)
    assert np.all(gap > 1e-4)
    got = mr.router(xm, wm, **kw, backend=face, fold=fold)
    assert got[0].shape == (1, n, k) and got[0].dtype == mx.int32 and got[1].dtype == mx.float32
    assert_routing(got[0][0], got[1][0], np.array(want[0][0]), np.array(want[1][0]), ordered=selection == "hash")


@pytest.mark.gpu
def test_gpu_self_tests_pass():
    face = _gpu_face()
    assert mr.self_test(face)
    if face == "cuda":
        assert mr.fold_self_test(face)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["long", "odd"])
def test_gpu_tiny_model_compiled_decode_kernels_on_vs_off(oracle, variant, monkeypatch):
    """The tiny V4 models' compiled decode steps on the GPU (the router kernels, with the
    other kernels) equal DS4MLX_KERNELS=reference and the float32 oracle within 1e-4."""
    _gpu_face()
    if os.environ.get("MLX_ENABLE_TF32") != "0":
        pytest.skip("needs MLX_ENABLE_TF32=0 (TF32 noise flips near-ties)")
    from parity_helpers import load_case, maxdiff

    from ds4mlx.runtime import stepper

    _, lm, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", variant)
    ids = ref["input_ids"][0].tolist()
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")

    def decode():
        stepper.forget(lm.model)
        s = lm.new_session(ctx=len(ids) + 8, chunk=7)
        s.prefill(ids[:5])
        return np.stack([s.decode(t) for t in ids[5:]])

    on = decode()
    with dispatch.use_face("reference"):
        off = decode()
    assert maxdiff(on, off) <= 1e-4
    assert maxdiff(on, ref["logits_full"][0][5:]) <= 1e-4
