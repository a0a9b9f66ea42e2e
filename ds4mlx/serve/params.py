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
| frequency_penalty,            |  x   |      x      |           |           |
| presence_penalty,             |      |             |           |           |
| repetition_penalty, logit_bias|      |             |           |           |

A known field with the wrong JSON type is a 400 naming it (serve/validate.py checks first);
`null` means absent; integer fields accept any number (truncated) and clamp
negatives to 0.  In thinking mode the client's temperature/top_p/top_k/min_p
are ignored (ds4's fixed defaults); penalties and logit_bias apply in both modes
(sampling.Penalties).  frequency / presence penalties in [-2, 2] and a repetition
penalty > 0 (as OpenAI and vLLM), logit_bias keys token ids of the vocabulary (values
clamped to ±100), else a 400 naming the field.  `ignore_eos` keeps the request's
sampling and decodes exactly max_tokens (guidellm sends it always).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..runtime.sampling import TOP_K_CAP, SamplingParams
from .errors import INVALID_JSON, APIError, invalid_field, invalid_value

PENALTY_FIELDS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")
# what every API reads (top_k / min_p / seed are extensions where the API lacks them: read alike
# everywhere), then each API's own fields
_SAMPLING = frozenset({"temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stream", "ignore_eos"})
_FIELDS = {
    "chat": _SAMPLING | {"max_completion_tokens", "stream_options", *PENALTY_FIELDS},
    "completions": _SAMPLING | {"stream_options", *PENALTY_FIELDS},
    "anthropic": _SAMPLING,
    "responses": _SAMPLING | {"max_output_tokens"},
}

_INT_CAP = 1 << 62
# thinking mode replaces the client's temperature / top_p / top_k / min_p (ds4's and the DeepSeek
# API's rule): a response names the fields it replaced in this header (docs/http-api.md §10.8)
SAMPLING_OVERRIDDEN_HEADER = "X-Ds4mlx-Sampling-Overridden"


def _two(x: float) -> bool:
    return -2.0 <= x <= 2.0


@dataclass
class Controls:
    params: SamplingParams
    max_tokens: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool
    overridden: tuple = ()  # sampling fields the client sent that thinking mode replaces (the header)
    logprobs: int | None = None  # None: not asked; k: the chosen token's log-prob and the k most likely


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


def _range(v: float | None, field: str, ok) -> float | None:
    if v is not None and not ok(v):
        raise APIError(400, invalid_field(field), param=field, code="invalid_value")
    return v


def _logit_bias(v: Any, vocab: int | None) -> tuple:
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise _bad("logit_bias")
    out = []
    for k, b in v.items():
        field = f"logit_bias.{k}"
        try:
            tok = int(k)
        except ValueError:
            raise APIError(400, invalid_field(field), param=field, code="invalid_value") from None
        if tok < 0 or (vocab is not None and tok >= vocab):
            raise APIError(400, invalid_field(field), param=field, code="invalid_value")
        out.append((tok, _number(b, field)))
    return tuple(sorted(out))


MAX_CHOICES = 128  # OpenAI's bound on n


def choice_count(api: str, body: Any) -> int:
    """`n` of a chat or completions body: how many choices (1 when absent; a wrongly
    typed n is left to serve/validate.py's 400)."""
    v = body.get("n") if api in ("chat", "completions") and isinstance(body, dict) else None
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return 1
    if not 1 <= v <= MAX_CHOICES:
        raise APIError(400, invalid_field("n"), param="n", code="invalid_value")
    return int(v)


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat top_logprobs (completions' logprobs allows 5; we allow 20)


def _logprobs(api: str, body: dict) -> int | None:
    """The logprobs a chat or completions body asks for: None, or how many alternatives."""
    if api == "chat":
        on, top = _bool(body.get("logprobs"), "logprobs"), body.get("top_logprobs")
        field = "top_logprobs"
    elif api == "completions":
        on, top, field = None, body.get("logprobs"), "logprobs"
    else:
        return None
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, (int, float)):
            raise _bad(field)
        if top != int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            msg = invalid_value(field, f"an integer in [0, {MAX_TOP_LOGPROBS}]", top)
            raise APIError(400, msg, param=field, code="invalid_value")
        top = int(top)
    if api == "completions":
        return top
    if top and not on:  # OpenAI: top_logprobs needs logprobs true
        raise APIError(400, invalid_value(field, "used with logprobs: true", top), param=field, code="invalid_value")
    return (top or 0) if on else None


def parse_controls(api: str, body: dict, thinking: str, vocab: int | None = None) -> Controls:
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
    penalties = {
        "frequency_penalty": _range(_number(get("frequency_penalty"), "frequency_penalty"), "frequency_penalty", _two),
        "presence_penalty": _range(_number(get("presence_penalty"), "presence_penalty"), "presence_penalty", _two),
        "repetition_penalty": _range(
            _number(get("repetition_penalty"), "repetition_penalty"), "repetition_penalty", lambda x: x > 0
        ),
    }
    extra = {k: v for k, v in penalties.items() if v is not None}
    extra["logit_bias"] = _logit_bias(get("logit_bias"), vocab)
    if top_k is not None and top_k > TOP_K_CAP:  # the sampler keeps at most TOP_K_CAP candidates
        raise APIError(400, invalid_value("top_k", f"at most {TOP_K_CAP}", top_k), param="top_k", code="invalid_value")
    if top_p is not None and not 0.0 < top_p <= 1.0:  # 0 keeps nothing: no distribution to sample
        raise APIError(400, invalid_value("top_p", "a number in (0, 1]", top_p), param="top_p", code="invalid_value")
    overridden = ()
    if thinking != "none":
        # ds4's fixed thinking-mode sampling (and the DeepSeek API's): said in SAMPLING_OVERRIDDEN_HEADER
        sent = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}
        overridden = tuple(k for k, v in sent.items() if v is not None)
        params = SamplingParams(seed=seed, **extra)
    else:
        d = SamplingParams()
        params = SamplingParams(
            temperature=d.temperature if temperature is None else temperature,
            top_p=d.top_p if top_p is None else top_p,
            top_k=d.top_k if top_k is None else top_k,
            min_p=d.min_p if min_p is None else min_p,
            seed=seed,
            **extra,
        )
    logprobs = _logprobs(api, body)
    return Controls(params, max_tokens, stream, include_usage, ignore_eos, overridden, logprobs)
