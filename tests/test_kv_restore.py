"""Disk KV checkpoints restore the exact session state (demo model, CPU).

* session level: snapshot after N tokens -> KVStore file -> lookup -> restore
  into a new session -> decode: every logit equals the uninterrupted session's,
  bit for bit;
* engine level (`DiskKVCache`): a restarted engine continues from the
  shutdown checkpoint exactly like an engine that never stopped, prefilling
  only the suffix; cold / continued / evict saves land where kv-cache.md §5
  puts them and a session switch reloads the evicted session;
* a checkpoint of another model configuration is rejected and deleted.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import ds4mlx
from ds4mlx.engine import Engine, Job
from ds4mlx.kv.cache import DiskKVCache, model_identity, routed_expert_bits
from ds4mlx.kv.policy import KVCacheOptions
from ds4mlx.kv.store import KVStore
from ds4mlx.runtime.sampling import GREEDY

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
TEXT = open(os.path.join(os.path.dirname(ds4mlx.__file__), "data", "bench_text.txt"), encoding="utf-8").read()


@pytest.fixture(scope="module")
def demo(shared_demo):
    return shared_demo()


def chat_prompt(system: str, *turns: str) -> str:
    """A rendered non-thinking chat prompt (user turns; assistant texts between them)."""
    out = BOS + system
    for i, t in enumerate(turns):
        out += (USER + t + ASSISTANT + "</think>") if i % 2 == 0 else (t + EOS)
    return out


def options(d, **kw) -> KVCacheOptions:
    base = dict(
        disk_dir=str(d), min_tokens=64, boundary_align_tokens=128, boundary_trim_tokens=8, continued_interval_tokens=0
    )
    base.update(kw)
    return KVCacheOptions(**base)


def engine(demo, cache=None, ctx=2048, chunk=96) -> Engine:
    model, tok = demo
    return Engine(model, tok, ctx=ctx, cache=cache, prefill_chunk=chunk)


def run(eng: Engine, prompt: str, n: int = 4):
    *_, fin = eng.generate(Job(prompt_text=prompt, params=GREEDY, max_tokens=n, thinking="none"))
    assert fin.reason in ("stop", "length"), fin
    return fin


# ------------------------------------------------------------------------- session level
@pytest.mark.parametrize("n", [131, 300])
def test_restore_then_continue_is_bit_exact(demo, tmp_path, n):
    """n crosses the 128-row sliding window and leaves partial compressor
    state (ratio 4 and 128 layers) in the snapshot."""
    model, tok = demo
    ids = tok.encode(TEXT)[: n + 12]
    prefix, more = ids[:n], ids[n:]
    ctx = 1024
    store = KVStore(str(tmp_path), 1 << 30, model_identity(model), routed_expert_bits(model), ctx, 64)

    ref = model.new_session(ctx)  # uninterrupted: prefill, then decode `more` token by token
    ref_logits = [ref.prefill(prefix)] + [ref.decode(t) for t in more]

    a = model.new_session(ctx)
    a.prefill(prefix)
    key = tok.decode_bytes(prefix)
    assert store.store(key, n, a.snapshot(), "cold") is not None
    del a

    b = model.new_session(ctx)  # "after a restart": a fresh session and a fresh store object
    store2 = KVStore(str(tmp_path), 1 << 30, model_identity(model), routed_expert_bits(model), ctx, 64)
    cp = store2.lookup(tok.decode(ids))
    assert cp is not None and cp.n_tokens == n and cp.key_bytes == key
    b.restore(cp.payload)
    assert b.tokens == prefix
    got = [b.last_logits] + [b.decode(t) for t in more]
    for i, (x, y) in enumerate(zip(got, ref_logits)):
        assert x.dtype == y.dtype == np.float32
        assert np.array_equal(x, y), f"logits differ at step {i}"
    # greedy continuation from the restored state equals the reference too
    g_ref = [int(np.argmax(ref_logits[-1]))]
    g_new = [int(np.argmax(got[-1]))]
    for _ in range(4):
        g_ref.append(int(np.argmax(ref.decode(g_ref[-1]))))
        g_new.append(int(np.argmax(b.decode(g_new[-1]))))
    assert g_new == g_ref


# ------------------------------------------------------------------------- engine level
def test_restarted_engine_continues_exactly_like_an_uninterrupted_one(demo, tmp_path):
    model, tok = demo
    # no cold split: a prefill cut at another place rounds differently, so both
    # engines must prefill in the same chunks (absolute multiples of 96)
    opt = options(tmp_path, cold_max_tokens=0)
    p1 = chat_prompt(TEXT[:1200], "Summarise.")
    a = engine(demo, DiskKVCache.open(opt, model, ctx=2048))
    f1 = run(a, p1)
    live = len(a.session)
    a.close()  # shutdown save of the whole live session
    assert any(
        e.reason == "shutdown" and e.tokens == live
        for e in KVStore(str(tmp_path), 1 << 30, model_identity(model), routed_expert_bits(model), 2048, 64).entries()
    )
    p2 = chat_prompt(TEXT[:1200], "Summarise.", f1.raw_text, "Shorter.")

    b = engine(demo, DiskKVCache.open(opt, model, ctx=2048))  # restart
    f2 = run(b, p2, 6)
    assert b.stats.last_cache_source == "disk-text"
    assert f2.usage.cached_tokens == live and b.stats.prefill_tokens == f2.usage.prompt_tokens - live

    c = engine(demo)  # never stopped: the live session is reused from memory
    assert run(c, p1).raw_text == f1.raw_text
    f2c = run(c, p2, 6)
    assert c.stats.last_cache_source.startswith("memory-") and f2c.usage.cached_tokens == live
    assert f2.raw_text == f2c.raw_text and f2.usage == f2c.usage
    assert b.session.tokens == c.session.tokens
    assert np.array_equal(b.session.last_logits, c.session.last_logits)
    b.close()
    c.close()


def test_save_points_and_session_switch(demo, tmp_path):
    """cold at the chat anchor, continued at absolute multiples, evict on a
    session switch; switching back restores the evicted session from disk."""
    model, tok = demo
    opt = options(tmp_path, continued_interval_tokens=200)  # step = 256 (align 128)
    cache = DiskKVCache.open(opt, model, ctx=2048)
    eng = engine(demo, cache, chunk=96)
    pa = chat_prompt(TEXT[:1500], "Question one?")
    fa = run(eng, pa, 3)
    n_sys = len(tok.encode(BOS + TEXT[:1500]))
    got = sorted((e.reason, e.tokens) for e in cache.store.entries())
    assert got == [("cold", n_sys), ("continued", 256)], got  # anchor = index of the last <User>
    live_a = len(eng.session)

    pb = chat_prompt(TEXT[2000:2600], "Another topic.")
    run(eng, pb, 3)  # full live miss: session A is evicted to disk
    assert ("evict", live_a) in [(e.reason, e.tokens) for e in cache.store.entries()]

    before = eng.stats.prefill_tokens
    pa2 = chat_prompt(TEXT[:1500], "Question one?", fa.raw_text, "Follow-up?")
    fa2 = run(eng, pa2, 3)
    assert eng.stats.last_cache_source == "disk-text" and fa2.usage.cached_tokens == live_a
    assert eng.stats.prefill_tokens - before == fa2.usage.prompt_tokens - live_a
    assert cache.stats()["hits"] == 1 and cache.frontier.last == live_a
    eng.close()


# ------------------------------------------------------------------------- other models
def _other_model():
    """The demo architecture with another rope theta: same shapes, other config."""
    from ds4mlx.io.demo import DEMO_CONFIG, demo_weights
    from ds4mlx.io.loader import materialize
    from ds4mlx.models.base import LanguageModel

    cfg = dict(DEMO_CONFIG, rope_theta=20000.0)
    m = LanguageModel.from_config(cfg, demo_weights(DEMO_CONFIG))
    materialize(m.model)  # the engine's worker thread cannot evaluate arrays left lazy here
    return m


def test_checkpoint_of_another_model_config_is_rejected_and_deleted(demo, tmp_path):
    model, tok = demo
    other = _other_model()
    assert model_identity(other) != model_identity(model)
    ids = tok.encode(TEXT)[:200]
    s = model.new_session(2048)
    s.prefill(ids)
    store = KVStore(str(tmp_path), 1 << 30, model_identity(model), routed_expert_bits(model), 2048, 64)
    path = store.store(tok.decode_bytes(ids), len(ids), s.snapshot(), "cold")
    assert os.path.exists(path)

    # the store of the other model: different model id -> deleted when met
    cache = DiskKVCache.open(options(tmp_path), other, ctx=2048)
    assert not os.path.exists(path) and cache.store.entries() == []

    # same store id but a payload the other model's session refuses (its own
    # fingerprint check): discarded on load, the request goes cold
    path = store.store(tok.decode_bytes(ids), len(ids), s.snapshot(), "cold")
    forged = DiskKVCache(
        KVStore(str(tmp_path), 1 << 30, model_identity(model), routed_expert_bits(model), 2048, 64),
        options(tmp_path, cold_max_tokens=0),
    )
    eng = Engine(other, tok, ctx=2048, cache=forged)
    fin = run(eng, tok.decode(ids) + " and more", 2)
    assert fin.usage.cached_tokens == 0 and eng.stats.last_cache_source == "none"
    assert forged.stats()["load_failures"] == 1 and not os.path.exists(path)
    eng.close()


def test_quant_bits_of_routed_experts(demo):
    """float32 experts report 32; MLX-quantized experts their bits."""
    import mlx.core as mx
    import mlx.nn as nn

    from ds4mlx.io.demo import DEMO_CONFIG, demo_weights
    from ds4mlx.models.base import LanguageModel

    assert routed_expert_bits(demo[0]) == 32
    m = LanguageModel.from_config(DEMO_CONFIG, demo_weights(DEMO_CONFIG))
    nn.quantize(
        m.model,
        group_size=32,
        bits=4,
        class_predicate=lambda path, mod: ".experts." in path and hasattr(mod, "to_quantized"),
    )
    assert routed_expert_bits(m) == 4

    from ds4mlx.io.quant import QT
    from ds4mlx.models.quantized import GGUFSwitchLinear

    class Fake(nn.Module):  # GGUF blocks kept as such (ds4's 2-bit files)
        def __init__(self):
            super().__init__()
            self.layers = [nn.Module()]
            self.layers[0].experts = nn.Module()
            self.layers[0].experts.down_proj = GGUFSwitchLinear(mx.zeros((2, 4, 84), mx.uint8), QT.Q2_K, 256)

    assert routed_expert_bits(Fake()) == 2


@pytest.mark.parametrize("config", [None, "long"])
def test_restore_then_continue_is_bit_exact_on_the_oracle_model(oracle, tmp_path, config):
    """The same property on the tiny transformers-oracle DeepSeek V4 models (whose
    logits match transformers' within 1e-4): a checkpoint stored mid-sequence, read
    back through the store by a fresh store object, continues bit for bit like
    the session that never stopped, on the oracle's own token sequence."""
    from ds4mlx.models.base import load_hf_dir

    folder = oracle("make_tiny_deepseek_v4.py", config)
    model = load_hf_dir(str(folder))
    ids = [int(t) for t in np.load(folder / "reference.npz")["input_ids"][0]]
    n = len(ids) // 2 + 1  # odd: mid compression block
    prefix, more = ids[:n], ids[n:]
    store = KVStore(str(tmp_path), 1 << 30, "oracle-" + str(config), 32, 256, 8)
    ref = model.new_session(256)
    ref_logits = [ref.prefill(prefix)] + [ref.decode(t) for t in more]
    a = model.new_session(256)
    a.prefill(prefix)
    key = "".join(f"<{t}>" for t in prefix)  # the oracle has no tokenizer: a text key per token
    assert store.store(key, n, a.snapshot(), "cold") is not None
    cp = KVStore(str(tmp_path), 1 << 30, "oracle-" + str(config), 32, 256, 8).lookup(
        key + "".join(f"<{t}>" for t in more)
    )
    assert cp is not None and cp.n_tokens == n
    b = model.new_session(256)
    b.restore(cp.payload)
    got = [b.last_logits] + [b.decode(t) for t in more]
    for i, (x, y) in enumerate(zip(got, ref_logits)):
        assert np.array_equal(x, y), f"logits differ at step {i}"
