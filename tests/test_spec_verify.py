"""Speculative decoding's verification primitive (issue #21 step 1), on all five tiny families.

`Session.verify(ids)` feeds k+1 tokens in one forward and returns every position's logits;
`Session.checkpoint()` / `rollback()` put every cache kind back exactly (DeepSeek V4 / V4.1
KV rings, compressors and indexer rows, GLM 5.2 MLA + DSA, GLM 5.3 KDA recurrent state,
Qwen3.8 Gated DeltaNet state).  Oracles: the same tokens decoded one step at a time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ds4mlx.runtime import stepper

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case, maxdiff  # noqa: E402
from spec_helpers import compiled_small_buckets  # noqa: E402, F401  (autouse)

TOL = 1e-4
FAMILIES = {
    "deepseek_v4": ("make_tiny_deepseek_v4.py", "long"),
    "deepseek_v41": ("probe_mlx_deepseek_v41.py", "mixed"),
    "glm_moe_dsa": ("make_tiny_glm_moe_dsa.py", "alt"),
    "glm5_next": ("make_tiny_glm5_next.py", "long"),
    "qwen4_exp": ("make_tiny_qwen4_exp.py", "long"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, oracle):
    _, lm, ref, _ = load_case(oracle, *FAMILIES[request.param])
    return lm, ref["input_ids"][0].tolist()


_STEPPED: dict = {}


def _stepped(lm, ids, start, n):
    """Logits of ids[start:start+n] decoded one step at a time after ids[:4] prefilled: one
    session per model and sequence, stepped on as far as asked (a window's rows are those of
    a fresh session stepped to it; every window re-stepped from the start was O(n^2) steps)."""
    key = (id(lm), tuple(ids))
    if key not in _STEPPED:
        s = lm.new_session(ctx=len(ids) + 8, chunk=5)
        s.prefill(ids[:4])
        _STEPPED[key] = (lm, s, [])  # lm kept: its id stays unique
    _, s, rows = _STEPPED[key]
    while 4 + len(rows) < start + n:
        rows.append(s.decode(ids[4 + len(rows)]))
    return np.stack(rows[start - 4 : start + n - 4])


def _wrong_drafts(lm, prompt, n):
    """(a session decoded greedily for n tokens after `prompt`, those tokens, a new session,
    a speculative loop over it whose drafts are the plain tokens made wrong at rotating
    depths): the loop must yield the same tokens."""
    from ds4mlx.runtime.decode import decode_tokens, greedy
    from ds4mlx.speculative.acceptance import GreedyRule
    from ds4mlx.speculative.drafter import ScriptedDrafter
    from ds4mlx.speculative.loop import SpeculativeLoop

    s = lm.new_session(ctx=len(prompt) + n + 8)
    want = list(decode_tokens(s, s.prefill(prompt), greedy(lm.vocab_size), limit=n))
    full = prompt + want

    def corrupt(ctx, k):
        at = len(ctx) % (k + 2)
        return [(t + 1) % lm.vocab_size if i == at else t for i, t in enumerate(full[len(ctx) : len(ctx) + k])]

    t = lm.new_session(ctx=len(prompt) + n + 8)
    loop = SpeculativeLoop(t, t.prefill(prompt), ScriptedDrafter(corrupt), GreedyRule(lm.vocab_size), depth=3, limit=n)
    return s, want, t, loop


def test_verify_equals_single_steps_and_rollback_is_exact(case):
    lm, ids = case
    n = min(len(ids), 40)
    s = lm.new_session(ctx=len(ids) + 8, chunk=5)
    s.prefill(ids[:4])
    pos = 4
    for k in (1, 2, 3, 4, 3, 2, 4):  # verify windows of k+1 tokens, then roll back part of them
        if pos + k + 1 > n:
            break
        cp = s.checkpoint()
        rows = np.array(s.verify(ids[pos : pos + k + 1]))
        assert len(s) == pos + k + 1
        assert maxdiff(rows, _stepped(lm, ids, pos, k + 1)) <= TOL
        s.rollback(cp)
        assert s.tokens == ids[:pos] and len(s) == pos
        keep = 1 + k // 2  # accept a prefix: the rest is rejected
        s.verify(ids[pos : pos + keep])
        pos += keep
        for t in ids[pos : pos + 2]:  # plain steps after a rollback: the compiled path again
            s.decode(t)
        pos += 2
    assert pos > 20
    tail = np.stack([s.decode(t) for t in ids[pos:n]])
    assert maxdiff(tail, _stepped(lm, ids, pos, n - pos)) <= TOL


def test_checkpoint_survives_later_steps_and_restores_twice(case):
    lm, ids = case
    s = lm.new_session(ctx=len(ids) + 8, chunk=5)
    s.prefill(ids[:6])
    for t in ids[6:12]:
        s.decode(t)
    cp = s.checkpoint()
    want = np.stack([s.decode(t) for t in ids[12:24]])
    for _ in range(2):  # the same checkpoint twice: rollback must not hand its arrays out
        s.rollback(cp)
        assert s.tokens == ids[:12]
        got = np.stack([s.decode(t) for t in ids[12:24]])
        assert np.array_equal(got, want)


def test_speculative_loop_with_wrong_drafts_equals_plain_greedy(case):
    """The loop on every family over 200 greedy tokens (each tiny model's window crossed many
    times): drafts wrong at rotating depths, the output and the session end token for token
    where plain greedy decoding ends; then a draft model (`--draft-model`: ModelDrafter, the
    model itself in its own session) over the first 32 of them."""
    from ds4mlx.speculative.acceptance import GreedyRule
    from ds4mlx.speculative.drafter import ModelDrafter
    from ds4mlx.speculative.loop import SpeculativeLoop

    lm, ids = case
    prompt = ids[:6]
    s, want, t, loop = _wrong_drafts(lm, prompt, 200)
    assert list(loop) == want and t.tokens == s.tokens
    u = lm.new_session(ctx=len(prompt) + 40)
    draft = SpeculativeLoop(u, u.prefill(prompt), ModelDrafter(lm, ctx=len(prompt) + 40), GreedyRule(lm.vocab_size), depth=2, margin=0, limit=32)  # fmt: skip
    assert list(draft) == want[:32] and draft.stats.accepted > 0
    # the caches after rollbacks: the next logits are the full forward's (a one-shot forward
    # is the reference; V4.1's compiled step itself drifts ~2e-3 from it on this sequence)
    assert maxdiff(t.last_logits[None], lm.logits(t.tokens)[-1:]) <= TOL
    assert 0 < loop.stats.accepted < loop.stats.drafted


@pytest.mark.parametrize("face", [None, "reference"])
def test_v4_verify_runs_the_static_step_chained_as_the_forward_does(oracle, monkeypatch, request, face):
    """DeepSeek V4's verify goes through the static decode step's rows chained
    (`stepper.step_chain`: the k + 1 tokens' projections once, their attention in turn over
    the state the previous token left) and gives the multi-token forward's logits, streams
    (the MTP head's input) and caches, over windows that cross the sliding window and the
    compressors' boundaries.  face "reference": the GPU step's structure (each row's prologue
    and compressors in turn, then the rows' attention offered to attend_rows) on the kernels'
    reference faces."""
    from ds4mlx.kernels import sparse_attention

    _, lm, ref, _ = load_case(oracle, *FAMILIES["deepseek_v4"])
    stepper.forget(lm.model)  # a trace of the other face must not serve this one (nor later tests)
    request.addfinalizer(lambda: stepper.forget(lm.model))
    monkeypatch.setattr(sparse_attention, "FORCE_FACE", face)
    _assert_chained_verify_equals_forward(lm, ref["input_ids"][0].tolist(), monkeypatch, streams=True)


@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm5_next"])
def test_glm_verify_runs_the_static_step_chained_as_the_forward_does(family, oracle, monkeypatch, request):
    """GLM 5.2 (MLA rows, DSA indexer, the MTP head's streams) and GLM 5.3 (each chained
    row steps the KDA recurrence and short conv over the state the row before left; k-pool
    MLA) verify through the static forward's CHAIN context, giving the multi-token forward's
    logits (and GLM 5.2's normed hidden states to the stream hook) past index_topk."""
    _, lm, ref, _ = load_case(oracle, *FAMILIES[family])
    stepper.forget(lm.model)
    request.addfinalizer(lambda: stepper.forget(lm.model))
    assert type(lm.model).static_rows_chain  # the family's own flag (the helper toggles it for the oracle)
    ids = ref["input_ids"][0].tolist()
    assert len(ids) > 36 > lm.model.args.index_topk  # the later windows attend sparsely
    _assert_chained_verify_equals_forward(lm, ids, monkeypatch, streams=hasattr(lm.model.model, "stream_hook"))


def _assert_chained_verify_equals_forward(lm, ids: list, monkeypatch, streams: bool) -> None:
    """Verify windows of 2 to 5 tokens over `ids` chained (`stepper.step_chain`) and as the
    multi-token forward: the same logits within TOL, and with `streams` the same hook calls
    (positions, shapes, values)."""
    backbone = lm.model.model
    chained = []
    real = stepper.step_chain
    monkeypatch.setattr(stepper, "step_chain", lambda m, c, t, p: chained.append(t.shape[1]) or real(m, c, t, p))

    def run(chain: bool):
        monkeypatch.setattr(lm.model, "static_rows_chain", chain, raising=False)
        got = []
        if streams:
            backbone.stream_hook = lambda x, at: got.append((at, np.array(x)))
        try:
            s = lm.new_session(ctx=len(ids) + 8, chunk=5)
            s.prefill(ids[:4])
            rows, pos = [], 5
            rows.append(s.decode(ids[4])[None])  # the static step's first run: it is then checked
            for k in (1, 4, 2, 3, 4, 1, 3, 4, 2):
                rows.append(np.array(s.verify(ids[pos : pos + k + 1])))
                pos += k + 1
            rows.append(np.stack([s.decode(t) for t in ids[pos : pos + 4]]))
        finally:
            if streams:
                backbone.stream_hook = None
        return np.concatenate(rows), got

    want, want_streams = run(False)
    assert not chained
    got, got_streams = run(True)
    assert chained == [2, 5, 3, 4, 5, 2, 4, 5, 3]
    assert maxdiff(got, want) <= TOL
    if streams:
        want_at = [0, 5, 7, 12, 15, 19, 24, 26, 30, 35]
        assert [at for at, _ in got_streams] == [at for at, _ in want_streams] == want_at
        for (_, g), (_, w) in zip(got_streams, want_streams):
            assert g.shape == w.shape and maxdiff(g, w) <= TOL


def test_v4_keeps_a_verified_prefix_from_the_chain_without_a_forward(oracle, monkeypatch):
    """After a chained verify the session keeps its first n tokens from the row states the
    chain left (`Session.keep_verified`): no rollback, no second forward, and the caches are
    those of n plain steps (the next logits agree with stepping the same tokens).  The record
    goes stale once the session moves, and a second keep can go further back in the same
    verify (the speculative loop's `settle` after a rejection)."""
    _, lm, ref, _ = load_case(oracle, *FAMILIES["deepseek_v4"])
    _assert_keeps_verified_prefix(lm, ref["input_ids"][0].tolist(), monkeypatch)


@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm5_next"])
def test_glm_keeps_a_verified_prefix_from_the_chain_without_a_forward(family, oracle, monkeypatch):
    """GLM 5.2 / 5.3 keep a chained verify's first n tokens from its row states (MLA rows
    and the open k-pool; KDA conv and recurrent state per row), as V4 does."""
    _, lm, ref, _ = load_case(oracle, *FAMILIES[family])
    _assert_keeps_verified_prefix(lm, ref["input_ids"][0].tolist(), monkeypatch)


def _assert_keeps_verified_prefix(lm, ids: list, monkeypatch) -> None:
    """Verify k + 1 tokens, keep n of them (`Session.keep_verified`) over several windows:
    no rollback, no second forward, the caches those of n plain steps."""
    from ds4mlx.runtime.session import Session

    forwards = []
    real_chain = stepper.step_chain
    monkeypatch.setattr(stepper, "step_chain", lambda *a: forwards.append("chain") or real_chain(*a))
    monkeypatch.setattr(Session, "rollback", lambda *a: pytest.fail("rollback"))
    s = lm.new_session(ctx=len(ids) + 8, chunk=5)
    s.prefill(ids[:4])
    s.decode(ids[4])  # the static step's first run: it is then checked
    pos = 5
    for k, n in ((4, 2), (3, 1), (4, 4), (2, 3), (4, 1)):  # verify k + 1 tokens, keep n of them
        forwards.clear()
        s.verify(ids[pos : pos + k + 1])
        assert s.keep_verified(n) and forwards == ["chain"]
        assert s.tokens == ids[: pos + n] and len(s) == pos + n
        pos += n
        assert maxdiff(s.last_logits[None], _stepped(lm, ids, pos - 1, 1)) <= TOL
    s.verify(ids[pos : pos + 4])
    assert s.keep_verified(3) and s.keep_verified(1)  # a second keep, further back
    pos += 1
    assert s.tokens == ids[:pos]
    got = np.stack([s.decode(t) for t in ids[pos : pos + 6]])
    assert maxdiff(got, _stepped(lm, ids, pos, 6)) <= TOL
    assert not s.keep_verified(1)  # the session moved since the verify: the caller rolls back
    s.verify(ids[pos + 6 : pos + 9])
    assert not s.keep_verified(4) and not s.keep_verified(0)  # past the verified rows / none kept


def test_v4_speculative_loop_keeps_rejections_without_rollback(oracle, monkeypatch):
    """The speculative loop's rejected rounds on V4 keep the accepted prefix from the chain:
    no rollback, no re-verify, the same tokens and session as plain greedy decoding."""
    from ds4mlx.runtime.session import Session

    _, lm, ref, _ = load_case(oracle, *FAMILIES["deepseek_v4"])
    monkeypatch.setattr(Session, "rollback", lambda *a: pytest.fail("rollback"))
    s, want, t, loop = _wrong_drafts(lm, ref["input_ids"][0].tolist()[:6], 40)
    assert list(loop) == want and t.tokens == s.tokens
    assert maxdiff(t.last_logits[None], lm.logits(t.tokens)[-1:]) <= TOL
    assert loop.stats.rollbacks > 0 and 0 < loop.stats.accepted < loop.stats.drafted


def test_v41_verify_runs_the_static_step_chained_as_the_forward_does(oracle, monkeypatch):
    """DeepSeek V4.1's verify with `chain_verify` goes through the static forward of a CHAIN
    context: its logits those of the PREFILL forward's verify (within TOL), a kept prefix
    those of plain steps, and the DSpark drafter's capture keeps the PREFILL verify (its
    states come from there)."""
    _, lm, ref, _ = load_case(oracle, *FAMILIES["deepseek_v41"])
    ids = ref["input_ids"][0].tolist()
    chained = []
    real = stepper.step_chain
    monkeypatch.setattr(stepper, "step_chain", lambda m, c, t, p: chained.append(t.shape[1]) or real(m, c, t, p))

    def run(chain: bool):
        monkeypatch.setattr(lm.model, "chain_verify", chain, raising=False)
        s = lm.new_session(ctx=len(ids) + 8, chunk=5)
        s.prefill(ids[:4])
        rows, pos = [s.decode(ids[4])[None]], 5  # the static step's first run: it is then checked
        for k in (1, 4, 2, 3, 4, 1, 3):
            rows.append(np.array(s.verify(ids[pos : pos + k + 1])))
            pos += k + 1
        rows.append(np.stack([s.decode(t) for t in ids[pos : pos + 4]]))
        return np.concatenate(rows), s, pos

    want, _, _ = run(False)
    assert not chained
    got, s, pos = run(True)
    assert chained == [2, 5, 3, 4, 5, 2, 4]
    assert maxdiff(got, want) <= TOL
    s.verify(ids[pos + 4 : pos + 8])
    assert s.keep_verified(2)
    assert maxdiff(s.last_logits[None], _stepped(lm, ids, pos + 5, 1)) <= TOL
    lm.model.model.capture_hook = lambda *a: None
    try:
        assert not stepper.supports_chain(lm.model)
    finally:
        lm.model.model.capture_hook = None
    assert stepper.supports_chain(lm.model)
    monkeypatch.undo()
    assert not stepper.supports_chain(lm.model)  # off by default
