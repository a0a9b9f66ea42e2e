"""ds4mlx.eval: case data, prompts, extractors and the --self-test-extractors CLI.
No model, no MLX."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from importlib import resources

import pytest

from ds4mlx.eval import build_prompt, extract, grade, load_cases, validate_cases
from ds4mlx.eval.cases import select
from ds4mlx.eval.extract import extract_integer, extract_letter, extract_line_spec, parse_line_spec
from ds4mlx.eval.prompts import SYSTEM_PROMPT, user_prompt
from ds4mlx.eval.selftest import VECTORS, check_vector, make_case

NO_MLX = (
    "import sys\n"
    "from ds4mlx.cli.commands import main\n"
    "rc = main({argv!r})\n"
    "bad = [m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')]\n"
    "assert not bad, bad\n"
    "sys.exit(rc)\n"
)


def _run_cli(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_MLX.format(argv=argv)], capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- self-test CLI


def test_self_test_extractors_cli_passes_without_mlx():
    r = _run_cli(["eval", "--self-test-extractors"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ds4-eval: answer extractor self-tests passed" in r.stdout
    assert len(VECTORS) >= 60


def test_self_test_reports_failures(monkeypatch, capsys):
    from ds4mlx.eval import selftest

    bad = selftest.Vector("deliberately wrong", "int", "5", "</think>Answer: 6", "5", True)
    monkeypatch.setattr(selftest, "VECTORS", [*selftest.VECTORS, bad])
    assert selftest.run_self_test() == 1
    out = capsys.readouterr().out
    assert "extractor self-test failed: deliberately wrong (got 6, expected 5" in out


def test_import_does_not_import_mlx():
    code = (
        "import sys, ds4mlx.eval, ds4mlx.eval.cli, ds4mlx.eval.runner, ds4mlx.eval.backends, "
        "ds4mlx.eval.inprocess, ds4mlx.eval.tui, ds4mlx.eval.trace\n"
        "assert not [m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("v", VECTORS, ids=[v.name for v in VECTORS])
def test_vector(v):
    ok, got, graded = check_vector(v)
    assert ok, (got, graded)


# ---------------------------------------------------------------- the seed's fixes, spelled out


@pytest.mark.parametrize(
    "text,gold",
    [
        ("</think>Answer: I think it is C", "C"),
        ("</think>Answer: A careful reading shows C", "C"),
        ("</think>Answer: I'll go with C.", "C"),
        ("</think>Answer: It is not B, the answer is D", "D"),
        ("</think>Answer: rules out C, leaving D", "D"),
        ("</think>Answer: the answer isn't B; C", "C"),
        ("</think>Answer: eliminate B and pick E", "E"),
        ("</think>Answer: all except B; so G", "G"),
        ("</think>Answer: D, not B", "D"),
    ],
)
def test_multiple_choice_fixes(text, gold):
    assert extract_letter(text, 10) == gold


def test_integer_answer_line_and_last_equals():
    assert extract_integer("</think>Answer: m+n = 256+37 = 293") == "293"
    assert extract_integer("</think>Final answer: 082") == "82"
    assert extract_integer("</think>Answer: 45\nfootnote from 2025") == "45"


def test_compsec_no_space_quirk():
    assert extract_line_spec("</think>Answer: 13 15") == "13,15"
    assert parse_line_spec("3,13-15") == {3, 13, 14, 15}


# ---------------------------------------------------------------- ds4 variants a/b (explain old traces)


@pytest.mark.parametrize(
    "kind,text,a,b",
    [
        ("mc/10", "</think>Answer: I think it is C", "I", "I"),
        ("mc/10", "</think>Answer: A careful check gives B", "A", "A"),
        ("mc/4", "</think>Answer: not B, D", "B", "B"),
        ("mc/4", "</think>Answer: this rules out C, so D", "C", "C"),
        ("mc/4", "</think>The answer might be B.\nAnswer: C", "B", "C"),
        ("int", "</think>Answer: 2*234 = 468", "2", "2"),
        ("int", "</think>Answer: 1,000", "1", "1"),
        ("int", "</think>The answer was 80 before correction.\nAnswer: 588", "80", "588"),
        ("compsec", "</think>Answer: 13 15", "13,5", "13,5"),
        ("compsec", "</think>Answer: 12 13", "12,3", "12,3"),
        ("compsec", "</think>Answer: 20-, 17", "20-,17", "20-,17"),
        ("compsec", "</think>Answer: 17\u201320", "17,20", "17,20"),
        ("compsec", "</think>The answer is not line 4.\nAnswer: 5", "4", "5"),
        # §7.1 under the snapshot: three of the six built-in vectors fail
        ("mc/10", VECTORS[0].text, "H", "F"),
        ("int", VECTORS[3].text, "80", "82"),
        ("compsec", VECTORS[5].text, "10,122", "10"),
    ],
)
def test_ds4_variants_a_and_b(kind, text, a, b):
    case = make_case(kind, "1")
    assert extract(case, text, "a") == a
    assert extract(case, text, "b") == b


# ---------------------------------------------------------------- cases and prompts


def test_suites():
    core, hard, smoke = load_cases("core"), load_cases("hard"), load_cases("hard-smoke")
    assert len(core) == 92 and len(hard) == 50 and len(smoke) == 10
    assert [c["index"] for c in core] == list(range(1, 93))
    assert [c["source"] for c in core[:6]] == ["GPQA Diamond", "SuperGPQA", "AIME2025"] * 2
    assert Counter(c["source"] for c in core) == {"GPQA Diamond": 25, "SuperGPQA": 25, "AIME2025": 25, "COMPSEC": 17}
    assert Counter(c["source"] for c in smoke) == {"MMLU-Pro": 3, "OlympiadBench": 3, "LiveBench": 2, "NIST Juliet": 2}
    assert Counter(c["answer_kind"] for c in hard) == {
        "multiple_choice": 15,
        "integer": 17,
        "line": 10,
        "ordered_sequence": 7,
        "exact_string": 1,
    }
    assert all(c["license"] and c["source_url"] for c in core + hard)
    shared = json.loads(resources.files("ds4mlx.eval.cases").joinpath("core.json").read_text())
    assert [c["id"] for c in shared] == [c["id"] for c in core]


def test_case_data_matches_the_shared_sources():
    """The shipped files keep every field of /work/shared/eval's data unchanged."""
    import os

    for name, suite in (("core_cases.json", "core"), ("hard_cases.json", "hard")):
        path = os.path.join("/work/shared/eval", name)
        if not os.path.exists(path):
            pytest.skip("shared eval data not present")
        ours = load_cases(suite)
        for theirs, mine in zip(json.load(open(path)), ours, strict=True):
            assert {k: mine[k] for k in theirs} == theirs


def test_validate_cases_clean_and_cli():
    assert validate_cases() == []
    r = _run_cli(["eval", "--validate-cases"])
    assert r.returncode == 0 and "case data valid (92 core, 50 hard, 10 hard-smoke)" in r.stdout


def test_list_cases_cli_filters():
    r = _run_cli(["eval", "--suite", "hard", "--source", "NIST Juliet", "--list-cases"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("10 cases")
    r = _run_cli(["eval", "--suite", "core", "--domain", "Physics", "--case-id", "1", "--list-cases"])
    assert "recNu3MXkvWUzHZr9" in r.stdout and r.stdout.strip().endswith("1 cases")
    r = _run_cli(["eval", "--case-id", "nope", "--list-cases"])
    assert r.returncode == 2 and "unknown case id" in r.stderr


def test_select():
    hard = load_cases("hard")
    assert len(select(hard, domains=["math"])) == 3 + 15  # MMLU-Pro "Math" + OlympiadBench "Math / ..."
    assert [c["id"] for c in select(hard, case_ids=["2", "mmlupro-8941"])] == [hard[0]["id"], hard[1]["id"]]


def test_prompt_case_7_byte_exact():
    case = load_cases("core")[6]
    assert user_prompt(case) == (
        "Find KE of product particles in,\nPi(+) = mu(+) + nu\nhere Pi(+) is stationary.\nRest mass of Pi(+) "
        "& mu(+) is 139.6 MeV & 105.7 MeV respectively.\n\nChoices:\nA. 7.2 MeV, 32.8 MeV\nB. 4.12 MeV, 29.8 MeV\n"
        "C. 2.84 MeV, 26.8 MeV\nD. 3.52 MeV, 20.8 MeV\n\nSolve the question. At the end, write exactly one final "
        "line in this format and do not write anything after it:\nAnswer: <letter>"
    )
    assert SYSTEM_PROMPT == (
        "You are solving a hard benchmark question. Reason carefully. The final answer "
        "must follow the requested format exactly."
    )


def test_prompt_tails_per_kind():
    core = load_cases("core")
    assert user_prompt(core[2]).endswith(
        "\n\nSolve the problem. At the end, write exactly one final line in this "
        "format and do not write anything after it:\nAnswer: <integer>"
    )
    assert user_prompt(core[80]).endswith(
        "\n\nAt the end, write exactly one final line in this format and do not "
        "write anything after it:\nAnswer: <line number or comma-separated line "
        "numbers>"
    )
    hard = {c["answer_kind"]: c for c in load_cases("hard")}
    assert user_prompt(hard["line"]).endswith("Answer: <line number>")
    assert "Answer: <answers to the questions, in the order asked, separated by commas, e.g. a, b, c>" in user_prompt(
        hard["ordered_sequence"]
    )
    assert user_prompt(hard["exact_string"]).endswith("Answer: <your answer, as a short phrase>")


def test_id_title_domain_never_reach_the_model():
    for c in load_cases("core") + load_cases("hard"):
        p = build_prompt(c)
        text = p.system + p.user + p.text
        assert c["id"] not in text
        if c["source"] == "NIST Juliet":
            assert "CWE" not in text and c["title"] not in text and c["domain"] not in text


def test_grade_public_api_on_real_cases():
    core = load_cases("core")
    assert grade(core[0], "reasoning</think>\nAnswer: B") is True
    assert grade(core[0], "reasoning</think>\nAnswer: A") is False
    compsec = core[80]  # answer 10-15
    assert grade(compsec, "</think>Answer: 14, 15") and not grade(compsec, "</think>Answer: 16")
    hard = load_cases("hard")
    big = next(c for c in hard if c["id"] == "olympiadbench-1697")
    assert grade(big, "</think>Answer: 3,986,729") and grade(big, "</think>Answer: 3986729")
    juliet = next(c for c in hard if c["aliases"] and c["answer_kind"] == "line")
    assert grade(juliet, f"</think>Answer: {juliet['aliases'][0]}")
    assert grade(juliet, f"</think>Answer: line {juliet['answer']}")


def test_sources_md_lists_every_source_and_licence():
    text = resources.files("ds4mlx.eval.cases").joinpath("SOURCES.md").read_text()
    for needle in (
        "GPQA Diamond",
        "SuperGPQA",
        "AIME2025",
        "COMPSEC",
        "MMLU-Pro",
        "OlympiadBench",
        "LiveBench",
        "NIST Juliet",
        "CC-BY-4.0",
        "ODC-BY",
        "Apache-2.0",
        "MIT",
        "CC0-1.0",
    ):
        assert needle in text, needle
