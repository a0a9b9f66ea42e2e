"""The prefill attention written as GEMMs (models/prefill_attention.py, DS4MLX_PREFILL_SDPA=matmul)
equals MLX's fused op: band masks, fully masked rows, per-head sinks, one shared K=V head (CPU,
float32).  The tiny V4 models' chunked prefill through it against transformers:
tests/test_deepseek_v4_parity.py::test_chunked_prefill_attention_as_matmuls."""

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.models import prefill_attention as pa

pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize(
    "shape", [(2, 4, 8, 24, 16, 1), (1, 3, 5, 7, 8, 3), (6, 4, 1, 20, 16, 1)]
)  # B, H, Lq, Lk, D, Hk (the last: one query per row, heads as GEMM rows)
def test_matmul_equals_the_fused_op(shape, sinks):
    b, h, lq, lk, d, hk = shape
    key = mx.random.key(lq * lk)
    q = mx.random.normal((b, h, lq, d), key=key)
    k = mx.random.normal((b, hk, lk, d), key=mx.random.key(1))
    v = k if hk == 1 else mx.random.normal((b, hk, lk, d), key=mx.random.key(2))
    mask = mx.random.uniform(shape=(b, 1, lq, lk), key=mx.random.key(3)) > 0.4
    if sinks:
        mask = mx.concatenate([mx.zeros((b, 1, 1, lk), mx.bool_), mask[:, :, 1:]], axis=2)  # row 0: only the sink
    s = mx.random.normal((h,), key=mx.random.key(4)) if sinks else None
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask, sinks=s)
    got = pa.by_matmul(q, k, v, scale=d**-0.5, mask=mask, sinks=s)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_env_picks_the_path(monkeypatch):
    monkeypatch.delenv(pa.ENV, raising=False)
    assert pa.mode() == "fast"  # auto: MLX's fused op on the CPU, the GEMMs on a GPU
    monkeypatch.setenv(pa.ENV, "matmul")
    assert pa.mode() == "matmul"
    monkeypatch.setenv(pa.ENV, "bogus")
    with pytest.raises(ValueError, match=pa.ENV):
        pa.mode()
