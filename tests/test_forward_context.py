"""The forward context (runtime/forward_context.py, docs/forward.md §2): what the host plans,
what the trace sees, and the families that run their static step as one forward over it
(DeepSeek V4, V4.1, Qwen3.8, GLM 5.2 and 5.3): several sessions in one forward give each row its own step's logits."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.models import cache as row_cache
from ds4mlx.runtime import stepper
from ds4mlx.runtime.forward_context import CHAIN, DECODE, PREFILL, ForwardContext, LiveView, StepContext
from ds4mlx.runtime.session import can_step_together, step_together

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case, rows_and_alone  # noqa: E402


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


def test_a_live_view_reads_and_writes_the_cache_in_its_order():
    """PREFILL: a `LiveView` reads a live cache's arrays in the static order and sets the new
    ones back in the same order, as a row's `StateView` reads and puts."""
    from ds4mlx.models.kda import LinearCache

    a, b, c, d = (mx.array([i]) for i in range(4))
    cache = LinearCache()
    cache.conv, cache.recurrent = a, b
    view = LiveView(cache, ("conv", "recurrent"))
    assert next(view) is a
    view.put(c)
    assert cache.conv is c and next(view) is b  # the old state read after the new conv is set
    view.put(d)
    assert cache.conv is c and cache.recurrent is d


@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm5_next"])
def test_glm_runs_every_kind_through_one_forward(family):
    """GLM 5.2 / 5.3: `model(ids, cache)` (PREFILL) and the stepper's `static_forward` (DECODE,
    CHAIN) are the one `forward`; no module of the family keeps a static or prefill twin
    (`step`, a backbone or attention `__call__`).  GLM 5.2's `DecoderLayer.__call__` is the
    MTP head's PREFILL entry into the same `forward`."""
    import importlib

    from ds4mlx.models import mla
    from ds4mlx.models.cache import BackboneForward

    mod = importlib.import_module(f"ds4mlx.models.{family}")
    assert issubclass(mod.Model, BackboneForward) and "static_forward" not in vars(mod.Model)
    backbone = {"glm_moe_dsa": "GlmMoeDsaModel", "glm5_next": "Glm5NextTextModel"}[family]
    classes = [mod.Model, mod.DecoderLayer, getattr(mod, backbone)]
    classes += [mla.MLAAttention] + ([mod.LinearAttention] if family == "glm5_next" else [])
    for cls in classes:
        assert "step" not in vars(cls) and "static_forward" not in vars(cls), cls
        assert "forward" in vars(cls) or cls is mod.Model, cls
        assert "__call__" not in vars(cls) or cls is mod.DecoderLayer, cls


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
    alone, rows = _twin_sessions(lm, ids, lengths)
    for k in range(4):
        _rows_equal_alone(alone, rows, [ids[(n + k) % len(ids)] for n in lengths])
    assert all(list(r.tokens) == list(a.tokens) for r, a in zip(rows, alone))


def _twin_sessions(lm, ids, lengths):
    """Two lists of sessions, session i of each prefilled with ids[:lengths[i]]."""
    alone = [lm.new_session(ctx=len(ids) + 8) for _ in lengths]
    rows = [lm.new_session(ctx=len(ids) + 8) for _ in lengths]
    for a, r, n in zip(alone, rows, lengths):
        if n:
            a.prefill(ids[:n])
            r.prefill(ids[:n])
    return alone, rows


def _rows_equal_alone(alone, rows, toks, undoable=False) -> list:
    """One round: each of `alone` steps its token, `rows` step theirs together; each row's
    logits within 1e-5 of its own step's (returned)."""
    want = [np.asarray(a.step(t)) for a, t in zip(alone, toks)]  # the first: the model's check
    assert can_step_together(rows)
    got = [np.asarray(lg) for lg in step_together(rows, toks, undoable=undoable)]
    for w, g in zip(want, got):
        assert np.abs(w - g).max() <= 1e-5
    return want


@pytest.fixture(scope="module")
def qwen_case(oracle):
    return load_case(oracle, "make_tiny_qwen4_exp.py", "long")


def test_qwen_rows_stepped_together_equal_each_alone(qwen_case, monkeypatch, request):
    """Qwen3.8 on the forward context gains session batching: B sessions at different
    positions (one still empty: its first token's state made by the view; different K/V
    buckets; QSA past its block budget for the longest) in one forward -- the Gated DeltaNet
    and PLE states stacked into one batch, the attention per row -- give each row the logits
    of its own step, within 1e-5 (float32 CPU), and leave each session where its own step
    would (the next rounds agree too)."""
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    _, lm, ref, _ = qwen_case
    ids = ref["input_ids"][0].tolist()
    stepper.forget(lm.model)
    request.addfinalizer(lambda: stepper.forget(lm.model))
    lengths = [0, 3, 9, len(ids) - 6]
    alone, rows = _twin_sessions(lm, ids, lengths)
    for k in range(5):
        toks = [ids[(n + k) % len(ids)] for n in lengths]
        want = _rows_equal_alone(alone, rows, toks, undoable=k == 4)
    for r in rows:
        r.undo_step()  # the last round was undoable: every row's caches go back
    again = [np.asarray(lg) for lg in step_together(rows, toks)]
    for w, g in zip(want, again):
        assert np.abs(w - g).max() <= 1e-5
    assert all(list(r.tokens) == list(a.tokens) for r, a in zip(rows, alone))
    # and each session goes on alone from where the rows left it
    for a, r, n in zip(alone, rows, lengths):
        t = ids[(n + 5) % len(ids)]
        assert np.abs(np.asarray(a.step(t)) - np.asarray(r.step(t))).max() <= 1e-5


@pytest.fixture(scope="module", params=[("make_tiny_glm_moe_dsa.py", "alt"), ("make_tiny_glm5_next.py", "long")])
def glm_case(request, oracle):
    return load_case(oracle, *request.param)


def test_glm_rows_stepped_together_equal_each_alone(glm_case, monkeypatch, request):
    """GLM 5.2 (MLA + DSA, "shared" layers inheriting each row's selection) and GLM 5.3 (KDA
    recurrent state + k-pool MLA, mHC) on the forward context gain session batching: rows at
    different positions (one past index_topk: sparse; different buckets) in one forward give
    each row its own step's logits within 1e-5 (float32 CPU), and the same tokens after."""
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    _, lm, ref, _ = glm_case
    ids = ref["input_ids"][0].tolist()
    stepper.forget(lm.model)
    request.addfinalizer(lambda: stepper.forget(lm.model))
    assert len(ids) - 6 > lm.model.args.index_topk  # one row attends sparsely
    worst, same = rows_and_alone(lm, ids, [3, 9, len(ids) - 6], rounds=4)
    assert worst <= 1e-5 and same


def test_qwen_every_kind_runs_the_one_forward(qwen_case, monkeypatch, request):
    """Qwen3.8 has one forward: its prefill (`model(ids, cache)`), the legacy decode (a
    one-token prefill), the decode step, batched rows and a verify chain all run
    `Model.forward`, and through it every layer's one `DecoderLayer.forward`, each with its
    context's kind and rows; no per-kind twin (`step`) is left in the module."""
    from ds4mlx.models import qwen4_exp
    from ds4mlx.models.causal_lm import ContextForward

    _, lm, ref, _ = qwen_case
    ids = ref["input_ids"][0].tolist()
    stepper.forget(lm.model)
    request.addfinalizer(lambda: stepper.forget(lm.model))
    seen: dict[str, list] = {"model": [], "layer": []}
    for cls, name in ((qwen4_exp.Model, "model"), (qwen4_exp.DecoderLayer, "layer")):

        def forward(self, *args, _inner=cls.forward, _name=name, **kw):
            ctx = next(a for a in args if isinstance(a, StepContext))
            seen[_name].append((ctx.kind, ctx.rows))
            return _inner(self, *args, **kw)

        monkeypatch.setattr(cls, "forward", forward)
    a, b = lm.new_session(ctx=64), lm.new_session(ctx=64)
    a.prefill(ids[:6])
    b.prefill(ids[:9])
    monkeypatch.setenv(stepper.MODE_ENV, "legacy")
    mx.eval(a.step(ids[6]))
    monkeypatch.setenv(stepper.MODE_ENV, "eager")  # traced or not, the same function runs
    mx.eval(a.step(ids[7]))
    mx.eval(*step_together([a, b], [ids[8], ids[9]]))
    mx.eval(a.verify(ids[9:13]))
    assert seen["model"] == [(PREFILL, 1)] * 3 + [(DECODE, 1), (DECODE, 2), (CHAIN, 4)]
    assert seen["layer"] == [k for k in seen["model"] for _ in lm.model.layers]
    assert qwen4_exp.Model.static_forward is ContextForward.static_forward
    twins = [
        c for c in (qwen4_exp.Qwen4ExpTextModel, qwen4_exp.DecoderLayer, qwen4_exp.Attention) if hasattr(c, "step")
    ]
    assert not twins
