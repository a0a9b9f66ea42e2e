"""`ds4mlx eval`: the ds4-eval harness.

    ds4mlx eval [-m MODEL] [--suite core|hard|hard-smoke] [--case-id ID ...] [--trace FILE]
    ds4mlx eval --endpoint http://127.0.0.1:8000 [--api-key KEY] [-m NAME]
    ds4mlx eval --self-test-extractors | --regrade TRACE | --list-cases | --validate-cases

Importing this module (and `--self-test-extractors`, `--regrade`, `--list-cases`,
`--validate-cases`) never imports MLX.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..chat import markers as M
from ..cli.options import UsageError, add_chat_template_argument
from ..io.modelfile import EXIT_CODE, ModelFileError
from ..speculative import cli as spec_cli
from .cases import SUITES, load_cases, select, unknown_ids, validate_cases

CTX_CAP = 1_000_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "-m",
        "--model",
        default=None,
        help="GGUF file or Hugging Face folder (default: the demo model); with --endpoint, "
        "the model name sent to the server (default: the first of /v1/models)",
    )
    g.add_argument(
        "--endpoint",
        metavar="URL",
        help="use an OpenAI-compatible server (chat completions, streamed or not); the server "
        "sizes the context (the trace says ctx: server)",
    )
    g.add_argument(
        "--endpoint-continuation",
        choices=("none", "prefix"),
        default="none",
        help="forced </think> at the think cap with --endpoint: 'prefix' cuts the reasoning there and "
        "asks for the answer by a second request (DeepSeek-style assistant prefix message); "
        "'none' (default; ds4mlx serve has no continuation) forces nothing: a reasoning may use "
        "the whole budget",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("DS4MLX_EVAL_API_KEY"),
        help="bearer token for --endpoint (default: $DS4MLX_EVAL_API_KEY)",
    )
    g.add_argument("--backend", choices=("mlx", "endpoint", "fake"), default=None, help=argparse.SUPPRESS)
    g.add_argument("--fake-script", metavar="JSON", help=argparse.SUPPRESS)
    spec_cli.add_arguments(g)  # speculative decoding of the in-process backend
    add_chat_template_argument(g)  # the in-process backend's prompts (a server picks its own)

    g = p.add_argument_group("cases")
    g.add_argument("--suite", choices=SUITES, default="core", help="case suite (default core: the 92 ds4-eval cases)")
    g.add_argument(
        "--case-id",
        action="append",
        default=[],
        metavar="ID",
        help="run only this case (id or 1-based index; repeatable)",
    )
    g.add_argument("--domain", action="append", default=[], help="only cases of this domain (repeatable)")
    g.add_argument("--source", action="append", default=[], help="only cases of this source (repeatable)")
    g.add_argument("--questions", type=int, metavar="N", help="only the first N selected cases")
    g.add_argument("--list-cases", action="store_true", help="list the selected cases and exit")
    g.add_argument("--validate-cases", action="store_true", help="check the shipped case data and exit")

    g = p.add_argument_group("generation")
    g.add_argument(
        "-n",
        "--tokens",
        type=int,
        default=None,
        metavar="N",
        help="generation budget per case (default: the case's own, 16000; Juliet 8000)",
    )
    from ..cli.think_flags import add_think_arguments

    add_think_arguments(g)  # ds4's --think / --think-max / --nothink / --think-level
    g.add_argument(
        "--soft-limit-reply-budget",
        type=int,
        metavar="N",
        help="soft </think> close once this many tokens remain (default 1024; below --tokens 2048 "
        "it is half the budget)",
    )
    g.add_argument(
        "--hard-limit-reply-budget",
        type=int,
        metavar="N",
        help="forced </think> once this many tokens remain (default 512; below --tokens 2048 it is "
        "a quarter of the budget)",
    )
    g.add_argument(
        "--soft-limit-think-close-rank",
        type=int,
        default=3,
        metavar="N",
        help="soft close when </think> ranks in the top N (default 3)",
    )
    g.add_argument("--temp", type=float, default=0.0, help="temperature (default 0 = greedy)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--seed", type=int, default=None, help="sampler seed (default: time based)")
    g.add_argument("--ctx", type=int, default=None, help="context size (default: largest prompt + budget)")

    g = p.add_argument_group("output")
    g.add_argument("--trace", metavar="FILE", help="write a trace of every case")
    g.add_argument(
        "--retry-incomplete",
        action="store_true",
        help="with --trace FILE: keep its PASSED/FAILED cases, run only the others",
    )
    g.add_argument(
        "--regrade",
        "--regrade-trace",
        dest="regrade",
        metavar="TRACE",
        help="grade a trace again with the current extractors (no model)",
    )
    g.add_argument(
        "--self-test-extractors", action="store_true", help="run the built-in extractor vectors (no model) and exit"
    )
    g.add_argument(
        "--report",
        metavar="FILE.json",
        help="write a JSON report: per case id, suite, source, domain, status, expected, "
        "extracted, tokens, seconds, t/s; totals and per-source counts",
    )
    g.add_argument(
        "--baseline",
        metavar="FILE.json",
        help="compare with an earlier --report: exit 0 when the pass count dropped by at most "
        "--max-drop, 1 when it dropped more, 2 on a harness error (error, unfinished run)",
    )
    g.add_argument(
        "--max-drop", type=int, default=0, metavar="N", help="with --baseline: passes allowed to be lost (default 0)"
    )
    g.add_argument("--plain", action="store_true", help="no TUI (also when stdout is not a terminal)")
    g.add_argument("--pause-ms", type=int, default=350, help="TUI pause after each result (default 350)")
    from ..experts import cli as experts_cli

    experts_cli.add_arguments(p)


def _fail(msg: str, code: int = 2) -> int:
    print(f"ds4-eval: {msg}", file=sys.stderr)
    return code


def _validate(a: argparse.Namespace) -> str | None:
    for name in ("tokens", "soft_limit_reply_budget", "hard_limit_reply_budget", "ctx", "questions", "seed"):
        v = getattr(a, name)
        if v is not None and v <= 0:
            return f"invalid value for --{name.replace('_', '-')}: {v}"
    if a.soft_limit_think_close_rank <= 0:
        return f"invalid value for --soft-limit-think-close-rank: {a.soft_limit_think_close_rank}"
    if a.pause_ms < 1:
        return f"invalid value for --pause-ms: {a.pause_ms}"
    if not (0 <= a.temp <= 100):
        return f"invalid value for --temp: {a.temp}"
    if not (0 <= a.top_p <= 1):
        return f"invalid value for --top-p: {a.top_p}"
    if not (0 <= a.min_p <= 1):
        return f"invalid value for --min-p: {a.min_p}"
    if a.tokens is not None and a.tokens > CTX_CAP:
        return f"--tokens ({a.tokens}) exceeds the {CTX_CAP} token context cap"
    if a.ctx is not None and a.ctx > CTX_CAP:
        return f"--ctx ({a.ctx}) exceeds the {CTX_CAP} token context cap"
    hard, soft = a.hard_limit_reply_budget, a.soft_limit_reply_budget
    if hard is not None and a.tokens is not None and hard >= a.tokens:
        return f"--hard-limit-reply-budget ({hard}) must be smaller than --tokens ({a.tokens})"
    if soft is not None:
        from .thinkclose import default_budgets

        eff_hard = default_budgets(a.tokens or 16000, soft, hard)[1]
        if soft < eff_hard:
            return f"--soft-limit-reply-budget ({soft}) must be >= --hard-limit-reply-budget ({eff_hard})"
    if a.retry_incomplete and not a.trace:
        return "--retry-incomplete needs --trace FILE"
    if a.max_drop < 0:
        return f"invalid value for --max-drop: {a.max_drop}"
    if a.max_drop and not a.baseline:
        return "--max-drop needs --baseline FILE.json"
    return None


def _thinking(a: argparse.Namespace) -> str | None:
    """`a.thinking` / `a.think_max` from the ds4 thinking flags.  The in-process
    backend renders DeepSeek V4 prompts, so numeric levels only go to an endpoint
    (as reasoning_effort); Think Max needs --ctx >= 393216 (an auto-sized context is
    the largest prompt + budget), else normal thinking with ds4's warning."""
    from ..cli.think_flags import THINK_MAX_MIN_CONTEXT, downgrade_notice

    think = getattr(a, "think", "high")
    a.think_level = None
    if isinstance(think, int):
        if not a.endpoint:
            return (
                "--think-level requires a DeepSeek V4.1 model (ds4-eval renders DeepSeek V4 prompts here; "
                "use --endpoint with a V4.1 server)"
            )
        a.think_level = think
    a.thinking = think not in ("none", 0)
    a.think_max = think == "max" and a.ctx is not None and a.ctx >= THINK_MAX_MIN_CONTEXT
    if think == "max" and not a.think_max:
        print(f"ds4-eval: warning: {downgrade_notice('--think-max', a.ctx or 0)}", file=sys.stderr)
    return None


def list_cases(cases: list[dict[str, Any]]) -> None:
    print(f"{'#':>3} {'source':<14} {'kind':<16} {'answer':<14} {'domain':<28} id / title")
    for c in cases:
        print(
            f"{c['index']:>3} {c['source']:<14} {c['answer_kind']:<16} {str(c['answer'])[:14]:<14} "
            f"{c['domain'][:28]:<28} {c['id']}  {c['title']}"
        )
    print(f"{len(cases)} cases")


def make_backend(kind: str, **kw: Any):
    """The eval backend `kind` (fake | endpoint | mlx); imported on demand, so only the
    mlx backend loads MLX."""
    from .backends import EndpointBackend, FakeBackend

    if kind == "fake":
        return FakeBackend(kw.get("script"))
    if kind == "endpoint":
        return EndpointBackend(
            kw["url"],
            kw.get("api_key"),
            kw.get("model_name"),
            kw.get("temperature", 0.0),
            kw.get("top_p", 1.0),
            kw.get("min_p", 0.05),
            continuation=kw.get("continuation", "none"),
        )
    from .inprocess import InProcessBackend

    return InProcessBackend(
        kw.get("model"),
        temperature=kw.get("temperature", 0.0),
        top_p=kw.get("top_p", 1.0),
        min_p=kw.get("min_p", 0.05),
        stream=kw.get("stream"),
        spec_args=kw.get("spec_args"),
        chat_template=kw.get("chat_template"),
    )


def _backend(a: argparse.Namespace):
    kind = a.backend or ("endpoint" if a.endpoint else "mlx")
    if kind == "fake":
        script: dict[str, Any] = {}
        if a.fake_script:
            with open(a.fake_script, encoding="utf-8") as f:
                script = json.load(f)
        return make_backend("fake", script=script)
    sampling = {"temperature": a.temp, "top_p": a.top_p, "min_p": a.min_p}
    if kind == "endpoint":
        if not a.endpoint:
            raise SystemExit(_fail("--backend endpoint needs --endpoint URL"))
        if a.chat_template != M.CHAT_TEMPLATE_DS4:
            raise SystemExit(
                _fail(
                    "--chat-template is for the in-process model; a server renders with its own (serve --chat-template)"
                )
            )
        return make_backend(
            "endpoint",
            url=a.endpoint,
            api_key=a.api_key,
            model_name=a.model,
            continuation=a.endpoint_continuation,
            **sampling,
        )
    from ..experts.cli import config_from_args

    stream = config_from_args(a)
    return make_backend("mlx", model=a.model, stream=stream, spec_args=a, chat_template=a.chat_template, **sampling)


def _carry_over(runner: Any, path: str) -> None:
    """--retry-incomplete: mark the cases with a complete PASSED/FAILED record as done.
    Only reads the trace; the run appends to it and never rewrites it."""
    from .trace import completed_records, parse_trace

    try:
        with open(path, "rb") as f:
            done = completed_records(parse_trace(f.read()))
    except FileNotFoundError:
        return
    for cr in runner.runs:
        rec = done.get((cr.case["source"], cr.case["id"]))
        if rec is not None:
            cr.status, cr.picked = rec.status, rec.picked
            cr.prompt_tokens = rec.int_field("prompt_tokens")
            cr.generated = rec.int_field("generated_tokens")
            cr.elapsed = rec.float_field("elapsed_sec")
            cr.carried = rec.raw


def _demo(a: argparse.Namespace) -> bool:
    """The in-process backend on the demo model."""
    kind = getattr(a, "backend", None) or ("endpoint" if a.endpoint else "mlx")
    return kind == "mlx" and _demo_model(a.model)


def _demo_model(model) -> bool:
    return model in (None, "demo") or str(model or "").startswith("demo:")


def demo_limit(a: argparse.Namespace) -> None:
    """No --tokens on the demo model: its random weights never end an answer, so the
    demo's output limit (said on stderr) instead of the cases' 16000."""
    if a.tokens is None and _demo(a):
        from ..io.demo import DEMO_MAX_TOKENS, limit_notice

        a.tokens = DEMO_MAX_TOKENS
        print(f"ds4-eval: {limit_notice(a.tokens)}", file=sys.stderr)


def _loading_notice(a: argparse.Namespace, backend: Any) -> None:
    """Say what is loading (the screen stayed blank for the whole load) and that the
    default demo model has random weights."""
    if backend.name == "mlx" and _demo_model(a.model):
        print(
            "ds4-eval: no -m MODEL: using the demo model, which has RANDOM weights "
            "(every answer is gibberish; this only exercises the harness)",
            file=sys.stderr,
        )
    if backend.name == "mlx":
        print(f"ds4-eval: loading {a.model or 'the demo model'} ...", file=sys.stderr, flush=True)
    elif backend.name == "endpoint":
        print(f"ds4-eval: using {a.endpoint}", file=sys.stderr, flush=True)


def _writable(path: str, append: bool, what: str) -> str | None:
    """Checked before the model loads, without touching an existing file."""
    if append and os.path.exists(path):
        ok = os.access(path, os.R_OK | os.W_OK)
    else:
        ok = os.access(os.path.dirname(os.path.abspath(path)), os.W_OK)
    return None if ok else f"cannot write {what} '{path}'"


def run(a: argparse.Namespace) -> int:
    if a.self_test_extractors:
        from .selftest import run_self_test

        return run_self_test(sys.stdout)
    if getattr(a, "mtp_timing", False):  # the verify-cost table is generate / chat / bench's
        return _fail("--mtp-timing is not measured by eval (use ds4mlx generate, chat or bench); --mtp drafts here")
    if a.regrade:
        from .trace import regrade_file

        return regrade_file(a.regrade, sys.stdout, sys.stderr)
    if a.validate_cases:
        errors = validate_cases()
        for e in errors:
            print(f"ds4-eval: {e}", file=sys.stderr)
        if errors:
            return 1
        print(
            f"ds4-eval: case data valid ({len(load_cases('core'))} core, {len(load_cases('hard'))} hard, "
            f"{len(load_cases('hard-smoke'))} hard-smoke)"
        )
        return 0
    err = _validate(a) or _thinking(a)
    if err:
        return _fail(err)
    cases = load_cases(a.suite)
    missing = unknown_ids(cases, a.case_id)
    if missing:
        return _fail(f"unknown case id(s) in suite {a.suite}: {', '.join(missing)}")
    cases = select(cases, a.case_id, a.domain, a.source)
    if a.questions is not None:
        if a.questions > len(cases):
            return _fail(f"only {len(cases)} questions are selected")
        cases = cases[: a.questions]
    if not cases:
        return _fail("no case matches the filters")
    if a.list_cases:
        list_cases(cases)
        return 0
    return _run_eval(a, cases)


def _run_eval(a: argparse.Namespace, cases: list[dict[str, Any]]) -> int:
    from .runner import Options, PlainUI, Runner, default_seed, report
    from .trace import TraceWriter

    demo_limit(a)
    opts = Options(
        tokens=a.tokens,
        thinking=a.thinking,
        think_max=a.think_max,
        think_level=a.think_level,
        soft_budget=a.soft_limit_reply_budget,
        hard_budget=a.hard_limit_reply_budget,
        soft_rank=a.soft_limit_think_close_rank,
        temperature=a.temp,
        top_p=a.top_p,
        min_p=a.min_p,
        seed=a.seed or default_seed(),
        ctx=a.ctx,
        trace=a.trace,
        pause_ms=a.pause_ms,
        suite=a.suite,
    )
    if a.trace:
        err = _writable(a.trace, a.retry_incomplete, "trace")
        if err:
            return _fail(err)
    baseline = None
    if a.baseline:
        from .report import read_baseline

        baseline, err = read_baseline(a.baseline)
        if baseline is None:
            return _fail(err)
    if a.report:
        err = _writable(a.report, False, "report")
        if err:
            return _fail(err)
    harness_rc = 2 if baseline is not None else 1  # with --baseline, 1 means only "passes dropped"
    backend = _backend(a)
    runner = Runner(cases, backend, opts)
    if a.retry_incomplete:
        try:
            _carry_over(runner, a.trace)
        except OSError as e:
            return _fail(f"cannot read trace '{a.trace}': {e.strerror}")
    _loading_notice(a, backend)
    try:
        rc = runner.size_context()
        if rc is not None:
            return rc
        backend.open(runner.ctx)
    except KeyboardInterrupt:
        return _fail("interrupted while loading the model", 130)
    except ModelFileError as e:  # a broken model file: one line naming it, exit 2
        return _fail(str(e), EXIT_CODE)
    except (spec_cli.SpecUsageError, UsageError) as e:  # a flag it cannot honour (speculation, template)
        return _fail(str(e), 2)
    except Exception as e:  # noqa: BLE001
        return _fail(f"cannot open the model: {type(e).__name__}: {e}", harness_rc)
    # the trace is touched only now that the model is open: a failed load loses nothing
    if a.trace:
        try:
            opener = TraceWriter.resume if a.retry_incomplete else TraceWriter.create
            runner.trace = opener(a.trace, **runner.header())
        except OSError as e:
            backend.close()
            return _fail(f"cannot open trace '{a.trace}': {e.strerror}", harness_rc)
    use_tui = False
    if not a.plain:
        from .tui import usable

        use_tui = usable(sys.stdout)
    try:
        if use_tui:
            from .tui import TUI

            rc = TUI(runner).run()
        else:
            runner.ui = PlainUI(sys.stdout)
            rc = runner.run()
    except KeyboardInterrupt:
        runner.control.request_quit()
        rc = 130
    finally:
        backend.close()
        sys.stdout.write(report(runner))
        sys.stdout.flush()
        runner.finish_trace()
    return _finish(a, runner, rc, baseline)


def _finish(a: argparse.Namespace, runner: Any, rc: int, baseline: dict[str, Any] | None) -> int:
    """--report and --baseline after the run; the exit code."""
    from .report import build_report, gate, write_json_atomic

    data = build_report(runner)
    if a.report:
        try:
            write_json_atomic(a.report, data)
        except OSError as e:
            return _fail(f"cannot write report '{a.report}': {e.strerror}")
    if baseline is None or rc == 130:
        return rc
    code, lines = gate(data, baseline, a.max_drop)
    for line in lines:
        print(line)
    return code
