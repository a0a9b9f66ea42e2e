"""MRoPE (t, h, w) positions of image rows in the Qwen3.8 language model (#23) against
transformers' `Qwen4ExpForCausalLM` given the same [3, 1, T] position ids (float32).

The prompt holds two image blocks (a 2x3 and a 1x4 merged grid) whose pad rows sit on
their grid (vision.encoder.mrope_positions, checked against `get_rope_index` in
test_vision_inputs.py): the attention and QSA-indexer ropes, chunked prefills cut inside
an image and inside an indexer block, the decode after the image (rows at row +
rope_delta, the compiled static step included), and a snapshot / restore of an image
session are compared with transformers' forward and its cached decode."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx import stepper
from ds4mlx.models.qwen4_exp import AttentionCache
from ds4mlx.vision.encoder import ImageSpan, PromptPositions, mrope_positions

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case, maxdiff  # noqa: E402

torch = pytest.importorskip("torch")
hf = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

TOL = 1e-4
SCRIPT = "make_tiny_qwen4_exp.py"
MERGE = 2
# text(3) [start, 2x3 pads, end] text(2) [start, 1x4 pads, end] text(5): 24 rows
SPANS = [ImageSpan(3, 8, "a", (1, 4, 6)), ImageSpan(13, 6, "b", (1, 2, 8))]
PROMPT = 24
DECODE = 6  # tokens decoded after the prompt


@pytest.fixture(scope="module", params=[None, "long"], ids=lambda c: c or "default")
def case(request, oracle):
    folder, lm, ref, _ = load_case(oracle, SCRIPT, request.param)
    ids = ref["input_ids"][0].tolist()[: PROMPT + DECODE]
    pos = mrope_positions(PROMPT, SPANS, MERGE)
    delta = int(pos.max()) + 1 - PROMPT
    full_pos = np.concatenate([pos, np.broadcast_to(np.arange(PROMPT, PROMPT + DECODE) + delta, (3, DECODE))], axis=1)
    model = hf.Qwen4ExpForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32)
    model.eval()
    model.set_attn_implementation("eager")
    t_ids = torch.tensor([ids])
    with torch.no_grad():
        want_full = model(input_ids=t_ids, position_ids=torch.from_numpy(full_pos)[:, None]).logits[0].numpy()
        # transformers' own cached decode after the image prompt
        out = model(input_ids=t_ids[:, :PROMPT], position_ids=torch.from_numpy(pos)[:, None], use_cache=True)
        pkv, steps = out.past_key_values, []
        for t in range(PROMPT, PROMPT + DECODE):
            p = torch.full((3, 1, 1), t + delta, dtype=torch.long)
            o = model(input_ids=t_ids[:, t : t + 1], position_ids=p, past_key_values=pkv, use_cache=True)
            pkv = o.past_key_values
            steps.append(o.logits[0, -1].numpy())
    return lm, ids, want_full, np.stack(steps), delta


def _prefill(lm, ids, chunk):
    s = lm.new_session(ctx=PROMPT + DECODE + 8, chunk=chunk)
    bb = lm.model.model
    bb.input_positions = PromptPositions(SPANS, MERGE)
    try:
        last = s.prefill(ids[:PROMPT])
    finally:
        bb.input_positions = None
    return s, last


def test_positions_differ_from_text(case):
    *_, delta = case
    assert delta < 0  # the images make the prompt's positions run behind its row count


def test_full_forward_matches_transformers(case):
    lm, ids, want_full, _, _ = case
    cache = lm.model.make_cache()
    bb = lm.model.model
    bb.input_positions = PromptPositions(SPANS, MERGE)
    try:
        got = np.array(lm.model(mx.array([ids[:PROMPT]], dtype=mx.int32), cache)[0])
    finally:
        bb.input_positions = None
    assert maxdiff(got, want_full[:PROMPT]) <= TOL
    # the text-only path really differs: the positions are under test
    assert maxdiff(lm.logits(ids[:PROMPT]), want_full[:PROMPT]) > 10 * TOL


@pytest.mark.parametrize("chunk", [1, 5, 7, 64])
@pytest.mark.parametrize("how", ["compiled", "legacy"])
def test_prefill_then_decode_matches_transformers(case, chunk, how, monkeypatch):
    """Chunked image prefill (chunks cut inside an image and inside QSA blocks), then
    token-by-token decode at row + rope_delta, on the compiled static step and the
    dynamic path."""
    lm, ids, want_full, want_steps, delta = case
    monkeypatch.setenv(stepper.MODE_ENV, how)
    s, last = _prefill(lm, ids, chunk)
    assert maxdiff(last, want_full[PROMPT - 1]) <= TOL
    assert all(c.rope_delta == delta for c in s._cache if isinstance(c, AttentionCache))
    stepped = []
    real = type(lm.model).static_step
    monkeypatch.setattr(type(lm.model), "static_step", lambda self, *a: stepped.append(1) or real(self, *a))
    stepper.forget(lm.model)  # retrace: the compiled step calls static_step again
    steps = np.stack([s.decode(t) for t in ids[PROMPT:]])
    assert bool(stepped) == (how == "compiled")  # the static step really ran (or not)
    assert maxdiff(steps, want_steps) <= TOL
    assert maxdiff(steps, want_full[PROMPT:]) <= TOL


def test_snapshot_restore_keeps_positions(case):
    """A restored image session decodes at the image prompt's positions (rope_delta and
    the explicit image-row positions travel in the snapshot), bit-identically."""
    lm, ids, want_full, want_steps, delta = case
    a, _ = _prefill(lm, ids, 7)
    blob = a.snapshot()
    want = np.stack([a.decode(t) for t in ids[PROMPT:]])
    b = lm.new_session(ctx=PROMPT + DECODE + 8, chunk=7)
    b.prefill(ids[:3])  # unrelated text state to be replaced
    b.restore(blob)
    attn = [c for c in b._cache if isinstance(c, AttentionCache)]
    assert attn and all(c.rope_delta == delta and c.mrope is not None for c in attn)
    got = np.stack([b.decode(t) for t in ids[PROMPT:]])
    assert np.array_equal(got, want)
    assert maxdiff(got, want_steps) <= TOL
    # a text session restored over an image one drops its positions
    c = lm.new_session(ctx=PROMPT + DECODE + 8, chunk=7)
    c.prefill(ids[:5])
    t_blob = c.snapshot()
    b.restore(t_blob)
    assert all(x.rope_delta == 0 and x.mrope is None for x in b._cache if isinstance(x, AttentionCache))
