"""Real tasks end to end on the scripted model (it writes DSML tool calls as V4 would;
the real tokenizer, template, sampler, parser and tools run): fix a failing test
over two turns, a multi-file rename resumed in a second `-p` run, a task stopped
mid-command and resumed from its saved session, a denied write retried once the
user agrees, a long task compacted past the context limit; plus the agent's
engine flags, view_image, /hints, /status, /strip and /del."""

from __future__ import annotations

import argparse
import io
import os
import threading
import time

import pytest
from agent_helpers import COMPACT_MARK, ScriptedModel, dsml, last_real_user, make_worker, steps

from ds4mlx.agent import cli, prompts
from ds4mlx.agent.approval import PendingApproval
from ds4mlx.agent.events import Notice, TurnEnd
from ds4mlx.agent.plain import run_prompt
from ds4mlx.agent.sessions import SessionDir, session_id
from ds4mlx.agent.tools import ToolBox


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


def parse(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def run_p(tok, script, root, prompt, capsys, *flags, session=None, during=None):
    """One `ds4mlx agent -p PROMPT` run on the scripted model, as cli.run does it
    (a session file opened when it exists, saved at the end).  `during(worker)` runs
    on a side thread while the task runs.  -> (exit status, stdout, stderr, worker)."""
    argv = ["-p", prompt, "--yes", "--cwd", str(root), "--ctx", "4096", *flags]
    if session:
        argv += ["--session", str(session)]
    args = parse(*argv)
    engine, worker = cli.build(args, ScriptedModel(tok, script), tok, console=_quiet())
    try:
        if session and session.exists():
            worker.open_session(str(session))
        else:
            worker.session_path = args.session
        side = threading.Thread(target=during, args=(worker,), daemon=True) if during else None
        if side:
            side.start()
        rc = run_prompt(worker, args.prompt, args.session)
        if side:
            side.join(30)
    finally:
        worker.close()
        engine.close()
    out, err = capsys.readouterr()
    return rc, out, err, worker


def _quiet():
    from rich.console import Console

    return Console(file=io.StringIO())


def tool_results(worker):
    return [m.content for m in worker.conv.messages if m.role == "tool"]


# ----------------------------------------------------------------------------- multi-turn tasks
def test_task_fix_a_failing_test_then_document_it(tok, tmp_path, capsys):
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (tmp_path / "test_calc.py").write_text("from calc import add\nassert add(2, 3) == 5, add(2, 3)\nprint('ok')\n")
    # written a minute ago: CPython's .pyc check is (whole-second mtime, size), and the fix keeps the
    # size, so an edit within the second the file was written would run the stale bytecode
    os.utime(tmp_path / "calc.py", (time.time() - 60,) * 2)

    def script(prompt):
        if "docstring" in last_real_user(prompt):
            return steps(
                dsml("edit", path="calc.py", old="def add(a, b):\n", new='def add(a, b):\n    """a + b."""\n'),
                dsml("bash", command="python3 test_calc.py"),
                "Documented `add`; the test still passes.",
            )(prompt)
        return steps(
            dsml("read", path="test_calc.py"),
            dsml("bash", command="python3 test_calc.py"),
            dsml("read", path="calc.py"),
            dsml("edit", path="calc.py", old="a - b", new="a + b"),
            dsml("bash", command="python3 test_calc.py"),
            "Fixed: `add` subtracted; the test passes now.",
        )(prompt)

    sess = tmp_path / "fix.json"
    rc, out, err, w = run_p(tok, script, tmp_path, "make the test pass", capsys, session=sess)
    assert rc == 0 and out == "Fixed: `add` subtracted; the test passes now.\n"
    results = tool_results(w)
    assert "AssertionError: -1" in results[1] and results[1].endswith("[exit code 1]")  # it saw the failure
    assert results[4].splitlines()[1:] == ["ok", "[exit code 0]"]  # ... and the fix pass
    rc, out, err, w = run_p(tok, script, tmp_path, "now add a docstring to add", capsys, session=sess)
    assert rc == 0 and out == "Documented `add`; the test still passes.\n"
    assert (tmp_path / "calc.py").read_text() == 'def add(a, b):\n    """a + b."""\n    return a + b\n'
    users = [m.content for m in w.conv.messages if m.role == "user"]
    assert users == ["make the test pass", "now add a docstring to add"]  # one conversation over both runs


def test_task_rename_across_files_then_answer_from_the_reopened_session(tok, tmp_path, capsys):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/a.py").write_text("def old_name():\n    return 1\n")
    (tmp_path / "pkg/b.py").write_text("from pkg.a import old_name\n\nprint(old_name())\n")

    def script(prompt):
        if "how many" in last_real_user(prompt):
            return "Two files: pkg/a.py and pkg/b.py."
        return steps(
            dsml("search", query="old_name", path="pkg"),
            dsml("edit", path="pkg/a.py", old="def old_name", new="def new_name"),
            dsml("write", path="pkg/b.py", content="from pkg.a import new_name\n\nprint(new_name())\n"),
            dsml("bash", command="python3 -m pkg.b"),
            "Renamed old_name to new_name in both files.",
        )(prompt)

    sess = tmp_path / "rename.json"
    rc, out, err, w = run_p(tok, script, tmp_path, "rename old_name to new_name", capsys, session=sess)
    assert rc == 0 and "Renamed old_name" in out
    hits = tool_results(w)[0].splitlines()
    assert hits == [
        "pkg/a.py:1: def old_name():",
        "pkg/b.py:1: from pkg.a import old_name",
        "pkg/b.py:3: print(old_name())",
    ]
    assert tool_results(w)[3].splitlines()[1:] == ["1", "[exit code 0]"]
    assert "new_name" in (tmp_path / "pkg/a.py").read_text() and "old_name" not in (tmp_path / "pkg/b.py").read_text()
    rc, out, err, w = run_p(tok, script, tmp_path, "how many files changed?", capsys, session=sess)
    assert out == "Two files: pkg/a.py and pkg/b.py.\n"
    assert "how many files changed?" in w.engine.model.prompts[-1] and "Renamed old_name" in w.engine.model.prompts[-1]


def test_task_stopped_mid_command_then_resumed_from_its_session(tok, tmp_path, capsys):
    def script(prompt):
        user = last_real_user(prompt)
        if "in the background" in user:
            return steps(
                dsml("bash", command="echo built > build.log", refresh_sec="5"),
                dsml("read", path="build.log"),
                "The build finished: build.log says built.",
            )(prompt)
        return steps(dsml("bash", command="sleep 60; echo built > build.log"), "unreachable")(prompt)

    def interrupt(worker):  # the user's Ctrl+C once the command runs
        import time

        end = time.monotonic() + 30
        while not worker.toolbox.bash.running() and time.monotonic() < end:
            time.sleep(0.02)
        worker.stop()

    sess = tmp_path / "build.json"
    rc, out, err, w = run_p(tok, script, tmp_path, "run the build", capsys, session=sess, during=interrupt)
    assert rc == 0 and "turn stopped" in err and "session saved to" in err
    assert tool_results(w)[-1].endswith("[job 1 stopped]") and not (tmp_path / "build.log").exists()
    rc, out, err, w = run_p(tok, script, tmp_path, "try again, in the background", capsys, session=sess)
    assert rc == 0 and out == "The build finished: build.log says built.\n"
    assert (tmp_path / "build.log").read_text() == "built\n"
    roles = [m.role for m in w.conv.messages]
    assert roles == [
        "system",
        "user",
        "assistant",
        "tool",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]


def test_task_denied_write_then_retried_when_the_user_agrees(tok, tmp_path):
    def script(prompt):
        user = last_real_user(prompt)
        if "go ahead" in user:
            return steps(dsml("write", path="notes.md", content="# Notes\n"), "Created notes.md.")(prompt)
        return steps(dsml("write", path="notes.md", content="# Notes\n"), "You declined: nothing was written.")(prompt)

    model, engine, worker, sink = make_worker(tok, script, tmp_path, trusted=False, timeout=60.0)
    verdicts = iter([False, True])
    sink.on_event = lambda ev: ev.answer(next(verdicts)) if isinstance(ev, PendingApproval) else None
    try:
        assert worker.run_turn("create notes.md") == TurnEnd("answered")
        assert not (tmp_path / "notes.md").exists() and "denied" in tool_results(worker)[0]
        assert worker.run_turn("ok, go ahead") == TurnEnd("answered")
    finally:
        worker.close()
        engine.close()
    assert (tmp_path / "notes.md").read_text() == "# Notes\n"
    assert [m.content for m in worker.conv.messages if m.role == "assistant" and m.content] == [
        "You declined: nothing was written.",
        "Created notes.md.",
    ]


def test_task_compacted_past_the_context_limit_goes_on_over_turns(tok, tmp_path):
    for name in ("one", "two", "three"):
        (tmp_path / f"{name}.txt").write_text("".join(f"{i:04d} {name} data line here\n" for i in range(100)))

    def script(prompt):
        user = last_real_user(prompt)
        if not user.strip():  # a prefill that ends before any user turn (the system prompt)
            return ""
        if COMPACT_MARK in user:
            return "Task: read the three files, then write summary.md. Done so far: earlier files read."
        if "summary" in user:
            return steps(dsml("write", path="summary.md", content="three files, 100 lines each\n"), "Wrote it.")(prompt)
        name = user.split()[-1]
        return steps(dsml("read", path=f"{name}.txt"), f"{name}.txt has 100 lines.")(prompt)

    model, engine, worker, sink = make_worker(tok, script, tmp_path, ctx=4096)
    try:
        for name in ("one", "two", "three"):
            assert worker.run_turn(f"read {name}") == TurnEnd("answered"), [n.text for n in sink.of(Notice)]
        assert worker.run_turn("now write the summary") == TurnEnd("answered")
    finally:
        worker.close()
        engine.close()
    rebuilt = [n.text for n in sink.of(Notice) if n.text.startswith("COMPACTING rebuilt")]
    assert rebuilt  # the context limit was reached and the conversation rebuilt
    assert not [n for n in sink.of(Notice) if n.kind == "error"]  # every result fitted once compacted
    assert any("Durable task-state summary" in m.content for m in worker.conv.messages if m.role == "system")
    assert (tmp_path / "summary.md").read_text() == "three files, 100 lines each\n"
    assert worker.conv.messages[-1].content == "Wrote it." and worker.prompt_tokens() < 4096
    results = tool_results(worker)
    assert any("(lines 1-100 of 100)" in r and "three data line" in r for r in results)  # the last file, whole


# ----------------------------------------------------------------------------- flags and commands
def test_engine_flags_parse_through_the_shared_option_modules():
    from ds4mlx.experts.cli import config_from_args

    a = parse("--stream-experts", "--expert-cache-count", "2", "--think-max", "--mtp", "--kv-disk-dir", "/tmp/kv")
    cfg = config_from_args(a)
    assert cfg.enabled and cfg.count == 2 and a.think == "max" and a.mtp == "" and a.kv_disk_dir == "/tmp/kv"
    a = parse("--ssd-streaming", "--think-level", "30", "--draft-model", "d.gguf", "--vision", "demo")
    assert a.stream_experts and a.think == 30 and a.draft_model == "d.gguf" and a.vision == "demo"
    a = parse("--dir-steering-file", "s.json", "--dir-steering-ffn", "0.5", "--dtype", "bfloat16")
    assert (a.dir_steering_file, a.dir_steering_ffn, a.dtype) == ("s.json", 0.5, "bfloat16")
    assert parse().think == "none" and parse("--think").think == "high"  # the agent starts without thinking
    with pytest.raises(SystemExit):
        parse("--think-level", "101")


def test_thinking_flags_resolve_for_the_loaded_family(tok, tmp_path):
    args = parse("--cwd", str(tmp_path), "--think-max", "--ctx", "4096")
    console = _quiet()
    engine, worker = cli.build(args, ScriptedModel(tok, "x"), tok, console=console)
    try:
        assert worker.thinking == engine.protocol.resolve_thinking("high", "high", explicit=True, ctx=4096)
        assert "needs --ctx >= " in console.file.getvalue()  # ds4's Think Max downgrade warning
    finally:
        worker.close()
        engine.close()
    with pytest.raises(ValueError, match="--think-level requires a DeepSeek V4.1 model"):
        cli.build(parse("--cwd", str(tmp_path), "--think-level", "40"), ScriptedModel(tok, "x"), tok, console=console)


def test_view_image_only_with_vision_and_confined(tmp_path):
    from PIL import Image

    Image.new("RGB", (3, 2), (255, 0, 0)).save(tmp_path / "red.png")
    (tmp_path / "notes.txt").write_text("not an image\n")
    plain = ToolBox(str(tmp_path))
    assert "view_image" not in plain.names() and "unknown tool" in plain.call("view_image", {"path": "red.png"})
    box = ToolBox(str(tmp_path), vision=True)
    try:
        out = box.call("view_image", {"path": "red.png"})
        (image,) = box.take_images()
        assert out == f"{image.marker}\nred.png: 3x2 image/png image" and (image.width, image.height) == (3, 2)
        assert box.take_images() == []
        assert "reads PNG or JPEG" in box.call("view_image", {"path": "notes.txt"})
        (tmp_path / "fake.png").write_text("no png")
        assert box.call("view_image", {"path": "fake.png"}).startswith("Tool error: fake.png:")
        assert "outside the project" in box.call("view_image", {"path": "../x.png"})
        (tmp_path / "pics.png").mkdir()
        assert "pics.png is a directory" in box.call("view_image", {"path": "pics.png"})
    finally:
        box.close()
        plain.close()


def test_hints_toggle_the_system_prompt_and_status_reports(tok, tmp_path):
    model, engine, worker, sink = make_worker(tok, "Sure.", tmp_path)
    try:
        assert prompts.HINTS not in worker.conv.messages[0].content
        worker.set_hints(True)
        assert worker.run_turn("hi") == TurnEnd("answered")
        assert prompts.HINTS in model.prompts[-1]  # the model read them
        worker.set_hints(False)
        assert prompts.HINTS not in worker.conv.messages[0].content and len(worker.conv.messages) == 3
        report = worker.status_report()
        assert "hints: off" in report and "conversation: 3 messages" in report and str(tmp_path) in report
    finally:
        worker.close()
        engine.close()


def test_strip_keeps_the_text_and_del_removes_a_saved_session(tok, tmp_path):
    from ds4mlx.kv.cache import DiskKVCache
    from ds4mlx.kv.policy import KVCacheOptions

    (tmp_path / "proj").mkdir()
    opt = KVCacheOptions(disk_dir=str(tmp_path / "kv"), min_tokens=32, cold_max_tokens=0, continued_interval_tokens=0)
    script = steps(dsml("list", path="."), "Empty project.")
    sessions = SessionDir(str(tmp_path / "sessions"))

    def fresh():
        model = ScriptedModel(tok, script)
        return make_worker(tok, script, tmp_path / "proj", model=model, cache=DiskKVCache.open(opt, model, 4096))

    model, engine, worker, sink = fresh()
    try:
        worker.checkpoint_system()
        assert worker.run_turn("what is here?") == TurnEnd("answered")
        path = worker.save_session(sessions.path("one"))
        kv = worker.kv
        assert sorted(e.reason for e in kv.store.entries()) == ["agent-session", "agent-system"]
        sid = session_id(path)
        assert sessions.find(sid[:6]) == path and sessions.list()[0][3] == sid
        with pytest.raises(ValueError, match="at least 4 hex digits"):
            sessions.find("ab")
        with pytest.raises(ValueError, match="that session is open"):
            worker.delete_session(path)
        worker.new_conversation()  # another task goes on in the live session (not saved to "one")
        assert worker.session_path is None
        assert worker.run_turn("look again") == TurnEnd("answered")
        n, tokens = worker.strip_session(sessions.find(sid[:6]))
        assert n == 1 and tokens > 0
        assert "agent-session" not in [e.reason for e in kv.store.entries()]
        (system_tokens,) = [e.tokens for e in kv.store.entries() if e.reason == "agent-system"]  # shared: it stays
    finally:
        worker.close()
        engine.close()
    model2, engine2, worker2, sink2 = fresh()  # reopened: the text is all there, the KV is not
    try:
        worker2.open_session(path)
        assert worker2.run_turn("and now?") == TurnEnd("answered")
        note = [n.text for n in sink2.of(Notice) if n.text.startswith("reopened")][0]
        cached = int(note.split()[2])  # "reopened session: N of M prompt tokens cached (disk-text)"
        assert cached == system_tokens < tokens  # restored from the system checkpoint, the rest prefilled again
        worker2.new_conversation()
        assert worker2.delete_session(path) >= 0
        assert sessions.list() == []
    finally:
        worker2.close()
        engine2.close()


def test_view_image_result_carries_the_image_into_the_job(tmp_path):
    """--vision on the Qwen3.8 demo: the view_image result's image becomes its token block
    in the next job (the encoder runs; the reply is the demo's gibberish)."""
    from PIL import Image

    from ds4mlx.chat.messages import Message, ToolCall
    from ds4mlx.engine import Failed
    from ds4mlx.io.loader import load

    Image.new("RGB", (32, 24), (0, 128, 255)).save(tmp_path / "blue.png")
    model, tok = load("demo:qwen4_exp")
    args = parse("--cwd", str(tmp_path), "--vision", "demo", "--ctx", "4096", "--temp", "0")
    engine, worker = cli.build(args, model, tok, console=_quiet())
    try:
        assert "view_image" in worker.toolbox.names() and "view_image" in worker.conv.messages[0].content
        worker.conv.tool_schemas = []  # a short prompt: the demo prefills slowly on a CPU
        worker.conv.messages[0].content = "You look at images."
        result = worker.toolbox.call("view_image", {"path": "blue.png"})
        worker.conv.messages += [
            Message("user", "look at blue.png"),
            Message("assistant", "", tool_calls=[ToolCall("c1", "view_image", '{"path": "blue.png"}')]),
        ]
        worker._append_tool_result("c1", result)
        (image,) = worker.conv.messages[-1].images
        block = engine.vision.n_tokens(image)
        text_only = len(engine.tokenize(worker.render()))
        marker = len(engine.tokenize(image.marker))
        # the marker's text counts as the image's block (a few tokens differ where text merges at its edges)
        assert abs(worker.prompt_tokens() - (text_only - marker + block)) <= 4 and block > marker
        fin = worker._run_job(worker.render(), tools=False, thinking="none", max_tokens=2)
        assert not isinstance(fin, Failed) and fin.reason in ("length", "stop")
    finally:
        worker.close()
        engine.close()
