"""API keys (`serve --api-key KEY`, `--api-key-file FILE`): docs/http-api.md §9.2.

A request carries its key as `Authorization: Bearer KEY` (OpenAI, Ollama clients) or
`x-api-key: KEY` (Anthropic).  Every configured key is compared, each in constant time
(`hmac.compare_digest` over SHA-256 digests: equal lengths, so not even a key's length
leaks), so neither the match nor its position leaks through timing.
Keys are never logged: the trace records bodies, not headers, and nothing here prints.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

# Routes a load balancer or a browser reaches without a key: the health checks, and
# CORS preflights (a browser sends no credentials with OPTIONS).
OPEN_PATHS = frozenset({"/health", "/"})
OPEN_PREFIXES = ("/ui/",)  # the chat page's own files: a browser loads them before it has a key
BEARER = "bearer "


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeyFileError(ValueError):
    pass


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and `#` comments skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"--api-key-file {path}: {e}") from None
    keys = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    if not keys:
        raise KeyFileError(f"--api-key-file {path}: no key in the file")
    return keys


class APIKeys:
    def __init__(self, keys: Iterable[str]):
        self._keys = tuple(_digest(k) for k in keys if k)

    def __bool__(self) -> bool:
        return bool(self._keys)

    @staticmethod
    def presented(headers: Mapping[str, str]) -> list[str]:
        """The keys a request presents (both headers may be sent)."""
        out = []
        auth = headers.get("Authorization", "")
        if auth[: len(BEARER)].lower() == BEARER:
            out.append(auth[len(BEARER) :].strip())
        x = headers.get("x-api-key")
        if x is not None:
            out.append(x.strip())
        return out

    def allows(self, method: str, path: str, headers: Mapping[str, str]) -> bool:
        if (
            not self._keys
            or method == "OPTIONS"
            or (method in ("GET", "HEAD") and (path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)))
        ):
            return True
        ok = False
        for given in self.presented(headers):
            g = _digest(given)
            for k in self._keys:  # no early exit: the time does not depend on which key matched
                ok |= hmac.compare_digest(g, k)
        return ok
