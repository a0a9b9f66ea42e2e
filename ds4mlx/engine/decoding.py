"""A request's decode phase on its slot: sample -> detokenize -> stop matcher ->
output parser -> events, one token a turn, then the job's `Finish`.

`Decoding(runner, handle, logits, prompt_tokens, cached).steps()` is a generator:
it yields at each token boundary (the other slots' turn) and, when the scheduler
batches decode steps, the `StepRequest` of each step for it to run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import mlx.core as mx
import numpy as np

from ..chat.markers import PARSE_UNTERMINATED_TOOL_CALL
from ..chat.protocol import get_protocol
from ..runtime.decode import StepRequest, decode_tokens
from ..runtime.detok import Detokenizer, StopMatcher
from ..runtime.events import Finish, TokenLogprob, Usage
from ..runtime.sampling import GREEDY, DeviceSampler, Penalties, Sampler
from ..runtime.structured import Constraint, GrammarSampler
from ..speculative.loop import loop_for_job
from ..speculative.options import SpecStats
from .bindings import after_turn
from .hooks import call_hook
from .job import JobHandle, job_kind
from .parser import ParsedOutput, calls_of
from .runner import SlotRunner

log = logging.getLogger("ds4mlx.engine")

NOT_ENDED = ("error", "length", "cancelled")  # finish reasons of a turn that did not end normally


class Decoding:
    def __init__(self, r: SlotRunner, h: JobHandle, logits, prompt_tokens: int, cached: int, prompt_lp=None):
        eng, job = r.engine, h.job
        self.prompt_lp = prompt_lp  # echo with logprobs: the prompt's TokenLogprobs
        self.r, self.h, self.job = r, h, job
        self.prompt_tokens, self.cached = prompt_tokens, cached
        self.room = eng.ctx - len(r.session)
        max_tokens = eng.default_max_tokens if job.max_tokens is None else max(0, int(job.max_tokens))
        self.max_tokens = min(max_tokens, self.room)
        if job.family is None:
            job.family = eng.protocol.family
        self.parser = eng.parser_factory(job, eng.tool_memory)
        self.detok = Detokenizer(eng.tokenizer)
        self.stops = StopMatcher(job.stop)
        self.sampler = Sampler(job.params.seed)
        ends = [e for e in {eng.tokenizer.eos_id, *eng.stop_ids} if e is not None]
        self.banned = sorted(ends) if job.ignore_eos else None
        self.stop_ids = () if job.ignore_eos else ends
        self.raw_parts: list[str] = []
        self.generated: list[int] = []
        self.reason, self.error = "length", None
        self.broken = False  # the session may hold a half-evaluated step
        self.t0 = time.monotonic()
        self.force = job.force_text if job.tools_active else None
        self.forced: list[int] = []
        self.spec_stats = SpecStats()
        if not isinstance(logits, mx.array):
            logits = mx.array(np.asarray(logits, dtype=np.float32))
        vocab = int(logits.shape[-1])
        # logit_bias and penalties (sampling.Penalties; the prompt for the repetition penalty)
        self.pen = Penalties(job.params, vocab, r.session.tokens) if job.params.penalised else None
        self.constraint = None  # structured output: the grammar's mask on the answer (not the reasoning)
        if job.grammar is not None:
            self.constraint = Constraint(job.grammar, eng.tokenizer, vocab)
        self.call_constraint = None  # strict tools: the forced call's rest (host path: the call is forced)
        if job.tool_grammar is not None and self.force is not None:
            self.call_constraint = Constraint(job.tool_grammar, eng.tokenizer, vocab)
        # logprobs: the device values of each sample, oldest first (a loop samples in yield order;
        # a token drawn ahead but never yielded stays at the tail)
        self.pending_lp: list | None = [] if job.logprobs is not None else None
        self.logprobs: list[TokenLogprob] = []
        self.loop = self._make_loop(logits)

    def _with_logprobs(self, sample):
        """`sample` that also queues, on the device, the log-softmax of the raw logits at the
        chosen token and the top k (read back with the token, no extra step)."""
        k = int(self.job.logprobs or 0)

        def wrapped(logits):
            tok = sample(logits)
            lp = logits.reshape(-1).astype(mx.float32)
            lp = lp - mx.logsumexp(lp)
            idx = tok.reshape(-1)[0] if isinstance(tok, mx.array) else mx.array(int(tok))
            out = [lp[idx]]
            if k:
                top = mx.argpartition(-lp, k - 1)[:k]  # the k most likely, then in order
                top = top[mx.argsort(-lp[top])]
                out += [top, lp[top]]
            mx.async_eval(*out)
            self.pending_lp.append(out)
            return tok

        return wrapped

    def _record_logprob(self, tok: int) -> None:
        out = self.pending_lp.pop(0)
        decode = self.r.engine.tokenizer.decode
        top = ()
        if len(out) > 1:
            top = tuple((int(i), decode([int(i)]), float(v)) for i, v in zip(out[1].tolist(), out[2].tolist()))
        self.logprobs.append(TokenLogprob(tok, decode([tok]), float(out[0].item()), top))

    # ------------------------------------------------ sampling
    def _pick(self, logits) -> int:
        """The host's choice (synchronous: it depends on the host's reading of the last token)."""
        job, parser = self.job, self.parser
        if self.force is not None and parser.phase == "text":
            self.forced, self.force = self.r.tokenize(self.force), None  # the answer starts: open the tool call
        if self.forced:
            return self.forced.pop(0)
        structural = bool(job.tools_active and parser.structural)
        params = GREEDY if structural else job.params  # ignore_eos keeps the requested sampling
        if structural and not job.params.greedy:
            self.r.engine.stats.greedy_tokens += 1
        # after the forced head of a strict call its grammar holds every token; otherwise
        # a structured-output grammar holds the answer
        if self.call_constraint is not None and self.force is None:
            constraint = self.call_constraint
        else:
            constraint = self.constraint if parser.phase == "text" else None
        x = constraint.apply(logits) if constraint is not None else logits
        pen = self.pen if params is job.params else None
        tok = int(self.sampler.sample(x, params, self.generated, self.banned, pen).item())
        if constraint is not None:
            constraint.consume(tok)
        return tok

    def _make_loop(self, logits):
        # Forced tool text and greedy-inside-a-tool-call for sampled jobs are host decisions
        # per token: those jobs run the loop synchronously; every other job samples on the
        # device, one token ahead of the host (decode.py).
        job, eng, s = self.job, self.r.engine, self.r.session
        # a grammar without tool calls runs the lookahead loop: over the whole output, or after
        # the reasoning when one token closes it; otherwise the parser picks the constrained tokens
        opens_at = self._reasoning_close() if self.parser.phase == "reasoning" else None
        grammar_ahead = (
            self.constraint is not None
            and not job.tools_active
            and (self.parser.phase == "text" or opens_at is not None)
        )
        host_chooses = (
            self.force is not None
            or (job.tools_active and not job.params.greedy)
            or (self.constraint is not None and not grammar_ahead)
        )
        if (
            not host_chooses and self.pending_lp is None and self.constraint is None
        ):  # speculation (not with logprobs): the same tokens, several per target forward
            loop = loop_for_job(
                eng.speculation, s, logits, job.params, banned=self.banned, seed=self.sampler.seed,
                stop_ids=self.stop_ids, limit=self.max_tokens, stats=self.spec_stats,
            )  # fmt: skip
            if loop is not None:
                return loop
        sample = (
            self._pick
            if host_chooses
            else DeviceSampler(
                job.params, int(logits.shape[-1]), self.banned, seed=self.sampler.seed, penalties=self.pen
            )
        )
        if grammar_ahead:
            sample = GrammarSampler(self.constraint, sample, opens_at)
        if self.pending_lp is not None:
            sample = self._with_logprobs(sample)
        # forced tool-call header tokens do not count against max_tokens: with forced text
        # the limit is checked in `_take`, the context room always
        return decode_tokens(
            s,
            logits,
            sample,
            stop_ids=self.stop_ids,
            lookahead=not host_chooses,
            limit=self.max_tokens if self.force is None else None,
            defer=eng.defer_steps,
        )

    def _reasoning_close(self) -> int | None:
        """The token that ends the reasoning, when the family's closing string is one token."""
        ids = self.r.tokenize(get_protocol(self.job.family).think_close)
        return ids[0] if len(ids) == 1 else None

    # ------------------------------------------------ the token loop
    def steps(self) -> Iterator[StepRequest | None]:
        """Decode to the end, then finish the job."""
        yield from self._tokens()
        self._finish()

    def _tokens(self) -> Iterator[StepRequest | None]:
        tokens = iter(self.loop)
        while True:
            if self.h.cancelled or self.r.engine.closed:
                self.reason, self.error = "cancelled", "cancelled"
                return
            try:
                tok = next(tokens)
                while isinstance(tok, StepRequest):  # deferred: the worker runs it with the others'
                    yield tok
                    tok = next(tokens)
            except StopIteration:
                self.reason = "stop" if self.loop.stopped_by is not None else "length"
                return
            except Exception as e:
                log.exception("decode step failed")
                self.reason, self.error = "error", f"decode failed: {e}"
                self.broken = True
                return
            reason = self._take(tok)
            if reason is not None:
                self.reason = reason
                return
            if not getattr(self.loop, "defer", False):
                yield  # the other slots' turn (a deferred loop gave it at its step request)

    def _push(self, text: str) -> None:
        if not text:
            return
        self.raw_parts.append(text)
        for ev in self.parser.feed(text):
            self.h.emit(ev)

    def _take(self, tok: int) -> str | None:
        """One generated token through detokenizer, stop matcher and parser: the finish
        reason it ends the loop with, or None to go on."""
        job, parser = self.job, self.parser
        self.generated.append(tok)
        if self.pending_lp is not None:
            self._record_logprob(tok)
        self.r.engine.stats.decode_tokens += 1
        self._push(self.stops.push(self.detok.feed(tok)))
        if self.stops.hit is not None:
            return "stop"
        if parser.stop_now:
            return "tool_calls"
        n = len(self.generated)
        if self.loop.limit is None and n >= min(self.max_tokens, self.room):
            return "length"  # the limit of a job with forced text (forced tokens count: generated output)
        if not (job.tools_active and parser.phase in ("tool", "done")):
            call_hook(self.r.cache.on_progress, self.r, job)  # not inside a tool call
            self.r.checkpoint_frontier()
        return None

    # ------------------------------------------------ finishing
    def _finish(self) -> None:
        if not self.broken and hasattr(self.loop, "settle"):
            self.loop.settle()  # speculative tokens the output did not take are dropped from the session
            self.r.engine.stats.count_speculation(self.spec_stats)
        self.r.engine.stats.decode_wait_seconds += getattr(self.loop, "wait_s", 0.0)
        stops = self.stops
        if self.reason != "stop" or stops.hit is None:
            self._push(stops.push(self.detok.flush()))
            self._push(stops.flush())
        if stops.hit is not None:
            self.reason = "stop"
        truncated = self.reason == "length"  # lets the parser repair a block cut by max_tokens
        tail_events, parsed = self.parser.finish(truncated)
        for ev in tail_events:
            self.h.emit(ev)
        calls = calls_of(parsed)
        self._resolve(parsed, calls)
        raw_text = "".join(self.raw_parts)
        self._keep_state(parsed, calls, raw_text)
        self._report(parsed, raw_text)

    def _resolve(self, parsed: ParsedOutput | None, calls: list) -> None:
        """The finish reason the parse settles (a tool-call block that never closed fails the turn)."""
        perror = parsed.error if parsed is not None else None
        if self.reason == "cancelled":
            self.r.engine.stats.cancelled += 1
        elif self.reason == "error":
            pass
        elif perror == PARSE_UNTERMINATED_TOOL_CALL:
            # ds4: a block that started but never closed fails the turn (docs/dsml.md §3.1).
            self.reason, self.error = "error", perror
        elif calls and self.reason != "length":  # a call the token limit cut is never executable
            self.reason = "tool_calls"
        elif self.job.force_text and self.job.tools_active and self.reason in ("stop", "tool_calls"):
            self.reason, self.error = "error", perror or "no tool call"  # tool_choice forced a call: none parsed
        elif self.reason == "tool_calls":
            self.reason = "stop"  # the block closed but did not parse: its markup is dropped
        if perror and self.reason != "error":
            log.warning("%s %s finish=%s", job_kind(self.job), perror, self.reason)

    def _keep_state(self, parsed: ParsedOutput | None, calls: list, raw_text: str) -> None:
        """What the slot keeps of this turn: the live session (or not), tool memory, bindings."""
        r, job = self.r, self.job
        if self.stops.hit is not None or self.broken:
            r.invalidate()  # ds4 invalidates the live session on a stop-sequence hit
        memory = r.tool_memory
        if calls and memory is not None and self.reason == "tool_calls":
            try:
                memory.remember([c.id for c in calls], parsed.raw_dsml)
            except Exception:
                log.exception("tool memory remember failed")
        if self.stops.hit is None and not job.raw and parsed is not None:
            ok = self.reason not in NOT_ENDED
            proto = r.engine.protocol
            r.keep_bindings(*after_turn(job, parsed, calls, ok, raw_text, proto, len(r.session)))

    def _report(self, parsed: ParsedOutput | None, raw_text: str) -> None:
        n, st = len(self.generated), self.spec_stats
        dt = time.monotonic() - self.t0
        log.info(
            "%s gen=%d finish=%s%s %.2f t/s%s",
            job_kind(self.job),
            n,
            self.reason,
            f' error="{self.error}"' if self.error else "",
            n / dt if dt > 0 else 0.0,
            f" spec drafted={st.drafted} accepted={st.accepted}" if st.rounds else "",
        )
        reasoning = self._reasoning_tokens(parsed, n)
        usage = Usage(self.prompt_tokens, n, self.cached, self.prompt_tokens - self.cached, reasoning_tokens=reasoning)
        self.h.finish(
            Finish(
                self.reason,
                usage,
                raw_text=raw_text,
                result=parsed,
                error=self.error,
                stop_sequence=self.stops.hit,
                speculation=st.as_dict() if st.rounds else None,
                logprobs=tuple(self.logprobs) if self.pending_lp is not None else None,
                echo=self.job.echo,
                prompt_logprobs=self.prompt_lp,
            )
        )

    def _reasoning_tokens(self, parsed: ParsedOutput | None, generated: int) -> int:
        """How many of the generated tokens were reasoning (its text re-tokenized, with
        the think close; at most all of them)."""
        if parsed is None or not parsed.reasoning:
            return 0
        closed = parsed.content or parsed.calls
        return min(generated, len(self.r.tokenize(parsed.reasoning)) + (1 if closed else 0))
