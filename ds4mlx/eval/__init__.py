"""ds4-eval for ds4mlx: case data, answer extractors, runner, TUI.

Public API (no MLX import):

    from ds4mlx.eval import load_cases, grade
    cases = load_cases("core")            # or "hard", "hard-smoke"
    grade(cases[0], model_output)         # -> bool, the harness's own extractor + comparison

`extract(case, output)` gives the extracted answer string; `validate_cases()`
checks the shipped data.
"""

from __future__ import annotations

from .cases import SUITES, all_cases, find_case, load_cases, validate_cases
from .extract import extract, grade, grade_detail, matches
from .prompts import SYSTEM_PROMPT, build_prompt, user_prompt

__all__ = [
    "SUITES",
    "load_cases",
    "all_cases",
    "find_case",
    "validate_cases",
    "grade",
    "grade_detail",
    "extract",
    "matches",
    "build_prompt",
    "user_prompt",
    "SYSTEM_PROMPT",
]
