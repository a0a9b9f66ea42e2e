"""The per-token prologue of DeepSeek V4's decode attention in one launch.

Per layer and token the compiled decode step (models/deepseek_v4.py `Attention.forward`)
norms and ropes the query heads, norms and ropes the new K=V row and writes it into the
sliding ring (a dynamic slice update: offset kernel + copy), and for CSA layers ropes the
indexer query: six to eight launches of tiny work.  `attn_prep` does all of it in one:

``attn_prep(q_b, kv, kv_weight, ring, pos, rope, eps, index_q_b=None, *, heads, index_heads=0)``
    -> (q [1, NH, 1, D] = rope(rms_norm(q_b per head)),
        ring [1, 1, W, D] = a copy of ring with slot pos % W = rope(rms_norm(kv) * kv_weight),
        index_q [1, NHI, 1, DI] = rope(index_q_b per head), or None)

``rope`` is the layer's `models.layers.RoPE` (duck-typed: called as ``rope(x, offset=, scale=)``
by the reference face; its ``dims``, ``periods`` and ``attention_factor`` feed the kernel).
The position ``pos`` is an int32 array (the compiled step) or an int.

Three faces (`ds4mlx.kernels.dispatch`): the reference face is the model's own ops (RMSNorm,
rope, slice update); the Metal face and its CUDA twin compile the shared text of
``kernels/metal/attn_prep.metal``.  The kernel rounds once per output, where the graph
rounds after the norm and after the rope (low-precision dtypes: an ulp or so apart).

Verified: the reference face against the model's graph; the shared kernel text compiled with
g++ (emulated threadgroups) against the reference; the CUDA translation unit with nvcc; on a
GPU (``pytest -m gpu tests/test_kernel_attn_prep.py``, an H100) the one-row face and the chain
at V4 Flash's shapes.  The rows form ("attn_prep.rows") has passed only its first-use self-test
there: it stays in `dispatch.UNVERIFIED_KERNELS` and self-tests at first use.
"""

from __future__ import annotations

from functools import cache, lru_cache

import mlx.core as mx

from ds4mlx.kernels.dispatch import (
    METAL_DIR,
    Kernel,
    auto_face,
    close_enough,
    placeholder,
    row_inputs,
    row_select,
    shared_sources,
)

SOURCE = METAL_DIR / "attn_prep.metal"
THREADS = 256  # 8 SIMD groups: 8 rows per row threadgroup
COPY_PER = 8  # ring elements per thread in the copy threadgroups

# sin / cos for the rope, per face (the shared PRELUDE stays lean: every kernel's source is
# hashed at each launch); sparse_attention's attend epilogue takes them from here too
TRIG = {
    "metal": "inline float ds4_sin(float x) { return metal::precise::sin(x); }\n"
    "inline float ds4_cos(float x) { return metal::precise::cos(x); }\n",
    "cuda": "__device__ __forceinline__ float ds4_sin(float x) { return sinf(x); }\n"
    "__device__ __forceinline__ float ds4_cos(float x) { return cosf(x); }\n",
}

_INPUTS = ["q", "kv", "kv_w", "iq", "ring", "freqs", "prm", "meta"]
_OUTPUTS = ["q_out", "ring_out", "iq_out"]


ONE = "#define AP_ROWS 1\n#define AP_POS (meta[0])\n#define AP_ROW_SELECT\n"  # attn_prep: one row


def kernel_sources(face: str, defines: str = ONE) -> tuple[str, str]:
    """(header, body) of the attn_prep kernel for `face` ('metal' or 'cuda'); `defines`: one
    row's (attn_prep_rows: `rows_defines`)."""
    header, body = shared_sources(SOURCE, face, "attn_prep")
    return header + TRIG[face] + defines, body


_ROWS_IN = ["q_rows", "kv_rows", "kv_w", "iq_rows"]  # then ring_0 .. ring_{R-1}, freqs, prm, poss


_CHAIN_IN = {"q": "TQ", "kv": "TKV", "iq": "TI"}  # attn_prep_chain: one input each per token


def rows_defines(n: int, chain: bool = False) -> str:
    """The defines that make the kernel's text attn_prep_rows for n rows: row r's slices of the
    stacked q / kv / iq and of the stacked q_out / iq_out, its own ring and ring_out.  `chain`:
    attn_prep_chain's (one session's n tokens over the one input ring: row r's K=V row written
    into the rings of rows r .. n-1, row r's ring copied but for the slots of tokens 0..r)."""
    ins = (
        "const DS4_DEV TQ* q = q_rows + uint64_t(row) * uint64_t(NH * D); "
        "const DS4_DEV TKV* kv = kv_rows + uint64_t(row) * uint64_t(D); "
        "const DS4_DEV TI* iq = iq_rows + uint64_t(row) * uint64_t(NHI * DI); "
    )
    offsets = ("" if chain else ins) + (
        "DS4_DEV TQ* q_out = q_out_rows + uint64_t(row) * uint64_t(NH * D); "
        "DS4_DEV TI* iq_out = iq_out_rows + uint64_t(row) * uint64_t(NHI > 0 ? NHI * DI : 1);"
    )
    # a chain's projections come one input per token (a token's slice of a split projection is
    # contiguous, the tokens' together are not: MLX would copy them before the launch)
    picked = _CHAIN_IN if chain else {"ring": "TR"}
    select = row_select(n, picked, {"ring_out": "TR"}, macro="AP_PICK")
    out = f"#define AP_ROWS {n}\n#define AP_POS (poss[row])\n{select}#define AP_ROW_SELECT AP_PICK {offsets}\n"
    if chain:
        dst = "".join(f"(t) == {r}u ? ring_out_{r} : " for r in range(n - 1)) + f"ring_out_{n - 1}"
        first = "((poss[0] % W + W) % W)"  # the first token's slot; token r's is r slots on
        out += f"#define AP_KV_FIRST row\n#define AP_KV_END {n}u\n#define AP_KV_DST(t) ({dst})\n"
        out += f"#define AP_WRITTEN(sl) (uint32_t(((int64_t(sl) - int64_t{first}) % W + W) % W) <= row)\n"
    return out


def rows_io(n: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of attn_prep_rows for n rows."""
    return _ROWS_IN + row_inputs(["ring"], n) + ["freqs", "prm", "poss"], [
        "q_out_rows",
        *row_inputs(["ring_out"], n),
        "iq_out_rows",
    ]


def chain_io(n: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of attn_prep_chain for n tokens: each token's projections,
    one input ring, n output rings."""
    ins = row_inputs(_CHAIN_IN, n) + ["kv_w", "ring", "freqs", "prm", "poss"]
    return ins, ["q_out_rows", *row_inputs(["ring_out"], n), "iq_out_rows"]


def chain_inputs(q_b, kv, iq, index_q_b) -> list:
    """attn_prep_chain's per-token inputs (`chain_io` order) from the tokens' projections [1, T, ...]
    (`iq` the launch's indexer input: index_q_b, or a placeholder without one)."""
    n = q_b.shape[1]
    each = lambda a: [a[:, t : t + 1] for t in range(n)]  # noqa: E731
    return [*each(q_b), *each(kv), *(each(iq) if index_q_b is not None else [iq] * n)]


@cache
def _chain_kernel(n: int) -> Kernel:
    faces = {face: kernel_sources(face, rows_defines(n, chain=True)) for face in ("metal", "cuda")}
    return Kernel(f"ds4mlx_attn_prep_chain{n}", *chain_io(n), **faces)


@cache
def _rows_kernel(n: int) -> Kernel:
    faces = {face: kernel_sources(face, rows_defines(n)) for face in ("metal", "cuda")}
    return Kernel(f"ds4mlx_attn_prep_rows{n}", *rows_io(n), **faces)


@cache
def _kernel() -> Kernel:
    return Kernel("ds4mlx_attn_prep", _INPUTS, _OUTPUTS, metal=kernel_sources("metal"), cuda=kernel_sources("cuda"))


@lru_cache(maxsize=16)
def params(eps: float, mscale: float) -> mx.array:
    return mx.array([eps, mscale], dtype=mx.float32)


def _meta(pos) -> mx.array:
    if isinstance(pos, mx.array):
        return pos.astype(mx.int32).reshape(1)
    return mx.array([int(pos)], dtype=mx.int32)


def fusable(rope, head_dim: int, index_dim: int = 0) -> bool:
    """Whether the kernel handles these widths: rope pairs never straddle a lane's channel pair."""
    dims = rope.dims
    widths = [head_dim] + ([index_dim] if index_dim else [])
    return dims % 2 == 0 and all(w % 2 == 0 and w >= dims for w in widths)


def reference(q_b, kv, kv_weight, ring, pos, rope, eps, index_q_b=None, *, heads, index_heads=0):
    """The model's own graph (the oracle and the CPU path)."""
    d = ring.shape[-1]
    q = q_b.reshape(1, 1, heads, d).swapaxes(1, 2)
    q = rope(mx.fast.rms_norm(q, None, eps), offset=pos)
    kv = rope(mx.fast.rms_norm(kv.reshape(1, 1, d), kv_weight.astype(kv.dtype), eps)[:, None], offset=pos)
    w = ring.shape[2]
    slot = (pos % w).reshape(1) if isinstance(pos, mx.array) else mx.array([pos % w], dtype=mx.int32)
    ring = mx.slice_update(ring, kv.astype(ring.dtype), slot, axes=(2,))
    index_q = None
    if index_q_b is not None:
        di = index_q_b.shape[-1] // index_heads
        index_q = rope(index_q_b.reshape(1, 1, index_heads, di).swapaxes(1, 2), offset=pos)
    return q, ring, index_q


def template_args(q_b, kv, kv_weight, iq, ring, heads: int, nhi: int, di: int, rope) -> list:
    """The kernel's template arguments (attn_prep and attn_prep_rows)."""
    w, d = ring.shape[2], ring.shape[-1]
    dtypes = [("TQ", q_b.dtype), ("TKV", kv.dtype), ("TWN", kv_weight.dtype), ("TI", iq.dtype), ("TR", ring.dtype)]
    sizes = [("NH", heads), ("D", d), ("NHI", nhi), ("DI", max(di, 2)), ("W", w), ("RD", rope.dims)]
    return dtypes + sizes + [("THREADS", THREADS), ("PER", COPY_PER)]


def launch_groups(heads: int, nhi: int, ring) -> int:
    """Threadgroups of one row's work: a SIMD group per head row, then the ring copy."""
    w, d = ring.shape[2], ring.shape[-1]
    return -(-(heads + 1 + nhi) // (THREADS // 32)) + -(-(w * d) // (THREADS * COPY_PER))


def launch_inputs(q_b, index_q_b, index_heads: int, rope) -> tuple[int, int, mx.array, mx.array]:
    """(indexer heads, indexer head width, indexer query input, RoPE periods input) of a prep
    launch: 0, 0 and placeholders where there is no indexer query, a placeholder for the
    periods where the rope has no rotary part."""
    freqs = rope.periods if rope.dims else placeholder(mx.float32)
    if index_q_b is None:
        return 0, 0, placeholder(q_b.dtype), freqs
    return index_heads, index_q_b.shape[-1] // index_heads, index_q_b, freqs


def attn_prep(
    q_b,
    kv,
    kv_weight,
    ring,
    pos,
    rope,
    eps: float,
    index_q_b=None,
    *,
    heads: int,
    index_heads: int = 0,
    backend: str | None = None,
):
    """See the module docstring.  q_b [.., NH*D], kv [.., D], ring [1, 1, W, D],
    index_q_b [.., NHI*DI] or None."""
    d = ring.shape[-1]
    nhi, di, iq, freqs = launch_inputs(q_b, index_q_b, index_heads, rope)
    face = backend
    if face is None:
        face = auto_face("attn_prep", lambda f: _self_test(f, rope))
    if face == "reference" or not fusable(rope, d, di):
        return reference(q_b, kv, kv_weight, ring, pos, rope, eps, index_q_b, heads=heads, index_heads=index_heads)
    q, ring, iq = _kernel()(
        face,
        inputs=[q_b, kv, kv_weight, iq, ring, freqs, params(float(eps), float(rope.attention_factor)), _meta(pos)],
        template=template_args(q_b, kv, kv_weight, iq, ring, heads, nhi, di, rope),
        grid=(launch_groups(heads, nhi, ring) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(1, heads, 1, d), ring.shape, (1, max(nhi, 1), 1, max(di, 1))],
        output_dtypes=[q_b.dtype, ring.dtype, iq.dtype],
    )
    return q, ring, (iq if index_q_b is not None else None)


def rings_alike(rings: list) -> bool:
    """Whether B rows' rings can share a launch (one shape and dtype)."""
    return all(r.shape == rings[0].shape and r.dtype == rings[0].dtype for r in rings)


def prep_rows_or_each(q_b, kv, kv_weight, rings: list, poss, rope, eps: float, index_q_b=None, **kw) -> list:
    """`attn_prep_rows` where the rows can share a launch, else `attn_prep` per row: one
    (q [1, NH, 1, D], ring, index_q or None) per row (keywords: attn_prep's)."""
    out = attn_prep_rows(q_b, kv, kv_weight, rings, poss, rope, eps, index_q_b, **kw)
    if out is not None:
        q, new_rings, iqs = out
        return [(q[b : b + 1], r, None if iqs is None else iqs[b : b + 1]) for b, r in enumerate(new_rings)]
    heads = []
    for b, ring in enumerate(rings):
        r = slice(b, b + 1)
        ib = None if index_q_b is None else index_q_b[:, r]
        heads.append(attn_prep(q_b[:, r], kv[:, r], kv_weight, ring, poss[r].squeeze(0), rope, eps, ib, **kw))
    return heads


def attn_prep_rows(
    q_b,
    kv,
    kv_weight,
    rings: list,
    poss,
    rope,
    eps: float,
    index_q_b=None,
    *,
    heads: int,
    index_heads: int = 0,
    backend: str | None = None,
):
    """`attn_prep` of B sessions' tokens of one layer in ONE launch (session batching): q_b
    [1, B, NH*D], kv [1, B, D], index_q_b [1, B, NHI*DI] or None (the rows' projections, as
    the batched step has them), rings[b] row b's ring, poss [B] int32 -> (q [B, NH, 1, D],
    the rows' new rings, the indexer queries [B, NHI, 1, DI] or None), or None where the rows
    cannot share a launch (the CPU, one row, unlike rings, widths the kernel does not take, a
    failed first-use self-test): the caller then runs attn_prep per row."""
    n = len(rings)
    d = rings[0].shape[-1]
    nhi, di, iq, freqs = launch_inputs(q_b, index_q_b, index_heads, rope)
    face = backend
    if face is None:
        face = auto_face("attn_prep.rows", lambda f: _rows_self_test(f, rope))
    if face == "reference" or n < 2 or not fusable(rope, d, di) or not rings_alike(rings):
        return None
    out = _rows_kernel(n)(
        face,
        inputs=[q_b, kv, kv_weight, iq, *rings, freqs, params(float(eps), float(rope.attention_factor)), poss],
        template=template_args(q_b, kv, kv_weight, iq, rings[0], heads, nhi, di, rope),
        grid=(launch_groups(heads, nhi, rings[0]) * THREADS, n, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(n, heads, 1, d), *[r.shape for r in rings], (n, max(nhi, 1), 1, max(di, 1))],
        output_dtypes=[q_b.dtype, *[r.dtype for r in rings], iq.dtype],
    )
    return out[0], out[1 : 1 + n], (out[-1] if index_q_b is not None else None)


def attn_prep_chain(
    q_b,
    kv,
    kv_weight,
    ring,
    poss,
    rope,
    eps: float,
    index_q_b=None,
    *,
    heads: int,
    index_heads: int = 0,
    backend: str | None = None,
):
    """`attn_prep` of one session's next T tokens (a speculative verify's chain) in ONE launch:
    q_b [1, T, NH*D], kv [1, T, D], index_q_b [1, T, NHI*DI] or None, ring the session's ring
    before the chain, poss [T] int32 consecutive positions -> (q [T, NH, 1, D], the rings after
    tokens 0..t for each t, the indexer queries [T, NHI, 1, DI] or None): token t's outputs are
    attn_prep's over the ring token t - 1 left.  None where the tokens cannot share a launch
    (the CPU, one token, more tokens than the ring has slots, widths the kernel does not take, a
    failed first-use self-test): the caller then runs attn_prep per token."""
    n = q_b.shape[1]
    w, d = ring.shape[2], ring.shape[-1]
    nhi, di, iq, freqs = launch_inputs(q_b, index_q_b, index_heads, rope)
    face = backend
    if face is None:
        face = auto_face("attn_prep.chain", lambda f: _chain_self_test(f, rope))
    if face == "reference" or not 1 < n <= w or not fusable(rope, d, di):
        return None
    out = _chain_kernel(n)(
        face,
        inputs=[
            *chain_inputs(q_b, kv, iq, index_q_b),
            kv_weight,
            ring,
            freqs,
            params(float(eps), float(rope.attention_factor)),
            poss,
        ],
        template=template_args(q_b, kv, kv_weight, iq, ring, heads, nhi, di, rope),
        grid=(launch_groups(heads, nhi, ring) * THREADS, n, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(n, heads, 1, d), *[ring.shape] * n, (n, max(nhi, 1), 1, max(di, 1))],
        output_dtypes=[q_b.dtype, *[ring.dtype] * n, iq.dtype],
    )
    return out[0], out[1 : 1 + n], (out[-1] if index_q_b is not None else None)


def chain_reference(q_b, kv, kv_weight, ring, poss, rope, eps: float, index_q_b=None, *, heads, index_heads=0) -> list:
    """attn_prep_chain's meaning: the reference attn_prep of each token over the ring the token
    before it left -> per token (q [1, NH, 1, D], ring, index_q or None)."""
    out = []
    for t in range(q_b.shape[1]):
        row = slice(t, t + 1)
        iq = None if index_q_b is None else index_q_b[:, row]
        kw = dict(heads=heads, index_heads=index_heads)
        out.append(reference(q_b[:, row], kv[:, row], kv_weight, ring, poss[row].squeeze(0), rope, eps, iq, **kw))
        ring = out[-1][1]
    return out


def _chain_self_test(face: str, rope) -> bool:
    """attn_prep_chain on `face` against the reference chain: four tokens over a ring of 5 that
    wraps inside the chain, with and without indexer heads, float32 and bfloat16."""
    dims = rope.dims
    d, di, n = dims + 8, dims + 4, 4
    k = mx.random.split(mx.random.key(17), 5)
    weight = 1.0 + 0.1 * mx.random.normal((d,), key=k[0])
    poss = mx.arange(38, 38 + n, dtype=mx.int32)  # slots 3, 4, 0, 1
    for dt, tol in ((mx.float32, 1e-4), (mx.bfloat16, 2e-2)):
        q_b = mx.random.normal((1, n, 3 * d), key=k[1]).astype(dt)
        kv = mx.random.normal((1, n, d), key=k[2]).astype(dt)
        ring = mx.random.normal((1, 1, 5, d), key=k[4]).astype(dt)
        for iq, nhi in ((mx.random.normal((1, n, 2 * di), key=k[3]).astype(dt), 2), (None, 0)):
            kw = dict(heads=3, index_heads=nhi)
            got = attn_prep_chain(q_b, kv, weight, ring, poss, rope, 1e-6, iq, **kw, backend=face)
            if got is None:
                return False
            for t, want in enumerate(chain_reference(q_b, kv, weight, ring, poss, rope, 1e-6, iq, **kw)):
                row = slice(t, t + 1)
                mine = [got[0][row], got[1][t]] + ([got[2][row]] if iq is not None else [])
                if not all(close_enough(g, w, rtol=tol, atol=tol) for g, w in zip(mine, want)):
                    return False
    return True


def _rows_self_test(face: str, rope) -> bool:
    """attn_prep_rows on `face` against the reference of each row: three rows (their own rings
    and positions, one in the ring's first lap), with and without indexer heads, float32 and
    bfloat16."""
    dims = rope.dims
    d, di, n = dims + 8, dims + 4, 3
    k = mx.random.split(mx.random.key(13), 5)
    weight = 1.0 + 0.1 * mx.random.normal((d,), key=k[0])
    poss = mx.array([37, 3, 12], mx.int32)
    for dt, tol in ((mx.float32, 1e-4), (mx.bfloat16, 2e-2)):
        q_b = mx.random.normal((1, n, 3 * d), key=k[1]).astype(dt)
        kv = mx.random.normal((1, n, d), key=k[2]).astype(dt)
        rings = [r.astype(dt) for r in mx.split(mx.random.normal((n, 1, 5, d), key=k[4]), n)]
        rings = [r.reshape(1, 1, 5, d) for r in rings]
        for iq, nhi in ((mx.random.normal((1, n, 2 * di), key=k[3]).astype(dt), 2), (None, 0)):
            got = attn_prep_rows(q_b, kv, weight, rings, poss, rope, 1e-6, iq, heads=3, index_heads=nhi, backend=face)
            if got is None:
                return False
            for b in range(n):
                row = slice(b, b + 1)
                want = reference(
                    q_b[:, row], kv[:, row], weight, rings[b], poss[b], rope, 1e-6,
                    None if iq is None else iq[:, row], heads=3, index_heads=nhi,
                )  # fmt: skip
                mine = [got[0][row], got[1][b]] + ([got[2][row]] if iq is not None else [])
                if not all(close_enough(g, w, rtol=tol, atol=tol) for g, w in zip(mine, want)):
                    return False
    return True


def _self_test(face: str, rope) -> bool:
    """The kernel on `face` against the reference on small inputs (3 heads of the rope's width
    plus a nope part, a ring of 5, 2 indexer heads; float32 and bfloat16), at a position past
    the ring's first lap."""
    dims = rope.dims
    d, di = dims + 8, dims + 4
    key = mx.random.key(11)
    k = mx.random.split(key, 5)
    weight = 1.0 + 0.1 * mx.random.normal((d,), key=k[0])
    for dt, tol in ((mx.float32, 1e-4), (mx.bfloat16, 2e-2)):
        q_b = mx.random.normal((1, 1, 3 * d), key=k[1]).astype(dt)
        kv = mx.random.normal((1, 1, d), key=k[2]).astype(dt)
        iq = mx.random.normal((1, 1, 2 * di), key=k[3]).astype(dt)
        ring = mx.random.normal((1, 1, 5, d), key=k[4]).astype(dt)
        pos = mx.array(37, dtype=mx.int32)
        got = attn_prep(q_b, kv, weight, ring, pos, rope, 1e-6, iq, heads=3, index_heads=2, backend=face)
        want = reference(q_b, kv, weight, ring, pos, rope, 1e-6, iq, heads=3, index_heads=2)
        if not all(close_enough(g, w, rtol=tol, atol=tol) for g, w in zip(got, want)):
            return False
    return True
