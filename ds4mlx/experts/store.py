"""The expert store: routed experts stay in the model file, a bounded cache of
(layer, expert) slices is resident (ds4's --ssd-streaming).

* One `LayerCache` per MoE layer: a slab of `capacity` slots (a `StreamedExperts`
  module), the expert -> slot table, and the policy's per-expert scores.  A layer whose
  whole bank fits the budget is pinned (every expert resident, no host sync).
* `run(x, indices)`: the router's choice is read on the host, the missing experts are
  read from the file once per call (a prefill chunk reads each needed expert once), then
  the family's SwitchGLU gathers from the slab by slot.  A call that needs more experts
  than the layer has slots (prefill) reads the missing ones into a transient bank beside
  the slab and runs once over both (working space: at most one layer's bank); the
  best-scored of them then stay in the cache.  Either way the per-(token, expert) math is
  the resident one.
* Eviction: lowest hit count with recency decay (halved every `HALF_LIFE` calls of the
  layer); never an expert the current group needs.
* A slot update is staged: the new experts are read, converted and evaluated first, then
  the slab and the table change together.  A read that fails (I/O error, short read)
  raises `ExpertReadError` with the cache as it was.
* Prefetch: once layer l's routing is known, a background thread reads the likely
  experts of the next streamed layer (its best-scored non-resident ones) into the page
  cache; it touches no MLX array and no cache state.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..io.atomic_file import atomic_write
from ..io.mapped import release
from .build import build_experts
from .fileread import FileChanged, Identity, OpenFiles, head_digest, reading
from .module import StreamedExperts
from .rows import layer_rows

log = logging.getLogger(__name__)

HALF_LIFE = 64.0  # calls of a layer after which an expert's hit score counts half
PROFILE_FORMAT = "ds4mlx-expert-profile"
LATENCY_WINDOW = 4096  # read latencies kept for the percentiles


class ExpertReadError(RuntimeError):
    """Reading routed experts from the model file failed; the cache is unchanged."""


def file_bytes(value) -> int:
    raw = getattr(value, "raw", None)
    if raw is not None:
        return int(raw.nbytes)
    if hasattr(value, "weight") and hasattr(value, "scales") and hasattr(value, "mode"):
        return file_bytes(value.weight) + file_bytes(value.scales)
    n = getattr(value, "nbytes", None)
    if n is None:
        n = int(np.prod(value.shape, dtype=np.int64)) * np.dtype(value.dtype).itemsize
    return int(n)


def _nbytes(module) -> int:
    return sum(int(a.nbytes) for _, a in tree_flatten(module.parameters()))


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    reads: int = 0
    read_errors: int = 0
    prefetch_reads: int = 0
    preload_done: int = 0
    preload_total: int = 0


class LayerCache:
    def __init__(self, store: ExpertStore, layer: int, banks: dict, n_experts: int, like, capacity: int, first):
        self.store, self.layer, self.banks = store, layer, banks
        self.E, self.capacity = n_experts, capacity
        self.pinned = capacity >= n_experts
        self.like = like
        self.expert_bytes = sum(file_bytes(v) for v in banks.values()) // max(1, n_experts)
        self.slot_of = np.full(n_experts, -1, np.int64)
        self.expert_in = np.full(capacity, -1, np.int64)
        self.score = np.zeros(n_experts, np.float64)
        self.last = np.zeros(n_experts, np.float64)
        self.counts = np.zeros(n_experts, np.int64)  # undecayed, for the profile
        self.tick = 0
        self.next_layer: LayerCache | None = None
        ids = list(range(n_experts)) if self.pinned else [int(first)]
        template = self._read(ids)
        if self.pinned:
            slab = template
        else:
            slab = template  # one expert: widened to `capacity` zeroed slots
            params = {
                k: mx.concatenate([a, mx.zeros((capacity - 1, *a.shape[1:]), a.dtype)])
                for k, a in tree_flatten(slab.parameters())
            }
            from mlx.utils import tree_unflatten

            slab.update(tree_unflatten(list(params.items())))
            mx.eval(slab.parameters())
        self.module = StreamedExperts(slab, self)
        for j, e in enumerate(ids):
            self.slot_of[e], self.expert_in[j] = j, e
        self.slot_bytes = _nbytes(self.module) // capacity

    # ------------------------------------------------------------------ reading
    def _read(self, ids):
        """The experts `ids` as a detached SwitchGLU, or ExpertReadError."""
        st = self.store
        t0 = time.perf_counter()
        try:
            with reading(st.open_files()):  # bounds-checked reads of the file the model was loaded from
                mod = build_experts(
                    st.model, self.layer, self.banks, ids, self.like, st.cast_dtype, st.compute_dtype, st.read_filter
                )
        except Exception as e:
            st.stats.read_errors += 1
            raise ExpertReadError(
                f"expert streaming: reading layer {self.layer} experts {list(ids)} from {st.path} failed: {e}"
            ) from e
        finally:
            for v in self.banks.values():
                release(v)  # the rows were copied: the mapping's pages go back to the kernel
        st.record_read(len(ids) * self.expert_bytes, time.perf_counter() - t0, len(ids))
        return mod

    def load(self, missing, keep) -> None:
        """Make `missing` resident, evicting only experts outside `keep`; all or nothing."""
        if not missing:
            return
        slots = self._victims(len(missing), keep)
        if len(slots) < len(missing):
            raise RuntimeError(f"layer {self.layer}: {len(missing)} experts for {len(slots)} free slots")
        fresh = dict(tree_flatten(self._read(missing).parameters()))
        self._commit(slots, missing, fresh, list(range(len(missing))))

    def _victims(self, n: int, keep) -> list[int]:
        """Up to `n` slots to fill: free ones first, then the lowest decayed scores outside `keep`."""
        keep = set(int(e) for e in keep)
        free = [s for s in range(self.capacity) if self.expert_in[s] < 0]
        victims = [s for s in range(self.capacity) if self.expert_in[s] >= 0 and int(self.expert_in[s]) not in keep]
        victims.sort(key=lambda s: self.decayed(int(self.expert_in[s])))
        return (free + victims)[:n]

    def _commit(self, slots, experts, fresh: dict, rows) -> None:
        """Rows `rows` of the read arrays `fresh` into `slots`; then the table (no read here)."""
        where = mx.array(slots, mx.int32)
        pick = mx.array(rows, mx.int32)
        new = {}
        for name, arr in tree_flatten(self.module.parameters()):
            a = arr
            a[where] = fresh[name][pick]
            new[name] = a
        mx.eval(list(new.values()))
        self.module.set_slab(new)  # commit: slab and table together
        for s, e in zip(slots, experts):
            old = int(self.expert_in[s])
            if old >= 0:
                self.slot_of[old] = -1
            self.expert_in[s], self.slot_of[e] = e, s

    def drop(self) -> None:
        """Forget every cached expert (their bytes came from a file that changed)."""
        if not self.pinned:
            self.slot_of[:] = -1
            self.expert_in[:] = -1

    def decayed(self, e: int) -> float:
        return float(self.score[e] * 0.5 ** ((self.tick - self.last[e]) / HALF_LIFE))

    # ------------------------------------------------------------------ forward
    def run(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.pinned:
            return self.module.slots_forward(x, indices)  # every expert in its own slot
        mx.eval(indices)
        ids = np.array(indices).astype(np.int64)
        need = np.unique(ids)
        self.tick += 1
        for e in need:
            self.score[e] = self.decayed(int(e)) + 1.0
            self.last[e] = self.tick
        self.counts[need] += 1
        resident = [int(e) for e in need if self.slot_of[e] >= 0]
        missing = [int(e) for e in need if self.slot_of[e] < 0]
        self.store.stats.hits += len(resident)
        self.store.stats.misses += len(missing)
        self.store.prefetch_after(self)
        if len(need) <= self.capacity:
            self.load(missing, need)
            return self.module.slots_forward(x, mx.array(self.slot_of.clip(0).astype(np.int32))[indices])
        # more experts than slots (a prefill chunk): the missing ones are read once into a
        # transient bank beside the slab (working space: at most one layer's experts), the
        # call runs over both, then the best-scored of them stay in the cache
        fresh_mod = self._read(missing)
        fresh = dict(tree_flatten(fresh_mod.parameters()))
        both = {k: mx.concatenate([a, fresh[k]]) for k, a in tree_flatten(self.module.parameters())}
        wide = StreamedExperts(fresh_mod, self)
        wide.set_slab(both)
        table = self.slot_of.clip(0).astype(np.int32)
        table[missing] = self.capacity + np.arange(len(missing), dtype=np.int32)
        y = wide.slots_forward(x, mx.array(table)[indices])
        mx.eval(y)
        del wide, both
        best = sorted(need.tolist(), key=lambda e: -self.decayed(int(e)))[: self.capacity]
        admit = [e for e in best if self.slot_of[e] < 0]
        slots = self._victims(len(admit), best)
        admit = admit[: len(slots)]
        if admit:
            pos = {e: j for j, e in enumerate(missing)}
            self._commit(slots, admit, fresh, [pos[e] for e in admit])
        return y

    def likely(self) -> list[int]:
        """Non-resident experts with the best decayed scores (prefetch candidates)."""
        if self.pinned:
            return []
        sc = self.score * 0.5 ** ((self.tick - self.last) / HALF_LIFE)
        cand = [int(e) for e in np.argsort(-sc, kind="stable")[: self.capacity] if sc[e] > 0 and self.slot_of[e] < 0]
        return cand


class ExpertStore:
    """All layers' caches, the budget, the stats, the profile, the prefetch thread."""

    def __init__(self, model, path: str, cast_dtype, compute_dtype, read_filter=None):
        self.model, self.path = model, path
        self.cast_dtype, self.compute_dtype = cast_dtype, compute_dtype
        self.read_filter = read_filter
        self.layers: dict[int, LayerCache] = {}
        self.stats = StoreStats()
        self._lat: list[float] = []
        self._lock = threading.Lock()
        self.profile_path: str | None = None
        self.prefetch = True
        self._pool: ThreadPoolExecutor | None = None
        self._pending = None
        self.budget_line = ""
        self._identity: dict[str, tuple[Identity, bytes]] = {}  # filename -> as loaded, its head digest
        self._changed: set[str] = set()  # files seen changed (their batch failed; checked again next time)

    # ------------------------------------------------------------------ the file
    def open_files(self, hint: bool = False) -> OpenFiles:
        """`hint`: a prefetch's files, which only compare (no cache change from that thread)."""
        return OpenFiles(self._compare_file if hint else self._check_file)

    def _compare_file(self, filename: str, fd: int, now: Identity) -> None:
        with self._lock:
            known = self._identity.get(filename)
            if known is None or known[0] != now or filename in self._changed:
                raise FileChanged(f"{filename} changed since it was loaded")

    def _check_file(self, filename: str, fd: int, now: Identity) -> None:
        """The file behind a read batch is the one loaded, or FileChanged.  The first batch
        that sees a change fails and the cache drops its entries; a later batch reads the
        file again only if it is back as loaded: the same inode and size and the same
        header bytes (restored in place)."""
        with self._lock:
            known = self._identity.get(filename)
            if known is None:  # first read (at load)
                self._identity[filename] = (now, head_digest(fd, now.size))
                return
            loaded, digest = known
            if now == loaded and filename not in self._changed:
                return
            what = loaded.differs(now) or "modified"
            if filename not in self._changed:
                self._changed.add(filename)
                for c in self.layers.values():
                    c.drop()
                log.error(
                    "expert streaming: %s changed since it was loaded (%s); cached experts dropped", filename, what
                )
                raise FileChanged(f"the model file changed since it was loaded ({what})")
            same_file = (now.dev, now.ino, now.size) == (loaded.dev, loaded.ino, loaded.size)
            if same_file and head_digest(fd, now.size) == digest:
                self._identity[filename] = (now, digest)
                self._changed.discard(filename)
                log.warning("expert streaming: %s is back (same inode, size and header): reading it again", filename)
                return
            raise FileChanged(f"the model file changed since it was loaded ({what}); restore it or restart the server")

    @property
    def host_routing(self) -> bool:
        """Whether a forward reads the router's choice on the host (a layer not pinned):
        then the decode step cannot be traced by mx.compile (stepper.py runs it eager)."""
        return any(not c.pinned for c in self.layers.values())

    # ------------------------------------------------------------------ stats
    def record_read(self, nbytes: int, seconds: float, experts: int = 1) -> None:
        """One read of `experts` experts; the latency percentiles are per expert (a
        prefill chunk's read of many and a decode miss of one stay comparable)."""
        with self._lock:
            self.stats.bytes_read += nbytes
            self.stats.reads += 1
            self._lat.append(seconds / max(1, experts))
            if len(self._lat) > LATENCY_WINDOW:
                del self._lat[: len(self._lat) - LATENCY_WINDOW]

    def resident_bytes(self) -> int:
        return sum(_nbytes(c.module) for c in self.layers.values())

    def snapshot(self) -> dict:
        """The numbers `generate` prints, `bench` writes and GET /v1/ds4mlx/stats serves."""
        s = self.stats
        lat = sorted(self._lat)

        def pct(q):
            return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 3) if lat else None

        calls = s.hits + s.misses
        return {
            "resident_bytes": self.resident_bytes(),
            "capacity_experts": sum(c.capacity for c in self.layers.values()),
            "total_experts": sum(c.E for c in self.layers.values()),
            "pinned_layers": sum(c.pinned for c in self.layers.values()),
            "hits": s.hits,
            "misses": s.misses,
            "hit_rate": round(s.hits / calls, 4) if calls else None,
            "bytes_read": s.bytes_read,
            "reads": s.reads,
            "read_errors": s.read_errors,
            "read_ms_p50": pct(0.5),
            "read_ms_p99": pct(0.99),
            "prefetch_reads": s.prefetch_reads,
            "preload_done": s.preload_done,
            "preload_total": s.preload_total,
        }

    def summary_line(self) -> str:
        d = self.snapshot()
        hr = "-" if d["hit_rate"] is None else f"{100 * d['hit_rate']:.1f}%"
        return (
            f"ds4mlx: expert cache: {d['capacity_experts']}/{d['total_experts']} experts resident "
            f"({d['resident_bytes'] / 2**30:.2f} GiB, {d['pinned_layers']} layers pinned), "
            f"hits {d['hits']} misses {d['misses']} ({hr}), read {d['bytes_read'] / 2**20:.1f} MiB, "
            f"read latency per expert p50 {d['read_ms_p50']} ms p99 {d['read_ms_p99']} ms, "
            f"preloaded {d['preload_done']}/{d['preload_total']}"
        )

    # ------------------------------------------------------------------ prefetch
    def prefetch_after(self, cache: LayerCache) -> None:
        nxt = cache.next_layer
        if not self.prefetch or nxt is None:
            return
        ids = nxt.likely()
        if not ids or (self._pending is not None and not self._pending.done()):
            return  # one read ahead at a time; a busy reader skips this hint
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ds4mlx-prefetch")
        banks = nxt.banks

        def warm():
            try:
                with reading(self.open_files(hint=True)):  # read, not mapped: a changed file is an error here
                    layer_rows(banks, ids)  # the file's pages into the page cache; no MLX, no state
                with self._lock:
                    self.stats.prefetch_reads += len(ids)
            except Exception:  # a hint: the real read reports any failure
                pass

        self._pending = self._pool.submit(warm)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.profile_path:
            self.write_profile(self.profile_path)

    # ------------------------------------------------------------------ profile / preload
    def write_profile(self, path: str) -> None:
        doc = {
            "format": PROFILE_FORMAT,
            "version": 1,
            "layers": {
                str(l): {str(e): int(n) for e, n in enumerate(c.counts) if n} for l, c in sorted(self.layers.items())
            },
        }
        with atomic_write(path, "w", temp_path=f"{path}.tmp.{os.getpid()}") as f:
            json.dump(doc, f)

    def preload(self, order: dict[int, list[int]], n: int) -> None:
        """Fill up to `n` slots of each streamed layer with `order[layer]` (hottest first)."""
        todo = {
            l: [e for e in order.get(l, range(c.E)) if c.slot_of[e] < 0][
                : max(0, min(n, c.capacity) - int((c.expert_in >= 0).sum()))
            ]
            for l, c in self.layers.items()
            if not c.pinned
        }
        self.stats.preload_total = sum(len(v) for v in todo.values())
        for l, ids in todo.items():
            c = self.layers[l]
            for e in ids:
                c.load([e], [int(x) for x in c.expert_in if x >= 0])
                self.stats.preload_done += 1


def read_profile(path: str) -> dict[int, list[int]]:
    """{layer: experts, most used first} from a profile a previous run wrote."""
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path}: not a ds4mlx expert profile")
    out = {}
    for l, counts in doc.get("layers", {}).items():
        out[int(l)] = [int(e) for e, _ in sorted(counts.items(), key=lambda kv: (-kv[1], int(kv[0])))]
    return out


__all__ = ["ExpertStore", "LayerCache", "ExpertReadError", "read_profile", "StoreStats"]
