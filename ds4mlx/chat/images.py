"""Image parts of a request: parsed (Pillow) or refused, never dropped (docs/vision.md §1).

Accepted: inline PNG / JPEG only — an OpenAI `data:image/png|jpeg|jpg;base64,...` URI
(Chat `image_url`, Responses `input_image`) or an Anthropic `{"type": "base64",
"media_type": ..., "data": ...}` source; at most MAX_IMAGES per request.  Refused
with an `ImageError` (the parsers turn it into their 400): a local path, an http(s) /
file / other URL, another media type, base64 that does not decode, bytes Pillow
cannot decode completely as PNG or JPEG, an image above MAX_PIXELS, too many images.
The server never reads the file system or the network on a client's behalf.

Each accepted image is written into the message text as a marker (MARKER_OPEN + a
random nonce + MARKER_CLOSE) at its position; the tokenizer step swaps every marker
for the image's block of image tokens.  Its identity is the SHA-256 of the decoded
bytes (`ImageInput.fingerprint`): the encoder cache and the live-KV reuse key on it,
never on a client-supplied hash or the nonce.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import secrets
import warnings
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

MAX_IMAGES = 16
MAX_BASE64_BYTES = 64 * 1024 * 1024  # the body limit: no single image can be larger
MAX_PIXELS = 40_000_000  # refused before decoding (a 4-byte-per-pixel 40 Mpx image is 160 MB)
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}
DATA_URI = re.compile(r"data:(image/(?:png|jpeg|jpg));base64,", re.IGNORECASE)

# The marker of an image inside rendered text: private-use characters around a random
# nonce (not whitespace: templates trim message text), which no client text reaches the
# prompt with by accident; a literal copy of one is only text, since markers are looked up
# by value in the request's own image list.
MARKER_OPEN = "\ue000DS4MLX_IMAGE_"
MARKER_CLOSE = "\ue001"
MARKER_RE = re.compile(re.escape(MARKER_OPEN) + r"[0-9a-f]{24}" + re.escape(MARKER_CLOSE))

# --- refusal messages (the 400's text on every API) -----------------------------------
ERR_NOT_DATA_URI = (
    "image URL must be an inline data:image/png;base64 or data:image/jpeg;base64 URI; "
    "local paths and http(s) URLs are not fetched"
)
ERR_MEDIA_TYPE = "unsupported image media type {media!r}: only image/png and image/jpeg are accepted"
ERR_SOURCE_TYPE = "unsupported image source type {kind!r}: only base64 sources are accepted"
ERR_BASE64 = "image data is not valid base64"
ERR_BROKEN = "image data is not a complete PNG or JPEG image"
ERR_TOO_LARGE = "image of {w}x{h} pixels exceeds the limit of {limit} pixels"
ERR_TOO_LARGE_UNKNOWN = f"image exceeds the limit of {MAX_PIXELS} pixels"
ERR_TOO_MANY = f"too many images: at most {MAX_IMAGES} per request"
ERR_ROLE = "images are accepted only in user messages and tool results"
ERR_MISSING = "image part without image data"


class ImageError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(eq=False)
class ImageInput:
    data: bytes  # the decoded file bytes (PNG / JPEG)
    media_type: str
    width: int
    height: int
    fingerprint: str  # sha256 hex of `data`
    marker: str = field(default_factory=lambda: MARKER_OPEN + secrets.token_hex(12) + MARKER_CLOSE)

    def image(self) -> Image.Image:
        """The decoded RGB image (decoded again: the parse only keeps the bytes)."""
        with Image.open(io.BytesIO(self.data)) as im:
            return im.convert("RGB")


def decode_base64(text: Any) -> bytes:
    if not isinstance(text, str) or not text:
        raise ImageError(ERR_BASE64)
    if len(text) > MAX_BASE64_BYTES:
        raise ImageError(ERR_BASE64)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(ERR_BASE64) from None


def open_checked(data: bytes) -> tuple[int, int]:
    """(width, height) of bytes Pillow decodes completely as PNG or JPEG; else ImageError.
    (The bytes decide the format: a PNG sent as image/jpeg is still a PNG.)"""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=["PNG", "JPEG"]) as im:
                w, h = im.size
                if w <= 0 or h <= 0:
                    raise ImageError(ERR_BROKEN)
                if w * h > MAX_PIXELS:
                    raise ImageError(ERR_TOO_LARGE.format(w=w, h=h, limit=MAX_PIXELS))
                im.load()  # decodes every byte: truncated or corrupt data fails here
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(ERR_TOO_LARGE_UNKNOWN) from None
    except Exception:  # Pillow reports broken data through many exception types
        raise ImageError(ERR_BROKEN) from None
    return w, h


def from_bytes(data: bytes, media_type: str) -> ImageInput:
    w, h = open_checked(data)
    return ImageInput(data, media_type.lower(), w, h, hashlib.sha256(data).hexdigest())


def from_base64(media_type: Any, text: Any) -> ImageInput:
    """Anthropic's base64 source: media type image/png|jpeg|jpg (any case) + base64 data."""
    if not isinstance(media_type, str) or media_type.lower() not in MEDIA_TYPES:
        raise ImageError(ERR_MEDIA_TYPE.format(media=media_type))
    return from_bytes(decode_base64(text), media_type)


def from_data_uri(url: Any) -> ImageInput:
    """An OpenAI image URL: only data:image/png|jpeg|jpg;base64, URIs."""
    if not isinstance(url, str) or not url:
        raise ImageError(ERR_MISSING)
    m = DATA_URI.match(url)
    if m is None:
        head = url.split(",", 1)[0].lower()
        if head.startswith("data:"):
            media = head[5:].split(";", 1)[0]
            raise ImageError(ERR_MEDIA_TYPE.format(media=media) if ";base64" in head else ERR_NOT_DATA_URI)
        raise ImageError(ERR_NOT_DATA_URI)
    return from_bytes(decode_base64(url[m.end() :]), m.group(1))


def image_url_of(value: Any) -> Any:
    """Chat's `image_url` member: a string or {"url": string, "detail": ...}."""
    return value.get("url") if isinstance(value, dict) else value


def chat_part(part: dict) -> ImageInput:
    """{"type": "image_url", "image_url": {"url": DATA_URI}} (Chat, also in Responses)."""
    return from_data_uri(image_url_of(part.get("image_url")))


def responses_part(part: dict) -> ImageInput:
    """{"type": "input_image", "image_url": DATA_URI} (a file_id is refused as a non-data URI)."""
    return from_data_uri(image_url_of(part.get("image_url")))


def anthropic_block(block: dict) -> ImageInput:
    """{"type": "image", "source": {"type": "base64", "media_type": ..., "data": ...}}."""
    src = block.get("source")
    if not isinstance(src, dict):
        raise ImageError(ERR_MISSING)
    if src.get("type") != "base64":
        raise ImageError(ERR_SOURCE_TYPE.format(kind=src.get("type")))
    return from_base64(src.get("media_type"), src.get("data"))


IMAGE_PART_TYPES = {"image_url": chat_part, "input_image": responses_part, "image": anthropic_block}


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def parse_part(part: dict) -> ImageInput:
    return IMAGE_PART_TYPES[part["type"]](part)


def check_role(role: str) -> None:
    if role not in ("user", "tool", "function"):
        raise ImageError(ERR_ROLE)


def check_count(n: int) -> None:
    if n > MAX_IMAGES:
        raise ImageError(ERR_TOO_MANY)


def conversation_images(messages) -> list[ImageInput]:
    """Every image of the messages, in prompt order."""
    return [im for m in messages for im in getattr(m, "images", ())]


def split_markers(text: str, images: list[ImageInput]) -> list[str | ImageInput]:
    """Rendered text -> text pieces and images, in order.  Only the markers of `images`
    count; any other marker-looking text stays text."""
    by_marker = {im.marker: im for im in images}
    out: list[str | ImageInput] = []
    pos = 0
    for m in MARKER_RE.finditer(text):
        im = by_marker.get(m.group(0))
        if im is None:
            continue
        if m.start() > pos:
            out.append(text[pos : m.start()])
        out.append(im)
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out
