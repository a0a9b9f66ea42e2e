"""The per-token cost of structured output: decode tokens per second with and without a
JSON schema, one process, the engine in process (a `Job` as the HTTP adapters build it).

    python tools/structured_cost.py                      # the CPU demo model
    python tools/structured_cost.py --model PATH --jobs 8

Each row sums several sampled jobs (temperature 1, a seed per job) over the same prompt:
`free` (no grammar: the device samples one token ahead of the host) and `json_schema`
(a nested schema of about 45 answer tokens: the host computes llguidance's mask between
steps and the device applies it, docs/http-api.md §10.7).  t/s counts the tokens after
the first of each job over the time from its first text delta to its last.  The mask row
is the host's time in `Constraint.mask` per token (median, p90, and its share of a
constrained step).
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import time
from unittest import mock

from ds4mlx import load
from ds4mlx.engine import Engine, Job
from ds4mlx.runtime.events import Finish, TextDelta
from ds4mlx.runtime.sampling import SamplingParams
from ds4mlx.runtime.structured import Constraint, Grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "age": {"enum": [1, 2, 30]}},
            "required": ["city", "age"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "owner", "tags", "ok"],
    "additionalProperties": False,
}


def run_job(engine, prompt: str, seed: int, gen: int, grammar) -> tuple[float, int]:
    """(seconds from the first to the last text delta, tokens generated)."""
    job = Job(
        prompt_text=prompt,
        api="completions",
        raw=True,
        max_tokens=gen,
        params=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed),
        grammar=grammar,
    )
    q: queue.Queue = queue.Queue()
    engine.submit(job, q.put)
    first = last = None
    while True:
        ev = q.get(timeout=600)
        if isinstance(ev, TextDelta):
            last = time.perf_counter()
            first = first or last
        elif isinstance(ev, Finish):
            return ((last - first) if first else 0.0), ev.usage.completion_tokens
        elif type(ev).__name__ == "Failed":
            raise RuntimeError(f"job failed: {ev}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="demo", help="a model path or `demo` (the random-weight CPU demo)")
    p.add_argument("--jobs", type=int, default=6, help="sampled jobs per row")
    p.add_argument("--gen", type=int, default=64, help="max tokens per job")
    a = p.parse_args()
    model, tok = load(a.model)
    engine = Engine(model, tok, ctx=1024, default_max_tokens=a.gen)
    prompt = "Describe a pet as JSON: "
    mask_s: list[float] = []
    real_mask = Constraint.mask

    def timed_mask(self):
        t = time.perf_counter()
        out = real_mask(self)
        mask_s.append(time.perf_counter() - t)
        return out

    try:
        run_job(engine, prompt, 0, 4, None)  # untimed: the session's traces
        run_job(engine, prompt, 0, 4, Grammar("json_schema", SCHEMA))  # and llguidance's tokenizer
        rows = {}
        for name, grammar in (("free", None), ("json_schema", Grammar("json_schema", SCHEMA))):
            secs = tokens = 0
            with mock.patch.object(Constraint, "mask", timed_mask):
                for seed in range(1, a.jobs + 1):
                    s, n = run_job(engine, prompt, seed, a.gen, grammar)
                    secs, tokens = secs + s, tokens + max(n - 1, 0)
            rows[name] = tokens / secs if secs else 0.0
            print(f"{name},{a.model},tps={rows[name]:.2f},tokens={tokens},jobs={a.jobs}", flush=True)
        step_ms = 1e3 / rows["json_schema"] if rows["json_schema"] else 0.0
        ms = sorted(1e3 * s for s in mask_s[1:])  # the first mask of the first job builds llguidance's caches
        med, p90 = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]
        print(
            f"mask,{a.model},median_ms={med:.3f},p90_ms={p90:.3f},masks={len(ms)},"
            f"share_of_step={med / step_ms:.1%},slowdown={1 - rows['json_schema'] / rows['free']:.1%}",
            flush=True,
        )
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
