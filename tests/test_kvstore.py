"""Disk KV checkpoint store (ds4mlx.kv.store) and save-point policy (ds4mlx.kv.policy).

Spec: kv-cache.md §3-§9, with the issue's deviations (model tag, CRC footer,
pre-store eviction, anchor factor, strict-prefix penalty)."""

from __future__ import annotations

import argparse
import json
import os
import struct

import pytest

from ds4mlx.kv import policy as kp
from ds4mlx.kv import store as ks
from ds4mlx.kv.store import KVStore

MODEL = "deepseek-v4-flash-test"
HALF_LIFE = ks.HIT_HALF_LIFE_SECONDS


class Clock:
    def __init__(self, t: int = 1_700_000_000):
        self.t = t

    def __call__(self) -> float:
        return self.t


def open_store(d, budget=1 << 20, *, model=MODEL, quant=4, ctx=4096, min_tokens=4, clock=None, **kw) -> KVStore:
    return KVStore(str(d), budget, model, quant, ctx, min_tokens, clock=clock or Clock(), **kw)


def kv_files(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".kv"))


# ------------------------------------------------------------------ §9 vectors

SPEC_HEADER_HEX = (
    "4b56 4301 0201 0000 2b05 0000 0000 0000"
    "0080 0000 0000 0000 b8b2 0c6b 0000 0000"
    "b8b2 0c6b 0000 0000 bc14 0000 0000 0000"
    "c405 0000 3cef bd9c 6265 6769 6ee2 9681"
)
SPEC_BYTES = bytes.fromhex(SPEC_HEADER_HEX.replace(" ", ""))


def test_sha1_vector():
    assert ks.sha1_hex(b"abc") == "a9993e364706816aba3e25717850c26c9cd0d89d"


def test_header_bytes_match_spec_capture():
    """With model tag 0 (ds4's reserved bytes) the header is byte-identical to
    the captured ds4 cold save (§3.1)."""
    h = ks.pack_header(
        quant_bits=2,
        reason=ks.REASON_CODES["cold"],
        flags=0,
        tokens=1323,
        hits=0,
        ctx=32768,
        model_tag=0,
        created_at=0x6B0CB2B8,
        last_used=0x6B0CB2B8,
        payload_bytes=5308,
    )
    assert len(h) == 48
    assert h + ks.KEYLEN.pack(1476) == SPEC_BYTES[:52]


def test_stored_file_header_matches_spec_capture_except_model_tag(tmp_path):
    key = ("<｜begin▁of▁sentence｜>" + "x" * 2000).encode()[:1476]
    assert len(key) == 1476 and key[:12] == SPEC_BYTES[52:64]
    s = open_store(tmp_path, 1 << 20, quant=2, ctx=32768, clock=Clock(0x6B0CB2B8))
    path = s.store(key, 1323, os.urandom(5308), "cold")
    with open(path, "rb") as f:
        data = f.read()
    assert data[:20] == SPEC_BYTES[:20]
    assert data[24:64] == SPEC_BYTES[24:64]
    assert struct.unpack_from("<I", data, 20)[0] == ks.model_tag(MODEL) != 0
    assert len(data) == 52 + 1476 + 5308 + 0 + 20
    assert data[-20:-16] == b"KVCF"
    assert os.path.basename(path) == ks.sha1_hex(key) + ".kv"


def test_budget_vectors():
    # ds4's sizes (52 + K + P + trailer) with the 1 % headroom
    assert ks.budget_required(52 + 100 + 930) == 1093
    assert ks.budget_required(52 + 100 + 938) == 1101
    assert ks.budget_required(52 + 100 + 900 + 40) == 1092 + 11
    # ours carries a 20-byte footer: the same boundaries, 20 bytes earlier
    s_fit = ks.file_size_for(100, 910)
    assert s_fit == 1082 and ks.budget_required(s_fit) == 1093
    assert ks.budget_required(ks.file_size_for(100, 918)) == 1101
    assert ks.budget_required(ks.file_size_for(100, 880, 40)) > 1100


def test_budget_vectors_in_store(tmp_path):
    key = b"k" * 100
    s = open_store(tmp_path, 1100)
    assert s.fits(100, 910) and not s.fits(100, 918) and not s.fits(100, 880, 40)
    assert s.store(key, 10, b"p" * 918) is None
    assert s.store(key, 10, b"p" * 880, trailer=b"t" * 40) is None
    assert kv_files(tmp_path) == []
    assert s.store(key, 10, b"p" * 910) is not None
    assert s.total_bytes() == 1082


def test_continued_vectors():
    opt = kp.KVCacheOptions(disk_dir="x")
    f = kp.ContinuedFrontier(opt)
    assert f.step == 10240
    assert not f.due(10239)
    assert f.due(10240)
    f.note(10240)
    assert not f.due(10240)
    assert not f.due(18432)
    assert f.due(20480)
    g = kp.ContinuedFrontier(kp.KVCacheOptions(disk_dir="x", boundary_align_tokens=0), last=20480)
    assert g.step == 10000
    assert not g.due(29999)
    assert g.due(30000)
    assert not kp.ContinuedFrontier(kp.KVCacheOptions(continued_interval_tokens=0)).due(10240)


U, A = 900, 901


def test_anchor_vectors():
    assert kp.chat_anchor_pos([1, 2, U, 3, 4, U, 5, A], U, A, 4) == 5
    assert kp.chat_anchor_pos([1, 2, 3, 4, U, 5, A], U, A, 4) == 4
    assert kp.chat_anchor_pos([1, 2, U, 3, A, 4, U, 5, A], U, A, 2) == 2
    assert kp.chat_anchor_pos([1, 2, U, 3, A, 4, U, 5, A], U, A, 3) is None
    assert kp.chat_anchor_pos([1, 2, U, 3], None, A, 1) is None


def test_cold_save_point():
    opt = kp.KVCacheOptions(disk_dir="x")
    assert kp.store_len(11011, opt) == 10240
    assert kp.store_len(1695, opt) == 1695
    assert kp.cold_save_point([7] * 11011, opt) == kp.ColdSave(10240, "trim-align")
    assert kp.cold_save_point([7] * 1695, opt) == kp.ColdSave(1695, "full")
    assert kp.cold_save_point([7] * 511, opt) is None  # < min
    assert kp.cold_save_point([7] * 30001, opt) is None  # > cold_max
    assert kp.cold_save_point([7] * 30000, opt) == kp.ColdSave(28672, "trim-align")
    ids = [7] * 600 + [U] + [7] * 900 + [A] + [7] * 40
    assert kp.cold_save_point(ids, opt, user_id=U, assistant_id=A) == kp.ColdSave(600, "anchor")
    # anchor below min -> trim/align fallback
    ids = [7] * 100 + [U] + [7] * 3000 + [A]
    assert kp.cold_save_point(ids, opt, user_id=U, assistant_id=A) == kp.ColdSave(2048, "trim-align")
    off = kp.KVCacheOptions(disk_dir="x", cold_max_tokens=0)
    assert kp.cold_save_point([7] * 2000, off) is None


def test_frontier_suppress_reset_loaded():
    opt = kp.KVCacheOptions(disk_dir="x")
    f = kp.ContinuedFrontier(opt)
    tok = f.suppress(10240)  # cold length is itself a frontier
    assert tok == 0 and not f.due(10240)
    f.unsuppress(tok, 10240)  # cold save failed
    assert f.due(10240)
    assert f.suppress(5000) is None and f.last == 0
    f.loaded(20480)
    assert not f.due(20480) and f.due(30720)
    f.reset()
    assert f.due(10240)


def test_evict_and_shutdown_lengths():
    opt = kp.KVCacheOptions(disk_dir="x")
    assert kp.evict_save_len(511, opt) is None
    assert kp.evict_save_len(777, opt) == 777
    assert kp.shutdown_save_len(512, opt) == 512
    assert kp.shutdown_save_len(5000, kp.KVCacheOptions()) is None  # cache off


def test_add_kv_arguments_defaults_and_aliases(tmp_path):
    p = argparse.ArgumentParser()
    kp.add_kv_arguments(p)
    opt = kp.KVCacheOptions.from_args(p.parse_args([]))
    assert opt == kp.KVCacheOptions()
    assert not opt.enabled and opt.budget_bytes == 4096 << 20
    a = p.parse_args(
        [
            "--kv-disk-dir",
            str(tmp_path),
            "--kv-disk-space-mb",
            "12",
            "--kv-cache-min-tokens",
            "100",
            "--kv-cache-cold-max-tokens",
            "0",
            "--kv-cache-continued-interval-tokens",
            "0",
            "--kv-cache-boundary-trim-tokens",
            "8",
            "--kv-cache-boundary-align-tokens",
            "0",
            "--kv-cache-accept-different-quant",
            "--disable-exact-dsml-tool-replay",
            "--tool-memory-max-ids",
            "7",
        ]
    )
    opt = kp.KVCacheOptions.from_args(a)
    assert (opt.disk_dir, opt.budget_bytes, opt.min_tokens, opt.cold_max_tokens) == (str(tmp_path), 12 << 20, 100, 0)
    assert (opt.continued_interval_tokens, opt.boundary_trim_tokens, opt.boundary_align_tokens) == (0, 8, 0)
    assert opt.cross_quant and not opt.exact_dsml_tool_replay and opt.tool_memory_max_ids == 7
    assert "budget=12 MiB" in opt.describe() and "cross-quant=accept" in opt.describe()
    assert p.parse_args(["--kv-cache-budget-mb", "0"]).kv_cache_budget_mb == 0
    assert kp.KVCacheOptions(budget_mb=0).budget_bytes == 4096 << 20
    assert p.parse_args(["--kv-cache-reject-different-quant"]).kv_cache_cross_quant is False
    s = kp.open_store(opt, model_id=MODEL, quant_bits=4, ctx=4096)
    assert isinstance(s, KVStore) and s.budget_bytes == 12 << 20 and s.cross_quant
    assert kp.open_store(kp.KVCacheOptions(), model_id=MODEL, quant_bits=4, ctx=4096) is None


def test_add_kv_arguments_keeps_existing_tool_memory_flags():
    p = argparse.ArgumentParser()
    p.add_argument("--tool-memory-max-ids", type=int, default=5)
    p.add_argument("--disable-exact-dsml-tool-replay", action="store_true")
    kp.add_kv_arguments(p)
    assert p.parse_args([]).tool_memory_max_ids == 5


def test_options_validation():
    with pytest.raises(ValueError):
        kp.KVCacheOptions(min_tokens=0)
    with pytest.raises(ValueError):
        kp.KVCacheOptions(min_tokens=512, cold_max_tokens=100)
    with pytest.raises(ValueError):
        kp.KVCacheOptions(boundary_align_tokens=-1)


# ------------------------------------------------------------------ store / lookup


def test_store_and_lookup_roundtrip(tmp_path):
    clock = Clock()
    s = open_store(tmp_path, clock=clock)
    payload = [b"abc", bytearray(b"def"), memoryview(b"ghi")]
    path = s.store("system prompt", 10, payload, "cold", trailer=b"KTM\x01....")
    assert path and os.path.basename(path) == ks.sha1_hex(b"system prompt") + ".kv"
    cp = s.lookup("system prompt + user task")
    assert cp is not None
    assert (cp.key_text, cp.n_tokens, cp.payload, cp.trailer, cp.reason) == (
        "system prompt",
        10,
        b"abcdefghi",
        b"KTM\x01....",
        "cold",
    )
    assert cp.has_tool_map and cp.key_kind == "token-text" and cp.hits == 1
    assert cp.suffix("system prompt + user task") == " + user task"
    with pytest.raises(ValueError):
        cp.suffix("other")
    [e] = s.entries()
    assert (e.hits, e.tokens, e.reason, e.flags) == (1, 10, "cold", ks.FLAG_TOOL_MAP)


def test_store_dir_is_created_private(tmp_path):
    d = tmp_path / "a" / "b"
    open_store(d)
    assert (os.stat(d).st_mode & 0o777) == 0o700


def test_key_kinds_and_flags(tmp_path):
    s = open_store(tmp_path)
    s.store("visible transcript A", 10, b"p", "evict", key_kind="responses-visible")
    s.store("visible transcript B", 10, b"p", "shutdown", key_kind="thinking-visible")
    kinds = {e.key_kind for e in s.entries()}
    assert kinds == {"responses-visible", "thinking-visible"}
    assert all(not e.flags & ks.FLAG_TOOL_MAP for e in s.entries())
    cp = s.lookup("visible transcript A and more")
    assert cp.key_kind == "responses-visible" and cp.trailer is None and cp.reason == "evict"
    with pytest.raises(ValueError):
        s.store("x" * 10, 10, b"p", key_kind="bogus")


def test_store_preconditions(tmp_path):
    s = open_store(tmp_path, min_tokens=8, ctx=100)
    assert s.store("key text", 7, b"p") is None  # below min_tokens: skipped
    with pytest.raises(ValueError):
        s.store("key text", 100, b"p")  # tokens must be < ctx
    with pytest.raises(ValueError):
        s.store("key text", 10, b"")  # empty payload
    with pytest.raises(ValueError):
        s.store("", 10, b"p")  # empty key
    with pytest.raises(ValueError):
        s.store("key text", 10, b"p", reason="bogus")
    assert kv_files(tmp_path) == []


def test_longest_prefix_vector(tmp_path):
    s = open_store(tmp_path, min_tokens=512)
    s.store("transcript prefix", 512, b"short", "cold")
    s.store("transcript prefix with sampled token bytes", 768, b"long", "continued")
    cp = s.lookup("transcript prefix with sampled token bytes and suffix")
    assert cp.n_tokens == 768 and cp.payload == b"long"
    assert s.lookup("transcript prefiX") is None
    assert s.lookup("transcript prefix, other").n_tokens == 512
    # equality allowed; a key longer than the prompt never matches
    assert s.lookup("transcript prefix").n_tokens == 512
    assert s.lookup("transcript prefi") is None


def test_lookup_min_tokens_threshold(tmp_path):
    s = open_store(tmp_path, min_tokens=4)
    s.store("abc long key", 600, b"long")
    s.store("abc", 100, b"short")
    t = open_store(tmp_path, min_tokens=512)
    assert t.lookup("abc long key!").payload == b"long"
    assert t.lookup("abc def") is None  # 100 < 512: not a candidate
    assert len(kv_files(tmp_path)) == 2  # below-min files are kept
    assert t.store("abcdef", 511, b"x") is None


def test_lookup_equal_length_keys_pick_the_matching_one(tmp_path):
    s = open_store(tmp_path)
    s.store("prefix AAAA", 50, b"A")
    s.store("prefix BBBB", 90, b"B")
    assert s.lookup("prefix AAAA tail").payload == b"A"
    assert s.lookup("prefix BBBB tail").payload == b"B"


def test_lookup_tie_same_key_more_tokens_wins(tmp_path):
    """Two files with the same key (ds4 lists upper-case hex names too): the
    one with more tokens wins."""
    s = open_store(tmp_path)
    p1 = s.store("same key", 10, b"ten")
    with open(p1, "rb") as f:
        ten = f.read()
    os.unlink(p1)
    p2 = s.store("same key", 20, b"twenty")
    upper = os.path.join(tmp_path, os.path.basename(p2)[:40].upper() + ".kv")
    with open(upper, "wb") as f:
        f.write(ten)
    assert len(s.entries()) == 2
    assert s.lookup("same key!").payload == b"twenty"


def test_lookup_falls_back_when_best_is_corrupt(tmp_path):
    s = open_store(tmp_path)
    s.store("shared prefix", 10, b"short")
    long_path = s.store("shared prefix and more", 20, b"long payload")
    data = bytearray(open(long_path, "rb").read())
    data[60 + len("shared prefix and more")] ^= 1  # a payload bit
    open(long_path, "wb").write(data)
    cp = s.lookup("shared prefix and more and more")
    assert cp.payload == b"short"
    assert not os.path.exists(long_path)
    assert s.load_failures == 1  # counted, as logged (the cache's stats add it)


def test_utf8_key_split_inside_a_character(tmp_path):
    s = open_store(tmp_path)
    full = "前缀文本".encode()
    key = full[:7]  # ends mid-character
    s.store(key, 10, b"p")
    cp = s.lookup("前缀文本 suffix")
    assert cp.key_bytes == key
    assert (cp.key_text + cp.suffix("前缀文本 suffix")).encode("utf-8", "surrogateescape") == "前缀文本 suffix".encode()
    assert cp.suffix_bytes("前缀文本 suffix") == full[7:] + b" suffix"


def test_has_and_store_existing_key_keeps_file_and_hits(tmp_path):
    clock = Clock()
    s = open_store(tmp_path, clock=clock)
    path = s.store("conversation", 10, b"v1")
    assert s.has("conversation") and not s.has("conversation!")
    s.lookup("conversation x")
    clock.t += 100
    assert s.store("conversation", 10, b"v2") == path  # no rewrite
    [e] = s.entries()
    assert e.hits == 1 and e.last_used == clock.t and e.created_at == clock.t - 100
    assert s.lookup("conversation x").payload == b"v1"


def test_store_existing_key_new_trailer_rewrites_and_carries_hits(tmp_path):
    clock = Clock()
    s = open_store(tmp_path, clock=clock)
    s.store("conversation", 10, b"v1", trailer=b"T1")
    s.lookup("conversation x")
    s.lookup("conversation x")
    clock.t += 5
    s.store("conversation", 10, b"v1", trailer=b"T1")  # same trailer: kept
    assert s.lookup("conversation y").trailer == b"T1"
    s.store("conversation", 10, b"v2", trailer=None)  # empty trailer: kept
    assert s.lookup("conversation y").payload == b"v1"
    s.store("conversation", 10, b"v2", trailer=b"T2")  # new trailer: rewritten
    [e] = s.entries()
    assert e.hits == 4 and e.created_at == clock.t
    cp = s.lookup("conversation z")
    assert (cp.payload, cp.trailer, cp.hits) == (b"v2", b"T2", 5)


def test_read_trailers(tmp_path):
    s = open_store(tmp_path)
    s.store("with trailer", 10, b"p", trailer=b"KTM-A")
    s.store("without trailer", 10, b"p")
    got = [(e.key_bytes, t) for e, t in s.read_trailers()]
    assert got == [(len("with trailer"), b"KTM-A")]


def test_hits_persist_in_sidecar_and_bind_to_file_identity(tmp_path):
    clock = Clock()
    s = open_store(tmp_path, clock=clock)
    s.store("persistent", 10, b"p")
    for _ in range(3):
        s.lookup("persistent!")
    assert open_store(tmp_path, clock=clock).entries()[0].hits == 3
    meta = json.load(open(tmp_path / ks.META_NAME))
    assert list(meta["entries"].values())[0]["hits"] == 3
    # the file is rebuilt (deleted + stored again): stale hits do not carry over
    s2 = open_store(tmp_path, clock=clock)
    s2.discard(s2.entries()[0])
    clock.t += 1
    s2.store("persistent", 10, b"q")
    assert s2.entries()[0].hits == 0
    # a garbage sidecar is ignored, not trusted
    (tmp_path / ks.META_NAME).write_bytes(b"{not json")
    s3 = open_store(tmp_path, clock=clock)
    assert s3.entries()[0].hits == 0
    assert s3.lookup("persistent?").payload == b"q"
    assert json.load(open(tmp_path / ks.META_NAME))["entries"]


def test_leftover_temporaries_cleaned_other_files_ignored(tmp_path):
    s = open_store(tmp_path)
    s.store("keep me", 10, b"p")
    sha = ks.sha1_hex(b"gone")
    dead = 2**22 + 12345  # above pid_max: never alive
    (tmp_path / f"{sha}.kv.tmp.{dead}").write_bytes(b"partial")
    (tmp_path / f"{ks.META_NAME}.tmp.{dead}").write_bytes(b"{")
    live = tmp_path / f"{sha}.kv.tmp.{os.getppid()}"
    live.write_bytes(b"someone else's write in progress")
    (tmp_path / "notes.txt").write_bytes(b"x")
    (tmp_path / ("ab" * 20 + ".kvx")).write_bytes(b"x")
    s = open_store(tmp_path)
    names = set(os.listdir(tmp_path))
    assert f"{sha}.kv.tmp.{dead}" not in names and f"{ks.META_NAME}.tmp.{dead}" not in names
    assert live.name in names and "notes.txt" in names and ("ab" * 20 + ".kvx") in names
    assert [e.key_bytes for e in s.entries()] == [len("keep me")]


# ------------------------------------------------------------------ rejection


def _pristine(tmp_path, **kw):
    d = tmp_path / "src"
    s = open_store(d, **kw)
    path = s.store("the key text", 600, bytes(range(40)), "continued", trailer=b"KTM!trailer")
    return path, open(path, "rb").read()


PROMPT = "the key text, then the new user turn"


def _assert_rejected(d, name, data, **kw):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)
    s = open_store(d, **kw)
    assert s.lookup(PROMPT) is None
    assert not os.path.exists(os.path.join(d, name)), "rejected file must be deleted"


def test_pristine_file_loads(tmp_path):
    path, data = _pristine(tmp_path)
    d = tmp_path / "ok"
    os.makedirs(d)
    (d / os.path.basename(path)).write_bytes(data)
    cp = open_store(d).lookup(PROMPT)
    assert cp.payload == bytes(range(40)) and cp.trailer == b"KTM!trailer"


def test_every_single_bit_flip_is_rejected_and_deleted(tmp_path):
    path, data = _pristine(tmp_path)
    name = os.path.basename(path)
    regions = {
        "header": range(0, 48),
        "key length": range(48, 52),
        "key": range(52, 64),
        "payload": range(64, 104),
        "trailer": range(104, 115),
        "footer": range(115, 135),
    }
    assert len(data) == 135
    d = tmp_path / "flip"
    for region, offsets in regions.items():
        for i in offsets:
            for bit in {i % 8, 7 - i % 8}:
                bad = bytearray(data)
                bad[i] ^= 1 << bit
                _assert_rejected(d, name, bytes(bad))


@pytest.mark.parametrize("cut", [0, 1, 47, 51, 60, 100, 114, 120, 134])
def test_truncated_file_is_rejected_and_deleted(tmp_path, cut):
    path, data = _pristine(tmp_path)
    _assert_rejected(tmp_path / "t", os.path.basename(path), data[:cut])


def test_appended_bytes_are_rejected(tmp_path):
    path, data = _pristine(tmp_path)
    _assert_rejected(tmp_path / "t", os.path.basename(path), data + b"\0")


def test_wrong_model_is_rejected_and_deleted(tmp_path):
    path, data = _pristine(tmp_path, model="some-other-model")
    _assert_rejected(tmp_path / "t", os.path.basename(path), data)


def test_wrong_quant_is_rejected_and_deleted(tmp_path):
    path, data = _pristine(tmp_path, quant=2)
    _assert_rejected(tmp_path / "t", os.path.basename(path), data)


def test_cross_quant_accepts_other_quant(tmp_path):
    path, data = _pristine(tmp_path, quant=2)
    d = tmp_path / "t"
    os.makedirs(d)
    (d / os.path.basename(path)).write_bytes(data)
    cp = open_store(d, cross_quant=True).lookup(PROMPT)
    assert cp is not None and cp.quant_bits == 2


def test_larger_ctx_is_rejected_and_deleted(tmp_path):
    path, data = _pristine(tmp_path, ctx=8192)
    _assert_rejected(tmp_path / "t", os.path.basename(path), data, ctx=4096)


def test_smaller_ctx_is_accepted(tmp_path):
    path, data = _pristine(tmp_path, ctx=2048)
    d = tmp_path / "t"
    os.makedirs(d)
    (d / os.path.basename(path)).write_bytes(data)
    assert open_store(d, ctx=4096).lookup(PROMPT).ctx == 2048


def _reseal(data: bytes) -> bytes:
    """Recompute the file CRC so only the intended field is 'wrong'."""
    import zlib

    body = data[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def test_tokens_not_below_file_ctx_rejected(tmp_path):
    path, data = _pristine(tmp_path)
    bad = bytearray(data)
    struct.pack_into("<I", bad, 16, 600)  # ctx == tokens (600)
    _assert_rejected(tmp_path / "t", os.path.basename(path), _reseal(bytes(bad)))


@pytest.mark.parametrize("version", [0, 2, 255])
def test_wrong_version_is_rejected_and_deleted(tmp_path, version):
    path, data = _pristine(tmp_path)
    bad = bytearray(data)
    bad[3] = version
    _assert_rejected(tmp_path / "t", os.path.basename(path), _reseal(bytes(bad)))


def test_ds4_c_v1_file_is_rejected_and_deleted(tmp_path):
    """A ds4 C file (no model tag, no footer) is not trusted."""
    key = b"the key text"
    h = ks.pack_header(
        quant_bits=4, reason=1, flags=0, tokens=600, ctx=4096, model_tag=0, created_at=1, last_used=1, payload_bytes=8
    )
    data = h + ks.KEYLEN.pack(len(key)) + key + b"DSV4...."
    _assert_rejected(tmp_path / "t", ks.sha1_hex(key) + ".kv", data)


def test_misnamed_file_is_never_loaded_and_verify_deletes_it(tmp_path):
    """Key does not hash to the file name (e.g. copied under another name):
    lookup matches names against the prompt, so it is never a candidate for
    its own key; a full verification deletes it."""
    d = tmp_path / "t"
    s = open_store(d)
    s.store("the key", 600, b"payload")
    wrong = os.path.join(d, ks.sha1_hex(b"the key text") + ".kv")
    os.rename(s.path_for("the key"), wrong)
    assert s.lookup(PROMPT) is None
    assert s.verify_all() == 1 and not os.path.exists(wrong)


def test_verify_all_deletes_corrupt_payloads(tmp_path):
    s = open_store(tmp_path)
    good = s.store("good key", 10, b"good payload")
    bad = s.store("bad key", 10, b"bad payload!")
    data = bytearray(open(bad, "rb").read())
    data[52 + len("bad key") + 3] ^= 0x10
    open(bad, "wb").write(data)
    assert len(s.entries()) == 2  # listing reads header+footer only
    assert s.verify_all() == 1
    assert os.path.exists(good) and not os.path.exists(bad)


def test_discard(tmp_path):
    s = open_store(tmp_path)
    s.store("some key", 10, b"p")
    cp = s.lookup("some key!")
    s.discard(cp)
    assert kv_files(tmp_path) == [] and s.lookup("some key!") is None


# ------------------------------------------------------------------ eviction


def _size(key: str, payload: int, trailer: int = 0) -> int:
    return ks.file_size_for(len(key.encode()), payload, trailer)


def test_effective_hits_decay():
    now = 10 * HALF_LIFE
    assert ks.effective_hits(8, now, now) == 8
    assert ks.effective_hits(8, now - HALF_LIFE, now) == pytest.approx(4)
    assert ks.effective_hits(8, now - 2 * HALF_LIFE, now) == pytest.approx(2)
    assert ks.effective_hits(10, now - 14 * HALF_LIFE, now) == 0.0  # 0.0006 < 0.01
    assert ks.effective_hits(1, now - 6 * HALF_LIFE, now) == pytest.approx(1 / 64)
    assert ks.effective_hits(1, now - 7 * HALF_LIFE, now) == 0.0  # 0.0078 < 0.01
    assert ks.effective_hits(5, 0, now) == 0.0  # never used
    assert ks.effective_hits(5, now + 100, now) == 5  # clock went back


def test_score_formula(tmp_path):
    clock = Clock()
    s = open_store(tmp_path, clock=clock)
    s.store("continued key", 300, b"p" * 100, "continued")
    s.store("cold key", 300, b"p" * 100, "cold")
    s.lookup("continued key!")
    s.lookup("continued key!")
    e = {x.reason: x for x in s.entries()}
    now = clock.t + HALF_LIFE
    assert s.score(e["continued"], now) == pytest.approx((1 + 1) * 300 / e["continued"].file_size)
    assert s.score(e["cold"], now) == pytest.approx(2.0 * 300 / e["cold"].file_size)
    assert s.score(e["cold"], now, protected_sha=e["cold"].sha) == float("inf")


def test_eviction_vector_tokens_per_byte(tmp_path):
    """§9: 512 tokens / 4096 B vs 2048 tokens / 2048 B, budget fits one."""
    for order in (0, 1):
        d = tmp_path / f"o{order}"
        s = open_store(d, 1 << 20)
        items = [("key five-twelve", 512, 4096), ("key two-o-four-eight", 2048, 2048)]
        for k, n, p in items if order == 0 else items[::-1]:
            s.store(k, n, b"\0" * p, "continued")
        budget = _size("key five-twelve", 4096) + 10
        s = open_store(d, budget)  # eviction runs on open
        assert [e.tokens for e in s.entries()] == [2048]


def test_eviction_vector_decayed_hits(tmp_path):
    """§9: a 10-hit file last used 14 half-lives ago (1024 tok / 4096 B) scores
    below a fresh 0-hit file (2048 tok / 4096 B)."""
    clock = Clock()
    s = open_store(tmp_path, 1 << 20, clock=clock)
    s.store("old hot key", 1024, b"\0" * 4096, "continued")
    for _ in range(10):
        s.lookup("old hot key!")
    clock.t += 14 * HALF_LIFE
    s.store("new cold key", 2048, b"\0" * 4096, "continued")
    s = open_store(tmp_path, _size("new cold key", 4096) + 100, clock=clock)
    assert [e.tokens for e in s.entries()] == [2048]


def test_recent_hits_protect_a_file(tmp_path):
    """Same density; the file with (recent) hits survives."""
    clock = Clock()
    s = open_store(tmp_path, 1 << 20, clock=clock)
    s.store("key AAAA", 100, b"\0" * 1000, "continued")
    clock.t += 10
    s.store("key BBBB", 100, b"\0" * 1000, "continued")
    s.lookup("key AAAA!")  # A is older but has a hit
    clock.t += HALF_LIFE
    s = open_store(tmp_path, _size("key AAAA", 1000) + 100, clock=clock)
    assert [e.hits for e in s.entries()] == [1]


def test_hit_bonus_decays_to_zero_then_last_use_breaks_the_tie(tmp_path):
    clock = Clock()
    s = open_store(tmp_path, 1 << 20, clock=clock)
    s.store("key AAAA", 100, b"\0" * 1000, "continued")
    s.lookup("key AAAA!")  # 1 hit at t0
    clock.t += 10
    s.store("key BBBB", 100, b"\0" * 1000, "continued")  # created at t0+10, 0 hits
    clock.t += 7 * HALF_LIFE  # 1 hit -> 0.0078 -> 0
    s = open_store(tmp_path, _size("key AAAA", 1000) + 100, clock=clock)
    # equal scores: the older last use (A, t0) goes first
    assert [e.created_at for e in s.entries()] == [clock.t - 7 * HALF_LIFE]


def test_ties_broken_by_last_use(tmp_path):
    clock = Clock()
    s = open_store(tmp_path, 1 << 20, clock=clock)
    s.store("key AAAA", 100, b"\0" * 1000, "continued")
    clock.t += 10
    s.store("key BBBB", 100, b"\0" * 1000, "continued")
    clock.t += 10
    s.store("key AAAA", 100, b"\0" * 1000, "continued")  # touch: last use of A now newer
    s = open_store(tmp_path, _size("key AAAA", 1000) + 100, clock=clock)
    [e] = s.entries()
    assert e.created_at == clock.t - 20  # A survived, B went
    s2 = open_store(tmp_path / "x", 1 << 20, clock=clock)
    s2.store("key AAAA", 100, b"\0" * 1000, "continued")
    clock.t += 10
    s2.store("key BBBB", 100, b"\0" * 1000, "continued")
    s2 = open_store(tmp_path / "x", _size("key AAAA", 1000) + 100, clock=clock)
    assert [e.created_at for e in s2.entries()] == [clock.t]  # older A went


@pytest.mark.parametrize("reason", ["cold", "evict", "shutdown"])
def test_anchor_reasons_score_double(tmp_path, reason):
    for other_tokens, survivor in ((150, reason), (250, "continued")):
        d = tmp_path / f"{reason}{other_tokens}"
        s = open_store(d, 1 << 20)
        s.store("anchor key", 100, b"\0" * 1000, reason)
        s.store("waypoint k", other_tokens, b"\0" * 1000, "continued")
        s = open_store(d, _size("anchor key", 1000) + 100)
        assert [e.reason for e in s.entries()] == [survivor]


def test_just_stored_file_is_protected(tmp_path):
    """A new low-density checkpoint into a full cache: the older, denser file
    is evicted, the new one is kept."""
    budget = _size("dense old key", 1000) + 100
    s = open_store(tmp_path, budget)
    s.store("dense old key", 1000, b"\0" * 1000, "continued")
    p = s.store("sparse new key", 5, b"\0" * 1000, "continued")
    assert [e.tokens for e in s.entries()] == [5] and os.path.exists(p)
    assert s.total_bytes() <= budget


def test_evict_with_protected_sha(tmp_path):
    s = open_store(tmp_path, 1 << 20)
    p_low = s.store("low density", 5, b"\0" * 1000, "continued")
    s.store("high density", 900, b"\0" * 1000, "continued")
    sha_low = os.path.basename(p_low)[:40]
    s.budget_bytes = _size("high density", 1000) + 50
    s.evict(protected_sha=sha_low)
    assert [e.tokens for e in s.entries()] == [5]
    # protection is dropped when the protected file alone exceeds the budget
    s.budget_bytes = 100
    s.evict(protected_sha=sha_low)
    assert s.entries() == []


def test_file_that_cannot_fit_is_skipped_without_evicting(tmp_path):
    budget = 4000
    s = open_store(tmp_path, budget)
    s.store("resident", 10, b"\0" * 2000)
    assert s.store("huge", 10, b"\0" * 4000) is None
    assert s.evict_for(5000, "huge") == []
    assert [e.tokens for e in s.entries()] == [10]


def test_pre_store_eviction_runs_before_the_write(tmp_path):
    """The store never exceeds the budget, even transiently: the victim is
    gone before the new file appears (observed through the write hook)."""
    budget = _size("first key!", 1000) + _size("second key", 1000) + 30
    seen = []

    class Spy(KVStore):
        def _hook(self, point):
            if point == "before-rename":
                seen.append((kv_files(self.dir), self.total_bytes()))

    s = Spy(str(tmp_path), budget, MODEL, 4, 4096, 4, clock=Clock())
    s.store("first key!", 100, b"\0" * 1000, "continued")
    s.store("second key", 200, b"\0" * 1000, "continued")
    s.store("third key!", 300, b"\0" * 1000, "continued")
    assert len(seen[-1][0]) == 1 and seen[-1][1] + _size("third key!", 1000) <= budget
    assert sorted(e.tokens for e in s.entries()) == [200, 300]


def test_strict_prefix_of_pending_entry_is_penalised(tmp_path):
    """A continued waypoint whose key is a strict prefix of the pending key is
    a cheap victim, even when denser than an unrelated file."""
    d = tmp_path / "a"
    s = open_store(d, 1 << 20)
    s.store("conversation turn 1", 300, b"\0" * 1000, "continued")  # prefix of pending
    s.store("unrelated document", 200, b"\0" * 1000, "continued")
    s.budget_bytes = _size("unrelated document", 1000) * 2 + 50
    deleted = s.evict_for(_size("conversation turn 1 turn 2", 1000), "conversation turn 1 turn 2")
    assert [os.path.basename(p) for p in deleted] == [ks.sha1_hex(b"conversation turn 1") + ".kv"]
    # without the pending context, the less dense unrelated file would go
    d = tmp_path / "b"
    s = open_store(d, 1 << 20)
    s.store("conversation turn 1", 300, b"\0" * 1000, "continued")
    s.store("unrelated document", 200, b"\0" * 1000, "continued")
    s.budget_bytes = _size("unrelated document", 1000) * 2 + 50
    deleted = s.evict_for(_size("conversation turn 1 turn 2", 1000), "something else")
    assert [os.path.basename(p) for p in deleted] == [ks.sha1_hex(b"unrelated document") + ".kv"]


def test_prefix_penalty_rules(tmp_path):
    clock = Clock()
    s = open_store(tmp_path, 1 << 20, clock=clock)
    s.store("conv", 300, b"\0" * 1000, "continued")
    s.store("conv anchor", 300, b"\0" * 1000, "cold")
    s.store("conv hot", 300, b"\0" * 1000, "continued")
    for _ in range(3):
        s.lookup("conv hot!")
    e = {x.key_bytes: x for x in s.entries()}
    pend = b"conv hot and more"
    now = clock.t
    base = 300 / e[4].file_size
    assert s.score(e[4], now, pending_key=pend) == pytest.approx(base * 0.05)
    # an anchor that is a prefix is not penalised (it is kept for other sessions)
    s_anchor = s.score(e[len("conv anchor")], now, pending_key=b"conv anchor and more")
    assert s_anchor == pytest.approx(2 * 300 / e[len("conv anchor")].file_size)
    # hits soften the penalty: 0.05 + 0.45 * h, h = eff / (eff + 1)
    hot = e[len("conv hot")]
    assert s.score(hot, now, pending_key=pend) == pytest.approx(4 * 300 / hot.file_size * (0.05 + 0.45 * 3 / 4))
    # equal key is not a *strict* prefix; a non-prefix is not penalised
    assert s.score(e[4], now, pending_key=b"conv") == pytest.approx(base)
    assert s.score(e[4], now, pending_key=b"cone and more") == pytest.approx(base)


def test_prefix_penalty_needs_at_least_as_reusable_ctx(tmp_path):
    s = open_store(tmp_path, 1 << 20, ctx=2048)
    s.store("conv", 300, b"\0" * 1000, "continued")
    big = open_store(tmp_path, 1 << 20, ctx=4096)  # the pending entry gets ctx 4096
    [e] = big.entries()
    assert big.score(e, 0, pending_key=b"conv and more") == pytest.approx(300 / e.file_size)


# ------------------------------------------------------------------ property

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "lookup"]),
        st.text(alphabet="ab前", min_size=1, max_size=6),
        st.integers(4, 60),
        st.integers(1, 700),
        st.sampled_from(["cold", "continued", "evict", "shutdown"]),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, budget=st.sampled_from([1500, 4000, 1 << 20]))
def test_property_budget_and_longest_prefix(ops, budget):
    """Random stores / lookups: the directory never exceeds the budget, and a
    lookup returns the longest listed key that is a byte prefix of the prompt
    (among files with >= min_tokens), with that file's exact payload."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        clock = Clock()
        s = open_store(d, budget, min_tokens=8, clock=clock)
        written = {}
        for op, text, n, size, reason in ops:
            clock.t += 7
            if op == "store":
                payload = (text.encode() * size)[:size] or b"x"
                had = s.has(text)  # an existing key is kept, not rewritten
                if s.store(text, n, payload, reason) is not None and not had:
                    written[text.encode()] = (n, payload)
            else:
                entries = s.entries()
                prompt = (text + "ab前").encode()
                want = [
                    e
                    for e in entries
                    if e.tokens >= 8 and e.key_bytes <= len(prompt) and ks.sha1_hex(prompt[: e.key_bytes]) == e.sha
                ]
                cp = s.lookup(prompt)
                if not want:
                    assert cp is None
                else:
                    assert cp is not None
                    assert len(cp.key_bytes) == max(e.key_bytes for e in want)
                    assert (cp.n_tokens, cp.payload) == written[cp.key_bytes]
            assert s.total_bytes() <= budget
