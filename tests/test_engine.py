"""Engine: FIFO worker, decode loop, cancellation, live-session reuse
(kv-cache.md §2), tool continuation — on the scripted model double with the
real DeepSeek V4 tokenizer, so the real sampler / detokenizer / stop matcher /
output parser run."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, Segment  # noqa: E402

from ds4mlx.chat.families.deepseek_v4.template import live_tail, render, render_continuation_tail, uses_tool_context  # noqa: E402
from ds4mlx.chat.toolmemory import ToolMemory  # noqa: E402
from ds4mlx.engine import Engine, Failed, Job  # noqa: E402
from ds4mlx.runtime.events import (
    Finish,
    PrefillProgress,
    ReasoningDelta,
    Started,
    TextDelta,
    ToolCallDelta,  # noqa: E402
    ToolCallEnd,
    ToolCallStart,
)
from ds4mlx.runtime.sampling import SamplingParams  # noqa: E402
from ds4mlx.serve.anthropic import parse_anthropic  # noqa: E402
from ds4mlx.serve.openai import parse_chat  # noqa: E402
from ds4mlx.serve.prepare import live_binding  # noqa: E402
from ds4mlx.serve.responses import parse_responses  # noqa: E402

# the live tool state the two HTTP adapters keep (serve/prepare.py)
RESPONSES, ANTHROPIC = live_binding("responses"), live_binding("anthropic")

DSML_CALL = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls /tmp</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


@pytest.fixture
def make(tok):
    engines = []

    def _make(script, ctx=2048, **kw):
        model = ScriptedModel(tok, script)
        eng = Engine(model, tok, ctx=ctx, **kw)
        engines.append(eng)
        return model, eng

    yield _make
    for e in engines:
        e.close()


def run(engine, job):
    return list(engine.generate(job))


def finish_of(events) -> Finish:
    assert isinstance(events[-1], Finish), events[-1]
    return events[-1]


def texts(events, kind=TextDelta):
    return "".join(e.text for e in events if isinstance(e, kind))


RAW = "<｜begin▁of▁sentence｜>You are a helpful assistant<｜User｜>hi<｜Assistant｜></think>"


def raw_job(**kw):
    return Job(prompt_text=kw.pop("prompt_text", RAW), api="completions", raw=True, **kw)


# --------------------------------------------------------------------------- decode loop
def test_raw_generation_events_and_usage(make, tok):
    model, eng = make("Hello wörld.")
    ev = run(eng, raw_job())
    assert isinstance(ev[0], PrefillProgress) and ev[0].done == 0
    started = next(e for e in ev if isinstance(e, Started))
    fin = finish_of(ev)
    assert texts(ev) == fin.raw_text == "Hello wörld."
    assert fin.reason == "stop"
    n_prompt = len(tok.encode(RAW))
    assert started.prompt_tokens == fin.usage.prompt_tokens == n_prompt
    assert fin.usage.completion_tokens == len(tok.encode("Hello wörld."))  # EOS not counted
    assert fin.usage.cached_tokens == 0 and fin.usage.written_tokens == n_prompt
    assert len(eng.session) == n_prompt + fin.usage.completion_tokens  # EOS not evaluated


def test_utf8_characters_never_split(make, tok):
    from ds4mlx.runtime.tokenizer import _BYTE_TO_CHAR

    text = "😀 ok 🙂中文"
    # One byte-level token per byte: every multi-byte character arrives split.
    byte_tokens = [tok.token_to_id(_BYTE_TO_CHAR[b]) for b in text.encode("utf-8")]
    assert all(t is not None and len(tok.token_bytes(t)) == 1 for t in byte_tokens)
    model, eng = make(lambda p: byte_tokens)
    ev = run(eng, raw_job())
    deltas = [e.text for e in ev if isinstance(e, TextDelta)]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)


def test_stop_sequence_cuts_holds_back_and_invalidates_session(make, tok):
    model, eng = make("one two three four")
    ev = run(eng, raw_job(stop=["thr", "zzz"]))
    fin = finish_of(ev)
    assert fin.reason == "stop" and fin.raw_text == "one two " and texts(ev) == "one two "
    assert len(eng.session) == 0  # ds4 drops the live session after a stop-sequence hit


def test_stop_sequence_prefix_is_released_when_no_match(make):
    model, eng = make("abcab")
    ev = run(eng, raw_job(stop=["abd"]))
    assert finish_of(ev).reason == "stop" and texts(ev) == "abcab"


def test_max_tokens_and_context_clipping(make, tok):
    model, eng = make("a b c d e f g h i j k l m n o p")
    fin = finish_of(run(eng, raw_job(max_tokens=3)))
    assert fin.reason == "length" and fin.usage.completion_tokens == 3
    n_prompt = len(tok.encode(RAW))
    model, eng = make("a b c d e f g h i j k l m n o p", ctx=n_prompt + 4)
    fin = finish_of(run(eng, raw_job()))
    assert fin.reason == "length" and fin.usage.completion_tokens == 4
    fin = finish_of(run(eng, raw_job(max_tokens=0)))
    assert fin.reason == "length" and fin.usage.completion_tokens == 0


def test_ignore_eos_generates_exactly_max_tokens(make):
    model, eng = make("hi")  # the script ends after one token, then forces EOS
    fin = finish_of(run(eng, raw_job(max_tokens=7, ignore_eos=True, params=SamplingParams(temperature=0.0))))
    assert fin.reason == "length" and fin.usage.completion_tokens == 7
    assert fin.raw_text.startswith("hi")


def test_logit_bias_and_presence_penalty_reach_the_device_sampler(make, tok):
    """The scripted target has logit 30, "x" 0: a bias of 29 on "x" loses to a target not
    yet generated and wins once the presence penalty (2) lowers a repeated one to 28."""
    x = tok.encode("x")[0]
    _, eng = make("Hello Hello Hello")
    bias = SamplingParams(temperature=0.0, logit_bias=((x, 29.0),))
    assert texts(run(eng, raw_job(params=bias, max_tokens=3))) == "Hello Hello Hello"
    pen = SamplingParams(temperature=0.0, logit_bias=((x, 29.0),), presence_penalty=2.0)
    assert texts(run(eng, raw_job(params=pen, max_tokens=3))) == "Hello Hellox"


def test_prompt_at_context_size_fails_before_prefill(make, tok):
    n = len(tok.encode(RAW))
    model, eng = make("x", ctx=n)
    ev = run(eng, raw_job())
    assert ev == [Failed(500, "prompt exceeds context")] and model.prefill_calls == 0


def test_decode_failure_ends_with_error_and_engine_keeps_serving(make):
    model, eng = make("abc def")
    boom = {"n": 0}
    real_step = type(eng.session).step

    def step(self, t):
        boom["n"] += 1
        if boom["n"] == 2:
            raise RuntimeError("device lost")
        return real_step(self, t)

    type(eng.session).step = step
    try:
        fin = finish_of(run(eng, raw_job()))
    finally:
        type(eng.session).step = real_step
    assert fin.reason == "error" and "device lost" in fin.error
    assert len(eng.session) == 0
    assert finish_of(run(eng, raw_job())).reason == "stop"


# --------------------------------------------------------------------------- scheduling, cancel
def test_jobs_run_fifo(make):
    model, eng = make(lambda p: p[-3:])
    model.prefill_gate.close()
    order, done = [], []
    handles = []
    for i in range(4):

        def emit(ev, i=i):
            if isinstance(ev, Started):
                order.append(i)
            if isinstance(ev, Finish):
                done.append(i)

        handles.append(eng.submit(raw_job(prompt_text=RAW + f"#{i}"), emit))
    assert model.prefill_gate.wait_for_waiters(1)
    assert eng.queue_depth == 3
    model.prefill_gate.open()
    for h in handles:
        assert h.done.wait(30)
    assert order == done == [0, 1, 2, 3]


def test_cancel_queued_job_never_runs(make):
    model, eng = make("abc")
    model.prefill_gate.close()
    first = eng.submit(raw_job(), lambda ev: None)
    assert model.prefill_gate.wait_for_waiters(1)
    got = []
    second = eng.submit(raw_job(prompt_text=RAW + "x"), got.append)
    second.cancel()
    model.prefill_gate.open()
    assert first.done.wait(30) and second.done.wait(30)
    assert [type(e) for e in got] == [Finish] and got[0].reason == "cancelled"
    assert model.prefill_calls == 1


def test_cancel_during_prefill_stops_at_chunk_boundary(make, tok):
    model, eng = make("abc", prefill_chunk=4)
    n = len(tok.encode(RAW))
    assert n > 8
    model.prefill_gate.close()
    got = []
    h = eng.submit(raw_job(), got.append)
    assert model.prefill_gate.wait_for_waiters(1)
    h.cancel()
    model.prefill_gate.open()
    assert h.done.wait(30)
    fin = finish_of(got)
    assert fin.reason == "cancelled" and model.prefill_tokens == 4
    assert not any(isinstance(e, Started) for e in got)
    assert eng.session.tokens == tok.encode(RAW)[:4]  # a valid prefix stays live


def test_cancel_during_decode_stops_within_one_token(make):
    model, eng = make("a b c d e f g h i j k l m n o p q r s t")
    model.step_gate.close()
    got = []
    h = eng.submit(raw_job(), got.append)
    model.step_gate.allow(3)
    assert model.step_gate.wait_for_waiters(1)  # blocked inside the 4th step
    steps_at_cancel = model.steps
    h.cancel()
    model.step_gate.open()
    assert h.done.wait(30)
    fin = finish_of(got)
    assert fin.reason == "cancelled"
    assert steps_at_cancel == 3 and model.steps <= steps_at_cancel + 1


# --------------------------------------------------------------------------- live reuse
def chat(messages, **kw):
    return parse_chat({"messages": messages, **kw}, ctx=2048)


def test_memory_token_reuse_prefills_only_the_suffix(make, tok):
    model, eng = make(lambda p: "Fine.")
    p1 = RAW
    fin1 = finish_of(run(eng, raw_job(prompt_text=p1)))
    live = list(eng.session.tokens)
    p2 = p1 + "Fine.<｜end▁of▁sentence｜><｜User｜>again<｜Assistant｜></think>"
    ids2 = tok.encode(p2)
    assert ids2[: len(live)] == live
    before = model.prefill_tokens
    fin2 = finish_of(run(eng, raw_job(prompt_text=p2)))
    assert eng.stats.last_cache_source == "memory-token"
    assert fin2.usage.cached_tokens == len(live) == fin1.usage.prompt_tokens + fin1.usage.completion_tokens
    assert model.prefill_tokens - before == len(ids2) - len(live) == fin2.usage.written_tokens


def test_memory_text_reuse_keeps_sampled_tokenization(make, tok):
    # The model samples "Hello" as two tokens; the replayed prompt tokenizes it as one.
    split = tok.encode("Hel") + tok.encode("lo")
    assert tok.encode("Hello") != split
    model, eng = make(lambda p: split)
    run(eng, raw_job())
    live = list(eng.session.tokens)
    p2 = RAW + "Hello<｜end▁of▁sentence｜><｜User｜>more<｜Assistant｜></think>"
    assert tok.encode(p2)[: len(live)] != live
    before = model.prefill_tokens
    fin = finish_of(run(eng, raw_job(prompt_text=p2)))
    suffix = tok.encode("<｜end▁of▁sentence｜><｜User｜>more<｜Assistant｜></think>")
    assert eng.stats.last_cache_source == "memory-text"
    assert fin.usage.cached_tokens == len(live) and model.prefill_tokens - before == len(suffix)
    assert eng.session.tokens[: len(live)] == live


def test_thinking_visible_reuse_keeps_hidden_reasoning(make, tok):
    model, eng = make(lambda p: "Let me think.</think>Four.")
    c1 = chat([{"role": "user", "content": "2+2?"}])
    p1 = render(c1)
    assert p1.endswith("<think>")
    run(eng, Job(prompt_text=p1, api="chat", thinking=c1.thinking))
    live = list(eng.session.tokens)
    c2 = chat(
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "Four."},
            {"role": "user", "content": "3+3?"},
        ]
    )
    p2 = render(c2)
    assert "Let me think." not in p2  # plain chats drop old reasoning
    before = model.prefill_tokens
    fin = finish_of(run(eng, Job(prompt_text=p2, api="chat", thinking=c2.thinking)))
    assert eng.stats.last_cache_source == "thinking-visible"
    assert fin.usage.cached_tokens == len(live)
    visible = p1[: -len("<think>")] + "</think>Four.<｜end▁of▁sentence｜>"
    assert model.prefill_tokens - before == len(tok.encode(p2[len(visible) :]))
    assert eng.session.tokens[: len(live)] == live  # the reasoning tokens are still in the KV


def test_unrelated_prompt_is_a_miss(make):
    model, eng = make(lambda p: "ok")
    run(eng, raw_job())
    fin = finish_of(run(eng, raw_job(prompt_text=RAW.replace("hi", "bye"))))
    assert eng.stats.last_cache_source == "none" and fin.usage.cached_tokens == 0


# --------------------------------------------------------------------------- tools
def tool_script(p: str) -> str:
    if "<tool_result>" in p:
        return "Got it.</think>Two files."
    return "Need ls.</think>Sure." + DSML_CALL


def test_tool_call_turn_stops_at_block_close(make):
    model, eng = make(lambda p: tool_script(p) + "SHOULD NOT APPEAR")
    mem = ToolMemory()
    eng.tool_memory = mem
    c = chat([{"role": "user", "content": "List /tmp"}], tools=TOOLS)
    ev = run(eng, Job(prompt_text=render(c), api="chat", thinking=c.thinking, tools_active=True))
    fin = finish_of(ev)
    assert fin.reason == "tool_calls" and fin.raw_text.endswith("</｜DSML｜tool_calls>")
    assert texts(ev, ReasoningDelta) == "Need ls." and texts(ev) == "Sure."
    start = next(e for e in ev if isinstance(e, ToolCallStart))
    end = next(e for e in ev if isinstance(e, ToolCallEnd))
    assert start.name == "bash" and start.id.startswith("call_") and len(start.id) == 37 and end.id == start.id
    assert "".join(e.arguments for e in ev if isinstance(e, ToolCallDelta)) == '{"command":"ls /tmp"}'
    (call,) = fin.result.calls
    assert call.id == start.id and call.arguments == '{"command":"ls /tmp"}'
    assert mem.lookup(call.id) == DSML_CALL  # exact replay memory


def test_unterminated_tool_call_is_an_error(make):
    model, eng = make(lambda p: "Need ls.</think>" + DSML_CALL[:60])
    c = chat([{"role": "user", "content": "List /tmp"}], tools=TOOLS)
    fin = finish_of(run(eng, Job(prompt_text=render(c), api="chat", thinking=c.thinking, tools_active=True)))
    assert fin.reason == "error" and fin.error == "unterminated tool call" and not fin.result.calls


def test_structure_is_sampled_greedily_bodies_at_request_temperature(make, tok):
    """Soft positions get a distractor almost as likely as the scripted token.
    Inside DSML structure (tags, names) the engine must take argmax; inside a
    string body it samples at the request temperature."""
    script = [
        Segment('Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="'),
        Segment("bash", soft=True),  # tool name: structural
        Segment('">\n<｜DSML｜parameter name="'),
        Segment("command", soft=True),  # parameter name: structural
        Segment('" string="true">'),
        Segment("echo hello world now", soft=True),  # string body: request sampling
        Segment("</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"),
    ]
    c = chat([{"role": "user", "content": "go"}], tools=TOOLS, think=False)
    prompt = render(c)
    deviated = 0
    for seed in range(1, 7):
        model, eng = make(lambda p: script)
        job = Job(
            prompt_text=prompt,
            api="chat",
            thinking="none",
            tools_active=True,
            params=SamplingParams(temperature=1.0, min_p=0.0, seed=seed),
        )
        fin = finish_of(run(eng, job))
        assert fin.reason == "tool_calls", fin.raw_text
        (call,) = fin.result.calls
        assert call.name == "bash" and list(call.input()) == ["command"]
        body = call.input()["command"]
        deviated += body != "echo hello world now"
        assert eng.stats.greedy_tokens > 0
    assert deviated > 0  # the body really was sampled


def test_responses_tool_output_continuation_prefills_only_the_tail(make, tok):
    model, eng = make(tool_script)
    mem = ToolMemory()
    eng.tool_memory = mem
    body = {
        "input": [{"role": "user", "content": "List /tmp"}],
        "tools": [{"type": "function", "name": "bash", "parameters": {"type": "object"}}],
    }
    c1 = parse_responses(body, ctx=2048)
    fin1 = finish_of(
        run(
            eng,
            Job(prompt_text=render(c1), api="responses", binding=RESPONSES, thinking=c1.thinking, tools_active=True),
        )
    )
    (call,) = fin1.result.calls
    assert eng.live_call_ids("responses") == {call.id}
    live = list(eng.session.tokens)
    body2 = dict(body, input=[{"type": "function_call_output", "call_id": call.id, "output": "a b"}])
    c2 = parse_responses(body2, ctx=2048)
    start, ids = live_tail(c2)
    tail = render_continuation_tail(c2, start)
    assert tail.startswith("<｜end▁of▁sentence｜><｜User｜><tool_result>a b</tool_result>")
    before = model.prefill_tokens
    job2 = Job(
        prompt_text=render(c2),
        api="responses",
        binding=RESPONSES,
        thinking=c2.thinking,
        tools_active=True,
        continuation_tail=tail,
        continuation_ids=frozenset(ids),
        requires_live=True,
    )
    fin2 = finish_of(run(eng, job2))
    assert eng.stats.last_cache_source == "responses-tool-output"
    assert fin2.usage.cached_tokens == len(live)
    assert model.prefill_tokens - before == len(tok.encode(tail))
    assert fin2.result.content == "Two files."
    # The live state moved on: the same continuation now has nothing to continue from.
    ev = run(eng, job2)
    assert ev == [
        Failed(409, "Responses continuation state is not available; retry by replaying the full input history")
    ]


def test_anthropic_tool_result_continuation(make, tok):
    model, eng = make(tool_script)
    tools = [{"name": "bash", "input_schema": {"type": "object"}}]
    c1 = parse_anthropic(
        {"messages": [{"role": "user", "content": "List /tmp"}], "tools": tools, "max_tokens": 50}, ctx=2048
    )
    fin1 = finish_of(
        run(
            eng,
            Job(
                prompt_text=render(c1),
                api="anthropic",
                binding=ANTHROPIC,
                thinking=c1.thinking,
                tools_active=True,
                tool_id_prefix="toolu_",
            ),
        )
    )
    (call,) = fin1.result.calls
    assert call.id.startswith("toolu_")
    live = len(eng.session)
    c2 = parse_anthropic(
        {
            "messages": [
                {"role": "user", "content": "List /tmp"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": call.id, "name": "bash", "input": {"command": "ls /tmp"}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "a b"}]},
            ],
            "tools": tools,
            "max_tokens": 50,
        },
        ctx=2048,
    )
    start, ids = live_tail(c2)
    tail = render_continuation_tail(c2, start)
    before = model.prefill_tokens
    fin2 = finish_of(
        run(
            eng,
            Job(
                prompt_text=render(c2),
                api="anthropic",
                binding=ANTHROPIC,
                thinking=c2.thinking,
                tools_active=True,
                continuation_tail=tail,
                continuation_ids=frozenset(ids),
                preserves_reasoning=uses_tool_context(c2),
            ),
        )
    )
    assert eng.stats.last_cache_source == "anthropic-tool-output"
    assert fin2.usage.cached_tokens == live and model.prefill_tokens - before == len(tok.encode(tail))


def test_engine_survives_a_consumer_that_raises(make):
    model, eng = make("abc")

    def bad(ev):
        raise RuntimeError("consumer bug")

    h = eng.submit(raw_job(), bad)
    assert h.done.wait(30)
    assert finish_of(run(eng, raw_job())).reason == "stop"


def test_generate_iterator_close_cancels(make):
    model, eng = make("a b c d e f g h i j")
    model.step_gate.close()
    it = eng.generate(raw_job())
    for ev in it:
        if isinstance(ev, Started):
            break
    it.close()
    model.step_gate.open()
    assert eng.stats.cancel_requests == 1
    done = threading.Event()
    eng.submit(raw_job(), lambda ev: isinstance(ev, Finish) and done.set())
    assert done.wait(30)
    assert eng.stats.cancelled == 1


@pytest.mark.parametrize("named", [True, False])
def test_tool_choice_forces_the_block_open(make, tok, named):
    """tool_choice required / named: the DSML open (and the invoke tag) are forced
    right after the reasoning.  The script writes filler where the forced text
    goes, so only the forced version parses as a call."""
    from ds4mlx.serve.prepare import force_text

    force = force_text("bash" if named else None)
    rest = ('bash">\n' if not named else "") + (
        '<｜DSML｜parameter name="command" string="true">ls</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    filler = tok.encode("x") * len(tok.encode(force))
    script = tok.encode("Hmm.</think>") + filler + tok.encode(rest)
    c = chat([{"role": "user", "content": "go"}], tools=TOOLS)
    job = Job(prompt_text=render(c), api="chat", thinking=c.thinking, tools_active=True)
    model, eng = make(lambda p: script)
    fin = finish_of(run(eng, job))
    assert fin.reason == "stop" and not fin.result.calls  # unforced: filler text, no call
    job.force_text = force
    model, eng = make(lambda p: script)
    ev = run(eng, job)
    fin = finish_of(ev)
    assert fin.reason == "tool_calls" and fin.result.reasoning == "Hmm." and fin.result.content == ""
    (call,) = fin.result.calls
    assert call.name == "bash" and call.arguments == '{"command":"ls"}'
    assert fin.usage.completion_tokens == len(script)  # forced tokens are generated output


def test_disk_cache_hooks_are_called_at_their_points(make, tok):
    from ds4mlx.engine import CacheHooks

    calls = []

    class Rec(CacheHooks):
        def on_miss(self, engine):
            calls.append(("miss", len(engine.session)))

        def try_load(self, engine, job):
            calls.append(("load",))
            return None

        def cold_save_point(self, engine, job, effective):
            return 5

        def on_cold_prefix(self, engine, job, n):
            calls.append(("cold", n, len(engine.session), engine.session.tokens == job.prompt_ids[:5]))

        def on_progress(self, engine, job):
            calls.append(("progress",))

        def on_shutdown(self, engine):
            calls.append(("shutdown", threading.current_thread().name))

    model, eng = make("ok fine", cache=Rec(), prefill_chunk=4)
    ids = tok.encode(RAW)
    fin = finish_of(run(eng, raw_job(prompt_ids=ids)))
    assert ("cold", 5, 5, True) in calls and calls[0] == ("load",)
    assert calls.count(("progress",)) == len(range(0, len(ids), 4)) + (5 % 4 != 0) + fin.usage.completion_tokens
    run(eng, raw_job(prompt_text=RAW.replace("hi", "bye")))  # full miss of a live session
    assert ("miss", len(ids) + fin.usage.completion_tokens) in calls
    eng.close()
    assert calls[-1] == ("shutdown", "ds4mlx-engine")
