"""ds4's thinking flags for the command line: `--think` (the default),
`--think-max`, `--nothink` and `--think-level N` (DeepSeek V4.1 only), shared by
`generate`, `chat`, `serve` and `eval`.

The flags set one value, the last one given wins (as in ds4_cli.c's option
loop): "high", "max", "none", or an int level.  `resolve` turns it into the
loaded family's thinking mode (chat/protocol.py).  Think Max needs a context of
at least `THINK_MAX_MIN_CONTEXT` tokens (ds4.c `ds4_think_mode_for_context`);
below it the normal thinking prompt is used and `resolve` returns ds4's
warning as a notice.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Union

from ..chat.markers import THINK_MAX_MIN_CONTEXT

__all__ = ["add_think_arguments", "resolve", "ThinkError", "ThinkChoice", "parse_level", "THINK_MAX_MIN_CONTEXT"]

Think = Union[str, int]  # "high" | "max" | "none" | a V4.1 level 0..100


class ThinkError(ValueError):
    """A thinking flag the loaded model does not accept."""


def parse_level(v: str) -> int:
    """A `--think-level` / `/think N` value: an integer 0..100 (ds4_think_mode_parse_level)."""
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--think-level requires an integer from 0 to 100, got {v!r}") from None
    if not 0 <= n <= 100:
        raise argparse.ArgumentTypeError(f"--think-level requires an integer from 0 to 100, got {v!r}")
    return n


def add_think_arguments(p: argparse.ArgumentParser, *, level_dest: str = "think", default: str = "high") -> None:
    """The four flags; they all write `args.think` (`default`: "high", or "none" for the
    agent).  `level_dest` puts `--think-level` elsewhere (serve keeps its own
    `think_level` default)."""
    p.add_argument(
        "--think",
        dest="think",
        action="store_const",
        const="high",
        help="normal thinking" + (" (the default)" if default == "high" else ""),
    )
    p.add_argument(
        "--think-max",
        dest="think",
        action="store_const",
        const="max",
        help=f"Think Max when --ctx is at least {THINK_MAX_MIN_CONTEXT} tokens; otherwise normal thinking",
    )
    p.add_argument(
        "--nothink",
        dest="think",
        action="store_const",
        const="none",
        help="no thinking: assistant turns start with </think>" + (" (the default)" if default == "none" else ""),
    )
    if level_dest == "think":
        # no `type=`: argparse would run it on the string default "high" of the shared dest
        p.add_argument(
            "--think-level",
            dest="think",
            action=_LevelAction,
            metavar="N",
            help="DeepSeek V4.1 reasoning effort 0..100 (0 = no thinking)",
        )
    else:
        p.add_argument(
            "--think-level",
            dest=level_dest,
            type=parse_level,
            default=None,
            metavar="N",
            help="DeepSeek V4.1 reasoning effort 0..100 (0 = no thinking)",
        )
    p.set_defaults(think=default)


class _LevelAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        try:
            setattr(namespace, self.dest, parse_level(values))
        except argparse.ArgumentTypeError as e:
            parser.error(str(e))


@dataclass(frozen=True)
class ThinkChoice:
    mode: str  # the family's thinking mode for Conversation.thinking / Job.thinking
    notice: str | None = None  # ds4's warning when Think Max was downgraded


def max_allowed(ctx: int) -> bool:
    return int(ctx) >= THINK_MAX_MIN_CONTEXT


def downgrade_notice(flag: str, ctx: int) -> str:
    # ds4_cli.c cli_warn_think_max_downgraded
    return f"{flag} needs --ctx >= {THINK_MAX_MIN_CONTEXT}; ctx={ctx} uses normal thinking instead"


def resolve(protocol, think: Think, ctx: int, *, flag: str = "--think-max") -> ThinkChoice:
    """The family's mode for a flag value at context size `ctx`.  Raises ThinkError
    for a level on a family without numeric levels."""
    if isinstance(think, int) and not isinstance(think, bool):
        if not getattr(protocol, "numeric_effort", False):
            raise ThinkError(
                f"--think-level requires a DeepSeek V4.1 model (the loaded model is "
                f"{protocol.model_name or protocol.family})"
            )
        return ThinkChoice(protocol.render_think_level(think))
    if think == "none":
        return ThinkChoice("none")
    if think == "max":
        if max_allowed(ctx):
            return ThinkChoice(protocol.resolve_thinking("max", "max", explicit=True, ctx=ctx))
        return ThinkChoice(_high(protocol, ctx), downgrade_notice(flag, ctx))
    if think != "high":
        raise ThinkError(f"unknown thinking mode {think!r}")
    return ThinkChoice(_high(protocol, ctx))


def _high(protocol, ctx: int) -> str:
    # ds4's DS4_THINK_HIGH is the "high" effort of every family (GLM: "Reasoning
    # Effort: High", ds4_glm_reasoning_effort_text), not the family's API default
    return protocol.resolve_thinking("high", "high", explicit=True, ctx=ctx)


def describe(think: Think) -> str:
    """The flag spelling of a value (status lines, notices)."""
    if isinstance(think, int):
        return f"level {think}"
    return {"high": "high", "max": "max", "none": "off"}.get(think, str(think))
