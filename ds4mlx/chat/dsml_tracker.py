"""DSML decode tracker: the streaming recognizer of tool-call block structure.

Forgiving structural recognizer for greedy sampling and stop-at-CLOSE
(docs/dsml.md §5.1): `DecodeTracker` and its decode states, `scan_block`, and the
block-OPEN searches (`earliest_open`, `partial_open_at_tail`) that the final
parser (families/deepseek_v4/dsml.py), the streaming output parser (families/deepseek_v4/output.py)
and tool memory (toolmemory.py) share.

Strings are Python `str`; positions are character indices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from . import markers as M
from .dsml_lex import attr, skip_ws
from .markers import DsmlSyntax

OUTSIDE, STRUCTURAL, STRING_BODY, JSON_STRUCTURAL, JSON_STRING = (
    "outside",
    "structural",
    "string_body",
    "json_structural",
    "json_string",
)

_MAX_OPEN = max(len(s.open) for s in M.DSML_SYNTAXES)


def _max_open(syntaxes: Sequence[DsmlSyntax]) -> int:
    return _MAX_OPEN if syntaxes is M.DSML_SYNTAXES else max(len(s.open) for s in syntaxes)


def earliest_open(
    text: str, start: int, end: int | None = None, syntaxes: Sequence[DsmlSyntax] = M.DSML_SYNTAXES
) -> tuple[int, DsmlSyntax] | None:
    """Earliest block OPEN of any spelling (of `syntaxes`) starting in [start, end)."""
    best: tuple[int, DsmlSyntax] | None = None
    for syn in syntaxes:
        p = text.find(syn.open, start) if end is None else text.find(syn.open, start, end + len(syn.open) - 1)
        if p >= 0 and (end is None or p < end) and (best is None or p < best[0]):
            best = (p, syn)
    return best


def partial_open_at_tail(text: str, start: int, syntaxes: Sequence[DsmlSyntax] = M.DSML_SYNTAXES) -> int:
    """Index of a trailing proper prefix of some OPEN spelling (>= start), or -1."""
    lt = text.rfind("<", max(start, len(text) - _max_open(syntaxes) + 1))
    if lt < 0:
        return -1
    tail = text[lt:]
    for syn in syntaxes:
        if len(tail) < len(syn.open) and syn.open.startswith(tail):
            return lt
    return -1


def is_partial_marker(tail: str, lits: Iterable[str]) -> bool:
    return any(len(tail) < len(lit) and lit.startswith(tail) for lit in lits)


class DecodeTracker:
    """Incremental, forgiving recognizer of DSML structure in generated text.

    Feed it the whole text so far with `update(raw)`; it resumes where it
    stopped.  `mode` is one of: search (no block open), struct (between or
    inside tags), string (inside a string="true" value), json (inside another
    value), done (block CLOSE reached; `block_end` set), stuck (text that is
    not DSML where a tag was expected; `stuck_at` set).  The caller decides what
    to do after done/stuck (usually `restart`).  `state` is the docs/dsml.md §5.1
    decode state of the next token.

    Differences from ds4's tracker (all make it follow the final parser more
    closely): a partial parameter close of one byte (`<`) inside a JSON value is
    not consumed; a value that starts with a parameter tag (loose nested
    parameters) is tracked as structure, and a stray parameter close between
    parameters is skipped; garbage is reported as `stuck` instead of staying
    STRUCTURAL forever.  `syntaxes`: the block spellings searched for (default:
    the V4 spellings, docs/dsml.md §1)."""

    def __init__(self, start: int = 0, syntaxes: Sequence[DsmlSyntax] = M.DSML_SYNTAXES):
        self.syntaxes = syntaxes
        self.restart(start)

    def restart(self, pos: int) -> None:
        self.mode = "search"
        self.pos = pos
        self.syn: DsmlSyntax | None = None
        self.block_start = -1
        self.block_end = -1
        self.stuck_at = -1
        self.state = OUTSIDE
        self._value_start = 0
        self._in_str = False
        self._esc = False
        self._fresh = False

    @property
    def in_block(self) -> bool:
        return self.mode in ("struct", "string", "json")

    def update(self, raw: str) -> None:
        n = len(raw)
        while True:
            mode = self.mode
            if mode in ("done", "stuck"):
                self.state = OUTSIDE if mode == "done" else STRUCTURAL
                return
            if mode == "search":
                found = earliest_open(raw, self.pos, syntaxes=self.syntaxes)
                if found is None:
                    self.pos = max(self.pos, n - _max_open(self.syntaxes) + 1)
                    self.state = OUTSIDE
                    return
                self.block_start, self.syn = found
                self.pos = found[0] + len(found[1].open)
                self.mode = "struct"
                continue
            syn = self.syn
            if mode == "struct":
                p = skip_ws(raw, self.pos)
                self.pos = p
                if p >= n:
                    self.state = STRUCTURAL
                    return
                if raw.startswith(syn.close, p):
                    self.mode = "done"
                    self.block_end = p + len(syn.close)
                    self.pos = self.block_end
                    self.state = OUTSIDE
                    return
                if raw.startswith(syn.invoke_close, p):
                    self.pos = p + len(syn.invoke_close)
                    continue
                if raw.startswith(syn.param_close, p):  # end of a loose nested parameter
                    self.pos = p + len(syn.param_close)
                    continue
                is_param = raw.startswith(syn.param, p)
                if is_param or raw.startswith(syn.invoke, p):
                    gt = raw.find(">", p)
                    if gt < 0:
                        self.state = STRUCTURAL
                        return
                    self.pos = gt + 1
                    if is_param:
                        self._value_start = gt + 1
                        if attr(raw[p : gt + 1], "string") == "true":
                            self.mode = "string"
                        else:
                            self.mode = "json"
                            self._in_str = self._esc = False
                            self._fresh = True
                    continue
                if is_partial_marker(
                    raw[p : p + 64], (syn.close, syn.invoke_close, syn.param_close, syn.invoke, syn.param)
                ):
                    self.state = STRUCTURAL
                    return
                self.mode = "stuck"
                self.stuck_at = p
                self.state = STRUCTURAL
                return
            close = syn.param_close
            if mode == "string":
                k = raw.find(close, self.pos)
                if k >= 0:
                    self.pos = k + len(close)
                    self.mode = "struct"
                    continue
                self.pos = max(self.pos, n - len(close) + 1)
                self.state = STRUCTURAL if self._partial_close(raw, 2) else STRING_BODY
                return
            # json value
            if self._fresh:
                p = skip_ws(raw, self.pos)
                if p >= n:
                    self.state = JSON_STRUCTURAL
                    return
                if raw.startswith(syn.param, p):
                    self.pos = p
                    self.mode = "struct"
                    continue
                if is_partial_marker(raw[p : p + 64], (syn.param,)):
                    self.state = STRUCTURAL
                    return
                self._fresh = False
            pos = self.pos
            while pos < n:
                c = raw[pos]
                if self._in_str:
                    if self._esc:
                        self._esc = False
                    elif c == "\\":
                        self._esc = True
                    elif c == '"':
                        self._in_str = False
                elif c == "<":
                    if raw.startswith(close, pos):
                        break
                    if is_partial_marker(raw[pos : pos + 64], (close,)):
                        self.pos = pos
                        self.state = STRUCTURAL if n - pos >= 2 else JSON_STRUCTURAL
                        return
                elif c == '"':
                    self._in_str = True
                pos += 1
            if pos < n:
                self.pos = pos + len(close)
                self.mode = "struct"
                continue
            self.pos = pos
            self.state = JSON_STRING if self._in_str else JSON_STRUCTURAL
            return

    def _partial_close(self, raw: str, min_len: int) -> bool:
        close = self.syn.param_close
        n = len(raw)
        for k in range(min_len, len(close)):
            if n - k >= self._value_start and raw.endswith(close[:k]):
                return True
        return False


def scan_block(text: str, open_pos: int, syntaxes: Sequence[DsmlSyntax] = M.DSML_SYNTAXES) -> tuple[str, int]:
    """Structure of the block whose OPEN starts at `open_pos`:
    ("complete", end after CLOSE) | ("stuck", garbage position) | ("open", len(text))."""
    tr = DecodeTracker(open_pos, syntaxes)
    tr.update(text)
    if tr.mode == "done":
        return "complete", tr.block_end
    if tr.mode == "stuck":
        return "stuck", tr.stuck_at
    return "open", len(text)
