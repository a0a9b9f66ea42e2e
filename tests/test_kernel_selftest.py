"""First-use self-tests of unverified GPU faces (`dispatch.auto_face`), on the CPU.

A GPU face is simulated by making `dispatch.backend()` answer it; its launches are
faked by swapping the kernels' launch function: raising (a face that does not
compile), returning garbage (a wrong kernel), or returning the reference result
(a good kernel).  The model-facing calls must then give the reference result
and warn, or keep the face."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.io.quant import random_gguf_blocks
from ds4mlx.kernels import dispatch, grouped_qmm, quant_moe
from ds4mlx.kernels import hyper_connection as hck
from ds4mlx.kernels import hyper_connection_reference as reference


def fake_launches(monkeypatch, module, behaviour):
    """Replace module._kernel(...) launches: 'raise', 'garbage' or 'reference'."""

    def fake_kernel(*names):
        def launch(face, *, output_shapes, output_dtypes, **kw):
            if behaviour == "raise":
                raise RuntimeError("metal compile error (simulated)")
            return [mx.full(s, 7.0, t) for s, t in zip(output_shapes, output_dtypes)]

        return launch

    monkeypatch.setattr(module, "_kernel", fake_kernel)


@pytest.mark.parametrize("behaviour", ["raise", "garbage"])
@pytest.mark.parametrize("qtype", ["IQ2_XXS", "Q2_K"])
def test_quant_moe_bad_face_falls_back_to_reference(fake_gpu, behaviour, qtype, caplog):
    fake_launches(fake_gpu, quant_moe, behaviour)
    blocks = random_gguf_blocks(qtype, 4, 6, 256, seed=3)
    x = mx.random.normal((1, 256), key=mx.random.key(0))
    ids = mx.array([[3, 1]], dtype=mx.int32)
    with caplog.at_level(logging.WARNING, logger="ds4mlx.kernels"):
        got = quant_moe.gather_qmatmul(x, blocks, qtype, ids)  # automatic face
    want = quant_moe.gather_qmv(x, blocks, qtype, ids, backend="reference")
    assert np.array_equal(np.array(got), np.array(want))
    assert f"quant_moe.{qtype}" in caplog.text and "failed its first-use self-test" in caplog.text
    assert dispatch._self_tests[(f"quant_moe.{qtype}", "metal")] is False
    caplog.clear()
    quant_moe.gather_qmatmul(x, blocks, qtype, ids)  # tested once only
    assert "self-test" not in caplog.text


def test_quant_moe_good_face_is_kept(fake_gpu):
    calls = []
    real_qmv, real_deq = quant_moe.gather_qmv, quant_moe.gather_dequantize

    # a "metal" face that computes exactly what the reference computes
    def qmv(x, w, qt, ids, *, backend=None):
        calls.append(backend)
        return real_qmv(x, w, qt, ids, backend="reference")

    def deq(w, qt, ids, dtype=mx.float32, *, backend=None):
        return real_deq(w, qt, ids, dtype, backend="reference")

    fake_gpu.setattr(quant_moe, "gather_qmv", qmv)
    fake_gpu.setattr(quant_moe, "gather_dequantize", deq)
    assert quant_moe._face(None, quant_moe.QT.Q2_K) == "metal"
    assert "metal" in calls and dispatch._self_tests[("quant_moe.Q2_K", "metal")] is True


def test_verified_face_is_not_self_tested(monkeypatch):
    monkeypatch.delenv("DS4MLX_KERNELS", raising=False)
    monkeypatch.delenv("DS4MLX_KERNEL_SELFTEST", raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device=None: "cuda")
    monkeypatch.setattr(dispatch, "_self_tests", {})
    assert dispatch.auto_face("k", lambda face: 1 / 0) == "cuda"  # CUDA ran its tests on an H200
    monkeypatch.setenv("DS4MLX_KERNEL_SELFTEST", "1")
    assert dispatch.auto_face("k", lambda face: 1 / 0) == "reference"
    monkeypatch.setenv("DS4MLX_KERNEL_SELFTEST", "0")
    monkeypatch.setattr(dispatch, "backend", lambda device=None: "metal")
    assert dispatch.auto_face("k2", lambda face: False) == "metal"


def test_forced_face_is_not_self_tested(fake_gpu):
    fake_gpu.setenv("DS4MLX_KERNELS", "metal")
    assert dispatch.auto_face("k", lambda face: False) == "metal"


@pytest.mark.parametrize("behaviour", ["raise", "garbage"])
def test_hyper_connection_bad_face_falls_back_to_reference(fake_gpu, behaviour, caplog):
    fake_launches(fake_gpu, hck, behaviour)
    n, d = 4, 32
    x = mx.random.normal((1, 3, n, d), key=mx.random.key(1)) * 0.5
    fn = mx.random.normal(((2 + n) * n, n * d), key=mx.random.key(2)) * (n * d) ** -0.5
    base, scale = mx.zeros(((2 + n) * n,)), mx.array([0.5, 1.0, 2.0])
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    with caplog.at_level(logging.WARNING, logger="ds4mlx.kernels"):
        got = hck.hc_pre(x, fn, base, scale, **kw)
    want = reference.hc_pre(x, fn, base, scale, **kw)
    for g, w in zip(got, want):
        assert np.array_equal(np.array(g), np.array(w))
    assert "hyper_connection" in caplog.text and "failed its first-use self-test" in caplog.text


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "Q2_K", "Q4_K", "Q8_0"])
def test_self_tests_pass_for_the_reference_itself(qtype):
    """The self-test inputs are valid and its comparison passes when the face is right."""
    assert quant_moe._self_test("reference", quant_moe.QT[qtype])
    assert hck._self_test("reference")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["IQ2_XXS", "Q2_K", "Q4_K", "Q8_0"])
def test_gpu_faces_pass_their_self_tests(qtype):
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    assert quant_moe._self_test(face, quant_moe.QT[qtype])
    assert hck._self_test(face)


def test_every_unverified_kernel_is_a_self_tested_launch():
    """`dispatch.UNVERIFIED_KERNELS` is the verification state DEVELOPERS.md points to: each
    name in it is a kernel some module hands to `auto_face` (so the self-test it promises
    exists), not a stale entry of a renamed or deleted kernel."""
    import re
    from pathlib import Path

    text = "\n".join(p.read_text(encoding="utf-8") for p in Path(dispatch.__file__).parent.glob("*.py"))
    named = set(re.findall(r'auto_face\(\s*"([\w.]+)"', text))
    named |= set(quant_moe.MOE_KERNELS.values()) | set(quant_moe.DEQUANT_KERNELS.values())
    named |= set(grouped_qmm.GROUPED_KERNELS.values()) | set(grouped_qmm.MMA_KERNELS.values())
    # sparse_attention's launches self-test through `_verified(kind)` -> auto_face("sparse_attention.<kind>")
    named |= {"sparse_attention." + k for k in re.findall(r'_verified\(\s*"(\w+)"', text)}
    assert dispatch.UNVERIFIED_KERNELS <= named, sorted(dispatch.UNVERIFIED_KERNELS - named)
