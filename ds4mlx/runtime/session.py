"""A live inference session over one model's caches: prefill, decode, snapshot, truncate.

The session is family-independent.  It needs from the model:

* `model(ids [1, T] int32, cache, last_only=True) -> logits [1, 1, V]` (advances `cache`);
* `model.make_cache() -> list` of per-layer cache objects, each with
  `.state` (dict name -> mx.array), `.meta_state` (JSON-able dict),
  `.load(meta, arrays)` (raises ValueError on a layout mismatch) and `.nbytes`;
* optionally `model.args` (a dataclass) to fingerprint snapshots.

Snapshot format (all integers little-endian):

    8 bytes   magic b"DS4MLXS\\0"
    u32       format version (1)
    u64       header length H
    H bytes   JSON header: model fingerprint, ctx, tokens, per-layer meta, array table
    ...       payload: the logits of the next token, then every cache array, raw bytes
    u32       CRC-32 of everything before it

`restore()` checks magic, version, CRC, fingerprint, ctx, array table and payload
size, and raises ValueError on any mismatch (the session is then left empty).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import zlib
from collections.abc import Callable, Iterable

import mlx.core as mx
import numpy as np

from ..kernels import cuda_cache
from . import stepper
from .prefill_chunk import default_chunk

MAGIC = b"DS4MLXS\x00"
VERSION = 1

_DTYPES = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "int32": mx.int32,
    "int64": mx.int64,
    "uint32": mx.uint32,
    "bool": mx.bool_,
}


def _dtype_name(dt) -> str:
    for name, d in _DTYPES.items():
        if d == dt:
            return name
    raise ValueError(f"cannot serialise dtype {dt}")


def _to_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def _from_bytes(buf: memoryview, name: str, shape) -> mx.array:
    dt = _DTYPES[name]
    if dt == mx.bfloat16:
        return mx.array(np.frombuffer(buf, np.uint16).reshape(shape)).view(mx.bfloat16)
    np_dt = {"bool": np.bool_}.get(name, name)
    return mx.array(np.frombuffer(buf, np_dt).reshape(shape))


def model_fingerprint(model) -> str:
    """A short hash of the model's configuration (its `args` dataclass), or its class name."""
    args = getattr(model, "args", None)
    if args is not None and dataclasses.is_dataclass(args):
        blob = json.dumps(dataclasses.asdict(args), sort_keys=True, default=str)
    else:
        blob = type(model).__name__
    steering = _steering_identity(model)  # a steered model's state is another model's
    if steering:
        blob += "|" + steering
    plan = getattr(model, "distributed_plan", None)  # a rank's shard of the state (distributed/)
    if plan:
        blob += "|" + plan
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _steering_identity(model):
    from .steering import identity

    return identity(model)


@dataclasses.dataclass(frozen=True)
class SessionCheckpoint:
    """An in-memory session state (`Session.checkpoint` / `Session.rollback`)."""

    tokens: tuple
    logits: object  # mx.array | None
    layers: list  # per layer cache: (meta_state, {name: array})

    def __len__(self) -> int:
        return len(self.tokens)


class _ChainRows:
    """What a chained `Session.verify` leaves for `keep_verified`: the rows' states, which
    row the caches hold (`now` tokens of the verify kept), and the arrays that mark the
    caches as untouched since (each step, rollback or restore replaces them)."""

    def __init__(self, base: int, rows: list, logits: mx.array, now: int, cache: list):
        self.base, self.rows, self.logits = base, rows, logits
        self.moved_to(now, cache)

    def moved_to(self, now: int, cache: list) -> None:
        self.now, self._cache = now, cache
        self._mark = [c.static_mark() for c in cache] if all(hasattr(c, "static_mark") for c in cache) else None

    def current(self, cache: list, tokens: int) -> bool:
        if self._mark is None or cache is not self._cache or tokens != self.base + self.now:
            return False
        # (array, offset) per layer: the same array object (a step, even one that writes in
        # place, changes the offset; a commit replaces the array) at the same offset
        return all(a is m[0] and o == m[1] for (a, o), m in ((c.static_mark(), m) for c, m in zip(cache, self._mark)))


class Session:
    """Token list + every cache of a model + the logits of the next token.

    `truncate(n)` recomputes: the sliding-window ring only holds the last
    `sliding_window` rows and the compressors fold tokens into pooled rows, so a
    shorter prefix cannot be recovered from the caches.  It resets and prefills
    `tokens[:n]` again (free when n == len(session), n == 0 just resets).
    """

    def __init__(self, model, ctx: int, chunk: int | None = None):
        chunk = default_chunk() if chunk is None else chunk  # 2048 on a GPU (prefill_chunk.py)
        if ctx <= 0 or chunk <= 0:
            raise ValueError("ctx and chunk must be positive")
        self.model, self.ctx, self.chunk = model, int(ctx), int(chunk)
        self._fingerprint = model_fingerprint(model)
        self.reset()

    # -- state -----------------------------------------------------------------------
    def reset(self) -> None:
        self._cache = self.model.make_cache()
        self._tokens: list = []
        self._logits: mx.array | None = None
        self._undo = None
        self._chain = None  # the last chained verify's rows (keep_verified)

    @property
    def tokens(self) -> list[int]:
        if any(isinstance(t, mx.array) for t in self._tokens):
            self._tokens = [int(t.item()) if isinstance(t, mx.array) else t for t in self._tokens]
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def last_logits(self) -> np.ndarray | None:
        return None if self._logits is None else np.array(self._logits.astype(mx.float32))

    @property
    def nbytes(self) -> int:
        """Bytes held by the caches (allocated capacity, not only live rows)."""
        return sum(c.nbytes for c in self._cache)

    def _room(self, n: int) -> None:
        if len(self._tokens) + n > self.ctx:
            raise ValueError(f"context full: {len(self._tokens)} + {n} tokens > ctx {self.ctx}")

    @property
    def caches(self) -> list:
        """The model's per-layer cache objects (read them; the session owns them)."""
        return self._cache

    def cache_arrays(self) -> list:
        """Every array of every layer cache (to `mx.eval` a restored state)."""
        return [a for c in self._cache for a in c.state.values()]

    # -- evaluation ------------------------------------------------------------------
    def prefill(
        self,
        ids: Iterable[int],
        progress: Callable[[int, int], None] | None = None,
        chunk: int | None = None,
    ) -> np.ndarray:
        """Append `ids` in chunks of `chunk` (default self.chunk); return the last token's logits."""
        ids = [int(t) for t in ids]
        if not ids:
            if self._logits is None:
                raise ValueError("prefill of no tokens on an empty session")
            return self.last_logits
        self._room(len(ids))
        self._chain = None
        chunk = int(chunk or self.chunk)
        total = len(ids)
        for i in range(0, total, chunk):
            part = ids[i : i + chunk]
            with cuda_cache.deferred():  # a chunk's new CUDA kernels compile side by side
                logits = self.model(mx.array([part], dtype=mx.int32), self._cache, last_only=True)[0, -1]
            mx.eval(logits, *self.cache_arrays())
            self._tokens.extend(part)
            self._logits = logits
            if progress is not None:
                progress(i + len(part), total)
        return self.last_logits

    @property
    def can_undo(self) -> bool:
        """Whether `step(..., undoable=True)` works (the model's static decode step)."""
        return stepper.can_undo(self.model)

    def step(self, token, undoable: bool = False) -> mx.array:
        """Feed one token (int or scalar mx.array, possibly lazy); return lazy logits [V].

        No host synchronisation happens here: the caller evaluates the result.  With
        `undoable`, `undo_step()` can take this step back until the next step."""
        self._room(1)
        t = token.reshape(1, 1).astype(mx.int32) if isinstance(token, mx.array) else mx.array([[int(token)]], mx.int32)
        prev = self._logits
        self._chain = None  # the last verify's rows: no longer the session's past (memory back)
        out = stepper.step(self.model, self._cache, t, len(self._tokens), undoable=undoable)
        logits, undo = out if undoable else (out, None)
        self._undo = None if undo is None else (undo, prev)
        self._tokens.append(token if isinstance(token, mx.array) else int(token))
        self._logits = logits
        return logits

    def undo_step(self) -> None:
        """Take back the last `step(..., undoable=True)`: caches, tokens and logits."""
        if getattr(self, "_undo", None) is None:
            raise ValueError("no undoable step to take back")
        undo, prev = self._undo
        self._undo = None
        undo()
        self._tokens.pop()
        self._logits = prev

    def decode(self, token) -> np.ndarray:
        """Feed one token; return its logits (float32 numpy [V])."""
        logits = self.step(token)
        mx.eval(logits)
        return np.array(logits.astype(mx.float32))

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (recomputed by a fresh prefill; see the class doc)."""
        if n < 0 or n > len(self._tokens):
            raise ValueError(f"cannot truncate a {len(self._tokens)}-token session to {n}")
        if n == len(self._tokens):
            return
        keep = self.tokens[:n]
        self.reset()
        if keep:
            self.prefill(keep)

    # -- speculative decoding: several tokens in one forward, exact rollback --------------
    def verify(self, ids) -> mx.array:
        """Feed `ids` (ints, or an int32 mx.array [T], possibly lazy) in ONE forward; return
        the lazy logits [T, V] of every position (row i predicts the token after ids[i]).

        The forward is the static decode step's rows chained (`stepper.step_chain`: the
        T tokens' projections run once, their attention one after another, the decode
        kernels) where the model has it, else the multi-token (prefill) path; either way a
        draft's k tokens cost one pass, and `checkpoint()` before and `rollback()` undo it
        exactly."""
        arr = ids.reshape(1, -1).astype(mx.int32) if isinstance(ids, mx.array) else mx.array([list(ids)], mx.int32)
        n = int(arr.shape[1])
        self._room(n)
        base, chain = len(self._tokens), None
        if stepper.supports_chain(self.model):
            logits, rows = stepper.step_chain(self.model, self._cache, arr, base)
            chain = _ChainRows(base, rows, logits, n, self._cache)
        else:
            logits = self.model(arr, self._cache)[0]
        self._tokens.extend([arr[0, i] for i in range(n)] if isinstance(ids, mx.array) else [int(t) for t in ids])
        self._logits, self._undo = logits[-1], None
        self._chain = chain
        return logits

    def keep_verified(self, n: int) -> bool:
        """Keep only the first n tokens of the last `verify` (1 <= n), without a forward:
        the chained verify left every row's state, and the caches take row n - 1's (the
        state `n` plain steps leave).  False (nothing changed) where there is no such
        state: the verify ran the multi-token forward, or the session moved since (a step,
        a rollback, a restore...); the caller then rolls back and feeds the n tokens again."""
        ch = getattr(self, "_chain", None)
        if ch is None or not ch.current(self._cache, len(self._tokens)) or not 1 <= n <= len(ch.rows):
            return False
        stepper.keep_chain_row(self.model, self._cache, ch.rows, ch.now, n)
        ch.moved_to(n, self._cache)
        del self._tokens[ch.base + n :]
        self._logits, self._undo = ch.logits[n - 1], None
        return True

    def checkpoint(self) -> SessionCheckpoint:
        """This session's state, kept in memory for `rollback` (no host copy: the cache
        arrays are shared until the next step writes, then copied by MLX)."""
        layers = [
            (json.loads(json.dumps(c.meta_state)), {k: mx.array(v) for k, v in c.state.items()}) for c in self._cache
        ]
        return SessionCheckpoint(tuple(self._tokens), self._logits, layers)

    def rollback(self, cp: SessionCheckpoint) -> None:
        """Put the session back exactly where `checkpoint()` found it (every cache kind:
        rings, compressors, indexer rows, recurrent state; tokens and logits)."""
        cache = self.model.make_cache()
        for c, (meta, arrays) in zip(cache, cp.layers):
            c.load(meta, {k: mx.array(v) for k, v in arrays.items()})  # copies: the checkpoint stays reusable
        self._cache, self._tokens, self._logits, self._undo = cache, list(cp.tokens), cp.logits, None
        self._chain = None

    # -- snapshot / restore --------------------------------------------------------------
    def snapshot(self) -> bytes:
        tokens = self.tokens
        arrays: list[tuple[str, mx.array]] = []
        if self._logits is not None:
            arrays.append(("logits", self._logits))
        layers = []
        for i, c in enumerate(self._cache):
            layers.append(c.meta_state)
            arrays.extend((f"{i}/{k}", v) for k, v in c.state.items())
        mx.eval([a for _, a in arrays])
        table, blobs, off = [], [], 0
        for name, a in arrays:
            b = _to_bytes(a)
            table.append(
                {"name": name, "dtype": _dtype_name(a.dtype), "shape": list(a.shape), "offset": off, "nbytes": len(b)}
            )
            blobs.append(b)
            off += len(b)
        header = json.dumps(
            {
                "fingerprint": self._fingerprint,
                "ctx": self.ctx,
                "tokens": tokens,
                "layers": layers,
                "arrays": table,
                "payload_bytes": off,
            }
        ).encode()
        body = b"".join([MAGIC, struct.pack("<IQ", VERSION, len(header)), header, *blobs])
        return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)

    def restore(self, data: bytes) -> None:
        """Replace this session's state by a snapshot (ValueError if it does not fit)."""
        try:
            self._restore(memoryview(data))
        except ValueError:
            self.reset()
            raise
        except Exception as e:  # malformed JSON, bad shapes, ...
            self.reset()
            raise ValueError(f"corrupt session snapshot: {e}") from e

    def _restore(self, data: memoryview) -> None:
        if len(data) < len(MAGIC) + 16 or bytes(data[: len(MAGIC)]) != MAGIC:
            raise ValueError("not a ds4mlx session snapshot")
        (crc,) = struct.unpack("<I", data[-4:])
        if zlib.crc32(data[:-4]) & 0xFFFFFFFF != crc:
            raise ValueError("session snapshot checksum mismatch")
        version, hlen = struct.unpack("<IQ", data[len(MAGIC) : len(MAGIC) + 12])
        if version != VERSION:
            raise ValueError(f"unsupported session snapshot version {version}")
        start = len(MAGIC) + 12
        header = json.loads(bytes(data[start : start + hlen]))
        payload = data[start + hlen : -4]
        if header["fingerprint"] != self._fingerprint:
            raise ValueError("session snapshot was made with a different model")
        tokens = [int(t) for t in header["tokens"]]
        if len(tokens) > self.ctx:
            raise ValueError(f"snapshot holds {len(tokens)} tokens > ctx {self.ctx}")
        if header["payload_bytes"] != len(payload):
            raise ValueError("session snapshot payload size mismatch")
        arrays = {}
        for e in header["arrays"]:
            o, nb = int(e["offset"]), int(e["nbytes"])
            if o < 0 or o + nb > len(payload):
                raise ValueError("session snapshot array out of bounds")
            arrays[e["name"]] = _from_bytes(payload[o : o + nb], e["dtype"], e["shape"])
        cache = self.model.make_cache()
        if len(header["layers"]) != len(cache):
            raise ValueError("layer count mismatch")
        for i, (c, meta) in enumerate(zip(cache, header["layers"])):
            prefix = f"{i}/"
            c.load(meta, {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)})
            if getattr(c, "offset", len(tokens)) != len(tokens):
                raise ValueError("cache offset does not match the token count")
        logits = arrays.get("logits")
        if (logits is None) != (len(tokens) == 0):
            raise ValueError("snapshot logits missing")
        self._cache, self._tokens, self._logits, self._undo = cache, tokens, logits, None


def can_step_together(sessions: list) -> bool:
    """Whether `step_together` runs these sessions in one forward (one model, its
    family batches static steps)."""
    if len(sessions) < 2:
        return False
    model = sessions[0].model
    return all(s.model is model for s in sessions) and stepper.supports_rows(model)


def step_together(sessions: list, tokens: list, undoable: bool = False) -> list[mx.array]:
    """`Session.step` of several sessions in one forward (`can_step_together`): each
    session fed its token, each gets its own lazy logits (equal to its `step`'s)."""
    for s in sessions:
        s._room(1)
    ids = mx.concatenate(
        [
            t.reshape(1, 1).astype(mx.int32) if isinstance(t, mx.array) else mx.array([[int(t)]], mx.int32)
            for t in tokens
        ],
        axis=1,
    )
    outs = stepper.step_rows(
        sessions[0].model, [s._cache for s in sessions], ids, [len(s._tokens) for s in sessions], undoable
    )
    res = []
    for s, token, out in zip(sessions, tokens, outs):
        logits, undo = out if undoable else (out, None)
        s._undo = None if undo is None else (undo, s._logits)
        s._tokens.append(token if isinstance(token, mx.array) else int(token))
        s._logits = logits
        res.append(logits)
    return res
