"""Tool calling on the real engine with the demo model (random weights).

The demo model cannot write a sensible call by itself, so a complete DSML call is
forced (the mechanism `tool_choice` uses for its prefix): the forced tokens go
through the real decode loop, the model's KV and the streaming parser, generation
stops at the block close, and the call must come back parsed — with the exact
sampled bytes remembered for replay."""

from __future__ import annotations

import json

import pytest

from ds4mlx.chat.families.deepseek_v4.template import render
from ds4mlx.chat.toolmemory import ToolMemory
from ds4mlx.engine import Engine, Job
from ds4mlx.runtime.events import Finish, ToolCallDelta, ToolCallEnd, ToolCallStart
from ds4mlx.runtime.sampling import SamplingParams
from ds4mlx.serve.openai import parse_chat

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}},
    },
}
CALL = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls /tmp && echo "<ok>"</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="timeout" string="false">10</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


@pytest.fixture(scope="module")
def engine(shared_demo):
    model, tok = shared_demo()
    memory = ToolMemory()
    eng = Engine(model, tok, ctx=2048, tool_memory=memory)
    yield eng, memory
    eng.close()


def test_forced_dsml_call_is_parsed_on_the_demo_model(engine):
    eng, memory = engine
    conv = parse_chat(
        {"messages": [{"role": "user", "content": "List /tmp"}], "tools": [BASH], "reasoning_effort": "none"}
    )
    job = Job(
        prompt_text=render(conv),
        thinking="none",
        tools_active=True,
        max_tokens=200,
        params=SamplingParams(temperature=0.7, seed=3),
    )
    job.force_text = CALL
    events = list(eng.generate(job))
    fin = events[-1]
    assert isinstance(fin, Finish) and fin.reason == "tool_calls", fin
    assert fin.raw_text == CALL  # stopped right after the block close
    [call] = fin.result.calls
    assert call.name == "bash" and json.loads(call.arguments) == {"command": 'ls /tmp && echo "<ok>"', "timeout": 10}
    # streamed: header, argument fragments that add up to the final arguments
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [s.name for s in starts] == ["bash"] and starts[0].id.startswith("call_") and len(starts[0].id) == 37
    frags = "".join(e.arguments for e in events if isinstance(e, ToolCallDelta))
    assert json.loads(frags) == json.loads(ends[0].arguments)
    # exact replay: the id maps to the sampled block
    assert memory.lookup_message([starts[0].id]) == CALL
