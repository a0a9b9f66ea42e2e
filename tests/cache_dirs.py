"""Where the suite keeps what it builds across runs (transformers oracles, g++ emulation
executables): `$DS4MLX_TEST_CACHE` (default ~/.cache/ds4mlx-tests), one folder per kind.
Entries are keyed by a hash of what built them and written to a temp name, then renamed."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    root = os.environ.get("DS4MLX_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ds4mlx-tests")
    return Path(root) / kind
