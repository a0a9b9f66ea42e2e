"""The disk KV cache's file format: one checkpoint file.

Layout and naming of a file, the header encoder, the key / reason / flag
encodings, the records a parsed file yields (`Entry`, `Checkpoint`), and the
parse / full verify / write of one file (`parse_file`, `check_header`,
`read_file`, `write_file`).
Pure Python, no MLX.  The directory of such files (listing, lookup, eviction,
budget, sidecar metadata) is `kv/store.py`.

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

Deviations from ds4 in the format (the store's are listed in kv/store.py):

* bytes 20..24 carry a model tag (first 4 bytes of SHA-1 of the model id,
  little-endian); ds4 leaves them 0.  With tag 0 the header is byte-identical
  to ds4's (docs/kv-cache.md §3.1 capture, tested).
* a 20-byte footer with CRC-32s: a flipped bit anywhere, a truncation or an
  append is detected; the file size must be exactly 52+K+P+T+20.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import zlib
from collections.abc import Callable, Sequence
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
KEY_KINDS = {"token-text": 0, "responses-visible": FLAG_RESPONSES_VISIBLE, "thinking-visible": FLAG_THINKING_VISIBLE}

KV_FILE_NAME = re.compile(r"^[0-9a-fA-F]{40}\.kv$")
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


def reason_code(reason: str | int | None) -> int:
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


def pack_header(
    *,
    quant_bits: int,
    reason: int,
    flags: int,
    tokens: int,
    hits: int = 0,
    ctx: int,
    model_tag: int = 0,
    created_at: int,
    last_used: int,
    payload_bytes: int,
) -> bytes:
    return HEADER.pack(
        MAGIC, VERSION, quant_bits, reason, flags, 0, tokens, hits, ctx, model_tag, created_at, last_used, payload_bytes
    )


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
        return pb[len(self.key_bytes) :]


class InvalidCheckpoint(Exception):
    pass


# ---------------------------------------------------------------- one file
#
# `want` is the reader's configuration: any object with `model_tag`,
# `quant_bits`, `ctx` and `cross_quant` (a `KVStore`).  A file that fails a
# structural or compatibility check raises `_Invalid`; the caller deletes it.
# `hook(point)` is called at each step of the write protocol (crash tests).


class NotRegularFile(OSError):
    """A cache-directory entry that is not a plain file (FIFO, directory, device, link)."""


def open_regular(path: str):
    """Open `path` for reading only if it is a regular file, never blocking: a
    FIFO named like a checkpoint would block a plain open() forever, and a
    symlink could point anywhere.  Raises NotRegularFile (an OSError)."""
    import stat

    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if os.path.islink(path):
            raise NotRegularFile("a symbolic link, not a regular file") from None
        raise e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a directory"
                if stat.S_ISDIR(mode)
                else "a socket"
                if stat.S_ISSOCK(mode)
                else "a device"
            )
            raise NotRegularFile(f"{kind}, not a regular file")
        if flags & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def parse_file(path: str, sha: str, want) -> Entry:
    """Header and footer of one file, checked (the payload is not read)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < FIXED_SIZE + FOOTER_SIZE:
            raise InvalidCheckpoint(f"truncated ({size} bytes)")
        head = f.read(FIXED_SIZE)
        f.seek(size - FOOTER_SIZE)
        foot = f.read(FOOTER_SIZE)
    if len(head) != FIXED_SIZE or len(foot) != FOOTER_SIZE:
        raise InvalidCheckpoint("short read")
    return check_header(head, size, foot, path, sha, want)


def check_header(head: bytes, size: int, foot: bytes, path: str, sha: str, want) -> Entry:
    """Structural + compatibility checks on header and footer; raises _Invalid."""
    (magic, version, quant, reason, flags, _r7, tokens, _hits, ctx, tag, created, _last, payload) = HEADER.unpack_from(
        head
    )
    (key_len,) = KEYLEN.unpack_from(head, HEADER_SIZE)
    if magic != MAGIC:
        raise InvalidCheckpoint("bad magic")
    if version != VERSION:
        raise InvalidCheckpoint(f"version {version} != {VERSION}")
    if not 1 <= quant <= 32:
        raise InvalidCheckpoint(f"bad quant bits {quant}")
    if tokens == 0:
        raise InvalidCheckpoint("zero tokens")
    if key_len == 0:
        raise InvalidCheckpoint("empty key")
    if tag != want.model_tag:
        raise InvalidCheckpoint(f"model tag {tag:#010x} != {want.model_tag:#010x}")
    if quant != want.quant_bits and not want.cross_quant:
        raise InvalidCheckpoint(f"quant {quant} != {want.quant_bits}")
    if ctx > want.ctx:
        raise InvalidCheckpoint(f"ctx {ctx} > {want.ctx}")
    if tokens >= ctx:
        raise InvalidCheckpoint(f"tokens {tokens} >= ctx {ctx}")
    fmagic, trailer_len, trailer_crc, file_crc = FOOTER.unpack(foot)
    if fmagic != FOOTER_MAGIC:
        raise InvalidCheckpoint("bad footer magic")
    if size != file_size_for(key_len, payload, trailer_len):
        raise InvalidCheckpoint(f"size {size} != {file_size_for(key_len, payload, trailer_len)}")
    if bool(flags & FLAG_TOOL_MAP) != (trailer_len > 0):
        raise InvalidCheckpoint("trailer flag / length mismatch")
    return Entry(
        sha=sha,
        path=path,
        quant_bits=quant,
        reason_code=reason if reason < len(REASONS) else 0,
        flags=flags,
        tokens=tokens,
        ctx=ctx,
        model_tag=tag,
        created_at=created,
        payload_bytes=payload,
        key_bytes=key_len,
        trailer_bytes=trailer_len,
        trailer_crc=trailer_crc,
        file_crc=file_crc,
        file_size=size,
        hits=0,
        last_used=created,
    )


def read_file(e: Entry, prompt: bytes | None, want) -> Checkpoint:
    """Read and fully verify one file; raises _Invalid."""
    with open_regular(e.path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < FIXED_SIZE + FOOTER_SIZE:
            raise InvalidCheckpoint("truncated")
        head = f.read(FIXED_SIZE)
        crc = zlib.crc32(head)
        f.seek(size - FOOTER_SIZE)
        foot = f.read(FOOTER_SIZE)
        cur = check_header(head, size, foot, e.path, e.sha, want)
        f.seek(FIXED_SIZE)
        key = f.read(cur.key_bytes)
        if len(key) != cur.key_bytes:
            raise InvalidCheckpoint("short key")
        crc = zlib.crc32(key, crc)
        if sha1_hex(key) != e.sha:
            raise InvalidCheckpoint("key does not hash to the file name")
        if prompt is not None and not prompt.startswith(key):
            raise InvalidCheckpoint("key is not a prefix of the prompt")
        payload = f.read(cur.payload_bytes)
        if len(payload) != cur.payload_bytes:
            raise InvalidCheckpoint("short payload")
        mv = memoryview(payload)
        for i in range(0, len(mv), _CHUNK):
            crc = zlib.crc32(mv[i : i + _CHUNK], crc)
        trailer = f.read(cur.trailer_bytes)
        if len(trailer) != cur.trailer_bytes:
            raise InvalidCheckpoint("short trailer")
        crc = zlib.crc32(trailer, crc)
        crc = zlib.crc32(foot[:16], crc)
    if zlib.crc32(trailer) != cur.trailer_crc:
        raise InvalidCheckpoint("trailer checksum mismatch")
    if crc != cur.file_crc:
        raise InvalidCheckpoint("checksum mismatch")
    return Checkpoint(
        key_bytes=key,
        n_tokens=cur.tokens,
        payload=payload,
        trailer=trailer or None,
        reason=cur.reason,
        flags=cur.flags,
        quant_bits=cur.quant_bits,
        ctx=cur.ctx,
        hits=e.hits,
        created_at=cur.created_at,
        sha=e.sha,
        path=e.path,
    )


def write_file(
    tmp: str,
    header: bytes,
    key: bytes,
    parts: Sequence[memoryview],
    trailer: bytes,
    size: int,
    hook: Callable[[str], None],
) -> int:
    """Write one whole file to `tmp` and fsync it; returns the file CRC."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            crc = 0
            for piece in (header, KEYLEN.pack(len(key)), key):
                f.write(piece)
                crc = zlib.crc32(piece, crc)
            hook("key-written")
            for p in parts:
                for i in range(0, p.nbytes, _CHUNK):
                    c = p[i : i + _CHUNK]
                    f.write(c)
                    crc = zlib.crc32(c, crc)
            hook("payload-written")
            f.write(trailer)
            crc = zlib.crc32(trailer, crc)
            foot = FOOTER.pack(FOOTER_MAGIC, len(trailer), zlib.crc32(trailer), 0)[:16]
            crc = zlib.crc32(foot, crc)
            f.write(foot + struct.pack("<I", crc))
            f.flush()
            hook("before-fsync")
            os.fsync(fd)
            if os.fstat(fd).st_size != size:
                raise OSError(f"temporary has {os.fstat(fd).st_size} bytes, want {size}")
    finally:
        os.close(fd)
    return crc
