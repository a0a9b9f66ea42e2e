"""When to write disk KV checkpoints (docs/kv-cache.md §5, §8): pure functions
and one small frontier tracker; no MLX, no I/O (except `open_store`).

The engine calls (see each function's docstring):

* full miss, before the live session is replaced: `evict_save_len(pos, opt)`
  -> store(live key, pos, snapshot, "evict"); then `frontier.reset()`.
* disk-text reuse (after the evict save): `cp = store.lookup(prompt_text)`;
  `session.restore(cp.payload)` (if it fails or `len(session) != cp.n_tokens`:
  `store.discard(cp)` and go cold); effective tokens = the session's tokens +
  tokenize(`cp.suffix(prompt_text)`) (never slice the request's own token
  list); if `cp.trailer`: load the KTM map into tool memory;
  `frontier.loaded(cp.n_tokens)`.
* cold prefill (no live / disk reuse): `cold_save_point(prompt_ids, opt, ...)`
  -> prefill exactly that many tokens, store "cold", continue prefilling
  (bracketed by `frontier.suppress` / `frontier.unsuppress`).
* after each prefill chunk / prompt sync / before sampling a token:
  `frontier.due(pos)` -> store "continued", `frontier.note(pos)`.
* clean shutdown: `shutdown_save_len(pos, opt)` -> store "shutdown".
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .store import (
    DEFAULT_BOUNDARY_ALIGN_TOKENS,
    DEFAULT_BOUNDARY_TRIM_TOKENS,
    DEFAULT_BUDGET_MB,
    DEFAULT_COLD_MAX_TOKENS,
    DEFAULT_CONTINUED_INTERVAL_TOKENS,
    DEFAULT_MIN_TOKENS,
    HIT_HALF_LIFE_SECONDS,
    KVStore,
)

DEFAULT_TOOL_MEMORY_MAX_IDS = 100_000


@dataclass(frozen=True)
class KVCacheOptions:
    disk_dir: str | None = None
    budget_mb: int = DEFAULT_BUDGET_MB
    min_tokens: int = DEFAULT_MIN_TOKENS
    cold_max_tokens: int = DEFAULT_COLD_MAX_TOKENS
    continued_interval_tokens: int = DEFAULT_CONTINUED_INTERVAL_TOKENS
    boundary_trim_tokens: int = DEFAULT_BOUNDARY_TRIM_TOKENS
    boundary_align_tokens: int = DEFAULT_BOUNDARY_ALIGN_TOKENS
    cross_quant: bool = False
    exact_dsml_tool_replay: bool = True
    tool_memory_max_ids: int = DEFAULT_TOOL_MEMORY_MAX_IDS

    def __post_init__(self):
        if self.min_tokens <= 0:
            raise ValueError("--kv-cache-min-tokens must be > 0")
        if self.cold_max_tokens < 0 or 0 < self.cold_max_tokens < self.min_tokens:
            raise ValueError("--kv-cache-cold-max-tokens must be 0 or >= --kv-cache-min-tokens")
        for name in (
            "budget_mb",
            "continued_interval_tokens",
            "boundary_trim_tokens",
            "boundary_align_tokens",
            "tool_memory_max_ids",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.disk_dir)

    @property
    def budget_bytes(self) -> int:
        return (self.budget_mb or DEFAULT_BUDGET_MB) << 20

    @property
    def cold_enabled(self) -> bool:
        return self.cold_max_tokens > 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KVCacheOptions:
        return cls(
            disk_dir=args.kv_disk_dir,
            budget_mb=args.kv_cache_budget_mb,
            min_tokens=args.kv_cache_min_tokens,
            cold_max_tokens=args.kv_cache_cold_max_tokens,
            continued_interval_tokens=args.kv_cache_continued_interval_tokens,
            boundary_trim_tokens=args.kv_cache_boundary_trim_tokens,
            boundary_align_tokens=args.kv_cache_boundary_align_tokens,
            cross_quant=args.kv_cache_cross_quant,
            exact_dsml_tool_replay=not getattr(args, "disable_exact_dsml_tool_replay", False),
            tool_memory_max_ids=getattr(args, "tool_memory_max_ids", DEFAULT_TOOL_MEMORY_MAX_IDS),
        )

    def describe(self) -> str:
        """ds4's startup line (docs/kv-cache.md §8)."""
        return (
            f"KV disk cache {self.disk_dir} (budget={self.budget_bytes >> 20} MiB, "
            f"cross-quant={'accept' if self.cross_quant else 'reject'}, "
            f"min={self.min_tokens}, cold_max={self.cold_max_tokens}, "
            f"continued={self.continued_interval_tokens}, trim={self.boundary_trim_tokens}, "
            f"align={self.boundary_align_tokens}, hit_half_life={HIT_HALF_LIFE_SECONDS}s)"
        )


def _has(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions  # noqa: SLF001 (argparse has no public API)


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """The disk KV cache flags (docs/kv-cache.md §8; `--kv-cache-budget-mb` per the issue,
    ds4's `--kv-disk-space-mb` kept as an alias).  The tool-memory flags
    `--disable-exact-dsml-tool-replay` / `--tool-memory-max-ids` are added
    only when the parser does not already have them."""
    g = parser.add_argument_group("disk KV cache")
    g.add_argument(
        "--kv-disk-dir",
        metavar="DIR",
        default=None,
        help="directory of on-disk KV checkpoints (enables the disk cache)",
    )
    g.add_argument(
        "--kv-cache-budget-mb",
        "--kv-disk-space-mb",
        dest="kv_cache_budget_mb",
        type=int,
        metavar="N",
        default=DEFAULT_BUDGET_MB,
        help=f"disk budget in MiB (default {DEFAULT_BUDGET_MB}; 0 means the default)",
    )
    g.add_argument(
        "--kv-cache-min-tokens",
        type=int,
        metavar="N",
        default=DEFAULT_MIN_TOKENS,
        help=f"smallest checkpoint stored or loaded (default {DEFAULT_MIN_TOKENS})",
    )
    g.add_argument(
        "--kv-cache-cold-max-tokens",
        type=int,
        metavar="N",
        default=DEFAULT_COLD_MAX_TOKENS,
        help=f"longest prompt that gets a cold save; 0 disables cold saves (default {DEFAULT_COLD_MAX_TOKENS})",
    )
    g.add_argument(
        "--kv-cache-continued-interval-tokens",
        type=int,
        metavar="N",
        default=DEFAULT_CONTINUED_INTERVAL_TOKENS,
        help="save the live session at absolute multiples of this (rounded up "
        f"to the alignment); 0 disables (default {DEFAULT_CONTINUED_INTERVAL_TOKENS})",
    )
    g.add_argument(
        "--kv-cache-boundary-trim-tokens",
        type=int,
        metavar="N",
        default=DEFAULT_BOUNDARY_TRIM_TOKENS,
        help=f"cold saves drop this many tail tokens (default {DEFAULT_BOUNDARY_TRIM_TOKENS})",
    )
    g.add_argument(
        "--kv-cache-boundary-align-tokens",
        type=int,
        metavar="N",
        default=DEFAULT_BOUNDARY_ALIGN_TOKENS,
        help=f"cold saves align down to this; 0 disables (default {DEFAULT_BOUNDARY_ALIGN_TOKENS})",
    )
    q = g.add_mutually_exclusive_group()
    q.add_argument(
        "--kv-cache-reject-different-quant",
        dest="kv_cache_cross_quant",
        action="store_false",
        help="delete checkpoints written with other quant bits (the default)",
    )
    q.add_argument(
        "--kv-cache-accept-different-quant",
        dest="kv_cache_cross_quant",
        action="store_true",
        help="reuse checkpoints written with other routed-expert quant bits (ds4's default)",
    )
    parser.set_defaults(kv_cache_cross_quant=False)
    if not _has(parser, "--disable-exact-dsml-tool-replay"):
        g.add_argument(
            "--disable-exact-dsml-tool-replay",
            action="store_true",
            help="no exact DSML tool replay (and no KTM trailers on checkpoints)",
        )
    if not _has(parser, "--tool-memory-max-ids"):
        g.add_argument(
            "--tool-memory-max-ids",
            type=int,
            metavar="N",
            default=DEFAULT_TOOL_MEMORY_MAX_IDS,
            help=f"tool ids kept in tool memory (default {DEFAULT_TOOL_MEMORY_MAX_IDS})",
        )


def open_store(
    opt: KVCacheOptions, *, model_id: str, quant_bits: int, ctx: int, clock: Callable[[], float] = time.time
) -> KVStore | None:
    """The store for these options, or None when the disk cache is off."""
    if not opt.enabled:
        return None
    return KVStore(
        opt.disk_dir,
        opt.budget_bytes,
        model_id,
        quant_bits,
        ctx,
        opt.min_tokens,
        cross_quant=opt.cross_quant,
        clock=clock,
    )


# ---------------------------------------------------------------- cold


def store_len(n_tokens: int, opt: KVCacheOptions) -> int:
    """Trim/align fallback (ds4 `store_len`): drop `trim` tail tokens and align
    down; if that falls below `min_tokens`, the full length.  11011 -> 10240,
    1695 -> 1695."""
    trim, align = opt.boundary_trim_tokens, opt.boundary_align_tokens
    if n_tokens > opt.min_tokens + trim:
        stable = n_tokens - trim
        if align > 0:
            stable -= stable % align
        if stable >= opt.min_tokens:
            return stable
    return n_tokens


def chat_anchor_pos(
    token_ids: Sequence[int], user_id: int | None, assistant_id: int | None, min_tokens: int
) -> int | None:
    """Index of the last ⟨User⟩ token before the first ⟨Assistant⟩ token (the
    prefix ends right before that ⟨User⟩: system + tools + stable preamble,
    without the task message), if it is >= min_tokens; else None."""
    if user_id is None or assistant_id is None or user_id < 0 or assistant_id < 0:
        return None
    last_user = -1
    for i, t in enumerate(token_ids):
        if t == assistant_id:
            break
        if t == user_id:
            last_user = i
    return last_user if last_user >= min_tokens else None


@dataclass(frozen=True)
class ColdSave:
    n_tokens: int  # prefill exactly this many tokens, then store (reason "cold")
    method: str  # "anchor" | "trim-align" | "full"


def cold_save_point(
    token_ids: Sequence[int], opt: KVCacheOptions, *, user_id: int | None = None, assistant_id: int | None = None
) -> ColdSave | None:
    """Where to cut the cold checkpoint of a prompt that had no live or disk
    reuse, or None (cold saves off, prompt shorter than min_tokens or longer
    than cold_max_tokens).  If `n_tokens < len(prompt)` the engine prefills
    the prefix, stores it, then prefills the rest; if equal, it stores after
    the full prefill."""
    n = len(token_ids)
    if not opt.cold_enabled or not opt.min_tokens <= n <= opt.cold_max_tokens:
        return None
    anchor = chat_anchor_pos(token_ids, user_id, assistant_id, opt.min_tokens)
    if anchor is not None:
        return ColdSave(anchor, "anchor")
    s = store_len(n, opt)
    return ColdSave(s, "full" if s == n else "trim-align")


# ---------------------------------------------------------------- continued


def continued_step(opt: KVCacheOptions) -> int:
    """Interval rounded up to the alignment (10240 by default); 0 = off."""
    step = opt.continued_interval_tokens
    if step <= 0:
        return 0
    align = opt.boundary_align_tokens
    if align > 0:
        step = -(-step // align) * align
    return step


class ContinuedFrontier:
    """The last absolute position at which a continued/cold checkpoint was
    written.  Saves happen at absolute multiples of `continued_step`."""

    def __init__(self, opt: KVCacheOptions, last: int = 0):
        self.opt = opt
        self.step = continued_step(opt)
        self.last = last

    def due(self, pos: int) -> bool:
        """Store the whole live session (reason "continued") now?"""
        return self.step > 0 and pos >= self.opt.min_tokens and pos % self.step == 0 and pos > self.last

    def note(self, pos: int) -> None:
        """A continued or cold checkpoint of `pos` tokens was written."""
        if pos > self.last:
            self.last = pos

    def reset(self) -> None:
        """Full miss: the live session is being replaced."""
        self.last = 0

    def loaded(self, n_tokens: int) -> None:
        """A disk checkpoint of `n_tokens` tokens was restored."""
        self.last = n_tokens

    def suppress(self, pos: int) -> int | None:
        """Before a cold save of `pos` tokens: if `pos` is itself a due
        frontier, mark it done (returns the token for `unsuppress`)."""
        if not self.due(pos):
            return None
        old = self.last
        self.note(pos)
        return old

    def unsuppress(self, token: int | None, pos: int) -> None:
        """The cold save failed: undo `suppress`."""
        if token is not None and self.last == pos:
            self.last = token


# ---------------------------------------------------------------- evict / shutdown


def evict_save_len(pos: int, opt: KVCacheOptions) -> int | None:
    """Full miss with the disk cache on: save the whole live session (reason
    "evict", no trim) before it is replaced; it does not move the frontier."""
    return pos if opt.enabled and pos >= opt.min_tokens else None


def shutdown_save_len(pos: int, opt: KVCacheOptions) -> int | None:
    """Clean exit after all requests: save the whole live session ("shutdown")."""
    return pos if opt.enabled and pos >= opt.min_tokens else None
