"""`ds4mlx chat` driven in a pseudo-terminal (pexpect) on the demo model: ds4's
REPL commands (/help, /think, /think N, /think-max, /nothink, /ctx, /read,
/steer, /quit), readline history, and Ctrl+C in the middle of an answer: the
answer stops, the REPL stays, and the next prompt extends the live session
(its cached tokens are everything the interrupted turn left in it)."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
from signal_helpers import ctrl_c_default

pexpect = pytest.importorskip("pexpect")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATUS = re.compile(r"ctx (\d+)/(\d+) \| prompt (\d+) \((\d+) cached\)[^\r\n]*\| interrupted")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PROMPT = "> "
TIMEOUT = 120


def spawn(tmp_path, *flags, ready=PROMPT):
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        DS4MLX_HISTORY=str(tmp_path / "history"),
        TERM="dumb",
        NO_COLOR="1",
        COLUMNS="160",
        PYTHONUNBUFFERED="1",
    )
    child = pexpect.spawn(
        sys.executable,
        ["-m", "ds4mlx.cli", "chat", *flags],
        env=env,
        cwd=str(tmp_path),
        encoding="utf-8",
        timeout=TIMEOUT,
        dimensions=(50, 160),
        preexec_fn=ctrl_c_default,  # Ctrl+C as at a terminal, however pytest was started
    )
    child.logfile_read = open(tmp_path / "session.log", "w")  # kept for a failing run
    child.expect("Ctrl\\+D quits")
    if ready:
        child.expect_exact(ready)
    return child


def command(child, line: str, expect: str) -> str:
    child.sendline(line)
    child.expect(expect)
    text = ANSI.sub("", child.before + child.after)
    child.expect_exact(PROMPT)
    return text


def status(child) -> tuple[int, int, int, int]:
    """The status line of the turn Ctrl+C stopped (ctx used, ctx total, prompt, cached)."""
    child.expect(STATUS)
    used, total, prompt, cached = (int(g) for g in child.match.groups())
    child.expect_exact(PROMPT)
    return used, total, prompt, cached


def test_repl_commands_read_ctx_and_ctrl_c(tmp_path):
    from ds4mlx.chat.messages import Conversation, Message
    from ds4mlx.chat.protocol import get_protocol
    from ds4mlx.runtime.tokenizer import Tokenizer

    child = spawn(tmp_path, "--nothink", "-n", "100000", "--ctx", "8192", "--temp", "1")
    try:
        assert "/think-max" in command(child, "/help", "/quit")
        command(child, "/think", "thinking: high")
        command(child, "/think 30", "/think N requires V4.1")  # the demo is DeepSeek V4
        command(child, "/think-max", r"thinking: high \(context below 393,216\)")
        command(child, "/nothink", "thinking: off")
        command(child, "/frobnicate", "unknown command: /frobnicate")

        # /ctx: a new context of that size
        command(child, "/ctx 3000", "context: 3000 tokens")

        # /read: the file's text is the next message, rendered with the template
        text = "Please summarise this file.\nIt has two lines."
        (tmp_path / "msg.txt").write_text(text)
        child.sendline("/read msg.txt")
        child.expect("ds4mlx:")
        child.expect(r"\S{3}")  # the answer is streaming
        child.sendintr()  # stop the answer
        used, total, prompt, cached = status(child)
        expect_ids = Tokenizer.default().encode(
            get_protocol("deepseek_v4").render(Conversation([Message("user", text)], thinking="none"))
        )
        assert (total, prompt, cached) == (3000, len(expect_ids), 0)
        assert used > prompt  # something was generated before Ctrl+C

        # Ctrl+C mid-answer, then a second prompt that reuses the session
        child.sendline("tell me a long story")
        child.expect("ds4mlx:")
        child.expect(r"\S{3}")  # the answer is streaming
        child.sendintr()
        used1, _, prompt1, cached1 = status(child)
        assert cached1 == used  # the previous turn's state was reused
        assert used1 > prompt1
        child.sendline("and now?")
        child.expect("ds4mlx:")
        child.expect(r"\S{3}")
        child.sendintr()
        used2, _, prompt2, cached2 = status(child)
        assert cached2 == used1  # everything the interrupted turn left in the session
        assert prompt2 > used1

        # Ctrl+C at the prompt only clears the line
        child.send("half a line")
        child.expect_exact(
            "half a line"
        )  # echoed: the REPL reads this line (a prompt already in the buffer must not match)
        child.sendintr()
        child.expect_exact(PROMPT)
        child.sendeof()  # Ctrl+D quits
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    history = (tmp_path / "history").read_text()
    assert "/read msg.txt" in history and "tell me a long story" in history


def test_repl_steer_and_think_level_refusal(tmp_path):
    from ds4mlx.io.demo import DEMO_CONFIG  # the demo model's shape, without loading it here too

    layers, hidden = DEMO_CONFIG["num_hidden_layers"], DEMO_CONFIG["hidden_size"]
    dirs = np.random.default_rng(0).standard_normal((layers, hidden)).astype("<f4")
    (tmp_path / "dir.f32").write_bytes(dirs.tobytes())
    (tmp_path / "short.f32").write_bytes(dirs.tobytes()[:-8])
    child = spawn(tmp_path, "--nothink", "-n", "4")
    try:
        command(child, "/steer", "steering: off")
        command(child, "/steer 2", "needs a direction")
        command(child, "/steer dir.f32", r"steering: dir\.f32 ffn=1 attn=0")
        command(child, "/steer -0.5", r"steering: dir\.f32 ffn=-0.5 attn=0")
        command(child, "/steer short.f32", "expected")
        command(child, "/steer off", "steering: off")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    out = pexpect.run(
        f"{sys.executable} -m ds4mlx.cli chat --think-level 40",
        cwd=str(tmp_path),
        timeout=TIMEOUT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        withexitstatus=True,
        encoding="utf-8",
    )
    assert out[1] == 2 and "--think-level requires a DeepSeek V4.1 model" in ANSI.sub("", out[0])


def test_repl_prefills_the_prefix_file(tmp_path):
    """ds4 prefills --prefix-file (after -sys) before the first prompt: the first
    turn finds all of it in the live session."""
    from ds4mlx.chat.messages import Conversation, Message
    from ds4mlx.chat.protocol import get_protocol
    from ds4mlx.runtime.tokenizer import Tokenizer

    (tmp_path / "prefix.txt").write_text("USER: Remember 7.\nASSISTANT: Noted: 7.\n")
    child = spawn(tmp_path, "--nothink", "-n", "100000", "-sys", "Be brief.", "--prefix-file", "prefix.txt")
    try:
        child.sendline("What number?")
        child.expect("ds4mlx:")
        child.expect(r"\S{3}")
        child.sendintr()
        used, total, prompt, cached = status(child)
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    proto = get_protocol("deepseek_v4")
    tok = Tokenizer.default()
    head = [Message("system", "Be brief."), Message("user", "Remember 7."), Message("assistant", "Noted: 7.")]
    whole = proto.render(Conversation(head + [Message("user", "What number?")], thinking="none"))
    assert prompt == len(tok.encode(whole))
    assert cached == len(tok.encode(proto.render(Conversation(head, thinking="none"))))


def test_answers_render_as_markdown():
    """On a terminal the answer is rich Markdown (live while it streams); reasoning
    is printed as is, dimmed; without a terminal the text stays plain."""
    import io

    from rich.console import Console

    from ds4mlx.cli.repl import _AnswerPrinter
    from ds4mlx.runtime.events import ReasoningDelta, TextDelta

    def show(markdown: bool) -> str:
        buf = io.StringIO()
        out = Console(file=buf, force_terminal=markdown, width=60, color_system=None)
        p = _AnswerPrinter(out, markdown)
        for ev in [
            ReasoningDelta("think **raw**"),
            TextDelta("# Title\n\nSome "),
            TextDelta("**bold** text.\n"),
            TextDelta("\n- one\n- two\n"),
        ]:
            p.feed(ev)
        p.close()
        return ANSI.sub("", buf.getvalue())

    md = show(True)
    assert "think **raw**" in md  # reasoning is not Markdown
    answer = md.split("</think>", 1)[1]
    assert "Title" in answer and "Some bold text." in answer and "**" not in answer and "#" not in answer
    assert "• one" in answer and "• two" in answer
    plain = show(False)
    assert "# Title\n\nSome **bold** text.\n\n- one\n- two\n" in plain


def test_repl_sends_the_prompt_file_first(tmp_path):
    """`chat --prompt-file FILE`: FILE's text is the first message, then the REPL goes on."""
    (tmp_path / "q.txt").write_text("First question, from a file.")
    child = spawn(tmp_path, "--nothink", "-n", "3", "--temp", "0", "--prompt-file", "q.txt", ready=None)
    try:
        child.expect("ds4mlx:")
        child.expect(r"ctx (\d+)/\d+ \| prompt (\d+) \(0 cached\)")
        first_used = int(child.match.group(1))
        child.expect_exact(PROMPT)
        child.sendline("and a second one")
        child.expect(r"ctx \d+/\d+ \| prompt \d+ \((\d+) cached\)")
        assert int(child.match.group(1)) == first_used
        child.expect_exact(PROMPT)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
