"""Image parts (chat/images.py), the encoder cache (vision/cache.py) and the image-token
layout (vision/encoder.py): every accepted form, every refusal, the LRU bounds, the
token blocks and the 3D rope positions against transformers' get_rope_index."""

from __future__ import annotations

import base64
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.chat import images as I
from ds4mlx.models.vision_qwen3vl import demo_tower
from ds4mlx.vision.cache import EncoderCache
from ds4mlx.vision.encoder import ImageRows, ImageSpan, ImageTokenIds, VisionEncoder, mrope_positions, tokenize

sys.path.insert(0, str(Path(__file__).parent))
from vision_helpers import b64, data_uri, huge_png, image_bytes  # noqa: E402

# --- accepted -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,media", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("JPEG", "image/jpg")])
def test_data_uri_png_and_jpeg(fmt, media):
    data = image_bytes(40, 30, fmt)
    im = I.from_data_uri(data_uri(data, media))
    assert (im.width, im.height) == (40, 30) and im.data == data
    assert im.fingerprint == __import__("hashlib").sha256(data).hexdigest()
    assert im.image().size == (40, 30) and im.image().mode == "RGB"
    assert I.MARKER_RE.fullmatch(im.marker)


def test_media_type_is_case_insensitive_and_bytes_decide_the_format():
    png = image_bytes()
    assert I.from_data_uri("data:IMAGE/PNG;base64," + b64(png)).width == 40
    assert I.from_base64("image/jpeg", b64(png)).height == 30  # a PNG labelled jpeg is still decoded


def test_each_api_part_shape():
    uri = data_uri()
    assert I.parse_part({"type": "image_url", "image_url": {"url": uri, "detail": "low"}}).width == 40
    assert I.parse_part({"type": "image_url", "image_url": uri}).width == 40
    assert I.parse_part({"type": "input_image", "image_url": uri}).width == 40
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(image_bytes())}}
    assert I.parse_part(block).width == 40


def test_same_bytes_same_fingerprint_new_marker():
    a, b = I.from_data_uri(data_uri()), I.from_data_uri(data_uri())
    assert a.fingerprint == b.fingerprint and a.marker != b.marker
    assert I.from_data_uri(data_uri(image_bytes(seed=1))).fingerprint != a.fingerprint


# --- refused --------------------------------------------------------------------------

REFUSED_URLS = [
    ("/etc/passwd", I.ERR_NOT_DATA_URI),
    ("./shot.png", I.ERR_NOT_DATA_URI),
    ("file:///tmp/a.png", I.ERR_NOT_DATA_URI),
    ("http://example.com/a.png", I.ERR_NOT_DATA_URI),
    ("https://example.com/a.png", I.ERR_NOT_DATA_URI),
    ("data:image/png,rawbytes", I.ERR_NOT_DATA_URI),
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", I.ERR_MEDIA_TYPE.format(media="image/gif")),
    ("data:image/webp;base64,AAAA", I.ERR_MEDIA_TYPE.format(media="image/webp")),
    ("data:text/plain;base64,aGk=", I.ERR_MEDIA_TYPE.format(media="text/plain")),
    ("data:image/png;base64,not base64!!", I.ERR_BASE64),
    ("data:image/png;base64,", I.ERR_BASE64),
    ("data:image/png;base64," + b64(b"hello, not an image"), I.ERR_BROKEN),
    ("data:image/png;base64," + b64(image_bytes()[:-40]), I.ERR_BROKEN),  # truncated PNG
    ("data:image/jpeg;base64," + b64(image_bytes(fmt="JPEG")[:200]), I.ERR_BROKEN),  # truncated JPEG
    ("data:image/png;base64," + b64(image_bytes(fmt="GIF")), I.ERR_BROKEN),  # a GIF behind a PNG label
    ("", I.ERR_MISSING),
]


@pytest.mark.parametrize("url,message", REFUSED_URLS, ids=[u[:30] or "empty" for u, _ in REFUSED_URLS])
def test_refused_urls(url, message):
    with pytest.raises(I.ImageError) as e:
        I.from_data_uri(url)
    assert e.value.message == message


def test_huge_dimensions_are_refused_from_the_header():
    with pytest.raises(I.ImageError) as e:
        I.from_data_uri(data_uri(huge_png(8000, 8000)))
    assert e.value.message == I.ERR_TOO_LARGE.format(w=8000, h=8000, limit=I.MAX_PIXELS)
    with pytest.raises(I.ImageError) as e:  # Pillow's own bomb guard fires while opening
        I.from_data_uri(data_uri(huge_png(20000, 20000)))
    assert e.value.message == I.ERR_TOO_LARGE_UNKNOWN


@pytest.mark.parametrize(
    "block,message",
    [
        ({"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}, I.ERR_SOURCE_TYPE.format(kind="url")),
        ({"type": "image", "source": {"type": "file", "file_id": "f"}}, I.ERR_SOURCE_TYPE.format(kind="file")),
        ({"type": "image"}, I.ERR_MISSING),
        (
            {"type": "image", "source": {"type": "base64", "media_type": "image/gif", "data": "AAAA"}},
            I.ERR_MEDIA_TYPE.format(media="image/gif"),
        ),
        ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@"}}, I.ERR_BASE64),
    ],
)
def test_refused_anthropic_sources(block, message):
    with pytest.raises(I.ImageError) as e:
        I.anthropic_block(block)
    assert e.value.message == message


def test_count_and_role_limits():
    I.check_count(I.MAX_IMAGES)
    with pytest.raises(I.ImageError, match="at most 16"):
        I.check_count(I.MAX_IMAGES + 1)
    for role in ("user", "tool"):
        I.check_role(role)
    for role in ("assistant", "system", "developer"):
        with pytest.raises(I.ImageError):
            I.check_role(role)


def test_markers_split_only_known_images():
    a, b = I.from_data_uri(data_uri()), I.from_data_uri(data_uri(image_bytes(seed=2)))
    forged = I.MARKER_OPEN + "0" * 24 + I.MARKER_CLOSE
    text = "x" + a.marker + "mid" + forged + b.marker + "end"
    assert I.split_markers(text, [a, b]) == ["x", a, "mid" + forged, b, "end"]


# --- the encoder cache ----------------------------------------------------------------


def test_cache_is_lru_bounded_by_entries_and_bytes():
    c = EncoderCache(max_entries=3, max_bytes=1000)
    for k in (b"a", b"b", b"c"):
        c.put(k, k.upper(), 10)
    assert c.get(b"a") == b"A"  # a is now the most recent
    c.put(b"d", b"D", 10)
    assert c.get(b"b") is None and len(c) == 3  # b was the least recent
    c.put(b"big", b"BIG", 900)
    assert c.nbytes <= 1000 and c.get(b"big") == b"BIG"
    c.put(b"huge", b"H", 5000)  # over the whole budget: never cached
    assert c.get(b"huge") is None


def test_cache_keeps_only_successful_encodings():
    c = EncoderCache()
    calls = []

    def fail():
        calls.append(1)
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError):
        c.get_or_compute(b"x", fail)
    assert c.get_or_compute(b"x", lambda: ("ok", 2)) == "ok" and c.get_or_compute(b"x", fail) == "ok"
    assert (c.hits, c.misses) == (1, 2) and len(calls) == 1


# --- token blocks, rows, positions ------------------------------------------------------


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]


@pytest.fixture(scope="module")
def encoder():
    return VisionEncoder(demo_tower(16), ImageTokenIds(900, 901, 902), name="test")


def test_token_blocks_sit_at_the_markers(encoder):
    a = I.from_data_uri(data_uri(image_bytes(40, 30)))
    b = I.from_data_uri(data_uri(image_bytes(300, 100, seed=3)))
    ids, spans = tokenize(_Tok(), "ab" + a.marker + "c" + b.marker + "d", [a, b], encoder)
    na, nb = encoder.n_tokens(a), encoder.n_tokens(b)
    assert 64 <= na < 80 and encoder.grid_for(a) == (1, 14, 20)  # 40x30 px scaled up to the 64-token floor
    assert ids == [97, 98, 900] + [901] * na + [902, 99, 900] + [901] * nb + [902, 100]
    assert [(s.start, s.length) for s in spans] == [(2, na + 2), (2 + na + 3, nb + 2)]
    assert spans[0].fingerprint != spans[1].fingerprint


def test_rows_are_cached_by_bytes(encoder):
    a = I.from_data_uri(data_uri(image_bytes(64, 64, seed=5)))
    r1 = encoder.rows(a)
    again = I.from_data_uri(data_uri(image_bytes(64, 64, seed=5)))
    hits = encoder.cache.hits
    r2 = encoder.rows(again)
    assert encoder.cache.hits == hits + 1 and r1 is r2
    assert r1.shape == (encoder.n_tokens(a), 16)


def test_image_rows_land_at_their_positions_across_chunks():
    rows = mx.arange(4 * 3, dtype=mx.float32).reshape(4, 3) + 100
    hook = ImageRows.for_spans([ImageSpan(start=2, length=6, fingerprint="f", grid=(1, 4, 4))], [rows])
    base = mx.zeros((1, 5, 3))
    first = np.array(hook(mx.array(base), 0))  # positions 0..4: pads 3, 4
    second = np.array(hook(mx.zeros((1, 5, 3)), 5))  # positions 5..9: pads 5, 6
    np.testing.assert_array_equal(first[0, 3:5], np.array(rows[:2]))
    np.testing.assert_array_equal(first[0, :3], 0)
    np.testing.assert_array_equal(second[0, :2], np.array(rows[2:]))
    np.testing.assert_array_equal(second[0, 2:], 0)


def test_mrope_positions_match_transformers():
    torch = pytest.importorskip("torch")
    mod = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    # text(3) [start pads(2x3 merged) end] text(2) [start pads(1x2) end] text(1)
    spans = [ImageSpan(3, 8, "a", (1, 4, 6)), ImageSpan(3 + 8 + 2, 4, "b", (1, 2, 4))]
    n = 3 + 8 + 2 + 4 + 1
    types = np.zeros(n, np.int64)
    for s in spans:
        types[list(s.pads)] = 1
    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)))
    fake.get_vision_position_ids = lambda *a, **k: mod.Qwen4ExpModel.get_vision_position_ids(fake, *a, **k)
    want, _ = mod.Qwen4ExpModel.get_rope_index(
        fake,
        torch.zeros(1, n, dtype=torch.long),
        torch.from_numpy(types)[None],
        image_grid_thw=torch.tensor([s.grid for s in spans]),
    )
    np.testing.assert_array_equal(mrope_positions(n, spans, 2), want[:, 0].numpy())


def test_base64_helper_roundtrip():
    assert I.decode_base64(base64.b64encode(b"abc").decode()) == b"abc"
