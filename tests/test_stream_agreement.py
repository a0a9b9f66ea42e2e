"""Streaming never lies (#17): for every family, random tool-call fragments,
truncations and token splits fed through the streaming parser give exactly the
answer of its final parse: the same reasoning, text and calls (every announced
call is in the final answer with the arguments its deltas spell), and the
answer does not depend on how the text was split into tokens (a non-streamed
request runs the same parser over the same tokens).  A call the output broke off
inside (EOS, the token limit) is left open in the stream and is not in the answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from ds4mlx.chat.messages import ToolCall
from ds4mlx.chat.protocol import families, get_protocol
from ds4mlx.runtime.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart

FAMILIES = families()


def streamed(events):
    """reasoning, text and calls of an event stream; asserts its own consistency."""
    out = {"reasoning": "", "text": "", "calls": []}
    for e in events:
        if isinstance(e, ReasoningDelta):
            out["reasoning"] += e.text
        elif isinstance(e, TextDelta):
            out["text"] += e.text
        elif isinstance(e, ToolCallStart):
            assert e.index == len(out["calls"])
            out["calls"].append({"id": e.id, "name": e.name, "args": "", "end": None})
        elif isinstance(e, ToolCallDelta):
            call = out["calls"][e.index]
            assert call["end"] is None, "delta after the call ended"
            call["args"] += e.arguments
        elif isinstance(e, ToolCallEnd):
            call = out["calls"][e.index]
            assert call["end"] is None and call["id"] == e.id and call["name"] == e.name
            call["end"] = e.arguments
    return out


def run(proto, chunks, thinking, truncated):
    p = proto.make_parser(thinking, True)
    events = []
    for c in chunks:
        events += p.feed(c)
        if p.stop_now:  # the engine stops sampling here
            break
    more, final = p.finish(truncated)
    return events + more, final


def ended(s) -> list:
    """The streamed calls that ended (a call left open was cut and is in no answer)."""
    return [(c["name"], c["args"]) for c in s["calls"] if c["end"] is not None]


def answer(final):
    return (final.content, final.reasoning or "", [(c.name, c.arguments) for c in final.calls])


_words = st.sampled_from(["ok", "ls", " ", "\n", "\n\n", "a&b", "<", ">", '"q"', "é", "{", "}", "&lt;"])
_args = st.dictionaries(
    st.sampled_from(["command", "path", "n", "opts"]),
    st.one_of(
        st.text(st.sampled_from('ab <>&/"\n'), max_size=6),
        st.integers(-5, 99),
        st.booleans(),
        st.lists(st.integers(0, 9), max_size=2),
        st.dictionaries(st.sampled_from(["k", "v"]), st.integers(0, 9), max_size=2),
    ),
    max_size=3,
)


@st.composite
def generation(draw, proto):
    """A plausible and often broken generation of `proto`'s family."""
    calls = draw(st.lists(st.tuples(st.sampled_from(["bash", "read", "x y"]), _args), min_size=1, max_size=2))
    block = proto.render_calls([ToolCall("", n, json.dumps(a)) for n, a in calls])
    pieces = {
        "words": "".join(draw(st.lists(_words, max_size=4))),
        "close": proto.think_close,
        "open": proto.think_open,
        "block": block,
        "cut": block[: draw(st.integers(0, len(block)))],
    }
    mutated = list(block)
    for _ in range(draw(st.integers(0, 2))):
        if mutated:
            i = draw(st.integers(0, len(mutated) - 1))
            op = draw(st.sampled_from(["del", "dup", "junk"]))
            if op == "del":
                del mutated[i]
            elif op == "dup":
                mutated.insert(i, mutated[i])
            else:
                mutated.insert(i, draw(st.sampled_from(["x", "<", ">", '"', "\n"])))
    pieces["mutated"] = "".join(mutated)
    kinds = draw(st.lists(st.sampled_from(sorted(pieces)), min_size=1, max_size=6))
    text = "".join(pieces[k] if k != "words" else "".join(draw(st.lists(_words, max_size=4))) for k in kinds)
    cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=10))))
    bounds = [0] + cuts + [len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), thinking=st.booleans(), truncated=st.booleans())
def test_streamed_answer_equals_final_answer(family, data, thinking, truncated):
    proto = get_protocol(family)
    text, chunks = data.draw(generation(proto))
    note(repr((text, chunks)))
    events, final = run(proto, chunks, thinking, truncated)
    s = streamed(events)
    assert s["reasoning"] == (final.reasoning or "")
    assert s["text"] == final.content
    assert ended(s) == [(c.name, c.arguments) for c in final.calls]
    assert all(c["end"] is not None for c in s["calls"]) or final.error is not None
    for c, f in zip(s["calls"], final.calls):
        assert c["end"] == c["args"] and c["id"] == f.id
        assert isinstance(json.loads(c["args"]), dict)
    # one piece or token by token: the same answer (a non-streamed request runs the same parser)
    _, whole = run(proto, [text], thinking, truncated)
    _, per_char = run(proto, list(text), thinking, truncated)
    assert answer(whole) == answer(final) == answer(per_char)


@pytest.mark.parametrize("family", FAMILIES)
def test_call_quoted_inside_reasoning_is_not_executed(family):
    """ds4's test_thinking_dsml_is_not_executable_before_think_close."""
    proto = get_protocol(family)
    block = proto.render_calls([ToolCall("", "bash", '{"command":"true"}')])
    text = "Maybe " + block + " no, not yet." + proto.think_close + "Final answer."
    for chunks in ([text], list(text)):
        events, final = run(proto, chunks, True, False)
        s = streamed(events)
        assert not s["calls"] and not final.calls
        assert s["text"] == final.content == "Final answer."
        assert s["reasoning"] == final.reasoning


@pytest.mark.parametrize("family", FAMILIES)
def test_unparseable_call_is_never_announced(family):
    """Claude Code's case: the call head is there, then the block breaks."""
    proto = get_protocol(family)
    block = proto.render_calls([ToolCall("", "read", '{"path":"/tmp/a"}')])
    broken = block[: len(block) // 3] + "@@ garbage @@" + proto.think_close
    events, final = run(proto, list(proto.think_close + broken), True, False)
    s = streamed(events)
    assert [(c["name"], c["args"]) for c in s["calls"]] == [(c.name, c.arguments) for c in final.calls]
    assert all(json.loads(c["args"]) is not None for c in s["calls"])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("truncated", [False, True])
def test_block_cut_before_its_close_never_shows_its_markup(family, truncated):
    """ds4 never streams DSML markup: a block cut by EOS (or max_tokens) stays out of
    the visible text of the stream and of the final answer alike, wherever the cut
    falls after its open tag; a call the cut fell in is left open and is in no answer."""
    proto = get_protocol(family)
    block = proto.render_calls([ToolCall("", "bash", '{"command":"ls -l"}')])
    opened = block.index(">", block.index("<")) + 1  # the block's open tag is whole
    for cut in range(opened, len(block.rstrip())):  # short of the last byte of the block CLOSE
        text = "Sure." + proto.think_close + "Listing.\n\n" + block[:cut]
        for chunks in ([text], list(text)):
            events, final = run(proto, chunks, True, truncated)
            s = streamed(events)
            assert s["text"] == final.content == "Listing.", (cut, s["text"], final.content)
            # a call whose invoke closed is complete; the one the cut fell in is left open
            assert ended(s) == [(c.name, c.arguments) for c in final.calls]
            assert all(c["end"] is not None for c in s["calls"]) or final.error is not None
