"""Generation controls of a request body: sampling, limits, streaming flags.

Which fields each API reads (docs/http-api.md §3–6):

| field                         | chat | completions | anthropic | responses |
|-------------------------------|------|-------------|-----------|-----------|
| temperature, top_p            |  x   |      x      |     x     |     x     |
| top_k                         |  x   |      x      |     x     |     x     |
| min_p, seed                   |  x   |      x      |     x     |     x     |
| max_tokens                    |  x   |      x      |     x     |     x     |
| max_completion_tokens         |  x   |             |           |           |
| max_output_tokens             |      |             |           |     x     |
| stream                        |  x   |      x      |     x     |     x     |
| stream_options.include_usage  |  x   |      x      |           |           |
| ignore_eos                    |  x   |      x      |     x     |     x     |

A known field with the wrong JSON type is a 400 naming it (serve/validate.py checks first);
`null` means absent; integer fields accept any number (truncated) and clamp
negatives to 0.  In thinking mode the client's temperature/top_p/top_k/min_p
are ignored (ds4's fixed defaults).  `ignore_eos` keeps the request's
sampling and decodes exactly max_tokens (#17: guidellm sends it always).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..sampling import SamplingParams
from .errors import INVALID_JSON, APIError

_FIELDS = {
    "chat": {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "ignore_eos",
    },
    "completions": {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "stream",
        "stream_options",
        "ignore_eos",
    },
    # top_k / min_p / seed are extensions where the API lacks them: read alike everywhere
    "anthropic": {"temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stream", "ignore_eos"},
    "responses": {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "max_output_tokens",
        "stream",
        "ignore_eos",
    },
}
_INT_CAP = 1 << 62


@dataclass
class Controls:
    params: SamplingParams
    max_tokens: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool


def _bad(field: str) -> APIError:
    # serve/validate.py names wrongly typed fields first; this is the last line of defence
    return APIError(400, INVALID_JSON, param=field)


def _number(v: Any, field: str = "") -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(field)
    f = float(v) if not isinstance(v, int) or abs(v) < _INT_CAP else math.copysign(float(_INT_CAP), v)
    if not math.isfinite(f):
        raise _bad(field)
    return f


def _int(v: Any, field: str = "") -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(field)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _bad(field)
        v = int(v)
    return max(0, min(int(v), _INT_CAP))


def _bool(v: Any, field: str = "") -> bool | None:
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _bad(field)
    return v


def parse_controls(api: str, body: dict, thinking: str) -> Controls:
    fields = _FIELDS[api]
    get = lambda k: body.get(k) if k in fields else None  # noqa: E731
    temperature = _number(get("temperature"), "temperature")
    top_p = _number(get("top_p"), "top_p")
    top_k = _int(get("top_k"), "top_k")
    min_p = _number(get("min_p"), "min_p")
    seed = _int(get("seed"), "seed")
    max_tokens = None
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = _int(get(key), key)
        if v is not None:
            max_tokens = v
    stream = bool(_bool(get("stream"), "stream"))
    include_usage = False
    opts = get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("stream_options")
        include_usage = bool(_bool(opts.get("include_usage"), "stream_options.include_usage"))
    # ignore_eos decodes exactly max_tokens with the requested sampling (guidellm sends
    # it on every request; other servers accept it so)
    ignore_eos = bool(_bool(get("ignore_eos"), "ignore_eos"))
    if thinking != "none":
        params = SamplingParams(seed=seed or 0)  # ds4's fixed thinking-mode sampling
    else:
        d = SamplingParams()
        params = SamplingParams(
            temperature=d.temperature if temperature is None else temperature,
            top_p=d.top_p if top_p is None else top_p,
            top_k=d.top_k if top_k is None else top_k,
            min_p=d.min_p if min_p is None else min_p,
            seed=seed or 0,
        )
    return Controls(params, max_tokens, stream, include_usage, ignore_eos)
