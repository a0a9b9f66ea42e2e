"""The compiled static decode step (ds4mlx/runtime/stepper.py) against the dynamic reference path.

On the tiny oracle models of all five families (CPU, float32; DeepSeek V4, V4.1, GLM 5.2,
GLM 5.3, Qwen3.8): logits of the compiled step within 1e-4 of the legacy per-layer forward
and of the full forward over >= 64 decode steps that cross the sliding window, compression
boundaries and row-bucket resizes (models/cache.MIN_BUCKET lowered to 4 rows); greedy
generations identical; snapshot / restore mid-decode bit-exact; a family without a static
step runs the legacy path; the decode loop and the device sampler.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.models import cache as row_cache
from ds4mlx.runtime import stepper

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case, maxdiff  # noqa: E402

TOL = 1e-4
PREFILL = 5  # decode starts early: every later position is a compiled step


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)


@pytest.fixture(scope="module", params=["long", "odd"])
def case(request, oracle):
    return load_case(oracle, "make_tiny_deepseek_v4.py", request.param)


def _decode(lm, ids, how, monkeypatch, prefill=PREFILL):
    monkeypatch.setenv(stepper.MODE_ENV, how)
    s = lm.new_session(ctx=len(ids) + 80, chunk=7)
    s.prefill(ids[:prefill])
    caps = set()
    out = []
    for t in ids[prefill:]:
        out.append(s.decode(t))
        caps.add(tuple(a.shape for a in lm.model.static_state(s._cache)) if stepper.supports_static(lm.model) else ())
    return s, np.stack(out), caps


_LEGACY: dict = {}


def _legacy_logits(lm, ids, monkeypatch) -> np.ndarray:
    """The legacy path's logits over `ids` (PREFILL, then decode), once per model and sequence:
    the reference both static-step attentions are compared with."""
    key = (id(lm), tuple(ids))
    if key not in _LEGACY:
        _LEGACY[key] = (lm, _decode(lm, ids, "legacy", monkeypatch)[1])  # lm kept: its id stays unique
    return _LEGACY[key][1]


def test_compiled_step_matches_reference(case, monkeypatch):
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    args = lm.model.args
    assert len(ids) - PREFILL >= 64 and len(ids) > args.sliding_window + PREFILL
    legacy = _legacy_logits(lm, ids, monkeypatch)
    s, compiled, caps = _decode(lm, ids, "compiled", monkeypatch)
    assert len(caps) >= 3  # the row buffers moved through several buckets
    assert maxdiff(compiled, legacy) <= TOL
    assert maxdiff(compiled, ref["logits_full"][0][PREFILL:]) <= TOL
    assert s.tokens == ids and all(c.offset == len(ids) for c in s._cache)
    for c in s._cache:  # host counters follow the positions
        for st in (c.comp, c.index):
            if st is not None:
                assert st.n == len(ids) // st.ratio


def test_one_launch_attention_in_the_step_matches_reference(case, monkeypatch):
    """The GPU's static-step attention (`sparse_attention.attend_at`: ring + capacity rows or
    the selected top-k rows, masks from the position array) through its reference face."""
    from ds4mlx.kernels import sparse_attention

    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    args = lm.model.args
    assert max(row_cache.bucket(len(ids) // 4), 4) > args.index_topk  # the selected path runs too
    legacy = _legacy_logits(lm, ids, monkeypatch)
    stepper.forget(lm.model)  # a fresh trace with the other attention
    monkeypatch.setattr(sparse_attention, "step_face", lambda: "reference")
    try:
        _, compiled, _ = _decode(lm, ids, "compiled", monkeypatch)
    finally:
        stepper.forget(lm.model)
    assert maxdiff(compiled, legacy) <= TOL
    assert maxdiff(compiled, ref["logits_full"][0][PREFILL:]) <= TOL


def test_eager_static_step_equals_compiled(case, monkeypatch):
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()[:40]
    _, eager, _ = _decode(lm, ids, "eager", monkeypatch)
    _, compiled, _ = _decode(lm, ids, "compiled", monkeypatch)
    assert maxdiff(eager, compiled) <= 1e-5


def _greedy(lm, prompt, n, how, monkeypatch):
    monkeypatch.setenv(stepper.MODE_ENV, how)
    s = lm.new_session(ctx=len(prompt) + n + 1, chunk=4)
    logits = s.prefill(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = s.decode(out[-1])
    return out


_LEGACY_GREEDY: dict = {}
LEGACY_GREEDY_N = 70  # the longest legacy run the V4 cases compare with; shorter ones take its prefix


def _legacy_greedy(lm, prompt, n, monkeypatch):
    """The legacy path's greedy tokens after `prompt`, LEGACY_GREEDY_N of them once per model and
    prompt (a session's ctx only bounds its length: a shorter run is this one's prefix)."""
    assert n <= LEGACY_GREEDY_N
    key = (id(lm), tuple(prompt))
    if key not in _LEGACY_GREEDY:
        _LEGACY_GREEDY[key] = (lm, _greedy(lm, prompt, LEGACY_GREEDY_N, "legacy", monkeypatch))  # lm kept
    return _LEGACY_GREEDY[key][1][:n]


def test_greedy_generation_identical(case, monkeypatch):
    _, lm, ref, _ = case
    prompt = ref["input_ids"][0].tolist()[:9]
    assert _greedy(lm, prompt, 70, "compiled", monkeypatch) == _legacy_greedy(lm, prompt, 70, monkeypatch)


def test_snapshot_restore_mid_decode_bit_exact(case, monkeypatch):
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    s = lm.new_session(ctx=len(ids), chunk=7)
    s.prefill(ids[:PREFILL])
    for t in ids[PREFILL:30]:
        s.decode(t)
    snap = s.snapshot()
    first = np.stack([s.decode(t) for t in ids[30:60]])
    s.restore(snap)
    again = np.stack([s.decode(t) for t in ids[30:60]])
    fresh = lm.new_session(ctx=len(ids), chunk=7)
    fresh.restore(snap)
    other = np.stack([fresh.decode(t) for t in ids[30:60]])
    assert np.array_equal(first, again) and np.array_equal(first, other)


def test_lazy_token_feeds_the_next_step(case, monkeypatch):
    """The sampled token stays on the device: step t+1 takes step t's argmax unevaluated."""
    _, lm, ref, _ = case
    prompt = ref["input_ids"][0].tolist()[:9]
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    s = lm.new_session(ctx=40)
    y = mx.argmax(mx.array(s.prefill(prompt)))
    toks = []
    for _ in range(20):
        toks.append(y)
        y = mx.argmax(s.step(y))
    assert [int(t.item()) for t in toks] == _legacy_greedy(lm, prompt, 20, monkeypatch)


def test_family_without_static_step_uses_the_legacy_path(oracle, monkeypatch):
    _, lm, ref, _ = load_case(oracle, "make_tiny_qwen4_exp.py", "long")
    monkeypatch.setattr(lm.model, "static_step", None, raising=False)  # a family not converted
    assert not stepper.supports_static(lm.model)
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    ids = ref["input_ids"][0].tolist()[:12]
    s = lm.new_session(ctx=len(ids))
    s.prefill(ids[:6])
    steps = np.stack([s.decode(t) for t in ids[6:]])
    assert maxdiff(steps, ref["logits_full"][0][6:12]) <= TOL


def test_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv(stepper.MODE_ENV, "fast")
    with pytest.raises(ValueError, match=stepper.MODE_ENV):
        stepper.mode()


# ----------------------------------------------------------------------------- the decode loop


def test_device_sampler_draws_what_the_host_sampler_draws():
    from ds4mlx.runtime.sampling import DeviceSampler, Sampler, SamplingParams

    rng = np.random.default_rng(0)
    rows = [mx.array(rng.normal(size=50).astype(np.float32) * 3) for _ in range(40)]
    for params in (
        SamplingParams(temperature=0.0, repetition_penalty=1.5, repetition_window=4),
        SamplingParams(
            temperature=0.9, top_p=0.9, top_k=20, min_p=0.02, seed=11, repetition_penalty=1.3, repetition_window=3
        ),
        SamplingParams(temperature=1.2, seed=5),
    ):
        host, dev = Sampler(params.seed), DeviceSampler(params, 50, banned=[7, 9])
        hist, got = [], []
        for x in rows:
            hist.append(int(host.sample(x, params, hist, [7, 9]).item()))
            got.append(int(dev(x).item()))
        assert got == hist and not {7, 9} & set(got)


def _loop_tokens(lm, prompt, n, monkeypatch, how="compiled", **kw):
    from ds4mlx.runtime.decode import decode_tokens, greedy

    monkeypatch.setenv(stepper.MODE_ENV, how)
    s = lm.new_session(ctx=len(prompt) + n + 2)
    logits = mx.array(s.prefill(prompt))
    loop = decode_tokens(s, logits, greedy(logits.shape[-1]), limit=n, **kw)
    return s, loop, list(loop)


def test_lookahead_loop_equals_synchronous_and_undoes_a_stop_token(case, monkeypatch):
    _, lm, ref, _ = case
    prompt = ref["input_ids"][0].tolist()[:9]
    _, _, sync = _loop_tokens(lm, prompt, 30, monkeypatch, lookahead=False)
    _, _, ahead = _loop_tokens(lm, prompt, 30, monkeypatch)
    assert ahead == sync == _legacy_greedy(lm, prompt, 30, monkeypatch)
    stop = ahead[12]
    first = ahead.index(stop)
    for lookahead in (True, False):
        s, loop, toks = _loop_tokens(lm, prompt, 30, monkeypatch, stop_ids=[stop], lookahead=lookahead)
        assert toks == ahead[:first] and loop.stopped_by == stop and loop.lookahead == lookahead
        assert s.tokens == prompt + toks  # the stop token's step was taken back
        ref_s = lm.new_session(ctx=len(prompt) + 40)
        ref_s.prefill(prompt + toks)
        assert maxdiff(s.last_logits, ref_s.last_logits) <= TOL
        assert maxdiff(s.decode(stop), ref_s.decode(stop)) <= TOL  # the caches are back too


def test_legacy_family_runs_the_loop_synchronously_with_stop_ids(oracle, monkeypatch):
    _, lm, ref, _ = load_case(oracle, "make_tiny_qwen4_exp.py", "long")
    monkeypatch.setattr(lm.model, "static_step", None, raising=False)  # a family not converted
    prompt = ref["input_ids"][0].tolist()[:6]
    _, loop, toks = _loop_tokens(lm, prompt, 8, monkeypatch)
    assert loop.lookahead and len(toks) == 8  # no stop ids: lookahead without undo
    _, loop, toks2 = _loop_tokens(lm, prompt, 8, monkeypatch, stop_ids=[toks[3]])
    assert not loop.lookahead and toks2 == toks[: toks.index(toks[3])] and loop.stopped_by == toks[3]


def test_a_failing_static_step_falls_back_to_legacy(case, monkeypatch):
    """A backend lacking one of the step's ops: logged once, then the legacy path, same logits."""
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()[:20]
    model = lm.model

    def broken(*a, **k):
        raise RuntimeError("DynamicSliceUpdate has no GPU implementation.")

    monkeypatch.setenv(stepper.MODE_ENV, "eager")
    monkeypatch.setattr(model, "static_step", broken, raising=False)
    try:
        s = lm.new_session(ctx=len(ids))
        s.prefill(ids[:5])
        steps = np.stack([s.decode(t) for t in ids[5:]])
        assert not s.can_undo
    finally:
        stepper.forget(model)
    assert maxdiff(steps, ref["logits_full"][0][5:20]) <= TOL


def test_engine_lookahead_equals_legacy_on_the_demo_model(monkeypatch, shared_demo):
    """The engine's decode (device sampling one token ahead, stop-token step undone) gives
    the legacy synchronous loop's tokens, finish and session length."""
    from ds4mlx.engine import Engine, Job
    from ds4mlx.runtime.events import Finish
    from ds4mlx.runtime.sampling import SamplingParams

    model, tok = shared_demo()

    greedy = SamplingParams(temperature=0.0)

    def run(how, stop_ids=None, params=greedy):
        monkeypatch.setenv(stepper.MODE_ENV, how)
        eng = Engine(model, tok, ctx=256, default_max_tokens=24)
        try:
            if stop_ids is not None:
                eng.stop_ids = set(stop_ids)
            job = Job(prompt_text="The quick brown fox", api="completions", raw=True, params=params)
            fin = [e for e in eng.generate(job) if isinstance(e, Finish)][-1]
            return fin.raw_text, fin.reason, fin.usage.completion_tokens, len(eng.session)
        finally:
            eng.close()

    base = run("legacy")
    assert run("compiled") == base and base[1] == "length"
    ids = tok.encode(base[0])
    stop = ids[len(ids) // 2]
    cut = run("legacy", [stop])
    assert cut[1] == "stop" and run("compiled", [stop]) == cut
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, repetition_penalty=1.2, repetition_window=8)
    assert run("compiled", params=seeded) == run("legacy", params=seeded)


# ----------------------------------------------------------------------------- DeepSeek V4.1


@pytest.fixture(scope="module", params=[None, "mixed"], ids=lambda c: c or "default")
def v41_case(request, oracle):
    return load_case(oracle, "probe_mlx_deepseek_v41.py", request.param)


def test_v41_compiled_step_matches_reference(v41_case, monkeypatch):
    """The oracle sequence (teacher forced), then 70 free-running greedy tokens: the compiled
    step's logits equal the legacy path's and the tokens are the same."""
    _, lm, ref, _ = v41_case
    ids = ref["input_ids"][0].tolist()
    assert stepper.supports_static(lm.model)
    _, compiled, caps = _decode(lm, ids, "compiled", monkeypatch, prefill=3)
    assert maxdiff(compiled, ref["logits_full"][0][3:]) <= TOL and len(caps) >= 2
    prompt = ids[:6]
    greedy_legacy = _greedy(lm, prompt, 70, "legacy", monkeypatch)
    assert _greedy(lm, prompt, 70, "compiled", monkeypatch) == greedy_legacy
    seq = prompt + greedy_legacy
    _, legacy, _ = _decode(lm, seq, "legacy", monkeypatch, prefill=3)
    _, compiled, caps = _decode(lm, seq, "compiled", monkeypatch, prefill=3)
    assert maxdiff(compiled, legacy) <= TOL and len(caps) >= 3
    assert seq and len(seq) - 3 >= 64 and len(seq) > lm.model.args.sliding_window


def test_v41_snapshot_restore_mid_decode_bit_exact(v41_case, monkeypatch):
    _, lm, ref, _ = v41_case
    ids = ref["input_ids"][0].tolist()
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    s = lm.new_session(ctx=len(ids), chunk=5)
    s.prefill(ids[:4])
    for t in ids[4:20]:
        s.decode(t)
    snap = s.snapshot()
    first = np.stack([s.decode(t) for t in ids[20:]])
    fresh = lm.new_session(ctx=len(ids), chunk=5)
    fresh.restore(snap)
    assert np.array_equal(first, np.stack([fresh.decode(t) for t in ids[20:]]))


# ----------------------------------------------------------------------------- GLM 5.2 (MLA + DSA)


@pytest.fixture(scope="module")
def glm52_case(oracle):
    return load_case(oracle, "make_tiny_glm_moe_dsa.py", "alt")


def test_glm52_compiled_step_matches_reference(glm52_case, monkeypatch):
    _, lm, ref, _ = glm52_case
    ids = ref["input_ids"][0].tolist()
    assert stepper.supports_static(lm.model) and len(ids) > lm.model.args.index_topk + 3
    _, legacy, _ = _decode(lm, ids, "legacy", monkeypatch, prefill=3)
    _, compiled, caps = _decode(lm, ids, "compiled", monkeypatch, prefill=3)
    assert maxdiff(compiled, legacy) <= TOL and maxdiff(compiled, ref["logits_full"][0][3:]) <= TOL
    prompt = ids[:6]
    assert _greedy(lm, prompt, 70, "compiled", monkeypatch) == _greedy(lm, prompt, 70, "legacy", monkeypatch)


def test_glm52_snapshot_restore_mid_decode_bit_exact(glm52_case, monkeypatch):
    _, lm, ref, _ = glm52_case
    ids = ref["input_ids"][0].tolist()
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    s = lm.new_session(ctx=len(ids), chunk=5)
    s.prefill(ids[:4])
    for t in ids[4:20]:
        s.decode(t)
    snap = s.snapshot()
    first = np.stack([s.decode(t) for t in ids[20:]])
    fresh = lm.new_session(ctx=len(ids), chunk=5)
    fresh.restore(snap)
    assert np.array_equal(first, np.stack([fresh.decode(t) for t in ids[20:]]))


# ----------------------------------------------------------------------------- GLM 5.3 (k-pool MLA + KDA)


@pytest.fixture(scope="module")
def glm53_case(oracle):
    return load_case(oracle, "make_tiny_glm5_next.py", "long")


def test_glm53_compiled_step_matches_reference(glm53_case, monkeypatch):
    _, lm, ref, _ = glm53_case
    ids = ref["input_ids"][0].tolist()
    assert stepper.supports_static(lm.model) and len(ids) - 3 >= 64
    _, legacy, _ = _decode(lm, ids, "legacy", monkeypatch, prefill=3)
    _, compiled, caps = _decode(lm, ids, "compiled", monkeypatch, prefill=3)
    assert len(caps) >= 3
    assert maxdiff(compiled, legacy) <= TOL and maxdiff(compiled, ref["logits_full"][0][3:]) <= TOL
    prompt = ids[:6]
    assert _greedy(lm, prompt, 40, "compiled", monkeypatch) == _greedy(lm, prompt, 40, "legacy", monkeypatch)


def test_glm53_snapshot_restore_mid_decode_bit_exact(glm53_case, monkeypatch):
    _, lm, ref, _ = glm53_case
    ids = ref["input_ids"][0].tolist()[:60]
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    s = lm.new_session(ctx=len(ids), chunk=5)
    s.prefill(ids[:4])
    for t in ids[4:25]:
        s.decode(t)
    snap = s.snapshot()
    first = np.stack([s.decode(t) for t in ids[25:]])
    fresh = lm.new_session(ctx=len(ids), chunk=5)
    fresh.restore(snap)
    assert np.array_equal(first, np.stack([fresh.decode(t) for t in ids[25:]]))


# ----------------------------------------------------------------------------- Qwen3.8 (QSA + Gated DeltaNet + PLE)


@pytest.fixture(scope="module")
def qwen_case(oracle):
    return load_case(oracle, "make_tiny_qwen4_exp.py", "long")


def test_qwen_compiled_step_matches_reference(qwen_case, monkeypatch):
    _, lm, ref, _ = qwen_case
    ids = ref["input_ids"][0].tolist()
    assert stepper.supports_static(lm.model) and len(ids) - 3 >= 64
    _, legacy, _ = _decode(lm, ids, "legacy", monkeypatch, prefill=3)
    _, compiled, caps = _decode(lm, ids, "compiled", monkeypatch, prefill=3)
    assert len(caps) >= 3
    assert maxdiff(compiled, legacy) <= TOL and maxdiff(compiled, ref["logits_full"][0][3:]) <= TOL
    prompt = ids[:6]
    assert _greedy(lm, prompt, 40, "compiled", monkeypatch) == _greedy(lm, prompt, 40, "legacy", monkeypatch)


def test_qwen_snapshot_restore_mid_decode_bit_exact(qwen_case, monkeypatch):
    _, lm, ref, _ = qwen_case
    ids = ref["input_ids"][0].tolist()[:60]
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    s = lm.new_session(ctx=len(ids), chunk=5)
    s.prefill(ids[:4])
    for t in ids[4:25]:
        s.decode(t)
    snap = s.snapshot()
    first = np.stack([s.decode(t) for t in ids[25:]])
    fresh = lm.new_session(ctx=len(ids), chunk=5)
    fresh.restore(snap)
    assert np.array_equal(first, np.stack([fresh.decode(t) for t in ids[25:]]))


def test_qwen_first_token_of_an_empty_session_takes_the_legacy_step(qwen_case, monkeypatch):
    _, lm, ref, _ = qwen_case
    ids = ref["input_ids"][0].tolist()[:12]
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    s = lm.new_session(ctx=len(ids))
    assert maxdiff(np.stack([s.decode(t) for t in ids]), ref["logits_full"][0][:12]) <= TOL


def test_compiled_step_with_the_two_bank_moe_matches_legacy(monkeypatch):
    """The narrow synthetic V4 (2-bit routed experts, 8-bit shared expert: V4 Flash's formats)
    with the MoE kernels' faces on (forced; their reference faces run on the CPU): the compiled
    step's MoE is affine_qmv's two two-bank launches (MODE 3: both gate_up + SwiGLU; MODE 4: both
    downs, summed), and its logits equal the legacy path's (routed fused_weighted + the shared
    expert as its own module) and the plain CPU step's.  On the CPU (no GPU face) the step keeps
    today's expressions."""
    from ds4mlx.bench.synthetic import build_synthetic_v4_flash
    from ds4mlx.kernels import affine_qmv as aq

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from launch_census import NARROW

    lm, _, _ = build_synthetic_v4_flash(layers=2, experts=16, overrides=NARROW)
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    calls = []
    for name in ("gather_swiglu_shared", "gather_down_sum_shared"):
        real = getattr(aq, name)
        monkeypatch.setattr(aq, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    _, cpu, _ = _decode(lm, ids, "compiled", monkeypatch)
    assert not calls  # the CPU: no GPU face, no two-bank launches
    stepper.forget(lm.model)
    monkeypatch.setattr(aq, "kernel_face", lambda *a, **k: "forced")
    try:
        _, legacy, _ = _decode(lm, ids, "legacy", monkeypatch)
        assert not calls  # the legacy path keeps the shared expert apart
        _, compiled, _ = _decode(lm, ids, "compiled", monkeypatch)
    finally:
        stepper.forget(lm.model)
    assert calls.count("gather_swiglu_shared") == calls.count("gather_down_sum_shared") >= 2
    scale = np.abs(legacy).max()
    assert maxdiff(compiled, legacy) <= TOL * scale
    assert maxdiff(compiled, cpu) <= TOL * scale
