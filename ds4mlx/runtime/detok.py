"""Incremental detokenization and stop-sequence matching.

`Detokenizer` turns token ids into text without ever splitting a UTF-8
character: bytes of an incomplete character stay buffered until the token
that completes it arrives (a byte-level BPE token can end mid-character).

`StopMatcher` implements ds4's stop-sequence rule (docs/http-api.md §2): matches
are searched in the raw generated text (reasoning included) after every
token; on a match the text is cut at the earliest match position.  Until a
suffix can no longer start a match it is held back, so a stream never shows
the beginning of a stop string.  (ds4 counts the hold-back in bytes, we count
characters; the visible result is the same.)
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable


class Detokenizer:
    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token_id: int) -> str:
        return self._dec.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still buffered (an incomplete character becomes U+FFFD)."""
        return self._dec.decode(b"", final=True)


class StopMatcher:
    def __init__(self, stops: Iterable[str] | None = None):
        self.stops = sorted({s for s in (stops or ()) if isinstance(s, str) and s}, key=len)
        self._hold = max((len(s) for s in self.stops), default=0) - 1
        self._pending = ""  # released text not yet cleared of a possible match start
        self.hit: str | None = None

    @property
    def active(self) -> bool:
        return bool(self.stops)

    def push(self, text: str) -> str:
        """Add generated text; return what can be released now.  After a match
        `hit` is set, the returned text ends right before the match and every
        later push returns ""."""
        if self.hit is not None:
            return ""
        if not self.stops:
            return text
        buf = self._pending + text
        best = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, self.hit = i, s
        if best >= 0:
            self._pending = ""
            return buf[:best]
        keep = self._hold if self._hold > 0 else 0
        # Only hold the tail if it could still be the start of some stop.
        cut = len(buf)
        for k in range(min(keep, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                cut = len(buf) - k
                break
        self._pending = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return "" if self.hit is not None else out
