"""DeepSeek V4.1's DSpark drafter as `--mtp` (ds4mlx/speculative/dspark.py) on the tiny V4.1
model (tests/oracle/probe_mlx_deepseek_v41.py, config "mixed": 5 layers, window 6, hc 3).

The head's forward is checked against DeepSeek's reference in test_dspark.py; here: the
backbone's capture is DeepSeek's `main_hidden` (Transformer.forward: the mean over the
streams *entering* each target layer, concatenated in layer order), greedy speculation
with a random head equals plain decoding, and what the drafter observes round by round
(verify rows of accepted tokens only) equals one pass over the final context.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from ds4mlx.models.deepseek_v41_dspark import DSparkArgs, random_head
from ds4mlx.runtime.decode import decode_tokens, greedy
from ds4mlx.speculative.acceptance import GreedyRule
from ds4mlx.speculative.dspark import DSparkBlockDrafter, default_dspark_config
from ds4mlx.speculative.loop import SpeculativeLoop

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case  # noqa: E402
from spec_helpers import (
    ScriptedPicks,  # noqa: E402
    compiled_small_buckets,  # noqa: E402, F401  (autouse)
)

# end to end (servers, several processes or models, whole files): the slow tier, which CI runs second
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def v41(oracle):
    _, lm, ref, _ = load_case(oracle, "probe_mlx_deepseek_v41.py", "mixed")
    return lm, ref["input_ids"][0].tolist()


def head_for(lm, seed, **over):
    args = lm.model.args
    return random_head(args, DSparkArgs.from_config({**default_dspark_config(args), **over}), seed)


def test_capture_is_the_mean_of_the_target_layers_inputs(v41):
    lm, ids = v41
    backbone = lm.model.model
    got = []
    backbone.capture_layers = frozenset({3, 1})
    backbone.capture_hook = lambda states, start, ids_: got.append((start, states, ids_))
    try:
        lm.model(mx.array([ids[:12]], mx.int32))
    finally:
        backbone.capture_hook, backbone.capture_layers = None, frozenset()
    ((start, states, seen),) = got
    assert start == 0 and seen.tolist() == [ids[:12]]
    # the layer inputs, by hand: embedding copied to the streams, stream 0 as layer 0's pre
    cache = lm.model.make_cache()
    h = backbone.embed_tokens(mx.array([ids[:12]], mx.int32))
    hc = lm.model.args.hc_mult
    x = mx.broadcast_to(h[:, :, None, :], (1, 12, hc, h.shape[-1]))
    pre = mx.broadcast_to((mx.arange(hc) == 0).astype(mx.float32), (1, 12, hc))
    inputs, shared = [], {}
    for layer, c in zip(backbone.layers, cache):
        inputs.append(np.array(x).mean(axis=2))
        x, pre = layer(x, pre, c, shared)
    want = np.concatenate([inputs[1], inputs[3]], axis=-1)  # layer order, not the set's
    assert states.shape == (1, 12, 2 * lm.model.args.hidden_size)
    assert np.abs(np.array(states) - want).max() <= 1e-5


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_greedy_with_the_dspark_drafter_equals_plain(v41, depth):
    lm, ids = v41
    prompt, n = ids[:8], 60
    s = lm.new_session(ctx=len(prompt) + n + 8)
    want = list(decode_tokens(s, s.prefill(prompt), greedy(lm.vocab_size), limit=n))
    drafter = DSparkBlockDrafter(lm, head_for(lm, seed=7))
    try:
        s = lm.new_session(ctx=len(prompt) + n + 8)
        loop = SpeculativeLoop(s, s.prefill(prompt), drafter, GreedyRule(lm.vocab_size), depth=depth, margin=0, limit=n)
        got = list(loop)
    finally:
        drafter.close()
    assert got == want
    assert loop.stats.drafted >= loop.stats.rounds - 1 > 0  # every round drafts (the last may have no room)
    assert lm.model.model.capture_hook is None


class ScriptedDrafter(DSparkBlockDrafter):
    def propose(self, context, x0, k, rule, margin=0.0):
        rule.at = len(context) + 1  # the block's first pick is the token after x0
        return super().propose(context, x0, k, rule, margin)


@pytest.mark.parametrize("scripted", [False, True])
def test_the_drafter_observes_what_one_pass_over_the_context_gives(v41, scripted):
    """Round by round, the head's window keys come from verify rows of accepted tokens
    (rejected drafts' rows never): the same keys one forward over the final context gives;
    with scripted picks, greedy output still equals plain decoding."""
    lm, ids = v41
    prompt, n_out = ids[:9], 30
    s = lm.new_session(ctx=80)
    want = list(decode_tokens(s, s.prefill(prompt), greedy(lm.vocab_size), limit=n_out))
    head = head_for(lm, seed=8)
    drafter = (ScriptedDrafter if scripted else DSparkBlockDrafter)(lm, head)
    rule = ScriptedPicks(lm.vocab_size, prompt + want) if scripted else GreedyRule(lm.vocab_size)
    try:
        s = lm.new_session(ctx=80)
        loop = SpeculativeLoop(s, s.prefill(prompt), drafter, rule, depth=3, margin=0, limit=n_out)
        out = list(loop)
        n, keys = drafter.cache.offset, [np.array(k) for k in drafter.cache.keys]
        got = []
        lm.model.model.capture_hook = lambda states, start, ids_: got.append(states)
        lm.model(mx.array([(prompt + out)[:n]], mx.int32))
    finally:
        drafter.close()
    assert out == want
    assert n >= len(prompt) + len(out) - 6 and loop.stats.rollbacks > 0  # some drafts were rejected
    if scripted:
        assert loop.stats.accepted >= loop.stats.rounds  # and many accepted: several positions a round
    W = lm.model.args.sliding_window
    fresh = head.make_cache()
    fresh.offset = n - W
    head.observe(got[0][:, n - W : n], fresh)
    for a, b in zip(keys, fresh.keys):
        assert a.shape == b.shape and np.abs(a - np.array(b)).max() <= 1e-4


def test_two_hundred_tokens_with_accepted_drafts_equal_plain(v41):
    """Over 200 greedy tokens (the tiny model's window of 6 crossed many times), with picks that
    get most drafts accepted and every third rejected: token for token the plain decoding (the
    tool-call, stop-string and limit boundaries are the loop's, drafter-independent:
    tests/test_spec_engine.py)."""
    lm, ids = v41
    prompt, n = ids[:8], 200
    s = lm.new_session(ctx=len(prompt) + n + 8)
    want = list(decode_tokens(s, s.prefill(prompt), greedy(lm.vocab_size), limit=n))
    drafter = ScriptedDrafter(lm, head_for(lm, seed=9))
    try:
        s = lm.new_session(ctx=len(prompt) + n + 8)
        rule = ScriptedPicks(lm.vocab_size, prompt + want)
        loop = SpeculativeLoop(s, s.prefill(prompt), drafter, rule, depth=4, margin=0, limit=n)
        got = list(loop)
    finally:
        drafter.close()
    assert got == want
    assert loop.stats.accepted >= loop.stats.rounds and loop.stats.rollbacks > 0


def test_mtp_on_a_v41_model_builds_the_dspark_drafter(v41, monkeypatch):
    from test_dspark import _hub_names

    from ds4mlx.speculative.mtp import mtp_drafter
    from ds4mlx.speculative.options import SpecUsageError

    lm, _ = v41
    monkeypatch.setattr(lm, "mtp_weights", {}, raising=False)
    monkeypatch.setattr(lm, "config", {}, raising=False)
    with pytest.raises(SpecUsageError, match="no DSpark tensors"):
        mtp_drafter(lm, ctx=64)
    monkeypatch.setattr(lm, "is_demo", True, raising=False)
    d = mtp_drafter(lm, ctx=64)  # a random head under DEFAULT_DSPARK
    d.close()
    assert isinstance(d, DSparkBlockDrafter) and d.head.dspark.dspark_block_size == 5

    cfg = {**default_dspark_config(lm.model.args), "dspark_block_size": 3, "num_nextn_predict_layers": 2}
    head = random_head(lm.model.args, DSparkArgs.from_config(cfg), seed=9)
    monkeypatch.setattr(lm, "mtp_weights", _hub_names(head))
    monkeypatch.setattr(lm, "config", {"text_config": cfg})
    d = mtp_drafter(lm, ctx=64)  # the checkpoint's tensors
    d.close()
    assert d.head.dspark.stages == 2
    for (k, a), (k2, b) in zip(tree_flatten(head.parameters()), tree_flatten(d.head.parameters())):
        assert k == k2 and mx.array_equal(a, b), k
    monkeypatch.setattr(lm, "config", {"text_config": {**cfg, "dspark_target_layer_ids": []}})
    with pytest.raises(SpecUsageError, match="dspark_target_layer_ids"):
        mtp_drafter(lm, ctx=64)


def test_generate_with_dspark_on_the_v41_demo_model_prints_the_same_text():
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo))
    base = [sys.executable, "-m", "ds4mlx.cli", "generate", "-m", "demo:deepseek_v41", "--raw"]
    base += ["-p", "The quick brown fox", "-n", "24", "--temp", "0"]
    plain = subprocess.run(base, capture_output=True, text=True, env=env, timeout=600)
    spec = subprocess.run(
        base + ["--dspark", "--mtp-draft", "3", "--mtp-margin", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )  # ds4's --dspark: V4.1's built-in drafter (as --mtp)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr[-2000:]
    assert spec.stdout == plain.stdout and "speculative decoding: DSpark block drafter" in spec.stderr
    assert "speculation: drafted" in spec.stderr


def test_confident_prefix_keeps_the_leading_positions_whose_survival_holds():
    from ds4mlx.speculative.dspark import confident_prefix

    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    conf = [logit(0.9), logit(0.9), logit(0.5), logit(0.99)]  # survival 0.9, 0.81, 0.405, 0.401
    assert confident_prefix(conf, 0.0) == 4
    assert confident_prefix(conf, 0.85) == 1
    assert confident_prefix(conf, 0.8) == 2
    assert confident_prefix(conf, 0.4) == 4
    assert confident_prefix(conf, 0.95) == 0
    assert confident_prefix([], 0.5) == 0


@pytest.mark.parametrize("threshold", [0.3, 1.0])
def test_confidence_pruning_keeps_greedy_output_and_drafts_less(v41, threshold):
    """--dspark-confidence: fewer drafts (none at 1.0: every round is a plain step), the
    same tokens as plain decoding."""
    lm, ids = v41
    prompt, n = ids[:8], 40
    s = lm.new_session(ctx=len(prompt) + n + 8)
    want = list(decode_tokens(s, s.prefill(prompt), greedy(lm.vocab_size), limit=n))
    drafted = {}
    for t in (0.0, threshold):
        drafter = DSparkBlockDrafter(lm, head_for(lm, seed=7))
        drafter.confidence_threshold = t
        try:
            s = lm.new_session(ctx=len(prompt) + n + 8)
            loop = SpeculativeLoop(s, s.prefill(prompt), drafter, GreedyRule(lm.vocab_size), depth=4, margin=0, limit=n)
            assert list(loop) == want
        finally:
            drafter.close()
        drafted[t] = loop.stats.drafted
    assert drafted[threshold] < drafted[0.0]
    if threshold == 1.0:
        assert drafted[threshold] == 0


def test_dspark_confidence_flag_is_checked():
    import argparse

    from ds4mlx.speculative import cli as spec_cli
    from ds4mlx.speculative.options import SpecUsageError

    p = argparse.ArgumentParser()
    spec_cli.add_arguments(p)

    class Drafter:  # a drafter without confidences (V4's head, a draft model)
        pass

    for value, message in ((1.5, r"in \[0, 1\]"), (-0.1, r"in \[0, 1\]")):
        with pytest.raises(SpecUsageError, match=message):
            spec_cli._set_confidence(DSparkBlockDrafter.__new__(DSparkBlockDrafter), value)
    with pytest.raises(SpecUsageError, match="only the DSpark drafter"):
        spec_cli._set_confidence(Drafter(), 0.5)
    spec_cli._set_confidence(Drafter(), 0.0)  # off: any drafter
    assert p.parse_args(["--mtp", "--dspark-confidence", "0.7"]).dspark_confidence == 0.7
