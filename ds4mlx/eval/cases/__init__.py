"""Eval cases as data: `cases/core.json` (92, ds4-eval order) and `cases/hard.json` (50).

Every case is a dict with these fields:

| field | meaning |
|---|---|
| `index` | 1-based position in its file (core keeps ds4's numbering) |
| `id`, `source` | `(source, id)` is the key a trace / regrade uses |
| `source_url`, `license` | where the text comes from and under which terms (SOURCES.md) |
| `domain`, `title` | shown in the UI and the trace only, never sent to the model |
| `question`, `choices` | what the model sees (`choices` empty unless multiple choice) |
| `answer`, `aliases` | gold answer as stored, and other accepted forms |
| `answer_kind` | multiple_choice, integer, exact_string, ordered_sequence, line, line_set |
| `accepted_lines` | line_set only: the audited gold line set |
| `max_tokens` | the case's generation budget (16000; Juliet 8000) |
| `suites` | subset of core, hard, hard-smoke |
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable
from functools import cache
from importlib import resources
from typing import Any

from ..extract import parse_line_spec
from ..prompts import build_prompt

SUITES = ("core", "hard", "hard-smoke")
ANSWER_KINDS = ("multiple_choice", "integer", "exact_string", "ordered_sequence", "line", "line_set")
_FILES = {"core": "core.json", "hard": "hard.json", "hard-smoke": "hard.json"}
_REQUIRED = {
    "index": int,
    "id": str,
    "source": str,
    "source_url": str,
    "license": str,
    "domain": str,
    "title": str,
    "question": str,
    "choices": list,
    "answer": str,
    "aliases": list,
    "answer_kind": str,
    "max_tokens": int,
    "suites": list,
}


@cache
def _read(name: str) -> tuple[dict[str, Any], ...]:
    text = resources.files("ds4mlx.eval.cases").joinpath(name).read_text(encoding="utf-8")
    return tuple(json.loads(text))


def load_cases(suite: str = "core") -> list[dict[str, Any]]:
    """The cases of `suite` (core, hard or hard-smoke), in order, as fresh dicts."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r} (expected one of {', '.join(SUITES)})")
    return [copy.deepcopy(c) for c in _read(_FILES[suite]) if suite in c["suites"]]


def all_cases() -> list[dict[str, Any]]:
    """Every shipped case (core then hard), each once."""
    return [copy.deepcopy(c) for name in ("core.json", "hard.json") for c in _read(name)]


def find_case(source: str, case_id: str) -> dict[str, Any] | None:
    for name in ("core.json", "hard.json"):
        for c in _read(name):
            if c["source"] == source and c["id"] == case_id:
                return copy.deepcopy(c)
    return None


def select(
    cases: list[dict[str, Any]], case_ids: Iterable[str] = (), domains: Iterable[str] = (), sources: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """Filter `cases`.  `case_ids` match the id or the 1-based index; `domains` and
    `sources` match case-insensitively, a domain also by prefix (`Math` matches
    `Math / Combinatorics`).  Empty filters keep everything.  Order is kept."""
    ids = [str(x) for x in case_ids]
    doms = [d.lower() for d in domains]
    srcs = [s.lower() for s in sources]
    out = []
    for c in cases:
        if ids and c["id"] not in ids and str(c["index"]) not in ids:
            continue
        if doms and not any(c["domain"].lower() == d or c["domain"].lower().startswith(d) for d in doms):
            continue
        if srcs and c["source"].lower() not in srcs:
            continue
        out.append(c)
    return out


def unknown_ids(cases: list[dict[str, Any]], case_ids: Iterable[str]) -> list[str]:
    known = {c["id"] for c in cases} | {str(c["index"]) for c in cases}
    return [x for x in case_ids if x not in known]


def validate_cases() -> list[str]:
    """Integrity checks over the shipped data; returns the problems found (empty = fine)."""
    errors: list[str] = []
    seen: set[tuple[str, str]] = set()
    for name in ("core.json", "hard.json"):
        for pos, c in enumerate(_read(name), 1):
            where = f"{name}#{pos} {c.get('source')}/{c.get('id')}"
            for field, typ in _REQUIRED.items():
                if not isinstance(c.get(field), typ):
                    errors.append(f"{where}: field {field!r} missing or not {typ.__name__}")
            if errors and errors[-1].startswith(where):
                continue
            errors += [f"{where}: {e}" for e in _check_case(c, pos, name)]
            key = (c["source"], c["id"])
            if key in seen:
                errors.append(f"{where}: duplicate (source, id)")
            seen.add(key)
    core = _read("core.json")
    if len(core) != 92:
        errors.append(f"core.json: {len(core)} cases, expected 92")
    if len(_read("hard.json")) != 50:
        errors.append(f"hard.json: {len(_read('hard.json'))} cases, expected 50")
    return errors


def _check_case(c: dict[str, Any], pos: int, name: str) -> list[str]:
    errs = []
    if c["index"] != pos:
        errs.append(f"index {c['index']} != position {pos}")
    kind = c["answer_kind"]
    if kind not in ANSWER_KINDS:
        return errs + [f"unknown answer_kind {kind!r}"]
    if not set(c["suites"]) <= set(SUITES) or not c["suites"]:
        errs.append(f"bad suites {c['suites']}")
    if "hard-smoke" in c["suites"] and "hard" not in c["suites"]:
        errs.append("hard-smoke case not in hard")
    if c["max_tokens"] < 1:
        errs.append("max_tokens < 1")
    if not c["question"].strip() or not c["answer"].strip():
        errs.append("empty question or answer")
    if (kind == "multiple_choice") != bool(c["choices"]):
        errs.append("choices must be present exactly for multiple_choice")
    if kind == "multiple_choice":
        n = len(c["choices"])
        if not (2 <= n <= 26) or not re.fullmatch(f"[A-{chr(64 + n)}]", c["answer"]):
            errs.append(f"answer {c['answer']!r} is not a letter among {n} choices")
    elif kind == "integer":
        for a in [c["answer"], *c["aliases"]]:
            if not re.fullmatch(r"\d+|\d{1,3}(,\d{3})+", a):
                errs.append(f"integer answer/alias {a!r} is not an unsigned integer")
    elif kind in ("line", "line_set"):
        listing = {int(n) for n in re.findall(r"(?m)^\s*(\d+): ", c["question"])}
        gold = set(c.get("accepted_lines") or ()) if kind == "line_set" else set()
        if kind == "line_set":
            if not gold or gold != parse_line_spec(c["answer"]):
                errs.append("accepted_lines does not match the answer spec")
        else:
            for a in [c["answer"], *c["aliases"]]:
                if not a.isdigit():
                    errs.append(f"line answer/alias {a!r} is not a line number")
                else:
                    gold.add(int(a))
        if not gold <= listing:
            errs.append(f"gold lines {sorted(gold - listing)} not in the numbered listing")
    elif kind == "ordered_sequence" and "," not in c["answer"]:
        errs.append("ordered_sequence answer is not a comma-separated list")
    prompt = build_prompt(c).system + "\n" + build_prompt(c).user
    if c["id"] in prompt:
        errs.append("the case id appears in the prompt")
    if not c["question"].startswith(c["title"].rstrip(". ")[:40]) and c["title"] in prompt:
        errs.append("the title appears in the prompt")
    if "juliet" in c["id"].lower() and re.search(r"CWE|FLAW|FIX|bad\(|good", prompt):
        errs.append("a Juliet prompt names the CWE or the flaw markers")
    return errs
