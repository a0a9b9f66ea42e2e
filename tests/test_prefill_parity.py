"""Chunked prefill equals the full forward on all five families' tiny oracle models (#14).

* On the oracle's own prompt (40-150 tokens): every position's logits of a forward fed
  1, 7, 512 or 4,096 tokens at a time equal transformers' full forward within 1e-4
  (512 and 4,096 are one chunk there).
* On a long random prompt (4,133 tokens, past several window evictions, compression
  boundaries and top-k selections): fed in 512-token chunks it equals the forward fed in
  4,096-token chunks, whose first chunk is the full forward of 4,096 positions; and a
  prompt of 773 tokens in 512-token chunks equals its one-chunk full forward.
* Prefill, then decode: a session prefilled (767 tokens) in chunks of 7 / 512 / 4,096
  tokens and then decoding token by token gives the full forward's logits at every
  decoded position.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import chunked_logits, load_case, maxdiff  # noqa: E402

TOL = 1e-4
FAMILIES = [  # (oracle script, config): one configuration per family, the longest prompt
    ("make_tiny_deepseek_v4.py", "long"),
    ("probe_mlx_deepseek_v41.py", "mixed"),
    ("make_tiny_glm_moe_dsa.py", "alt"),
    ("make_tiny_glm5_next.py", "long"),
    ("make_tiny_qwen4_exp.py", "long"),
]
LONG, MID, DECODED = 4096 + 37, 512 + 261, 6


# end to end (servers, several processes or models, whole files): the slow tier, which CI runs second
pytestmark = pytest.mark.slow


def _family_id(fam) -> str:
    return fam[0].removeprefix("make_tiny_").removeprefix("probe_mlx_").removesuffix(".py")


@pytest.fixture(scope="module", params=FAMILIES, ids=_family_id)
def case(request, oracle):
    _, lm, ref, _ = load_case(oracle, *request.param)
    rng = np.random.default_rng(14)
    ids = rng.integers(2, lm.vocab_size, LONG).tolist()
    return {"lm": lm, "ref": ref, "ids": ids, "memo": {}}


def _logits(case, n: int, chunk: int) -> np.ndarray:
    """Every position's logits of the first n long-prompt tokens fed `chunk` at a time (memoised)."""
    key = (n, chunk)
    if key not in case["memo"]:
        case["memo"][key] = chunked_logits(case["lm"], case["ids"][:n], chunk)
    return case["memo"][key]


@pytest.mark.parametrize("chunk", [1, 7, 512, 4096])
def test_oracle_prompt_chunked_equals_full_forward(case, chunk):
    ref = case["ref"]
    got = chunked_logits(case["lm"], ref["input_ids"][0].tolist(), chunk)
    assert maxdiff(got, ref["logits_full"][0]) <= TOL


def test_mid_prompt_512_chunks_equal_one_forward(case):
    assert maxdiff(_logits(case, MID, 512), case["lm"].logits(case["ids"][:MID])) <= TOL


@pytest.mark.slow
def test_long_prompt_512_chunks_equal_4096_chunks(case):
    big = _logits(case, LONG, 4096)
    assert big.shape[0] == LONG and np.isfinite(big).all()
    assert maxdiff(_logits(case, LONG, 512), big) <= TOL


@pytest.mark.parametrize("chunk", [7, 512, 4096])
def test_prefill_then_decode_equals_full_forward(case, chunk):
    """(The 4,096-token chunk's continuation after a full chunk is the long test's.)"""
    n = MID
    lm, ids = case["lm"], case["ids"][:n]
    full = _logits(case, n, n)  # one chunk: the full forward
    s = lm.new_session(ctx=n, chunk=chunk)
    first = s.prefill(ids[:-DECODED])
    assert maxdiff(first, full[n - DECODED - 1]) <= TOL
    for i in range(n - DECODED, n):
        assert maxdiff(s.decode(ids[i]), full[i]) <= TOL, i
