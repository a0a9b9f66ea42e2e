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
from lazy_modules import lazy

from ds4mlx.models.qwen4_exp import AttentionCache
from ds4mlx.runtime import stepper
from ds4mlx.vision.encoder import ImageSpan, PromptPositions, mrope_positions

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case, maxdiff  # noqa: E402

torch = lazy("torch")
hf = lazy("transformers.models.qwen4_exp.modeling_qwen4_exp")

TOL = 1e-4
SCRIPT = "make_tiny_qwen4_exp.py"
MERGE = 2
# text(3) [start, 2x3 pads, end] text(2) [start, 1x4 pads, end] text(5): 24 rows
SPANS = [ImageSpan(3, 8, "a", (1, 4, 6)), ImageSpan(13, 6, "b", (1, 2, 8))]
PROMPT = 24
DECODE = 6  # tokens decoded after the prompt


def _transformers(folder, ids: list[int], prompt: int):
    """transformers' logits of `ids` (the first `prompt` rows an image prompt, the rest
    text at row + delta): the full forward, its cached decode after the prompt, delta."""
    n = len(ids)
    pos = mrope_positions(prompt, SPANS, MERGE)
    delta = int(pos.max()) + 1 - prompt
    full_pos = np.concatenate([pos, np.broadcast_to(np.arange(prompt, n) + delta, (3, n - prompt))], axis=1)
    model = hf.Qwen4ExpForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32)
    model.eval()
    model.set_attn_implementation("eager")
    t_ids = torch.tensor([ids])
    with torch.no_grad():
        want_full = model(input_ids=t_ids, position_ids=torch.from_numpy(full_pos)[:, None]).logits[0].numpy()
        # transformers' own cached decode after the image prompt
        out = model(input_ids=t_ids[:, :prompt], position_ids=torch.from_numpy(pos)[:, None], use_cache=True)
        pkv, steps = out.past_key_values, []
        for t in range(prompt, n):
            p = torch.full((3, 1, 1), t + delta, dtype=torch.long)
            o = model(input_ids=t_ids[:, t : t + 1], position_ids=p, past_key_values=pkv, use_cache=True)
            pkv = o.past_key_values
            steps.append(o.logits[0, -1].numpy())
    return want_full, np.stack(steps), delta


@pytest.fixture(scope="module", params=[None, "long"], ids=lambda c: c or "default")
def case(request, oracle):
    folder, lm, ref, _ = load_case(oracle, SCRIPT, request.param)
    ids = ref["input_ids"][0].tolist()[: PROMPT + DECODE]
    want_full, steps, delta = _transformers(folder, ids, PROMPT)
    return lm, ids, want_full, steps, delta, folder


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
    *_, delta, _ = case
    assert delta < 0  # the images make the prompt's positions run behind its row count


def test_full_forward_matches_transformers(case):
    lm, ids, want_full, _, _, _ = case
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
    lm, ids, want_full, want_steps, delta, _ = case
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


@pytest.mark.parametrize("how", ["compiled", "eager"])
def test_undoable_decode_right_after_an_image(case, how, monkeypatch):
    """A prompt that ends on the last image's vision_end: the open QSA block starts on
    image rows, so the static step takes that block's (t, h, w) position; undoable steps
    (the engine's lookahead) and an undo on this path."""
    lm, ids, _, _, _, folder = case
    prompt = SPANS[-1].start + SPANS[-1].length
    ids = ids[: prompt + DECODE]
    want_full, want_steps, _ = _transformers(folder, ids, prompt)
    monkeypatch.setenv(stepper.MODE_ENV, how)
    s = lm.new_session(ctx=len(ids) + 8, chunk=6)
    bb = lm.model.model
    bb.input_positions = PromptPositions(SPANS, MERGE)
    try:
        assert maxdiff(s.prefill(ids[:prompt]), want_full[prompt - 1]) <= TOL
    finally:
        bb.input_positions = None
    assert any(not c.plain_from(c.offset // c.ratio * c.ratio) for c in s.caches if isinstance(c, AttentionCache))
    assert s.can_undo
    got = []
    for i, t in enumerate(ids[prompt:]):
        if i == 2:  # a step taken back: the next one is as if it never ran
            s.step(ids[0], undoable=True)
            s.undo_step()
        got.append(np.array(s.step(t, undoable=True)))
    assert maxdiff(np.stack(got), want_steps) <= TOL


def test_verify_chain_right_after_an_image(case, monkeypatch):
    """A speculative verify (the static forward's CHAIN context) right after a prompt that
    ends on the last image's vision_end: the chain's first row takes the open QSA block's
    (t, h, w) position, the rows after that block closes open text blocks at row + delta;
    every row's logits equal transformers' cached decode, and the indexer's block keys
    those of the same tokens decoded one by one."""
    lm, ids, _, _, _, folder = case
    prompt = SPANS[-1].start + SPANS[-1].length
    ids = ids[: prompt + DECODE]
    want_full, want_steps, _ = _transformers(folder, ids, prompt)
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    lm.new_session(ctx=4).decode(ids[0])  # the model's first static step (its check) before a chain
    assert stepper.supports_chain(lm.model)
    chained, stepped = (lm.new_session(ctx=len(ids) + 8, chunk=6) for _ in range(2))
    bb = lm.model.model
    bb.input_positions = PromptPositions(SPANS, MERGE)
    try:
        chained.prefill(ids[:prompt])
        stepped.prefill(ids[:prompt])
    finally:
        bb.input_positions = None
    attn = [c for c in chained.caches if isinstance(c, AttentionCache)]
    assert any(not c.plain_from(c.offset // c.ratio * c.ratio) for c in attn)
    assert maxdiff(np.array(chained.verify(ids[prompt:])), want_steps) <= TOL
    for t in ids[prompt:]:
        stepped.decode(t)
    blocks = [c.index_blocks.live() for c in stepped.caches if isinstance(c, AttentionCache)]
    assert all(maxdiff(np.array(c.index_blocks.live()), np.array(b)) <= 1e-5 for c, b in zip(attn, blocks))


def test_snapshot_restore_keeps_positions(case):
    """A restored image session decodes at the image prompt's positions (rope_delta and
    the explicit image-row positions travel in the snapshot), bit-identically."""
    lm, ids, want_full, want_steps, delta, _ = case
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


# -- the whole VLM: transformers' Qwen4ExpForConditionalGeneration given pixel_values -------
VISION = dict(
    depth=2,
    hidden_size=32,
    hidden_act="gelu",
    intermediate_size=48,
    num_heads=2,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=MERGE,
    temporal_patch_size=2,
    num_position_embeddings=36,
    rope_parameters={"rope_type": "axial", "rope_theta": 500.0},
    initializer_range=0.2,
)
GRIDS = [(1, 4, 6), (1, 2, 8)]  # the grids of SPANS


@pytest.fixture(scope="module")
def vlm(oracle, tmp_path_factory):
    """(ds4mlx LanguageModel, VisionEncoder, prompt ids, pixel rows, HF prompt logits,
    HF cached decode logits) of a tiny random VLM over the default text oracle."""
    import json

    from safetensors.torch import save_file
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpConfig

    from ds4mlx.models.base import load_hf_dir
    from ds4mlx.vision.load import load_vision

    folder, _, ref, _ = load_case(oracle, SCRIPT, None)
    text = json.loads((folder / "config.json").read_text())
    V = text["vocab_size"]
    cfg = Qwen4ExpConfig(
        text_config=text,
        vision_config={**VISION, "out_hidden_size": text["hidden_size"]},
        image_token_id=V - 2,
        video_token_id=V - 4,
        vision_start_token_id=V - 3,
        vision_end_token_id=V - 1,
    )
    torch.manual_seed(0)
    model = hf.Qwen4ExpForConditionalGeneration(cfg).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for p in model.model.visual.parameters():  # the random init is near zero: spread it
            p.add_(torch.randn_like(p) * 0.05)
    out_dir = tmp_path_factory.mktemp("qwen4_exp_vlm")
    cfg.save_pretrained(out_dir)  # the in-memory state-dict names, as tests/oracle writes them
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    ids = [int(t) % (V - 4) for t in ref["input_ids"][0].tolist()[: PROMPT + DECODE]]
    types = np.zeros(PROMPT + DECODE, np.int64)
    for s in SPANS:
        ids[s.start], ids[s.start + s.length - 1] = V - 3, V - 1
        for i in s.pads:
            ids[i] = V - 2
        types[list(s.pads)] = 1
    patch = 3 * 2 * 16 * 16
    rng = np.random.default_rng(1)
    pixels = rng.standard_normal((sum(int(np.prod(g)) for g in GRIDS), patch)).astype(np.float32)
    t_ids = torch.tensor([ids])
    kw = dict(pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.tensor(GRIDS))
    with torch.no_grad():
        full = model(input_ids=t_ids[:, :PROMPT], mm_token_type_ids=torch.from_numpy(types[:PROMPT])[None], **kw)
        want_full = full.logits[0].numpy()
        out = model(
            input_ids=t_ids[:, :PROMPT], mm_token_type_ids=torch.from_numpy(types[:PROMPT])[None], use_cache=True, **kw
        )
        pkv, steps = out.past_key_values, []
        for t in range(PROMPT, PROMPT + DECODE):
            o = model(
                input_ids=t_ids[:, t : t + 1],
                mm_token_type_ids=torch.zeros((1, 1), dtype=torch.long),
                past_key_values=pkv,
                use_cache=True,
            )
            pkv = o.past_key_values
            steps.append(o.logits[0, -1].numpy())
    lm = load_hf_dir(str(out_dir))
    enc = load_vision(str(out_dir), lm)
    return lm, enc, ids, pixels, want_full, np.stack(steps)


def test_vlm_prompt_and_decode_match_transformers(vlm):
    """Encoder rows + MRoPE positions: the image prompt's logits and the decode after it
    equal transformers' model given pixel_values (float32)."""
    from ds4mlx.vision.encoder import ImageRows

    lm, enc, ids, pixels, want_full, want_steps = vlm
    assert (enc.ids.start, enc.ids.pad, enc.ids.end) == (ids[3], ids[4], ids[10])
    n0 = int(np.prod(GRIDS[0]))
    rows = [
        enc.tower(mx.array(pixels[:n0]), [GRIDS[0]]).embeddings,
        enc.tower(mx.array(pixels[n0:]), [GRIDS[1]]).embeddings,
    ]
    bb = lm.model.model
    s = lm.new_session(ctx=PROMPT + DECODE + 8, chunk=5)
    bb.input_rows = ImageRows.for_spans(SPANS, rows)
    bb.input_positions = PromptPositions(SPANS, MERGE)
    try:
        cache = lm.model.make_cache()
        full = np.array(lm.model(mx.array([ids[:PROMPT]], dtype=mx.int32), cache)[0])
        last = s.prefill(ids[:PROMPT])
    finally:
        bb.input_rows = bb.input_positions = None
    assert maxdiff(full, want_full) <= TOL
    assert maxdiff(last, want_full[-1]) <= TOL
    steps = np.stack([s.decode(t) for t in ids[PROMPT:]])
    assert maxdiff(steps, want_steps) <= TOL
    # the rows and the positions both matter here
    assert maxdiff(lm.logits(ids[:PROMPT]), want_full) > 10 * TOL
    no_pos = lm.model.make_cache()
    bb.input_rows = ImageRows.for_spans(SPANS, rows)
    try:
        text_pos = np.array(lm.model(mx.array([ids[:PROMPT]], dtype=mx.int32), no_pos)[0])
    finally:
        bb.input_rows = None
    assert maxdiff(text_pos, want_full) > 10 * TOL
