"""Image jobs through the engine on the Qwen3.8 demo model with the demo encoder
(`demo:qwen4_exp --vision demo`): the encoder rows reach the model at the image
positions, live-KV reuse only with matching image fingerprints and spans, and no
vision state in the memory checkpoints or the disk KV cache hooks."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ds4mlx.chat import images as chat_images
from ds4mlx.chat.messages import Conversation, Message
from ds4mlx.engine import CacheHooks, Engine, Finish, Job
from ds4mlx.runtime.sampling import SamplingParams
from ds4mlx.vision import prompt as vprompt
from ds4mlx.vision.load import load_vision

sys.path.insert(0, str(Path(__file__).parent))
from vision_helpers import data_uri, image_bytes  # noqa: E402


@pytest.fixture(scope="module")
def loaded(shared_demo):
    return shared_demo("demo:qwen4_exp")


class RecordingHooks(CacheHooks):
    def __init__(self):
        self.calls = []

    def cold_save_point(self, engine, job, effective):
        self.calls.append("cold_save_point")
        return 0

    def after_prefill(self, engine, job):
        self.calls.append("after_prefill")

    def on_progress(self, engine, job):
        self.calls.append("on_progress")


@pytest.fixture()
def engine(loaded):
    model, tok = loaded
    hooks = RecordingHooks()
    eng = Engine(model, tok, ctx=4096, default_max_tokens=4, cache=hooks, prefill_chunk=64)
    eng.enable_vision(load_vision("demo", model))
    eng.hooks = hooks
    yield eng
    eng.close()


def image(seed: int, w: int = 40, h: int = 30):
    return chat_images.from_data_uri(data_uri(image_bytes(w, h, seed=seed)))


def job_for(engine, parts: list, max_tokens: int = 3) -> Job:
    """parts: text and ImageInput, one user message."""
    ims = [p for p in parts if not isinstance(p, str)]
    text = "".join(p if isinstance(p, str) else p.marker for p in parts)
    conv = Conversation(messages=[Message("user", text)], thinking="none")
    job = Job(
        prompt_text=engine.protocol.render(conv),
        thinking="none",
        max_tokens=max_tokens,
        params=SamplingParams(temperature=0.0),
        family=engine.protocol.family,
    )
    vprompt.attach(job, engine, ims)
    return job


def run(engine, job) -> Finish:
    return next(e for e in engine.generate(job) if isinstance(e, Finish))


def test_prompt_holds_one_block_per_image_in_place(engine):
    a, b = image(1), image(2, 300, 100)
    job = job_for(engine, ["look: ", a, " and ", b, " ok"])
    ids = engine.vision.ids
    assert [s.start for s in job.images] == [i for i, t in enumerate(job.prompt_ids) if t == ids.start]
    for s, im in zip(job.images, job.image_inputs):
        block = job.prompt_ids[s.start : s.start + s.length]
        assert block == engine.vision.block_ids(im)
    assert job.images[0].start < job.images[1].start
    head, rest = job.prompt_text.split(a.marker)
    middle, tail = rest.split(b.marker)
    enc = engine.tokenizer.encode
    sa, sb = job.images
    assert job.prompt_ids[: sa.start] == enc(head)  # the text around the blocks is tokenized as it was
    assert job.prompt_ids[sa.start + sa.length : sb.start] == enc(middle) and middle.startswith(" and ")
    assert job.prompt_ids[sb.start + sb.length :] == enc(tail)


def test_encoder_rows_change_the_answer_logits(engine, loaded):
    model, _ = loaded
    job_a = job_for(engine, ["describe ", image(1), " please"])
    job_b = job_for(engine, ["describe ", image(7), " please"])
    assert job_a.prompt_ids == job_b.prompt_ids  # same size, same tokens: only the rows differ
    logits = []
    for job in (job_a, job_b):
        s = model.new_session(4096)
        from ds4mlx.vision import reuse

        fake = type("E", (), {"model": model.model, "vision": engine.vision})()
        with reuse.rows_installed(fake, job, 0):
            logits.append(s.prefill(job.prompt_ids))
    plain = model.new_session(4096).prefill(job_a.prompt_ids)
    assert np.abs(logits[0] - logits[1]).max() > 1e-3
    assert np.abs(logits[0] - plain).max() > 1e-3


def test_same_images_reuse_the_live_prefix(engine):
    a, b = image(1), image(2)
    first = job_for(engine, ["two: ", a, " and ", b, " ok"])
    fin1 = run(engine, first)
    assert fin1.reason in ("stop", "length") and fin1.usage.cached_tokens == 0
    live = engine.session.tokens
    # the next turn: same images (new markers, same bytes), the live answer kept as a prefix
    again = job_for(engine, ["two: ", image(1), " and ", image(2), " ok"])
    assert again.images == first.images  # same positions, same fingerprints (the markers differ)
    again.prompt_ids = live + engine.tokenizer.encode(" more")
    fin2 = run(engine, again)
    assert engine.stats.last_cache_source == "vision-prefix"
    assert fin2.usage.cached_tokens == len(live)


def test_replaced_image_rebuilds(engine):
    first = job_for(engine, ["two: ", image(1), " and ", image(2), " ok"])
    run(engine, first)
    live = engine.session.tokens
    changed = job_for(engine, ["two: ", image(1), " and ", image(3), " ok"])
    assert changed.prompt_ids == first.prompt_ids  # equal tokens: the fingerprints must tell
    changed.prompt_ids = live + engine.tokenizer.encode(" more")
    fin = run(engine, changed)
    assert fin.usage.cached_tokens == 0 and engine.stats.last_cache_source == "none"


def test_text_request_never_reuses_image_state(engine):
    first = job_for(engine, ["one: ", image(4), " ok"])
    run(engine, first)
    live = engine.session.tokens
    text = Job(prompt_text="", prompt_ids=live + [5, 6], max_tokens=2, params=SamplingParams(temperature=0.0))
    fin = run(engine, text)
    assert fin.usage.cached_tokens == 0 and engine.live_images is None


def test_vision_state_stays_out_of_checkpoints_and_disk_hooks(engine):
    engine.checkpoints.min_tokens = 1  # would keep every prompt end of a text session
    saved = engine.checkpoints.saved
    engine.hooks.calls.clear()
    run(engine, job_for(engine, ["one: ", image(5), " ok"], max_tokens=2))
    assert engine.hooks.calls == []  # silenced while the session holds the image
    assert engine.checkpoints.saved == saved
    engine.hooks.calls.clear()
    run(engine, Job(prompt_text="", prompt_ids=[1, 2, 3, 4], max_tokens=1, params=SamplingParams(temperature=0.0)))
    assert "after_prefill" in engine.hooks.calls  # text again: the hooks run


def test_no_encoder_and_unplaced_images_are_refused(loaded):
    model, tok = loaded
    eng = Engine(model, tok, ctx=1024)
    try:
        job = Job(prompt_text="x" + image(1).marker)
        with pytest.raises(vprompt.ImagePromptError) as e:
            vprompt.attach(job, eng, [image(1)])
        assert e.value.message == vprompt.ERR_NO_ENCODER
        eng.enable_vision(load_vision("demo", model))
        with pytest.raises(vprompt.ImagePromptError) as e:
            vprompt.attach(Job(prompt_text="no marker here"), eng, [image(1)])
        assert e.value.message == vprompt.ERR_NOT_PLACED
    finally:
        eng.close()


def test_same_request_again_restores_the_image_checkpoint(engine):
    first = job_for(engine, ["two: ", image(1), " and ", image(2), " ok"])
    fin1 = run(engine, first)
    retry = job_for(engine, ["two: ", image(1), " and ", image(2), " ok"])  # the same images, new markers
    fin2 = run(engine, retry)
    assert engine.stats.last_cache_source == "vision-checkpoint"
    assert fin2.usage.cached_tokens == fin2.usage.prompt_tokens == fin1.usage.prompt_tokens
    assert fin2.raw_text == fin1.raw_text  # greedy: the restored logits are the prompt's
    other = job_for(engine, ["two: ", image(1), " and ", image(9), " ok"])  # one image replaced
    fin3 = run(engine, other)
    assert fin3.usage.cached_tokens == 0 and engine.stats.last_cache_source == "none"


def _fresh_prefill(engine, model, job, ids):
    """The logits of `ids` prefilled from the first token with the job's images (the
    engine's rebuild path), and the session."""
    from ds4mlx.vision import reuse

    s = model.new_session(4096)
    with reuse.rows_installed(engine, job, 0):
        last = s.prefill(ids)
    return s, last


def _deltas(session) -> set:
    return {c.rope_delta for c in session.caches if hasattr(c, "rope_delta")}


def test_reused_image_prefix_continues_at_the_image_positions(engine, loaded):
    """The live-prefix reuse (the continuation is prefilled with no new images, so no
    positions hook) and the image checkpoint keep the MRoPE position delta: the answer
    after the reused prefix is the answer of a session rebuilt from the first token."""
    from ds4mlx.vision.encoder import mrope_positions

    model, _ = loaded
    first = job_for(engine, ["two: ", image(1, 300, 100), " and ", image(2), " ok"])
    run(engine, first)
    live = list(engine.session.tokens)
    merge = engine.vision.tower.args.spatial_merge_size
    n = len(first.prompt_ids)
    want_delta = int(mrope_positions(n, first.images, merge).max()) + 1 - n
    assert want_delta < 0 and _deltas(engine.session) == {want_delta}
    again = job_for(engine, ["two: ", image(1, 300, 100), " and ", image(2), " ok"])
    more = engine.tokenizer.encode(" more words")
    again.prompt_ids = live + more
    again.max_tokens = 6
    run(engine, again)
    assert engine.stats.last_cache_source == "vision-prefix"
    assert _deltas(engine.session) == {want_delta}
    answer = list(engine.session.tokens)[len(live) + len(more) :]
    assert answer
    # a session rebuilt from the first token (test thread, its own arrays), decoded greedily
    fresh, logits = _fresh_prefill(engine, model, again, live + more)
    assert _deltas(fresh) == {want_delta}
    greedy = []
    for _ in answer:
        greedy.append(int(np.argmax(logits)))
        logits = fresh.decode(greedy[-1])
    assert greedy == answer
