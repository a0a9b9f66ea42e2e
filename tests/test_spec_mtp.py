"""The V4 MTP head (issue #21 step 3) and `--mtp` speculation.

Reference: DeepSeek's V4 inference code (`inference/model.py`: MTPBlock.forward and
ParallelHead.hc_head), written out here in numpy around the V4 decoder layer (itself
checked against transformers in test_deepseek_v4_parity.py):
e = enorm(embed(t+1)); x = e_proj(e)[:, None] + h_proj(hnorm(streams)); x' = Block(x);
pre = sigmoid(rms(x'_flat) @ hc_fn.T * scale + base) + hc_eps; y = sum(pre * x');
logits = lm_head(norm(y)).  Then greedy speculation with the (random) head equals plain
decoding over 210 tokens, and `ds4mlx generate --mtp --mtp-timing` on the demo model prints
the same text as without it, then its counters and the break-even acceptance per k.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.speculative.mtp import MTPDrafter, random_head

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from parity_helpers import load_case  # noqa: E402
from spec_helpers import (
    compiled_small_buckets,  # noqa: E402, F401  (autouse)
    plain_and_speculative,  # noqa: E402
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def v4(oracle):
    _, lm, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", "long")
    return lm, ref["input_ids"][0].tolist()


def _rms(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def test_mtp_logits_match_the_reference_formula(v4):
    lm, ids = v4
    args = lm.model.args
    head = random_head(args, seed=5)
    got = []
    backbone = lm.model.model
    backbone.stream_hook = lambda x, start: got.append((start, x))
    try:
        T = 40
        lm.model(mx.array([ids[:T]], mx.int32))
    finally:
        backbone.stream_hook = None
    ((start, streams),) = got
    assert start == 0 and streams.shape == (1, T, args.hc_mult, args.hidden_size)
    x, hid = head(streams[:, : T - 1], mx.array([ids[1:T]], mx.int32), backbone.embed_tokens, head.make_cache())
    logits = np.array(lm.model.head(hid)[0])

    eps = args.rms_norm_eps
    E = np.array(backbone.embed_tokens.weight)
    e = _rms(E[ids[1:T]], head.enorm.weight, eps)
    h = _rms(np.array(streams[0, : T - 1]), head.hnorm.weight, eps)
    xin = (e @ np.array(head.e_proj.weight, np.float64).T)[:, None, :] + h @ np.array(head.h_proj.weight, np.float64).T
    xb = np.array(
        head.block(mx.array(xin[None].astype(np.float32)), mx.array([ids[1:T]]), head.make_cache())[0], np.float64
    )
    flat = xb.reshape(T - 1, -1)
    mixes = (flat @ np.array(head.hc_head.hc_fn, np.float64).T) / np.sqrt((flat * flat).mean(-1, keepdims=True) + eps)
    pre = 1 / (1 + np.exp(-(mixes * np.array(head.hc_head.hc_scale)[0] + np.array(head.hc_head.hc_base)))) + args.hc_eps
    y = (pre[..., None] * xb).sum(1)
    want = _rms(y, head.norm.weight, eps) @ np.array(lm.model.lm_head.weight, np.float64).T
    assert np.abs(logits - want).max() <= 1e-3 * max(1.0, np.abs(want).max())
    assert np.abs(np.array(x[0], np.float64) - xb).max() <= 1e-4


def test_mtp_chunked_catch_up_equals_one_forward(v4):
    lm, ids = v4
    head = random_head(lm.model.args, seed=6)
    backbone = lm.model.model
    got = []
    backbone.stream_hook = lambda x, start: got.append(x)
    try:
        lm.model(mx.array([ids[:30]], mx.int32))
    finally:
        backbone.stream_hook = None
    streams, nxt = got[0][:, :29], mx.array([ids[1:30]], mx.int32)
    _, one = head(streams, nxt, backbone.embed_tokens, head.make_cache())
    c = head.make_cache()
    parts = [
        head(streams[:, a:b], nxt[:, a:b], backbone.embed_tokens, c)[1] for a, b in ((0, 7), (7, 8), (8, 20), (20, 29))
    ]
    assert np.abs(np.array(mx.concatenate(parts, axis=1)) - np.array(one)).max() <= 1e-4


def test_the_heads_compiled_step_equals_its_forward(v4):
    """The head's compiled static `step` (the block as the target's decode step runs a layer)
    gives `__call__`'s streams and hidden states: a round's catch-up of a few positions (a
    chain), and recursive positions one at a time, past the ring's wrap; a long catch-up (the
    first after a prefill) takes the forward."""
    lm, ids = v4
    head = random_head(lm.model.args, seed=8)
    backbone = lm.model.model
    got = []
    backbone.stream_hook = lambda x, start: got.append(x)
    n = head.window + 48
    try:
        lm.model(mx.array([ids[: n + 1]], mx.int32))
    finally:
        backbone.stream_hook = None
    streams, nxt, embed = got[0], mx.array([ids[1 : n + 1]], mx.int32), backbone.embed_tokens
    caches, at = (head.make_cache(), head.make_cache()), 0

    def both(x, tok):
        want = head(x, tok, embed, caches[0])
        step = head.step(x, tok, embed, caches[1])
        for g, w in zip(step, want):
            assert g.shape == w.shape and np.abs(np.array(g) - np.array(w)).max() <= 1e-4, (x.shape, at)
        return want[0][:, -1:]

    # propose's rounds: a catch-up over the positions the target verified, then recursive drafts
    for T, drafts in ((head.CHAIN_MAX + 3, 2), (3, 2), (1, 0), (4, 2), (2, 1), (head.CHAIN_MAX, 2), (5, 2)):
        x = both(streams[:, at % n : at % n + T], nxt[:, at % n : at % n + T])
        at += T
        for _ in range(drafts):
            x = both(x, nxt[:, at % n : at % n + 1])
            at += 1
    assert caches[0].offset == caches[1].offset == at > head.window
    assert callable(head._step)  # the static step ran: no fall-back to the forward


@pytest.mark.parametrize("positions", [1, 4])
def test_a_draft_position_costs_a_tenth_of_a_step(positions):
    """The head's step counted as on CUDA (ds4mlx.bench.census): its block's launches as one
    target layer's (one attention prologue, one attention: no MLX attention ops), 38 in all
    with the output head on the 4-layer census model (154 when the head ran its block as a
    prefill chunk), under a tenth of the 43-layer step's 418; a round's catch-up over 4
    positions as many (the block's rows chained as a verify's)."""
    from launch_census import NARROW

    from ds4mlx.bench.census import mtp_census
    from ds4mlx.bench.synthetic import build_synthetic_v4_flash

    model, _, _ = build_synthetic_v4_flash(layers=4, experts=16, overrides=NARROW)
    c = mtp_census(model, 2048, positions)
    rows = "" if positions == 1 else f"_chain{positions}"
    assert c["kernels"][f"ds4mlx_attn_prep{rows}"] == 1
    assert c["kernels"]["ds4mlx_attend" + ("" if positions == 1 else f"_rows{positions}")] == 1
    assert not {"Softmax", "Concatenate", "ArgPartition"} & set(c["mlx"])
    assert c["total"] <= 38 < 418 / 10


@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_with_the_mtp_head_equals_plain(v4, depth):
    lm, ids = v4
    drafter = MTPDrafter(lm, random_head(lm.model.args, seed=7))
    want, got, loop = plain_and_speculative(lm, ids[:8], 210, drafter, depth)
    assert got == want
    assert loop.stats.drafted >= loop.stats.rounds - 1 > 0  # the last round: no room for a draft


def test_generate_with_mtp_on_the_demo_model_prints_the_same_text():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    base = [
        sys.executable,
        "-m",
        "ds4mlx.cli",
        "generate",
        "--raw",
        "-p",
        "The quick brown fox",
        "-n",
        "40",
        "--temp",
        "0",
    ]
    plain = subprocess.run(base, capture_output=True, text=True, env=env, timeout=600)
    spec = subprocess.run(
        base + ["--mtp", "--mtp-draft", "2", "--mtp-timing"], capture_output=True, text=True, env=env, timeout=600
    )
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr[-2000:]
    assert spec.stdout == plain.stdout and "speculative decoding: MTP head" in spec.stderr
    # the end-of-run summary beside t/s, and --mtp-timing's acceptance model for k = 1..4
    assert "speculation: drafted" in spec.stderr and "speculation:" not in plain.stderr
    for k in (1, 2, 3, 4):
        assert f"k={k}: verify of {k + 1} tokens" in spec.stderr


def test_catch_up_from_one_window_back_gives_the_same_last_position(v4):
    lm, ids = v4
    head = random_head(lm.model.args, seed=8)
    W = lm.model.args.sliding_window
    backbone = lm.model.model
    got = []
    backbone.stream_hook = lambda x, start: got.append(x)
    try:
        lm.model(mx.array([ids[:45]], mx.int32))
    finally:
        backbone.stream_hook = None
    streams, nxt = got[0][:, :44], mx.array([ids[1:45]], mx.int32)
    _, full = head(streams, nxt, backbone.embed_tokens, head.make_cache())
    c = head.make_cache()
    c.offset = 44 - W  # what MTPDrafter does after a long prefill: only the last window
    _, short = head(streams[:, 44 - W :], nxt[:, 44 - W :], backbone.embed_tokens, c)
    assert np.abs(np.array(short[:, -1]) - np.array(full[:, -1])).max() <= 1e-4


def test_a_head_saved_in_the_gguf_layout_loads_back_and_a_foreign_layout_is_refused(v4):
    from mlx.utils import tree_flatten

    from ds4mlx.speculative.mtp import SpecUsageError, loaded_head

    lm, _ = v4
    args = lm.model.args
    head = random_head(args, seed=9)
    own = {"hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
    tensors = {}
    for name, p in tree_flatten(head.parameters()):  # the names read_mtp_gguf hands out
        if name in own:
            key = f"mtp.0.{own[name]}"
        elif name.startswith("block."):
            key = "mtp.0." + name[len("block.") :].removesuffix(
                ".weight"
                if ".mlp.experts." in name and name.endswith(("gate_up_proj.weight", "down_proj.weight"))
                else "@"
            )
        else:
            key = f"mtp.0.{name}"
        tensors[key] = p
    back = loaded_head(args, tensors)
    for (n1, a), (n2, b) in zip(tree_flatten(head.parameters()), tree_flatten(back.parameters())):
        assert n1 == n2 and np.array_equal(np.array(a), np.array(b))
    with pytest.raises(SpecUsageError, match="do not form"):
        loaded_head(args, {"mtp.0.attn.wq_a.weight": mx.zeros((4, 4))})


def test_v41_mtp_builds_dspark_not_v4s_layer(oracle):
    """V4.1's config keeps num_nextn_predict_layers, but its mtp.* tensors are a DSpark block
    drafter (DeepSeek's V4.1 inference/model.py: DSparkBlock, forward_spec), a different
    graph from V4's MTP layer: `--mtp` builds that drafter (tests/test_spec_dspark.py), and
    a V4.1 file without the tensors is refused in those terms, never given V4's head."""
    from ds4mlx.speculative.mtp import mtp_drafter
    from ds4mlx.speculative.options import SpecUsageError

    _, lm, _, _ = load_case(oracle, "probe_mlx_deepseek_v41.py", "mixed")
    with pytest.raises(SpecUsageError, match="no DSpark tensors"):
        mtp_drafter(lm, ctx=64)
