"""Sparse attention for DeepSeek V4 compressed layers: indexer scores, top-k, attention.

The plain graph (`ds4mlx.models.deepseek_v4`) scores every indexer row with two
matmuls, picks the top-k with `argpartition`, gathers the rows, concatenates them to
the sliding window and runs SDPA; in prefill it attends *all* compressed rows through
a [C, window + C + N] mask.  These three kernels do the same work in three launches
per CSA layer (one for HCA layers), and a prefill query touches only its window and
its own selected rows:

``index_scores(q, w, keys, n=, s=, ratio=, scale=)``  -> scores [C, n] float32
    ``scores[t, r] = sum_h (w[t, h] * scale) * relu(q[h, t] . keys[r])`` for rows
    below query t's causal limit ``min(n, (s + t + 1) // ratio)``, -inf above it.
    Two layouts of the same sums: ``rows`` (a thread per row, the heads in a loop: prefill
    chunks) and ``heads`` (a threadgroup per few rows, the heads split across its SIMD
    groups: decode, where ``rows`` leaves most of the GPU idle); `score_layout` picks.
``topk_select(scores, k, s=, ratio=)``                -> idx [C, k] int32, cnt [C] int32
    the top-k rows of each query among its causal rows, in ascending row order
    (all of them when there are at most k); entries past ``cnt`` are 0.
``index_topk(q, w, keys, k, n=, s=, ratio=, scale=)`` -> idx, cnt
    the two above; at decode on CUDA in ONE launch (index_topk: the last threadgroup of a
    query to finish its scores, a ticket, runs the top-k on them; the compiled decode step's
    CSA layers), with the same idx / cnt bit for bit.
``sparse_attention(q, keys, rows, idx, cnt, sinks, n=, s=, ring_last=, window=, ratio=, scale=)``
    -> [NH, C, D]: softmax attention of each query over its sliding-window keys
    (positions in (s+t-window, s+t]) and its compressed rows (``rows[idx[t, :cnt[t]]]``,
    or every causal row when ``idx is None``), with the per-head sink logit in the
    denominator; K = V.
``attend_at(q, ring, rows, idx, cnt, sinks, pos, ratio=, scale=, out_rope=None, splits=None)``
    the same for one decode query at the position array ``pos``; with ``out_rope`` (the
    layer's RoPE) the output gets the inverse rope at ``pos`` in the kernel's epilogue, and
    the candidate keys may be split across ``splits`` threadgroups per head (merged by the
    last one to finish): 64 heads alone fill half of an H200.

Shapes: q [NH, C, D] (the model's [1, NH, C, D] without the batch), keys [L, D] the
window (W ring slots, then in prefill the chunk's own C rows: ``LayerCache.sliding``),
rows [>= n, D] the compressed rows (a cache buffer may be passed whole: only the
first n are read).  Ring slot j holds position ``ring_last - ((ring_last - j) mod W)``
(``ring_last = s`` at decode, ``s - 1`` in prefill).

Three faces (see `ds4mlx.kernels.dispatch`): the reference face is MLX ops in float32
(an oracle, not the model's plain path, which stays in deepseek_v4.py); the Metal face
(``kernels/metal/sparse_attention.metal``) and its CUDA twin compile the same text.

Exactness: scores and attention differ from float64 by rounding only (bounds in
tests/test_kernel_sparse_attention.py).  The top-k is exact on its input; rows whose
scores tie (or nearly tie, across faces) at the k-th place may be chosen differently
than `mx.argpartition` chooses them — test on inputs without near-ties.

Verified: reference faces against float64 math and the model's plain path (CPU, the
tiny transformers-oracle models); the shared kernel text compiled with g++ (emulated
threadgroups) and nvcc; the GPU faces by ``pytest -m gpu tests/test_kernel_sparse_attention.py``.
The decode variants (index_score_heads, attend's key split and rope epilogue, index_topk:
emulated against the two launches bit for bit) self-test at first use while
`dispatch.UNVERIFIED_KERNELS` names them; a failure keeps the launches they replace.
"""

from __future__ import annotations

import os
import threading
from functools import cache, lru_cache

import mlx.core as mx

from ds4mlx.kernels import dispatch
from ds4mlx.kernels.attn_prep import TRIG
from ds4mlx.kernels.dispatch import METAL_DIR, Kernel, auto_face, close_enough, f32_scalar, placeholder, shared_sources

SOURCE = METAL_DIR / "sparse_attention.metal"
SCORE_THREADS = 128  # rows per threadgroup in index_score (one thread per row)
SCORE_HEADS = 16  # query heads staged in threadgroup memory at a time
SCORE_SPLIT_THREADS = 256  # index_score_heads: 8 SIMD groups share out the heads
SCORE_FILL = 264  # fewer index_score threadgroups than this (2 per H200 SM): the heads layout
SCORE_GROUPS = 1024  # index_score_heads aims at about this many threadgroups
SCORE_ROWS_MAX = 64  # rows per index_score_heads threadgroup, at most
TOPK_THREADS = 512  # threads of the one threadgroup per query in topk
ATTN_THREADS = 256  # threads per (head, query) in attend
ATTN_KEYS = 4  # keys per SIMD group per step in attend
ATTN_SPLIT_KEYS = 160  # decode attend: a key split per this many candidate keys ...
ATTN_SPLIT_MAX = 4  # ... up to this many (64 heads x 4 = 256 threadgroups: one H200 wave)

# Tests set this to run the model's fused path with a given face (e.g. "reference" on
# the CPU); None: the fused path runs exactly when `dispatch.backend()` is a GPU face.
FORCE_FACE: str | None = None

_INPUTS = {
    "index_score": (["q", "w", "keys", "prm", "meta"], ["scores"]),
    "index_score_heads": (["q", "w", "keys", "prm", "meta"], ["scores"]),
    "topk": (["scores", "meta"], ["idx", "cnt"]),
    # index_score_heads + topk in one launch (decode on CUDA): the last threadgroup of a query runs topk
    "index_topk": (["q", "w", "keys", "prm", "meta", "tickets"], ["scores", "idx", "cnt"]),
    "attend": (["q", "keys", "rows", "idx", "cnt", "sinks", "rope", "prm", "meta", "tickets"], ["o", "part"]),
}

# attend's split merge: a device-wide fence, a ticket counter and a load past the L1 cache.
# The tickets live in a persistent input buffer (`dispatch.tickets`) that the last split of each
# (head, query) resets: MLX inputs are const, the counter is written through a cast.
# Metal has no device-scope fence before MSL 3.2, so its attend runs unsplit (SPLIT 1: the
# kernel asserts it); its stand-ins only have to compile, they are never reached.
TICKETS = {
    "metal": """#define DS4_DEVICE_TICKETS 0
inline void ds4_device_fence() {}
inline uint32_t ds4_device_ticket(const device uint32_t* p) { return *p; }
inline void ds4_ticket_reset(const device uint32_t* p) {}
inline float ds4_load_cg(const device float* p) { return *p; }
""",
    "cuda": """#define DS4_DEVICE_TICKETS 1
__device__ __forceinline__ void ds4_device_fence() { __threadfence(); }
__device__ __forceinline__ uint32_t ds4_device_ticket(const uint32_t* p) { return atomicAdd(const_cast<uint32_t*>(p), 1u); }
__device__ __forceinline__ void ds4_ticket_reset(const uint32_t* p) { atomicExch(const_cast<uint32_t*>(p), 0u); }
__device__ __forceinline__ float ds4_load_cg(const float* p) { return __ldcg(p); }
""",
}


# index_topk's body: index_score_heads (its names that topk declares again renamed), the
# last-threadgroup hand-off, topk; each section's text as in its own kernel
INDEX_TOPK = ("index_topk_names", "index_score_heads", "index_topk_last", "topk")


# attend's text serves one launch (R = 1: these defines) and R sessions' decode queries at once
# (attend_rows: `attend_rows_defines`); see the attend comment in the .metal file
ATTEND_ONE = "#define DS4_ATTEND_ROWS 1\n#define DS4_ATTEND_HEADS 0\n#define DS4_ATTEND_SELECT\n"


def kernel_sources(kind: str, face: str, attend: str = ATTEND_ONE) -> tuple[str, str]:
    """(header, body) of 'index_score', 'index_score_heads', 'topk', 'index_topk' or 'attend'
    for `face` ('metal' or 'cuda'); `attend`: attend's defines (attend_rows: its own)."""
    if kind == "index_topk":
        header, body = shared_sources(SOURCE, face, INDEX_TOPK[0])
        sec = dispatch.sections(SOURCE)
        return header + TICKETS[face], body + "".join(sec[k] for k in INDEX_TOPK[1:])
    header, body = shared_sources(SOURCE, face, kind)
    if kind == "attend":
        header += TRIG[face] + TICKETS[face] + attend
    return header, body


ROW_INPUTS = ("q", "keys", "rows", "idx", "cnt", "meta")  # attend_rows: one input per row each
_ROW_TYPES = {"q": "T", "keys": "TK", "rows": "TK", "idx": "int", "cnt": "int", "meta": "int"}


def attend_rows_defines(n: int) -> str:
    """The header defines of attend_rows for n rows: row r's q_r, keys_r, ... chosen by the
    threadgroup's y index, o the row's [NH, 1, D] slice of o_rows (HEADS: a template constant)."""
    select = dispatch.row_select(n, {name: _ROW_TYPES[name] for name in ROW_INPUTS}, macro="DS4_ROW_PICK")
    return (
        f"#define DS4_ATTEND_ROWS {n}\n#define DS4_ATTEND_HEADS HEADS\n{select}"
        "#define DS4_ATTEND_SELECT DS4_ROW_PICK DS4_DEV T* o = o_rows + uint64_t(row) * uint64_t(HEADS) * uint64_t(D);\n"
    )


def attend_rows_io(n: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of attend_rows for n rows."""
    return dispatch.row_inputs(ROW_INPUTS, n) + ["sinks", "rope", "prm", "tickets"], ["o_rows", "part"]


@cache
def _rows_kernel(n: int) -> Kernel:
    faces = {face: kernel_sources("attend", face, attend_rows_defines(n)) for face in ("metal", "cuda")}
    return Kernel(f"ds4mlx_attend_rows{n}", *attend_rows_io(n), **faces)


@cache
def _kernel(kind: str) -> Kernel:
    inputs, outputs = _INPUTS[kind]
    return Kernel(
        f"ds4mlx_{kind}", inputs, outputs, metal=kernel_sources(kind, "metal"), cuda=kernel_sources(kind, "cuda")
    )


@lru_cache(maxsize=64)
def _f32s(a: float, b: float) -> mx.array:
    return mx.array([a, b], dtype=mx.float32)


def _meta(*vals) -> mx.array:
    return mx.array([int(v) for v in vals], dtype=mx.int32)


_META_LOCK = threading.Lock()
_META_KEYS: dict[tuple, int] = {}  # (lead, *rest) -> offset in the step's one meta array
_META_BASE: dict = {}  # "cur": (base, mask, views' offsets) of that array: constants
_META_STEP: dict = {}  # "cur": (pos, {key: meta}), the metas of the latest `pos` (the step traced)
_META_ROWS: dict = {}  # "cur": (positions, {key: [T, len] metas}), the latest rows' (`_row_metas`)


def expect_step(window: int, rows: int, index_rows: int | None = None) -> None:
    """Announce the metas a decode step's `attend_at` (a window-row ring and `rows` capacity
    rows; 0: none) and, with `index_rows`, its `index_scores` / `topk_select` will ask for,
    before the step is traced: every meta of one step then comes out of one launch (one
    multiply-add over constants, each meta a view of it) instead of one per distinct meta.
    An optimization only: a meta not announced costs its own launch (models/deepseek_v4.py's
    `LayerCache.static_state` announces its layer's)."""
    _expect((2, window, rows, 1))
    if index_rows is not None:
        _expect((1, index_rows, 1))


def _expect(key: tuple) -> None:
    with _META_LOCK:
        if key not in _META_KEYS:
            _META_KEYS[key] = sum(k[0] + len(k) - 1 for k in _META_KEYS)


def _meta_base() -> tuple:
    with _META_LOCK:
        cur = _META_BASE.get("cur")
        if cur is None or len(cur[2]) != len(_META_KEYS):
            base, mask = [], []
            for lead, *rest in _META_KEYS:
                base += [0] * lead + rest
                mask += [1] * lead + [0] * len(rest)
            arrays = (mx.array(base, dtype=mx.int32), mx.array(mask, dtype=mx.int32))
            mx.eval(*arrays)  # constants: allowed (and kept) even while a step is traced
            cur = _META_BASE["cur"] = (*arrays, dict(_META_KEYS))
        return cur


def _meta_at(pos, lead: int, *rest) -> mx.array:
    """meta = [pos] * lead + rest; `pos` a host int, or an int32 array (the compiled decode
    step: every meta of one `pos` a view of one multiply-add over two constants, no host
    value; `expect_step` lays them out)."""
    if not isinstance(pos, mx.array):
        return _meta(*([pos] * lead), *rest)
    key = (lead, *rest)
    return _metas_over(_META_STEP, pos, [key])[key]


def _metas_over(store: dict, pos: mx.array, keys: list) -> dict:
    """Every announced meta of the int32 position(s) `pos` (a scalar: one row's; [T]: each
    row's, [T, len]) as views of one multiply-add over `_meta_base`'s constants, cached in
    `store` while `pos` is the same array and holds `keys`."""
    for key in keys:
        _expect(key)
    cur = store.get("cur")  # held, so `is` never matches a reused id
    if cur is None or cur[0] is not pos or any(key not in cur[1] for key in keys):
        base, mask, offsets = _meta_base()
        p = pos.astype(mx.int32)
        every = base + p * mask if pos.ndim == 0 else base[None] + p[:, None] * mask[None]
        cur = store["cur"] = (pos, {k: every[..., o : o + k[0] + len(k) - 1] for k, o in offsets.items()})
    return cur[1]


def _row_metas(poss: list, lead: int, rests: list) -> list:
    """`_meta_at(poss[b], lead, *rests[b])` of each query row b; where the rows' positions are
    views of one array (runtime/forward_context.py's `RowPositions`: a batched step's or a
    verify chain's rows), every row's metas come out of one multiply-add over it, each a view
    (else one launch per row)."""
    src = getattr(poss, "all", None)
    if not isinstance(src, mx.array) or src.shape != (len(poss),):
        return [_meta_at(p, lead, *r) for p, r in zip(poss, rests)]
    keys = [(lead, *r) for r in rests]
    metas = _metas_over(_META_ROWS, src, keys)
    return [metas[key][b : b + 1].squeeze(0) for b, key in enumerate(keys)]  # views: `a[b]` is a gather


def _face(backend: str | None) -> str:
    return dispatch.backend() if backend is None else backend


def model_face() -> str | None:
    """The face the model's fused attention path should use, or None for its plain path.

    Opt-in (`DS4MLX_SPARSE_ATTENTION=1`): measured slower than the plain MLX graph
    (indexer + top-k and the attention core; docs/bench-history.md, "Kernels"), so the model
    keeps its plain path unless asked."""
    if FORCE_FACE is not None:
        return FORCE_FACE
    if os.environ.get("DS4MLX_SPARSE_ATTENTION", "") not in ("1", "true", "yes"):
        return None
    face = dispatch.backend()
    return None if face == "reference" else face


def causal_limits(s: int, c: int, ratio: int, n: int) -> mx.array:
    """[C] int32: how many compressed rows each query of the chunk may see."""
    return mx.minimum((s + mx.arange(c, dtype=mx.int32) + 1) // ratio, n)


def _rows2d(a: mx.array, d: int) -> mx.array:
    return a.reshape(-1, d)


# --------------------------------------------------------------------------- indexer scores


def score_layout(n: int, c: int) -> str:
    """'rows' when a thread per row already launches enough threadgroups (prefill chunks),
    else 'heads' (decode: at 512 rows 'rows' launches 4 threadgroups for 64 heads x 128)."""
    return "rows" if c * -(-n // SCORE_THREADS) >= SCORE_FILL else "heads"


def score_rows(n: int, c: int) -> int:
    """Rows per index_score_heads threadgroup: a power of two from 2 to SCORE_ROWS_MAX, about
    SCORE_GROUPS threadgroups in all."""
    want, rows = -(-n * c // SCORE_GROUPS), 2
    while rows < want and rows < SCORE_ROWS_MAX:
        rows *= 2
    return rows


def index_scores(
    q: mx.array,
    w: mx.array,
    keys: mx.array,
    *,
    n: int,
    s: int,
    ratio: int,
    scale: float,
    backend: str | None = None,
    layout: str | None = None,
) -> mx.array:
    """q [NH, C, DI], w [C, NH], keys [>= n, DI] -> scores [C, n] float32.  `layout` 'rows' /
    'heads' picks the GPU kernel (None: `score_layout`, 'heads' once its self-test passed)."""
    nh, c, di = q.shape
    keys = _rows2d(keys, di)
    if w.shape != (c, nh) or keys.shape[0] < n:
        raise ValueError(f"index_scores: q {q.shape}, w {w.shape}, keys {keys.shape}, n {n}")
    face = _face(backend)
    if face == "reference" or n == 0:
        k = keys[:n].astype(mx.float32)
        dots = mx.maximum(q.astype(mx.float32) @ k.T, 0.0)  # [NH, C, n]
        ww = w.astype(mx.float32) * scale  # [C, NH]
        sc = (ww[:, None, :] @ dots.swapaxes(0, 1)).squeeze(1)  # [C, n]
        live = mx.arange(n)[None] < causal_limits(s, c, ratio, n)[:, None]
        return mx.where(live, sc, -mx.inf)
    if layout is None:
        layout = score_layout(n, c)
        if layout == "heads" and not _verified("index_heads", face):
            layout = "rows"
    if layout == "heads":  # ROWS rows a threadgroup, the heads shared out over its SIMD groups
        rows = score_rows(n, c)
        name, tile, threads, blocks = "index_score_heads", ("ROWS", rows), SCORE_SPLIT_THREADS, -(-n // rows)
    else:  # one row a thread, HG heads staged at a time
        name, tile, threads = "index_score", ("HG", min(SCORE_HEADS, nh)), SCORE_THREADS
        blocks = -(-n // SCORE_THREADS)
    return _kernel(name)(
        face,
        inputs=[q, w, keys, f32_scalar(float(scale)), _meta_at(s, 1, n, c)],
        template=[
            ("TQ", q.dtype),
            ("TW", w.dtype),
            ("TK", keys.dtype),
            ("NH", nh),
            ("DI", di),
            tile,
            ("RATIO", int(ratio)),
            ("THREADS", threads),
        ],
        grid=(blocks * threads, c, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(c, n)],
        output_dtypes=[mx.float32],
    )[0]


# --------------------------------------------------------------------------- top-k


def topk_select(scores: mx.array, k: int, *, s: int, ratio: int, backend: str | None = None):
    """scores [C, N] float32 -> (idx [C, k] int32 ascending, cnt [C] int32)."""
    c, n = scores.shape
    face = _face(backend)
    if face == "reference":
        lim = causal_limits(s, c, ratio, n)
        cnt = mx.minimum(lim, k).astype(mx.int32)
        if n <= k:
            idx = mx.broadcast_to(mx.arange(k, dtype=mx.int32), (c, k))
        else:
            masked = mx.where(mx.arange(n)[None] < lim[:, None], scores, -mx.inf)
            idx = mx.sort(mx.argpartition(-masked, kth=k - 1, axis=-1)[:, :k], axis=-1).astype(mx.int32)
        idx = mx.where(mx.arange(k)[None] < cnt[:, None], idx, 0)
        return idx, cnt
    idx, cnt = _kernel("topk")(
        face,
        inputs=[scores.astype(mx.float32), _meta_at(s, 1, n, c)],
        template=[("TOPK", int(k)), ("RATIO", int(ratio)), ("THREADS", TOPK_THREADS)],
        grid=(TOPK_THREADS, c, 1),
        threadgroup=(TOPK_THREADS, 1, 1),
        output_shapes=[(c, k), (c,)],
        output_dtypes=[mx.int32, mx.int32],
    )
    return idx, cnt


def index_topk(
    q: mx.array,
    w: mx.array,
    keys: mx.array,
    k: int,
    *,
    n: int,
    s: int,
    ratio: int,
    scale: float,
    backend: str | None = None,
    fused: bool | None = None,
):
    """`topk_select(index_scores(q, w, keys, ...), k, ...)` -> (idx [C, k] int32, cnt [C] int32).

    With `fused` (None: `index_topk_fuses`) ONE launch, index_topk: the 'heads' layout's
    scores, and the last threadgroup of each query to finish them (a ticket) runs the top-k
    on them; the same idx / cnt as the two launches (bit for bit: the same scores, and the
    top-k's result does not depend on its thread count).  Otherwise the two launches."""
    nh, c, di = q.shape
    face = _face(backend)
    if fused is None:
        fused = index_topk_fuses(face, n, c)
    if not fused:
        scores = index_scores(q, w, keys, n=n, s=s, ratio=ratio, scale=scale, backend=face)
        return topk_select(scores, k, s=s, ratio=ratio, backend=face)
    return _launch_index_topk(face, q, w, keys, k, n, s, ratio, scale)[1:]


def _launch_index_topk(face, q, w, keys, k, n, s, ratio, scale) -> list[mx.array]:
    """The index_topk launch -> [scores [C, n] float32, idx [C, k], cnt [C]]."""
    nh, c, di = q.shape
    keys = _rows2d(keys, di)
    if w.shape != (c, nh) or keys.shape[0] < n or n == 0:
        raise ValueError(f"index_topk: q {q.shape}, w {w.shape}, keys {keys.shape}, n {n}")
    rows = score_rows(n, c)
    return _kernel("index_topk")(
        face,
        inputs=[q, w, keys, f32_scalar(float(scale)), _meta_at(s, 1, n, c), dispatch.tickets("index_topk", c, 64)],
        template=_topk_template(q, w, keys, rows, ratio, k),
        grid=(-(-n // rows) * SCORE_SPLIT_THREADS, c, 1),
        threadgroup=(SCORE_SPLIT_THREADS, 1, 1),
        output_shapes=[(c, n), (c, k), (c,)],
        output_dtypes=[mx.float32, mx.int32, mx.int32],
    )


_TOPK_ROW_IN = {"q": "TQ", "w": "TW", "keys": "TK", "meta": "int"}


def index_topk_rows_prologue(n: int) -> str:
    """The body prologue of index_topk_rows for n rows: row r's inputs and outputs under the
    kernel's usual names (the query index DS4_QY is 0: the header defines it), and the early
    return of a threadgroup past its row's score groups (the grid covers the largest row)."""
    # (the row index is `it_row`: topk declares a `row` of its own)
    pick = dispatch.row_select(n, _TOPK_ROW_IN, {"scores": "float"}, macro="DS4_IT_PICK", row="it_row")
    return (
        pick
        + "const uint32_t it_row = tgy;\nDS4_IT_PICK\n"
        + "DS4_DEV int* idx = idx_rows + uint64_t(it_row) * uint64_t(TOPK);\n"
        + "DS4_DEV int* cnt = cnt_rows + it_row;\n"
        + "if (tgx >= uint32_t((meta[1] + ROWS - 1) / ROWS)) {\n    return;\n}\n"
    )


def index_topk_rows_io(n: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of index_topk_rows for n rows."""
    ins = dispatch.row_inputs(_TOPK_ROW_IN, n) + ["prm", "tickets"]
    return ins, dispatch.row_inputs(["scores"], n) + ["idx_rows", "cnt_rows"]


@cache
def _topk_rows_kernel(n: int) -> Kernel:
    faces = {}
    for face in ("metal", "cuda"):
        header, body = kernel_sources("index_topk", face)
        index = dispatch.INDEX[face]
        assert body.startswith(index)
        faces[face] = ("#define DS4_QY 0u\n" + header, index + index_topk_rows_prologue(n) + body[len(index) :])
    return Kernel(f"ds4mlx_index_topk_rows{n}", *index_topk_rows_io(n), **faces)


def index_topk_rows(
    qs: list, ws: list, keys: list, k: int, *, ns: list, poss: list, ratio: int, scale: float, backend=None
):
    """`index_topk` of B sessions' decode queries in ONE launch (session batching): row b is
    index_topk(qs[b], ws[b], keys[b], k, n=ns[b], s=poss[b], ...), q [NH, 1, DI] and w [1, NH]
    per row -> per row (idx [1, k], cnt [1]), or None where the rows cannot share a launch (not
    the fused one-launch index_topk on this face, one row, unlike shapes or dtypes, a failed
    first-use self-test): the caller then runs index_topk per row."""
    face = _face(backend)
    n_rows = len(qs)
    if face == "reference" or n_rows < 2:
        return None
    nh, c, di = qs[0].shape[-3:]
    alike = c == 1 and all(
        q.shape[-3:] == (nh, 1, di) and q.dtype == qs[0].dtype and w.shape[-1] == nh and w.dtype == ws[0].dtype
        and kk.shape[-1] == di and kk.dtype == keys[0].dtype and 0 < n <= kk.shape[-2]
        for q, w, kk, n in zip(qs, ws, keys, ns)
    )  # fmt: skip
    if not alike or not all(index_topk_fuses(face, n, 1) for n in ns):
        return None
    if not _verified("index_topk_rows", face):
        return None
    return _launch_index_topk_rows(face, qs, ws, keys, k, ns, poss, ratio, scale)[1]


def _launch_index_topk_rows(face, qs, ws, keys, k, ns, poss, ratio, scale) -> tuple[list, list]:
    """The index_topk_rows launch -> (the rows' scores [1, n_b] float32, the rows' (idx, cnt))."""
    n_rows = len(qs)
    nh, _, di = qs[0].shape[-3:]
    keys = [_rows2d(kk, di) for kk in keys]
    rows = score_rows(max(ns), 1)
    metas = _row_metas(poss, 1, [(n, 1) for n in ns])
    out = _topk_rows_kernel(n_rows)(
        face,
        inputs=[*qs, *ws, *keys, *metas, f32_scalar(float(scale)), dispatch.tickets("index_topk_rows", n_rows, 64)],
        template=_topk_template(qs[0], ws[0], keys[0], rows, ratio, k),
        grid=(-(-max(ns) // rows) * SCORE_SPLIT_THREADS, n_rows, 1),
        threadgroup=(SCORE_SPLIT_THREADS, 1, 1),
        output_shapes=[*[(1, n) for n in ns], (n_rows, k), (n_rows,)],
        output_dtypes=[mx.float32] * n_rows + [mx.int32, mx.int32],
    )
    idx, cnt = out[n_rows], out[n_rows + 1]
    return out[:n_rows], [(idx[b : b + 1], cnt[b : b + 1]) for b in range(n_rows)]


def _topk_template(q, w, keys, rows: int, ratio: int, k: int) -> list:
    """index_topk's template arguments (one launch and index_topk_rows)."""
    nh, di = q.shape[-3], q.shape[-1]
    dtypes = [("TQ", q.dtype), ("TW", w.dtype), ("TK", keys.dtype)]
    return dtypes + [("NH", nh), ("DI", di), ("ROWS", rows), ("RATIO", int(ratio)), ("THREADS", SCORE_SPLIT_THREADS), ("TOPK", int(k))]  # fmt: skip


def index_topk_fuses(face: str, n: int, c: int) -> bool:
    """Whether `index_topk` runs as one launch on `face`: on CUDA only (Metal has no device-wide
    fence here: `TICKETS`), where the two launches would use the 'heads' layout (decode), once
    the 'heads' layout and the fused kernel have passed their first-use self-tests."""
    return (
        face == "cuda"
        and n > 0
        and score_layout(n, c) == "heads"
        and _verified("index_heads", face)
        and _verified("index_topk", face)
    )


# --------------------------------------------------------------------------- attention


def window_positions(length: int, s: int, ring_last: int, window: int) -> mx.array:
    """[L] int32: the position held by each window key (< 0: empty ring slot)."""
    j = mx.arange(length, dtype=mx.int32)
    mod = ((ring_last - j) % window + window) % window
    return mx.where(j < window, ring_last - mod, s + (j - window))


def sparse_attention(
    q: mx.array,
    keys: mx.array,
    rows: mx.array | None,
    idx: mx.array | None,
    cnt: mx.array | None,
    sinks: mx.array,
    *,
    n: int,
    s: int,
    ring_last: int,
    window: int,
    ratio: int,
    scale: float,
    backend: str | None = None,
) -> mx.array:
    """Attention of q [NH, C, D] over the window keys and compressed rows -> [NH, C, D] in q.dtype."""
    nh, c, d = q.shape
    keys = _rows2d(keys, d)
    length = keys.shape[0]
    if length < window or (rows is None and n):
        raise ValueError(f"sparse_attention: {length} window keys for a window of {window}, or no rows for n={n}")
    if rows is not None:
        rows = _rows2d(rows, d)
    face = _face(backend)
    if face == "reference":
        return _attend_reference(q, keys, rows, idx, cnt, sinks, n, s, ring_last, window, ratio, scale)
    if n == 0 or rows is None:
        rows, n = None, 0
    return _launch_attend(face, q, keys, rows, idx, cnt, sinks, scale, _meta(s, ring_last, length, n, c), window, ratio)


def step_face() -> str | None:
    """The face of the compiled decode step's attention (`attend_at`), or None for its plain
    graph.  On by default on a GPU: in the static step it replaces the keys / mask
    concatenation and SDPA's unfused decode graph (~8 launches) with one launch;
    ``DS4MLX_SPARSE_ATTENTION=0`` turns it off."""
    if FORCE_FACE is not None:
        return FORCE_FACE
    if os.environ.get("DS4MLX_SPARSE_ATTENTION", "").strip().lower() in ("0", "false", "no"):
        return None
    face = dispatch.backend()
    return None if face == "reference" else face


def attend_splits(face: str, c: int, n_virt: int) -> int:
    """Key splits per (head, query) for `n_virt` candidate keys: one per ATTN_SPLIT_KEYS up to
    ATTN_SPLIT_MAX at decode on CUDA; 1 for prefill chunks (C x NH threadgroups fill the GPU)
    and on Metal (no device-wide fence for the merge)."""
    if face != "cuda" or c != 1:
        return 1
    return max(1, min(ATTN_SPLIT_MAX, -(-n_virt // ATTN_SPLIT_KEYS)))


def attend_at(
    q: mx.array,
    ring: mx.array,
    rows: mx.array | None,
    idx: mx.array | None,
    cnt: mx.array | None,
    sinks: mx.array,
    pos: mx.array,
    *,
    ratio: int,
    scale: float,
    backend: str | None = None,
    out_rope=None,
    splits: int | None = None,
) -> mx.array:
    """`sparse_attention` for one query at position `pos` (an int32 array: the compiled
    decode step), over the ring [W, D] just written at slot pos % W and every capacity row
    of `rows` [cap, D] (masked to the (pos + 1) // ratio live ones inside), or the
    selected rows idx [1, k] / cnt [1].  q [..., NH, 1, D] -> the same shape; ring [..., W, D]
    (leading axes of 1: the launch reads both flat, so the decode step passes its arrays
    without a squeeze or reshape node).

    `out_rope` (the layer's models.layers.RoPE): the output gets its inverse rope at `pos`
    (``out_rope(o, offset=pos, scale=-1.0)``), in the kernel's epilogue on a GPU face.
    `splits`: key splits per head (None: `attend_splits`, once its self-test passed)."""
    nh, c, d = q.shape[-3:]
    window = ring.shape[-2]
    n = 0 if rows is None else rows.shape[0]
    face = _face(backend)
    if face == "reference":
        q3, ring2 = q.reshape(nh, c, d), ring.reshape(window, d)
        out = _attend_reference(q3, ring2, rows, idx, cnt, sinks, n, pos, pos, window, max(ratio, 1), scale)
        out = out if out_rope is None else out_rope(out[None], offset=pos, scale=-1.0)[0]
        return out.reshape(q.shape)
    in_kernel = out_rope is not None and out_rope.dims <= d and _verified("attend_rope", face, out_rope)
    if splits is None:
        splits = attend_splits(face, c, window + (n if idx is None else idx.shape[1]))
        if splits > 1 and not _verified("attend_split", face):
            splits = 1
    meta = _meta_at(pos, 2, window, n, 1)  # [s, ring_last, length, n, c]
    out = _launch_attend(
        face,
        q,
        ring,
        rows,
        idx,
        cnt,
        sinks,
        scale,
        meta,
        window,
        max(ratio, 1),
        out_rope if in_kernel else None,
        splits,
    )
    if out_rope is not None and not in_kernel:
        out = out_rope(out.reshape(1, nh, c, d), offset=pos, scale=-1.0).reshape(q.shape)
    return out


def attend_rows(
    qs: list,
    rings: list,
    rows: list,
    idxs: list,
    cnts: list,
    sinks: mx.array,
    poss: list,
    *,
    ratio: int,
    scale: float,
    out_rope=None,
    backend: str | None = None,
) -> mx.array | None:
    """`attend_at` for B sessions' decode queries in ONE launch (session batching): row b is
    attend_at(qs[b], rings[b], rows[b], idxs[b], cnts[b], sinks, poss[b], ...) with q [1, NH,
    1, D] and ring [1, 1, W, D] per row.  -> [B, NH, 1, D], or None where the rows cannot share
    a launch (the CPU / reference face, one row, rows unlike in window, dtype, selection or
    top-k, an epilogue rope the kernel does not take, or a failed first-use self-test): the
    caller then runs attend_at per row.  Each row of a launch costs about what a launch of
    one costs (a decode query leaves most of the GPU idle): B rows in one launch instead of B."""
    face = _face(backend)
    n_rows = len(qs)
    if face == "reference" or n_rows < 2:
        return None
    nh, c, d = qs[0].shape[-3:]
    window = rings[0].shape[-2]
    selected = idxs[0] is not None
    with_rows = rows[0] is not None
    alike = (
        c == 1
        and all(q.shape == qs[0].shape and q.dtype == qs[0].dtype for q in qs)
        and all(r.shape[-2] == window and r.dtype == rings[0].dtype for r in rings)
        and all((r is not None) == with_rows for r in rows)
        and all((i is not None) == selected for i in idxs)
        and (not selected or all(i.shape == idxs[0].shape for i in idxs))
    )
    if not alike or (out_rope is not None and out_rope.dims > d):
        return None
    if not _verified("attend_rows", face, out_rope):
        return None
    ns = [0 if r is None else r.shape[0] for r in rows]
    virt = max(window + (n if not selected else idxs[0].shape[1]) for n in ns)
    splits = attend_splits(face, 1, virt)
    if splits > 1 and not _verified("attend_split", face):
        splits = 1
    metas = _row_metas(poss, 2, [(window, n, 1) for n in ns])
    return _launch_attend_rows(
        face, qs, rings, rows, idxs, cnts, sinks, scale, metas, window, max(ratio, 1), out_rope, splits
    )


def _launch_attend_rows(face, qs, keys, rows, idxs, cnts, sinks, scale, metas, window, ratio, rope, splits) -> mx.array:
    """attend_rows' launch: the per-row inputs of `_launch_attend`, one each per row."""
    n_rows = len(qs)
    nh, _, d = qs[0].shape[-3:]
    kdt = keys[0].dtype
    dummy_rows = mx.zeros((1, d), kdt) if any(r is None for r in rows) else None
    rows = [dummy_rows if r is None else (r if r.dtype == kdt else r.astype(kdt)) for r in rows]
    selected = idxs[0] is not None
    if not selected:
        idxs, cnts = [mx.zeros((1, 1), mx.int32)] * n_rows, [mx.zeros((1,), mx.int32)] * n_rows
    rd = 0 if rope is None else rope.dims
    periods = rope.periods if rd else placeholder(mx.float32)
    mscale = 1.0 if rope is None else float(rope.attention_factor)
    split = splits > 1
    per_row = [*qs, *keys, *rows, *idxs, *cnts, *metas]
    return _rows_kernel(n_rows)(
        face,
        inputs=[
            *per_row,
            sinks,
            periods,
            _f32s(float(scale), mscale),
            dispatch.tickets("attend_rows", n_rows * nh, 4096),
        ],
        template=_attend_template(qs[0], kdt, sinks, window, ratio, idxs[0], selected, rd, splits) + [("HEADS", nh)],
        grid=(nh * ATTN_THREADS, n_rows, int(splits)),
        threadgroup=(ATTN_THREADS, 1, 1),
        output_shapes=[(n_rows, nh, 1, d), (n_rows * nh * splits * (d + 2) if split else 1,)],
        output_dtypes=[qs[0].dtype, mx.float32],
    )[0]


def _attend_template(q, kdt, sinks, window: int, ratio: int, idx, selected: bool, rd: int, splits: int) -> list:
    """attend's template arguments (one launch and attend_rows, which adds HEADS)."""
    d = q.shape[-1]
    kinds = [("T", q.dtype), ("TK", kdt), ("TS", sinks.dtype), ("D", d), ("W", int(window)), ("RATIO", int(ratio))]
    sizes = [("TOPK", idx.shape[1]), ("THREADS", ATTN_THREADS), ("KB", ATTN_KEYS), ("SELECTED", selected)]
    return kinds + sizes + [("RD", rd), ("SPLIT", int(splits))]


def _launch_attend(face, q, keys, rows, idx, cnt, sinks, scale, meta, window, ratio, rope=None, splits=1) -> mx.array:
    """The attend kernel's GPU launch: keys [L, D] (window first), rows [n, D] or None,
    idx [C, k] / cnt [C] or None (every causal row), meta [s, ring_last, L, n, C]; `rope`
    a RoPE whose inverse the epilogue applies at each query's position; `splits` key
    splits per (head, query).  q [..., NH, C, D] (read flat; the output has q's shape)."""
    nh, c, d = q.shape[-3:]
    if rows is None:
        rows = mx.zeros((1, d), keys.dtype)
    elif rows.dtype != keys.dtype:
        rows = rows.astype(keys.dtype)
    selected = idx is not None
    if not selected:
        idx, cnt = mx.zeros((1, 1), mx.int32), mx.zeros((1,), mx.int32)
    rd = 0 if rope is None else rope.dims
    periods = rope.periods if rd else placeholder(mx.float32)
    mscale = 1.0 if rope is None else float(rope.attention_factor)
    split = splits > 1
    return _kernel("attend")(
        face,
        inputs=[
            q,
            keys,
            rows,
            idx,
            cnt,
            sinks,
            periods,
            _f32s(float(scale), mscale),
            meta,
            dispatch.tickets("attend", nh * c, 4096),
        ],
        template=_attend_template(q, keys.dtype, sinks, window, ratio, idx, selected, rd, splits),
        grid=(nh * ATTN_THREADS, c, int(splits)),
        threadgroup=(ATTN_THREADS, 1, 1),
        output_shapes=[q.shape, (nh * c * splits * (d + 2) if split else 1,)],
        output_dtypes=[q.dtype, mx.float32],
    )[0]


# --------------------------------------------------------------------------- first-use self-tests
#
# A variant dispatch.UNVERIFIED_KERNELS names (today attend's rows: only its self-test has run
# on a GPU) is compared with the reference face once per face before the automatic choice uses
# it; a failure keeps the verified layout.


def _verified(kind: str, face: str, rope=None) -> bool:
    return auto_face(f"sparse_attention.{kind}", lambda f: _self_test(kind, f, rope)) == face


def _self_test(kind: str, face: str, rope=None) -> bool:
    key = mx.random.split(mx.random.key(7), 6)
    if kind == "index_heads":
        nh, di, n, s = 12, 40, 70, 290
        q, w = mx.random.normal((nh, 1, di), key=key[0]), mx.random.normal((1, nh), key=key[1])
        keys = mx.random.normal((n + 3, di), key=key[2])
        kw = dict(n=n, s=s, ratio=4, scale=0.1)
        got = index_scores(q, w, keys, **kw, backend=face, layout="heads")
        with mx.stream(mx.cpu):  # float32 matmuls on MLX CUDA are TF32: the reference runs on the CPU
            want = index_scores(q, w, keys, **kw, backend="reference")
        return close_enough(got, want, rtol=1e-4, atol=1e-4)
    if kind == "index_topk":
        return _index_topk_self_test(face, key)
    if kind == "attend_rows":
        return _attend_rows_self_test(face, key, rope)
    if kind == "index_topk_rows":
        return _index_topk_rows_self_test(face, key)
    nh, d, window, n, k = 3, 24 + (rope.dims if rope is not None else 0), 8, 30, 6
    q = mx.random.normal((nh, 1, d), key=key[0])
    ring = mx.random.normal((window, d), key=key[1])
    rows = mx.random.normal((n, d), key=key[2])
    sinks = mx.random.normal((nh,), key=key[3])
    idx = mx.sort(mx.random.permutation(n, key=key[4])[:k]).astype(mx.int32)[None]
    cnt = mx.array([k], mx.int32)
    pos = mx.array(4 * n + 3, mx.int32)
    splits, meta = (3 if kind == "attend_split" else 1), _meta_at(pos, 2, window, n, 1)
    for sel in ((idx, cnt), (None, None)):  # split: the second launch needs the tickets the first reset
        got = _launch_attend(face, q, ring, rows, *sel, sinks, d**-0.5, meta, window, 4, rope, splits)
        with mx.stream(mx.cpu):  # not TF32 (MLX CUDA's float32 matmuls): the reference on the CPU
            want = attend_at(
                q, ring, rows, *sel, sinks, pos, ratio=4, scale=d**-0.5, out_rope=rope, backend="reference"
            )
        if not close_enough(got, want, rtol=1e-4, atol=1e-4):
            return False
    return True


def _attend_rows_self_test(face: str, key, rope=None) -> bool:
    """attend_rows on `face` against the reference attend_at of each row: three rows at their
    own positions over their own rings and compressed rows (selected and all rows), unsplit and
    (CUDA) split in 3, each launch twice (the split's tickets must be zero again)."""
    nh, d, window, n, k, b = 3, 24 + (rope.dims if rope is not None else 0), 8, 30, 6, 3
    keys = mx.random.split(key[5], 6 * b)
    qs = [mx.random.normal((1, nh, 1, d), key=keys[i]) for i in range(b)]
    rings = [mx.random.normal((1, 1, window, d), key=keys[b + i]) for i in range(b)]
    rows = [mx.random.normal((n - 2 * i, d), key=keys[2 * b + i]) for i in range(b)]
    idxs = [mx.sort(mx.random.permutation(n - 2 * i, key=keys[3 * b + i])[:k]).astype(mx.int32)[None] for i in range(b)]
    cnts = [mx.array([k - i], mx.int32) for i in range(b)]
    poss = [mx.array(4 * (n - 2 * i) + i, mx.int32) for i in range(b)]
    sinks = mx.random.normal((nh,), key=key[3])
    scale = d**-0.5
    for splits in (1, 3) if face == "cuda" else (1,):
        for sel_i, sel_c in ((idxs, cnts), ([None] * b, [None] * b)):
            metas = [_meta_at(int(p.item()), 2, window, r.shape[0], 1) for p, r in zip(poss, rows)]
            for _ in range(2):
                got = _launch_attend_rows(
                    face, qs, rings, rows, sel_i, sel_c, sinks, scale, metas, window, 4, rope, splits
                )
                with mx.stream(mx.cpu):  # not TF32 (MLX CUDA's float32 matmuls): the reference on the CPU
                    want = mx.concatenate(
                        [
                            attend_at(q, g, r, i, c, sinks, p, ratio=4, scale=scale, out_rope=rope, backend="reference")
                            for q, g, r, i, c, p in zip(qs, rings, rows, sel_i, sel_c, poss)
                        ]
                    )
                if not close_enough(got, want, rtol=1e-4, atol=1e-4):
                    return False
    return True


def _index_topk_rows_self_test(face: str, key) -> bool:
    """index_topk_rows on `face`: three rows of their own keys, counts and positions (more live
    rows than k, fewer, and a row whose grid share is smaller than another's), each launch
    twice (its tickets must be zero again): every row's scores near the reference's, its idx /
    cnt the reference top-k of those scores."""
    nh, di, k = 12, 40, 64
    ks = mx.random.split(key[5], 9)
    ns = [700, 300, 90]
    qs = [mx.random.normal((nh, 1, di), key=ks[i]) for i in range(3)]
    ws = [mx.random.normal((1, nh), key=ks[3 + i]) for i in range(3)]
    keys = [mx.random.normal((n + 3, di), key=ks[6 + i]) for i, n in enumerate(ns)]
    for poss in ([4 * ns[0] + 1, 4 * k - 9, 4 * ns[2] - 2], [4 * k - 9, 4 * ns[1] + 3, 4 * ns[2] + 1]) * 2:
        scores, sel = _launch_index_topk_rows(face, qs, ws, keys, k, ns, poss, 4, 0.1)
        for b, (n, s) in enumerate(zip(ns, poss)):
            kw = dict(n=n, s=s, ratio=4, scale=0.1)
            with mx.stream(mx.cpu):  # float32 matmuls on MLX CUDA are TF32: the reference runs on the CPU
                want = index_scores(qs[b], ws[b], keys[b], **kw, backend="reference")
                ref = topk_select(scores[b], k, s=s, ratio=4, backend="reference")
            lim = min(n, (s + 1) // 4)
            if not close_enough(scores[b][:, :lim], want[:, :lim], rtol=1e-4, atol=1e-4):
                return False
            if not all(mx.array_equal(g, v).item() for g, v in zip(sel[b], ref)):
                return False
    return True


def _index_topk_self_test(face: str, key) -> bool:
    """index_topk (one launch) on `face`: its scores near the reference's, its idx / cnt the
    reference top-k of those scores, and all three bit for bit those of index_score_heads +
    topk (two launches); over several threadgroups per query, with more live rows than k and
    (a second query position) fewer, each case twice (a launch needs the tickets the one
    before it reset)."""
    nh, di, n, k = 12, 40, 700, 64
    q, w = mx.random.normal((nh, 1, di), key=key[0]), mx.random.normal((1, nh), key=key[1])
    keys = mx.random.normal((n + 3, di), key=key[2])
    for s in (4 * n + 1, 4 * k - 9, 4 * n + 1, 4 * k - 9):
        got = _launch_index_topk(face, q, w, keys, k, n, s, 4, 0.1)
        kw = dict(n=n, s=s, ratio=4, scale=0.1)
        scores = index_scores(q, w, keys, **kw, backend=face, layout="heads")
        two = [scores, *topk_select(scores, k, s=s, ratio=4, backend=face)]
        with mx.stream(mx.cpu):  # float32 matmuls on MLX CUDA are TF32: the reference runs on the CPU
            ref_scores = index_scores(q, w, keys, **kw, backend="reference")
            ref = topk_select(got[0], k, s=s, ratio=4, backend="reference")
        lim = min(n, (s + 1) // 4)  # live rows; -inf past them
        if not close_enough(got[0][:, :lim], ref_scores[:, :lim], rtol=1e-4, atol=1e-4):
            return False
        if not mx.all(got[0][:, lim:] == -mx.inf).item():
            return False
        if not all(mx.array_equal(g, v).item() for g, v in zip(got[1:], ref)):
            return False
        if not all(mx.array_equal(g, v).item() for g, v in zip(got, two)):
            return False
    return True


def _attend_reference(q, keys, rows, idx, cnt, sinks, n, s, ring_last, window, ratio, scale):
    nh, c, d = q.shape
    length = keys.shape[0]
    qf, kf = q.astype(mx.float32), keys.astype(mx.float32)
    pos = window_positions(length, s, ring_last, window)[None]  # [1, L]
    tq = (s + mx.arange(c, dtype=mx.int32))[:, None]  # [C, 1]
    wmask = (pos >= 0) & (pos <= tq) & (pos > tq - window)  # [C, L]
    logits = [(qf @ kf.T) * scale]  # [NH, C, L]
    masks = [wmask]
    vals = None
    if n > 0 and idx is not None:
        g = rows[idx].astype(mx.float32)  # [C, k, D]
        logits.append((qf.swapaxes(0, 1) @ g.swapaxes(1, 2)).swapaxes(0, 1) * scale)
        masks.append(mx.arange(idx.shape[1])[None] < cnt[:, None])
        vals = ("gathered", g)
    elif n > 0:
        rf = rows[:n].astype(mx.float32)
        logits.append((qf @ rf.T) * scale)
        masks.append(mx.arange(n)[None] < causal_limits(s, c, ratio, n)[:, None])
        vals = ("all", rf)
    lg = mx.concatenate(logits, axis=-1)
    mask = mx.concatenate(masks, axis=-1)[None]
    lg = mx.where(mask, lg, -mx.inf)
    sink = sinks.astype(mx.float32)[:, None, None]
    m = mx.maximum(lg.max(axis=-1, keepdims=True), sink)
    p = mx.where(mask, mx.exp(lg - m), 0.0)
    z = p.sum(axis=-1, keepdims=True) + mx.exp(sink - m)
    out = p[..., :length] @ kf
    if vals is not None:
        pc = p[..., length:]
        if vals[0] == "gathered":
            out = out + (pc.swapaxes(0, 1) @ vals[1]).swapaxes(0, 1)
        else:
            out = out + pc @ vals[1]
    return (out / z).astype(q.dtype)
