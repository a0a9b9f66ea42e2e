"""The disk KV cache through `ds4mlx serve` processes that are restarted
between turns (127.0.0.1, official `openai` / `anthropic` SDKs).

Prefill is measured with `GET /v1/ds4mlx/stats` (`engine.prefill_tokens`:
prompt tokens this process actually evaluated); the `--trace` file gives the
rendered prompts and raw outputs, so the expected reuse is derived, not
guessed:

* a ~5.4K-token chat (demo model): turn 1 cold, SIGINT (shutdown checkpoint),
  restart, turn 2 prefills only the suffix and reports the reuse as
  `cached_tokens` (OpenAI: the whole first turn, from the shutdown
  checkpoint) / `cache_read_input_tokens` (Anthropic, thinking on: the cold
  checkpoint at the chat anchor); a shorter Responses exchange reports it in
  `input_tokens_details.cached_tokens`;
* a tool call (scripted model that samples non-canonical DSML), restart (tool
  memory gone), tool result: the KTM trailer brings the exact DSML back, the
  request hits the checkpoint and only the tool-result suffix is prefilled;
  with exact replay disabled the same request cannot reach it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from lazy_modules import lazy

sys.path.insert(0, str(Path(__file__).parent))
from signal_helpers import ctrl_c_default  # noqa: E402
from test_server_cli import free_port, wait_up  # noqa: E402

openai = lazy("openai")
anthropic = lazy("anthropic")

MODEL = "deepseek-v4-flash"
TESTS = Path(__file__).parent
TEXT = (TESTS.parent / "ds4mlx" / "data" / "bench_text.txt").read_text(encoding="utf-8")
LONG = "\n\n".join(f"Section {i}.\n{TEXT}" for i in range(6))  # ~5.4K tokens
USER = "<｜User｜>"
GREEDY = {"temperature": 0}  # (this anthropic SDK's create() has no temperature argument)


# end to end (servers, several processes or models, whole files): the slow tier, which CI runs second
pytestmark = pytest.mark.slow


class Server:
    """`ds4mlx serve` (or a launcher script with the same CLI) in `root`,
    restartable; its log goes to root/serve-N.log."""

    def __init__(self, root: Path, *args: str, launcher: Path | None = None):
        self.root, self.args, self.launcher = root, list(args), launcher
        self.runs = 0
        self.proc = None

    def start(self, *extra: str) -> Server:
        self.runs += 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        head = [sys.executable, str(self.launcher)] if self.launcher else [sys.executable, "-m", "ds4mlx.cli", "serve"]
        cmd = head + [
            "--port",
            str(self.port),
            "--chdir",
            str(self.root),
            "--kv-disk-dir",
            "kv",
            "--trace",
            "trace.jsonl",
            *self.args,
            *extra,
        ]
        self.log_path = self.root / f"serve-{self.runs}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(TESTS.parent)),
            preexec_fn=ctrl_c_default,  # stopped with SIGINT
        )
        wait_up(self.url, self.proc)
        return self

    def stop(self, sig: int = signal.SIGINT) -> str:
        """SIGINT / SIGTERM (clean exit: the shutdown checkpoint is written); the log."""
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=300)
        self._log.close()
        out = self.log_path.read_text()
        assert rc == 0, out[-3000:]
        self.proc = None
        return out

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self._log.close()

    def stats(self) -> dict:
        return json.loads(urllib.request.urlopen(self.url + "/v1/ds4mlx/stats", timeout=30).read())

    def trace(self) -> list[dict]:
        return [json.loads(x) for x in (self.root / "trace.jsonl").read_text().splitlines()]

    def openai(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=600)

    def anthropic(self):
        return anthropic.Anthropic(base_url=self.url, api_key="x", max_retries=0, timeout=600)


@pytest.fixture
def server(tmp_path):
    made = []

    def make(*args, **kw) -> Server:
        s = Server(tmp_path, *args, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.kill()


def expected_reuse(t1: dict, t2: dict, live: int, anchor: int) -> int:
    """What turn 2 can reuse after the restart: the whole turn-1 session (its
    shutdown checkpoint's key is prompt 1 + the raw output) when that text is
    a prefix of prompt 2; otherwise the cold checkpoint at the chat anchor."""
    return live if t2["prompt"].startswith(t1["prompt"] + t1["raw_text"]) else anchor


def anchor_of(prompt: str) -> int:
    """Token index of the ⟨User⟩ before the first ⟨Assistant⟩ (the cold save point)."""
    from ds4mlx.runtime.tokenizer import Tokenizer

    return len(Tokenizer.default().encode(prompt[: prompt.index(USER)]))


# ------------------------------------------------------------------------------- demo model
def test_openai_chat_resumes_from_disk_after_restart(server):
    srv = server("--ctx", "8192", "--kv-cache-min-tokens", "256").start()
    msgs = [{"role": "system", "content": LONG}, {"role": "user", "content": "Summarise section 3."}]
    r1 = srv.openai().chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0, reasoning_effort="none"
    )
    u1 = r1.usage
    assert u1.prompt_tokens > 5000 and u1.prompt_tokens_details.cached_tokens == 0
    st = srv.stats()
    assert st["engine"]["prefill_tokens"] == u1.prompt_tokens  # cold
    assert st["kv_disk_cache"]["stores"] == {"cold": 1}
    live = st["live_tokens"]
    log = srv.stop()
    assert f"stored tokens={live} reason=shutdown" in log

    srv.start()  # a new process: nothing in memory
    msgs2 = msgs + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And section 4?"},
    ]
    r2 = srv.openai().chat.completions.create(
        model=MODEL, messages=msgs2, max_tokens=8, temperature=0, reasoning_effort="none"
    )
    u2 = r2.usage
    t1, t2 = srv.trace()
    want = expected_reuse(t1, t2, live, anchor_of(t1["prompt"]))
    st = srv.stats()
    assert st["engine"]["last_cache_source"] == "disk-text" and st["kv_disk_cache"]["hits"] == 1
    assert u2.prompt_tokens_details.cached_tokens == want > 5000
    assert st["engine"]["prefill_tokens"] == u2.prompt_tokens - want == u2.prompt_tokens_details.cache_write_tokens
    assert want == live, "the demo's greedy answer round-trips: the whole first turn is reused"
    srv.stop()


def test_anthropic_messages_resume_from_disk_after_restart(server):
    srv = server("--ctx", "8192", "--kv-cache-min-tokens", "256").start()
    system = LONG.replace("Section", "Part")
    msgs = [{"role": "user", "content": "What is part 2 about?"}]
    think = {"type": "enabled", "budget_tokens": 1024}  # Anthropic thinking is off unless asked for (#17)
    m1 = srv.anthropic().messages.create(
        model=MODEL, system=system, messages=msgs, max_tokens=8, thinking=think, extra_body=GREEDY
    )
    assert m1.usage.cache_read_input_tokens == 0 and m1.usage.cache_creation_input_tokens > 5000
    live = srv.stats()["live_tokens"]
    log = srv.stop()
    # The shutdown save holds the whole live session, unless its text ends inside a UTF-8
    # character (a random-weight answer cut by max_tokens can): such a key could not be
    # matched against prompt text, so the store skips it and says why.  The next turn is
    # served from the cold checkpoint either way (below).
    assert (
        f"stored tokens={live} reason=shutdown" in log
        or f"skipped tokens={live} reason=shutdown: key ends inside a character" in log
    ), log

    srv.start()
    msgs2 = msgs + [
        {"role": "assistant", "content": [b.model_dump() for b in m1.content]},
        {"role": "user", "content": "And part 5?"},
    ]
    with srv.anthropic().messages.stream(
        model=MODEL, system=system, messages=msgs2, max_tokens=8, thinking=think, extra_body=GREEDY
    ) as stream:
        first = next(iter(stream))
        m2 = stream.get_final_message()
    assert first.type == "message_start"
    t1, t2 = srv.trace()
    want = expected_reuse(t1, t2, live, anchor_of(t1["prompt"]))
    st = srv.stats()
    assert st["engine"]["last_cache_source"] == "disk-text"
    assert first.message.usage.cache_read_input_tokens == m2.usage.cache_read_input_tokens == want > 5000
    assert st["engine"]["prefill_tokens"] == m2.usage.cache_creation_input_tokens
    # Thinking is on and 8 tokens end turn 1 inside the reasoning: the replayed
    # history closes the think block, the live text does not, so the shutdown
    # checkpoint is not a prefix; the cold checkpoint at the chat anchor
    # (system prompt) serves, and only the rest is prefilled.
    assert want == anchor_of(t1["prompt"]) and t1["prompt"].endswith("<think>")
    srv.stop()


def test_responses_input_tokens_details_report_disk_hits(server):
    srv = server("--ctx", "4096", "--kv-cache-min-tokens", "256").start()
    r1 = srv.openai().responses.create(
        model=MODEL, instructions=TEXT, input="Who keeps the lighthouse?", max_output_tokens=4, temperature=0
    )
    assert r1.usage.input_tokens_details.cached_tokens == 0
    live = srv.stats()["live_tokens"]
    srv.stop()

    srv.start()
    history = [
        {"role": "user", "content": "Who keeps the lighthouse?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": r1.output_text}]},
        {"role": "user", "content": "Since when?"},
    ]
    r2 = srv.openai().responses.create(
        model=MODEL, instructions=TEXT, input=history, max_output_tokens=4, temperature=0
    )
    t1, t2 = srv.trace()
    want = expected_reuse(t1, t2, live, anchor_of(t1["prompt"]))
    st = srv.stats()
    assert st["engine"]["last_cache_source"] == "disk-text"
    assert r2.usage.input_tokens_details.cached_tokens == want > 256
    assert st["engine"]["prefill_tokens"] == r2.usage.input_tokens - want
    srv.stop()


# ------------------------------------------------------------------------------- tool continuation
SAMPLED_DSML = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="calc">\n'
    '<｜DSML｜parameter name="xs" string="false">[1,  2, 3]</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
CANONICAL_XS = '<｜DSML｜parameter name="xs" string="false">[1,2,3]</｜DSML｜parameter>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Add numbers",
            "parameters": {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "number"}}}},
        },
    }
]

LAUNCHER = '''\
"""`ds4mlx serve`'s CLI over the scripted model double (tests/scripted_model.py)."""
import argparse
import sys

sys.path.insert(0, {tests!r})
from scripted_model import ScriptedModel, last_user_text
from ds4mlx.serve import cli
from ds4mlx.runtime.tokenizer import Tokenizer

DSML = {dsml!r}


def script(prompt):
    think = prompt.endswith("<think>")
    if "<tool_result>" in last_user_text(prompt):
        return ("Adding.</think>" if think else "") + "The sum is 6."
    return ("Need calc.</think>" if think else "") + "Calling calc." + DSML


tok = Tokenizer.default()
parser = argparse.ArgumentParser()
cli.add_arguments(parser)
sys.exit(cli.run(parser.parse_args(), loaded=(ScriptedModel(tok, script), tok)))
'''


def test_tool_result_after_restart_hits_disk_with_exact_dsml_from_ktm(server, tmp_path):
    launcher = tmp_path / "scripted_serve.py"
    launcher.write_text(LAUNCHER.format(tests=str(TESTS), dsml=SAMPLED_DSML))
    srv = server("--ctx", "4096", "--kv-cache-min-tokens", "256", launcher=launcher).start()
    msgs = [{"role": "system", "content": TEXT}, {"role": "user", "content": "Add 1, 2 and 3."}]
    r1 = srv.openai().chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
    c = r1.choices[0]
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.function.arguments == '{"xs":[1,2,3]}'  # JSON for the client; the model wrote "[1,  2, 3]"
    live = srv.stats()["live_tokens"]
    assert f"stored tokens={live} reason=shutdown" in srv.stop(signal.SIGTERM)

    srv.start()  # tool memory is gone with the process; the checkpoint's KTM trailer remains
    st = srv.stats()
    assert st["kv_disk_cache"]["tool_ids_loaded"] == 1 and st["engine"]["prefill_tokens"] == 0
    extra = c.message.model_extra or {}
    msgs2 = msgs + [
        {
            "role": "assistant",
            "content": c.message.content,
            "reasoning_content": extra.get("reasoning_content"),
            "tool_calls": [call.model_dump()],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "6"},
    ]
    r2 = srv.openai().chat.completions.create(model=MODEL, messages=msgs2, tools=TOOLS)
    assert r2.choices[0].message.content == "The sum is 6."
    st = srv.stats()
    u = r2.usage
    assert st["engine"]["last_cache_source"] == "disk-text"
    assert u.prompt_tokens_details.cached_tokens == live
    assert st["engine"]["prefill_tokens"] == u.prompt_tokens - live == u.prompt_tokens_details.cache_write_tokens
    t2 = srv.trace()[-1]["prompt"]
    assert SAMPLED_DSML in t2 and CANONICAL_XS not in t2  # the exact sampled bytes were replayed
    srv.stop()

    # Control: without exact replay the history renders canonically and cannot
    # reach the tool-call checkpoint (only the cold prefix before the user turn).
    srv.start("--disable-exact-dsml-tool-replay")
    r3 = srv.openai().chat.completions.create(model=MODEL, messages=msgs2, tools=TOOLS)
    t3 = srv.trace()[-1]["prompt"]
    assert CANONICAL_XS in t3 and SAMPLED_DSML not in t3
    assert r3.usage.prompt_tokens_details.cached_tokens < live
    srv.stop()
