"""The eval run: context sizing, scheduling, grading, trace records, the report
(docs/eval.md §3, §4, §8, §11, §13, §14).  UI-agnostic: a UI object gets
callbacks (plain mode prints, the TUI renders the shared state)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from .backends import Backend, Control, GenJob
from .extract import grade_detail
from .prompts import Prompt, build_prompt
from .thinkclose import THINK_CLOSE, CloseEvent, default_budgets
from .trace import TraceRecord, TraceWriter

CTX_CAP = 1_000_000
LABELS = {
    "PENDING": "PEND",
    "PREFILL": "FILL",
    "RUNNING": "RUN",
    "SKIPPED": "SKIP",
    "STOPPED": "STOP",
    "PASSED": "PASS",
    "FAILED": "FAIL",
    "ERROR": "ERR",
}
_STAGE_PREFIXES = ("prefill failed: ", "decode failed: ")


@dataclass
class Options:
    tokens: int | None = None  # None: each case's own max_tokens
    thinking: bool = True
    think_max: bool = False  # Think Max prefix (already gated by the context size)
    think_level: int | None = None  # V4.1 effort sent to an endpoint (--think-level)
    soft_budget: int | None = None  # None: 1024, scaled down for small limits
    hard_budget: int | None = None  # None: 512, scaled down for small limits
    soft_rank: int = 3
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.05
    seed: int = 0
    ctx: int | None = None  # None: auto-size
    trace: str | None = None
    pause_ms: int = 350
    suite: str = "core"


@dataclass
class CaseRun:
    pos: int
    case: dict[str, Any]
    prompt: Prompt
    budget: int  # requested generation budget
    prompt_tokens: int = 0
    limit: int = 0  # budget clamped to the context
    status: str = "PENDING"  # PENDING PREFILL RUNNING PASSED FAILED SKIPPED STOPPED
    picked: str = ""
    generated: int = 0
    raw: list[str] = field(default_factory=list)
    think_open: bool = True
    prefill: tuple[int, int] = (0, 0)
    elapsed: float = 0.0
    t_phase: float = 0.0  # monotonic start of the current phase (speed)
    phase_paused0: float = 0.0  # Control.paused_total() at that start
    phase_tokens: int = 0
    error: str = ""
    carried: str | None = None  # trace record text kept by --retry-incomplete
    spec: dict[str, Any] | None = None  # speculative decoding: the last run's counters (trace)

    @property
    def label(self) -> str:
        return LABELS.get(self.status, self.status[:4])

    @property
    def key(self) -> str:
        return f"{self.case['source']}/{self.case['id']}"

    def reset(self) -> None:
        self.status, self.picked, self.generated, self.raw = "PENDING", "", 0, []
        self.think_open, self.prefill, self.elapsed, self.error = True, (0, 0), 0.0, ""
        self.phase_tokens, self.spec = 0, None


def error_line(cr: CaseRun) -> str:
    """`prefill failed for ID: why` (in-process stages) or `error in ID: why`."""
    for prefix in _STAGE_PREFIXES:
        if cr.error.startswith(prefix):
            return f"{prefix.split(':')[0]} for {cr.case['id']}: {cr.error[len(prefix) :]}"
    return f"error in {cr.case['id']}: {cr.error}"


class NullUI:
    def begin(self, runner: Runner) -> None: ...
    def case_started(self, cr: CaseRun) -> None: ...
    def prefill(self, cr: CaseRun, done: int, total: int) -> None: ...
    def text(self, cr: CaseRun, delta: str) -> None: ...
    def case_finished(self, cr: CaseRun) -> None: ...


class Runner:
    def __init__(
        self,
        cases: list[dict[str, Any]],
        backend: Backend,
        opts: Options,
        ui: Any = None,
        out: TextIO | None = None,
        err: TextIO | None = None,
        control: Control | None = None,
    ):
        self.backend = backend
        self.opts = opts
        self.ui = ui or NullUI()
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.control = control or Control()
        self.runs = [
            CaseRun(
                i,
                c,
                build_prompt(c, opts.thinking, opts.think_max, opts.think_level),
                opts.tokens or int(c.get("max_tokens") or 16000),
            )
            for i, c in enumerate(cases)
        ]
        self.ctx = 0
        self.active: int | None = None
        self.trace: TraceWriter | None = None
        self.error = False
        self.runtime = 0.0
        self.t_active = 0.0
        self.sleep_after_case = 0.0
        self.case_t0 = 0.0
        self.case_p0 = 0.0

    # ------------------------------------------------------------ setup
    def _think_mode(self) -> str:
        if not self.opts.thinking:
            return "none"
        if self.opts.think_level is not None:
            return str(self.opts.think_level)
        return "max" if self.opts.think_max else "high"

    def size_context(self) -> int | None:
        """Count prompts and pick the context (docs/eval.md §4).  Returns an exit code on failure."""
        counts = [self.backend.count_tokens(cr.prompt) for cr in self.runs]
        if any(n is None for n in counts):
            for cr in self.runs:
                cr.limit = cr.budget
            self.ctx = self.opts.ctx or 0
            print("ds4-eval: context sized by the server (endpoint backend)", file=self.err)
            return None
        for cr, n in zip(self.runs, counts):
            cr.prompt_tokens = int(n)  # type: ignore[arg-type]
        k = max(range(len(self.runs)), key=lambda i: self.runs[i].prompt_tokens + self.runs[i].budget)
        big = self.runs[k]
        required = big.prompt_tokens + big.budget
        if self.opts.ctx:
            self.ctx = self.opts.ctx
        else:
            if required > CTX_CAP:
                print(
                    f"ds4-eval: largest prompt ({big.prompt_tokens} tokens, case {k + 1}) + --tokens "
                    f"({big.budget}) exceeds the {CTX_CAP} token context cap",
                    file=self.err,
                )
                return 2
            self.ctx = required
            print(
                f"ds4-eval: context auto-sized to {self.ctx} tokens (largest prompt={big.prompt_tokens} "
                f"tokens, case={k + 1}, generation budget={big.budget})",
                file=self.err,
            )
        for cr in self.runs:
            cr.limit = min(cr.budget, self.ctx - cr.prompt_tokens)
        return None

    def header(self) -> dict[str, Any]:
        soft, hard = default_budgets(max(cr.budget for cr in self.runs), self.opts.soft_budget, self.opts.hard_budget)
        return {
            "started_unix": int(time.time()),
            "model": self.backend.model,
            "backend": self.backend.name,
            "suite": self.opts.suite,
            "ctx": self.ctx or "server",
            "max_tokens": self.opts.tokens if self.opts.tokens else "per-case",
            "max_prompt_tokens": max(cr.prompt_tokens for cr in self.runs),
            "questions": len(self.runs),
            "temperature": float(self.opts.temperature),
            "top_p": float(self.opts.top_p),
            "min_p": float(self.opts.min_p),
            "seed": self.opts.seed,
            "think_mode_requested": self._think_mode(),
            "soft_limit_reply_budget": soft,
            "hard_limit_reply_budget": hard,
            "soft_limit_think_close_rank": self.opts.soft_rank,
            "think_close_forcing": self.think_close_forcing(),
        }

    def think_close_forcing(self) -> str:
        """How a `</think>` can be forced: in the decode loop, by a continuation
        request, or not at all (an endpoint without continuation)."""
        if not self.opts.thinking:
            return "none (thinking off)"
        kind = getattr(self.backend, "continuation", None)
        if kind is None:
            return "decode loop (soft + hard)"
        return f"continuation request ({kind})" if kind != "none" else "none (endpoint without continuation)"

    # ------------------------------------------------------------ one case
    def run_case(self, pos: int) -> str:
        cr = self.runs[pos]
        cr.reset()
        self.active = pos
        self.control.running = pos
        if cr.limit < 1 and self.ctx:
            return self._skip(
                cr,
                "prompt does not fit context" if cr.prompt_tokens >= self.ctx else "prompt leaves no generation room",
            )
        cr.status = "PREFILL"
        cr.t_phase, cr.phase_paused0 = time.monotonic(), self.control.paused_total()
        self.ui.case_started(cr)
        soft, hard = default_budgets(cr.limit, self.opts.soft_budget, self.opts.hard_budget)

        def on_prefill(done: int, total: int) -> None:
            cr.prefill = (done, total)
            self.ui.prefill(cr, done, total)

        def on_started(prompt_tokens: int) -> None:
            if prompt_tokens:
                cr.prompt_tokens = prompt_tokens
            cr.status = "RUNNING"
            cr.t_phase, cr.phase_tokens = time.monotonic(), 0
            cr.phase_paused0 = self.control.paused_total()

        def on_text(delta: str) -> None:
            cr.raw.append(delta)
            cr.generated += 1
            cr.phase_tokens += 1
            if cr.think_open and self.opts.thinking:
                tail = "".join(cr.raw[-4:])[-(len(delta) + len(THINK_CLOSE)) :]
                if THINK_CLOSE in tail:
                    cr.think_open = False
                    cr.t_phase, cr.phase_tokens = time.monotonic(), 0
                    cr.phase_paused0 = self.control.paused_total()
            self.ui.text(cr, delta)

        t0 = self.case_t0 = time.monotonic()
        p0 = self.case_p0 = self.control.paused_seconds
        try:
            job = GenJob(
                cr.prompt,
                cr.limit or cr.budget,
                seed=self.opts.seed,
                control=self.control,
                on_prefill=on_prefill,
                on_started=on_started,
                on_text=on_text,
                soft_budget=soft,
                hard_budget=hard,
                soft_rank=self.opts.soft_rank,
                case_id=cr.case["id"],
            )
            res = self.backend.generate(job)
        except Exception as e:  # noqa: BLE001 - a backend bug is an ERROR record, not a crash
            from .thinkclose import GenResult

            res = GenResult(
                raw="".join(cr.raw),
                generated_tokens=cr.generated,
                finish="error",
                error=f"{'decode' if cr.status == 'RUNNING' else 'prefill'} failed: {e}",
            )
        self.t_active += time.monotonic() - t0 - (self.control.paused_seconds - p0)
        self.case_t0 = 0.0
        if res.prompt_tokens:
            cr.prompt_tokens = res.prompt_tokens
        cr.generated = res.generated_tokens or cr.generated
        cr.elapsed = res.elapsed
        cr.spec = getattr(res, "spec", None)
        raw = res.raw if res.raw or not cr.raw else "".join(cr.raw)
        status = {"stopped": "STOPPED", "switched": "SWITCHED", "error": "ERROR", "skipped": "SKIPPED"}.get(
            res.finish, ""
        )
        if status == "SKIPPED":
            return self._skip(cr, res.error)
        if not status:
            cr.picked, ok = grade_detail(cr.case, raw)
            status = "PASSED" if ok else "FAILED"
        cr.error = res.error
        self._record(cr, status, raw, res.close)
        if status == "ERROR":
            cr.status = "ERROR"  # kept on screen and in the report: the reason must outlive the TUI
            print(f"ds4-eval: {error_line(cr)}", file=self.err)
            self.error = True
        elif status == "SWITCHED":
            cr.reset()
        else:
            cr.status = status
        self.ui.case_finished(cr)
        if status in ("PASSED", "FAILED") and self.sleep_after_case:
            time.sleep(self.sleep_after_case)
        return status

    def _skip(self, cr: CaseRun, why: str) -> str:
        cr.status, cr.error = "SKIPPED", why
        self._record(cr, "SKIPPED", "", CloseEvent())
        self.ui.case_finished(cr)
        return "SKIPPED"

    def _record(self, cr: CaseRun, status: str, raw: str, close: CloseEvent) -> None:
        if self.trace is None:
            return
        c = cr.case
        self.trace.record(
            TraceRecord(
                cr.pos + 1,
                len(self.runs),
                c["source"],
                c["id"],
                c["domain"],
                c["title"],
                status,
                cr.picked if status in ("PASSED", "FAILED") else "?",
                c["answer"],
                prompt_tokens=cr.prompt_tokens,
                generated_tokens=cr.generated,
                elapsed=cr.elapsed,
                temperature=self.opts.temperature,
                top_p=self.opts.top_p,
                min_p=self.opts.min_p,
                think_mode=self._think_mode(),
                think_close=close.kind,
                think_close_index=close.token_index,
                think_close_remaining=close.remaining,
                think_close_rank=close.rank,
                error=cr.error,
                choices=c["choices"],
                answer_kind=c["answer_kind"],
                system=cr.prompt.system,
                question=cr.prompt.user,
                output=raw,
                spec=cr.spec if status != "SKIPPED" else None,
            )
        )

    # ------------------------------------------------------------ the loop
    def run(self) -> int:
        """Run until every case is done (or quit / error).  Returns the exit code."""
        t0 = time.monotonic()
        p0 = self.control.paused_seconds
        nxt = next((cr.pos for cr in self.runs if cr.status == "PENDING"), None)
        self.ui.begin(self)
        while nxt is not None:
            self.control.wait_if_paused()
            if self.control.quit:
                break
            if self.control.switch_to is not None:
                nxt, self.control.switch_to = self.control.switch_to, None
            status = self.run_case(nxt)
            if status == "ERROR":
                break
            if self.control.quit or status == "STOPPED":
                if self.runs[nxt].status not in ("PASSED", "FAILED"):
                    self.runs[nxt].status = "STOPPED"
                break
            if self.control.switch_to is not None:
                nxt, self.control.switch_to = self.control.switch_to, None
                continue
            n = len(self.runs)
            nxt = next((p % n for p in range(nxt + 1, nxt + 1 + n) if self.runs[p % n].status == "PENDING"), None)
        self.control.running = None
        self.active = None
        self.runtime = time.monotonic() - t0 - (self.control.paused_seconds - p0)
        return self.exit_code()

    def exit_code(self) -> int:
        """ds4-eval's: 1 on an error or a failed case; 2 when the run ended without
        grading anything (every case skipped); else 0 (also after `q`)."""
        if self.error or self.failed:
            return 1
        if not self.passed and not self.control.quit and all(cr.status == "SKIPPED" for cr in self.runs):
            print(f"ds4-eval: no case was graded ({len(self.runs)} skipped)", file=self.err)
            return 2
        return 0

    def finish_trace(self) -> None:
        if self.trace is not None:
            totals = getattr(self.backend, "spec_stats", None)  # in-process speculation: the cases' sum
            self.trace.summary(self.passed, self.failed, len(self.runs), totals.as_dict() if totals else None)
            self.trace.close()

    @property
    def passed(self) -> int:
        return sum(cr.status == "PASSED" for cr in self.runs)

    @property
    def failed(self) -> int:
        return sum(cr.status == "FAILED" for cr in self.runs)


# ---------------------------------------------------------------- report


def hhmm(seconds: float) -> str:
    m = int(seconds // 60)
    return f"{m // 60:02d}h:{m % 60:02d}m"


def _cell(text: str, width: int) -> str:
    """A report column padded to `width` terminal cells, cut with `~` so long or
    double-width answers never shift the columns."""
    from rich.cells import cell_len, set_cell_size

    text = "".join(ch if ch.isprintable() else "?" for ch in text)
    return set_cell_size(text, width) if cell_len(text) <= width else set_cell_size(text, width - 1) + "~"


def speed_line(runner: Runner) -> str:
    """Time and t/s of the cases generated (carried-over cases included)."""
    ran = [cr for cr in runner.runs if cr.status != "PENDING" and cr.generated]
    tokens = sum(cr.generated for cr in ran)
    seconds = sum(cr.elapsed for cr in ran)
    tps = tokens / seconds if seconds > 0 else 0.0
    return f"{runner.runtime:.1f}s, {tokens} tokens generated in {seconds:.1f}s, {tps:.1f} t/s"


def report(runner: Runner) -> str:
    """The final report (docs/eval.md §14) plus totals by source, time and t/s."""
    runs = runner.runs
    p, f = runner.passed, runner.failed
    lines = [
        f"ds4-eval: {p}/{len(runs)} passed{f', {f} failed' if f else ''}, runtime {hhmm(runner.runtime)} "
        f"({speed_line(runner)})",
        f"{'#':<3} {'state':<8} {'prompt':>8} {'gen':>8} {'total':>8} {'given':<8} {'correct':<8} test",
    ]
    for cr in runs:
        state = cr.status
        given = (cr.picked or "?") if state in ("PASSED", "FAILED") else "-"
        ran = state != "PENDING" or cr.carried is not None
        prompt = cr.prompt_tokens if ran else 0
        gen = cr.generated if ran else 0
        lines.append(
            f"{cr.pos + 1:>3} {state:<8} {prompt:>8} {gen:>8} {prompt + gen:>8} {_cell(given, 8)} "
            f"{_cell(str(cr.case['answer']), 8)} {cr.case['source']}/{cr.case['id']}"
        )
    lines.append("")
    lines.append(f"{'source':<16} {'passed':>6} {'failed':>6} {'other':>6} {'total':>6}")
    sources: dict[str, list[CaseRun]] = {}
    for cr in runs:
        sources.setdefault(cr.case["source"], []).append(cr)
    for src, group in sources.items():
        sp = sum(c.status == "PASSED" for c in group)
        sf = sum(c.status == "FAILED" for c in group)
        lines.append(f"{src:<16} {sp:>6} {sf:>6} {len(group) - sp - sf:>6} {len(group):>6}")
    lines.append(f"{'all':<16} {p:>6} {f:>6} {len(runs) - p - f:>6} {len(runs):>6}")
    errors = [cr for cr in runs if cr.status == "ERROR"]
    if errors:
        lines.append("")
        lines += [f"{cr.pos + 1:>3} ERROR {cr.key}: {cr.error}" for cr in errors]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- plain mode


class PlainUI(NullUI):
    """docs/eval.md §13: per case a header, the streamed raw text (thinking dim), the result."""

    def __init__(self, out: TextIO = sys.stdout, color: bool | None = None):
        self.out = out
        self.color = out.isatty() if color is None else color
        self._tail = ""
        self._closed = False
        self._last = "\n"

    def _c(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color and text else text

    def begin(self, runner: Runner) -> None:
        self.n = len(runner.runs)
        self.thinking = runner.opts.thinking
        self.ctx = runner.ctx

    def case_started(self, cr: CaseRun) -> None:
        c = cr.case
        self.out.write(f"\n[{cr.pos + 1}/{self.n}] {self._c('36', c['source'] + '/' + c['domain'])} {c['title']}\n")
        self.out.flush()
        self._tail, self._closed, self._last = "", not self.thinking, "\n"

    def text(self, cr: CaseRun, delta: str) -> None:
        if not delta:
            return
        if self._closed:
            self.out.write(delta)
        else:
            joined = self._tail + delta
            i = joined.find(THINK_CLOSE)
            if i < 0:
                self.out.write(self._c("2", delta))
                self._tail = joined[-(len(THINK_CLOSE) - 1) :]
            else:
                cut = max(0, i + len(THINK_CLOSE) - len(self._tail))
                self.out.write(self._c("2", delta[:cut]) + delta[cut:])
                self._closed = True
        self._last = delta[-1]
        self.out.flush()

    def case_finished(self, cr: CaseRun) -> None:
        c = cr.case
        if cr.status == "SKIPPED":
            self.out.write(
                f"\n[{cr.pos + 1}/{self.n}] SKIPPED {c['source']}/{c['id']} prompt={cr.prompt_tokens} ctx={self.ctx}\n"
            )
        elif cr.status in ("PASSED", "FAILED"):
            if self._last != "\n":
                self.out.write("\n")
            word = self._c("32", "PASSED") if cr.status == "PASSED" else self._c("31", "FAIL")
            self.out.write(
                f"{word} got {cr.picked or '?'} expected {c['answer']} ({cr.elapsed:.1f}s, {cr.generated} tokens)\n"
            )
        elif self._last != "\n":
            self.out.write("\n")
        self.out.flush()


def default_seed() -> int:
    return ((int(time.time()) ^ (os.getpid() << 32) ^ int(time.process_time() * 1e6)) & ((1 << 63) - 1)) or 1
