"""How often the compiled static forward (ds4mlx/runtime/stepper.py) is traced: once per
(context kind, row count, row-buffer bucket), never again on later steps of the same shapes
(docs/forward.md §5, §8 "trace count").  A retrace per token would still give the right
logits, only slower: these counts are what catches it.

DeepSeek V4, V4.1, GLM 5.2 / 5.3 and Qwen3.8 on their tiny oracle models (CPU, float32): one session
decoding more than 20 tokens inside one bucket, then the same with buckets of 4 rows (one
trace per bucket signature met), B sessions stepped together, and verify chains (V4.1's
opt-in).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

from ds4mlx.models import cache as row_cache
from ds4mlx.runtime import session as session_mod
from ds4mlx.runtime import stepper
from ds4mlx.runtime.forward_context import CHAIN, DECODE

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case  # noqa: E402

ONE, ROWS = (DECODE, True), (DECODE, False)
STEPS = 24


CASES = {
    "v4": ("make_tiny_deepseek_v4.py", None),
    "v41": ("probe_mlx_deepseek_v41.py", None),
    "glm52": ("make_tiny_glm_moe_dsa.py", "alt"),
    "glm53": ("make_tiny_glm5_next.py", None),
    "qwen": ("make_tiny_qwen4_exp.py", None),
}


@pytest.fixture(scope="module", params=list(CASES))
def family(request, oracle):
    _, lm, ref, _ = load_case(oracle, *CASES[request.param])
    return request.param, lm, ref["input_ids"][0].tolist()


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")


def _fresh(lm):
    """Forget the model's compiled functions (their counts start at zero)."""
    stepper.forget(lm.model)
    return lm


def _shapes(lm, s) -> tuple:
    return tuple(a.shape for a in lm.model.static_state(s.caches))


def test_one_row_decode_traces_once_inside_a_bucket(family):
    _, lm, ids = family
    lm = _fresh(lm)
    s = lm.new_session(ctx=len(ids) + 128)
    s.prefill(ids[:5])
    seen = set()
    for t in ids[5 : 5 + STEPS]:
        seen.add(_shapes(lm, s))
        mx.eval(s.step(t))
    assert len(seen) == 1  # no bucket boundary crossed: the shapes never changed
    assert stepper.trace_counts(lm.model) == {ONE: 1}


def test_one_row_decode_traces_once_per_bucket(family, monkeypatch):
    """Buckets of 4 rows: the compressed rows cross several; one trace per shape signature."""
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    _, lm, ids = family
    lm = _fresh(lm)
    s = lm.new_session(ctx=len(ids) + 128)
    s.prefill(ids[:5])
    seen = set()
    for t in ids[5:]:
        seen.add(_shapes(lm, s))
        mx.eval(s.step(t))
    assert len(seen) >= 3
    assert stepper.trace_counts(lm.model) == {ONE: len(seen)}


def test_rows_trace_once_per_row_count(family):
    _, lm, ids = family
    lm = _fresh(lm)
    sessions = []
    for k in range(3):
        s = lm.new_session(ctx=len(ids) + 128)
        s.prefill(ids[k : k + 5 + k])  # rows at different positions
        sessions.append(s)
    mx.eval(sessions[0].step(ids[20]))  # the first step's eager check, before rows are allowed
    assert session_mod.can_step_together(sessions)
    for B in (2, 3):
        for i in range(STEPS):
            mx.eval(*session_mod.step_together(sessions[:B], [ids[(i + b) % len(ids)] for b in range(B)]))
    # one trace of the one-row step, one per row count (the buffers stay in their bucket)
    assert stepper.trace_counts(lm.model) == {ONE: 1, ROWS: 2}


def test_chains_trace_once_per_length(family, monkeypatch):
    name, lm, ids = family
    if name == "v41":
        monkeypatch.setattr(lm.model, "chain_verify", True, raising=False)  # opt-in on V4.1
    ids = ids * 3  # room for the chains
    lm = _fresh(lm)
    s = lm.new_session(ctx=len(ids) + 64)
    s.prefill(ids[:5])
    mx.eval(s.step(ids[5]))  # the eager first-step check
    assert stepper.supports_chain(lm.model)
    at = 6
    for T in (3, 4):
        for _ in range(6):
            mx.eval(s.verify(ids[at : at + T]))
            at += T
    assert stepper.trace_counts(lm.model) == {ONE: 1, (CHAIN, False): 2}
