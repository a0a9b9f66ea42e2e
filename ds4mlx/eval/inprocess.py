"""In-process backend: the model runs in this process through `ds4mlx.load` and a
`Session` (DEVELOPERS.md contracts: `model.new_session(ctx)`, `session.prefill(ids)`,
`session.step(id)`, `session.truncate(n)`, `len(session)`; tokenizer `encode`,
`token_bytes`, `eos_id`).

Like ds4-eval it drives the session directly rather than through the engine's job
queue, because the `</think>` budget controller must choose tokens step by step.
One session of the auto-sized context is reused; each case is prefilled from
scratch (ds4 never finds a reusable prefix between cases either).
MLX is imported only when `open()` runs.
"""

from __future__ import annotations

import codecs
from typing import Any

from ..chat import markers as M
from .backends import GenJob
from .prompts import Prompt
from .thinkclose import GenResult, Interrupted, Xorshift64Star, run_token_loop

PREFILL_CHUNK = 2048


class InProcessBackend:
    name = "mlx"

    def __init__(
        self,
        model_path: str | None = None,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        min_p: float = 0.05,
        loaded: tuple[Any, Any] | None = None,
        stream: Any = None,
        spec_args: Any = None,
        chat_template: str | None = None,
    ):
        """`loaded=(model, tokenizer)` skips `ds4mlx.load` (tests, embedding); `stream`:
        an `experts.StreamConfig` (--stream-experts); `spec_args`: the speculative-decoding
        flags (speculative/cli.py), or a SpecConfig."""
        self.stream = stream
        self.chat_template = chat_template  # --chat-template; None / "ds4": Prompt.text as is
        self._protocol: Any = None  # the loaded family's protocol with that template
        self.model_path = model_path
        self.model = model_path or "demo"
        self.temperature, self.top_p, self.min_p = temperature, top_p, min_p
        self._model: Any = loaded[0] if loaded else None
        self._tok: Any = loaded[1] if loaded else None
        self._session: Any = None
        self._spec_args, self.speculation, self.spec_stats = spec_args, None, None
        self._rng: Xorshift64Star | None = None
        self.ctx = 0

    # -- loading
    def _load(self) -> None:
        if self._model is None:
            import ds4mlx

            from ..speculative import cli as spec_cli

            self._model, self._tok = ds4mlx.load(
                self.model_path, stream=self.stream, mtp=spec_cli.mtp_file(self._spec_args)
            )
        if self._protocol is None:
            from ..chat.protocol import protocol_for_model
            from ..cli.options import template_protocol

            self._protocol = template_protocol(self.chat_template, protocol_for_model(self._model))

    def prompt_text(self, prompt: Prompt) -> str:
        """The prompt's text: eval's own rendering (prompts.py), or the --chat-template
        protocol's rendering of its system + user messages when that is not the default."""
        self._load()
        if self._protocol.chat_template == M.CHAT_TEMPLATE_DS4:
            return prompt.text
        from ..chat.messages import Conversation, Message

        mode = "none" if not prompt.thinking else ("max" if prompt.think_max else "high")
        msgs = [Message(m["role"], m["content"]) for m in prompt.messages]
        return self._protocol.render(Conversation(msgs, thinking=mode))

    def count_tokens(self, prompt: Prompt) -> int:
        self._load()
        return len(self._tok.encode(self.prompt_text(prompt)))

    def open(self, ctx: int) -> None:
        self._load()
        self.ctx = ctx
        self._session = self._model.new_session(ctx)
        if self._spec_args is not None and self.speculation is None:
            from ..speculative import cli as spec_cli
            from ..speculative.options import SpecConfig, SpecStats

            spec = self._spec_args
            self.speculation = spec if isinstance(spec, SpecConfig) else spec_cli.spec_config(spec, self._model, ctx)
            self.spec_stats = SpecStats()

    def close(self) -> None:
        self._session = None

    def close_ids(self) -> list[int]:
        """`</think>` tokenized as plain text (ds4 does not use the special id):
        the pre-tokenizer splits it into `</`, `think`, `>`, so encoding the two
        halves separately gives the plain tokenization without matching the
        special string."""
        return list(self._tok.encode("</")) + list(self._tok.encode("think>"))

    # -- sampling
    def _sampler(self, seed: int):
        import mlx.core as mx
        import numpy as np

        if self.temperature <= 0:
            return lambda logits: int(mx.argmax(logits).item())
        if self._rng is None:
            self._rng = Xorshift64Star(seed)
        rng = self._rng

        def sample(logits) -> int:
            x = np.asarray(logits.astype(mx.float32)).reshape(-1) / self.temperature
            p = np.exp(x - x.max())
            p /= p.sum()
            keep = np.nonzero(p >= self.min_p * p.max())[0]
            order = keep[np.argsort(-p[keep], kind="stable")]
            if self.top_p < 1.0:
                cum = np.cumsum(p[order])
                cut = int(np.searchsorted(cum, self.top_p * cum[-1])) + 1
                order = order[: max(1, cut)]
            probs = p[order] / p[order].sum()
            r = rng.uniform()
            idx = int(np.searchsorted(np.cumsum(probs), r, side="right"))
            return int(order[min(idx, len(order) - 1)])

        return sample

    # -- generation
    def generate(self, job: GenJob) -> GenResult:
        prompt, control, on_text = job.prompt, job.control, job.on_text
        import mlx.core as mx
        import numpy as np

        ids = list(self._tok.encode(self.prompt_text(prompt)))
        res = GenResult(prompt_tokens=len(ids))
        if len(ids) >= self.ctx:
            res.finish, res.error = "skipped", "prompt does not fit context"
            return res
        limit = min(job.max_tokens, self.ctx - len(ids))
        if limit < 1:
            res.finish, res.error = "skipped", "prompt leaves no generation room"
            return res
        try:
            if len(self._session):
                try:
                    self._session.truncate(0)
                except Exception:  # noqa: BLE001 - a session without truncate
                    self._session = self._model.new_session(self.ctx)
            s = self._session
            logits = None
            for i in range(0, len(ids), PREFILL_CHUNK):
                control.wait_if_paused()
                logits = s.prefill(ids[i : i + PREFILL_CHUNK])
                job.on_prefill(min(i + PREFILL_CHUNK, len(ids)), len(ids))
        except Exception as e:  # noqa: BLE001 - reported as ERROR, as ds4 does
            res.finish, res.error = "error", f"prefill failed: {e}"
            return res
        try:
            control.check()
        except Interrupted as e:
            res.finish = e.status.lower()
            return res
        job.on_started(len(ids))
        state = {"logits": logits if isinstance(logits, mx.array) else mx.array(np.asarray(logits))}
        sample = self._sampler(job.seed)
        eos = self._tok.eos_id
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        closer = job.closer(self.close_ids())

        def cur():
            return state["logits"].reshape(-1)

        def rank_of(tok: int) -> int:
            x = cur()
            v = x[tok]
            return int((x > v).sum().item()) + int((x[:tok] == v).sum().item()) + 1

        stepper, case_stats = s, None
        if self.speculation is not None:  # drafts verified in one forward; every pick still the target's
            from ..speculative.options import SpecStats
            from ..speculative.stepper import SpeculativeStepper

            sp, case_stats = self.speculation, SpecStats()  # this case's counters; the run's: spec_stats
            stepper = SpeculativeStepper(s, sp.drafter, sp.depth, sp.margin, stats=case_stats)

        def advance(tok: int) -> str:
            state["logits"] = stepper.step(tok)
            return decoder.decode(self._tok.token_bytes(tok))

        try:
            run_token_loop(
                limit=limit,
                closer=closer,
                control=control,
                pick=lambda: sample(cur()),
                rank_of=rank_of,
                is_eos=lambda t: t == eos,
                advance=advance,
                on_text=on_text,
                result=res,
            )
        except Exception as e:  # noqa: BLE001
            res.finish, res.error = "error", f"decode failed: {e}"
        if stepper is not s:
            try:
                stepper.settle()
            finally:
                self.spec_stats.add(case_stats)  # the run's totals are the sum of the cases'
                res.spec = case_stats.as_dict()
        tail = decoder.decode(b"", final=True)
        if tail:
            res.raw += tail
            on_text(tail)
        return res
