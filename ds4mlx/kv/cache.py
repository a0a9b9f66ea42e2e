"""The disk KV cache wired into the engine (docs/kv-cache.md §2 steps 8–10, §5, §6).

`DiskKVCache` implements the engine's `CacheHooks` with `kv.store.KVStore`
(files) and `kv.policy` (when to save).  Every hook runs on the engine's worker
thread, where the session's MLX stream lives, so `snapshot()` / `restore()`
are safe there.  The engine reuses the live in-memory session first
(steps 1–7); the disk is consulted only on a full live miss.

* evict (step 8): the live session is about to be replaced -> save it whole,
  keyed by the visible transcript of a Responses / thinking binding when one
  describes it, else by its rendered token text.
* disk-text (step 9): the checkpoint whose key is the longest byte prefix of
  the rendered prompt is restored; only tokens(prompt[len(key):]) is
  prefilled.  Its KTM trailer (exact sampled DSML per tool-call id) is loaded
  into tool memory.
* cold (step 10): a prompt with no reuse is prefilled up to the chat anchor
  (or the trimmed / aligned length), saved, then prefilled to the end.
* continued: the whole live session at absolute multiples of the continued
  step (prefill chunks are cut there; checked after each decoded token too,
  except inside a tool call).
* shutdown: the live session at exit (the engine's close path; `ds4mlx serve`
  closes the engine on SIGINT / SIGTERM).

Keys are the exact bytes of the stored tokens (`tokenizer.decode_bytes`); a
cut that would end inside a UTF-8 character is not stored (cold cuts move back
up to 16 tokens to a character boundary), because the suffix after the key
must be tokenized as text.

Tool memory and restarts: the server renders a request (replaying remembered
DSML) *before* the engine looks for a checkpoint, so `preload_tool_memory`
loads the KTM trailers of every checkpoint at startup; without it the first
tool-result request after a restart would render the calls canonically, miss
the checkpoint's key, and prefill from scratch.

Compatibility: the store's model id (`model_identity`) is a fingerprint of
the model configuration and of the weights file identity (resolved path, size,
modification time of the GGUF file or of every file of a Hugging Face
folder), plus the float type the weights were loaded in; the quant bits
(`routed_expert_bits`) are the MLX-quantization bits of the routed experts, or
16 / 32 for float experts (a float16/bfloat16 or float32 model: ds4 only knows
2 and 4, the store accepts 1..32).  A checkpoint from any other model is
deleted when the store meets it; a payload the session rejects anyway (its own
fingerprint / layout checks) is discarded on load.

Debugging: `stats()` (hits, misses, stores per reason, times) is served by
`ds4mlx serve` at `GET /v1/ds4mlx/stats` next to the engine counters
(`prefill_tokens`: prompt tokens actually evaluated).

`python -m ds4mlx.bench.kv bench` measures snapshot / store / lookup + restore
against a re-prefill (BENCHMARKS.md).
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Sequence

from ..chat import markers as M
from ..engine import CacheHooks
from .policy import ContinuedFrontier, KVCacheOptions, cold_save_point, evict_save_len, open_store, shutdown_save_len
from .store import KVStore

log = logging.getLogger("ds4mlx.kvcache")

_COLD_BACKOFF = 16  # tokens a cold cut may move back to end on a UTF-8 character boundary


# ---------------------------------------------------------------- model identity


def _file_identity(path: str) -> list:
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def _weights_identity(path: str | None) -> list:
    if not path:
        return []
    try:
        if os.path.isdir(path):
            names = sorted(
                glob.glob(os.path.join(path, "*.safetensors"))
                + glob.glob(os.path.join(path, "*.gguf"))
                + glob.glob(os.path.join(path, "config.json"))
            )
            return [_file_identity(n) for n in names]
        return [_file_identity(path)]
    except OSError:
        return [os.path.realpath(path)]


def _config_blob(model) -> object:
    config = getattr(model, "config", None)
    if isinstance(config, dict):
        return config
    args = getattr(model, "args", None)
    if args is not None and dataclasses.is_dataclass(args):
        return dataclasses.asdict(args)
    return [type(model).__module__, type(model).__qualname__, getattr(model, "vocab_size", None)]


def _first_float_dtype(model) -> str | None:
    inner = getattr(model, "model", model)
    try:
        from mlx.utils import tree_flatten

        for _, a in tree_flatten(inner.parameters()):
            name = str(a.dtype).rsplit(".", 1)[-1]
            if name.startswith(("float", "bfloat")):
                return name
    except Exception:  # not an MLX module (test doubles)
        pass
    return None


def model_identity(model) -> str:
    """A stable id of this model configuration: config (or args) + weights file
    identity + loaded float type + the session snapshot format (+ the directional
    steering, when one is installed)."""
    from ..runtime import session as _session
    from ..runtime.steering import identity as steering_identity

    fields = {
        "config": _config_blob(model),
        "weights": _weights_identity(getattr(model, "path", None)),
        "dtype": _first_float_dtype(model),
        "snapshot": [_session.MAGIC.hex(), _session.VERSION],
    }
    steering = steering_identity(model)
    if steering:  # only when steered, so unsteered ids stay what they were
        fields["steering"] = steering
    plan = getattr(getattr(model, "model", model), "distributed_plan", None)
    if plan:  # a sharded server's files hold rank 0's shard: another plan refuses them
        fields["distributed"] = plan
    blob = json.dumps(fields, sort_keys=True, default=str)
    return "ds4mlx-" + hashlib.sha1(blob.encode()).hexdigest()[:20]


def routed_expert_bits(model) -> int:
    """Bits of the routed-expert weights: MLX quantization bits, or the GGUF
    block type's bits (IQ2_XXS / Q2_K 2, Q4_K 4, Q8_0 8) when quantized, else 16
    (float16 / bfloat16) or 32 (float32, and unknown models)."""
    inner = getattr(model, "model", model)
    named = getattr(inner, "named_modules", None)
    if named is None:
        return 32
    try:
        modules = named()
    except Exception:
        return 32
    for name, mod in modules:
        if ".experts." not in f".{name}." or not name.endswith(("gate_up_proj", "down_proj", "gate_proj", "up_proj")):
            continue
        bits = getattr(mod, "bits", None)
        if isinstance(bits, int) and bits > 0:
            return bits  # QuantizedSwitchLinear (MLX affine, repacked Q4_K / Q8_0, mlx2 / mlx4)
        qtype = getattr(mod, "qtype", None)
        if qtype is not None:  # GGUFSwitchLinear: the file's blocks (Q2_K, IQ2_XXS, ...)
            name_q = getattr(qtype, "name", str(qtype)).upper()
            return _QTYPE_BITS.get(name_q, next((int(c) for c in name_q if c.isdigit()), 32))
        w = getattr(mod, "weight", None)
        if w is not None:
            dt = str(w.dtype)
            return 16 if ("float16" in dt or "bfloat16" in dt) else 32
    return 32


_QTYPE_BITS = {
    "IQ2_XXS": 2,
    "IQ2_XS": 2,
    "Q2_K": 2,
    "Q3_K": 3,
    "Q4_0": 4,
    "Q4_1": 4,
    "Q4_K": 4,
    "Q5_0": 5,
    "Q5_1": 5,
    "Q5_K": 5,
    "Q6_K": 6,
    "Q8_0": 8,
}


# ---------------------------------------------------------------- the hooks


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    load_failures: int = 0
    stores: dict = dataclasses.field(default_factory=dict)  # reason -> count
    store_skips: int = 0
    last_load_ms: float = 0.0
    last_store_ms: float = 0.0
    tool_ids_loaded: int = 0


class DiskKVCache(CacheHooks):
    """`CacheHooks` over a `KVStore` (see the module doc)."""

    def __init__(self, store: KVStore, opt: KVCacheOptions):
        self.store = store
        self.opt = opt
        self.frontier = ContinuedFrontier(opt)
        self._cold: tuple[int, int | None] | None = None  # (cold length, frontier suppress token)
        self._lock = threading.Lock()
        self._stats = CacheStats()

    @classmethod
    def open(cls, opt: KVCacheOptions, model, ctx: int) -> DiskKVCache | None:
        """The cache for a loaded model, or None when `opt` has no directory."""
        store = open_store(opt, model_id=model_identity(model), quant_bits=routed_expert_bits(model), ctx=ctx)
        return None if store is None else cls(store, opt)

    def for_slot(self) -> DiskKVCache:
        """The hooks for another resident session (`--batched-session`): the same
        store, lock and counters, its own continued-save frontier and cold point."""
        view = copy.copy(self)
        view.frontier = ContinuedFrontier(self.opt)
        view._cold = None
        return view

    # -- helpers ---------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            d = dataclasses.asdict(self._stats)
        d["load_failures"] += getattr(self.store, "load_failures", 0)  # files the lookup could not read
        d["dir"] = self.store.dir
        d["frontier"] = self.frontier.last
        return d

    def preload_tool_memory(self, memory) -> int:
        """Load the KTM trailers of every checkpoint (oldest first, so a newer
        block wins) into tool memory; returns the number of ids loaded."""
        if memory is None or not self.opt.exact_dsml_tool_replay:
            return 0
        n = 0
        for _, data in sorted(self.store.read_trailers(), key=lambda et: (et[0].created_at, et[0].sha)):
            n += memory.load_trailer(data)
        if n:
            log.info("kv cache loaded %d tool ids from checkpoint trailers", n)
        with self._lock:
            self._stats.tool_ids_loaded += n
        return n

    @staticmethod
    def _token_key(engine, tokens: Sequence[int]) -> bytes | None:
        """The exact rendered bytes of `tokens`, or None if they end inside a
        UTF-8 character (the suffix after such a key could not be tokenized)."""
        tk = engine.tokenizer
        dec = getattr(tk, "decode_bytes", None)
        key = dec(tokens) if dec is not None else tk.decode(tokens).encode("utf-8")
        try:
            key.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return key or None

    def _save(self, engine, reason: str, visible: bool = False) -> bool:
        """Store the whole live session (reason `reason`).  True on success
        (including an identical checkpoint already on disk)."""
        s = engine.session
        pos = len(s)
        if pos < self.opt.min_tokens or pos >= self.store.ctx:
            return False
        vis = engine.live_visible_key() if visible else None
        if vis is not None:
            kind, text = vis
            key = text.encode("utf-8", "surrogateescape")
        else:
            kind, key = "token-text", self._token_key(engine, s.tokens)
        if key is None:
            log.info("kv cache skipped tokens=%d reason=%s: key ends inside a character", pos, reason)
            with self._lock:
                self._stats.store_skips += 1
            return False
        trailer = b""
        memory = engine.tool_memory
        if memory is not None and self.opt.exact_dsml_tool_replay:
            trailer = memory.trailer_for_text(key.decode("utf-8", "surrogateescape"))
        if not trailer and self.store.has(key):
            log.info("kv cache store kept existing file tokens=%d reason=%s", pos, reason)
            return True
        t0 = time.perf_counter()
        payload = s.snapshot()
        path = self.store.store(key, pos, payload, reason, trailer or None, key_kind=kind)
        ms = (time.perf_counter() - t0) * 1e3
        with self._lock:
            if path is None:
                self._stats.store_skips += 1
            else:
                self._stats.stores[reason] = self._stats.stores.get(reason, 0) + 1
                self._stats.last_store_ms = round(ms, 3)
        return path is not None

    def save_live(self, engine, reason: str) -> bool:
        """Store the whole live session now under `reason` (the agent's
        "agent-system" / "agent-session" checkpoints).  Worker thread only:
        call it through `Engine.run_on_worker`."""
        return self._save(engine, reason)

    # -- hooks (worker thread) ---------------------------------------------------
    def on_miss(self, engine) -> None:
        """Step 8: save the live session before it is replaced."""
        if evict_save_len(len(engine.session), self.opt) is not None:
            self._save(engine, "evict", visible=True)

    def try_load(self, engine, job):
        """Step 9: restore the best checkpoint; (effective tokens, cached)."""
        self.frontier.reset()
        self._cold = None
        prompt = job.prompt_text
        cp = self.store.lookup(prompt)
        if cp is None:
            with self._lock:
                self._stats.misses += 1
            return None
        t0 = time.perf_counter()
        try:
            suffix = cp.suffix_bytes(prompt).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            log.info("kv cache hit %s ends inside a character: not used", cp.path)
            return None
        s = engine.session
        try:
            s.restore(cp.payload)
            ok = len(s) == cp.n_tokens
            why = f"restored {len(s)} tokens, header says {cp.n_tokens}"
        except Exception as e:  # ValueError from Session; anything from other sessions
            ok, why = False, str(e) or type(e).__name__
        if not ok:
            log.warning("kv cache load failed %s: %s", cp.path, why)
            self.store.discard(cp)
            engine.reset_session()
            with self._lock:
                self._stats.load_failures += 1
            return None
        effective = list(s.tokens) + engine.tokenize(suffix)
        memory = engine.tool_memory
        if cp.trailer and memory is not None and self.opt.exact_dsml_tool_replay:
            n = memory.load_trailer(cp.trailer)
            with self._lock:
                self._stats.tool_ids_loaded += n
        self.frontier.loaded(cp.n_tokens)
        ms = (time.perf_counter() - t0) * 1e3
        log.info(
            "kv cache restored tokens=%d key=%s restore=%.1f ms suffix=%d tokens",
            cp.n_tokens,
            cp.key_kind,
            ms,
            len(effective) - cp.n_tokens,
        )
        with self._lock:
            self._stats.hits += 1
            self._stats.hit_tokens += cp.n_tokens
            self._stats.last_load_ms = round(ms, 3)
        return effective, cp.n_tokens

    def cold_save_point(self, engine, job, effective) -> int:
        """Step 10: where to cut the cold checkpoint (0 = none)."""
        self.frontier.reset()  # the session is rebuilt from nothing
        self._cold = None
        tk = engine.tokenizer
        ids = getattr(tk, "special_ids", {}) or {}
        cs = cold_save_point(effective, self.opt, user_id=ids.get(M.USER), assistant_id=ids.get(M.ASSISTANT))
        if cs is None:
            return 0
        n = cs.n_tokens
        for _ in range(_COLD_BACKOFF):
            if n < self.opt.min_tokens or self._token_key(engine, effective[:n]) is not None:
                break
            n -= 1
        if n < self.opt.min_tokens or self._token_key(engine, effective[:n]) is None:
            return 0
        self._cold = (n, self.frontier.suppress(n))
        return n

    def on_cold_prefix(self, engine, job, n_tokens: int) -> None:
        cold, self._cold = self._cold, None
        token = cold[1] if cold is not None and cold[0] == n_tokens else None
        if self._save(engine, "cold"):
            self.frontier.note(n_tokens)
        else:
            self.frontier.unsuppress(token, n_tokens)

    def prefill_stops(self, engine, job, start: int, end: int) -> Sequence[int]:
        step = self.frontier.step
        if step <= 0:
            return ()
        return range((start // step + 1) * step, end, step)

    def _continued(self, engine) -> None:
        pos = len(engine.session)
        if self.frontier.due(pos) and self._save(engine, "continued"):
            self.frontier.note(pos)

    def on_progress(self, engine, job) -> None:
        self._continued(engine)

    def after_prefill(self, engine, job) -> None:
        self._continued(engine)

    def on_shutdown(self, engine) -> None:
        if shutdown_save_len(len(engine.session), self.opt) is not None:
            self._save(engine, "shutdown", visible=True)
