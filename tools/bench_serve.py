#!/usr/bin/env python3
"""Serving benchmark in the style of vLLM's `benchmark_serving.py`, against a
`ds4mlx serve` (or any OpenAI-compatible `/v1/completions` server).

Each request streams `/v1/completions` with `ignore_eos` (exact output length) and
`stream_options.include_usage`.  Arrivals: `--mode closed` (`--concurrency C`
clients, each sends its next request when the last one ended) or `--mode poisson`
(`--rate R` requests/s, exponential gaps, at most `--concurrency` in flight).
Reported: TTFT, ITL (gap between streamed chunks), TPOT ((e2e - ttft) / (tokens - 1)),
end-to-end latency, each mean / p50 / p90 / p99, and aggregate output tokens/s.
A broken or incomplete stream (status not 200, a chunk that is not JSON, an error
object, no usage, no `[DONE]`, fewer tokens than asked) fails the run: exit 1.

    # a server already running
    python3 tools/bench_serve.py --url http://127.0.0.1:8000 --concurrency 4 --num-prompts 16
    # start one per --batched-session value and print one row each
    python3 tools/bench_serve.py --spawn --slots 1,2,4 --num-prompts 16 --input-len 64 --output-len 32
    python3 tools/bench_serve.py --spawn --slots 8 --serve-args "-m /models/v4.gguf --ctx 8192" --mode poisson --rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import numpy as np

WORDS = (
    "the lighthouse keeper wrote in his log that a storm was coming from the north and the "
    "boats of the village stayed in the harbour while the wind turned the sea white"
).split()


class BrokenStream(Exception):
    pass


@dataclass
class Result:
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def make_prompt(rng: random.Random, n_words: int, i: int) -> str:
    # a distinct head per request, so no request reuses another's live session
    return f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(n_words))


async def one_request(cs: aiohttp.ClientSession, url: str, prompt: str, args) -> Result:
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = Result()
    t0 = time.perf_counter()
    last = None
    done = False
    usage = None
    async with cs.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise BrokenStream(f"HTTP {r.status}: {(await r.text())[:200]}")
        buf = b""
        async for data in r.content.iter_any():
            buf += data
            while b"\n\n" in buf:
                block, buf = buf.split(b"\n\n", 1)
                for line in block.decode("utf-8").split("\n"):
                    if not line.startswith("data: "):
                        continue  # comments (keepalive, queue position)
                    payload = line[len("data: ") :]
                    if payload == "[DONE]":
                        done = True
                        continue
                    try:
                        obj = json.loads(payload)
                    except ValueError:
                        raise BrokenStream(f"chunk is not JSON: {payload[:120]!r}") from None
                    if "error" in obj:
                        raise BrokenStream(f"error event: {obj['error']}")
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if any(c.get("text") for c in obj.get("choices") or ()):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
    res.e2e = time.perf_counter() - t0
    if not done:
        raise BrokenStream("stream ended without [DONE]")
    if usage is None:
        raise BrokenStream("stream carried no usage")
    res.tokens = int(usage.get("completion_tokens", 0))
    res.prompt_tokens = int(usage.get("prompt_tokens", 0))
    if res.tokens != args.output_len:
        raise BrokenStream(f"{res.tokens} tokens generated, {args.output_len} asked (ignore_eos)")
    if last is None:
        raise BrokenStream("no text streamed")
    return res


async def run_bench(url: str, args) -> tuple[list[Result], float]:
    rng = random.Random(args.seed)
    prompts = [make_prompt(rng, args.input_len, i) for i in range(args.num_prompts)]
    limit = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as cs:
        for w in range(args.warmup):  # compile / first-use costs outside the measurement
            await one_request(cs, url, f"Warm-up {w}: " + prompts[0], args)

        async def bounded(p: str) -> Result:
            async with limit:
                return await one_request(cs, url, p, args)

        t0 = time.perf_counter()
        if args.mode == "closed":
            results = await asyncio.gather(*(bounded(p) for p in prompts))
        else:
            gaps = np.random.default_rng(args.seed).exponential(1.0 / args.rate, len(prompts))
            tasks = []
            for p, gap in zip(prompts, gaps):
                tasks.append(asyncio.ensure_future(bounded(p)))
                await asyncio.sleep(float(gap))
            results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def summarize(results: list[Result], duration: float) -> dict:
    def stats(xs) -> dict:
        a = np.asarray([x for x in xs if x is not None], dtype=np.float64) * 1e3  # ms
        if a.size == 0:
            return {"mean": None, "p50": None, "p90": None, "p99": None}
        return {
            "mean": float(a.mean()),
            "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)),
        }

    out_tokens = sum(r.tokens for r in results)
    return {
        "requests": len(results),
        "duration_s": duration,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "output_tps": out_tokens / duration if duration > 0 else 0.0,
        "request_rate": len(results) / duration if duration > 0 else 0.0,
        "ttft_ms": stats(r.ttft for r in results),
        "itl_ms": stats(x for r in results for x in r.itl),
        "tpot_ms": stats(r.tpot for r in results),
        "e2e_ms": stats(r.e2e for r in results),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(slots: int, args):
    port = _free_port()
    cmd = [sys.executable, "-m", "ds4mlx.cli", "serve", "--port", str(port), "--batched-session", str(slots)]
    cmd += shlex.split(args.serve_args)
    log = open(f"{args.log_dir}/bench-serve-{slots}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + args.start_timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"server did not come up in {args.start_timeout}s; see {log.name}")


def fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def print_table(rows: list[tuple[str, dict]]) -> None:
    head = "| run | req | out t/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | TPOT p50/p99 ms | E2E p50/p90/p99 ms |"
    print(head)
    print("|" + "---|" * 7)
    for name, s in rows:
        t, i, p, e = s["ttft_ms"], s["itl_ms"], s["tpot_ms"], s["e2e_ms"]
        print(
            f"| {name} | {s['requests']} | {s['output_tps']:.2f} | "
            f"{fmt(t['p50'])} / {fmt(t['p90'])} / {fmt(t['p99'])} | "
            f"{fmt(i['p50'])} / {fmt(i['p90'])} / {fmt(i['p99'])} | "
            f"{fmt(p['p50'])} / {fmt(p['p99'])} | "
            f"{fmt(e['p50'])} / {fmt(e['p90'])} / {fmt(e['p99'])} |"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: --spawn)")
    ap.add_argument("--spawn", action="store_true", help="start `ds4mlx serve` for each --slots value")
    ap.add_argument("--slots", default="1", help="--batched-session values to spawn, comma separated")
    ap.add_argument("--serve-args", default="", help="extra `ds4mlx serve` arguments (model, ctx, ...)")
    ap.add_argument("--mode", choices=("closed", "poisson"), default="closed")
    ap.add_argument("--concurrency", type=int, default=None, help="clients in flight (default: the slot count)")
    ap.add_argument("--rate", type=float, default=1.0, help="poisson: requests per second")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64, help="prompt words (about as many tokens)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="deepseek-v4-flash")
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--log-dir", default=os.environ.get("OUT", "."))
    ap.add_argument("--json", help="write the summaries here")
    args = ap.parse_args(argv)
    slot_list = [int(x) for x in args.slots.split(",") if x]
    rows = []
    failed = False
    for slots in [None] if args.url else slot_list:
        conc = args.concurrency or slots or 1
        a = argparse.Namespace(**{**vars(args), "concurrency": conc})
        proc = None
        url = args.url
        if url is None:
            proc, url = spawn_server(slots, a)
        name = f"{args.mode} N={slots if slots is not None else '?'} C={conc}"
        try:
            results, duration = asyncio.run(run_bench(url, a))
            rows.append((name, summarize(results, duration)))
        except BrokenStream as e:
            print(f"{name}: broken stream: {e}", file=sys.stderr)
            failed = True
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"run": n, **s} for n, s in rows], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
