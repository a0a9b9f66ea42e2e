"""The disk KV cache's file format: one checkpoint file.

Layout and naming of a file, the header encoder, the key / reason / flag
encodings, and the records a parsed file yields (`Entry`, `Checkpoint`).
Pure Python, no MLX.  The directory of such files (listing, lookup, eviction,
budget, sidecar metadata) is `kvstore.py`.

File format (all integers little-endian)::

    [0..48)       fixed header (below; the ds4 48-byte layout)
    [48..52)      u32 key byte count K (> 0)
    [52..52+K)    key text: the rendered text of the stored tokens (UTF-8 bytes)
    [..+P)        session payload, P = header payload_bytes
    [..+T)        trailer (opaque; present and non-empty iff flag bit0)
    [..+20)       footer:  +0  4s  magic b"KVCF"
                           +4  u64 trailer byte count T
                           +12 u32 CRC-32 of the trailer bytes
                           +16 u32 CRC-32 (zlib) of every file byte before this field

    header:  0 3s "KVC" | 3 u8 version 1 | 4 u8 quant bits | 5 u8 reason
             6 u8 flags (bit0 KTM trailer, bit1 Responses-visible key,
             bit2 thinking-visible key) | 7 u8 reserved 0 | 8 u32 tokens
             12 u32 hits (always written 0) | 16 u32 ctx | 20 u32 model tag
             24 u64 created | 32 u64 last-used (= created) | 40 u64 payload bytes

File name: ``<sha1(key bytes) lower hex>.kv``; temporaries are
``<name>.tmp.<pid>``.

Deviations from ds4 in the format (the store's are listed in kvstore.py):

* bytes 20..24 carry a model tag (first 4 bytes of SHA-1 of the model id,
  little-endian); ds4 leaves them 0.  With tag 0 the header is byte-identical
  to ds4's (spec §3.1 capture, tested).
* a 20-byte footer with CRC-32s: a flipped bit anywhere, a truncation or an
  append is detected; the file size must be exactly 52+K+P+T+20.
"""
from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from typing import Union

# ---------------------------------------------------------------- constants

MAGIC = b"KVC"
VERSION = 1
FOOTER_MAGIC = b"KVCF"
HEADER = struct.Struct("<3sBBBBBIIIIQQQ")  # 48 bytes
KEYLEN = struct.Struct("<I")
FOOTER = struct.Struct("<4sQII")  # 20 bytes
HEADER_SIZE = HEADER.size
FIXED_SIZE = HEADER_SIZE + KEYLEN.size  # 52
FOOTER_SIZE = FOOTER.size
assert HEADER_SIZE == 48 and FOOTER_SIZE == 20

REASONS = ("unknown", "cold", "continued", "evict", "shutdown", "agent-system", "agent-session")
REASON_CODES = {name: code for code, name in enumerate(REASONS)}

FLAG_TOOL_MAP = 1 << 0
FLAG_RESPONSES_VISIBLE = 1 << 1
FLAG_THINKING_VISIBLE = 1 << 2
KEY_KINDS = {"token-text": 0, "responses-visible": FLAG_RESPONSES_VISIBLE,
             "thinking-visible": FLAG_THINKING_VISIBLE}

_KV_NAME = re.compile(r"^[0-9a-fA-F]{40}\.kv$")
_CHUNK = 16 << 20

Buffer = Union[bytes, bytearray, memoryview]
Text = Union[str, bytes, bytearray, memoryview]


# ---------------------------------------------------------------- helpers

def to_bytes(text: Text) -> bytes:
    """Rendered text -> the bytes the cache compares.  `str` is UTF-8 encoded
    (surrogateescape, so a key decoded with `Checkpoint.key_text` round-trips
    even when it ends inside a multi-byte character)."""
    if isinstance(text, str):
        return text.encode("utf-8", "surrogateescape")
    return bytes(text)


def sha1_hex(data: Buffer) -> str:
    return hashlib.sha1(data).hexdigest()


def model_tag(model_id: str) -> int:
    """u32 stored at header bytes 20..24: first 4 bytes of SHA-1(model id)."""
    return int.from_bytes(hashlib.sha1(model_id.encode("utf-8")).digest()[:4], "little")


def reason_code(reason: Union[str, int, None]) -> int:
    if reason is None:
        return 0
    if isinstance(reason, int):
        if not 0 <= reason < len(REASONS):
            raise ValueError(f"unknown KV save reason {reason!r}")
        return reason
    try:
        return REASON_CODES[reason]
    except KeyError:
        raise ValueError(f"unknown KV save reason {reason!r}") from None


def reason_name(code: int) -> str:
    return REASONS[code] if 0 <= code < len(REASONS) else "unknown"


def key_kind(flags: int) -> str:
    if flags & FLAG_RESPONSES_VISIBLE:
        return "responses-visible"
    if flags & FLAG_THINKING_VISIBLE:
        return "thinking-visible"
    return "token-text"


def pack_header(*, quant_bits: int, reason: int, flags: int, tokens: int, hits: int = 0,
                ctx: int, model_tag: int = 0, created_at: int, last_used: int,
                payload_bytes: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, quant_bits, reason, flags, 0, tokens, hits, ctx,
                       model_tag, created_at, last_used, payload_bytes)


def file_size_for(key_bytes: int, payload_bytes: int, trailer_bytes: int = 0) -> int:
    return FIXED_SIZE + key_bytes + payload_bytes + trailer_bytes + FOOTER_SIZE


# ---------------------------------------------------------------- records

@dataclass(frozen=True)
class Entry:
    """One listed checkpoint file (header + footer only; payload unverified)."""
    sha: str
    path: str
    quant_bits: int
    reason_code: int
    flags: int
    tokens: int
    ctx: int
    model_tag: int
    created_at: int
    payload_bytes: int
    key_bytes: int
    trailer_bytes: int
    trailer_crc: int
    file_crc: int
    file_size: int
    hits: int = 0
    last_used: int = 0

    @property
    def reason(self) -> str:
        return reason_name(self.reason_code)

    @property
    def used_at(self) -> int:
        return self.last_used or self.created_at

    @property
    def key_kind(self) -> str:
        return key_kind(self.flags)


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: restore `payload` (it holds the exact `n_tokens`
    token ids), then append tokens(`suffix(prompt)`)."""
    key_bytes: bytes
    n_tokens: int
    payload: bytes
    trailer: bytes | None
    reason: str
    flags: int
    quant_bits: int
    ctx: int
    hits: int
    created_at: int
    sha: str
    path: str

    @property
    def key_text(self) -> str:
        return self.key_bytes.decode("utf-8", "surrogateescape")

    @property
    def key_kind(self) -> str:
        return key_kind(self.flags)

    @property
    def has_tool_map(self) -> bool:
        return bool(self.flags & FLAG_TOOL_MAP)

    def suffix(self, prompt_text: Text) -> str:
        """The part of the prompt after the key, to be tokenized and appended.
        Decoded with surrogateescape when the key ends inside a character."""
        return self.suffix_bytes(prompt_text).decode("utf-8", "surrogateescape")

    def suffix_bytes(self, prompt_text: Text) -> bytes:
        pb = to_bytes(prompt_text)
        if not pb.startswith(self.key_bytes):
            raise ValueError("prompt does not start with the checkpoint key")
        return pb[len(self.key_bytes):]


class _Invalid(Exception):
    pass
