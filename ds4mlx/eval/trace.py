"""The trace file (docs/eval.md §9) and `--regrade TRACE` (§10, with the
seed's fix: only PASSED/FAILED records are graded, the rest count as not_graded).

Payloads (system prompt, question, model output) are written as counted blocks
`LABEL_BEGIN bytes=N` + N bytes + `\\n` + `LABEL_END`, so text inside a payload
can never be mistaken for structure.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from ..io.atomic_file import write_bytes_atomic

GRADED = ("PASSED", "FAILED")
STATUSES = ("PASSED", "FAILED", "STOPPED", "SKIPPED", "SWITCHED", "ERROR")
CASE_PREFIX = b"===== CASE "
SUMMARY_LINE = b"===== SUMMARY ====="
RESUMED_LINE = b"# ds4-eval trace resumed"  # a --retry-incomplete run appends from here
HEADER_PREFIX = b"# ds4-eval trace"
PREVIOUS_SUFFIX = ".prev"  # where a fresh run moves the trace it replaces


@dataclass
class TraceRecord:
    i: int
    n: int
    source: str
    id: str
    domain: str
    title: str
    status: str
    picked: str
    expected: str
    prompt_tokens: int = 0
    generated_tokens: int = 0
    elapsed: float = 0.0
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.05
    think_mode: str = "high"
    think_close: str = "none"  # none | natural | soft_forced | hard_forced
    think_close_index: int = 0
    think_close_remaining: int = 0
    think_close_rank: int = 0
    error: str = ""
    choices: list[str] = field(default_factory=list)
    answer_kind: str = ""
    system: str = ""
    question: str = ""
    output: str = ""
    timestamp: int | None = None
    spec: dict[str, Any] | None = None  # speculative decoding: the case's counters, SpecStats.as_dict()


def spec_lines(spec: dict[str, Any]) -> list[str]:
    """`spec_<counter>: value` lines of a SpecStats.as_dict() (ds4mlx's addition to the
    record: only with --mtp / --draft-model)."""
    return [f"spec_{k}: {_g(v) if isinstance(v, float) else v}" for k, v in spec.items()]


def _block(label: str, text: str) -> str:
    n = len(text.encode("utf-8", "surrogateescape"))
    if not text:
        return f"{label}_BEGIN bytes=0\n{label}_END\n"
    return f"{label}_BEGIN bytes={n}\n{text}{'' if text.endswith(chr(10)) else chr(10)}{label}_END\n"


def _g(x: float) -> str:
    return f"{x:.6g}"


def format_record(r: TraceRecord, case: dict[str, Any] | None = None) -> str:
    choices = r.choices or (case or {}).get("choices") or []
    kind = r.answer_kind or (case or {}).get("answer_kind", "")
    lines = [
        f"===== CASE {r.i}/{r.n} {r.source}/{r.id} =====",
        f"timestamp_unix: {r.timestamp if r.timestamp is not None else int(time.time())}",
        f"source: {r.source}",
        f"id: {r.id}",
        f"domain: {r.domain}",
        f"title: {r.title}",
        f"status: {r.status}",
        f"picked: {(r.picked or '?') if r.status in GRADED else '?'}",
        f"expected: {r.expected}",
        f"prompt_tokens: {r.prompt_tokens}",
        f"generated_tokens: {r.generated_tokens}",
        f"elapsed_sec: {r.elapsed:.3f}",
        f"temperature: {_g(r.temperature)}",
        f"top_p: {_g(r.top_p)}",
        f"min_p: {_g(r.min_p)}",
        f"think_mode_effective: {r.think_mode}",
        f"think_close: {r.think_close}",
    ]
    if r.think_close != "none":
        lines += [
            f"think_close_token_index: {r.think_close_index}",
            f"think_close_remaining_budget: {r.think_close_remaining}",
            f"think_close_rank: {r.think_close_rank}",
        ]
    if r.spec:
        lines += spec_lines(r.spec)
    if r.error:
        lines.append(f"error: {r.error}")
    if choices:
        lines.append("choices:")
        lines += [f"  {chr(65 + k)}. {c}" for k, c in enumerate(choices)]
    else:
        lines.append(f"answer_kind: {kind or 'integer'}")
    return (
        "\n".join(lines)
        + "\n"
        + _block("SYSTEM_PROMPT", r.system)
        + _block("QUESTION_PROMPT", r.question)
        + _block("MODEL_OUTPUT", r.output)
        + "\n"
    )


class TraceWriter:
    """Writes a trace without ever losing a completed record (docs/eval.md §9).

    `create` replaces the file atomically (temporary file, fsync, rename) with the
    header only, keeping a non-empty old file as FILE.prev; `resume` (--retry-incomplete) appends to the existing file and never
    rewrites it.  Every record goes out in one `write` on an O_APPEND descriptor and
    is fsynced, so a kill at any point leaves at worst one torn record at the end,
    which the reader sees as incomplete (its MODEL_OUTPUT block does not close)."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self.fd = fd

    @classmethod
    def create(cls, path: str, **header: Any) -> TraceWriter:
        directory = os.path.dirname(os.path.abspath(path))

        def keep_previous() -> None:
            """A fresh run keeps the trace it replaces."""
            if os.path.exists(path) and os.path.getsize(path):
                os.replace(path, path + PREVIOUS_SUFFIX)

        header_bytes = _header_text("# ds4-eval trace\n", header).encode("utf-8", "surrogateescape")
        write_bytes_atomic(
            path,
            header_bytes,
            temp_prefix=".ds4-eval-trace-",
            fsync=True,
            permissions=0o644,  # mkstemp's 0600 would surprise next to the user's files
            before_replace=keep_previous,
        )
        _fsync_dir(directory)
        return cls(path, os.open(path, os.O_WRONLY | os.O_APPEND))

    @classmethod
    def resume(cls, path: str, **header: Any) -> TraceWriter:
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            return cls.create(path, **header)
        fd = os.open(path, os.O_RDWR | os.O_APPEND)
        w = cls(path, fd)
        size = os.fstat(fd).st_size
        lead = ""
        if size:
            os.lseek(fd, size - 1, os.SEEK_SET)
            if os.read(fd, 1) != b"\n":
                lead = "\n"  # a torn last line: start ours on a line of its own
        w.raw(lead + _header_text(RESUMED_LINE.decode() + "\n", header))
        return w

    def raw(self, text: str) -> None:
        data = text.encode("utf-8", "surrogateescape")
        while data:
            n = os.write(self.fd, data)
            data = data[n:]
        os.fsync(self.fd)

    def record(self, rec: TraceRecord, case: dict[str, Any] | None = None) -> None:
        self.raw(format_record(rec, case))

    def summary(self, passed: int, failed: int, total: int, spec: dict[str, Any] | None = None) -> None:
        """`spec`: the run's speculation totals (the sum of the cases' counters)."""
        extra = "".join(line + "\n" for line in spec_lines(spec)) if spec else ""
        self.raw(f"===== SUMMARY =====\npassed: {passed}\nfailed: {failed}\ntotal: {total}\n{extra}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _header_text(first: str, fields: dict[str, Any]) -> str:
    return first + "".join(f"{k}: {_g(v) if isinstance(v, float) else v}\n" for k, v in fields.items()) + "\n"


def _fsync_dir(directory: str) -> None:
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def completed_records(records: list[ParsedRecord]) -> dict[tuple[str, str], ParsedRecord]:
    """The last complete PASSED/FAILED record of every (source, id): what
    --retry-incomplete keeps.  A torn record (killed mid-write) does not count."""
    done: dict[tuple[str, str], ParsedRecord] = {}
    for r in records:
        if r.source and r.id and r.output_ok and r.status in GRADED:
            done[(r.source, r.id)] = r
    return done


# ---------------------------------------------------------------- reading


@dataclass
class ParsedRecord:
    fields: dict[str, str]
    blocks: dict[str, str]
    raw: str  # the whole record text, re-emittable as is
    output_ok: bool  # a MODEL_OUTPUT block was found and is well formed

    @property
    def source(self) -> str:
        return self.fields.get("source", "")

    @property
    def id(self) -> str:
        return self.fields.get("id", "")

    @property
    def status(self) -> str:
        return self.fields.get("status", "")

    @property
    def picked(self) -> str:
        return self.fields.get("picked", "")

    @property
    def output(self) -> str:
        return self.blocks.get("MODEL_OUTPUT", "")

    def int_field(self, name: str) -> int:
        try:
            return int(self.fields.get(name, "0"))
        except ValueError:
            return 0

    def float_field(self, name: str) -> float:
        try:
            return float(self.fields.get(name, "0"))
        except ValueError:
            return 0.0


_BEGIN = re.compile(rb"([A-Z_]+)_BEGIN(?: bytes=(\d+))?\r?\n?$")


def _lines(data: bytes) -> list[tuple[int, int]]:
    """(start, end) offsets of every line, end excluding the newline."""
    out, pos = [], 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        end = len(data) if nl < 0 else nl
        out.append((pos, end))
        pos = end + 1
    return out


def _scan(data: bytes) -> list[tuple[int, int, dict[str, tuple[int, int, bool]]]]:
    """Split `data` into case chunks, skipping counted blocks as units.
    Returns (start, end, {label: (payload_start, payload_end, ok)}) per case."""
    cases: list[tuple[int, int, dict[str, tuple[int, int, bool]]]] = []
    pos = 0
    cur: list[Any] | None = None
    n = len(data)
    while pos < n:
        nl = data.find(b"\n", pos)
        end = n if nl < 0 else nl
        line = data[pos:end]
        nxt = end + 1
        m = _BEGIN.match(line)
        if m and cur is not None:
            label = m.group(1).decode()
            if m.group(2) is not None:
                size = int(m.group(2))
                p0, p1 = nxt, nxt + size
                q = p1 + 1 if data[p1 : p1 + 1] == b"\n" else p1
                close = label.encode() + b"_END"
                if data[q : q + len(close)] == close and p1 <= n:
                    cur[2].setdefault(label, (p0, p1, True))
                    e = data.find(b"\n", q)
                    pos = n if e < 0 else e + 1
                    continue
                cur[2].setdefault(label, (p0, p0, False))
            else:  # legacy: up to "\nLABEL_END"
                close = b"\n" + label.encode() + b"_END"
                k = data.find(close, end)
                if k >= 0:
                    cur[2].setdefault(label, (nxt, k, True))
                    e = data.find(b"\n", k + 1)
                    pos = n if e < 0 else e + 1
                    continue
                cur[2].setdefault(label, (nxt, nxt, False))
        if line.startswith((CASE_PREFIX, SUMMARY_LINE, HEADER_PREFIX)):
            if cur is not None:
                cur[1] = pos
                cases.append(tuple(cur))  # type: ignore[arg-type]
            cur = [pos, n, {}] if line.startswith(CASE_PREFIX) else None
        pos = nxt
    if cur is not None:
        cur[1] = n
        cases.append(tuple(cur))  # type: ignore[arg-type]
    return cases


def parse_trace(text: str | bytes) -> list[ParsedRecord]:
    data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    out = []
    for start, end, blocks in _scan(data):
        fields: dict[str, str] = {}
        # header lines: everything before the first block
        first_block = min((b[0] for b in blocks.values()), default=end)
        for a, b in _lines(data[start:first_block]):
            line = data[start + a : start + b].decode("utf-8", "replace").rstrip("\r")
            if ": " in line and not line.startswith((" ", "=")):
                k, v = line.split(": ", 1)
                fields.setdefault(k, v)
            elif line.endswith(":") and not line.startswith(" "):
                fields.setdefault(line[:-1], "")
        decoded = {k: data[p0:p1].decode("utf-8", "surrogateescape") for k, (p0, p1, ok) in blocks.items() if ok}
        ok = blocks.get("MODEL_OUTPUT", (0, 0, False))[2]
        out.append(ParsedRecord(fields, decoded, data[start:end].decode("utf-8", "surrogateescape"), ok))
    return out


# ---------------------------------------------------------------- regrade


@dataclass
class RegradeSummary:
    total: int = 0
    passed: int = 0
    failed: int = 0
    not_graded: int = 0
    changed: int = 0
    unknown: int = 0
    parse_errors: int = 0
    superseded: int = 0  # torn records rerun later in the same trace
    messages: list[str] = field(default_factory=list)

    def line(self, path: str) -> str:
        return (
            f"ds4-eval: regraded {self.total} cases from {path}: passed={self.passed} "
            f"failed={self.failed} not_graded={self.not_graded} changed={self.changed} "
            f"unknown={self.unknown} parse_errors={self.parse_errors}"
            + (f" superseded={self.superseded}" if self.superseded else "")
        )

    @property
    def rc(self) -> int:
        return 1 if (self.unknown or self.parse_errors or self.total == 0) else 0


def regrade_records(records: list[ParsedRecord], lookup: Callable[[str, str], dict[str, Any] | None]) -> RegradeSummary:
    """Grade PASSED/FAILED records (and records without a status line) again with
    the current extractor; the other statuses are counted as not_graded."""
    from .extract import grade_detail

    s = RegradeSummary()
    for k, rec in enumerate(records, 1):
        s.total += 1
        if not rec.source or not rec.id:
            s.parse_errors += 1
            s.messages.append(f"ds4-eval: trace case {k} is missing source/id")
            continue
        case = lookup(rec.source, rec.id)
        if case is None:
            s.unknown += 1
            s.messages.append(f"ds4-eval: trace case {k} not found in embedded cases: {rec.source}/{rec.id}")
            continue
        if not rec.output_ok and any(r.output_ok and (r.source, r.id) == (rec.source, rec.id) for r in records[k:]):
            s.superseded += 1  # torn by a kill, then run again by --retry-incomplete
            continue
        if not rec.output_ok:
            s.parse_errors += 1
            s.messages.append(f"ds4-eval: trace case {k} is missing MODEL_OUTPUT block: {rec.source}/{rec.id}")
            continue
        if rec.status and rec.status not in GRADED:
            s.not_graded += 1
            continue
        picked, ok = grade_detail(case, rec.output)
        s.passed += ok
        s.failed += not ok
        old_pass = rec.status == "PASSED"
        if (rec.status and old_pass != ok) or (rec.picked and rec.picked != picked):
            s.changed += 1
            s.messages.append(
                f"case {k} {rec.source}/{rec.id}: trace {rec.status or '?'} picked={rec.picked or '?'} -> "
                f"regrade {'PASSED' if ok else 'FAILED'} picked={picked} expected={case['answer']}"
            )
    return s


def regrade_file(path: str, out: TextIO, err: TextIO) -> int:
    from .cases import find_case

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        print(f"ds4-eval: cannot read trace '{path}': {e.strerror}", file=err)
        return 2
    s = regrade_records(parse_trace(data), find_case)
    for msg in s.messages:
        print(msg, file=err if msg.startswith("ds4-eval:") else out)
    print(s.line(path), file=out)
    return s.rc
