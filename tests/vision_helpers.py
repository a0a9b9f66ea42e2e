"""Tiny real images for the vision tests (encoded by Pillow, never hand-written bytes)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def image_bytes(w: int = 40, h: int = 30, fmt: str = "PNG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_uri(data: bytes | None = None, media: str = "image/png") -> str:
    return f"data:{media};base64," + b64(data if data is not None else image_bytes())


def huge_png(w: int = 20000, h: int = 20000) -> bytes:
    """A small PNG whose IHDR claims w x h pixels (CRC fixed up): the size check must
    refuse it from the header, before any decoding."""
    png = bytearray(image_bytes(2, 2))
    assert png[12:16] == b"IHDR"
    png[16:24] = struct.pack(">II", w, h)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    return bytes(png)
