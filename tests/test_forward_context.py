"""The forward context (runtime/forward_context.py, docs/forward.md §2): what the host plans,
what the trace sees, and the families that run their static step as one forward over it
(DeepSeek V4 and V4.1): several sessions in one forward give each row its own step's logits."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.models import cache as row_cache
from ds4mlx.runtime import stepper
from ds4mlx.runtime.forward_context import CHAIN, DECODE, PREFILL, ForwardContext, StepContext
from ds4mlx.runtime.session import can_step_together, step_together

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case  # noqa: E402


def test_the_host_plan_gives_the_traces_positions():
    d = ForwardContext.decode([7, 3, 12])
    assert (d.kind, d.tokens, d.positions()) == (DECODE, 3, [7, 3, 12])
    assert d.pos_array().tolist() == [7, 3, 12] and d.pos_array().dtype == mx.int32
    one = ForwardContext.decode([9])
    assert one.pos_array().shape == () and one.pos_array().item() == 9  # static_step's scalar
    c = ForwardContext.chain(40, 4, streams=True)
    assert (c.kind, c.tokens, c.positions(), c.streams) == (CHAIN, 4, [40, 41, 42, 43], True)
    p = ForwardContext.prefill(8, 3)
    assert (p.kind, p.tokens, p.positions()) == (PREFILL, 3, [8, 9, 10])


@pytest.mark.parametrize(
    "kind, starts, counts, words",
    [
        ("verify", (0,), (1,), "forward kind"),
        (DECODE, (), (), "at least one token"),
        (DECODE, (1, 2), (1,), "at least one token"),
        (CHAIN, (5,), (0,), "at least one token"),
        (DECODE, (1,), (2,), "one token per row"),
        (CHAIN, (1, 2), (2, 2), "one session"),
        (PREFILL, (1, 2), (2, 2), "one session"),
    ],
)
def test_a_malformed_plan_is_refused(kind, starts, counts, words):
    with pytest.raises(ValueError, match=words):
        ForwardContext(kind, starts, counts)


def test_a_chains_rows_read_the_state_the_row_before_left():
    """CHAIN: row t's view reads what row t - 1 put (in order), DECODE: each row its own slice."""
    a, b, c, d = (mx.array([i]) for i in range(4))
    chain = StepContext.of(CHAIN, mx.array([5, 6, 7], mx.int32), [a, b], 2)
    first, second, third = chain.views
    assert next(first) is a and next(first) is b
    first.put(c, d)
    assert next(second) is c and next(second) is d
    second.put(a)
    assert next(third) is a
    assert [int(p.item()) for p in chain.row_pos] == [5, 6, 7] and chain.row_pos[0].shape == ()
    rows = StepContext.of(DECODE, mx.array([5, 9], mx.int32), [a, b, c, d], 2)
    assert [[next(v), next(v)] for v in rows.views] == [[a, b], [c, d]]


@pytest.fixture(scope="module", params=[None, "mixed"], ids=lambda c: c or "default")
def v41_case(request, oracle):
    return load_case(oracle, "probe_mlx_deepseek_v41.py", request.param)


def test_v41_rows_stepped_together_equal_each_alone(v41_case, monkeypatch, request):
    """DeepSeek V4.1 on the forward context gains session batching: B sessions at different
    positions (different buffer buckets; some past the sliding window and the compressors'
    first rows) in one forward give each row the logits of its own step, within 1e-5 (float32
    CPU), and leave each session where its own step would (the next rounds agree too)."""
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    _, lm, ref, _ = v41_case
    ids = ref["input_ids"][0].tolist()
    stepper.forget(lm.model)
    request.addfinalizer(lambda: stepper.forget(lm.model))
    lengths = [3, 9, len(ids) - 6]
    alone = [lm.new_session(ctx=len(ids) + 8) for _ in lengths]
    rows = [lm.new_session(ctx=len(ids) + 8) for _ in lengths]
    for a, r, n in zip(alone, rows, lengths):
        a.prefill(ids[:n])
        r.prefill(ids[:n])
    for k in range(4):
        toks = [ids[(n + k) % len(ids)] for n in lengths]
        want = [np.asarray(a.step(t)) for a, t in zip(alone, toks)]  # the first: the model's check
        assert can_step_together(rows)
        got = [np.asarray(lg) for lg in step_together(rows, toks)]
        for w, g in zip(want, got):
            assert np.abs(w - g).max() <= 1e-5
    assert all(list(r.tokens) == list(a.tokens) for r, a in zip(rows, alone))
