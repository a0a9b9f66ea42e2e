"""GGUF metadata fields as python values, for every reader of GGUF files (weights.py, the
tokenizer): strings decoded, numeric arrays as lists, float32 values as their shortest
decimal."""

from __future__ import annotations

import gguf
import numpy as np

from .base import to_f32


def field_value(field):
    """A `gguf.ReaderField` as a python value: strings decoded, numeric arrays as
    lists (one np.concatenate instead of one object per element), float32 values
    rounded to their shortest decimal (1e-6 reads back as 1e-6)."""
    V = gguf.GGUFValueType
    main = field.types[0]
    parts = field.parts
    if main == V.STRING:
        return parts[-1].tobytes().decode("utf-8", errors="surrogateescape")
    if main != V.ARRAY:
        v = parts[-1].tolist()[0]
        return to_f32(v) if main == V.FLOAT32 else v
    sub = field.types[-1] if len(field.types) > 1 else None
    if sub is None or not field.data:
        return []
    if len(field.types) > 2:  # nested arrays: gguf flattens them
        return field.contents()
    if sub == V.STRING:
        return [parts[i].tobytes().decode("utf-8", errors="surrogateescape") for i in field.data]
    vals = np.concatenate([parts[i] for i in field.data]).tolist()
    return [to_f32(v) for v in vals] if sub == V.FLOAT32 else vals


def fields_metadata(fields) -> dict:
    """{key: python value} of a reader's fields (the GGUF.* header fields skipped)."""
    return {k: field_value(f) for k, f in fields.items() if not k.startswith("GGUF.") and f.types}
