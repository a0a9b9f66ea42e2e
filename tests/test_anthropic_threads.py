"""Anthropic message threads (the `thread` field, the `message-threads-2026-08-12`
beta) are not served: a request carrying either is refused with a 400 naming it, in the
shape on which the anthropic SDK goes on without a thread, so its `tool_runner`
(which threads by default) completes a multi-step tool loop against `serve`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lazy_modules import lazy  # noqa: E402
from scripted_model import ScriptedModel, serve  # noqa: E402

anthropic = lazy("anthropic")
anthropic_tools = lazy("anthropic.lib.tools")

CALL = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="add">\n'
    '<｜DSML｜parameter name="a" string="false">{n}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def script(prompt: str) -> str:
    """Two tool rounds, then the answer: the round is the number of results so far."""
    head = "Hmm.</think>" if prompt.endswith("<think>") else ""
    done = prompt.count("<tool_result>")
    return head + ("Done: " + str(done) if done >= 2 else "Adding." + CALL.format(n=done + 1))


@pytest.fixture(scope="module")
def srv():
    from ds4mlx.runtime.tokenizer import Tokenizer

    tok = Tokenizer.default()
    with serve(tok, ScriptedModel(tok, script), ctx=2048, tokens=64) as s:
        yield s


def test_thread_field_and_beta_are_refused_by_name(srv):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    for extra, headers, named in (
        ({"thread": {"type": "create"}}, {}, "'thread' field"),
        ({}, {"anthropic-beta": "other-beta, message-threads-2026-08-12"}, "message-threads-2026-08-12"),
    ):
        r = httpx.post(srv.url + "/v1/messages", json={**body, **extra}, headers=headers, timeout=30)
        err = r.json()
        assert r.status_code == 400 and err["type"] == "error" and named in err["error"]["message"]
        assert err["error"]["details"] == {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}
    r = httpx.post(srv.url + "/v1/messages", json={**body, "thread": None}, timeout=30)  # null: absent
    assert r.status_code == 200, r.text


def test_sdk_tool_runner_completes_two_tool_rounds(srv):
    calls = []

    @anthropic_tools.beta_tool
    def add(a: int) -> str:
        """Add one to a number.

        Args:
            a: the number
        """
        calls.append(a)
        return json.dumps(a + 1)

    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    runner = client.beta.messages.tool_runner(
        model="deepseek-chat", max_tokens=64, tools=[add], messages=[{"role": "user", "content": "add twice"}]
    )
    replies = list(runner)
    assert calls == [1, 2]
    assert [m.stop_reason for m in replies] == ["tool_use", "tool_use", "end_turn"]
    assert replies[-1].content[-1].text == "Done: 2"
