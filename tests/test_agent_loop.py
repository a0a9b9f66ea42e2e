"""Whole agent sessions on the scripted model (fixed token scripts, the real
V4 tokenizer, template, sampler and DSML parser): tool loops, approvals, the
project confinement, compaction, cooperative stops, sessions with their KV
checkpoint across a restart."""

from __future__ import annotations

import os
import threading

import pytest
from agent_helpers import COMPACT_MARK, ScriptedModel, dsml, last_real_user, make_worker, steps

from ds4mlx.agent.approval import PendingApproval
from ds4mlx.agent.events import Notice, TextDelta, ToolCard, TurnEnd


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


@pytest.fixture
def agents():
    made = []

    def _make(*a, **kw):
        model, engine, worker, sink = make_worker(*a, **kw)
        made.append((engine, worker))
        return model, engine, worker, sink

    yield _make
    for engine, worker in made:
        worker.close()
        engine.close()


def tool_messages(worker):
    return [m.content for m in worker.conv.messages if m.role == "tool"]


def test_read_edit_bash_answer_loop(tok, tmp_path, agents):
    (tmp_path / "app.py").write_text("def greet():\n    return 'helo'\n")
    script = steps(
        "I will read the file." + dsml("read", path="app.py"),
        dsml("edit", path="app.py", old="'helo'", new="'hello'"),
        dsml("bash", command="python3 -c 'import app; print(app.greet())'"),
        "Fixed the typo: greet() now returns **hello**.",
    )
    model, engine, worker, sink = agents(tok, script, tmp_path)
    end = worker.run_turn("fix the typo in app.py")
    assert end == TurnEnd("answered")
    assert (tmp_path / "app.py").read_text() == "def greet():\n    return 'hello'\n"
    results = tool_messages(worker)
    assert results[0].startswith("app.py (lines 1-2 of 2)\n1: def greet():")
    assert results[1].startswith("edited app.py at line 2")
    assert results[2].splitlines()[1:] == ["hello", "[exit code 0]"]
    assert worker.conv.messages[-1].content == "Fixed the typo: greet() now returns **hello**."
    # every card went parsing -> running -> done, and no raw tool-call text reached the answer
    for name in ("read", "edit", "bash"):
        states = [c.state for c in sink.cards() if c.name == name]
        assert states[0] == "parsing" and states[-2:] == ["running", "done"], (name, states)
    shown = "".join(e.text for e in sink.of(TextDelta))
    assert "DSML" not in shown and shown.startswith("I will read the file.")
    # each step continued the live session instead of prefilling it again
    assert engine.stats.jobs == 4 and engine.stats.last_cache_source.startswith("memory-")
    assert engine.stats.prefill_tokens < worker.prompt_tokens() - engine.stats.decode_tokens + 8


def test_approval_denied_and_timeout_deny(tok, tmp_path, agents):
    script = steps(
        dsml("write", path="x.txt", content="one"), dsml("bash", command="touch ran.flag"), "Nothing was changed."
    )
    model, engine, worker, sink = agents(tok, script, tmp_path, trusted=False, timeout=0.3)
    asked = []

    def answer(ev):
        if isinstance(ev, PendingApproval):
            asked.append(ev.request)
            if ev.request.tool == "write":
                ev.answer(False)  # the user says no; the bash question is never answered

    sink.on_event = answer
    assert worker.run_turn("make x.txt and run touch") == TurnEnd("answered")
    assert [(r.tool, r.cwd) for r in asked] == [("write", str(tmp_path.resolve())), ("bash", str(tmp_path.resolve()))]
    assert asked[1].action == "$ touch ran.flag"  # the exact command is shown
    assert not (tmp_path / "x.txt").exists() and not (tmp_path / "ran.flag").exists()
    res = tool_messages(worker)
    assert res[0] == "Tool error: write was not run: the user denied it."
    assert res[1] == "Tool error: bash was not run: no approval within 0.3 s (denied by default)."
    assert [c.state for c in sink.cards("denied")] == ["denied", "denied"]
    assert [c.name for c in sink.cards("awaiting approval")] == ["write", "bash"]


def test_symlink_escape_is_refused_in_a_session(tok, tmp_path, agents):
    project = tmp_path / "proj"
    project.mkdir()
    (tmp_path / "secret.txt").write_text("TOPSECRET\n")
    os.symlink(tmp_path / "secret.txt", project / "innocent.txt")
    script = steps(
        dsml("read", path="innocent.txt"), dsml("write", path="innocent.txt", content="pwned"), "I cannot read it."
    )
    model, engine, worker, sink = agents(tok, script, project)
    assert worker.run_turn("show innocent.txt") == TurnEnd("answered")
    for res in tool_messages(worker):
        assert res.startswith("Tool error:") and "outside the project directory" in res
    assert (tmp_path / "secret.txt").read_text() == "TOPSECRET\n"
    assert not any("TOPSECRET" in p for p in model.prompts)
    assert [c.state for c in sink.cards() if c.state in ("done", "failed")] == ["failed", "failed"]


def lines_file(path, n, word):
    path.write_text("".join(f"{i:04d} the quick {word} fox jumps\n" for i in range(n)))


def test_large_tool_result_forces_compaction_then_the_task_continues(tok, tmp_path, agents):
    lines_file(tmp_path / "a.txt", 70, "amber")
    lines_file(tmp_path / "b.txt", 110, "blue")

    def script(prompt):
        user = last_real_user(prompt)
        if COMPACT_MARK in user:
            return "Goal: read a.txt then b.txt. a.txt has 70 numbered lines. Next: read b.txt."
        name = "a.txt" if "a.txt" in user else "b.txt"
        if "Durable task-state summary" in prompt:
            return steps(dsml("read", path=name), "b.txt has 110 lines.")(prompt)
        return steps(dsml("read", path=name), f"{name} was read.")(prompt)

    model, engine, worker, sink = agents(tok, script, tmp_path, ctx=4096)
    assert worker.run_turn("read a.txt") == TurnEnd("answered")
    before = worker.prompt_tokens()
    assert before < 4096 * 85 // 100 and 4096 - before > 1024  # no soft trigger: only the big result compacts
    compacted = {"done": False}

    def on_event(ev):
        if isinstance(ev, Notice) and ev.text.startswith("COMPACTING rebuilt"):
            compacted["done"] = True

    sink.on_event = on_event
    assert worker.run_turn("now read b.txt") == TurnEnd("answered"), (before, [e for e in sink.of(Notice)])
    assert compacted["done"]
    notes = [e.text for e in sink.of(Notice) if e.kind == "compaction"]
    assert notes[0] == "COMPACTING tool result would exceed context: summarizing durable task state"
    roles = [m.role for m in worker.conv.messages]
    assert roles[:2] == ["system", "system"] and "Durable task-state summary follows" in worker.conv.messages[1].content
    assert "a.txt has 70 numbered lines" in worker.conv.messages[1].content
    # the verbatim tail starts at the user turn, the call and its (whole) result follow
    assert worker.conv.messages[2].content == "now read b.txt"
    assert worker.conv.messages[4].role == "tool" and "(lines 1-110 of 110)" in worker.conv.messages[4].content
    assert worker.conv.messages[-1].content == "b.txt has 110 lines."
    assert not any("the quick amber" in m.content for m in worker.conv.messages)  # a.txt's result is gone
    assert worker.prompt_tokens() < 4096


@pytest.mark.slow  # a 2,500-word reply tokenized and compacted over and over: ~8 CPU s
def test_context_full_mid_reply_compacts_and_continues_the_same_message(tok, tmp_path, agents):
    long = "word " * 2500

    def script(prompt):
        user = last_real_user(prompt)
        if COMPACT_MARK in user:
            return "Goal: write a long reply."
        if "Durable task-state summary" in prompt and prompt.rstrip().endswith("word word word"):
            return " and the end."
        if "first" in user:
            return "Short answer."
        return long + dsml("bash", command="touch never.flag")  # the call is cut by the context end

    model, engine, worker, sink = agents(tok, script, tmp_path, ctx=3072)
    assert worker.run_turn("first question") == TurnEnd("answered")
    end = worker.run_turn("write a long reply")
    assert end == TurnEnd("answered"), [n.text for n in sink.of(Notice)]
    last = worker.conv.messages[-1]
    assert last.role == "assistant" and not last.tool_calls
    assert last.content.lstrip().startswith("word word") and last.content.endswith("word and the end.")
    assert len(tok.encode(last.content)) < 3072 // 10  # only the reply's tail stayed verbatim
    assert not (tmp_path / "never.flag").exists() and not sink.cards("running")
    assert any(n.text.startswith("generation reached compaction reserve") for n in sink.of(Notice))
    assert "Durable task-state summary" in worker.conv.messages[1].content


@pytest.mark.slow  # a reply cut by the compaction reserve, then compacted: ~8 CPU s
def test_a_tool_call_cut_by_the_reserve_is_rolled_back_and_never_run(tok, tmp_path, agents):
    from ds4mlx.agent.prompts import INTERRUPTED_CALL

    def script(prompt):
        user = last_real_user(prompt)
        if COMPACT_MARK in user:
            return "Goal: run a command."
        if "interrupted by context compaction" in prompt:
            return "Retrying with a smaller command later."
        return "word " * 600 + dsml("bash", command="echo " + " ".join(map(str, range(100000, 101500))) + " > big.flag")

    model, engine, worker, sink = agents(tok, script, tmp_path, ctx=3072)
    assert worker.run_turn("run the big command") == TurnEnd("answered")
    assert not (tmp_path / "big.flag").exists() and not sink.cards("running")
    assert INTERRUPTED_CALL in worker.conv.messages[1].content
    assistants = [m for m in worker.conv.messages if m.role == "assistant"]
    assert [m.content for m in assistants] == ["Retrying with a smaller command later."]
    assert not any(m.tool_calls for m in worker.conv.messages)
    assert any("rolled back, not run" in n.text for n in sink.of(Notice))
    assert [(c.name, c.detail) for c in sink.cards("failed")] == [("bash", "cut by the compaction reserve: not run")]


def test_stop_during_prefill_generation_and_bash_then_reopen(tok, tmp_path, agents):
    def script(prompt):
        user = last_real_user(prompt)
        if "slow job" in user:
            return steps(dsml("bash", command="sleep 30; touch finished.flag"), "unreachable")(prompt)
        if "long answer" in user:
            return "one two three four five six seven eight nine ten eleven twelve"
        return "Fine, continuing."

    model, engine, worker, sink = agents(tok, script, tmp_path, prefill_chunk=256)
    worker.start()
    # 1. during prefill: the first chunk is parked, the stop lands, the next chunk never runs
    model.prefill_gate.close()
    worker.submit("hello")
    assert model.prefill_gate.wait_for_waiters(1)
    worker.stop()
    model.prefill_gate.open()
    assert sink.wait_ends(1) == [TurnEnd("stopped")]
    assert engine.stats.cancelled == 1 and model.prefill_calls == 1
    # 2. during generation: three tokens, then the stop
    model.step_gate.close()
    model.step_gate.allow(3)
    worker.submit("long answer please")
    assert model.step_gate.wait_for_waiters(1)
    worker.stop()
    model.step_gate.open()
    assert sink.wait_ends(2)[1] == TurnEnd("stopped")
    partial = worker.conv.messages[-1]
    assert partial.role == "assistant" and "one two" in partial.content and "twelve" not in partial.content
    # 3. during a running bash job: the job is killed, the turn ends
    worker.submit("start the slow job")
    sink.wait(lambda e: isinstance(e, ToolCard) and e.name == "bash" and e.state == "running")
    worker.stop()
    assert sink.wait_ends(3)[2] == TurnEnd("stopped")
    assert tool_messages(worker)[-1].endswith("[job 1 stopped]") and worker.toolbox.bash.running() == []
    assert [c.state for c in sink.cards() if c.name == "bash"][-1] == "stopped"
    # the session is consistent: save it, reopen it in a fresh worker, continue
    path = worker.call(lambda w: w.save_session(str(tmp_path / "s.json")))
    model2, engine2, worker2, sink2 = agents(tok, script, tmp_path)
    worker2.open_session(path)
    assert [m.role for m in worker2.conv.messages] == [m.role for m in worker.conv.messages]
    assert worker2.run_turn("go on") == TurnEnd("answered")
    assert worker2.conv.messages[-1].content == "Fine, continuing."
    assert not (tmp_path / "finished.flag").exists()


def test_session_saved_restarted_and_resumed_from_its_kv_checkpoint(tok, tmp_path, agents):
    from ds4mlx.kv.cache import DiskKVCache
    from ds4mlx.kv.policy import KVCacheOptions

    (tmp_path / "proj").mkdir()
    kvdir = tmp_path / "kv"
    opt = KVCacheOptions(disk_dir=str(kvdir), min_tokens=32, cold_max_tokens=0, continued_interval_tokens=0)
    script = steps(dsml("list", path="."), "The project is empty.")

    def fresh():
        model = ScriptedModel(tok, script)
        return agents(tok, script, tmp_path / "proj", model=model, cache=DiskKVCache.open(opt, model, 4096))

    model, engine, worker, sink = fresh()
    assert worker.checkpoint_system()
    assert worker.run_turn("what is here?") == TurnEnd("answered")
    live = len(engine.session)
    path = worker.save_session(str(tmp_path / "sess.json"))
    worker.close()
    engine.close()
    reasons = sorted(e.reason for e in worker.kv.store.entries())
    assert "agent-system" in reasons and "agent-session" in reasons

    # "restart": a new model, engine, cache and worker; only the files survive
    model2, engine2, worker2, sink2 = fresh()
    worker2.open_session(path)
    assert worker2.run_turn("and now?") == TurnEnd("answered")
    note = [n.text for n in sink2.of(Notice) if n.text.startswith("reopened session")]
    # the first job restored the checkpoint: only the new user turn and the tool result were prefilled
    assert engine2.stats.prefill_tokens < 128 and engine2.stats.jobs == 2
    assert note and note[0].startswith(f"reopened session: {live} of ") and note[0].endswith("cached (disk-text)")


def test_engine_run_on_worker_runs_between_jobs_on_the_engine_thread(tok, tmp_path, agents):
    model, engine, worker, sink = agents(tok, "ok", tmp_path)
    assert engine.run_on_worker(lambda e: (threading.current_thread().name, len(e.session))) == ("ds4mlx-engine", 0)

    def boom(e):
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        engine.run_on_worker(boom)
    assert worker.run_turn("still fine?") == TurnEnd("answered")  # the worker kept serving


def test_a_prompt_typed_while_a_tool_waits_joins_after_its_result(tok, tmp_path, agents):
    def script(prompt):
        user = last_real_user(prompt)
        if "also say bye" in user:
            return "Bye."
        return steps(dsml("bash", command="echo hi"), "unreachable")(prompt)

    model, engine, worker, sink = agents(tok, script, tmp_path, trusted=False, timeout=60.0)
    worker.start()
    worker.submit("say hi")
    pending = sink.wait(lambda e: isinstance(e, PendingApproval))
    worker.submit("also say bye")  # typed while the approval is open
    pending.answer(True)
    assert sink.wait_ends(1) == [TurnEnd("answered")]
    assert [(m.role, m.content.splitlines()[-1] if m.content else "") for m in worker.conv.messages[1:]] == [
        ("user", "say hi"),
        ("assistant", ""),
        ("tool", "[exit code 0]"),
        ("user", "also say bye"),
        ("assistant", "Bye."),
    ]
    worker.call(lambda w: None)  # anything still queued would run before this
    assert len(sink.ends()) == 1
