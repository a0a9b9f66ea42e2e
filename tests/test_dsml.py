"""DSML: canonical rendering, escaping, the final parser and repair (dsml.md, chat-template.md §6/§7)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ds4mlx.chat import markers as M
from ds4mlx.chat.families.deepseek_v4.dsml import (
    DecodeTracker,
    attr_escape,
    call_input,
    decode_entities,
    dumps_compact,
    escape_tool_result,
    json_escape,
    json_literal,
    minify_json,
    param_text,
    parse_flat_object,
    parse_output,
    render_calls,
    repair_block,
    scan_block,
)
from ds4mlx.chat.messages import ToolCall

P = "<｜DSML｜parameter"
PC = "</｜DSML｜parameter>"
OPEN = "<｜DSML｜tool_calls>"
CLOSE = "</｜DSML｜tool_calls>"


def block(*invokes: str, sep: str = "\n\n") -> str:
    return sep + OPEN + "\n" + "".join(invokes) + CLOSE


def invoke(name: str, *params: str) -> str:
    return f'<｜DSML｜invoke name="{name}">\n' + "".join(p + "\n" for p in params) + "</｜DSML｜invoke>\n"


def sparam(k: str, v: str) -> str:
    return f'{P} name="{k}" string="true">{v}{PC}'


def jparam(k: str, v: str) -> str:
    return f'{P} name="{k}" string="false">{v}{PC}'


EX_A = "Need ls.</think>Sure." + block(invoke("bash", sparam("command", "ls /tmp"), jparam("timeout", "10")))


# --- dsml.md §4 worked examples ---------------------------------------------------------------


def test_example_A_text_and_call():
    r = parse_output(EX_A, thinking=True)
    assert (r.content, r.reasoning, r.finish, r.error) == ("Sure.", "Need ls.", "tool_calls", None)
    assert [(c.name, c.arguments) for c in r.calls] == [("bash", '{"command":"ls /tmp","timeout":10}')]
    assert r.raw_dsml == EX_A[len("Need ls.</think>Sure.") :]
    assert r.calls[0].input() == {"command": "ls /tmp", "timeout": 10}


def test_example_B_loose_nested_and_entities():
    text = (
        '</think>review done\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="edit">\n'
        '<｜DSML｜parameter name="path">/tmp/t.c</｜DSML｜parameter>\n<｜DSML｜parameter name="edits">\n'
        '<｜DSML｜parameter name="oldText" string="true">old &lt;text&gt;</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="newText" string="true">new text</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>"
    )
    r = parse_output(text, thinking=True)
    assert r.content == "review done" and r.reasoning == ""
    assert r.calls[0].arguments == '{"path":"/tmp/t.c","edits":{"oldText":"old <text>","newText":"new text"}}'


def test_example_C_short_spelling():
    text = (
        'need a tool</think><DSML｜tool_calls>\n<DSML｜invoke name="bash">\n'
        '<DSML｜parameter name="command" string="true">ls -la</DSML｜parameter>\n</DSML｜invoke>\n'
        "</DSML｜tool_calls>"
    )
    r = parse_output(text, thinking=True)
    assert (r.reasoning, r.content, r.calls[0].arguments) == ("need a tool", "", '{"command":"ls -la"}')


def test_example_D_dsml_inside_reasoning_is_not_executed():
    inner = block(invoke("bash", sparam("command", "rm -rf /")), sep="")
    text = f"maybe {inner} no.</think>Final answer."
    r = parse_output(text, thinking=True)
    assert r.calls == [] and r.finish == "stop"
    assert r.reasoning == f"maybe {inner} no." and r.content == "Final answer."


def test_example_E_two_invokes_entities_json():
    text = "</think>" + block(
        invoke("read", sparam("path", "a.c")),
        invoke("bash", sparam("command", "wc -l a.c &amp;&amp; echo &quot;ok&quot;"), jparam("opts", '{"n": [1, 2]}')),
    )
    r = parse_output(text, thinking=True)
    assert [c.input() for c in r.calls] == [
        {"path": "a.c"},
        {"command": 'wc -l a.c && echo "ok"', "opts": {"n": [1, 2]}},
    ]
    assert r.calls[1].arguments == '{"command":"wc -l a.c && echo \\"ok\\"","opts":{"n":[1,2]}}'


def test_example_F_invalid_json_value_gives_empty_object():
    r = parse_output("</think>" + block(invoke("f", jparam("a", "hello world"))), thinking=True)
    assert r.finish == "tool_calls" and r.calls[0].arguments == "{}"


def test_example_G_malformed_is_plain_text():
    text = "Hmm.</think>Trying.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    r = parse_output(text, thinking=True)
    assert (r.content, r.reasoning, r.calls, r.finish, r.error) == (text, None, [], "stop", "invalid tool call")


def test_example_H_unterminated():
    text = (
        'Hmm.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n' + P + ' name="command" string="true">ls'
    )
    r = parse_output(text, thinking=True)
    # ds4 answers finish "error"; we return the raw text with finish stop (length when truncated, see repair)
    assert (r.content, r.reasoning, r.calls, r.finish, r.error) == (text, None, [], "stop", "unterminated tool call")


# --- grammar details ------------------------------------------------------------------------


def test_search_order_prefers_separator_then_spelling():
    good = block(invoke("good"))
    bare_first = "</think>x" + block(invoke("bare"), sep="") + " y" + good
    r = parse_output(bare_first, thinking=True)
    assert [c.name for c in r.calls] == ["good"]  # "\n\n"+OPEN wins over an earlier bare OPEN
    short = '\n\n<DSML｜tool_calls>\n<DSML｜invoke name="short">\n</DSML｜invoke>\n</DSML｜tool_calls>'
    r = parse_output("</think>" + short + " later" + block(invoke("full"), sep=""), thinking=True)
    assert [c.name for c in r.calls] == ["full"]  # the full spelling wins wherever it is
    plain = '<tool_calls>\n<invoke name="p">\n<parameter name="k" string="true">v</parameter>\n</invoke>\n</tool_calls>'
    r = parse_output("</think>" + plain, thinking=True)
    assert [(c.name, c.arguments) for c in r.calls] == [("p", '{"k":"v"}')]


def test_prose_mention_of_a_tag_is_skipped():
    text = "</think>Use <tool_calls> to call tools." + block(invoke("real"))
    r = parse_output(text, thinking=True)
    assert [c.name for c in r.calls] == ["real"] and r.content == "Use <tool_calls> to call tools."
    text = "</think>Write " + OPEN + " then stop." + block(invoke("real2"))
    assert [c.name for c in parse_output(text, thinking=True).calls] == ["real2"]


def test_zero_invokes_and_text_after_close():
    r = parse_output("</think>hi\n\n" + OPEN + "\n" + CLOSE + " trailing", thinking=True)
    assert r.calls == [] and r.content == "hi" and r.error is None and r.finish == "stop"
    r = parse_output("</think>" + block(invoke("a")) + "ignored text", thinking=True)
    assert r.calls[0].name == "a" and r.calls[0].arguments == "{}"


def test_params_missing_string_duplicates_and_types():
    inv = (
        '<｜DSML｜invoke name="f">'
        f'{P} name="a">x &amp; y{PC}'  # missing string attribute -> string
        f'{P} name="a" string="true">dup{PC}'
        f'{P} name="b" string="False">[1, 2]{PC}'  # anything but "true" -> JSON
        f'{P} name="c" string="no">{PC}'  # empty JSON -> null
        f'{P} name="d" string="false"> {{"k" : "v w"}} {PC}'
        "</｜DSML｜invoke>"
    )
    r = parse_output("</think>" + OPEN + inv + CLOSE, thinking=True)
    assert r.calls[0].arguments == '{"a":"x & y","a":"dup","b":[1,2],"c":null,"d":{"k":"v w"}}'


def test_attributes_entity_decoded_and_prefix_matched():
    inv = f'<｜DSML｜invokeX name="a&amp;b &quot;q&quot;">{P} name="k&lt;1&gt;" string="true">v{PC}</｜DSML｜invoke>'
    r = parse_output(OPEN + inv + CLOSE, thinking=False)
    assert r.calls[0].name == 'a&b "q"' and r.calls[0].input() == {"k<1>": "v"}


def test_missing_names_fail():
    for inv in (
        "<｜DSML｜invoke>" + sparam("a", "b") + "</｜DSML｜invoke>",
        f'<｜DSML｜invoke name="f">{P} string="true">v{PC}</｜DSML｜invoke>',
        '<｜DSML｜invoke name="f">stray text</｜DSML｜invoke>',
    ):
        text = "</think>" + OPEN + inv + CLOSE
        r = parse_output(text, thinking=True)
        assert r.calls == [] and r.content == text and r.error == "invalid tool call"


def test_literal_tags_inside_values():
    value = f"{CLOSE} </｜DSML｜invoke> </think> <think> {OPEN} &lt;{PC[1:]}"
    text = "r</think>" + block(invoke("w", sparam("content", value)))
    r = parse_output(text, thinking=True)
    assert r.calls[0].input() == {"content": f"{CLOSE} </｜DSML｜invoke> </think> <think> {OPEN} {PC}"}
    assert r.reasoning == "r"


def test_think_close_inside_parameter_while_reasoning_is_open():
    # a literal </think> inside a DSML value in the reasoning does not end the reasoning
    inner = block(invoke("x", sparam("v", "a</think>b")), sep="")
    text = f"plan {inner} more</think>answer"
    r = parse_output(text, thinking=True, think_recovery=False)
    assert r.reasoning == f"plan {inner} more" and r.content == "answer"


def test_no_think_close_means_no_calls_and_whole_content():
    text = "just thinking " + block(invoke("x"))[:-5]
    r = parse_output(text, thinking=True)
    assert (r.content, r.reasoning, r.calls) == (text, None, [])
    r = parse_output("<think>abc", thinking=True)
    assert (r.content, r.reasoning) == ("<think>abc", None)
    r = parse_output("<think>abc</think>\n\nHi", thinking=True)
    assert (r.content, r.reasoning) == ("\n\nHi", "abc")  # content is not left-trimmed


def test_non_thinking_and_inactive_tools():
    r = parse_output("Sure." + block(invoke("a")), thinking=False)
    assert r.content == "Sure." and r.reasoning is None and r.calls[0].name == "a"
    # without active tools nothing is parsed (ds4 parses anyway; deliberate difference)
    text = "r</think>Sure." + block(invoke("a"))
    r = parse_output(text, thinking=True, tools_active=False)
    assert r.calls == [] and r.reasoning == "r" and r.content == "Sure." + block(invoke("a"))
    r = parse_output("a</think>b", thinking=False, tools_active=False)
    assert r.content == "a</think>b" and r.reasoning is None


# --- repair (truncated by max tokens) -------------------------------------------------------


@pytest.mark.parametrize(
    "tail,args",
    [
        (sparam("command", "ls")[: -len(PC)], '{"command":"ls"}'),  # inside a string value
        (sparam("command", "ls")[:-6], '{"command":"ls"}'),  # partial close tag
        (sparam("command", "ls") + "\n", '{"command":"ls"}'),  # between params
        (sparam("command", "ls") + "\n" + P + ' name="x" str', '{"command":"ls"}'),  # incomplete param tag
        (jparam("o", '{"a": [1, {"b": "x\\"y')[: -len(PC)], '{"o":{"a":[1,{"b":"x\\"y"}]}}'),  # JSON value
        (jparam("o", '{"a": 1,')[: -len(PC)], '{"o":{"a":1}}'),
        (jparam("o", '{"a":')[: -len(PC)], '{"o":{"a":null}}'),
        (
            f'{P} name="edits">\n{P} name="old" string="true">x{PC}\n{P} name="new" string="true">y',
            '{"edits":{"old":"x","new":"y"}}',
        ),  # loose nested
    ],
)
def test_truncated_block_is_repaired(tail, args):
    text = 'why</think>ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n' + tail
    r = parse_output(text, thinking=True, truncated=True)
    assert r.repaired and r.finish == "tool_calls" and r.error is None
    assert (r.content, r.reasoning) == ("ok", "why")
    assert [(c.name, c.arguments) for c in r.calls] == [("bash", args)]
    assert r.raw_dsml.startswith("\n\n" + OPEN) and r.raw_dsml.endswith(CLOSE)
    # the repaired block parses back to the same call
    again = parse_output("</think>" + r.raw_dsml, thinking=True)
    assert again.calls[0].arguments == args and not again.repaired


def test_truncated_repair_edges():
    # truncated inside the invoke tag: the partial invoke is dropped, earlier calls survive
    text = "</think>" + OPEN + "\n" + invoke("a", sparam("k", "v")) + '<｜DSML｜invoke name="b'
    r = parse_output(text, thinking=True, truncated=True)
    assert [c.name for c in r.calls] == ["a"] and r.repaired
    # only the open tag: zero calls, the prefix is the content, finish length
    r = parse_output("</think>hello\n\n" + OPEN + "\n<｜DS", thinking=True, truncated=True)
    assert r.calls == [] and r.content == "hello" and r.finish == "length"
    # garbage cannot be repaired: plain text with finish length
    text = "</think>" + OPEN + "\nnot dsml at all"
    r = parse_output(text, thinking=True, truncated=True)
    assert r.calls == [] and r.content == text and r.finish == "length" and r.error
    assert repair_block(OPEN + "\n" + invoke("a") + CLOSE, M.DSML_FULL) is None


# --- think recovery (our extension) -----------------------------------------------------------


def test_complete_block_inside_unclosed_think_is_recovered():
    text = "<think>I should list files.\n\n" + block(invoke("bash", sparam("command", "ls")), sep="")
    r = parse_output(text, thinking=True)
    assert r.recovered and r.finish == "tool_calls"
    assert (r.reasoning, r.content) == ("I should list files.", "")
    assert r.calls[0].arguments == '{"command":"ls"}' and r.raw_dsml.startswith("\n\n" + OPEN)
    off = parse_output(text, thinking=True, think_recovery=False)
    assert off.calls == [] and off.content == text


def test_think_recovery_skips_invalid_blocks_and_repairs_truncated():
    bad = OPEN + "\nnope " + CLOSE
    good = block(invoke("ok"))
    r = parse_output("x " + bad + " y" + good, thinking=True)
    assert [c.name for c in r.calls] == ["ok"] and r.reasoning == "x " + bad + " y"
    trunc = "think " + OPEN + '\n<｜DSML｜invoke name="f">\n' + P + ' name="a" string="true">par'
    r = parse_output(trunc, thinking=True, truncated=True)
    assert r.recovered and r.repaired and r.calls[0].arguments == '{"a":"par"}'
    assert parse_output(trunc, thinking=True).calls == []


# --- rendering and escaping (chat-template.md §6, §7; the issue) ---------------------------------


def test_param_text_escapes_only_its_own_closing_delimiter():
    s = "a < b > c && d &amp; e </tool_result> </parameter> </｜DSML｜invoke> </｜DSML｜parameter> x"
    assert param_text(s) == s.replace("</｜DSML｜parameter>", "&lt;/｜DSML｜parameter>")
    assert param_text("cd /tmp && git diff 2>/dev/null") == "cd /tmp && git diff 2>/dev/null"
    assert json_literal('["</｜DSML｜parameter>"]') == '["\\u003c/｜DSML｜parameter>"]'


def test_tool_result_escapes_only_tool_result_close():
    s = "<b>&amp; && code(); </tool_result> <tool_result> </｜DSML｜parameter>"
    assert escape_tool_result(s) == s.replace("</tool_result>", "&lt;/tool_result>")


def test_attr_escape():
    assert attr_escape("a&b<c>d\"e'f") == "a&amp;b&lt;c&gt;d&quot;e'f"


def test_render_calls_canonical():
    calls = [
        ToolCall("1", 'we"ird<', '{"z": "</｜DSML｜parameter>", "a": {"k": [1, 2.50]}, "z": true, "n": null}'),
        ToolCall("2", "empty", "{}"),
        ToolCall("3", "custom", "*** Begin Patch\n</｜DSML｜parameter>"),
        ToolCall("4", "notobj", "[1, 2]"),
    ]
    assert render_calls(calls) == (
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="we&quot;ird&lt;">\n'
        '<｜DSML｜parameter name="z" string="true">&lt;/｜DSML｜parameter></｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="a" string="false">{"k":[1,2.50]}</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="z" string="false">true</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">null</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="empty">\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="custom">\n<｜DSML｜parameter name="arguments" string="true">*** Begin Patch\n'
        "&lt;/｜DSML｜parameter></｜DSML｜parameter>\n</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="notobj">\n<｜DSML｜parameter name="arguments" string="true">[1, 2]</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>"
    )
    assert render_calls([]) == ""


def test_canonical_block_round_trip_reproduces_sampled_bytes():
    sampled = block(
        invoke("bash", sparam("command", "cd /tmp && git diff 2>/dev/null"), jparam("timeout", "10")),
        invoke("write", sparam("text", "x </｜DSML｜invoke> <a href='&'>"), jparam("o", '{"a":[1,"b"]}')),
    )
    r = parse_output("</think>" + sampled, thinking=True)
    again = render_calls([ToolCall(c.id, c.name, c.arguments) for c in r.calls])
    assert again == sampled


def test_json_helpers():
    assert json_escape('a"\\\n\r\t\b\f\x01\x7fé/') == '"a\\"\\\\\\n\\r\\t\\u0008\\u000c\\u0001\x7fé/"'
    assert dumps_compact({"a": [1, 2.5, None, True], "é": "\b"}) == '{"a":[1,2.5,null,true],"é":"\\u0008"}'
    assert minify_json(' { "a" : [ 1 , "x y" ] } trailing') == '{"a":[1,"x y"]}'
    assert minify_json("hello world") is None
    assert parse_flat_object('{"a":"x" "b":1,}') == [("a", "x", True), ("b", "1", False)]
    assert parse_flat_object("[1]") is None and parse_flat_object('{"a":}') is None
    assert call_input("{}") == {} and call_input("nonsense") == {} and call_input("[1]") == {}
    assert decode_entities("&amp;lt; &apos;&quot;&gt;&bogus;") == "&lt; '\">&bogus;"
    assert decode_entities("&amp; &lt;/｜DSML｜parameter>", "close") == "&amp; </｜DSML｜parameter>"


# --- decode tracker (dsml.md §5.1) -------------------------------------------------------------


def _states(text: str, pieces: int = 1):
    tr = DecodeTracker()
    out = []
    for i in range(1, len(text) + 1):
        tr.update(text[:i])
        out.append(tr.state)
    return out


def test_tracker_states_along_a_block():
    pre = "hello "
    head = OPEN + '\n<｜DSML｜invoke name="f">\n' + P + ' name="s" string="true">'
    text = pre + head + "ab</" + "｜DSML｜parameter>\n" + P + ' name="j" string="false">{"k": "v"}' + PC + "\n" + CLOSE
    st_ = _states(text)
    assert all(s == "outside" for s in st_[: len(pre) + len(OPEN) - 1])
    assert st_[len(pre) + len(OPEN) - 1] == "structural"  # OPEN complete
    i = len(pre + head)
    assert st_[i - 1] == "string_body"  # right after string="true">
    assert st_[i] == "string_body" and st_[i + 1] == "string_body"  # "a", "b"
    assert st_[i + 2] == "string_body"  # "<" alone: could be text
    assert st_[i + 3] == "structural"  # "</" : possible PARAM_CLOSE
    j = text.index('{"k"')
    assert st_[j - 1] == "json_structural" and st_[j] == "json_structural"
    assert st_[j + 1] == "json_string"  # inside "k"
    assert st_[text.index(': "v"') + 2] == "json_string"
    assert st_[-1] == "outside"
    tr = DecodeTracker()
    tr.update(text)
    assert tr.mode == "done" and tr.block_end == len(text)


def test_tracker_literal_close_in_values_and_stuck():
    text = OPEN + '<｜DSML｜invoke name="f">' + sparam("s", CLOSE + "</think>") + jparam("j", '"' + CLOSE + '"')
    assert scan_block(text, 0) == ("open", len(text))
    assert scan_block(text + "</｜DSML｜invoke>" + CLOSE, 0)[0] == "complete"
    assert scan_block(OPEN + " prose", 0) == ("stuck", len(OPEN) + 1)


# --- property tests -------------------------------------------------------------------------------

_alphabet = st.sampled_from(
    list("ab <>&;\"'\\/\n\t{}[]:,=")
    + [
        "</｜DSML｜parameter>",
        "</｜DSML｜invoke>",
        "</｜DSML｜tool_calls>",
        "<｜DSML｜parameter",
        "</think>",
        "<think>",
        "<｜User｜>",
        "&lt;",
        "&amp;",
        "é",
        "😀",
        "\u2028",
        "\x00",
        'string="',
        'name="',
    ]
)
_text = st.lists(_alphabet, max_size=12).map("".join) | st.text(max_size=12)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text
)
_json = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3), max_leaves=8
)
_args = st.dictionaries(_text, _json, max_size=4)
_ENTITY_SEQS = [e for e, _ in M.DSML_ENTITIES]


def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _top_strings(args: dict):
    return [v for v in args.values() if isinstance(v, str)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(st.tuples(_text, _args), min_size=1, max_size=3), content=_text)
def test_render_parse_round_trip(calls, content):
    # ds4 decodes the five entities in string values, so a string that literally
    # contains one cannot round-trip in that mode (see the "close" mode test below).
    for _, args in calls:
        assume(not any(e in s for s in _top_strings(args) for e in _ENTITY_SEQS))
    assume(not content.rstrip(" \t\n\v\f\r").endswith("<"))
    tcs = [ToolCall(f"id{i}", name, json.dumps(args, ensure_ascii=False)) for i, (name, args) in enumerate(calls)]
    text = "reason</think>" + content.replace("</think>", "") + render_calls(tcs)
    assume(OPEN not in content and "<DSML｜tool_calls>" not in content and "<tool_calls>" not in content)
    r = parse_output(text, thinking=True)
    assert r.error is None and len(r.calls) == len(calls)
    for (name, args), c in zip(calls, r.calls):
        assert c.name == name
        assert json.loads(c.arguments) == args


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(_text, _args), min_size=1, max_size=2))
def test_render_parse_round_trip_close_entity_mode(calls):
    # with entities="close" every string round-trips except one that literally
    # contains the escaped closing tag (an ambiguity of the format itself)
    for _, args in calls:
        assume(not any("&lt;/｜DSML｜parameter>" in s for s in _top_strings(args)))
    tcs = [ToolCall(f"id{i}", name, json.dumps(args)) for i, (name, args) in enumerate(calls)]
    r = parse_output("</think>" + render_calls(tcs), thinking=True, entities="close")
    assert [(c.name, json.loads(c.arguments)) for c in r.calls] == [(n, a) for n, a in calls]
