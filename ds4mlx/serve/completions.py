"""OpenAI legacy completions, both directions: the request body -> `CompletionRequest`
(docs/chat-template.md §4.3) and raw generated text -> wire shapes (docs/http-api.md §4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..chat import markers as M
from ..chat.protocol import ChatProtocol, get_protocol
from ..chat.requests import CHAT_THINKING_FIELDS, DEFAULT_MODEL, RequestError, Thinking, as_str, body_object, parse_stop
from ..runtime.events import Finish, Started, TextDelta, Usage
from . import sse
from .common import RequestInfo, body_bytes, total_usage
from .logprobs import completion_logprobs, generated_logprobs, token_logprobs
from .openai import finish_reason, usage_openai

# --- request (docs/chat-template.md §4.3) -------------------------------------------------


@dataclass
class CompletionRequest:
    prompt: str
    thinking: str = "high"
    model: str = DEFAULT_MODEL
    stop: list[str] = field(default_factory=list)

    def render(self, protocol: ChatProtocol | None = None) -> str:
        """The prompt in `protocol`'s completion format (None: the default family's)."""
        return (protocol or get_protocol()).render_completion(self.prompt, self.thinking)


def parse_completion(body: Any, *, ctx: int = 32768) -> CompletionRequest:
    """POST /v1/completions body -> CompletionRequest."""
    body = body_object(body)
    th = Thinking()
    prompt = None
    model = DEFAULT_MODEL
    stop: list[str] = []
    for k, v in body.items():
        if k == "prompt":
            if isinstance(v, str):
                prompt = v
            elif isinstance(v, list):
                prompt = v[0] if v and isinstance(v[0], str) else ""
            else:
                prompt = ""
        elif k == "model":
            model = as_str(v)
        elif k in CHAT_THINKING_FIELDS:
            th.chat_field(k, v)
        elif k == "stop":
            stop = parse_stop(v)
    if prompt is None:
        raise RequestError(M.ERR_MISSING_PROMPT, param="prompt")
    return CompletionRequest(prompt=prompt, thinking=th.resolve(model, ctx), model=model, stop=stop)


def echo_of(body: dict) -> bool:
    """`echo: true`: the prompt is printed before the output (streamed: as the first chunk)."""
    return body.get("echo") is True


# --- response (docs/http-api.md §4) -------------------------------------------------------


class CompletionsAdapter:
    api = "completions"

    def __init__(self, info: RequestInfo, index: int = 0, last: bool = True):
        self.info = info
        self.index = index  # the choice this adapter prints (one per prompt of a prompt list)
        self.last = last  # the last choice of the response: the usage chunk and [DONE] follow it

    def _chunk(self, text: str, finish: str | None, logprobs: dict | None = None) -> bytes:
        i = self.info
        choice = {"text": text, "index": self.index, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return sse.data(
            {
                "id": i.id,
                "object": "text_completion",
                "created": i.created,
                "model": i.model,
                "choices": [choice],
            }
        )

    def start(self, started: Started) -> list[bytes]:
        """With `echo`, the prompt (and its tokens' log-probs when asked) as the first chunk."""
        if started.echo is None:
            return []
        lp = None if started.prompt_logprobs is None else token_logprobs(started.prompt_logprobs)
        return [self._chunk(started.echo, None, lp)]

    def event(self, ev) -> list[bytes]:
        if isinstance(ev, TextDelta) and ev.text:
            return [self._chunk(ev.text, None)]
        return []

    def finish(self, fin: Finish, usage: Usage | None = None) -> list[bytes]:
        """The choice's last chunk; after the last choice, the usage (of all of them) and [DONE]."""
        out = [self._chunk("", finish_reason(fin), generated_logprobs(fin))]  # all its tokens' logprobs
        if not self.last:
            return out
        if self.info.include_usage:
            i = self.info
            out.append(
                sse.data(
                    {
                        "id": i.id,
                        "object": "text_completion",
                        "created": i.created,
                        "model": i.model,
                        "choices": [],
                        "usage": usage_openai(usage or fin.usage),
                    }
                )
            )
        out.append(sse.DONE)
        return out

    def body(self, fin: Finish) -> bytes:
        return self.batch_body([fin])

    def batch_body(self, fins: list) -> bytes:
        """One choice per prompt, in order; usage summed over them."""
        i = self.info
        return body_bytes(
            {
                "id": i.id,
                "object": "text_completion",
                "created": i.created,
                "model": i.model,
                "choices": [_choice(k, f) for k, f in enumerate(fins)],
                "usage": usage_openai(total_usage(fins)),
            }
        )


def _choice(index: int, fin: Finish) -> dict:
    text = fin.raw_text if fin.echo is None else fin.echo + fin.raw_text
    choice = {"text": text, "index": index, "finish_reason": finish_reason(fin)}
    if fin.logprobs is not None:
        choice["logprobs"] = completion_logprobs(fin)
    return choice


def prompt_list(body) -> list | None:
    """The prompts of a body whose `prompt` is a list of two or more strings (else None)."""
    p = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, str) for x in p):
        return p
    return None
