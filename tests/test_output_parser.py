"""Streaming projection (dsml.md §7, http-api.md §3), decode states (§5.1), stop sequences."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ds4mlx.chat.families.deepseek_v4.dsml import render_calls
from ds4mlx.chat.families.deepseek_v4.output import OutputParser, new_tool_id
from ds4mlx.chat.messages import ToolCall
from ds4mlx.runtime.detok import StopMatcher
from ds4mlx.runtime.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart

P = "<｜DSML｜parameter"
PC = "</｜DSML｜parameter>"
OPEN = "<｜DSML｜tool_calls>"
CLOSE = "</｜DSML｜tool_calls>"
EX_A = (
    'Need ls.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls /tmp</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="timeout" string="false">10</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>"
)
TOKENS_A = [
    "Need ls.",
    "</think>",
    "\n\n",
    OPEN,
    "\n",
    '<｜DSML｜invoke name="bash">',
    "\n",
    f'{P} name="command" string="true">',
    "ls /tmp",
    PC,
    "\n",
    f'{P} name="timeout" string="false">',
    "10",
    PC,
    "\n",
    "</｜DSML｜invoke>",
    "\n",
    CLOSE,
]


def run(chunks, thinking=True, tools=True, truncated=False, **kw):
    p = OutputParser(thinking, tools, **kw)
    events = []
    for c in chunks:
        events += p.feed(c)
    more, final = p.finish(truncated)
    return p, events + more, final


def summary(events):
    out = {"reasoning": "", "text": "", "calls": {}}
    for e in events:
        if isinstance(e, ReasoningDelta):
            out["reasoning"] += e.text
        elif isinstance(e, TextDelta):
            out["text"] += e.text
        elif isinstance(e, ToolCallStart):
            assert e.index not in out["calls"]
            out["calls"][e.index] = {"name": e.name, "args": "", "end": None, "id": e.id}
        elif isinstance(e, ToolCallDelta):
            assert out["calls"][e.index]["end"] is None
            out["calls"][e.index]["args"] += e.arguments
        elif isinstance(e, ToolCallEnd):
            c = out["calls"][e.index]
            assert c["end"] is None and c["id"] == e.id and c["name"] == e.name
            c["end"] = e.arguments
    return out


def no_ids(s):
    return {**s, "calls": {i: {k: v for k, v in c.items() if k != "id"} for i, c in s["calls"].items()}}


def final_key(r):
    return (
        r.content,
        r.reasoning,
        [(c.name, c.arguments) for c in r.calls],
        r.raw_dsml,
        r.error,
        r.finish,
        r.repaired,
        r.recovered,
    )


# --- the captured ds4 stream (http-api.md §3) ----------------------------------------------------


def test_example_a_token_by_token_fragments():
    p = OutputParser(True, True)
    per_token, stops = [], []
    for t in TOKENS_A:
        per_token.append(p.feed(t))
        stops.append(p.stop_now)
    assert per_token[0] == [ReasoningDelta("N")]  # 7-byte </think> holdback
    assert per_token[1] == [ReasoningDelta("eed ls.")]
    assert stops[-1] and not any(stops[:-1])
    deltas = [e.arguments for evs in per_token for e in evs if isinstance(e, ToolCallDelta)]
    assert deltas == ["{", '"command":"', "ls /tmp", '"', ',"timeout":', "10", "}"]
    starts = [e for evs in per_token for e in evs if isinstance(e, ToolCallStart)]
    assert len(starts) == 1 and starts[0].name == "bash" and re.fullmatch(r"call_[0-9a-f]{32}", starts[0].id)
    more, final = p.finish()
    assert more == [] and final.finish == "tool_calls"
    assert final.calls[0].id == starts[0].id
    assert final.calls[0].arguments == '{"command":"ls /tmp","timeout":10}'
    ends = [e for evs in per_token for e in evs if isinstance(e, ToolCallEnd)]
    assert ends[0].arguments == final.calls[0].arguments


def test_example_a_in_one_piece():
    _, events, final = run([EX_A])
    s = summary(events)
    assert s["reasoning"] == "Need ls." and s["text"] == ""
    assert s["calls"][0]["args"] == '{"command":"ls /tmp","timeout":10}' == s["calls"][0]["end"]
    assert [e.arguments for e in events if isinstance(e, ToolCallDelta)] == [
        "{",
        '"command":"',
        "ls /tmp",
        '"',
        ',"timeout":',
        "10",
        "}",
    ]


def test_structural_flag_follows_decode_states():
    p = OutputParser(True, True)
    flags = []
    for t in TOKENS_A:
        p.feed(t)
        flags.append((t, p.structural))
    d = dict((i, f) for i, (_, f) in enumerate(flags))
    assert d[0] is False and d[2] is False  # reasoning / separator: request sampling
    assert d[3] is True and d[5] is True  # after OPEN / invoke tag: greedy
    assert d[7] is False and d[8] is False  # string parameter body: request sampling
    assert d[9] is True  # after its close: structure
    assert d[11] is True and d[12] is True  # non-string value outside JSON strings
    assert d[len(TOKENS_A) - 1] is False  # after CLOSE
    q = OutputParser(True, False)
    for t in TOKENS_A:
        q.feed(t)
        assert q.structural is False and q.stop_now is False  # no active tools: nothing tracked
    q = OutputParser(False, True)
    q.feed(OPEN + '<｜DSML｜invoke name="f">' + P + ' name="j" string="false">{"a": "x')
    assert q.structural is False and q.decode_state == "json_string"
    q.feed('"')
    assert q.structural is True
    q.feed("</")
    assert q.structural is True


def test_think_close_split_across_feeds():
    p = OutputParser(True, True)
    ev = p.feed("I think </thi")
    assert summary(ev)["reasoning"] == "I thin"  # all but the last 7 characters
    ev += p.feed("nk>Answer")
    s = summary(ev + p.finish()[0])
    assert s["reasoning"] == "I think " and s["text"] == "Answer" and "</thi" not in s["text"]
    assert p.result.reasoning == "I think " and p.result.content == "Answer"


def test_leading_think_tag_is_skipped():
    for chunks in (["<think>abc</think>x"], ["<thi", "nk>abc", "</think>", "x"]):
        _, events, final = run(chunks)
        s = summary(events)
        assert s["reasoning"] == "abc" and s["text"] == "x" and final.reasoning == "abc"


def test_text_phase_holdback_with_tools():
    p = OutputParser(False, True)
    assert summary(p.feed("Hello  \n\n"))["text"] == "Hello"  # trailing whitespace may be the separator
    assert summary(p.feed("<"))["text"] == ""  # a possible OPEN
    assert summary(p.feed("b>bold"))["text"] == "  \n\n<b>bold"  # not a tag: released
    assert summary(p.feed("\n\n<｜DSML｜tool_"))["text"] == ""
    ev = p.feed("calls>\n" + '<｜DSML｜invoke name="x">\n</｜DSML｜invoke>\n' + CLOSE)
    assert summary(ev)["text"] == "" and p.stop_now
    _, final = p.finish()
    assert final.content == "Hello  \n\n<b>bold" and final.calls[0].name == "x"


def test_no_tools_streams_everything_and_never_stops():
    text = "r</think>Sure." + "\n\n" + OPEN + '<｜DSML｜invoke name="x"></｜DSML｜invoke>' + CLOSE + " more"
    p, events, final = run([text[:10], text[10:]], tools=False)
    s = summary(events)
    assert s["reasoning"] == "r" and s["text"] == text[len("r</think>") :] and not s["calls"]
    assert final.calls == [] and final.content == s["text"] and not p.stop_now


def test_literal_tags_inside_parameter_values():
    value = f'{CLOSE} </｜DSML｜invoke> </think> <think> &lt;/｜DSML｜parameter> a&amp;b "q"\n'
    text = (
        "</think>\n\n"
        + OPEN
        + '\n<｜DSML｜invoke name="write">\n'
        + P
        + ' name="content" string="true">'
        + value
        + PC
        + "\n</｜DSML｜invoke>\n"
        + CLOSE
    )
    for chunks in ([text], list(text)):
        p = OutputParser(True, True)
        events = []
        stops = []
        for c in chunks:
            events += p.feed(c)
            stops.append(p.stop_now)
        assert stops[-1] and not any(stops[:-1])  # only the real CLOSE stops
        more, final = p.finish()
        s = summary(events + more)
        expected = {"content": f'{CLOSE} </｜DSML｜invoke> </think> <think> {PC} a&b "q"\n'}
        assert json.loads(s["calls"][0]["args"]) == expected == final.calls[0].input()


def test_entity_and_close_holdback_in_string_values():
    p = OutputParser(False, True)
    ev = p.feed(OPEN + '<｜DSML｜invoke name="f">' + P + ' name="s" string="true">x &am')
    assert [e.arguments for e in ev if isinstance(e, ToolCallDelta)] == ["{", '"s":"', "x "]
    ev = p.feed("p; </｜DSML｜para")  # entity completed, partial close held
    assert [e.arguments for e in ev if isinstance(e, ToolCallDelta)] == ["& "]
    ev = p.feed("meter>")
    assert [e.arguments for e in ev if isinstance(e, ToolCallDelta)] == ['"']
    ev = p.feed(P + ' name="t" string="true">a</｜DSML｜paramX')  # not the close after all
    assert [e.arguments for e in ev if isinstance(e, ToolCallDelta)] == [',"t":"', "a</｜DSML｜paramX"]


def test_loose_nested_parameters_stream_whole_and_agree_with_the_end():
    text = (
        '</think>review done\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="edit">\n'
        '<｜DSML｜parameter name="path">/tmp/t.c</｜DSML｜parameter>\n<｜DSML｜parameter name="edits">\n'
        '<｜DSML｜parameter name="oldText" string="true">old &lt;text&gt;</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="newText" string="true">new text</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>"
    )
    p, events, final = run(list(text))
    assert p.stop_now
    s = summary(events)
    assert s["text"] == "review done"
    args = '{"path":"/tmp/t.c","edits":{"oldText":"old <text>","newText":"new text"}}'
    assert s["calls"][0]["args"] == args == s["calls"][0]["end"] == final.calls[0].arguments


def test_malformed_block_is_never_answer_text():
    """A closed block that does not parse: its markup is dropped (the engine logs why),
    streamed and final alike."""
    text = "Hmm.</think>Trying.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    for chunks in ([text], list(text)):
        p, events, final = run(chunks)
        s = summary(events)
        assert final.error == "invalid tool call" and final.finish == "stop" and not final.calls
        assert s["reasoning"] == "Hmm." == final.reasoning and not s["calls"]
        assert s["text"] == "Trying." == final.content  # streamed and final agree, no markup


def test_prose_tag_is_streamed_as_text():
    text = "Use <tool_calls> like this, then " + "\n\n" + OPEN + '<｜DSML｜invoke name="f"></｜DSML｜invoke>' + CLOSE
    p, events, final = run(list(text), thinking=False)
    s = summary(events)
    assert s["text"] == "Use <tool_calls> like this, then" == final.content
    assert s["calls"][0]["name"] == "f" == final.calls[0].name and p.stop_now


@pytest.mark.parametrize("chunked", [False, True])
def test_block_cut_inside_a_call_returns_no_call(chunked):
    """The token limit or EOS inside a call (announced or not): no call is returned, the
    stream's partial call is never closed into valid JSON and no markup is text."""
    text = (
        'Hmm.</think>Go.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
        + P
        + ' name="command" string="true">ls'
    )
    for truncated in (True, False):
        p, events, final = run(list(text) if chunked else [text], truncated=truncated)
        s = summary(events)
        assert not final.calls and not final.repaired and s["text"] == "Go." == final.content
        assert final.error == ("tool call cut by the token limit" if truncated else "unterminated tool call")
        assert final.finish == ("length" if truncated else "stop") and s["reasoning"] == "Hmm." == final.reasoning
        if s["calls"]:  # announced while streaming: what was sent stays open (not executable JSON)
            assert s["calls"][0]["args"] == '{"command":"ls' and s["calls"][0]["end"] is None
    # EOS before the call is certain (name only): nothing was announced, and ds4 never
    # streams DSML markup: the block is in neither the stream nor the answer (a failed turn)
    head = 'Hmm.</think>Listing.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    p, events, final = run([head], truncated=False)
    s = summary(events)
    assert not s["calls"] and not final.calls and s["text"] == "Listing." == final.content
    assert final.error == "unterminated tool call" and s["reasoning"] == "Hmm." == final.reasoning


@pytest.mark.parametrize("truncated", [False, True])
def test_block_cut_before_any_announcement_is_never_visible_text(truncated):
    """EOS or max_tokens inside the invoke tag or the OPEN marker: the text before the
    block is the whole answer, streamed token by token and in one piece alike."""
    for text in (
        "Hmm.</think>Listing.\n\n" + OPEN + '\n<｜DSML｜invoke name="ba',
        "Hmm.</think>Listing.\n\n" + OPEN[:5],
    ):
        for chunks in ([text], list(text)):
            p, events, final = run(chunks, truncated=truncated)
            s = summary(events)
            assert not s["calls"] and not final.calls
            if not truncated and not text.endswith(OPEN[:5]):
                assert final.error == "unterminated tool call"
            if truncated or not text.endswith(OPEN[:5]):  # EOS in the OPEN: flushed as text, as ds4
                assert s["text"] == "Listing." == final.content and "DSML" not in s["text"]


def test_think_recovery_streaming():
    text = (
        "I should list.\n\n"
        + OPEN
        + '\n<｜DSML｜invoke name="bash">\n'
        + P
        + ' name="command" string="true">ls</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        + CLOSE
    )
    p = OutputParser(True, True)
    events = []
    for ch in text:
        events += p.feed(ch)
    assert not p.stop_now  # ds4 recovers only when the generation ends without </think>
    assert summary(events)["reasoning"] == "I should list."  # the block is held, not streamed as reasoning
    more, final = p.finish()
    s = summary(events + more)
    assert s["reasoning"] == "I should list." == final.reasoning and final.recovered
    assert s["calls"][0]["end"] == '{"command":"ls"}' == final.calls[0].arguments
    assert s["calls"][0]["id"] == final.calls[0].id
    # without recovery the DSML stays reasoning (ds4) and generation goes on
    p, events, final = run([text + " hmm</think>Done."], think_recovery=False)
    s = summary(events)
    assert not p.stop_now and not s["calls"] and s["text"] == "Done." and final.calls == []
    assert s["reasoning"] == text + " hmm" == final.reasoning


def test_unclosed_reasoning_flushes_as_reasoning():
    p, events, final = run(["still thinking <b>", " and more"], truncated=True)
    s = summary(events)
    assert s["reasoning"] == "still thinking <b> and more" == final.reasoning
    assert final.content == "" and final.finish == "length"  # streamed and final agree


def test_ids_prefix_and_uniqueness_against_memory():
    class Mem:
        def __init__(self):
            self.calls = 0

        def has(self, tool_id):
            self.calls += 1
            return self.calls <= 3  # the first three candidates are "taken"

    mem = Mem()
    text = (
        "</think>"
        + OPEN
        + '<｜DSML｜invoke name="a"></｜DSML｜invoke><｜DSML｜invoke name="b"></｜DSML｜invoke>'
        + CLOSE
    )
    p, events, final = run([text], id_prefix="toolu_", tool_memory=mem)
    ids = [c.id for c in final.calls]
    assert len(set(ids)) == 2 and all(re.fullmatch(r"toolu_[0-9a-f]{32}", i) for i in ids)
    assert mem.calls >= 5
    assert re.fullmatch(r"call_[0-9a-f]{32}", new_tool_id())


def test_bytes_input_with_split_utf8():
    data = "é😀</think>ok".encode()
    p = OutputParser(True, False)
    events = []
    for i in range(len(data)):
        events += p.feed(data[i : i + 1])
    events += p.finish()[0]
    s = summary(events)
    assert s["reasoning"] == "é😀" and s["text"] == "ok"
    p = OutputParser(False, False)
    assert summary(p.feed(b"a\xc3") + p.finish()[0])["text"] == "a\ufffd"


def test_feed_after_finish_is_an_error():
    p = OutputParser(False, False)
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed("x")


# --- stop sequences -------------------------------------------------------------------------------


def test_stop_matcher():
    """The engine's matcher (detok.StopMatcher): only a tail that could start a stop is held."""
    m = StopMatcher(["END", "\n\n"])
    assert m.push("abcE") == "abc" and m.hit is None  # "E" may start END: held
    assert m.push("N") == ""
    assert m.push("Dzzz") == "" and m.hit == "END"
    assert m.push("more") == "" and m.hit == "END"  # nothing after a hit
    m = StopMatcher(["END"])
    out = []
    for ch in "hello ENxEND tail":
        out.append(m.push(ch))
        if m.hit:
            break
    assert "".join(out) == "hello ENx" and m.hit == "END"
    m = StopMatcher(["xyz"])
    assert m.push("abxy") == "ab" and m.flush() == "xy"
    m = StopMatcher([])
    assert m.push("abc") == "abc" and not m.active
    m = StopMatcher(["b", "abc"])
    assert m.push("zabc") == "z" and m.hit == "abc"  # earliest match wins


# --- property tests: chunking never changes the result ---------------------------------------------

SCRIPTS = [
    (EX_A, {}),
    ("plain answer with <b>tags</b> & stuff\n\n", {"thinking": False}),
    (
        "r</think>Sure.\n\n  "
        + OPEN
        + '<｜DSML｜invoke name="f">'
        + P
        + ' name="a" string="true">x&amp;y'
        + PC
        + P
        + ' name="b" string="false">{"k": ["v </｜DSML｜parameter", 1]}'
        + PC
        + "</｜DSML｜invoke>"
        + CLOSE,
        {},
    ),
    (
        "maybe " + OPEN + '<｜DSML｜invoke name="x"></｜DSML｜invoke>' + CLOSE + " no.</think>Final.",
        {"think_recovery": False},
    ),
    ("maybe " + OPEN + '<｜DSML｜invoke name="x"></｜DSML｜invoke>' + CLOSE + " no.</think>Final.", {}),
    ("Hmm.</think>Trying.\n\n" + OPEN + "\n<｜DSML｜invoke>\n" + CLOSE, {}),
    (
        "Hmm.</think>\n\n" + OPEN + '\n<｜DSML｜invoke name="bash">\n' + P + ' name="command" string="true">ls &a',
        {"truncated": True},
    ),
    (
        'a </thi b </think> c <tool_calls> d\n\n<DSML｜tool_calls><DSML｜invoke name="s">'
        '<DSML｜parameter name="k" string="true">v</DSML｜parameter></DSML｜invoke></DSML｜tool_calls>',
        {},
    ),
    ("x " + OPEN + " not dsml " + OPEN + '<｜DSML｜invoke name="q"></｜DSML｜invoke>' + CLOSE, {}),
    (
        "<think>"
        + OPEN
        + '<｜DSML｜invoke name="n">'
        + P
        + ' name="e">'
        + P
        + ' name="a" string="true">1'
        + PC
        + "</｜DSML｜invoke>"
        + CLOSE,
        {},
    ),
    ("no tools here</think>but " + OPEN + " text", {"tools": False}),
]


@st.composite
def splits(draw, text):
    cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=12))))
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), which=st.integers(0, len(SCRIPTS) - 1))
def test_chunking_invariance_scripts(data, which):
    text, kw = SCRIPTS[which]
    kw = dict(kw)
    truncated = kw.pop("truncated", False)
    _, ev1, f1 = run([text], truncated=truncated, **kw)
    chunks = data.draw(splits(text))
    _, ev2, f2 = run(chunks, truncated=truncated, **kw)
    assert no_ids(summary(ev1)) == no_ids(summary(ev2))
    assert final_key(f1) == final_key(f2)
    _, ev3, f3 = run(list(text), truncated=truncated, **kw)
    assert no_ids(summary(ev3)) == no_ids(summary(ev1)) and final_key(f3) == final_key(f1)


_alphabet = st.sampled_from(
    list("ab <>&;\"'\\/\n{}[]:,") + [PC, "</｜DSML｜invoke>", CLOSE, "</think>", "<think>", "&lt;", "é", "😀"]
)
_text = st.lists(_alphabet, max_size=10).map("".join) | st.text(max_size=8)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-999, 10**12) | st.floats(allow_nan=False, allow_infinity=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)
_ENT = ("&amp;", "&lt;", "&gt;", "&quot;", "&apos;")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    reasoning=_text,
    content=_text,
    calls=st.lists(st.tuples(_text, st.dictionaries(_text, _json, max_size=3)), min_size=1, max_size=2),
)
def test_streamed_tool_calls_agree_with_final_parse(data, reasoning, content, calls):
    for _, args in calls:
        assume(not any(e in v for v in args.values() if isinstance(v, str) for e in _ENT))
    reasoning = reasoning.replace("</think>", "").replace("<think>", "")
    assume("<" not in reasoning and "<" not in content)
    tcs = [ToolCall("", n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    text = reasoning + "</think>" + content + render_calls(tcs)
    p, events, final = run(data.draw(splits(text)))
    assert p.stop_now
    s = summary(events)
    assert final.error is None
    assert [(c.name, json.loads(c.arguments)) for c in final.calls] == [(n, a) for n, a in calls]
    assert s["reasoning"] == final.reasoning == reasoning
    assert s["text"] == final.content
    for i, c in enumerate(final.calls):
        assert s["calls"][i]["end"] == c.arguments and s["calls"][i]["id"] == c.id
        assert json.loads(s["calls"][i]["args"]) == json.loads(c.arguments)  # raw JSON values may keep spaces
