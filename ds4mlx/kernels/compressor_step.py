"""One decode token through one DeepSeek V4 compressor, in one launch on a GPU.

`Compressor.pool_step` (ds4mlx/models/deepseek_v4.py) runs once per compressor per
layer and token in the compiled decode step: the attention's compressor of every CSA
and HCA layer, and the indexer's of every CSA layer.  As MLX ops it is ~12-15 GPU
kernels (two slice updates of the window buffers, each an offset kernel plus a copy,
the position-bias add, the overlap concatenates and `where`s, the float32 softmax, the
weighted sum, the RMSNorm, the rope, the rows slice update); on the H200 each op costs
~16 µs of host time.  The kernel does all of it at once:

``compressor_step(kv, gate, pos, state, *, position_bias, norm, rope, ratio)``
    state = [buf_kv, buf_gate, (ov_kv, ov_gate,) rows] (`CompressorState.static_arrays`),
    kv / gate [1, 1, c*d] this token's projections, pos an int32 array (the compiled
    step's position) -> the new state, same order: buf_kv / buf_gate with row pos % m
    replaced, the overlap rows (CSA: the window's "Ca" half once it is complete), and a
    copy of rows with the window's pooled row at row pos // m once this token completes
    the window (an incomplete window's row is not live: it keeps its old contents and the
    GPU faces skip the pooling, serial over the window).  New arrays, the old state kept
    (the stepper undoes a step / rolls back a speculation with it).

One threadgroup pools (softmax over the window per channel in float32, weighted sum,
RMSNorm with the kv_norm weight, the compress rope on the last rope dims, traditional
pairs); the others copy the rows buffer and the window buffers around the rows the
first one writes.  The reference face is the MLX graph the model ran before (the CPU
runs it: identical numbers).  Sources: ``kernels/metal/compressor_step.metal``, one
text for the Metal and CUDA faces (the face's `dispatch.PRELUDE` / `INDEX`, then the
file's sections without their comments: `dispatch.compact`).

Verified: the reference face against the model's dynamic `Compressor.pool` and a
float64 oracle; the shared text compiled with g++ (emulated threadgroups) and nvcc
(tests/test_kernel_compressor_step.py); its CUDA face on a GPU (``pytest -m gpu
tests/test_kernel_compressor_step.py``).  The rows form ("compressor_step.rows") has passed only
its first-use self-test on a GPU: `dispatch.UNVERIFIED_KERNELS` self-tests it at first use.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from ds4mlx.kernels.dispatch import (
    INDEX,
    METAL_DIR,
    PRELUDE,
    Kernel,
    auto_face,
    close_enough,
    compact,
    row_inputs,
    row_select,
    sections,
)

SOURCE = METAL_DIR / "compressor_step.metal"
THREADS = 256  # threads per threadgroup (the pooling one and the copying ones)
PER = 4  # 16-byte units per thread of a copying threadgroup (16 KB per threadgroup)
FLOAT_TYPES = (mx.float32, mx.bfloat16, mx.float16)

INPUTS = [
    "buf_kv",
    "buf_gate",
    "ov_kv",
    "ov_gate",
    "rows",
    "kv",
    "gate",
    "bias",
    "weight",
    "periods",
    "prm",
    "meta",
    "pos",
]
OUTPUTS = ["buf_kv_out", "buf_gate_out", "ov_kv_out", "ov_gate_out", "rows_out"]


def shared_text() -> tuple[str, str]:
    """(common, body): the kernel's two sections as they are launched, without the face's
    prelude and index block (the g++ emulation adds its own)."""
    sec = sections(SOURCE)
    return compact(sec["common"]), compact(sec["compressor_step"])


def kernel_sources(face: str, defines: str = "") -> tuple[str, str]:
    """(header, body) of the kernel for `face` ('metal' or 'cuda'): only its own text, after
    `defines` (compressor_step_rows: `rows_defines`)."""
    common, body = shared_text()
    return PRELUDE[face] + defines + common, INDEX[face] + body


@cache
def _kernel() -> Kernel:
    return Kernel(
        "ds4mlx_compressor_step",
        INPUTS,
        OUTPUTS,
        metal=kernel_sources("metal"),
        cuda=kernel_sources("cuda"),
    )


ROW_IN = {
    "buf_kv": "T",
    "buf_gate": "T",
    "ov_kv": "T",
    "ov_gate": "T",
    "rows": "T",
    "kv": "TK",
    "gate": "TG",
    "meta": "int",
}
_ROW_OUT = {name: "T" for name in OUTPUTS}
SHARED_IN = ["bias", "weight", "periods", "prm", "poss"]


def rows_defines(n: int) -> str:
    """The defines that make the kernel's text compressor_step_rows for n rows (row r's
    buffers chosen by the threadgroup's y index, the position poss[r])."""
    return f"#define CS_ROWS {n}\n#define CS_POS (poss[row])\n" + row_select(n, ROW_IN, _ROW_OUT, macro="CS_ROW_SELECT")


def rows_io(n: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of compressor_step_rows for n rows."""
    return row_inputs(ROW_IN, n) + SHARED_IN, row_inputs(OUTPUTS, n)


@cache
def _rows_kernel(n: int) -> Kernel:
    inputs, outputs = rows_io(n)
    faces = {face: kernel_sources(face, rows_defines(n)) for face in ("metal", "cuda")}
    return Kernel(f"ds4mlx_compressor_step_rows{n}", inputs, outputs, **faces)


@cache
def params(eps: float, mscale: float, dtype) -> mx.array:
    """(eps, attention factor rounded to the state dtype, as the graph's multiply rounds it)."""
    a = mx.concatenate([mx.array([eps], mx.float32), mx.array([mscale], dtype).astype(mx.float32)])
    mx.eval(a)  # a constant: allowed (and kept) while a step is traced
    return a


@cache
def capacity_meta(cap: int) -> mx.array:
    a = mx.array([cap], mx.int32)
    mx.eval(a)
    return a


def groups(cap: int, ratio: int, dim: int, overlap: bool, itemsize: int) -> int:
    """Threadgroups of one launch: the pooling one plus the copying ones."""
    c = 2 if overlap else 1
    units = (cap * dim + 2 * ratio * c * dim) * itemsize // 16
    return 1 + -(-units // (THREADS * PER))


def supported(state: list, kv: mx.array, gate: mx.array, position_bias: mx.array, rope) -> bool:
    """Whether the GPU faces take these arrays (else the reference face runs): one float
    state dtype, rows a whole number of 16-byte units, the rope within the row."""
    rows = state[-1]
    d = rows.shape[-1]
    dt = rows.dtype
    c = 2 if len(state) == 5 else 1
    m = position_bias.shape[0]
    return (
        dt in FLOAT_TYPES
        and all(a.dtype == dt for a in state)
        and d >= 8  # every input the helpers read is a device buffer on Metal (>= 8 elements)
        and (d * dt.size) % 16 == 0
        and kv.size == c * d
        and gate.size == c * d
        and position_bias.shape == (m, c * d)
        and state[0].shape[-2:] == (m, c * d)
        and 0 < rope.dims <= d
        and rope.dims % 2 == 0
        and kv.dtype in FLOAT_TYPES
        and gate.dtype in FLOAT_TYPES
        and position_bias.dtype in FLOAT_TYPES
    )


def rows_alike(kvs: list, gates: list, states: list, position_bias: mx.array, rope) -> bool:
    """Whether B rows' steps of one compressor can share a launch: each row `supported`, the
    rows alike in dtypes and window layout (their capacities may differ)."""
    first = states[0]
    return all(
        len(st) == len(first)
        and all(a.dtype == f.dtype for a, f in zip(st, first))
        and all(a.shape == f.shape for a, f in zip(st[:-1], first[:-1]))
        and st[-1].shape[-1] == first[-1].shape[-1]
        and kv.dtype == kvs[0].dtype
        and g.dtype == gates[0].dtype
        and supported(st, kv, g, position_bias, rope)
        for st, kv, g in zip(states, kvs, gates)
    )


def _face(backend: str | None) -> str:
    return auto_face("compressor_step", _self_test) if backend is None else backend


def _rows_face(backend: str | None) -> str:
    return auto_face("compressor_step.rows", _rows_self_test) if backend is None else backend


def compressor_step(
    kv: mx.array,
    gate: mx.array,
    pos: mx.array,
    state: list,
    *,
    position_bias: mx.array,
    norm,
    rope,
    ratio: int,
    backend: str | None = None,
) -> list:
    """The new state of one compressor after the token at `pos` (see the module
    docstring).  `norm` is the kv_norm RMSNorm (weight, eps), `rope` the compress
    `models.layers.RoPE`; with 5 state arrays the compressor overlaps (CSA)."""
    face = _face(backend)
    if face == "reference" or not supported(state, kv, gate, position_bias, rope):
        return reference(kv, gate, pos, state, position_bias=position_bias, norm=norm, rope=rope, ratio=ratio)
    return _launch(face, kv, gate, pos, state, position_bias, norm, rope, ratio)


def compressor_step_rows(
    kvs: list,
    gates: list,
    poss: mx.array,
    states: list,
    *,
    position_bias: mx.array,
    norm,
    rope,
    ratio: int,
    backend: str | None = None,
) -> list | None:
    """`compressor_step` of B sessions' tokens through one compressor (session batching) in
    ONE launch: row b is compressor_step(kvs[b], gates[b], poss[b], states[b], ...), poss an
    int32 array [B].  -> the rows' new states, or None where they cannot share a launch (the
    CPU, one row, a layout the kernel does not take, rows of unlike dtype or window layout, a
    failed first-use self-test): the caller then steps each row."""
    face = _rows_face(backend)
    if face == "reference" or len(states) < 2:
        return None
    if not rows_alike(kvs, gates, states, position_bias, rope):
        return None
    return _launch_rows(face, kvs, gates, poss, states, position_bias, norm, rope, ratio)


def _launch_rows(face, kvs, gates, poss, states, position_bias, norm, rope, ratio) -> list:
    n = len(states)
    overlap = len(states[0]) == 5
    dt = states[0][-1].dtype
    d = states[0][-1].shape[-1]
    per = {name: [] for name in ROW_IN}
    shapes = {name: [] for name in OUTPUTS}
    for st, kv, g in zip(states, kvs, gates):
        buf_kv, buf_gate, rows = st[0], st[1], st[-1]
        ov_kv, ov_gate = (st[2], st[3]) if overlap else (buf_kv, buf_gate)  # dummies: not read
        for name, a in zip(ROW_IN, (buf_kv, buf_gate, ov_kv, ov_gate, rows, kv, g, capacity_meta(rows.shape[-2]))):
            per[name].append(a)
        ov_shapes = [st[2].shape, st[3].shape] if overlap else [(1,), (1,)]  # dummies: not written
        for name, shape in zip(OUTPUTS, (buf_kv.shape, buf_gate.shape, *ov_shapes, rows.shape)):
            shapes[name].append(shape)
    cap = max(st[-1].shape[-2] for st in states)
    if poss.dtype != mx.int32:
        poss = poss.astype(mx.int32)
    out = _rows_kernel(n)(
        face,
        inputs=[
            *[a for name in ROW_IN for a in per[name]],
            position_bias,
            norm.weight,
            rope.periods,
            params(float(norm.eps), float(rope.attention_factor), dt),
            poss.reshape(-1),
        ],
        template=template_args(dt, kvs[0], gates[0], position_bias, norm, rope, ratio, d, overlap),
        grid=(groups(cap, ratio, d, overlap, dt.size) * THREADS, n, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[s for name in OUTPUTS for s in shapes[name]],
        output_dtypes=[dt] * (5 * n),
    )
    rows_out = [[out[i * n + b] for i in range(5)] for b in range(n)]  # outputs come name by name
    return rows_out if overlap else [[r[0], r[1], r[4]] for r in rows_out]


def reference(kv, gate, pos, state, *, position_bias, norm, rope, ratio) -> list:
    """The reference face: the MLX graph of `Compressor.pool_step` as the model ran it."""
    m = ratio
    overlap = len(state) == 5
    buf_kv, buf_gate = state[0], state[1]
    ov_kv, ov_gate = (state[2], state[3]) if overlap else (None, None)
    rows = state[-1]
    d = rows.shape[-1]
    b = (pos % m).reshape(1)
    buf_kv = mx.slice_update(buf_kv, kv.astype(buf_kv.dtype), b, axes=(1,))
    buf_gate = mx.slice_update(buf_gate, gate.astype(buf_gate.dtype), b, axes=(1,))
    w0 = pos // m
    win_kv = buf_kv[:, None]  # [1, 1, m, c*d]
    win_gate = buf_gate[:, None] + position_bias.astype(buf_gate.dtype)
    new = [buf_kv, buf_gate]
    if overlap:
        complete = (pos % m) == (m - 1)
        ca_kv, cb_kv = win_kv[..., :d], win_kv[..., d:]
        ca_g, cb_g = win_gate[..., :d], win_gate[..., d:]
        win_kv = mx.concatenate([ov_kv[:, None], cb_kv], axis=2)
        win_gate = mx.concatenate([ov_gate[:, None], cb_g], axis=2)
        new += [mx.where(complete, ca_kv[:, 0], ov_kv), mx.where(complete, ca_g[:, 0], ov_gate)]
    w = mx.softmax(win_gate.astype(mx.float32), axis=2, precise=True).astype(win_kv.dtype)
    row = norm((win_kv * w).sum(axis=2))  # [1, 1, d]
    row = rope(row, offset=w0, scale=float(m))
    # row w0 changes only when this token completes its window (an incomplete one is not live)
    start = w0.reshape(1)
    old = mx.slice(rows, start, axes=(1,), slice_size=(1, 1, d))
    row = mx.where((pos % m) == (m - 1), row.astype(rows.dtype), old)
    rows = mx.slice_update(rows, row, start, axes=(1,))
    return new + [rows]


def template_args(dt, kv, gate, position_bias, norm, rope, ratio: int, d: int, overlap: bool) -> list:
    """The kernel's template arguments (compressor_step and compressor_step_rows)."""
    dtypes = [("T", dt), ("TK", kv.dtype), ("TG", gate.dtype), ("TB", position_bias.dtype), ("TW", norm.weight.dtype)]
    return dtypes + [
        ("M", ratio),
        ("D", d),
        ("OVERLAP", overlap),
        ("ROPE", rope.dims),
        ("THREADS", THREADS),
        ("PER", PER),
    ]


def _launch(face, kv, gate, pos, state, position_bias, norm, rope, ratio) -> list:
    overlap = len(state) == 5
    buf_kv, buf_gate, rows = state[0], state[1], state[-1]
    ov_kv, ov_gate = (state[2], state[3]) if overlap else (buf_kv, buf_gate)  # dummies: not read
    dt = rows.dtype
    cap, d = rows.shape[-2], rows.shape[-1]
    m = ratio
    if pos.dtype != mx.int32 or pos.ndim:  # the step's position is a 0-d int32 array already
        pos = pos.astype(mx.int32).reshape(())
    ov_shapes = [state[2].shape, state[3].shape] if overlap else [(1,), (1,)]  # dummies: not written
    out = _kernel()(
        face,
        inputs=[
            buf_kv,
            buf_gate,
            ov_kv,
            ov_gate,
            rows,
            kv,
            gate,
            position_bias,
            norm.weight,
            rope.periods,
            params(float(norm.eps), float(rope.attention_factor), dt),
            capacity_meta(cap),
            pos,
        ],
        template=template_args(dt, kv, gate, position_bias, norm, rope, m, d, overlap),
        grid=(groups(cap, m, d, overlap, dt.size) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[buf_kv.shape, buf_gate.shape, *ov_shapes, rows.shape],  # the state's own shapes: no reshapes
        output_dtypes=[dt] * 5,
    )
    return out if overlap else [out[0], out[1], out[4]]


# --------------------------------------------------------------------------- first-use self-test


def self_test_cases():
    """Small problems covering both layouts: (name, ratio, dim, rope dims, overlap, cap,
    attention factor).  Tests and the self-test share them."""
    return [
        ("csa", 4, 64, 16, True, 8, 1.0),
        ("hca", 8, 32, 8, False, 4, 1.0),
        ("yarn", 4, 48, 16, True, 4, 0.75),
    ]


def random_problem(ratio, dim, rope_dims, overlap, cap, mscale, dtype, seed: int = 0):
    """(kv, gate, state, position_bias, norm, rope) with random values: every buffer row
    filled (stale rows of an earlier window included), overlap gates finite."""
    from ds4mlx.models.layers import RMSNorm, RoPE  # the model's own modules, for the reference face

    c = 2 if overlap else 1
    key = mx.random.key(seed)
    ks = mx.random.split(key, 8)
    state = [mx.random.normal((1, ratio, c * dim), key=ks[0]), mx.random.normal((1, ratio, c * dim), key=ks[1])]
    if overlap:
        state += [mx.random.normal((1, ratio, dim), key=ks[2]), mx.random.normal((1, ratio, dim), key=ks[3])]
    state.append(mx.random.normal((1, cap, dim), key=ks[4]))
    state = [a.astype(dtype) for a in state]
    kv = mx.random.normal((1, 1, c * dim), key=ks[5])
    gate = mx.random.normal((1, 1, c * dim), key=ks[6])
    bias = mx.random.normal((ratio, c * dim), key=ks[7]) * 0.5
    norm = RMSNorm(dim, 1e-6)
    norm.weight = 1.0 + 0.1 * mx.random.normal((dim,), key=ks[0])
    inv = 1.0 / (10000.0 ** (mx.arange(0, rope_dims, 2, dtype=mx.float32) / rope_dims))
    rope = RoPE(rope_dims, inv, mscale)
    return kv, gate, state, bias, norm, rope


def _rows_self_test(face: str) -> bool:
    """compressor_step_rows on `face` against the reference face of each row: three rows of
    each self-test case (their own buffers, capacities and positions: a window's end, its
    middle, its start), float32 and bfloat16."""
    for _, ratio, dim, rope_dims, overlap, cap, mscale in self_test_cases():
        for dt, tol in ((mx.float32, 1e-4), (mx.bfloat16, 3e-2)):
            probs = [random_problem(ratio, dim, rope_dims, overlap, cap + 2 * i, mscale, dt, seed=i) for i in range(3)]
            ps = [ratio * (cap - 1) + ratio - 1, ratio + ratio // 2, 2 * ratio]
            _, _, _, bias, norm, rope = probs[0]
            kw = dict(position_bias=bias, norm=norm, rope=rope, ratio=ratio)
            kvs, gates, states = [p[0] for p in probs], [p[1] for p in probs], [p[2] for p in probs]
            got = compressor_step_rows(kvs, gates, mx.array(ps, mx.int32), states, **kw, backend=face)
            if got is None:
                return False
            for g, kv, gate, st, p in zip(got, kvs, gates, states, ps):
                want = reference(kv, gate, mx.array(p, mx.int32), st, **kw)
                if not all(close_enough(a, w, rtol=tol, atol=tol) for a, w in zip(g, want)):
                    return False
    return True


def _self_test(face: str) -> bool:
    """Every self-test case on `face` against the reference face, float32 and bfloat16,
    at a window's start, middle and end."""
    for _, ratio, dim, rope_dims, overlap, cap, mscale in self_test_cases():
        for dt, tol in ((mx.float32, 1e-4), (mx.bfloat16, 3e-2)):
            kv, gate, state, bias, norm, rope = random_problem(ratio, dim, rope_dims, overlap, cap, mscale, dt)
            for p in (ratio * (cap - 1), ratio + ratio // 2, 2 * ratio - 1):
                pos = mx.array(p, mx.int32)
                kw = dict(position_bias=bias, norm=norm, rope=rope, ratio=ratio)
                got = compressor_step(kv, gate, pos, state, **kw, backend=face)
                want = reference(kv, gate, pos, state, **kw)
                if not all(close_enough(g, w, rtol=tol, atol=tol) for g, w in zip(got, want)):
                    return False
    return True
