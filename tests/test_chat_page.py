"""The browser chat page (docs/chat-page.md) in a real browser: Playwright from PyPI
driving Debian's Chromium (headless, no browser download) against `serve` on the demo
models.  The page is loaded, an answer streams in with its figures, a long answer is
stopped mid-stream (the server counts the cancel), the conversation survives a reload,
a message is edited and sent again, and an image goes out on the vision demo.  Each
step leaves a screenshot in out/chat-page/ (git-ignored).

Without Chromium (`apt-get install chromium`; .ci/run installs it) the browser tests
are skipped; the HTTP checks of `/` run everywhere."""

from __future__ import annotations

import base64
import json
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import serve  # noqa: E402
from vision_helpers import image_bytes  # noqa: E402

SHOTS = Path(__file__).resolve().parent.parent / "out" / "chat-page"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
BROWSER_HTML = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"  # Chromium's navigation Accept


@pytest.fixture(scope="module")
def demo_server():
    import ds4mlx

    model, tok = ds4mlx.load("demo")
    with serve(tok, model, ctx=4096) as s:
        yield s


def stats(s) -> dict:
    return requests.get(s.url + "/v1/ds4mlx/stats", timeout=30).json()


# --- `/` for API clients and browsers (no browser needed) ---------------------------------


def test_root_is_health_json_for_clients_and_the_page_for_browsers(demo_server):
    url = demo_server.url
    for accept in (None, "*/*", "application/json", "text/html;q=0"):
        r = requests.get(url + "/", headers={"Accept": accept} if accept else {}, timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, accept
        assert r.headers["Vary"] == "Accept"
    page = requests.get(url + "/", headers={"Accept": BROWSER_HTML}, timeout=30)
    assert page.status_code == 200 and page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert page.headers["Vary"] == "Accept"
    # only this origin's files: nothing from a CDN can load, nothing inline can run
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert refs and all(r.startswith("ui/") or r == "data:," for r in refs), refs
    for ref in refs:
        if ref.startswith("ui/"):
            asset = requests.get(url + "/" + ref, timeout=30)
            assert asset.status_code == 200 and asset.content, ref
    assert requests.head(url + "/", timeout=30).status_code == 200
    missing = requests.get(url + "/ui/secret.py", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "unknown endpoint"
    assert requests.get(url + "/ui/..%2Fapp.py", timeout=30).status_code == 404
    assert stats(demo_server)["vision"] is False


# --- the browser ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api", reason="the `playwright` package is not installed")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield b
        b.close()


def open_page(browser, url: str, **context):
    ctx = browser.new_context(viewport={"width": 1100, "height": 760}, **context)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(url + "/")
    page.get_by_text("ctx 4,096").wait_for()  # the header read /v1/models
    return page, errors


def shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"))


def set_setting(page, label: str, value: str) -> None:
    """Through the labelled control (the settings panel opened by its button)."""
    if page.get_attribute("#toggle-settings", "aria-expanded") != "true":
        page.get_by_role("button", name="Settings").click()
    field = page.get_by_label(label, exact=True)
    if field.evaluate("e => e.tagName") == "SELECT":
        field.select_option(value)
    else:
        field.fill(value)
        field.press("Tab")  # commits the change


def send(page, text: str) -> None:
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_label("Message", exact=True).press("Enter")


WATCH_LIVE = """() => {
  window.__seen = new Set();
  const box = document.getElementById('messages');
  new MutationObserver(() => {
    const live = box.querySelector('[data-live] .content');
    if (live && live.textContent) window.__seen.add(live.textContent.length);
  }).observe(box, {subtree: true, childList: true, characterData: true});
}"""


def test_chat_page_streams_stops_and_keeps_the_conversation(browser, demo_server):
    page, errors = open_page(browser, demo_server.url)
    shot(page, "1-loaded")
    set_setting(page, "Thinking", "off")
    set_setting(page, "Temperature", "0")
    set_setting(page, "Max tokens", "24")
    page.get_by_role("button", name="Settings").click()

    # a streamed answer: the text grows while the answer is live, then the figures
    page.evaluate(WATCH_LIVE)
    send(page, "Write a haiku about lighthouses")
    figures = page.locator(".msg.assistant .figures").last
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant:not([data-live]) .figures')?.textContent.includes('finish:')"
    )
    assert len(page.evaluate("[...window.__seen]")) >= 2, "the answer did not arrive in pieces"
    answer = page.locator(".msg.assistant .content").last.inner_text()
    assert answer.strip()
    line = figures.inner_text()
    fig = re.search(
        r"prompt (\d+) tokens \((\d+) cached, (\d+) new\) · prefill [\d.]+ t/s · (\d+) tokens · decode [\d.]+ t/s · finish: (\w+)",
        line,
    )
    assert fig, line
    assert int(fig[1]) == int(fig[2]) + int(fig[3]) and int(fig[4]) <= 24 and fig[5] in ("length", "stop")
    engine = stats(demo_server)["engine"]
    assert engine["jobs"] == 1 and engine["prefill_tokens"] == int(fig[3])  # the figures are the server's counts
    shot(page, "2-streamed-answer")

    # stop a long answer mid-stream: the page says so and the server cancelled the job
    set_setting(page, "Max tokens", "3000")
    page.get_by_role("button", name="Settings").click()
    send(page, "Now tell me a very long story")
    page.wait_for_function("() => document.querySelector('[data-live] .content')?.textContent.length > 0")
    shot(page, "3-streaming")
    page.get_by_role("button", name="Stop").click()
    page.get_by_text("finish: stopped").wait_for()
    assert page.get_by_role("status").inner_text() == "Stopped."
    deadline = time.monotonic() + 30
    while stats(demo_server)["engine"]["cancelled"] < 1:  # the worker sees the cancel at its next token
        assert time.monotonic() < deadline, "the server never cancelled the stopped answer"
        time.sleep(0.05)
    stopped = page.locator(".msg.assistant .content").last.inner_text()
    shot(page, "4-stopped")

    # reload: the conversation is still there, answers and all
    page.reload()
    page.get_by_text("ctx 4,096").wait_for()
    assert page.get_by_role("button", name="Write a haiku about lighthouses", exact=True).count() == 1
    contents = page.locator(".msg.assistant .content").all_inner_texts()
    assert contents == [answer, stopped]
    assert "finish: stopped" in page.locator(".msg.assistant .figures").last.inner_text()
    shot(page, "5-reloaded")

    # export: every conversation as JSON, the same the page keeps
    with page.expect_download() as dl:
        page.get_by_role("button", name="Export JSON").click()
    exported = json.loads(Path(dl.value.path()).read_text())
    kept = json.loads(page.evaluate("localStorage.getItem('ds4mlx.chat.conversations')"))
    assert exported["conversations"] == kept["conversations"] and len(kept["conversations"]) == 1
    messages = exported["conversations"][0]["messages"]
    assert [(m["role"], m.get("finish")) for m in messages] == [
        ("user", None),
        ("assistant", fig[5]),
        ("user", None),
        ("assistant", "stopped"),
    ]

    # edit the first message and send it again: the history after it is replaced
    set_setting(page, "Max tokens", "8")
    page.get_by_role("button", name="Settings").click()
    page.get_by_role("button", name="Edit").first.click()
    page.get_by_label("Edit message").fill("Write a haiku about the sea")
    page.get_by_role("button", name="Save and send").click()
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant:not([data-live]) .figures')?.textContent.includes('finish:')"
    )
    assert page.locator(".msg").count() == 2
    assert page.locator(".msg.user .plain").inner_text() == "Write a haiku about the sea"
    saved = json.loads(page.evaluate("localStorage.getItem('ds4mlx.chat.conversations')"))
    (conv,) = saved["conversations"]
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    assert conv["messages"][1]["figures"]["completion"] <= 8

    # a phone-sized window: the chat list folds away behind its button
    page.set_viewport_size({"width": 390, "height": 760})
    page.reload()
    page.get_by_text("ctx 4,096").wait_for()
    assert not page.locator("#sidebar").is_visible()
    page.get_by_role("button", name="Chats").click()
    assert page.locator("#sidebar").is_visible()
    page.get_by_role("button", name="Chats").click()
    shot(page, "6-phone")
    assert not errors, errors


def test_markdown_renderer_escapes_before_it_formats(browser, demo_server):
    page, errors = open_page(browser, demo_server.url)
    cases = {
        "xss": "<img src=x onerror=alert(1)> <script>alert(2)</script> [a](javascript:alert(3)) "
        '<a href="javascript:alert(4)">b</a> [c](https://x.org/"onmouseover="alert(5))',
        "formats": "# Title\n\n**bold** *it* `a<b` ~~gone~~\n\n- one\n- two\n\n1. first\n\n> quoted\n\n"
        "| a | b |\n|---|--:|\n| 1 | 2 |\n\n```python\nif a < b:\n    print('<tag>')\n```\n\nsee https://example.org.",
        "unclosed": "```js\nlet x = 1;",
    }
    out = page.evaluate(
        """(cases) => {
      const res = {};
      for (const [k, src] of Object.entries(cases)) {
        const box = document.createElement('div');
        box.innerHTML = window.ds4md.render(src);
        const els = [...box.querySelectorAll('*')];
        res[k] = {
          tags: [...new Set(els.map(e => e.tagName.toLowerCase()))].sort(),
          attrs: [...new Set(els.flatMap(e => [...e.attributes].map(a => a.name)))].sort(),
          hrefs: [...box.querySelectorAll('a')].map(a => a.getAttribute('href')),
          code: [...box.querySelectorAll('pre code')].map(c => c.textContent),
          text: box.textContent,
        };
      }
      return res;
    }""",
        cases,
    )
    xss = out["xss"]
    assert set(xss["tags"]) <= {"p", "a", "br"} and not [a for a in xss["attrs"] if a.startswith("on")], xss
    assert all(h.startswith("https://") for h in xss["hrefs"]) and "<script>alert(2)</script>" in xss["text"]
    fmt = out["formats"]
    assert {"h1", "strong", "em", "code", "del", "ul", "ol", "li", "blockquote", "table", "th", "td", "pre"} <= set(
        fmt["tags"]
    )
    assert fmt["code"] == ["if a < b:\n    print('<tag>')"] and fmt["hrefs"] == ["https://example.org"]
    assert out["unclosed"]["code"] == ["let x = 1;"]

    # the server's refusal is shown where the answer would be, in its own words
    send(page, "word " * 5000)
    alert = page.get_by_role("alert")
    alert.wait_for()
    assert re.fullmatch(
        r"400: Prompt has \d+ tokens, but the configured context size is 4096 tokens", alert.inner_text()
    )
    assert page.get_by_role("status").inner_text().startswith("Failed: 400")
    assert [e for e in errors if "400 (Bad Request)" not in e] == []  # the console's note of the failed fetch


def test_image_attach_on_the_vision_demo(browser, tmp_path):
    import ds4mlx
    from ds4mlx.vision.load import load_vision

    model, tok = ds4mlx.load("demo:qwen4_exp")
    png = tmp_path / "picture.png"
    png.write_bytes(image_bytes(48, 32))
    with serve(tok, model, ctx=4096) as s:
        s.engine.enable_vision(load_vision("demo", model))
        page, errors = open_page(browser, s.url)
        sent: list = []
        page.on("request", lambda r: sent.append(r) if r.method == "POST" else None)
        set_setting(page, "Thinking", "off")
        set_setting(page, "Max tokens", "6")
        set_setting(page, "API key", "page-test-key")
        page.get_by_role("button", name="Settings").click()
        page.get_by_text("Attach image").wait_for()  # shown once the page read `vision` from the stats
        page.get_by_label("Attach image").set_input_files(str(png))
        page.get_by_role("img", name="Image 1 to send").wait_for()
        shot(page, "7-image-attached")
        send(page, "What is in this picture?")
        page.wait_for_function(
            "() => document.querySelector('.msg.assistant:not([data-live]) .figures')?.textContent.includes('finish:')"
        )
        shot(page, "8-image-answered")
        assert page.get_by_role("img", name="Attached image 1").is_visible()
        assert not page.locator(".msg.assistant .error").is_visible()
        (req,) = sent
        assert req.headers["authorization"] == "Bearer page-test-key"
        (user,) = req.post_data_json["messages"]
        image, text = user["content"]
        assert text == {"type": "text", "text": "What is in this picture?"}
        media, _, data = image["image_url"]["url"].partition(";base64,")
        assert media == "data:image/png" and base64.b64decode(data) == png.read_bytes()
        assert s.engine.live_images is not None  # the prompt the server ran held the image
        assert not errors, errors


BASH_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


def listing_script(prompt: str) -> str:
    """Reasoning, then a tool call; after the tool's result, reasoning and a Markdown answer."""
    from agent_helpers import dsml

    if "<tool_result>" in prompt:
        return "Two names.</think>The listing has **two** files:\n\n```\na.txt\nb.txt\n```"
    return "Need ls.</think>" + dsml("bash", command="ls /tmp")


def test_reasoning_and_tool_calls_on_a_scripted_model(browser):
    from scripted_model import ScriptedModel

    from ds4mlx.runtime.tokenizer import Tokenizer

    tok = Tokenizer.default()
    with serve(tok, ScriptedModel(tok, listing_script), ctx=4096) as s:
        page, errors = open_page(browser, s.url)
        posts: list = []
        page.on("request", lambda r: posts.append(r.post_data_json) if r.method == "POST" else None)
        set_setting(page, "Tools (JSON array, optional)", json.dumps(BASH_TOOL))
        page.get_by_role("button", name="Settings").click()
        send(page, "List /tmp")
        page.get_by_text("finish: tool_calls").wait_for()
        thoughts = page.locator(".msg.assistant details.reasoning")
        assert thoughts.is_visible() and thoughts.get_attribute("open") is None  # shown, collapsed
        assert page.locator(".reasoning-body").text_content() == "Need ls."  # collapsed: not rendered
        card = page.get_by_role("group", name="Tool call bash", exact=True)
        assert json.loads(card.locator("pre").inner_text()) == {"command": "ls /tmp"}
        call_id = card.locator(".call-id").inner_text().removeprefix("id ")
        hint = page.locator("#tool-reply")
        assert hint.is_visible() and call_id in hint.inner_text()
        shot(page, "9-tool-call")

        send(page, "a.txt\nb.txt")  # the tool's result
        page.get_by_text("finish: stop").wait_for()
        assert posts[0]["tools"] == BASH_TOOL and posts[0]["think"] is True
        history = posts[1]["messages"]
        assert [m["role"] for m in history] == ["user", "assistant", "tool"]
        assert history[1]["tool_calls"][0]["id"] == call_id and history[1]["reasoning_content"] == "Need ls."
        assert history[2] == {"role": "tool", "tool_call_id": call_id, "content": "a.txt\nb.txt"}
        answer = page.locator(".msg.assistant .content").last
        assert answer.locator("strong").inner_text() == "two"
        assert answer.locator("pre code").inner_text() == "a.txt\nb.txt"
        assert not hint.is_visible()
        page.set_viewport_size({"width": 1100, "height": 1000})  # the whole exchange (docs/chat-page.png)
        shot(page, "10-tool-answer")
        assert not errors, errors
