"""MTP heads of GLM 5.x (`glm_moe_dsa`) and Qwen3.8 Flash Next (`qwen4_exp`), and `--mtp`
speculation on them (issue #21).

Reference: vLLM glm4_moe_mtp.py / deepseek_mtp.py (GLM: Glm4MoeMultiTokenPredictorLayer,
fed the target's final hidden states after its final norm) and SGLang qwen4_exp_mtp.py
(Qwen4Exp: Qwen4ExpForCausalLMMTP._fuse_residual_linear_shared over the target's residual
streams before the final mixer, then Qwen4ExpModel with is_nextn; the Qwen3-Next neck of
vLLM qwen3_next_mtp.py, one `fc` on the concatenation, is what SGLang uses only without
hyper-connections).  Written out here in numpy around each family's decoder layer (itself
checked against transformers in test_glm_moe_dsa_parity.py / test_qwen4_exp_parity.py):

  GLM:  e = embed(t+1) (zero at position 0); x = eh_proj([rms(e)*enorm ; rms(h)*hnorm]);
        x' = Layer(x); logits = lm_head(rms(x') * shared_head.norm)
  Qwen: e = fc_embedding(rms(embed(t+1)) * (1+w_e)); s = rms(flat(streams)) * (1+w_h);
        y = e[:, None] + fc_hidden(s.view(hc, H)); y' = Layer(y);
        logits = lm_head(mean_j(sigmoid(up(silu(down(flat(n)) / hc)))_j * n_j)),
        n = per-stream rms(y') * (1+w) (the hyper-connection mixer)

Then greedy speculation with a random head equals plain greedy decoding over 210 tokens
(depths 1 and 3, past GLM's DSA top-k and Qwen's QSA budget), `--mtp` builds a head on
both families (a random one on the demo models, the checkpoint's own from its MTP tensors,
a refusal for a real file without them).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from ds4mlx.runtime.decode import decode_tokens, greedy
from ds4mlx.speculative.acceptance import GreedyRule
from ds4mlx.speculative.loop import SpeculativeLoop
from ds4mlx.speculative.mtp import MTPDrafter, mtp_drafter, random_head
from ds4mlx.speculative.options import SpecUsageError

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case  # noqa: E402
from spec_helpers import (  # noqa: E402
    ScriptedPicks,
    compiled_small_buckets,  # noqa: E402, F401  (autouse)
    plain_and_speculative,
)

SCRIPTS = {"glm": "make_tiny_glm_moe_dsa.py", "qwen": "make_tiny_qwen4_exp.py"}


# end to end (servers, several processes or models, whole files): the slow tier, which CI runs second
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(oracle):
    cases = {}

    def get(family):
        if family not in cases:
            folder, lm, ref, _ = load_case(oracle, SCRIPTS[family], None)
            cases[family] = (folder, lm, [int(t) for t in ref["input_ids"][0]])
        return cases[family]

    return get


def _np(a) -> np.ndarray:
    return np.array(a.astype(mx.float32), np.float64)


def _rms(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def _hidden(lm, ids):
    """What the backbone's stream_hook hands over for one forward of `ids`."""
    got = []
    backbone = lm.model.model
    backbone.stream_hook = lambda x, start: got.append((start, x))
    try:
        lm.model(mx.array([ids], mx.int32))
    finally:
        backbone.stream_hook = None
    ((start, h),) = got
    assert start == 0
    return h


def _close(got, want, tol=1e-4):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    if want.size:
        assert float(np.abs(got - want).max()) <= tol * max(1.0, float(np.abs(want).max()))


def test_glm_head_matches_vllm_graph(tiny):
    _, lm, ids = tiny("glm")
    args, T = lm.model.args, 40
    head = random_head(args, seed=5)
    h = _hidden(lm, ids[:T])
    assert h.shape == (1, T, args.hidden_size)
    nxt = mx.array([ids[1:T]], mx.int32)
    x, hid = head(h[:, : T - 1], nxt, lm.model.model.embed_tokens, head.make_cache())
    logits = _np(lm.model.head(hid)[0])

    eps = args.rms_norm_eps
    e = _np(lm.model.model.embed_tokens.weight)[ids[1:T]]
    e[0] = 0.0  # vLLM: inputs_embeds[positions == 0] = 0
    cat = np.concatenate(
        [_rms(e, _np(head.enorm.weight), eps), _rms(_np(h[0, : T - 1]), _np(head.hnorm.weight), eps)], -1
    )
    xin = cat @ _np(head.eh_proj.weight).T
    xb, _ = head.block(mx.array(xin[None].astype(np.float32)), head.make_cache(), None)  # the GLM decoder layer
    xb = _np(xb[0])
    want = _rms(xb, _np(head.shared_head.norm.weight), eps) @ _np(lm.model.lm_head.weight).T
    _close(logits, want)
    _close(_np(x[0]), xb)


def test_qwen_head_matches_sglang_graph(tiny):
    _, lm, ids = tiny("qwen")
    args, T = lm.model.args, 40
    hc, H, eps = args.hc_count, args.hidden_size, args.rms_norm_eps
    head = random_head(args, seed=5)
    streams = _hidden(lm, ids[:T])
    assert streams.shape == (1, T, hc, H)
    nxt = mx.array([ids[1:T]], mx.int32)
    x, hid = head(streams[:, : T - 1], nxt, lm.model.model.embed_tokens, head.make_cache())
    logits = _np(lm.model.head(hid)[0])

    E = _np(lm.model.model.embed_tokens.weight)
    e = _rms(E[ids[1:T]], 1 + _np(head.pre_fc_norm_embedding.weight), eps) @ _np(head.fc_embedding.weight).T
    flat = _np(streams[0, : T - 1]).reshape(T - 1, hc * H)
    s = _rms(flat, 1 + _np(head.pre_fc_norm_hidden.weight), eps).reshape(T - 1, hc, H)
    y = e[:, None, :] + s @ _np(head.fc_hidden.weight).T
    yb = head.layer(mx.array(y[None].astype(np.float32)), nxt, head.make_cache())  # the Qwen4Exp decoder layer
    yb = _np(yb[0])
    mix = head.hyper_connection_mixer
    n = _rms(yb, 1 + _np(mix.hc_norm.weight).reshape(hc, H), eps)  # per stream
    nf = n.reshape(T - 1, hc * H)
    down = nf @ _np(mix.input_mix_weight_down.weight).T / hc
    w = 1 / (1 + np.exp(-((down / (1 + np.exp(-down))) @ _np(mix.input_mix_weight_up.weight).T)))
    mixed = (w.reshape(T - 1, hc, H) * n).mean(1)
    want = mixed @ _np(lm.model.lm_head.weight).T
    _close(logits, want)
    _close(_np(x[0]), yb)


@pytest.mark.parametrize("family", ["glm", "qwen"])
def test_chunked_catch_up_equals_one_forward(tiny, family):
    _, lm, ids = tiny(family)
    head = random_head(lm.model.args, seed=6)
    h = _hidden(lm, ids[:30])[:, :29]
    nxt, embed = mx.array([ids[1:30]], mx.int32), lm.model.model.embed_tokens
    _, one = head(h, nxt, embed, head.make_cache())
    c = head.make_cache()
    parts = [head(h[:, a:b], nxt[:, a:b], embed, c)[1] for a, b in ((0, 7), (7, 8), (8, 20), (20, 29))]
    assert float(np.abs(_np(mx.concatenate(parts, axis=1)) - _np(one)).max()) <= 1e-4


@pytest.mark.parametrize("family", ["glm", "qwen"])
@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_with_the_mtp_head_equals_plain(tiny, family, depth):
    _, lm, ids = tiny(family)
    drafter = MTPDrafter(lm, random_head(lm.model.args, seed=7))
    want, got, loop = plain_and_speculative(lm, ids[:8], 210, drafter, depth)
    assert got == want
    assert loop.stats.drafted >= loop.stats.rounds - 1 > 0  # the last round: no room for a draft
    assert lm.model.model.stream_hook is None


@pytest.mark.parametrize("family", ["glm", "qwen"])
def test_a_head_attached_after_the_prefill_drafts_from_zeros_there(tiny, family):
    """A full-attention head cannot start mid-sequence: positions whose states it never saw
    (here the whole prompt) go in as zeros; drafting goes on, the output is unchanged."""
    _, lm, ids = tiny(family)
    prompt, n = ids[:24], 40
    s = lm.new_session(ctx=len(prompt) + n + 8)
    want = list(decode_tokens(s, s.prefill(prompt), greedy(lm.vocab_size), limit=n))
    s = lm.new_session(ctx=len(prompt) + n + 8)
    logits = s.prefill(prompt)
    drafter = MTPDrafter(lm, random_head(lm.model.args, seed=10))
    try:
        loop = SpeculativeLoop(s, logits, drafter, GreedyRule(lm.vocab_size), depth=2, margin=0, limit=n)
        got = list(loop)
    finally:
        drafter.close()
    assert got == want and loop.stats.drafted >= loop.stats.rounds - 1 > 0


def test_a_family_without_a_head_is_refused():
    from ds4mlx.models.base import LanguageModel
    from ds4mlx.models.glm5_next import DEMO_CONFIG

    lm = LanguageModel.from_config(DEMO_CONFIG)  # random weights, no checkpoint
    with pytest.raises(SpecUsageError, match="no MTP head for glm5_next_text models yet"):
        mtp_drafter(lm, ctx=64)


class ScriptedDrafter(MTPDrafter):
    def propose(self, context, x0, k, rule, margin=0.0):
        rule.at = len(context) + 1  # the first draft is the token after x0
        return super().propose(context, x0, k, rule, margin)


@pytest.mark.parametrize("family", ["glm", "qwen"])
def test_accepted_drafts_keep_the_head_cache_of_one_pass(tiny, family):
    """With most drafts accepted (several positions a round, some rejected): the output is
    plain greedy decoding's, and the head's cache after its last catch-up holds what one
    pass of the head over one target forward of the same context gives."""
    _, lm, ids = tiny(family)
    prompt, n = ids[:8], 200
    s = lm.new_session(ctx=len(prompt) + n + 8)
    want = list(decode_tokens(s, s.prefill(prompt), greedy(lm.vocab_size), limit=n))
    head = random_head(lm.model.args, seed=9)
    drafter = ScriptedDrafter(lm, head)
    try:
        s = lm.new_session(ctx=len(prompt) + n + 8)
        rule = ScriptedPicks(lm.vocab_size, prompt + want)
        loop = SpeculativeLoop(s, s.prefill(prompt), drafter, rule, depth=3, margin=0, limit=n)
        got = list(loop)
        full, m = prompt + got, drafter.done
        assert drafter.propose(full[:m], full[m], 1, GreedyRule(lm.vocab_size))[0] == []  # back to the catch-up
        kept = {k: _np(v) for k, v in drafter.cache.state.items()}
    finally:
        drafter.close()
    assert got == want
    assert loop.stats.accepted >= loop.stats.rounds and loop.stats.rollbacks > 0
    assert m >= len(full) - 4
    fresh = head.make_cache()
    head(_hidden(lm, full[:m]), mx.array([full[1 : m + 1]], mx.int32), lm.model.model.embed_tokens, fresh)
    assert fresh.offset == m and set(kept) == set(fresh.state)
    for k, v in fresh.state.items():
        _close(kept[k], _np(v))


def _mtp_checkpoint_names(family, head, args) -> dict:
    """The head's parameters under the checkpoint's names (transformers' in-memory layout)."""
    out = {}
    for name, p in tree_flatten(head.parameters()):
        if name.endswith(("mlp.experts.gate_up_proj.weight", "mlp.experts.down_proj.weight")):
            name = name.removesuffix(".weight")
        if family == "glm":
            key = f"model.layers.{args.num_hidden_layers}." + name.removeprefix("block.")
        else:
            key = "mtp." + (f"layers.0.{name[len('layer.') :]}" if name.startswith("layer.") else name)
        out[key] = p
    return out


@pytest.mark.parametrize("family", ["glm", "qwen"])
def test_mtp_builds_the_checkpoint_head_or_refuses_without_one(tiny, tmp_path, family):
    from ds4mlx.io.loader import load

    folder, lm, _ = tiny(family)
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    model, _ = load(plain, verbose=False)
    assert model.mtp_weights == {}
    with pytest.raises(SpecUsageError, match="carries no MTP tensors"):
        mtp_drafter(model, ctx=64)

    args = lm.model.args
    head = random_head(args, seed=11)
    withmtp = tmp_path / "mtp"
    shutil.copytree(folder, withmtp)
    mx.save_safetensors(str(withmtp / "mtp.safetensors"), _mtp_checkpoint_names(family, head, args))
    model, _ = load(withmtp, verbose=False)
    assert set(model.mtp_weights) == set(_mtp_checkpoint_names(family, head, args))
    ref = np.array(lm.logits(list(range(5, 25))))
    assert float(np.abs(np.array(model.logits(list(range(5, 25)))) - ref).max()) == 0.0  # decoder unchanged
    drafter = mtp_drafter(model, ctx=64)
    try:
        back = dict(tree_flatten(drafter.head.parameters()))
        for name, p in tree_flatten(head.parameters()):
            assert np.array_equal(np.array(p), np.array(back[name])), name
    finally:
        drafter.close()


@pytest.mark.parametrize("family", ["glm_moe_dsa", "qwen4_exp"])
def test_mtp_on_the_demo_model_gets_a_random_head(family):
    from ds4mlx.io.loader import load

    model, _ = load(f"demo:{family}", verbose=False)
    drafter = mtp_drafter(model, ctx=64)
    try:
        assert isinstance(drafter, MTPDrafter) and drafter.window is None
    finally:
        drafter.close()
