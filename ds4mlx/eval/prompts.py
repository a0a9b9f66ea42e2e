"""Prompt rendering for eval cases (docs/eval.md §2).

Only `question` and `choices` reach the model: a case's id, title and domain never
do (Juliet ids and titles name the CWE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..chat.markers import ASSISTANT, BOS, THINK_CLOSE, THINK_MAX_PREFIX, THINK_OPEN, USER  # noqa: F401 (the prompt's markers)

SYSTEM_PROMPT = (
    "You are solving a hard benchmark question. Reason carefully. "
    "The final answer must follow the requested format exactly."
)

_FINAL = "At the end, write exactly one final line in this format and do not write anything after it:\n"

# Per answer kind: the text appended after the question (and the choices).
INSTRUCTIONS = {
    "multiple_choice": "\nSolve the question. " + _FINAL + "Answer: <letter>",
    "integer": "\nSolve the problem. " + _FINAL + "Answer: <integer>",
    "line_set": "\n" + _FINAL + "Answer: <line number or comma-separated line numbers>",
    "line": "\n" + _FINAL + "Answer: <line number>",
    "ordered_sequence": (
        "\nSolve the puzzle. "
        + _FINAL
        + "Answer: <answers to the questions, in the order asked, separated by commas, e.g. a, b, c>"
    ),
    "exact_string": "\nSolve the problem. " + _FINAL + "Answer: <your answer, as a short phrase>",
}

# The DeepSeek V4 chat markers come from chat/markers.py (docs/chat-template.md §1); eval renders
# system + one user turn.


def choice_letter(i: int) -> str:
    return chr(ord("A") + i)


def user_prompt(case: dict[str, Any]) -> str:
    """The user message for `case`, byte for byte as ds4-eval builds it."""
    out = case["question"] + "\n"
    kind = case["answer_kind"]
    if kind == "multiple_choice":
        out += "\nChoices:\n"
        for i, choice in enumerate(case["choices"]):
            out += f"{choice_letter(i)}. {choice}\n"
    return out + INSTRUCTIONS[kind]


@dataclass(frozen=True)
class Prompt:
    system: str
    user: str
    thinking: bool = True
    think_max: bool = False  # the Think Max prefix after BOS (docs/chat-template.md §3)
    think_level: int | None = None  # a V4.1 effort level, sent to an endpoint as reasoning_effort

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]

    @property
    def text(self) -> str:
        """The DeepSeek V4 template rendering (BOS + system + User + prompt + Assistant + think)."""
        return (
            BOS
            + (THINK_MAX_PREFIX if self.think_max else "")
            + self.system
            + USER
            + self.user
            + ASSISTANT
            + (THINK_OPEN if self.thinking else THINK_CLOSE)
        )


def build_prompt(
    case: dict[str, Any], thinking: bool = True, think_max: bool = False, think_level: int | None = None
) -> Prompt:
    return Prompt(SYSTEM_PROMPT, user_prompt(case), thinking, think_max and thinking, think_level)
