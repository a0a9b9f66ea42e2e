"""Session: chunked prefill, decode, lazy step, snapshot/restore, truncate, ctx limits.

Uses the tiny DeepSeek V4 oracles ("long": window 16, CSA ratio 4, HCA ratio 16, 150
tokens; default: window 8, ratios 4/8) so that snapshots land mid-window, on window
boundaries, before and after the sliding window fills and before/after top-k kicks in.
"""

from __future__ import annotations

import struct

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.models.base import load_hf_dir
from ds4mlx.runtime.session import Session

TOL = 1e-4


@pytest.fixture(scope="module")
def long_case(oracle):
    folder = oracle("make_tiny_deepseek_v4.py", "long")
    ref = dict(np.load(folder / "reference.npz"))
    return load_hf_dir(str(folder)), ref["input_ids"][0].tolist(), ref


@pytest.fixture(scope="module")
def default_folder(oracle):
    return oracle("make_tiny_deepseek_v4.py", None)


def _decode_all(s: Session, ids) -> np.ndarray:
    return np.stack([s.decode(t) for t in ids])


@pytest.mark.parametrize("cut", [5, 17, 64])
def test_snapshot_restore_decode_is_bit_exact(long_case, cut):
    lm, ids, _ = long_case
    a = lm.new_session(ctx=200, chunk=7)
    a.prefill(ids[:cut])
    blob = a.snapshot()
    nbytes = a.nbytes
    want = _decode_all(a, ids[cut : cut + 24])

    b = lm.new_session(ctx=200, chunk=7)
    b.prefill(ids[:3])  # some unrelated state that restore must replace
    b.restore(blob)
    assert b.tokens == ids[:cut] and len(b) == cut and b.nbytes == nbytes
    got = _decode_all(b, ids[cut : cut + 24])
    assert np.array_equal(got, want)

    a.restore(blob)  # restoring into the session that moved on rewinds it
    assert np.array_equal(_decode_all(a, ids[cut : cut + 24]), want)


def test_snapshot_keeps_logits_and_empty_session_roundtrips(long_case):
    lm, ids, _ = long_case
    s = lm.new_session(ctx=200)
    last = s.prefill(ids[:30])
    t = lm.new_session(ctx=200)
    t.restore(s.snapshot())
    assert np.array_equal(t.last_logits, last)
    empty = lm.new_session(ctx=200)
    t.restore(empty.snapshot())
    assert len(t) == 0 and t.last_logits is None
    assert np.array_equal(t.prefill(ids[:30]), last)


def test_restore_rejects_bad_snapshots(long_case, default_folder):
    lm, ids, _ = long_case
    s = lm.new_session(ctx=200)
    s.prefill(ids[:40])
    blob = s.snapshot()
    target = lm.new_session(ctx=200)
    corrupt = bytearray(blob)
    corrupt[len(corrupt) // 2] ^= 0x40
    bad_version = bytearray(blob)
    bad_version[8:12] = struct.pack("<I", 99)
    for bad in (b"", b"garbage" * 10, blob[:-1], blob[:100], bytes(corrupt), b"X" + blob[1:], bytes(bad_version)):
        with pytest.raises(ValueError):
            target.restore(bad)
        assert len(target) == 0
    with pytest.raises(ValueError, match="ctx"):
        lm.new_session(ctx=39).restore(blob)
    other = load_hf_dir(str(default_folder))
    with pytest.raises(ValueError, match="different model"):
        other.new_session(ctx=200).restore(blob)
    target.restore(blob)  # still usable afterwards
    assert target.tokens == ids[:40]


@pytest.mark.parametrize("n", [0, 15, 33, 64])
def test_truncate_equals_fresh_prefill(long_case, n):
    lm, ids, _ = long_case
    s = lm.new_session(ctx=200, chunk=13)
    s.prefill(ids[:90])
    s.truncate(n)
    assert s.tokens == ids[:n] and len(s) == n
    fresh = lm.new_session(ctx=200, chunk=13)
    if n:
        fresh.prefill(ids[:n])
        assert np.abs(s.last_logits - fresh.last_logits).max() <= TOL
    else:
        assert s.last_logits is None
    got, want = _decode_all(s, ids[n : n + 12]), _decode_all(fresh, ids[n : n + 12])
    assert np.abs(got - want).max() <= TOL


def test_truncate_bounds(long_case):
    lm, ids, _ = long_case
    s = lm.new_session(ctx=200)
    s.prefill(ids[:10])
    s.truncate(10)
    assert len(s) == 10
    for bad in (-1, 11):
        with pytest.raises(ValueError):
            s.truncate(bad)


def test_ctx_limit(long_case):
    lm, ids, _ = long_case
    s = lm.new_session(ctx=20, chunk=8)
    with pytest.raises(ValueError):
        s.prefill(ids[:21])
    assert len(s) == 0
    s.prefill(ids[:19])
    s.decode(ids[19])
    with pytest.raises(ValueError):
        s.decode(ids[20])
    with pytest.raises(ValueError):
        s.step(ids[20])
    assert len(s) == 20


def test_progress_callback_and_chunking(long_case):
    lm, ids, ref = long_case
    seen = []
    s = lm.new_session(ctx=200, chunk=64)
    last = s.prefill(ids[:150], progress=lambda done, total: seen.append((done, total)), chunk=40)
    assert seen == [(40, 150), (80, 150), (120, 150), (150, 150)]
    assert np.abs(last - ref["logits_full"][0, 149]).max() <= TOL
    with pytest.raises(ValueError):
        lm.new_session(ctx=10).prefill([])
    assert np.array_equal(s.prefill([]), last)


def test_step_is_lazy_and_accepts_array_tokens(long_case):
    lm, ids, ref = long_case
    s = lm.new_session(ctx=200, chunk=16)
    s.prefill(ids[:60])
    prev = None
    for t in ids[60:80]:
        tok = mx.array(t) if prev is None else mx.array(t) + 0 * prev.argmax()  # a lazy token
        prev = s.step(tok)
        assert isinstance(prev, mx.array) and prev.shape == (lm.vocab_size,)
    assert s.tokens == ids[:80]
    assert np.abs(np.array(prev) - ref["logits_full"][0, 79]).max() <= TOL


def test_bfloat16_snapshot_roundtrip(default_folder):
    lm = load_hf_dir(str(default_folder), dtype=mx.bfloat16)
    ids = np.load(default_folder / "reference.npz")["input_ids"][0].tolist()
    a = lm.new_session(ctx=64, chunk=5)
    a.prefill(ids[:21])
    blob = a.snapshot()
    want = _decode_all(a, ids[21:40])
    b = lm.new_session(ctx=64)
    b.restore(blob)
    assert np.array_equal(_decode_all(b, ids[21:40]), want)
    assert a.nbytes > 0 and all(v.dtype == mx.bfloat16 for c in b._cache for v in c.state.values())
