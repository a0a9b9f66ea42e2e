"""`ds4mlx bench --profile-prefill` (bench/prefill_profile.py) on a tiny synthetic V4 Flash:
every op family of the graph is timed the number of times one chunk runs it, the timing
hooks leave the forward's result and the model's classes as they were, and the CLI
prints the table for each chunk size."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_synthetic import TINY

from ds4mlx.bench.prefill_profile import (
    FamilyClock,
    family_hooks,
    format_prefill_profile,
    profile_prefill,
    timed_families,
)
from ds4mlx.bench.synthetic import build_synthetic_v4_flash
from ds4mlx.cli.commands import main
from ds4mlx.models import deepseek_v4 as v4

LAYERS = 4  # two sliding-window layers, one CSA, one HCA


@pytest.fixture(scope="module")
def tiny():
    lm, tok, _ = build_synthetic_v4_flash(layers=LAYERS, experts=8, overrides=TINY)
    return lm


def test_profile_counts_every_family(tiny):
    toks = [(7 * i + 3) % 1000 for i in range(16 + 3 * 8)]
    p = profile_prefill(tiny, toks, ctx=16, chunk=8, repeats=1)
    calls = p["calls_per_chunk"]
    assert calls["attention"] == LAYERS
    # the one forward's layer (PREFILL as DECODE): the first layer's pre, then per layer a
    # post+pre inside it and one into the next layer (the last: the final post); the layer
    # norms folded into those launches, the final norm alone
    assert calls["hyper-connections"] == 2 * LAYERS + 1
    assert calls["norms"] == 1
    assert calls["moe router"] == calls["moe shared expert"] == LAYERS
    assert calls["moe routed experts"] == LAYERS
    assert calls["compressor"] == 3  # CSA: attention + indexer compressors, HCA: one
    assert calls["head"] == 2  # hc_head, lm_head
    assert all(v >= 0 for v in p["families_ms"].values()) and p["chunk_ms"] > 0
    text = format_prefill_profile(p)
    assert "moe routed experts" in text and "host (graph build" in text


def test_hooks_change_nothing(tiny):
    """The instrumented forward gives the plain forward's logits, and every patched
    attribute is the original again afterwards."""
    ids = mx.array([[(5 * i + 1) % 1000 for i in range(12)]], dtype=mx.int32)
    inner = tiny.model
    before = {(owner, name): getattr(owner, name) for owner, name, _ in family_hooks(inner)}
    plain = np.array(inner(ids, inner.make_cache()).astype(mx.float32))
    cache = inner.make_cache()
    clock = FamilyClock(lambda: [a for c in cache for a in c.state.values()])
    with timed_families(clock, family_hooks(inner)):
        assert v4.Attention.forward is not before[(v4.Attention, "forward")]
        clock.start()
        hooked = np.array(inner(ids, cache).astype(mx.float32))
    assert np.array_equal(plain, hooked)
    assert clock.calls["attention"] == LAYERS
    assert all(getattr(owner, name) is fn for (owner, name), fn in before.items())


def test_cli_profile_prefill(capsys):
    argv = ["bench", "--synthetic", "v4-flash", "--layers", "3", "--experts", "8", "--gen-tokens", "1"]
    argv += [f"--synthetic-override={k}={v}" for k, v in TINY.items()]
    argv += ["--ctx-start", "8", "--ctx-max", "16", "--profile-prefill", "--profile-chunks", "4,8"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "prefill chunk of 4 tokens at ctx 8" in err and "prefill chunk of 8 tokens at ctx 8" in err
    assert main(argv[:-1] + ["4,x"]) == 2


def test_gpu_busy_is_measured_on_its_own_chunk_and_printed(tiny, monkeypatch):
    """Where the CUDA profiler is there, one more barrier-free chunk runs under it and its
    busy time is set against the chunk's wall time (the profiler faked here: the CPU has none)."""
    from ds4mlx.bench import gpu_timer

    seen = []

    def fake_busy(fn, steps):
        seen.append(steps)
        fn()
        return 0.25

    monkeypatch.setattr(gpu_timer, "unavailable", lambda: None)
    monkeypatch.setattr(gpu_timer, "busy_ms", fake_busy)
    toks = [(7 * i + 3) % 1000 for i in range(16 + 3 * 8)]
    with pytest.raises(ValueError, match="needs 48 tokens"):
        profile_prefill(tiny, toks, ctx=16, chunk=8, repeats=1)
    p = profile_prefill(tiny, toks + toks[:8], ctx=16, chunk=8, repeats=1)
    assert seen == [1] and p["gpu_busy_ms"] == 0.25
    assert "GPU-busy 0.2 ms of the" in format_prefill_profile(p)


def test_no_gpu_busy_where_it_can_not_be_measured(tiny):
    toks = [(7 * i + 3) % 1000 for i in range(16 + 3 * 8)]
    p = profile_prefill(tiny, toks, ctx=16, chunk=8, repeats=1)
    assert p["gpu_busy_ms"] is None and "GPU-busy" not in format_prefill_profile(p)
