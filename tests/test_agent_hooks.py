"""ds4-agent's response hooks: the event JSON on the hook's stdin (ds4_hooks.c's keys,
order and values) around every model call of a scripted task, failures reported
without ending the turn, a hook past its timeout killed with its process group,
and the flags' bounds."""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest
from agent_helpers import dsml, make_worker, steps

from ds4mlx.agent import cli
from ds4mlx.agent.events import Notice, TurnEnd
from ds4mlx.agent.hooks import MAX_TEXT_BYTES, ResponseHooks, payload, run_hook

DS4_KEYS = [
    "event",
    "pid",
    "model",
    "user_text",
    "response_text",
    "response_index",
    "generated_tokens",
    "interrupted",
    "tool_call",
    "user_text_truncated",
    "response_text_truncated",
]


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def test_hooks_get_ds4s_event_json_around_every_response(tok, tmp_path):
    (tmp_path / "a.txt").write_text("alpha\n")
    log = tmp_path / "events.jsonl"
    script = steps(dsml("read", path="a.txt"), 'It says "alpha".')
    model, engine, worker, sink = make_worker(tok, script, tmp_path)
    worker.hooks = ResponseHooks(f"cat >> {log}", f"cat >> {log}", 10, model=engine.protocol.model_id)
    try:
        assert worker.run_turn("what is in a.txt?\ttab \\ and ü") == TurnEnd("answered")
    finally:
        worker.close()
        engine.close()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [list(e) for e in events] == [DS4_KEYS] * 4  # ds4's keys, in ds4's order
    assert [(e["event"], e["response_index"], e["tool_call"]) for e in events] == [
        ("before_response", 1, False),
        ("after_response", 1, True),  # the tool round
        ("before_response", 2, False),
        ("after_response", 2, False),
    ]
    for e in events:
        assert e["pid"] == os.getpid() and e["model"] == engine.protocol.model_id
        assert e["user_text"] == "what is in a.txt?\ttab \\ and ü"  # escapes and UTF-8 survive
        assert e["interrupted"] is False and e["user_text_truncated"] is e["response_text_truncated"] is False
    assert events[0]["response_text"] is None and events[0]["generated_tokens"] == 0
    assert "DSML" in events[1]["response_text"] and events[1]["generated_tokens"] > 0
    assert events[3]["response_text"] == 'It says "alpha".'
    assert events[3]["generated_tokens"] == len(tok.encode('It says "alpha".'))  # the end of turn not counted (ds4)


def test_a_failing_hook_is_reported_and_the_turn_goes_on(tok, tmp_path):
    model, engine, worker, sink = make_worker(tok, "Fine.", tmp_path)
    worker.hooks = ResponseHooks(None, "exit 3", 10, report=lambda t: worker.emit(Notice(t, "error")))
    try:
        assert worker.run_turn("hi") == TurnEnd("answered")
    finally:
        worker.close()
        engine.close()
    assert [n.text for n in sink.of(Notice)] == ["after_response hook: hook exited with status 3"]
    assert worker.conv.messages[-1].content == "Fine."


def test_a_hook_past_its_timeout_is_killed_with_its_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    # the hook leaves a grandchild behind: killing only the shell would not stop it
    cmd = f"sleep 60 & echo $! > {pidfile}; wait"
    t0 = time.monotonic()
    res = run_hook(
        cmd,
        payload("before_response", model="m", user_text="u", response_text=None, response_index=1, generated_tokens=0),
        0.5,
    )
    assert res.timed_out and not res.ok and res.error == "hook timed out after 0.5 seconds"
    assert time.monotonic() - t0 < 30  # it did not wait for the sleep
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_hook_payload_cuts_long_texts_and_no_command_starts_nothing():
    body = json.loads(
        payload(
            "after_response",
            model=None,
            user_text="x" * (MAX_TEXT_BYTES + 5),
            response_text="é" * MAX_TEXT_BYTES,
            response_index=3,
            generated_tokens=7,
        )
    )
    assert len(body["user_text"]) == MAX_TEXT_BYTES and body["user_text_truncated"] is True
    assert len(body["response_text"].encode()) <= MAX_TEXT_BYTES and body["response_text_truncated"] is True
    assert body["model"] is None
    before = json.loads(
        payload(
            "before_response", model="m", user_text="u", response_text="ignored", response_index=1, generated_tokens=0
        )
    )
    assert before["response_text"] is None  # before a response there is none
    hooks = ResponseHooks(None, "", 10)
    assert (
        not hooks.enabled
        and hooks.before("u") is None
        and hooks.after("", 0, interrupted=False, tool_call=False) is None
    )


def test_hook_flags_take_ds4s_names_and_bounds():
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    a = p.parse_args(["--before-response-hook", "cat", "--after-response-hook=true", "--hook-timeout", "3"])
    assert (a.before_response_hook, a.after_response_hook, a.hook_timeout) == ("cat", "true", 3)
    assert p.parse_args([]).hook_timeout == 10
    for bad in ("0", "3601", "1.5", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--hook-timeout", bad])
