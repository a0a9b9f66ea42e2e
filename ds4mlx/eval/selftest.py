"""`ds4mlx eval --self-test-extractors`: every built-in extractor vector, no model.

A vector passes when the extraction equals `expect` and the grade against `key`
equals `passes`.  The vectors cover docs/eval.md §7.1 and §7.2 (with the
variant-C result, fixes included), the seed's false-negative fixes, and the
answer kinds of the hard suite.  Two structural checks follow: the trace splitter
(docs/eval.md §7.1's trace-parsing test) and the regrade status rule (1 PASSED + 2 STOPPED ->
passed=1 not_graded=2).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, TextIO

from ..chat.markers import THINK_CLOSE
from .extract import extract, matches


class Vector(NamedTuple):
    name: str
    kind: str  # mc/N | int | compsec | line | seq | str
    key: str  # gold answer (compsec: line spec; line/str: "answer|alias|...")
    text: str  # raw model output
    expect: str  # extraction
    passes: bool  # grade against key


def make_case(kind: str, key: str) -> dict[str, Any]:
    """A synthetic case of `kind` with gold answer `key`."""
    base: dict[str, Any] = {"source": "SELFTEST", "id": "vector", "choices": [], "aliases": []}
    if kind.startswith("mc/"):
        n = int(kind[3:])
        return {**base, "answer_kind": "multiple_choice", "choices": [f"option {i}" for i in range(n)], "answer": key}
    if kind == "int":
        answer, *aliases = key.split("|")
        return {**base, "answer_kind": "integer", "answer": answer, "aliases": aliases}
    if kind == "compsec":
        from .extract import parse_line_spec

        return {
            **base,
            "source": "COMPSEC",
            "answer_kind": "line_set",
            "answer": key,
            "accepted_lines": sorted(parse_line_spec(key)),
        }
    answer, *aliases = key.split("|")
    kinds = {"line": "line", "seq": "ordered_sequence", "str": "exact_string"}
    return {**base, "answer_kind": kinds[kind], "answer": answer, "aliases": aliases}


T = THINK_CLOSE
V = Vector
VECTORS: list[Vector] = [
    # ---- docs/eval.md §7.1: the ds4 built-in self-tests (PR #185)
    V(
        "multiple-choice prefers final answer marker",
        "mc/10",
        "F",
        "</think>So answer is 0.716 H+/O2. That corresponds to option F.\nThus final answer: F.</think>"
        "The visible explanation repeats the calculation.\nAnswer: F",
        "F",
        True,
    ),
    V(
        "multiple-choice prefers Answer-colon over later prose",
        "mc/10",
        "F",
        "</think>Answer: F\nThis answer is final; option H is a tempting distractor.",
        "F",
        True,
    ),
    V(
        "multiple-choice preserves loose-answer fallback",
        "mc/10",
        "F",
        "</think>The answer is F. This answer is final; option H is tempting.",
        "F",
        True,
    ),
    V(
        "integer prefers final answer marker",
        "int",
        "82",
        "</think>I first thought the answer was 80.\nFinal answer: 082",
        "82",
        True,
    ),
    V(
        "integer preserves loose-answer fallback",
        "int",
        "82",
        "</think>The answer is 082. This answer comes from AIME 2025.",
        "82",
        True,
    ),
    V(
        "COMPSEC prefers final answer marker",
        "compsec",
        "9-10",
        "</think>I think the answer should be line 10, because CWE-122 may apply.\n**Answer:** 10</think>"
        "The primary write is at line 10.\nAnswer: 10",
        "10",
        True,
    ),
    # ---- docs/eval.md §7.2: multiple choice
    V("mc basic", "mc/4", "B", "thinking...</think>\nThe correct option is B.\n\nAnswer: B", "B", True),
    V("mc no think close", "mc/4", "C", "Let me think. Answer: C", "C", True),
    V("mc lowercase", "mc/4", "B", "</think>answer: (b)", "B", True),
    V("mc bold", "mc/4", "D", "</think>**Answer: D**", "D", True),
    V("mc no marker -> last letter", "mc/4", "C", "</think>Between B and C, I pick C.", "C", True),
    V("mc out-of-range letter", "mc/4", "B", "</think>Answer: F\nso B", "B", True),
    V("mc pronoun I", "mc/10", "C", "</think>Answer: I think it is C", "C", True),
    V("mc article A", "mc/10", "B", "</think>Answer: A careful check gives B", "B", True),
    V("mc negation not", "mc/4", "D", "</think>Answer: not B, D", "D", True),
    V("mc D, not B guard", "mc/4", "D", "</think>Answer: D, not B", "D", True),
    V("mc rules out", "mc/4", "D", "</think>Answer: this rules out C, so D", "D", True),
    V("mc apostrophe", "mc/10", "C", "</think>Answer: I'm sure it's C", "C", True),
    V("mc 'answers' substring", "mc/4", "A", "</think>All answers are close. Final: A", "A", True),
    V("mc earlier loose answer", "mc/4", "C", "</think>The answer might be B.\nAnswer: C", "C", True),
    # ---- docs/eval.md §7.2: integers
    V("int basic", "int", "70", "</think>So the sum is 21+49 = 70.\n\nAnswer: 70", "70", True),
    V("int leading zero", "int", "70", "</think>Answer: 070", "70", True),
    V("int all zeros", "int", "0", "</think>Answer: 000", "0", True),
    V("int no marker", "int", "468", "</think>The area is 468.", "468", True),
    V("int last '=' rule", "int", "468", "</think>Answer: 2*234 = 468", "468", True),
    V("int boxed", "int", "468", "</think>Answer: $\\boxed{468}$", "468", True),
    V("int next line", "int", "468", "</think>Answer:\n468", "468", True),
    V("int sign", "int", "5", "</think>Answer: -5", "5", True),
    V("int decimal", "int", "3", "</think>Answer: 3.5", "3", True),
    V("int thousands separator", "int", "1000", "</think>Answer: 1,000", "1000", True),
    V(
        "int earlier loose answer",
        "int",
        "588",
        "</think>The answer was 80 before correction.\nAnswer: 588",
        "588",
        True,
    ),
    V("int no digits", "int", "1", "</think>no digits here", "?", False),
    # ---- docs/eval.md §7.2: COMPSEC line specs
    V("compsec single", "compsec", "11", "</think>Answer: 11", "11", True),
    V("compsec 'line N'", "compsec", "9-10", "</think>Answer: line 9", "9", True),
    V("compsec 'and'", "compsec", "3,13-15", "</think>Answer: 3 and 15", "3,15", True),
    V("compsec list", "compsec", "3,13-15", "</think>Answer: 13, 14, 15", "13,14,15", True),
    V("compsec range", "compsec", "8,20-22", "</think>Answer: 20-22", "20-22", True),
    V("compsec spaced range", "compsec", "8,20-22", "</think>Answer: 20 - 22", "20-22", True),
    V("compsec too wide", "compsec", "8,20-22", "</think>Answer: 19-22", "19-22", False),
    V("compsec one outside", "compsec", "17-20", "</think>Answer: 17, 21", "17,21", False),
    V("compsec safe claim", "compsec", "11", "</think>Answer: 0", "0", False),
    V("compsec space-separated (no 13,5 quirk)", "compsec", "3,13-15", "</think>Answer: 13 15", "13,15", True),
    V("compsec space-separated 2", "compsec", "12-13", "</think>Answer: 12 13", "12,13", True),
    V("compsec next-line fallback", "compsec", "11", "</think>Answer:\n11", "11", True),
    V("compsec no marker", "compsec", "11", "</think>The bug is on line 11.", "11", True),
    V("compsec dangling dash", "compsec", "17-20", "</think>Answer: 20-, 17", "20,17", True),
    V("compsec en-dash range", "compsec", "17-20", "</think>Answer: 17\u201320", "17-20", True),
    V("compsec en-dash range too wide", "compsec", "17-20", "</think>Answer: 16\u201320", "16-20", False),
    V("compsec earlier loose answer", "compsec", "5", "</think>The answer is not line 4.\nAnswer: 5", "5", True),
    # ---- seed fixes (issues #319 / #321)
    V("seed: I think it is C", "mc/10", "C", "</think>Answer: I think it is C", "C", True),
    V("seed: A careful reading shows C", "mc/10", "C", "</think>Answer: A careful reading shows C", "C", True),
    V("seed: I'll go with C", "mc/10", "C", "</think>Answer: I'll go with C.", "C", True),
    V("seed: bare I still recovered", "mc/10", "I", "</think>Answer: I.", "I", True),
    V("seed: It is not B, the answer is D", "mc/10", "D", "</think>Answer: It is not B, the answer is D", "D", True),
    V("seed: rules out C, leaving D", "mc/4", "D", "</think>Answer: rules out C, leaving D", "D", True),
    V("seed: Answer: D, not B stays D", "mc/10", "D", "</think>Answer: D, not B", "D", True),
    V("negation isn't", "mc/4", "D", "</think>Answer: it isn't B; D", "D", True),
    V("negation eliminate", "mc/4", "C", "</think>Answer: eliminate A, C", "C", True),
    V("negation except", "mc/10", "E", "</think>Answer: everything except B; E", "E", True),
    V("negation ruled out", "mc/4", "A", "</think>Answer: we ruled out D, leaving A", "A", True),
    V("negation does not cross lines", "mc/4", "B", "</think>It is not\nAnswer: B", "B", True),
    V("letter then prose", "mc/4", "C", "</think>Answer: C is correct", "C", True),
    V("seed: m+n = 256+37 = 293", "int", "293", "</think>Answer: m+n = 256+37 = 293", "293", True),
    V("seed: Final answer: 082", "int", "82", "</think>Final answer: 082", "82", True),
    V("int '=' with nothing after", "int", "12", "</think>Answer: 12 =", "12", True),
    V("int answer line only", "int", "45", "</think>Answer: 45\nThis used 2025 and 7 as inputs.", "45", True),
    V("int no-marker takes last number", "int", "17", "</think>First 3, then 17", "17", True),
    V("int grouped alias", "int", "3986729|3,986,729", "</think>Answer: 3,986,729", "3986729", True),
    V("int wrong answer", "int", "293", "</think>Answer: 292", "292", False),
    # ---- hard suite kinds
    V("line single", "line", "16", "</think>Answer: 16", "16", True),
    V("line with 'line'", "line", "16", "</think>**Answer:** line 16", "16", True),
    V("line alias accepted", "line", "16|11", "</think>Answer: 11", "11", True),
    V("line wrong", "line", "16", "</think>Answer: 15", "15", False),
    V("line no marker", "line", "27|18", "</think>The use after free is on line 27.", "27", True),
    V(
        "sequence basic",
        "seq",
        "techno, british, 5, turtle",
        "</think>Answer: techno, british, 5, turtle",
        "techno, british, 5, turtle",
        True,
    ),
    V("sequence case and bold", "seq", "no, no, yes", "</think>**Answer: No, No, Yes**", "no, no, yes", True),
    V(
        "sequence number word",
        "seq",
        "goat, dutch, 1, rabbit",
        "</think>Answer: Goat, Dutch, one, Rabbit.",
        "goat, dutch, 1, rabbit",
        True,
    ),
    V("sequence wrong order", "seq", "yes, no, yes", "</think>Answer: no, yes, yes", "no, yes, yes", False),
    V("sequence too short", "seq", "no, yes, no", "</think>Answer: no, yes", "no, yes", False),
    V("sequence next line", "seq", "no, yes, no", "</think>Answer:\n**no, yes, no**", "no, yes, no", True),
    V(
        "string exact",
        "str",
        "square pyramid|square-based pyramid",
        "</think>Answer: square pyramid",
        "square pyramid",
        True,
    ),
    V(
        "string article and period",
        "str",
        "square pyramid|square-based pyramid",
        "</think>Answer: A square pyramid.",
        "square pyramid",
        True,
    ),
    V(
        "string alias",
        "str",
        "square pyramid|square-based pyramid",
        "</think>Answer: **Square-based pyramid**",
        "square-based pyramid",
        True,
    ),
    V(
        "string wrong",
        "str",
        "square pyramid|square-based pyramid",
        "</think>Answer: triangular prism",
        "triangular prism",
        False,
    ),
]


def check_vector(v: Vector) -> tuple[bool, str, bool]:
    case = make_case(v.kind, v.key)
    got = extract(case, v.text)
    ok = matches(case, got)
    return got == v.expect and ok == v.passes, got, ok


def _trace_self_tests() -> list[str]:
    """Structural checks of the trace reader and of regrade's status rule."""
    from .trace import TraceRecord, format_record, parse_trace, regrade_records

    failures: list[str] = []
    tricky = "Answer: F\n===== CASE 9/9 FAKE/x =====\nMODEL_OUTPUT_END\nstatus: PASSED\n"
    case = make_case("mc/10", "F")
    recs = [
        TraceRecord(
            1,
            2,
            "SELFTEST",
            "vector",
            "d",
            "t",
            "PASSED",
            "F",
            "F",
            question="q MODEL_OUTPUT_BEGIN bytes=3\n",
            output="Answer: F",
        ),
        TraceRecord(
            2, 2, "SELFTEST", "vector2", "d", "t", "FAILED", "?", "F", question="MODEL_OUTPUT_BEGIN", output=tricky
        ),
    ]
    text = "# ds4-eval trace\n\n" + "".join(format_record(r, case) for r in recs)
    parsed = parse_trace(text)
    if len(parsed) != 2 or parsed[1].id != "vector2" or parsed[1].output != tricky:
        failures.append("trace splitter: a fake CASE line or MODEL_OUTPUT_END inside a payload broke parsing")
    statuses = [("PASSED", "Answer: F"), ("STOPPED", "Answer: F"), ("STOPPED", "")]
    recs = [
        TraceRecord(i, 3, "SELFTEST", "vector", "d", "t", s, "F", "F", output=o) for i, (s, o) in enumerate(statuses, 1)
    ]
    summary = regrade_records(parse_trace("".join(format_record(r, case) for r in recs)), lookup=lambda s, i: case)
    if (summary.passed, summary.failed, summary.not_graded, summary.changed) != (1, 0, 2, 0):
        failures.append(f"regrade status rule: 1 PASSED + 2 STOPPED gave {summary.line('x')}")
    return failures


def run_self_test(out: TextIO | None = None, verbose: bool = False) -> int:
    out = out or sys.stdout
    failed = 0
    for v in VECTORS:
        ok, got, graded = check_vector(v)
        if not ok:
            failed += 1
            print(
                f"ds4-eval: extractor self-test failed: {v.name} (got {got}, expected {v.expect}, "
                f"key {v.key}, graded {'pass' if graded else 'fail'}, expected {'pass' if v.passes else 'fail'})",
                file=out,
            )
        elif verbose:
            print(f"  ok  {v.name}: {got}", file=out)
    for msg in _trace_self_tests():
        failed += 1
        print(f"ds4-eval: extractor self-test failed: {msg}", file=out)
    if failed:
        print(f"ds4-eval: {failed} of {len(VECTORS) + 2} self-tests failed", file=out)
        return 1
    print(f"ds4-eval: answer extractor self-tests passed ({len(VECTORS)} vectors + 2 trace checks)", file=out)
    return 0
