"""One error for a model file or folder that cannot be loaded.

Every command that opens a model (serve, generate, chat, eval, bench, convert,
quantize, inspect) reads it inside `reading(path)`: whatever the readers raise
for a broken file (missing, empty, truncated, corrupt header, claimed sizes past
the end, bad config.json, missing tensors) becomes a `ModelFileError` whose one
line names the file and what is wrong; `ds4mlx` prints that line and exits 2
instead of a traceback.  No imports beyond the standard library: cli.py uses it
before any subcommand module is loaded.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_CODE = 2

# What the readers (gguf, safetensors, numpy, json, our own checks) raise for a bad file.
_FILE_FAULTS = (
    OSError,
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    OverflowError,
    MemoryError,
    struct.error,
    UnicodeError,
    EOFError,
)


class ModelFileError(ValueError):
    """A model path that cannot be loaded; str() is one line naming it."""


def one_line(path, exc: BaseException) -> str:
    """`path: what is wrong` in one line (the path once, even if the reader named it)."""
    path = os.fspath(path)
    if isinstance(exc, FileNotFoundError) and not exc.args[1:] and str(exc).strip():
        msg = str(exc)
    elif isinstance(exc, OSError) and exc.strerror:
        msg = exc.strerror
    else:
        msg = str(exc) or type(exc).__name__
    if isinstance(exc, KeyError) and exc.args:
        msg = f"missing {exc.args[0]!r}"
    msg = " ".join(msg.split())
    if path and path not in msg:
        msg = f"{path}: {msg}"
    return msg


@contextmanager
def reading(path) -> Iterator[None]:
    """Turn a reader's failure on `path` into a ModelFileError."""
    try:
        yield
    except ModelFileError:
        raise
    except _FILE_FAULTS as e:
        raise ModelFileError(one_line(path if path is not None else "", e)) from e
