"""Exact tool replay memory (dsml.md §9) and the KTM trailer (dsml.md §10)."""

from __future__ import annotations

import json
import struct

from ds4mlx.chat.families.deepseek_v4.dsml import parse_output
from ds4mlx.chat.families.deepseek_v4.output import OutputParser
from ds4mlx.chat.families.deepseek_v4.template import render
from ds4mlx.chat.messages import Conversation, Message, ToolCall
from ds4mlx.chat.toolmemory import DISK, RAM, ReplayStats, ToolMemory, parse_ktm, serialize_ktm
from ds4mlx.serve.anthropic import parse_anthropic
from ds4mlx.serve.openai import parse_chat

BLOCK = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls /tmp</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="timeout" string="false">10</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>"
)
SAMPLED = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="timeout" string="false">10</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="command" string="true">ls /tmp</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>"
)  # key order differs from the client's JSON


def test_put_lookup_refresh_replace_and_sources():
    m = ToolMemory()
    m.put("a", BLOCK, DISK)
    assert m.lookup("a") == BLOCK and m.source("a") == DISK and "a" in m and len(m) == 1
    m.put("a", BLOCK, RAM)  # same block: refresh, RAM upgrades DISK
    assert m.source("a") == RAM and m.block_count() == 1
    m.put("a", BLOCK, DISK)  # DISK never downgrades
    assert m.source("a") == RAM
    m.put("a", SAMPLED)  # different block replaces it, old block freed
    assert m.lookup("a") == SAMPLED and m.block_count() == 1
    m.put("b", SAMPLED)
    assert m.block_count() == 1  # blocks are deduplicated
    m.put("", BLOCK)
    m.put("c", "")
    assert len(m) == 2 and m.lookup("missing") is None


def test_lru_bounds_by_ids_and_bytes():
    m = ToolMemory(max_ids=3)
    for i in range(3):
        m.put(f"id{i}", f"block{i}")
    m.lookup("id0")  # refresh the oldest
    m.put("id3", "block3")
    assert "id1" not in m and all(f"id{i}" in m for i in (0, 2, 3))
    assert m.block_count() == 3  # block1 freed with its last id
    big = "x" * 1000
    m = ToolMemory(max_bytes=2500)
    m.put("p", big + "1")
    m.put("q", big + "2")
    assert len(m) == 2
    m.put("r", big + "3")
    assert "p" not in m and len(m) == 2 and m.bytes <= 2500
    shared = ToolMemory(max_bytes=1300)
    shared.put("s1", big)
    shared.put("s2", big)  # a shared block is accounted once
    assert len(shared) == 2


def test_lookup_message_rules():
    m = ToolMemory()
    m.remember(["c1", "c2"], SAMPLED)
    m.put("other", BLOCK)
    assert m.lookup_message(["c1", "c2"]) == SAMPLED
    assert m.lookup_message(["c1"]) == SAMPLED
    assert m.lookup_message(["c1", "other"]) is None  # ids from different blocks
    assert m.lookup_message(["c1", "nope"]) is None  # any id missing
    assert m.lookup_message([]) is None


def test_render_replays_the_sampled_block_verbatim():
    body = json.loads(
        r"""{"messages":[{"role":"user","content":"List /tmp"},{"role":"assistant","content":"","reasoning_content":"Need ls.","tool_calls":[{"id":"call_abc","type":"function","function":{"name":"bash","arguments":"{\"command\":\"ls /tmp\",\"timeout\":10}"}}]},{"role":"tool","tool_call_id":"call_abc","content":"ok"}]}"""
    )
    canonical = render(parse_chat(body))
    assert BLOCK in canonical
    m = ToolMemory()
    m.remember(["call_abc"], SAMPLED)
    replayed = render(parse_chat(body), tool_memory=m)
    assert SAMPLED in replayed and replayed == canonical.replace(BLOCK, SAMPLED)
    conv = parse_chat(body)
    stats = m.attach(conv)
    assert stats == ReplayStats(mem=1) and conv.messages[1].raw_dsml == SAMPLED
    assert render(conv) == replayed
    off = ToolMemory(enabled=False)
    off.remember(["call_abc"], SAMPLED)
    assert len(off) == 0 and render(parse_chat(body), tool_memory=off) == canonical
    conv = parse_chat(body)
    assert off.attach(conv) == ReplayStats(canonical=1, missing_ids=1) and conv.messages[1].raw_dsml == ""


def test_attach_stats_disk_and_missing():
    m = ToolMemory()
    m.put("t1", SAMPLED, DISK)
    conv = Conversation(
        messages=[
            Message("assistant", tool_calls=[ToolCall("t1", "bash", "{}")]),
            Message("assistant", tool_calls=[ToolCall("t1", "bash", "{}"), ToolCall("t9", "x", "{}")]),
            Message("assistant", content="no calls"),
        ]
    )
    assert m.attach(conv) == ReplayStats(disk=1, canonical=1, missing_ids=1)


def test_generation_to_memory_to_next_prompt_round_trip():
    """A sampled turn's ids map to its exact block; the next request replays it."""
    sampled_text = "Need ls.</think>" + SAMPLED
    p = OutputParser(True, True, id_prefix="toolu_")
    p.feed(sampled_text)
    _, final = p.finish()
    m = ToolMemory()
    m.remember([c.id for c in final.calls], final.raw_dsml)  # as the engine does
    tool_id = final.calls[0].id
    assert m.lookup(tool_id) == SAMPLED
    body = {
        "messages": [
            {"role": "user", "content": "List /tmp"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Need ls."},
                    {"type": "tool_use", "id": tool_id, "name": "bash", "input": final.calls[0].input()},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": "a"}]},
        ],
        "tools": [{"name": "bash", "input_schema": {"type": "object"}}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }  # Anthropic's default is off (#17)
    prompt = render(parse_anthropic(body), tool_memory=m)
    assert "<｜Assistant｜><think>Need ls.</think>" + SAMPLED + "<｜end▁of▁sentence｜>" in prompt


# --- KTM (dsml.md §10) ------------------------------------------------------------------------


def test_ktm_matches_the_captured_example():
    tool_id = "call_b6cd89466f2af871de365d781ab9173c"
    assert len(BLOCK.encode()) == 255 and parse_output("x</think>" + BLOCK, thinking=True).raw_dsml == BLOCK
    m = ToolMemory()
    m.remember([tool_id], BLOCK)
    data = m.trailer_for_text("<｜begin▁of▁sentence｜>...<｜Assistant｜><think>x</think>" + BLOCK)
    assert len(data) == 308
    assert data[:16] == bytes.fromhex("4B544D010100000025000000FF000000")
    assert data[16 : 16 + 37] == tool_id.encode() and data[53:] == BLOCK.encode()
    assert parse_ktm(data) == [(tool_id, BLOCK)]


def test_ktm_selection_only_blocks_in_text_each_once():
    m = ToolMemory()
    m.remember(["a1", "a2"], BLOCK)
    m.remember(["b1"], SAMPLED)
    m.remember(["c1"], "\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>")
    text = "u" + BLOCK + "v" + BLOCK + "w"  # BLOCK twice: written once
    entries = m.trailer_entries(text)
    assert sorted(entries) == [("a1", BLOCK), ("a2", BLOCK)]
    assert m.trailer_for_text("no blocks here") == b""
    assert m.trailer_for_text("") == b""
    # a block stored without its separator is still found
    bare = BLOCK[2:]
    m.remember(["d1"], bare)
    assert ("d1", bare) in m.trailer_entries("x" + bare)
    assert ToolMemory(enabled=False).trailer_for_text(BLOCK) == b""


def test_ktm_reader_limits_and_partial_data():
    entries = [("i1", "b1"), ("i2", "b2"), ("i3", "b3")]
    data = serialize_ktm(entries)
    assert parse_ktm(data) == entries
    assert parse_ktm(data[:-1]) == entries[:2]  # short last entry: keep the ones before
    assert parse_ktm(b"KTM\x02" + data[4:]) == []  # version
    assert parse_ktm(b"XTM" + data[3:]) == []  # magic
    assert parse_ktm(b"KTM\x01" + struct.pack("<I", 9)) == []
    too_many = b"KTM\x01" + struct.pack("<I", 4 * 10 + 1) + data[8:]
    assert parse_ktm(too_many, max_ids=10) == []
    bad_len = b"KTM\x01" + struct.pack("<I", 2) + struct.pack("<II", 300, 1) + b"x" * 301
    assert parse_ktm(bad_len) == []  # id longer than 256 bytes
    zero = b"KTM\x01" + struct.pack("<I", 1) + struct.pack("<II", 1, 0) + b"x"
    assert parse_ktm(zero) == []
    assert serialize_ktm([]) == b""


def test_load_trailer_as_disk_entries_with_wanted_filter():
    data = serialize_ktm([("i1", BLOCK), ("i2", SAMPLED)])
    m = ToolMemory()
    assert m.load_trailer(data, wanted=["i2", "zz"]) == 1
    assert "i1" not in m and m.source("i2") == DISK
    assert m.load_trailer(data) == 2 and m.source("i1") == DISK
    m.remember(["i1"], BLOCK)
    assert m.source("i1") == RAM
    assert ToolMemory(enabled=False).load_trailer(data) == 0
    conv = Conversation(
        messages=[
            Message("assistant", tool_calls=[ToolCall("x1", "f", "{}")]),
            Message("tool", "r", tool_call_ids=["x1", "x2"]),
        ]
    )
    assert ToolMemory.wanted_ids(conv) == ["x1", "x2"]
