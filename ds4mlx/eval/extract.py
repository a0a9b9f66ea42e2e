"""Answer extraction and grading: the one place where model text becomes a verdict.

The rules follow ds4-eval (docs/eval.md §5-§7).  Three rule sets exist:

* ``"a"``: the ds4 snapshot (first ``answer`` substring, no filters, the
  ``13 15 -> 13,5`` scanner quirk).  Kept only to explain old traces.
* ``"b"``: PR #185 (last ``answer:`` marker), otherwise like ``"a"``.
* ``"c"``: the default.  The later upstream fixes (issues #319/#321 in the seed):
  pronoun/article/contraction letters are skipped, negated letters are skipped,
  integers come from the answer line with the last-``=`` rule, COMPSEC line
  specs without the scanner quirk, plus the answer kinds of the hard suite.

Everything works on ASCII tests only (C locale): non-ASCII characters are never
letters or digits.  The multiple-choice / integer / line scanners run over the
UTF-8 bytes (as latin-1 text) so that window sizes are byte counts, like ds4.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ..chat.markers import THINK_CLOSE

VARIANTS = ("a", "b", "c")
DEFAULT_VARIANT = "c"

MC_WINDOW = 96
LINE_WINDOW = 160
SEQ_WINDOW = 400

_WS = " \t\n\v\f\r"
_NEGATORS = frozenset(
    "not except excluding exclude excludes eliminate eliminates eliminated reject rejects rejected rejecting".split()
)
_RULE_WORDS = frozenset(("rule", "rules", "ruled"))
# One-letter English words: only these can be prose rather than an option
# ("I think", "A careful", "a bit").  "Answer: C is correct" stays C.
_WORD_LETTERS = frozenset("AIai")


# ---------------------------------------------------------------- helpers


def _alpha(ch: str) -> bool:
    return ("a" <= ch <= "z") or ("A" <= ch <= "Z")


def _digit(ch: str) -> bool:
    return "0" <= ch <= "9"


def _ascii_lower(text: str) -> str:
    return text.translate(_LOWER)


_LOWER = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}


def as_bytes_text(text: str) -> str:
    """UTF-8 bytes of `text`, one character per byte (so windows count bytes)."""
    return text.encode("utf-8", "surrogatepass").decode("latin-1")


def visible_text(raw: str) -> str:
    """Everything after the first `</think>`, or the whole output without one."""
    i = raw.find(THINK_CLOSE)
    return raw[i + len(THINK_CLOSE) :] if i >= 0 else raw


def find_answer_marker(text: str, variant: str = DEFAULT_VARIANT) -> int:
    """Index of the answer marker, or -1.

    a: the first case-insensitive `answer` substring (even inside `answers`).
    b/c: the last `answer` with no ASCII letter on either side that is followed,
    after optional whitespace, by `:`; without one, the first substring.
    """
    low = _ascii_lower(text)
    if variant == "a":
        return low.find("answer")
    last = -1
    pos = low.find("answer")
    while pos >= 0:
        before = text[pos - 1] if pos > 0 else " "
        j = pos + 6
        after = text[j] if j < len(text) else ""
        if not _alpha(before) and not _alpha(after):
            while j < len(text) and text[j] in _WS:
                j += 1
            if j < len(text) and text[j] == ":":
                last = pos
        pos = low.find("answer", pos + 1)
    return last if last >= 0 else low.find("answer")


def _answer_line(text: str, marker: int, width: int = LINE_WINDOW) -> str:
    line = text[marker : marker + width]
    nl = line.find("\n")
    return line if nl < 0 else line[:nl]


_NUMBER_RE = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)|\d+")
_DIGITS_RE = re.compile(r"\d+")


def normalize_int(digits: str) -> str:
    """`070` -> `70`, `000` -> `0`, `3,986,729` -> `3986729`."""
    digits = digits.replace(",", "")
    stripped = digits.lstrip("0")
    return stripped if stripped else ("0" if digits else "?")


def _numbers(text: str, grouped: bool) -> list[str]:
    return (_NUMBER_RE if grouped else _DIGITS_RE).findall(text)


# ---------------------------------------------------------------- multiple choice


def _mc_negated(text: str, start: int, pos: int) -> bool:
    """Is the letter at `pos` preceded (same line, after `start`) by a negation cue?"""
    p = pos
    while p > start and text[p - 1] in " \t,;":
        p -= 1
    if p > start and text[p - 1] == "\n":
        return False
    end = p
    while p > start and (_alpha(text[p - 1]) or text[p - 1] == "'"):
        p -= 1
    word = _ascii_lower(text[p:end])
    if not word or len(word) >= 16:
        return False
    if len(word) >= 3 and word.endswith("n't"):
        return True
    if word in _NEGATORS:
        return True
    if word == "out":
        q = p
        while q > start and text[q - 1] in " \t":
            q -= 1
        qend = q
        while q > start and _alpha(text[q - 1]):
            q -= 1
        return _ascii_lower(text[q:qend]) in _RULE_WORDS
    return False


def extract_letter(raw: str, nchoices: int, variant: str = DEFAULT_VARIANT) -> str:
    """The chosen option letter (`A`..), or `?`."""
    text = as_bytes_text(visible_text(raw))
    last = chr(ord("A") + max(1, min(nchoices, 26)) - 1)

    def standalone(i: int) -> str:
        c = text[i].upper()
        if not ("A" <= c <= last) or not _alpha(text[i]):
            return ""
        before = text[i - 1] if i > 0 else " "
        after = text[i + 1] if i + 1 < len(text) else ""
        return "" if _alpha(before) or _alpha(after) else c

    marker = find_answer_marker(text, variant)
    if marker >= 0:
        for i in range(marker, min(marker + MC_WINDOW, len(text))):
            c = standalone(i)
            if not c:
                continue
            if variant == "c":
                nxt = text[i + 1] if i + 1 < len(text) else ""
                if nxt == "'":
                    continue  # I'll, I'm, A's
                if nxt in " \t" and text[i] in _WORD_LETTERS:
                    j = i + 1
                    while j < len(text) and text[j] in " \t":
                        j += 1
                    if j < len(text) and "a" <= text[j] <= "z":
                        continue  # "I think", "A careful"
                if _mc_negated(text, marker, i):
                    continue  # "not B", "rules out C", "isn't D"
            return c
    for i in range(len(text) - 1, -1, -1):
        c = standalone(i)
        if c:
            return c
    return "?"


# ---------------------------------------------------------------- integers


def extract_integer(raw: str, variant: str = DEFAULT_VARIANT) -> str:
    """The answer integer as a normalized digit string, or `?`."""
    text = as_bytes_text(visible_text(raw))
    grouped = variant == "c"
    marker = find_answer_marker(text, variant)
    if marker >= 0:
        if variant == "c":
            line = _answer_line(text, marker)
            eq = line.rfind("=")
            if eq >= 0:
                found = _numbers(line[eq + 1 :], grouped)
                if found:
                    return normalize_int(found[0])
            found = _numbers(line, grouped)
        else:
            found = _numbers(text[marker : marker + LINE_WINDOW], grouped)
        if found:
            return normalize_int(found[0])
    found = _numbers(text, grouped)
    return normalize_int(found[-1]) if found else "?"


# ---------------------------------------------------------------- line numbers

# `-`, or an en/em dash (as text or as its UTF-8 bytes in latin-1 form)
_RANGE_RE = re.compile(r"(\d+)(?:[ \t]*(?:-|\u2013|\u2014|\xe2\x80[\x93\x94])[ \t]*(\d+))?")


def _compact_spec_quirky(window: str) -> str:
    """ds4 a/b scanner, quirk included: `13 15` -> `13,5`, `20-, 17` -> `20-,17`."""
    out: list[str] = []
    i, n = 0, len(window)
    while i < n:
        if not _digit(window[i]):
            i += 1
            continue
        if out:
            out.append(",")
        while i < n and _digit(window[i]):
            out.append(window[i])
            i += 1
        while i < n and window[i] in _WS:
            i += 1
        if i < n and window[i] == "-":
            out.append("-")
            i += 1
            while i < n and window[i] in _WS:
                i += 1
            while i < n and _digit(window[i]):
                out.append(window[i])
                i += 1
        i += 1  # the scanner steps over whatever follows
    spec = "".join(out).rstrip(",-")
    return spec or "?"


def compact_line_spec(window: str) -> str:
    """`line 9` -> `9`; `13, 14 and 15` -> `13,14,15`; `20 - 22` -> `20-22`;
    `17\u201320` -> `17-20` (an en dash is a range too).  Empty -> `?`."""
    items = []
    for m in _RANGE_RE.finditer(window):
        a, b = m.group(1), m.group(2)
        items.append(f"{int(a)}-{int(b)}" if b else str(int(a)))
    return ",".join(items) if items else "?"


def parse_line_spec(spec: str, ds4_dangling: bool = False) -> set[int]:
    """`3,13-15` -> {3, 13, 14, 15}.  Reversed ranges are swapped.  Values are
    clamped to 0..65535.  With `ds4_dangling` a trailing `20-` means 0..20."""
    out: set[int] = set()
    for m in re.finditer(r"(\d+)(?:\s*(-)\s*(\d*))?", spec):
        a = min(int(m.group(1)), 65535)
        if m.group(2):
            if m.group(3):
                b = min(int(m.group(3)), 65535)
            elif ds4_dangling:
                b = 0
            else:
                b = a
        else:
            b = a
        lo, hi = min(a, b), max(a, b)
        out.update(range(lo, hi + 1))
    return out


def extract_line_spec(raw: str, variant: str = DEFAULT_VARIANT) -> str:
    """COMPSEC: the line spec on the answer line, else the integer rule."""
    text = as_bytes_text(visible_text(raw))
    marker = find_answer_marker(text, variant)
    if marker >= 0:
        line = _answer_line(text, marker)
        spec = compact_line_spec(line) if variant == "c" else _compact_spec_quirky(line)
        if spec != "?":
            return spec
    return extract_integer(raw, variant)


def extract_line(raw: str, variant: str = DEFAULT_VARIANT) -> str:
    """A single line number: the first number on the answer line, else the last
    number in the visible text."""
    text = as_bytes_text(visible_text(raw))
    marker = find_answer_marker(text, variant)
    if marker >= 0:
        found = _DIGITS_RE.findall(_answer_line(text, marker))
        if found:
            return normalize_int(found[0])
    found = _DIGITS_RE.findall(text)
    return normalize_int(found[-1]) if found else "?"


# ---------------------------------------------------------------- free text kinds

_NUMBER_WORDS = {
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
}
_STRIP_CHARS = " \t*_`'\"()[]{}<>.;:!"


def normalize_phrase(text: str) -> str:
    """Lower case, markup and edge punctuation removed, whitespace collapsed,
    a leading article dropped, number words turned into digits."""
    text = text.replace("\\text{", "").replace("\\boxed{", "").replace("$", "")
    text = re.sub(r"\s+", " ", text.strip().strip(_STRIP_CHARS).lower()).strip()
    text = text.strip(_STRIP_CHARS)
    for article in ("the ", "a ", "an "):
        if text.startswith(article):
            text = text[len(article) :]
            break
    return _NUMBER_WORDS.get(text, text)


def _answer_text(raw: str) -> str:
    """The text after the `Answer:` marker on its line; without a marker, the
    last non-empty line of the visible text."""
    text = visible_text(raw)
    marker = find_answer_marker(text)
    if marker >= 0:
        line = _answer_line(text, marker, SEQ_WINDOW)[6:]
        line = line.lstrip("*_ \t")
        if line.startswith(":"):
            line = line[1:]
        line = line.strip()
        if line.strip("*_` \t"):
            return line
        rest = text[marker:].split("\n")[1:]
        for candidate in rest:
            if candidate.strip("*_` \t"):
                return candidate.strip()
        return ""
    lines = [ln for ln in text.split("\n") if ln.strip("*_` \t")]
    return lines[-1].strip() if lines else ""


def extract_sequence(raw: str) -> str:
    """Ordered sequence `a, b, c` (normalized items joined by `, `), or `?`."""
    body = _answer_text(raw)
    if not body:
        return "?"
    items = [normalize_phrase(x) for x in re.split(r"[,;]", body)]
    items = [x for x in items if x]
    return ", ".join(items) if items else "?"


def extract_string(raw: str) -> str:
    """Exact-string answers: the normalized answer text, or `?`."""
    body = normalize_phrase(_answer_text(raw))
    return body if body else "?"


# ---------------------------------------------------------------- per case


def extract(case: dict[str, Any], raw: str, variant: str = DEFAULT_VARIANT) -> str:
    """What the model answered for `case`, as a short string (`?` = nothing found)."""
    kind = case["answer_kind"]
    if kind == "multiple_choice":
        return extract_letter(raw, len(case["choices"]), variant)
    if kind == "integer":
        return extract_integer(raw, variant)
    if kind == "line_set":
        return extract_line_spec(raw, variant)
    if kind == "line":
        return extract_line(raw, variant)
    if kind == "ordered_sequence":
        return extract_sequence(raw)
    if kind == "exact_string":
        return extract_string(raw)
    raise ValueError(f"unknown answer_kind {kind!r}")


def _accepted(case: dict[str, Any]) -> Iterable[str]:
    yield str(case["answer"])
    yield from (str(a) for a in case.get("aliases") or ())


def matches(case: dict[str, Any], picked: str, variant: str = DEFAULT_VARIANT) -> bool:
    """Does the extracted answer `picked` satisfy the case's gold answer?"""
    if not picked or picked == "?":
        return False
    kind = case["answer_kind"]
    if kind == "multiple_choice":
        return picked[:1] == str(case["answer"])[:1]
    if kind == "integer":
        got = normalize_int(picked)
        return any(got == normalize_int(a) for a in _accepted(case) if re.fullmatch(r"[\d,]+", a))
    if kind == "line_set":
        gold = set(case.get("accepted_lines") or ()) or parse_line_spec(str(case["answer"]))
        got = parse_line_spec(picked, ds4_dangling=variant != "c")
        return bool(got) and bool(gold) and got <= gold
    if kind == "line":
        return any(normalize_int(picked) == normalize_int(a) for a in _accepted(case))
    if kind == "ordered_sequence":
        want = [normalize_phrase(x) for x in str(case["answer"]).split(",")]
        return [x.strip() for x in picked.split(",")] == want
    if kind == "exact_string":
        return any(picked == normalize_phrase(a) for a in _accepted(case))
    raise ValueError(f"unknown answer_kind {kind!r}")


def grade_detail(case: dict[str, Any], raw: str, variant: str = DEFAULT_VARIANT) -> tuple[str, bool]:
    """`(picked, passed)` for one model output."""
    picked = extract(case, raw, variant)
    return picked, matches(case, picked, variant)


def grade(case: dict[str, Any], model_output: str, variant: str = DEFAULT_VARIANT) -> bool:
    """Does `model_output` (raw text, thinking and `</think>` included) answer `case`?"""
    return grade_detail(case, model_output, variant)[1]
