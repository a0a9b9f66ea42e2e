"""The CUDA tile API's fragment offsets (kernels/mma_tile.py's FRAGMENT) on a 32-lane model.

The g++ emulation holds whole tiles per lane, so it cannot see which lane loads which element;
here each of 32 lanes fills its registers at the offsets the CUDA text uses (the same
expressions, evaluated in Python), a model of `mma.sync.aligned.m16n8k16.row.col` reads the
registers as the PTX ISA's fragment layouts place them (transcribed below on their own, not
from FRAGMENT), and the lanes store at FRAGMENT's offsets: the result must be C + A B for
random tiles, at the kernel's ld and at the tight one.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4mlx.kernels import mma_tile

LANES = 32


def isa_a(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of a_i (i < 8) in the 16 x 16 A of m16n8k16, .f16 / .bf16 (PTX ISA)."""
    g, t = lane >> 2, lane % 4
    row = g if i in (0, 1, 4, 5) else g + 8
    return row, t * 2 + (i & 1) + (8 if i >= 4 else 0)


def isa_b(lane: int, i: int) -> tuple[int, int]:
    """(row k, col n) of b_i (i < 4) in the 16 x 8 B of m16n8k16."""
    g, t = lane >> 2, lane % 4
    return t * 2 + (i & 1) + (8 if i >= 2 else 0), g


def isa_c(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of c_i / d_i (i < 4) in the 16 x 8 float32 C of m16n8k16."""
    g, t = lane >> 2, lane % 4
    return g + (8 if i >= 2 else 0), t * 2 + (i & 1)


def offsets(op: str, ld: int) -> np.ndarray:
    """[lane, element] offsets from FRAGMENT's expressions (the C++ text's own)."""
    return np.array(
        [
            [eval(e, {}, {"g": lane >> 2, "t": lane % 4, "ld": ld}) for e in mma_tile.FRAGMENT[op]]
            for lane in range(LANES)
        ]
    )


def mma_model(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ds4_mma on lane registers: c [32, 8] floats, a [32, 8], b [32, 8] (16-bit elements in
    register order): two m16n8k16 ops, b's and c's elements 4h.. for n half h."""
    out = c.copy()
    for h in range(2):
        am, bm, cm = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
        for lane in range(LANES):
            for i in range(8):
                am[isa_a(lane, i)] = a[lane, i]
            for i in range(4):
                bm[isa_b(lane, i)] = b[lane, 4 * h + i]
                cm[isa_c(lane, i)] = c[lane, 4 * h + i]
        d = cm + am @ bm
        for lane in range(LANES):
            for i in range(4):
                out[lane, 4 * h + i] = d[isa_c(lane, i)]
    return out


def test_every_lane_element_is_one_tile_element():
    """Over the 32 lanes each fragment's offsets cover the 16 x 16 tile once (ld = 16)."""
    for op in "abc":
        off = offsets(op, 16)
        assert sorted(off.ravel()) == list(range(256)), op


@pytest.mark.parametrize("ld", [16, 72])
def test_loads_mma_store_compute_the_tile_product(ld):
    rng = np.random.default_rng(ld)
    a = rng.integers(-8, 9, (16, 16)).astype(np.float64)  # a[m][k]
    b = rng.integers(-8, 9, (16, 16)).astype(np.float64)  # b[k][n]
    c0 = rng.integers(-8, 9, (16, 16)).astype(np.float64)
    pa = np.zeros(16 * ld)
    pb = np.zeros(16 * ld)
    pc = np.zeros(16 * ld)
    for m in range(16):
        pa[m * ld : m * ld + 16] = a[m]  # ds4_mma_load_a: a[m][k] = p[m ld + k]
        pb[m * ld : m * ld + 16] = b[:, m]  # ds4_mma_load_b: b[k][n] = p[n ld + k]
        pc[m * ld : m * ld + 16] = c0[m]
    oa, ob, oc = offsets("a", ld), offsets("b", ld), offsets("c", ld)
    # the accumulator of a store-load round trip: ds4_mma_store's offsets read back
    acc = mma_model(pc[oc], pa[oa], pb[ob])
    acc = mma_model(acc, pa[oa], pb[ob])  # accumulation: c + 2 a b
    out = np.full(16 * ld, np.nan)
    out[oc] = acc  # ds4_mma_store: p[m ld + n] = c[m][n]
    got = out.reshape(16, ld)[:, :16]
    assert np.array_equal(got, c0 + 2 * (a @ b))


def test_cuda_text_uses_the_offsets():
    """The CUDA prelude loads and stores at exactly FRAGMENT's expressions, in register order."""
    cuda = mma_tile.PRELUDE["cuda"]
    for op, name in (("a", "a"), ("b", "b")):
        off = mma_tile.FRAGMENT[op]
        for i in range(4):
            assert f"{name}.r[{i}] = ds4_mma_pack(p[{off[2 * i]}], p[{off[2 * i + 1]}]);" in cuda
    for i, e in enumerate(mma_tile.FRAGMENT["c"]):
        assert f"p[{e}] = c.r[{i}];" in cuda
    assert "#include" not in cuda
