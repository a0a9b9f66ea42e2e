"""Operator endpoints: GET /slots, POST /tokenize, POST /detokenize (docs/http-api.md §9.4).

The shapes are llama.cpp's and vLLM's at once, where they differ both names are
answered: /tokenize reads `content` (llama.cpp) or `prompt` (vLLM), or `messages`
(vLLM's chat form: the prompt the chat route would render), and answers `tokens`
plus vLLM's `count` / `max_model_len`; /detokenize answers `content` (llama.cpp)
and `prompt` (vLLM).  A field the server does not read is a 400 naming it.
"""

from __future__ import annotations

import time
from typing import Any

from . import errors as E

TOKENIZE_FIELDS = frozenset(
    {"content", "prompt", "messages", "tools", "model", "add_special", "add_special_tokens", "with_pieces"}
    | {"return_token_strs"}
)
DETOKENIZE_FIELDS = frozenset({"tokens", "model"})
PREFIX_CHARS = 1000


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise E.APIError(400, E.invalid_type("body", "an object", "something else"), code="invalid_type")
    return body


def _refuse_unknown(body: dict, known: frozenset) -> None:
    for k in body:
        if k not in known:
            raise E.APIError(400, E.unsupported_field(k), param=k, code="unsupported_parameter")


def _flag(body: dict, *names: str) -> bool:
    value = False
    for n in names:
        v = body.get(n)
        if v is None:
            continue
        if not isinstance(v, bool):
            raise E.APIError(400, E.invalid_type(n, "a boolean", type(v).__name__), param=n, code="invalid_type")
        value = v
    return value


def _piece(tokenizer, tid: int) -> str | list[int]:
    """llama.cpp's piece: the token's text, or its bytes when they are not UTF-8 on their own."""
    raw = tokenizer.token_bytes(tid)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def tokenize_text(body: Any) -> tuple[str | None, dict]:
    """(text to tokenize, or None for the `messages` form, the checked body)."""
    body = _object(body)
    _refuse_unknown(body, TOKENIZE_FIELDS)
    given = [k for k in ("content", "prompt", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise E.APIError(400, E.TOKENIZE_NEEDS_ONE, param="content", code="missing_required_parameter")
    if given[0] == "messages":
        return None, body
    text = body[given[0]]
    if not isinstance(text, str):
        raise E.APIError(400, E.invalid_type(given[0], "a string", type(text).__name__), param=given[0])
    if body.get("tools") is not None:
        raise E.APIError(400, E.TOKENIZE_TOOLS_NEED_MESSAGES, param="tools")
    return text, body


def tokenize_answer(tokenizer, ids: list[int], body: dict, ctx: int) -> dict:
    if _flag(body, "add_special", "add_special_tokens") and tokenizer.bos_id is not None:
        if not ids or ids[0] != tokenizer.bos_id:
            ids = [tokenizer.bos_id, *ids]
    pieces = _flag(body, "with_pieces")
    strs = _flag(body, "return_token_strs")
    doc: dict = {
        "tokens": [{"id": t, "piece": _piece(tokenizer, t)} for t in ids] if pieces else list(ids),
        "count": len(ids),
        "max_model_len": ctx,
    }
    if strs:
        doc["token_strs"] = [tokenizer.decode([t]) for t in ids]
    return doc


def detokenize(tokenizer, body: Any) -> dict:
    body = _object(body)
    _refuse_unknown(body, DETOKENIZE_FIELDS)
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise E.APIError(400, E.missing_field("tokens"), param="tokens", code="missing_required_parameter")
    vocab = int(tokenizer.vocab_size)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            name = f"tokens[{i}]"
            raise E.APIError(400, E.invalid_value(name, f"a token id in [0, {vocab})", t), param=name)
    text = tokenizer.decode(ids)
    return {"content": text, "prompt": text}


def slots_view(engine, last_text: dict | None = None) -> list[dict]:
    """Each resident slot: state, live tokens, the start of its cached text, idle time,
    the job it runs.  Read from the loop thread without touching the sessions' arrays:
    the text is the engine's memo of the slot's live text when it is current, else the
    text of the last job that ran there (`last_text`: slot index -> prompt + output)."""
    now = time.monotonic()
    out = []
    for sl in engine.resident_slots:
        n = len(sl)
        h = sl.active
        key = sl.text_key
        if not n:
            prefix = None
        elif key is not None and key[1] == n:
            prefix = sl.text[:PREFIX_CHARS]
        else:
            prefix = (last_text or {}).get(sl.index, "")[:PREFIX_CHARS] or None
        task = None
        if h is not None:
            ids = h.job.prompt_ids
            task = {"id": h.id, "api": h.job.api, "prompt_tokens": len(ids) if ids is not None else None}
        out.append(
            {
                "id": sl.index,
                "n_ctx": engine.ctx,
                "is_processing": h is not None,
                "state": "processing" if h is not None else ("idle" if n else "empty"),
                "n_tokens": n,
                "cached_prefix": prefix,
                "idle_s": round(sl.idle_s(now), 3) if h is None and sl.last_used else None,
                "task": task,
            }
        )
    return out
