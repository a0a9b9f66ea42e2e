"""Where the time of one prefill chunk goes (`ds4mlx bench --profile-prefill`).

Unlike the decode profile (bench/decode_profile.py), which times each op family
alone, a prefill chunk is long enough (milliseconds per layer) to be timed in
place: one chunk runs through the model with a device barrier (evaluate, then
`mx.synchronize`) at the entry and exit of every op family's module, and each
interval is charged to the innermost family running (exclusive time: the
compressor inside the attention is not counted twice).  The barriers cost a few
microseconds each, a small share of a chunk; the barrier-free chunk is timed
too (`chunk_ms`) and the families' sum set against it.

`host` is the Python time to build one chunk's lazy graph (the model call
returning, before anything is evaluated); a host synchronisation inside the
forward (a `.item()` or an `np.array` of a device value) lands there as well.

`gpu_busy_ms` is the device's kernel time for one more barrier-free chunk under
the CUDA profiler (bench/gpu_timer.py; None where it can not be measured): set
against `chunk_ms` it says how much of the chunk's wall time the GPU is idle
(host work, synchronisations, launch gaps).

The families of the DeepSeek V4 graph (models/deepseek_v4.py): attention (the
projections, sliding window and attention core), compressor (pooling of both
compressors), indexer (index scores and top-k), moe routed experts, moe router,
moe shared expert, hyper-connections (the layer norms folded into them), norms (the final
one), head (hc_head and lm_head), embedding; what runs outside all of them is
`other`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager

OTHER = "other"
ATTENTION = "attention"


class FamilyClock:
    """Exclusive wall time per family, charged at device barriers."""

    def __init__(self, barrier_arrays):
        self._arrays = barrier_arrays  # () -> arrays the forward mutates (the caches)
        self.ms = defaultdict(float)
        self.calls = defaultdict(int)
        self._stack: list[str] = []
        self._mark = None

    def _barrier(self, *values, caches: bool = False) -> None:
        import mlx.core as mx

        mx.eval(list(_arrays_in(values)), *(self._arrays() if caches else ()))
        mx.synchronize()
        now = time.perf_counter()
        self.ms[self._stack[-1] if self._stack else OTHER] += (now - self._mark) * 1e3
        self._mark = now

    def start(self) -> None:
        import mlx.core as mx

        mx.synchronize()
        self._mark = time.perf_counter()

    def stop(self, *values) -> None:
        self._barrier(*values, caches=True)

    def run(self, family: str, fn, *args, **kw):
        if self._stack and self._stack[-1] == family:  # nested call of the same family
            return fn(*args, **kw)
        self._barrier(*args, *kw.values())  # pending work belongs to the enclosing family
        self._stack.append(family)
        try:
            out = fn(*args, **kw)
            # the attention's cache updates (ring, pooled rows) are its own work
            self._barrier(out, caches=family == ATTENTION)
        finally:
            self._stack.pop()
        if out is not None:  # a fast path that declined (returned None) is not a call
            self.calls[family] += 1
        return out


def _arrays_in(values):
    import mlx.core as mx

    for v in values:
        if isinstance(v, mx.array):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from _arrays_in(v)


def family_hooks(inner) -> list[tuple[object, str, object]]:
    """(owner, attribute name, family or {id(instance): family}) of every method to time.

    Class attributes are patched (Python looks special methods up on the type), so
    an identity map restricts a shared class (RMSNorm, nn.Linear) to the instances
    named here; any other instance runs untimed inside its caller's family."""
    from ..kernels import sparse_attention
    from ..models import deepseek_v4 as v4
    from ..models import layers as L

    backbone = inner.model
    hooks: list[tuple[object, str, object]] = [
        (v4.Attention, "forward", ATTENTION),
        (v4.Compressor, "pool", "compressor"),
        (v4.Indexer, "scores", "indexer"),
        (v4.ChunkRows, "mask", "indexer"),  # scores, top-k and the selection masks
        (v4.ChunkRows, "per_query", "indexer"),  # the banded prefill's selection
        (v4.ChunkRows, "kernel", "indexer"),  # the fused-kernel path's selection
        (sparse_attention, "index_scores", "indexer"),
        (sparse_attention, "topk_select", "indexer"),
        (v4.Router, "__call__", "moe router"),
        (L.SwitchGLU, "__call__", "moe routed experts"),
        (L.SwitchGLU, "fused_weighted", "moe routed experts"),
        (L.HyperConnection, "__call__", "hyper-connections"),
        (L.HyperConnection, "after_post", "hyper-connections"),
        (v4, "hc_post", "hyper-connections"),
        (L.HyperHead, "__call__", "head"),
        (type(inner), "head", "head"),  # lm_head (CausalLM.head)
    ]
    shared = {id(layer.mlp.shared_experts): "moe shared expert" for layer in backbone.layers}
    norms = {id(layer.input_layernorm): "norms" for layer in backbone.layers}
    norms.update({id(layer.post_attention_layernorm): "norms" for layer in backbone.layers})
    norms[id(backbone.norm)] = "norms"
    hooks += [
        (type(backbone.layers[0].mlp.shared_experts), "__call__", shared),
        (type(backbone.norm), "__call__", norms),
        (type(backbone.embed_tokens), "__call__", {id(backbone.embed_tokens): "embedding"}),
    ]
    return hooks


@contextmanager
def timed_families(clock: FamilyClock, hooks):
    """Patch every hook to run through `clock`; restore the originals on exit."""

    def wrap(orig, family, is_method):
        def timed(*args, **kw):
            fam = family
            if isinstance(family, dict):
                fam = family.get(id(args[0])) if is_method else None
            if fam is None:
                return orig(*args, **kw)
            return clock.run(fam, orig, *args, **kw)

        return timed

    with ExitStack() as stack:
        for owner, name, family in hooks:
            if isinstance(owner, type):  # patch the class that defines it (subclasses inherit the patch)
                owner = next((c for c in owner.__mro__ if name in c.__dict__), None)
                if owner is None or owner.__module__.startswith("mlx."):
                    continue  # never patch MLX's own base classes
                orig = owner.__dict__[name]
            else:
                orig = getattr(owner, name)
            setattr(owner, name, wrap(orig, family, isinstance(owner, type)))
            stack.callback(setattr, owner, name, orig)
        yield


def _chunk(inner, session, ids, clock=None) -> tuple[float, float]:
    """Run one chunk through `session`'s caches; (host build seconds, total seconds)."""
    import mlx.core as mx

    arr = mx.array([ids], dtype=mx.int32)
    mx.synchronize()
    t0 = time.perf_counter()
    if clock is not None:
        clock.start()
    logits = inner(arr, session.caches, last_only=True)
    t1 = time.perf_counter()
    if clock is not None:
        clock.stop(logits)
    mx.eval(logits, *session.cache_arrays())
    mx.synchronize()
    return t1 - t0, time.perf_counter() - t0


def profile_prefill(model, tokens: list[int], ctx: int, chunk: int, repeats: int = 2) -> dict:
    """Prefill `ctx` tokens in chunks of `chunk`, then time chunks at that depth.

    `tokens` needs ctx + (2 * repeats + 1) * chunk entries, one chunk more where the GPU's
    busy time can be measured.  Chunk k after ctx runs at depth ctx + k * chunk: one
    warm-up (first-use kernel compilation), `repeats` plain chunks (the median is
    `chunk_ms`, its graph build `host`), then the busy-time chunk where measured, then
    `repeats` instrumented ones (families summed over them, divided by `repeats`)."""
    import mlx.core as mx

    from . import gpu_timer

    inner = model.model
    busy_chunks = 1 if gpu_timer.unavailable() is None else 0
    need = ctx + (2 * repeats + 1 + busy_chunks) * chunk
    if len(tokens) < need:
        raise ValueError(f"profile_prefill needs {need} tokens, got {len(tokens)}")
    session = model.new_session(ctx=need + 1, chunk=chunk)
    if ctx:
        session.prefill(tokens[:ctx])
    pos = ctx
    _chunk(inner, session, tokens[pos : pos + chunk])  # warm-up
    pos += chunk
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    plain = []
    for _ in range(repeats):
        plain.append(_chunk(inner, session, tokens[pos : pos + chunk]))
        pos += chunk
    peak = mx.get_peak_memory()
    busy = None
    if busy_chunks:
        busy = gpu_timer.busy_ms(lambda: _chunk(inner, session, tokens[pos : pos + chunk]), 1)
        pos += chunk
    clock = FamilyClock(session.cache_arrays)
    hooks = family_hooks(inner)
    with timed_families(clock, hooks):
        for _ in range(repeats):
            _chunk(inner, session, tokens[pos : pos + chunk], clock)
            pos += chunk
    plain.sort(key=lambda hs: hs[1])
    host, total = plain[len(plain) // 2]
    fam = {k: v / repeats for k, v in clock.ms.items()}
    return {
        "chunk": chunk,
        "ctx": ctx,
        "layers": len(inner.model.layers),
        "chunk_ms": total * 1e3,
        "tokens_per_s": chunk / total,
        "host_ms": host * 1e3,
        "gpu_busy_ms": busy,
        "families_ms": fam,
        "instrumented_ms": sum(fam.values()),
        "calls_per_chunk": {k: v // repeats for k, v in clock.calls.items()},
        "peak_memory_bytes": int(peak),
        "chunk_memory_bytes": int(peak - base),  # what one chunk's forward adds at its peak
    }


def format_prefill_profile(p: dict) -> str:
    lines = [
        f"prefill chunk of {p['chunk']} tokens at ctx {p['ctx']}, {p['layers']} layers: "
        f"{p['chunk_ms']:.1f} ms per chunk = {p['tokens_per_s']:.0f} t/s; "
        f"peak memory {p['peak_memory_bytes'] / 2**30:.2f} GiB ({p['chunk_memory_bytes'] / 2**30:.2f} GiB for the chunk)",
        "| op family | ms / chunk | share of the instrumented chunk | calls |",
        "|---|---:|---:|---:|",
    ]
    total = max(p["instrumented_ms"], 1e-9)
    for k, v in sorted(p["families_ms"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {k} | {v:.1f} | {100 * v / total:.0f} % | {p['calls_per_chunk'].get(k, '')} |")
    lines.append(f"| host (graph build, inside the barrier-free chunk) | {p['host_ms']:.1f} | | |")
    busy = p.get("gpu_busy_ms")
    if busy is not None:
        idle = max(0.0, 1 - busy / max(p["chunk_ms"], 1e-9))
        lines.append(f"GPU-busy {busy:.1f} ms of the {p['chunk_ms']:.1f} ms chunk ({100 * idle:.0f} % idle)")
    lines.append(
        f"(instrumented chunk {p['instrumented_ms']:.1f} ms with a device barrier around every family, "
        f"barrier-free chunk {p['chunk_ms']:.1f} ms)"
    )
    return "\n".join(lines)
