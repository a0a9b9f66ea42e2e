"""A local stand-in for the Hugging Face hub: one folder per repository served in the URL
layout huggingface_hub's client asks for (HF_ENDPOINT points at it), so `ds4mlx pull` runs
the real client unchanged:

* `GET /api/models/{org}/{repo}[/revision/{rev}]` (`HfApi.model_info`, `?blobs=true`):
  id, sha (the commit) and siblings with size, blobId and, for big files, lfs {sha256, size};
* `HEAD /{org}/{repo}/resolve/{rev}/{file}` (`get_hf_file_metadata`): X-Repo-Commit, ETag
  (the git blob id of a small file, the sha256 of an LFS one), and for LFS files
  X-Linked-Etag / X-Linked-Size as the hub sends them;
* `GET` of the same URL: the bytes, honouring `Range: bytes=N-` with a 206;
* anything else (the client's `/api/agent-harnesses`, fetched for its user agent): 404.

`files` maps a repository file to (the bytes to serve, the bytes the metadata describes):
they differ for a corrupted transfer.  Every GET is logged (path, Range header, bytes
sent), and every request's Authorization header; `pause_after` holds a GET of one file after that many bytes until `release` is set
(the test kills the client meanwhile)."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_MIN = 1 << 10  # files at least this big are LFS files (the hub's threshold is larger; any works)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Served:
    path: Path  # what is sent
    described: bytes | None = None  # the content the metadata describes (None: the file's own)

    def meta(self) -> dict:
        data = self.described if self.described is not None else self.path.read_bytes()
        if len(data) >= LFS_MIN:
            sha = hashlib.sha256(data).hexdigest()
            return {
                "size": len(data),
                "blobId": git_blob_id(data[:64]),
                "lfs": {"sha256": sha, "size": len(data), "pointerSize": 130},
            }
        return {"size": len(data), "blobId": git_blob_id(data)}


@dataclass
class FakeHub:
    repos: dict = field(default_factory=dict)  # "org/repo" -> {filename: Served}
    log: list = field(default_factory=list)  # (method, file, range header, bytes sent)
    auth: list = field(default_factory=list)  # (method, path, Authorization header) of every request
    pause_after: dict = field(default_factory=dict)  # filename -> bytes before holding
    paused: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    def gets(self, name: str) -> list:
        return [e for e in self.log if e[0] == "GET" and e[1] == name]


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _send(self, code: int, headers: dict, body: bytes = b""):
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _route(self):
            hub.auth.append((self.command, self.path, self.headers.get("Authorization")))
            parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
            if parts[:2] == ["api", "models"]:
                repo = "/".join(parts[2:4])
                if repo not in hub.repos:
                    return self._send(404, {"X-Error-Code": "RepoNotFound"}, b'{"error":"Repository not found"}')
                siblings = [{"rfilename": n, **s.meta()} for n, s in sorted(hub.repos[repo].items())]
                body = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings})
                return self._send(200, {"Content-Type": "application/json"}, body.encode())
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                served = hub.repos.get(repo, {}).get(name)
                if served is None:
                    return self._send(404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
                return self._file(name, served)
            return self._send(404, {})

        def _file(self, name: str, served: Served):
            meta = served.meta()
            etag = meta["lfs"]["sha256"] if "lfs" in meta else meta["blobId"]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
            if "lfs" in meta:
                headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": meta["size"]}
            data = served.path.read_bytes()
            if self.command == "HEAD":
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, str(v))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return
            rng = self.headers.get("Range")
            start = int(rng.split("=")[1].split("-")[0]) if rng else 0
            body = data[start:]
            self.send_response(206 if rng else 200)
            for k, v in headers.items():
                self.send_header(k, str(v))
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            entry = ["GET", name, rng, 0]
            hub.log.append(entry)
            hold = hub.pause_after.pop(name, None)
            try:
                if hold is not None:
                    self.wfile.write(body[:hold])
                    self.wfile.flush()
                    entry[3] = hold
                    hub.paused.set()
                    hub.release.wait(60)
                    return
                self.wfile.write(body)
                entry[3] = len(body)
            except (BrokenPipeError, ConnectionResetError):
                pass

        do_GET = do_HEAD = _route

    return Handler


def start(hub: FakeHub) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    return server
