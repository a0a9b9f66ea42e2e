"""The HTTP wire under the API, over raw sockets: faults aiohttp meets before
the app (bad chunk sizes, smuggling attempts, oversized headers) answer in the
API's JSON error shape, no response carries a Server banner, and a client that
half-closes its socket after sending its request still gets the answer."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, serve  # noqa: E402

CHAT = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def srv():
    from ds4mlx.runtime.tokenizer import Tokenizer

    tok = Tokenizer.default()
    with serve(tok, ScriptedModel(tok, lambda p: "ok"), ctx=512, tokens=4) as s:
        yield s


def skip_interim(data: bytes) -> bytes:
    """Drop complete 1xx interim answers, as every HTTP/1.1 client does."""
    while data.startswith(b"HTTP/1.1 1") and b"\r\n\r\n" in data:
        data = data.split(b"\r\n\r\n", 1)[1]
    return data


def exchange(srv, raw: bytes, *, half_close: bool = False) -> tuple[int, dict, bytes]:
    """Send raw bytes, read the whole answer until the server closes; (status, headers, body)."""
    host, port = srv.url.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(raw)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            data = skip_interim(data)
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head.lower():
                n = int(
                    next(
                        ln.split(b":", 1)[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")
                    )
                )
                if len(body) >= n:
                    break
    head, _, body = skip_interim(data).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines and lines[0].startswith("HTTP/1."), data[:300]
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
    return int(lines[0].split()[1]), headers, body


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def test_half_closed_client_gets_its_answer(srv):
    """(The server cannot tell a half-close from a client that is gone; it
    probes with interim 100 Continue answers, which clients skip.)"""
    status, headers, body = exchange(srv, post("/v1/chat/completions", CHAT), half_close=True)
    assert status == 200 and json.loads(body)["object"] == "chat.completion"
    status, _, body = exchange(srv, post("/v1/messages", CHAT), half_close=True)
    assert status == 200 and json.loads(body)["type"] == "message"
    raw = post("/v1/chat/completions", CHAT).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    host, port = srv.url.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # HTTP/1.0: no 1xx probes
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.0 200") and b"chat.completion" in data


BAD_CHUNKED = b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
FAULTS = {
    "bad chunk size": lambda path: f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode() + BAD_CHUNKED,
    "content-length with chunked": lambda path: (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ).encode(),
    "two content-lengths": lambda path: (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{{}}"
    ).encode(),
    "oversized header": lambda path: (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 20000}\r\nContent-Length: 2\r\n\r\n{{}}"
    ).encode(),
}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_http_faults_answer_in_the_api_shape(srv, fault, path):
    status, headers, body = exchange(srv, FAULTS[fault](path))
    assert 400 <= status < 500, (status, body[:200])
    assert headers["content-type"].startswith("application/json"), headers
    obj = json.loads(body)
    if path == "/v1/messages":
        assert obj["type"] == "error" and obj["error"]["message"] == "bad HTTP request"
    else:
        assert obj["error"]["message"] == "bad HTTP request" and obj["error"]["type"] == "invalid_request_error"
    assert "server" not in headers
    status, _, _ = exchange(srv, post("/v1/chat/completions", CHAT, "Connection: close\r\n"))
    assert status == 200  # and the server goes on serving


def test_no_server_banner_anywhere(srv):
    cases = [
        post("/v1/chat/completions", CHAT, "Connection: close\r\n"),
        post("/v1/chat/completions", b"{bad", "Connection: close\r\n"),
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        post(
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "Hi"}], "stream": True}).encode(),
            "Connection: close\r\n",
        ),
    ]
    for raw in cases:
        status, headers, _ = exchange(srv, raw)
        assert "server" not in headers, (raw[:40], headers)
