"""The speculative-decoding flags every command shares (generate, chat, serve, eval, bench).

ds4's names: `--mtp [FILE]` (the model's MTP head; FILE = ds4's separate MTP support
GGUF), `--mtp-draft N` (draft tokens per round, default 1), `--mtp-margin F` (draft
confidence pruning, default 3), `--mtp-exact-sampling` (sampled jobs keep the target
distribution; the default here, `--no-mtp-exact-sampling` for ds4's default: argmax drafts
accepted opportunistically), `--mtp-model FILE` (ds4's newer spelling of `--mtp FILE`),
`--dspark` (the DSpark block drafter: DeepSeek V4.1's built-in one; V4 Flash's comes in
ds4's support file, `--dspark --mtp-model FILE`), `--mtp-timing` (implies `--mtp`; every
job ends with the verify cost per k and the acceptance each k needs to pay, cost.py);
mlx-lm's `--draft-model PATH` (any model with the same tokenizer).  `spec_config(args,
model, ctx)` builds the engine's SpecConfig, or None.
"""

from __future__ import annotations

import argparse

from .options import DEFAULT_DRAFT, DEFAULT_EXACT_SAMPLING, DEFAULT_MARGIN, SpecConfig, SpecUsageError

__all__ = ["SpecUsageError", "add_arguments", "mtp_file", "off_for_slots", "spec_config"]

MAIN_FILE = ""  # `--mtp` without FILE: the MTP tensors of the model file itself


def add_arguments(p, mtp: bool = True) -> None:
    if mtp:
        p.add_argument(
            "--mtp",
            nargs="?",
            const=MAIN_FILE,
            default=None,
            metavar="FILE",
            help=(
                "speculative decoding with the model's MTP head: DeepSeek V4, GLM 5.x, Qwen3.8 Flash Next "
                "(FILE: ds4's V4 MTP support GGUF)"
            ),
        )
        p.add_argument(
            "--mtp-model",
            metavar="FILE",
            help="ds4's spelling of --mtp FILE: the separate MTP (or, with --dspark, DSpark) support GGUF",
        )
        p.add_argument(
            "--dspark",
            action="store_true",
            help="speculative decoding with the DSpark block drafter (DeepSeek V4.1: built in; "
            "V4 Flash: ds4's DSpark support file, --mtp-model FILE)",
        )
        p.add_argument(
            "--mtp-timing",
            action="store_true",
            help="speculative decoding (implies --mtp unless --draft-model is given); each job ends by "
            "measuring a plain step and a verify of k+1 tokens (k = 1..4) and prints the break-even acceptance",
        )
    p.add_argument("--draft-model", metavar="PATH", help="speculative decoding with a draft model (same tokenizer)")
    p.add_argument(
        "--mtp-draft", type=int, default=DEFAULT_DRAFT, metavar="N", help="draft tokens per verify (default 1)"
    )
    p.add_argument(
        "--mtp-margin",
        type=float,
        default=DEFAULT_MARGIN,
        metavar="F",
        help="argmax drafts: draft token 2.. only while the draft's top-1 logit leads by F (default 3; 0 = off)",
    )
    p.add_argument(
        "--dspark-confidence",
        type=float,
        default=0.0,
        metavar="F",
        help="DeepSeek V4.1's DSpark drafter: propose only the block's leading drafts whose survival "
        "(product of sigmoid(confidence)) stays >= F, in [0, 1] (default 0 = off)",
    )
    p.add_argument(
        "--mtp-exact-sampling",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_EXACT_SAMPLING,
        help="temperature > 0: standard speculative sampling, the target distribution (default); "
        "--no-mtp-exact-sampling: ds4's opportunistic acceptance (argmax drafts kept while they are "
        "the target's argmax)",
    )


def mtp_file(args) -> str | None:
    """The separate MTP GGUF for `load(..., mtp=)` (None: none, or the model file's own):
    `--mtp FILE` or ds4's `--mtp-model FILE`; with `--dspark` the support file is the
    drafter's (spec_config reads it), not the loader's."""
    if getattr(args, "dspark", False):
        return None
    return getattr(args, "mtp", None) or getattr(args, "mtp_model", None) or None


def _support_file(args) -> str | None:
    path, alias = getattr(args, "mtp", None), getattr(args, "mtp_model", None)
    if path and alias and path != alias:
        raise SpecUsageError(f"--mtp {path} and --mtp-model {alias} name two different files")
    return path or alias or None


def _wants_mtp(args) -> bool:
    """--mtp [FILE], or one of ds4's flags that imply it (--mtp-model, --dspark, --mtp-timing
    without --draft-model)."""
    if getattr(args, "mtp", None) is not None or getattr(args, "mtp_model", None) or getattr(args, "dspark", False):
        return True
    return bool(getattr(args, "mtp_timing", False)) and not getattr(args, "draft_model", None)


def speculation_requested(args) -> bool:
    """Whether the flags ask for speculative decoding (before anything is loaded)."""
    return bool(getattr(args, "draft_model", None)) or _wants_mtp(args)


# the flags that ask for speculation, and each one's value when it asks for nothing
_REQUEST_FLAGS = {"mtp": None, "mtp_model": None, "dspark": False, "mtp_timing": False, "draft_model": None}


def off_for_slots(args, slots: int) -> str | None:
    """With `slots` > 1 resident sessions (serve's --batched-session) speculation is off: the
    flags asking for it are cleared (no drafter or MTP file is loaded) and the one-line reason
    returned; None where nothing was asked or one slot runs."""
    if slots <= 1 or not speculation_requested(args):
        return None
    for name, off in _REQUEST_FLAGS.items():
        if hasattr(args, name):
            setattr(args, name, off)
    # as ds4's session-batched server: the slots decode in one shared forward per step and a
    # drafter follows one session's tokens
    return (
        f"speculative decoding off: --batched-session {slots} decodes the slots in one shared forward "
        "per step, which a drafter does not follow (--batched-session 1 speculates)"
    )


def spec_config(args, model, ctx: int, dtype="auto") -> SpecConfig | None:
    """The engine's speculation settings from the flags (None: speculation off)."""
    draft_path = getattr(args, "draft_model", None)
    use_mtp = _wants_mtp(args)
    if not draft_path and not use_mtp:
        return None
    if draft_path and use_mtp:
        raise SpecUsageError("--mtp (--mtp-model, --dspark) and --draft-model exclude each other")
    support = _support_file(args)
    if int(args.mtp_draft) < 1:
        raise SpecUsageError("--mtp-draft must be at least 1")
    confidence = float(getattr(args, "dspark_confidence", 0.0) or 0.0)
    if not 0.0 <= confidence <= 1.0:  # before a draft model or head is loaded
        raise SpecUsageError(f"--dspark-confidence must be in [0, 1], not {confidence:g}")
    if use_mtp:
        from .mtp import mtp_drafter

        if getattr(args, "dspark", False):
            from .dspark_support import check_dspark_target

            check_dspark_target(model, support)
        drafter = mtp_drafter(model, ctx)
    else:
        from ..io.loader import load
        from .drafter import ModelDrafter

        draft, _ = load(draft_path, dtype=dtype, verbose=False)
        if draft.vocab_size != model.vocab_size:
            raise SpecUsageError(
                f"--draft-model {draft_path}: vocabulary {draft.vocab_size} != the model's {model.vocab_size}"
            )
        drafter = ModelDrafter(draft, ctx=ctx)
    _set_confidence(drafter, confidence)
    exact = bool(getattr(args, "mtp_exact_sampling", DEFAULT_EXACT_SAMPLING))
    timing = bool(getattr(args, "mtp_timing", False))
    return SpecConfig(drafter, depth=args.mtp_draft, margin=args.mtp_margin, exact_sampling=exact, timing=timing)


def _set_confidence(drafter, threshold: float) -> None:
    if not 0.0 <= threshold <= 1.0:
        raise SpecUsageError(f"--dspark-confidence must be in [0, 1], not {threshold:g}")
    if threshold > 0 and not hasattr(drafter, "confidence_threshold"):
        raise SpecUsageError("--dspark-confidence: only the DSpark drafter (--mtp on DeepSeek V4.1) has confidences")
    if hasattr(drafter, "confidence_threshold"):
        drafter.confidence_threshold = threshold
