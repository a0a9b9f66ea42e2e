"""The HTTP connection layer under the app: aiohttp's runner with three changes.

* Faults aiohttp meets before a request reaches the app (a bad chunk size, a
  request-smuggling attempt such as Content-Length with Transfer-Encoding, a
  header line past the limit) are answered in the API's JSON error shape, for
  the path of the request line when it was read, instead of aiohttp's
  `text/plain` page.
* No `Server: Python/3.x aiohttp/3.x` banner on any response.
* `--root-path P` (a reverse proxy that forwards /P/v1/... unchanged): a request
  under P is routed as the path after it; paths without P keep working (a proxy that
  strips the prefix).  Done before routing, so every route and its error shape see
  the same path (docs/http-api.md §9.2).
* A client that half-closes its socket after sending its request (shutdown of
  its write side) still gets the answer: the read side ending does not close
  the connection; it closes once the answer is written.  (A FIN cannot tell a
  half-close from a client that is gone; interim `100 Continue` probes do.)  A body
  the app refused unread (413) is not waited for once the client has sent its FIN.

`make_runner(app)` is what `ds4mlx serve` and `BackgroundServer` run.
"""

from __future__ import annotations

import json
import logging
import re

from aiohttp import HttpVersion11, hdrs, web
from aiohttp.web_protocol import RequestHandler

from . import errors as E

log = logging.getLogger("ds4mlx.serve")
ROOT_PATH = web.AppKey("ds4mlx_root_path", str)  # set by make_app; "" = none
_REQUEST_LINE = re.compile(rb"[A-Z]{3,10} (/[^ ?#\r\n]*)")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
PROBE_INTERVAL_S = 0.05


async def drop_banner(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: runs after aiohttp set its default headers."""
    response.headers.pop(hdrs.SERVER, None)


class _ErrorResponse(web.Response):
    """A response prepared outside the app (no on_response_prepare): drop the banner itself."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self.headers.pop(hdrs.SERVER, None)


def normalize_root_path(root: str | None) -> str:
    """ "/ds4/" -> "/ds4"; "" or "/" -> ""."""
    root = (root or "").strip().rstrip("/")
    if root and not root.startswith("/"):
        root = "/" + root
    return root


def strip_root(path: str, root: str) -> str:
    """The path a request under `root` is routed as (unchanged outside it)."""
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


def _rooted(factory, root: str):
    def make_request(message, *args, **kwargs):
        url = message.url
        path = strip_root(url.raw_path, root)
        if path != url.raw_path:
            url = url.with_path(path, encoded=True).with_query(url.raw_query_string)
            query = "?" + url.raw_query_string if url.raw_query_string else ""
            target = path + query
            # aiohttp's RawRequestMessage (a NamedTuple, or its C twin): path and url replaced
            m = message
            message = type(m)(
                m.method, target, m.version, m.headers, m.raw_headers, m.should_close, m.compression, m.upgrade,
                m.chunked, url,
            )  # fmt: skip
        return factory(message, *args, **kwargs)

    return make_request


class _Connection(RequestHandler):
    _path: str | None = None
    _root: str = ""
    _peer_done = False  # the client's FIN came
    _unread_body = None  # the answered request's body, when the app left it unread

    def data_received(self, data: bytes) -> None:
        m = _REQUEST_LINE.match(data)
        if m is not None:  # the start of a request: remember its path for a parse error's shape
            self._path = strip_root(m.group(1).decode("ascii", "replace"), self._root)
        super().data_received(data)

    def eof_received(self) -> bool:
        # The client's FIN: a half-close (it still reads its answer) or a full
        # close (gone).  True keeps the transport open for writing; close() ends
        # the connection after the answer in progress.  A gone client is found by
        # the probes below (and a stream by its own writes), so its job is still
        # cancelled within a probe interval.
        self._peer_done = True
        if self._unread_body is not None and not self._unread_body.is_eof():
            self.force_close()  # answered already; the refused body will never come
            return False
        self.close()
        self._probe()
        return True

    async def finish_response(self, request, resp, start_time):
        # aiohttp reads and drops a body the app refused unread (a 413 before the body)
        # until the peer's EOF or its 10 s `lingering_time`; with FIN kept open above the
        # EOF never reaches it, so a peer that has sent all it will send is closed here.
        done = await super().finish_response(request, resp, start_time)
        self._unread_body = None if request.content.is_eof() else request.content
        if self._unread_body is not None and self._peer_done:
            self.force_close()  # the answer is written (close flushes it)
        return done

    def _probe(self) -> None:
        """Until the answer starts, write an interim `100 Continue` (every HTTP/1.1
        client skips 1xx answers): a fully closed peer answers it with a reset,
        the next write fails, and the connection's end cancels the handler."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        req = self._current_request
        if req is not None and (req.writer.output_size > 0 or req.version < HttpVersion11):
            return  # the answer is being written (its own writes find a gone peer), or no 1xx for HTTP/1.0
        if req is not None:
            transport.write(CONTINUE)
        self._loop.call_later(PROBE_INTERVAL_S, self._probe)

    def handle_error(
        self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        log.debug("HTTP-level error %d on %s: %s", status, self._path, message or exc)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started: cannot send the error")
        api = E.api_for_path(self._path or "")
        text = E.BAD_HTTP if status < 500 else E.internal_error(type(exc).__name__ if exc else "error")
        body = json.dumps(E.error_body(api, E.APIError(status, text))).encode()
        resp = _ErrorResponse(status=status, body=body, content_type="application/json")
        resp.force_close()
        return resp


class _Server(web.Server):
    root = ""

    def __call__(self) -> RequestHandler:
        conn = _Connection(self, loop=self._loop, **self._kwargs)
        conn._root = self.root
        return conn


class _Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the app's own server; only its connections differ
        root = normalize_root_path(self.app.get(ROOT_PATH, ""))
        if root:
            server.root = root
            server.request_factory = _rooted(server.request_factory, root)
        return server


def make_runner(app: web.Application) -> web.AppRunner:
    app.on_response_prepare.append(drop_banner)
    return _Runner(app, handler_cancellation=True, access_log=None)
