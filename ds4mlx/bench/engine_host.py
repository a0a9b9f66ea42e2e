"""The host's cost per decoded token, path by path: the same greedy decode through bench's
plain loop, the engine with one slot, the engine's batched-session path (two slots, one
stream: the deferred steps of `--batched-session N`) and the HTTP SSE stream.

    python -m ds4mlx.bench.engine_host --gen 256 [--repeat 3] [--profile] [--eos]
    python -m ds4mlx.bench.engine_host --synthetic --layers 20 --ctx 2048 --gen 128 --profile   # a GPU

With the stand-in model (bench/stub_model.py: its forward costs almost nothing) each
path's time per token is its host work; with `--model` (a path, `demo`) or `--synthetic`
the same rows on a real graph (tools/device.sh `engine`).  Per path and token: wall time,
the process's CPU time, the decoding thread's CPU time (bench's main thread, the engine's
worker) and the decode loop's time blocked reading a token; with `--profile` the worker's
cProfile and its Python calls per token.  Where the decoding thread's CPU time is close to
the wall time the path is host-bound; the read wait is only the `.item()` of the loop
(a backend that blocks in `async_eval` instead shows it as wall minus CPU).  Figures:
docs/bench-history.md "Engine host cost per token".
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import threading
import time
import urllib.request

PATHS = ("bench", "engine", "batched", "http")
# per token: wall time, the process's CPU time (every thread, the CPU backend's device work
# included), the decoding thread's CPU time, and the decode loop's time blocked reading a token
COLUMNS = ("wall", "cpu", "decode_thread", "read_wait")


# ---------------------------------------------------------------- one job, timed
def completion_job(prompt: str, ids: list[int], gen: int, ignore_eos: bool):
    """One greedy raw-completion job, as the HTTP adapters build it."""
    from ..engine import Job
    from ..runtime.sampling import SamplingParams

    return Job(
        prompt_text=prompt,
        prompt_ids=list(ids),
        api="completions",
        raw=True,
        max_tokens=gen,
        ignore_eos=ignore_eos,
        params=SamplingParams(temperature=0.0),
    )


class Clocks:
    """Wall, process CPU and the decoding thread's CPU seconds, read at a text delta."""

    def __init__(self, thread_id: int | None = None):
        self.clock = time.pthread_getcpuclockid(thread_id) if thread_id is not None else None
        self.first: tuple | None = None
        self.last: tuple | None = None
        self.deltas = 0

    def tick(self) -> None:
        now = (time.perf_counter(), time.process_time(), time.clock_gettime(self.clock) if self.clock else 0.0)
        self.first, self.last = self.first or now, now
        self.deltas += 1

    def per_token(self, tokens: int) -> tuple[float, float, float]:
        """(wall, process CPU, thread CPU) microseconds per token between the first and last delta."""
        if self.first is None:
            return 0.0, 0.0, 0.0
        return tuple(1e6 * (b - a) / max(tokens - 1, 1) for a, b in zip(self.first, self.last))


def timed_job(engine, job, clocks: Clocks | None = None) -> tuple[float, int, str]:
    """Run `job` through `Engine.generate` (the CLI's consumer): (seconds from its first to
    its last text delta, tokens generated, the text streamed); `clocks` ticks at each delta."""
    from ..engine import Failed
    from ..runtime.events import Finish, TextDelta

    clocks = clocks or Clocks()
    parts = []
    for ev in engine.generate(job):
        if isinstance(ev, TextDelta):
            clocks.tick()
            parts.append(ev.text)
        elif isinstance(ev, Finish):
            secs = clocks.last[0] - clocks.first[0] if clocks.first else 0.0
            return secs, ev.usage.completion_tokens, "".join(parts)
        elif isinstance(ev, Failed):
            raise RuntimeError(f"job failed: {ev}")
    raise RuntimeError("the job ended without a Finish")


def engine_job(engine, prompt: str, ids: list[int], gen: int, ignore_eos: bool) -> tuple[float, int]:
    """One greedy raw-completion job straight into the engine: (seconds from the first to
    the last text delta, tokens generated)."""
    secs, tokens, _ = timed_job(engine, completion_job(prompt, ids, gen, ignore_eos))
    return secs, tokens


def stream(url: str, body: dict, clocks: Clocks | None = None) -> tuple[float, int, str]:
    """A streamed /v1/completions request: (seconds from the first to the last text delta,
    deltas seen, the text); `clocks` ticks at each delta."""
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    clocks = clocks or Clocks()
    parts = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            text = "".join(c.get("text") or "" for c in ev.get("choices", []))
            if text:
                clocks.tick()
                parts.append(text)
    secs = clocks.last[0] - clocks.first[0] if clocks.first else 0.0
    return secs, len(parts), "".join(parts)


# ---------------------------------------------------------------- the paths
class Paths:
    """One model, prompt and decode length; `run(path)` -> (us per token, tokens, text)."""

    def __init__(self, model, tokenizer, ctx: int, gen: int, ignore_eos: bool = True):
        from . import frontier

        self.model, self.tok, self.ctx, self.gen, self.ignore_eos = model, tokenizer, ctx, gen, ignore_eos
        self.ids = frontier.bench_tokens(tokenizer, ctx)
        self.prompt = tokenizer.decode(self.ids)
        self.engines: dict = {}
        self.http = None

    def engine(self, slots: int):
        from ..engine import Engine

        eng = self.engines.get(slots)
        if eng is None:
            eng = Engine(self.model, self.tok, ctx=self.ctx + self.gen + 64, default_max_tokens=self.gen, slots=slots)
            self.engines[slots] = eng
            engine_job(eng, self.prompt, self.ids, 4, True)  # untimed: the session's traces
        return eng

    def job(self):
        return completion_job(self.prompt, self.ids, self.gen, self.ignore_eos)

    def run(self, path: str) -> tuple[tuple, int, str | None]:
        """One decode of `gen` tokens: ((wall, process CPU, decoding thread CPU, blocked on a
        token read) us per token, tokens, the text streamed)."""
        if path == "bench":
            return self.bench()
        eng = self.engine(2 if path == "batched" else 1)
        url = self.server().url if path == "http" else None
        clocks = Clocks(eng.worker_thread_id)
        tokens, wait = eng.stats.decode_tokens, eng.stats.decode_wait_seconds
        if path == "http":  # SSE may carry several tokens a delta: the engine counts them
            _, _, text = stream(url, self.body(), clocks)
        else:
            _, _, text = timed_job(eng, self.job(), clocks)
        n = eng.stats.decode_tokens - tokens
        wait_us = 1e6 * (eng.stats.decode_wait_seconds - wait) / max(n, 1)
        return (*clocks.per_token(n), wait_us), n, text

    def bench(self):
        """bench's probe (frontier.py): the plain decode loop, greedy, EOS banned, after
        two untimed steps; the text is what it decoded."""
        import mlx.core as mx

        from ..runtime.decode import decode_tokens, greedy

        session = self.model.new_session(self.ctx + self.gen + 8)
        first = mx.array(session.prefill(self.ids))
        eos = getattr(self.tok, "eos_id", None)
        plain = decode_tokens(session, first, greedy(first.shape[-1], [] if eos is None else [eos]))
        loop = iter(plain)
        next(loop), next(loop)
        clocks, wait = Clocks(threading.get_ident()), plain.wait_s
        for _ in range(self.gen):
            next(loop)
            clocks.tick()
        return (*clocks.per_token(self.gen), 1e6 * (plain.wait_s - wait) / self.gen), self.gen, None

    def body(self) -> dict:
        return {"prompt": self.prompt, "max_tokens": self.gen, "temperature": 0, "think": False, "stream": True,
                "ignore_eos": self.ignore_eos}  # fmt: skip

    def server(self):
        if self.http is None:
            from ..serve.app import BackgroundServer, make_app

            self.http = BackgroundServer(make_app(self.engine(1))).start()
            stream(self.http.url, {**self.body(), "max_tokens": 4})  # untimed
        return self.http

    def profile(self, path: str, top: int = 30) -> tuple[str, float]:
        """cProfile of the engine worker thread over one job of `path` (engine or batched):
        (its top functions by own and cumulative time, Python calls per token: a count the
        machine's load does not blur)."""
        eng = self.engine(2 if path == "batched" else 1)
        prof = cProfile.Profile()
        eng.run_on_worker(lambda e: prof.enable())  # cProfile follows the thread that enables it
        try:
            timed_job(eng, self.job())
        finally:
            eng.run_on_worker(lambda e: prof.disable())
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).strip_dirs()
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
        return out.getvalue(), stats.total_calls / self.gen

    def close(self) -> None:
        if self.http is not None:
            self.http.stop()
        for eng in self.engines.values():
            eng.close()


def load(args):
    """(model, tokenizer): the stand-in over the real tokenizer, or a real model."""
    if args.synthetic:
        from .synthetic import build_synthetic_v4_flash

        model, tok, info = build_synthetic_v4_flash(layers=args.layers, expert_format=args.expert_format)
        print(f"# {info}", flush=True)
        return model, tok
    if args.model:
        from .. import load as load_model

        return load_model(args.model)
    from ..runtime.tokenizer import Tokenizer
    from . import frontier
    from .stub_model import stub_model

    tok = Tokenizer.default()
    return stub_model(tok, frontier.bench_tokens(tok, 4096)), tok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds4mlx.bench.engine_host")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {', '.join(PATHS)}")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3, help="runs per path (interleaved); the best is reported")
    p.add_argument("--eos", action="store_true", help="EOS and the stop ids live (the loop keeps a step undoable)")
    p.add_argument("--model", help="a model path or `demo` instead of the stand-in")
    p.add_argument("--synthetic", action="store_true", help="the synthetic V4 Flash (bench/synthetic.py)")
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--expert-format", choices=["mlx", "gguf"], default="mlx", help="--synthetic: routed experts")
    p.add_argument("--profile", action="store_true", help="a cProfile of the engine worker per engine path")
    a = p.parse_args(argv)
    paths = [x for x in a.paths.split(",") if x]
    bad = [x for x in paths if x not in PATHS]
    if bad:
        p.error(f"unknown path {bad[0]!r}: expected {', '.join(PATHS)}")
    model, tok = load(a)
    runs = Paths(model, tok, a.ctx, a.gen, ignore_eos=not a.eos)
    try:
        best, failed = measure(runs, paths, a.repeat)
        print("path," + ",".join(f"{c}_us_per_token" for c in COLUMNS) + ",tokens")
        for path in paths:
            if path in best:
                print(f"{path}," + ",".join(f"{x:.1f}" for x in best[path]) + f",{a.gen}", flush=True)
            else:
                print(f"{path},failed: {failed[path]}", flush=True)
        if a.profile:
            for path in (x for x in paths if x in ("engine", "batched") and x in best):
                text, calls = runs.profile(path)
                print(f"# profile: {path}, {calls:.1f} Python calls per token on the worker\n{text}", flush=True)
    finally:
        runs.close()
    return 0


def measure(runs: Paths, paths: list[str], repeat: int) -> tuple[dict, dict]:
    """Each path `repeat` times, interleaved: ({path: the best of each column}, {path: why it
    failed}).  A path fails on an exception, a short decode or text other than its own
    earlier run's or the other engine paths' (the HTTP prompt is text, tokenized again: it
    may split otherwise, so HTTP is held to its own text only)."""
    best: dict[str, tuple] = {}
    failed: dict[str, str] = {}
    texts: dict[str, str] = {}
    for _ in range(max(1, repeat)):
        for path in (x for x in paths if x not in failed):
            try:
                us, n, text = runs.run(path)
            except Exception as e:  # noqa: BLE001 - reported in its row, the other paths go on
                failed[path] = f"{type(e).__name__}: {e}"
                continue
            if n != runs.gen:
                failed[path] = f"{n} tokens, expected {runs.gen}"
                continue
            if text is not None:
                want = texts.setdefault(path if path == "http" else "engine paths", text)
                if want != text:
                    failed[path] = "other text than an earlier run"
                    continue
            best[path] = tuple(min(x, y) for x, y in zip(best.get(path, us), us))
    for path in failed:
        best.pop(path, None)
    return best, failed


if __name__ == "__main__":
    sys.exit(main())
