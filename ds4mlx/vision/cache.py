"""Bounded LRU cache of encoder outputs, keyed by the exact decoded image bytes.

The same image sent again (a retry, a later turn quoting it) skips the ViT.  The key is
the bytes themselves, never a client-supplied hash; only successful encodings are kept;
an entry counts its key bytes and its rows toward the byte budget.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

MAX_ENTRIES = 32
MAX_BYTES = 128 * 1024 * 1024


class EncoderCache:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        self.max_entries, self.max_bytes = int(max_entries), int(max_bytes)
        self._items: OrderedDict[bytes, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: bytes):
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: bytes, value, value_bytes: int) -> None:
        size = len(key) + int(value_bytes)
        if size > self.max_bytes:
            return  # larger than the whole budget: not cached
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self._items[key] = (value, size)
            self.nbytes += size
            while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
                _, (_, n) = self._items.popitem(last=False)
                self.nbytes -= n

    def get_or_compute(self, key: bytes, compute: Callable[[], tuple[object, int]]):
        """The cached value, or compute() -> (value, nbytes), kept if it returns."""
        hit = self.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        self.misses += 1
        value, nbytes = compute()
        self.put(key, value, nbytes)
        return value
