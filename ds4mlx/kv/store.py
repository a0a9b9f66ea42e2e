"""On-disk KV checkpoints: the disk KV cache (docs/kv-cache.md §3, §4, §6, §7).

Pure Python, no MLX: the store moves opaque session payloads (whatever
`Session.snapshot()` produced) and optional opaque trailers (the KTM tool-id
map) in and out of files; the engine does the snapshot / restore and decides
*when* to save (see `kv/policy.py`).

File format, naming, the records of one file and its parse / verify / write:
`kv/fileformat.py` (its names are re-exported here).  This module is the store: a
directory of such files, lookup, eviction scoring against the budget, and the
sidecar metadata.  Files are immutable after the rename: hit counts and
last-use times live in the sidecar ``kvmeta.json`` (atomically replaced), bound
to a file by (created, file CRC) so a rebuilt file never inherits stale hits.

Deviations from ds4 (documented in the module's report and tests):

* hits / last-used are never rewritten in place (sidecar instead), so a file
  never changes after its atomic rename.
* temporaries are fsync'ed before the rename and the directory after it.
* compatibility = model tag, quant bits (unless ``cross_quant``), ctx ≥ file
  ctx, tokens < ctx; anything failing a check is deleted, never trusted.
* eviction also runs *before* a store (pending entry's context), anchors
  (cold/evict/shutdown) score ×2 and a non-anchor strict key prefix of the
  pending entry is penalised (ds4 later versions / seed); a loaded checkpoint
  is not "consumed" (seed #673).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Union

from ..io.atomic_file import write_bytes_atomic

# The file format's names, re-exported so `kv.store.X` works (the tests use several).
from .fileformat import (
    FIXED_SIZE,
    FLAG_RESPONSES_VISIBLE,
    FLAG_THINKING_VISIBLE,  # noqa: F401
    FLAG_TOOL_MAP,
    FOOTER,
    FOOTER_MAGIC,
    FOOTER_SIZE,
    HEADER,
    HEADER_SIZE,
    KEY_KINDS,
    KEYLEN,
    KV_FILE_NAME,
    MAGIC,
    REASON_CODES,
    REASONS,
    VERSION,
    Buffer,
    Checkpoint,
    Entry,
    InvalidCheckpoint,
    Text,
    check_header,
    file_size_for,
    model_tag,
    open_regular,
    pack_header,
    parse_file,
    read_file,
    reason_code,
    reason_name,
    sha1_hex,
    to_bytes,
    write_file,
)

log = logging.getLogger("ds4mlx.kvstore")

# ---------------------------------------------------------------- constants

DEFAULT_BUDGET_MB = 4096
DEFAULT_MIN_TOKENS = 512
DEFAULT_COLD_MAX_TOKENS = 30000
DEFAULT_CONTINUED_INTERVAL_TOKENS = 10000
DEFAULT_BOUNDARY_TRIM_TOKENS = 32
DEFAULT_BOUNDARY_ALIGN_TOKENS = 2048

HIT_HALF_LIFE_SECONDS = 6 * 60 * 60
MIN_EFFECTIVE_HITS = 0.01
ANCHOR_REASON_SCORE_FACTOR = 2.0
PREFIX_PENALTY_MIN_FACTOR = 0.05
PREFIX_PENALTY_HIT_FACTOR = 0.45

ANCHOR_REASONS = frozenset({REASON_CODES["cold"], REASON_CODES["evict"], REASON_CODES["shutdown"]})

META_NAME = "kvmeta.json"
_TMP_NAME = re.compile(r"^(?:[0-9a-fA-F]{40}\.kv|" + re.escape(META_NAME) + r")\.tmp\.(\d+)$")
_U32 = 0xFFFFFFFF


# ---------------------------------------------------------------- helpers


def budget_required(file_bytes: int) -> int:
    """File size plus 1 % headroom, rounded up (ds4 `kv_cache_budget_required`)."""
    return file_bytes + -(-file_bytes // 100)


def effective_hits(hits: float, used_at: int, now: int) -> float:
    """Hits halve every 6 h since last use; below 0.01 they count as 0."""
    if used_at == 0:
        return 0.0
    eff = float(hits)
    if now > used_at:
        eff *= 2.0 ** (-(now - used_at) / HIT_HALF_LIFE_SECONDS)
        if eff < MIN_EFFECTIVE_HITS:
            eff = 0.0
    return eff


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _chunks(payload) -> list[memoryview]:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        parts = [payload]
    else:
        parts = list(payload)
    return [memoryview(p).cast("B") for p in parts]


# ---------------------------------------------------------------- store


class KVStore:
    """A directory of checkpoint files for one model configuration.

    Every ``<sha>.kv`` file that is corrupt or incompatible with
    (model_id, quant_bits, ctx) is deleted when the store meets it (listing,
    lookup, eviction).  Use one directory per model configuration.
    Thread-safe (one lock); one process per directory.
    """

    def __init__(
        self,
        dir: str,
        budget_bytes: int = DEFAULT_BUDGET_MB << 20,
        model_id: str = "",
        quant_bits: int = 4,
        ctx: int = 0,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        *,
        cross_quant: bool = False,
        clock: Callable[[], float] = time.time,
    ):
        if not model_id:
            raise ValueError("KVStore needs a model_id")
        if not 1 <= quant_bits <= 32:
            raise ValueError(f"quant_bits must be 1..32, got {quant_bits}")
        if not 0 < ctx <= _U32:
            raise ValueError(f"ctx must be a positive u32, got {ctx}")
        if min_tokens <= 0:
            raise ValueError("min_tokens must be > 0")
        self.dir = os.path.abspath(dir)
        self.budget_bytes = int(budget_bytes) if budget_bytes else DEFAULT_BUDGET_MB << 20
        self.model_id = model_id
        self.model_tag = model_tag(model_id)
        self.quant_bits = quant_bits
        self.ctx = ctx
        self.min_tokens = min_tokens
        self.cross_quant = cross_quant
        self.clock = clock
        self._lock = threading.RLock()
        self.load_failures = 0  # checkpoint files a lookup could not read (cache.stats adds them)
        self._meta: dict[str, dict] = {}
        self._skipped: set[tuple[str, str]] = set()
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        with self._lock:
            self._clean_temporaries()
            self._meta = self._load_meta()
            self.evict()
        log.info(
            "KV disk cache %s (budget=%d MiB, cross-quant=%s, min=%d, model=%s, quant=%d, ctx=%d, hit_half_life=%ds)",
            self.dir,
            self.budget_bytes >> 20,
            "accept" if cross_quant else "reject",
            min_tokens,
            model_id,
            quant_bits,
            ctx,
            HIT_HALF_LIFE_SECONDS,
        )

    # -- test hook: called at each step of the write protocol (crash tests)
    def _hook(self, point: str) -> None:
        pass

    def _now(self) -> int:
        return max(0, int(self.clock()))

    def path_for(self, key_text: Text) -> str:
        return os.path.join(self.dir, sha1_hex(to_bytes(key_text)) + ".kv")

    # ------------------------------------------------------------ listing

    def entries(self) -> list[Entry]:
        """Valid, compatible entries (bad files are deleted), sorted by name."""
        with self._lock:
            return self._scan()

    def total_bytes(self) -> int:
        return sum(e.file_size for e in self.entries())

    def has(self, key_text: Text) -> bool:
        """Whether a listed checkpoint with exactly this key exists (lets the
        engine skip a snapshot whose store would be a no-op)."""
        sha = sha1_hex(to_bytes(key_text))
        return any(e.sha == sha for e in self.entries())

    def _scan(self) -> list[Entry]:
        out = []
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            names = []
        seen = set()
        for name in names:
            if not KV_FILE_NAME.match(name):
                if name != META_NAME and not _TMP_NAME.match(name):
                    self._skip_once(name, "not a checkpoint name")
                continue
            path = os.path.join(self.dir, name)
            sha = name[:40].lower()
            try:
                e = parse_file(path, sha, self)
            except InvalidCheckpoint as why:
                self._delete(path, sha, f"rejected: {why}")
                continue
            except FileNotFoundError:
                continue  # vanished since the listing
            except OSError as exc:  # not a regular file, or unreadable: left alone, not listed
                self._skip_once(name, exc.strerror or str(exc))
                continue
            out.append(self._with_meta(e))
            seen.add(sha)
        for sha in list(self._meta):
            if sha not in seen:
                del self._meta[sha]
        return out

    def _skip_once(self, name: str, why: str) -> None:
        """One log line per odd directory entry, however often the directory is scanned."""
        if (name, why) not in self._skipped:
            self._skipped.add((name, why))
            log.warning("kv cache skipping %s: %s", os.path.join(self.dir, name), why)

    def _with_meta(self, e: Entry) -> Entry:
        rec = self._meta.get(e.sha)
        if rec and rec.get("created") == e.created_at and rec.get("crc") == e.file_crc:
            return replace(e, hits=int(rec.get("hits", 0)), last_used=int(rec.get("last_used", e.created_at)))
        return e

    # ------------------------------------------------------------ reading

    def verify(self, entry: Entry) -> bool:
        """Fully read and check one entry; a bad file is deleted."""
        with self._lock:
            try:
                read_file(entry, None, self)
                return True
            except InvalidCheckpoint as why:
                self._delete(entry.path, entry.sha, f"rejected: {why}")
                return False
            except OSError:
                return False

    def verify_all(self) -> int:
        """Verify every file (reads everything); returns how many were deleted."""
        with self._lock:
            return sum(not self.verify(e) for e in self._scan())

    def read_trailers(self) -> Iterator[tuple[Entry, bytes]]:
        """(entry, trailer) for every entry with a KTM trailer whose own CRC
        checks out (cheap: reads only the trailer), e.g. to pre-load tool
        memory at startup.  The full-file CRC is checked only on lookup."""
        with self._lock:
            entries = [e for e in self._scan() if e.trailer_bytes]
        for e in entries:
            try:
                with open_regular(e.path) as f:
                    f.seek(e.file_size - FOOTER_SIZE - e.trailer_bytes)
                    data = f.read(e.trailer_bytes)
            except OSError:
                continue
            if len(data) == e.trailer_bytes and zlib.crc32(data) == e.trailer_crc:
                yield e, data
            else:
                with self._lock:
                    self._delete(e.path, e.sha, "rejected: trailer checksum mismatch")

    # ------------------------------------------------------------ lookup

    def lookup(self, prompt_text: Text) -> Checkpoint | None:
        """The checkpoint with the longest key that is a byte prefix of the
        prompt (ties: more tokens, then more recently used), with at least
        `min_tokens` tokens.  Verified in full; a bad file is deleted and the
        next candidate tried.  A hit bumps the persistent hit count."""
        pb = to_bytes(prompt_text)
        with self._lock:
            cands = [e for e in self._scan() if e.key_bytes <= len(pb) and e.tokens >= self.min_tokens]
            if not cands:
                return None
            digests = self._prefix_digests(pb, {e.key_bytes for e in cands})
            cands.sort(key=lambda e: (-e.key_bytes, -e.tokens, -e.used_at, e.sha))
            for e in cands:
                if digests[e.key_bytes] != e.sha:
                    continue
                t0 = time.perf_counter()
                try:
                    cp = read_file(e, pb, self)
                except InvalidCheckpoint as why:
                    self.load_failures += 1
                    self._delete(e.path, e.sha, f"load failed: {why}")
                    continue
                except OSError as exc:
                    self.load_failures += 1
                    log.warning("kv cache load failed %s: %s", e.path, exc)
                    continue
                now = self._now()
                self._meta[e.sha] = {
                    "hits": min(e.hits + 1, _U32),
                    "last_used": now,
                    "created": e.created_at,
                    "crc": e.file_crc,
                }
                self._save_meta()
                log.info(
                    "kv cache hit text tokens=%d text=%d quant=%d key=%s load=%.1f ms file=%s",
                    cp.n_tokens,
                    len(cp.key_bytes),
                    cp.quant_bits,
                    cp.key_kind,
                    (time.perf_counter() - t0) * 1e3,
                    e.path,
                )
                return replace(cp, hits=e.hits + 1)
            return None

    @staticmethod
    def _prefix_digests(pb: bytes, lengths: Iterable[int]) -> dict[int, str]:
        out, h, pos, mv = {}, hashlib.sha1(), 0, memoryview(pb)
        for n in sorted(lengths):
            h.update(mv[pos:n])
            pos = n
            out[n] = h.copy().hexdigest()
        return out

    def discard(self, what: Checkpoint | Entry | str) -> None:
        """Delete a checkpoint (e.g. the session rejected its payload)."""
        path = what if isinstance(what, str) else what.path
        with self._lock:
            self._delete(path, os.path.basename(path)[:40].lower(), "discarded")

    # ------------------------------------------------------------ store

    def fits(self, key_bytes: int, payload_bytes: int, trailer_bytes: int = 0) -> bool:
        return budget_required(file_size_for(key_bytes, payload_bytes, trailer_bytes)) <= self.budget_bytes

    def store(
        self,
        key_text: Text,
        n_tokens: int,
        payload,
        reason: str | int = "unknown",
        trailer: bytes | None = None,
        *,
        key_kind: str = "token-text",
    ) -> str | None:
        """Write a checkpoint of exactly `n_tokens` tokens whose rendered text
        is `key_text` (or a visible transcript, `key_kind`).  `payload` is a
        bytes-like object or a sequence of them.  Returns the path, or None
        when the store was skipped (below min_tokens, over budget, I/O error).
        """
        key = to_bytes(key_text)
        code = reason_code(reason)
        if key_kind not in KEY_KINDS:
            raise ValueError(f"unknown key kind {key_kind!r}")
        if not key or len(key) > _U32:
            raise ValueError("key text must be 1 byte .. 4 GiB")
        parts = _chunks(payload)
        plen = sum(p.nbytes for p in parts)
        if plen == 0:
            raise ValueError("empty payload")
        trailer = bytes(trailer) if trailer else b""
        if n_tokens < self.min_tokens:
            log.debug("kv cache skipped tokens=%d < min %d", n_tokens, self.min_tokens)
            return None
        if not 0 < n_tokens < self.ctx:
            raise ValueError(f"n_tokens {n_tokens} outside 1..ctx-1 ({self.ctx})")
        size = file_size_for(len(key), plen, len(trailer))
        required = budget_required(size)
        if required > self.budget_bytes:
            log.info(
                "kv cache skipped tokens=%d reason=%s size=%d exceeds budget %d",
                n_tokens,
                REASONS[code],
                size,
                self.budget_bytes,
            )
            return None
        sha = sha1_hex(key)
        path = os.path.join(self.dir, sha + ".kv")
        flags = KEY_KINDS[key_kind] | (FLAG_TOOL_MAP if trailer else 0)
        with self._lock:
            t0 = time.perf_counter()
            old = next((e for e in self._scan() if e.sha == sha), None)
            carry_hits = 0
            if old is not None:
                if old.key_bytes == len(key) and (not trailer or self._same_trailer(old, trailer)):
                    now = self._now()
                    self._meta[sha] = {
                        "hits": old.hits,
                        "last_used": now,
                        "created": old.created_at,
                        "crc": old.file_crc,
                    }
                    self._save_meta()
                    log.info(
                        "kv cache store kept existing file tokens=%d reason=%s file=%s", old.tokens, REASONS[code], path
                    )
                    return path
                carry_hits = old.hits
            self.evict_for(size, key, _exclude=sha)
            now = self._now()
            header = pack_header(
                quant_bits=self.quant_bits,
                reason=code,
                flags=flags,
                tokens=n_tokens,
                hits=0,
                ctx=self.ctx,
                model_tag=self.model_tag,
                created_at=now,
                last_used=now,
                payload_bytes=plen,
            )
            tmp = f"{path}.tmp.{os.getpid()}"
            try:
                file_crc = write_file(tmp, header, key, parts, trailer, size, self._hook)
                self._hook("before-rename")
                os.replace(tmp, path)
                _fsync_dir(self.dir)
                self._hook("renamed")
            except OSError as exc:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                log.warning("kv cache store failed tokens=%d reason=%s: %s", n_tokens, REASONS[code], exc)
                return None
            if carry_hits:
                self._meta[sha] = {"hits": carry_hits, "last_used": now, "created": now, "crc": file_crc}
                self._save_meta()
            else:
                self._meta.pop(sha, None)
            self.evict(protected_sha=sha)
            self._hook("evicted")
            log.info(
                "kv cache stored tokens=%d reason=%s key=%s size=%.2f MiB save=%.1f ms",
                n_tokens,
                REASONS[code],
                key_kind,
                size / (1 << 20),
                (time.perf_counter() - t0) * 1e3,
            )
            return path

    def _same_trailer(self, e: Entry, trailer: bytes) -> bool:
        if e.trailer_bytes != len(trailer) or e.trailer_crc != zlib.crc32(trailer):
            return False
        try:
            with open_regular(e.path) as f:
                f.seek(e.file_size - FOOTER_SIZE - e.trailer_bytes)
                return f.read(e.trailer_bytes) == trailer
        except OSError:
            return False

    # ------------------------------------------------------------ eviction

    def score(
        self, e: Entry, now: int | None = None, *, pending_key: bytes | None = None, protected_sha: str | None = None
    ) -> float:
        """Eviction score (lowest is deleted first)."""
        if protected_sha is not None and e.sha == protected_sha:
            return math.inf
        now = self._now() if now is None else now
        eff = effective_hits(e.hits, e.used_at, now)
        s = (eff + 1.0) * e.tokens / e.file_size
        if e.reason_code in ANCHOR_REASONS:
            s *= ANCHOR_REASON_SCORE_FACTOR
        elif pending_key is not None and self._superseded(e, pending_key):
            h = eff / (eff + 1.0)
            s *= PREFIX_PENALTY_MIN_FACTOR + PREFIX_PENALTY_HIT_FACTOR * h
        return s

    def _superseded(self, e: Entry, pending_key: bytes) -> bool:
        """`e`'s key is a strict byte prefix of the pending entry's key and the
        pending entry is at least as reusable (same model/quant, e.ctx >= ctx)."""
        return (
            e.key_bytes < len(pending_key)
            and e.ctx >= self.ctx
            and e.quant_bits == self.quant_bits
            and sha1_hex(memoryview(pending_key)[: e.key_bytes]) == e.sha
        )

    def evict_for(
        self, pending_size: int, pending_key_text: Text | None = None, *, _exclude: str | None = None
    ) -> list[str]:
        """Pre-store eviction: delete until the listed files plus the pending
        file (+1 % headroom) fit the budget.  A pending file that cannot fit
        at all evicts nothing.  Returns the deleted paths."""
        required = budget_required(pending_size)
        if required > self.budget_bytes:
            return []
        key = to_bytes(pending_key_text) if pending_key_text is not None else None
        if _exclude is None and key is not None:
            _exclude = sha1_hex(key)
        with self._lock:
            return self._evict_to(self.budget_bytes - required, pending_key=key, exclude=_exclude)

    def evict(self, protected_sha: str | None = None) -> list[str]:
        """Delete lowest-score files until the total fits the budget; the
        protected file (just stored) is kept unless it alone exceeds the budget."""
        with self._lock:
            return self._evict_to(self.budget_bytes, protected_sha=protected_sha)

    def _evict_to(
        self,
        target: int,
        *,
        pending_key: bytes | None = None,
        protected_sha: str | None = None,
        exclude: str | None = None,
    ) -> list[str]:
        entries = [e for e in self._scan() if e.sha != exclude]
        total = sum(e.file_size for e in entries)
        if protected_sha is not None:
            prot = next((e for e in entries if e.sha == protected_sha), None)
            if prot is not None and prot.file_size > self.budget_bytes:
                protected_sha = None
        now = self._now()
        deleted = []
        while total > target and entries:
            victim = min(
                entries,
                key=lambda e: (
                    self.score(e, now, pending_key=pending_key, protected_sha=protected_sha),
                    e.used_at,
                    e.sha,
                ),
            )
            try:
                os.unlink(victim.path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("kv cache eviction stopped: %s: %s", victim.path, exc)
                break
            self._meta.pop(victim.sha, None)
            entries.remove(victim)
            total -= victim.file_size
            deleted.append(victim.path)
            log.info(
                "kv cache evicted reason=disk-cache-full tokens=%d hits=%d size=%.2f MiB file=%s",
                victim.tokens,
                victim.hits,
                victim.file_size / (1 << 20),
                victim.path,
            )
        if deleted:
            _fsync_dir(self.dir)
        return deleted

    # ------------------------------------------------------------ housekeeping

    def _delete(self, path: str, sha: str, why: str) -> None:
        try:
            os.unlink(path)
            log.warning("kv cache %s: deleted %s", why, path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("kv cache %s: cannot delete %s: %s", why, path, exc)
        if self._meta.pop(sha, None) is not None:
            self._save_meta()

    def _clean_temporaries(self) -> None:
        me = os.getpid()
        for name in os.listdir(self.dir):
            m = _TMP_NAME.match(name)
            if not m:
                continue
            pid = int(m.group(1))
            if pid == me or not _pid_alive(pid):
                try:
                    os.unlink(os.path.join(self.dir, name))
                    log.info("kv cache removed leftover temporary %s", name)
                except OSError:
                    pass

    def _load_meta(self) -> dict[str, dict]:
        try:
            with open_regular(os.path.join(self.dir, META_NAME)) as f:
                doc = json.loads(f.read())
            entries = doc["entries"]
            if doc.get("version") != 1 or not isinstance(entries, dict):
                raise ValueError("bad meta")
            out = {}
            for sha, rec in entries.items():
                if (
                    isinstance(rec, dict)
                    and re.fullmatch(r"[0-9a-f]{40}", sha)
                    and all(
                        isinstance(rec.get(k), int) and rec[k] >= 0 for k in ("hits", "last_used", "created", "crc")
                    )
                ):
                    out[sha] = rec
            return out
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("kv cache ignoring unreadable %s: %s", META_NAME, exc)
            return {}

    def _save_meta(self) -> None:
        path = os.path.join(self.dir, META_NAME)
        data = json.dumps({"version": 1, "entries": self._meta}, sort_keys=True).encode()
        try:
            write_bytes_atomic(
                path,
                data,
                temp_path=f"{path}.tmp.{os.getpid()}",  # the name open()'s cleanup recognises
                fsync=True,
                permissions=0o600,
                before_replace=lambda: self._hook("meta-before-rename"),
            )
            _fsync_dir(self.dir)
        except OSError as exc:  # the temporary is already removed
            log.warning("kv cache cannot write %s: %s", path, exc)
