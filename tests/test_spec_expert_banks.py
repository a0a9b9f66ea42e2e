"""Float expert banks past MLX CUDA's grouped-GEMM offsets: the MTP drafter's illegal access.

MLX's CUDA `gather_mm(..., sorted_indices=True)` (one row per pair: the grouped GEMM of
mlx/backend/cuda/gemms/grouped_gemm_unaligned.cu) forms expert e's pointer as
`e * itemsize * rows * cols` in 32-bit int.  A full-size bfloat16 MTP head's gate_up bank
(256 x 4096 x 4096, 8 GiB) wraps from expert 64 on, its down bank (4 GiB) from 128: the
head's catch-up over a window of positions (>= 64 pairs, sorted) read up to 2 GiB before
the bank, an illegal address where nothing was mapped there (20 layers beside the target),
silently wrong drafts where something was (8 layers).  `quant.grouped_gemm_spans` plans the
slices each grouped GEMM sees; the CPU tests pin the plan on V4 Flash's shapes (no large
allocation) and show a split product equals the whole one; the `gpu` test runs the full-size
bank on the device against a per-pair reference.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.io import quant
from ds4mlx.models import layers

INT32_MAX = (1 << 31) - 1


def _v4_flash_head_banks():
    """(name, [E, out, in]) of every float expert bank of the full-size V4 Flash MTP head
    (the shapes only: the head's parameters are lazy zeros, never evaluated)."""
    from mlx.utils import tree_flatten

    from ds4mlx.bench.synthetic import v4_flash_config
    from ds4mlx.models.base import family_module
    from ds4mlx.speculative.mtp import head_module

    args = family_module("deepseek_v4").ModelArgs.from_dict(v4_flash_config(layers=20))
    head = head_module("deepseek_v4").make_head(args)
    return [
        (name, tuple(p.shape))
        for name, p in tree_flatten(head.parameters())
        if name.endswith(("gate_up_proj.weight", "down_proj.weight")) and p.ndim == 3
    ]


def _worst_offset(spans, expert_bytes):
    """The largest `expert * itemsize * rows * cols` the grouped GEMM forms over the spans."""
    return max((n - 1) * expert_bytes for _, n in spans)


def test_the_v4_flash_head_banks_are_split_below_the_32_bit_offsets():
    banks = dict(_v4_flash_head_banks())
    assert banks == {
        "block.mlp.experts.gate_up_proj.weight": (256, 4096, 4096),
        "block.mlp.experts.down_proj.weight": (256, 4096, 2048),
    }
    want = {  # (dtype size, bank) -> experts per span
        (2, (256, 4096, 4096)): 64,
        (2, (256, 4096, 2048)): 128,
        (4, (256, 4096, 4096)): 32,
        (4, (256, 4096, 2048)): 64,
    }
    for (size, (e, out_dims, in_dims)), per in want.items():
        expert_bytes = out_dims * in_dims * size
        assert (e - 1) * expert_bytes > INT32_MAX  # the whole bank in one call wraps
        spans = quant.grouped_gemm_spans(e, expert_bytes)
        assert {n for _, n in spans} == {per}
        assert [s for s, _ in spans] == list(range(0, e, per))  # every expert once, in order
        assert _worst_offset(spans, expert_bytes) <= INT32_MAX


def test_small_banks_and_the_target_s_2_bit_banks_stay_whole():
    assert quant.grouped_gemm_spans(8, 64 * 32 * 4) == [(0, 8)]  # a test model's bank
    assert quant.grouped_gemm_spans(256, 4096 * 4096 // 4) == [(0, 256)]  # 2-bit packed: 1 GiB
    assert quant.grouped_gemm_spans(3, 1 << 32) == [(0, 1), (1, 1), (2, 1)]  # an expert past the limit alone


@pytest.mark.parametrize("size", [2, 4])
def test_the_dequantized_prefill_blocks_stay_below_the_32_bit_offsets(size):
    """kernels/quant_moe.gather_qmm splits a dequantized stack along its rows instead: the
    whole V4 Flash gate stack (256 x 2048 x 4096) is 4 GiB in float16."""
    for rows, k in ((2048, 4096), (4096, 2048)):
        step = quant.grouped_gemm_rows(256, rows, k, size)
        assert _worst_offset([(0, 256)], step * k * size) <= INT32_MAX
        assert step == (1 << 31) // (256 * k * size)
    assert quant.grouped_gemm_rows(6, 33, 512, 4) == 33  # a test stack: one block


def _switch(e, out_dims, in_dims, dtype, seed):
    sw = layers.SwitchLinear(in_dims, out_dims, e)
    sw.weight = mx.random.normal((e, out_dims, in_dims), key=mx.random.key(seed)).astype(dtype)
    return sw


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_a_bank_split_into_spans_gives_the_whole_bank_s_rows(monkeypatch, dtype):
    """SwitchGLU's sorted path over a bank past the limit (made small here): one grouped GEMM
    per span, each pair's row equal to the one-call product (float32 and the GPU policy's
    16-bit weights)."""
    e, out_dims, in_dims, tokens, k = 10, 24, 32, 20, 4
    gate_up = _switch(e, 2 * out_dims, in_dims, dtype, 1)
    down = _switch(e, in_dims, out_dims, dtype, 2)
    glu = layers.SwitchGLU(in_dims, out_dims, e, limit=10.0)
    glu.gate_up_proj, glu.down_proj = gate_up, down
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, tokens, in_dims)).astype(np.float32)).astype(dtype)
    ids = mx.array(np.stack([rng.permutation(e)[:k] for _ in range(tokens)])[None].astype(np.uint32))
    assert ids.size >= 64  # SwitchGLU sorts the pairs: the grouped GEMM's path on a GPU
    whole = glu(x, ids)
    calls = []
    real = layers._gather_mm
    monkeypatch.setattr(layers, "_gather_mm", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    monkeypatch.setattr(quant, "GROUPED_GEMM_MAX_BYTES", 3 * 2 * out_dims * in_dims * dtype.size)
    split = glu(x, ids)
    assert calls == [3, 3, 3, 1, 6, 4]  # gate_up by 3 experts, down (half as big) by 6
    assert split.dtype == whole.dtype
    assert np.array_equal(np.array(split.astype(mx.float32)), np.array(whole.astype(mx.float32)))


def test_unsorted_calls_are_never_split(monkeypatch):
    """Decode's few pairs take MLX's gather_mv, whose expert offsets are 64-bit: no split."""
    sw = _switch(10, 8, 16, mx.float32, 3)
    monkeypatch.setattr(quant, "GROUPED_GEMM_MAX_BYTES", 8 * 16 * 4)
    calls = []
    real = layers._gather_mm
    monkeypatch.setattr(layers, "_gather_mm", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    x = mx.ones((1, 1, 1, 1, 16))
    sw(x, mx.array([[[9, 0]]], mx.uint32))
    assert calls == [10]


def test_the_dequantized_prefill_product_is_the_same_split_by_rows(monkeypatch):
    from ds4mlx.kernels import quant_moe as qm

    e, rows, k = 6, 33, 256
    raw = mx.array(quant.random_block_bytes(quant.QT.Q2_K, (e, rows, k), np.random.default_rng(4)))
    rng = np.random.default_rng(5)
    ids = mx.array(rng.integers(0, e, (40, 4)))
    x = mx.array(rng.standard_normal((40, k)).astype(np.float32))
    whole = qm.gather_qmm(x, raw, quant.QT.Q2_K, ids, backend="reference")
    monkeypatch.setattr(quant, "GROUPED_GEMM_MAX_BYTES", e * 10 * k * 4)  # blocks of 10 rows
    split = qm.gather_qmm(x, raw, quant.QT.Q2_K, ids, backend="reference")
    assert np.array_equal(np.array(split), np.array(whole))


@pytest.mark.gpu
def test_gpu_a_full_size_bfloat16_bank_s_sorted_product_reads_every_expert_right():
    """The triggering case: the V4 Flash MTP head's bfloat16 routed experts (gate_up 8 GiB,
    down 4 GiB) through SwitchGLU's sorted path at the head's catch-up size (128 positions x
    6 experts = 768 pairs, every expert 3 times), checked pair by pair against each expert's
    own matmul in float32 (experts 0, 63, 64, 127, 128, 191, 192, 255 among them: the ones the
    32-bit offsets put before the bank)."""
    e, hidden, inter, tokens, k = 256, 4096, 2048, 128, 6

    def bank(shape, seed):  # drawn a span at a time (a whole-bank draw fails to launch)
        keys = mx.random.split(mx.random.key(seed), len(list(quant.expert_spans(shape[0]))))
        parts = []
        for i, (_, n) in enumerate(quant.expert_spans(shape[0])):
            parts.append((0.02 * mx.random.normal((n, *shape[1:]), key=keys[i])).astype(mx.bfloat16))
            mx.eval(parts[-1])
        return mx.concatenate(parts)

    glu = layers.SwitchGLU(hidden, inter, e, limit=10.0)
    glu.gate_up_proj.weight = bank((e, 2 * inter, hidden), 1)
    glu.down_proj.weight = bank((e, hidden, inter), 2)
    mx.eval(glu.parameters())
    ids_np = ((np.arange(tokens)[:, None] * k + np.arange(k)[None]) % e).astype(np.uint32)  # every expert x3
    x = mx.random.normal((1, tokens, hidden), key=mx.random.key(3)).astype(mx.bfloat16)
    got = np.array(glu(x, mx.array(ids_np[None])).astype(mx.float32))[0]  # [tokens, k, hidden]
    xs = np.array(x.astype(mx.float32))[0]
    checked = set()
    for t, j in [(t, j) for t in range(tokens) for j in range(k)]:
        ex = int(ids_np[t, j])
        if ex in checked or ex not in (0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 200, 255):
            continue
        checked.add(ex)
        gu = np.array(glu.gate_up_proj.weight[ex].astype(mx.float32)) @ xs[t]
        h = np.array(layers.clamped_swiglu(mx.array(gu[:inter]), mx.array(gu[inter:]), 10.0))
        h = np.array(mx.array(h).astype(mx.bfloat16).astype(mx.float32))  # the bank's rounding
        want = np.array(glu.down_proj.weight[ex].astype(mx.float32)) @ h
        err = np.abs(got[t, j] - want).max() / max(np.abs(want).max(), 1e-6)
        assert err < 3e-2, (ex, err)
    assert len(checked) == 12


@pytest.mark.gpu
def test_gpu_the_full_size_bfloat16_mtp_head_s_catch_up_equals_position_by_position():
    """The drafter's own path: the random full-size V4 Flash MTP head in bfloat16 (its experts
    not quantized) catches up over a window of 128 positions in one forward (768 pairs: the
    sorted grouped GEMM, split into spans) and, on a fresh cache, one position at a time (6
    pairs: MLX's gather_mv, 64-bit offsets).  The oracle is the same head in float32 (on the CPU
    the float32 catch-up equals position by position exactly): the window's error against it is
    bfloat16's, no larger than the one-at-a-time path's own (a fixed bound cannot tell rounding
    through a whole block from a wrong expert; a factor of the other path's error can)."""
    from ds4mlx.bench.synthetic import v4_flash_config
    from ds4mlx.models.base import family_module
    from ds4mlx.speculative.mtp import random_head

    args = family_module("deepseek_v4").ModelArgs.from_dict(v4_flash_config(layers=20))
    head = random_head(args, seed=7, dtype=mx.bfloat16)
    assert isinstance(head.block.mlp.experts.gate_up_proj, layers.SwitchLinear)  # float banks: the case
    T, hc, H = 128, args.hc_mult, args.hidden_size
    table = (0.02 * mx.random.normal((1000, H), key=mx.random.key(8))).astype(mx.bfloat16)
    streams = mx.random.normal((1, T, hc, H), key=mx.random.key(9)).astype(mx.bfloat16)
    ids = mx.array(np.random.default_rng(10).integers(0, 1000, (1, T)), mx.int32)

    def window(h, dtype):  # the catch-up: the window in one forward
        x, hid = h(streams.astype(dtype), ids, lambda i: table.astype(dtype)[i], h.make_cache())
        mx.eval(x, hid)
        return [np.array(a.astype(mx.float32)) for a in (x, hid)]

    x_all, h_all = window(head, mx.bfloat16)
    cache, xs, hs = head.make_cache(), [], []
    for t in range(T):
        x, h = head(streams[:, t : t + 1], ids[:, t : t + 1], lambda i: table[i], cache)
        mx.eval(x, h)
        xs.append(x)
        hs.append(h)
    steps = [np.array(mx.concatenate(a, axis=1).astype(mx.float32)) for a in (xs, hs)]
    head.set_dtype(mx.float32)  # the same weights, exactly, in float32
    mx.clear_cache()
    oracle = window(head, mx.float32)
    for got, step, want in zip((x_all, h_all), steps, oracle):
        scale = np.abs(want).max(axis=-1, keepdims=True) + 1e-6
        err_window = (np.abs(got - want) / scale).max()
        err_step = (np.abs(step - want) / scale).max()
        assert np.all(np.isfinite(got))
        assert err_window <= max(2.0 * err_step, 2e-2), (err_window, err_step)
