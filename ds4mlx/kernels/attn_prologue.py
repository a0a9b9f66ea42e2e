"""A compressed layer's whole decode-attention prologue in one launch: attn_prep and the
layer's compressor steps side by side.

Per CSA / HCA layer and token the compiled decode step ran `attn_prep` (the query and K=V
norms and ropes, the ring write, the indexer query's rope) and one `compressor_step` per
compressor (HCA: the attention's; CSA: the attention's and the indexer's): two or three
launches of independent work, none reading another's output.  `attn_prologue` runs them as
one launch whose threadgroups are split between the jobs: first attn_prep's, then each
compressor's, every job with its own text unchanged.

``attn_prologue(q_b, kv, kv_weight, ring, pos, rope, eps, index_q_b, comps, *, heads,
index_heads)`` -> (q, ring, index_q, [each compressor's new state])
    ``comps``: one `CompressorJob` per compressor (its token's kv / gate projections, its
    state arrays, position bias, kv norm, compress rope, ratio); the outputs are those of
    ``attn_prep(...)`` and ``compressor_step(...)`` of each job, bit for bit the same
    kernels' arithmetic.

The kernel's text is assembled from the two kernels' sources (``kernels/metal/attn_prep.metal``
and ``kernels/metal/compressor_step.metal``): a compressor's section keeps its names, which
defines map to the fused launch's own (its inputs, outputs and template constants get the
prefix ``c<i>_``, its threadgroup index counts from its first group); both GPU faces compile
that text.  The reference face, and every case the fused launch does not take, is the
separate launches (`attn_prep`, `compressor_step`), each choosing its own face.

Verified: the shared text compiled with g++ (emulated threadgroups) against the reference,
and the CUDA translation unit with nvcc (tests/test_kernel_attn_prologue.py); on an H100 the
GPU tests pass (the self-tests; a 4-token chain at V4 Flash's shapes against the reference token
by token).  The rows form ("attn_prologue.rows") has passed only its first-use self-test there,
so it stays in `dispatch.UNVERIFIED_KERNELS` and self-tests at first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import mlx.core as mx

from ds4mlx.kernels import attn_prep as ap
from ds4mlx.kernels import compressor_step as cs
from ds4mlx.kernels.dispatch import (
    INDEX,
    PRELUDE,
    Kernel,
    auto_face,
    close_enough,
    compact,
    row_inputs,
    row_select,
    sections,
)

THREADS = ap.THREADS  # both jobs' threadgroups are this wide (the compressor's THREADS too)
assert cs.THREADS == THREADS

# the compressor section's names (inputs, outputs, template constants) that get a prefix
_CS_TEMPLATE = ["T", "TK", "TG", "TB", "TW", "M", "D", "OVERLAP", "ROPE", "PER"]
_CS_INPUTS = [n for n in cs.INPUTS if n != "pos"]  # the position is the launch's one `step_pos`
_AP_INPUTS = ["q", "kv", "kv_w", "iq", "ring", "freqs", "prm"]


@dataclass
class CompressorJob:
    """One compressor's step in the prologue: `compressor_step`'s arguments."""

    kv: mx.array
    gate: mx.array
    state: list
    position_bias: mx.array
    norm: object
    rope: object
    ratio: int


def _prefix(i: int) -> str:
    return f"c{i}_"


_RENAMED = [*_CS_INPUTS, *cs.OUTPUTS, *_CS_TEMPLATE, "tgx"]  # a compressor section's own names
_CHAIN_TOKEN_IN = ["kv", "gate"]  # a chain's compressor inputs that come one per token (kv_t, gate_t)


def _row_defines(n_comps: int, rows: int, chain: bool = False) -> str:
    """The position and row-selection defines: one row (the 0-d `step_pos`), or `rows`
    sessions' rows (attn_prologue_rows: grid y picks the row, `poss[row]` its position,
    per-row buffers chosen as attn_prep_rows and compressor_step_rows choose them), or one
    session's `rows` chained tokens (`chain`, attn_prologue_chain: grid y picks the token whose
    state the row writes, every input the chain's one)."""
    if chain:
        out = f"#define CS_ROWS {rows}\n#define CS_POS (poss[row])\n#define CS_ROW_SELECT\n"
        out += ap.rows_defines(rows, chain=True)
        for i in range(n_comps):
            p = _prefix(i)
            out += row_select(rows, {}, {p + name: p + "T" for name in cs.OUTPUTS}, macro=f"C{i}_ROW_SELECT")
        return out
    if rows == 1:
        out = "#define CS_ROWS 1\n#define CS_POS CS_SCALAR(step_pos)\n#define CS_ROW_SELECT\n" + ap.ONE.replace(
            "(meta[0])", "CS_SCALAR(step_pos)"
        )
        return out + "".join(f"#define C{i}_ROW_SELECT\n" for i in range(n_comps))
    out = f"#define CS_ROWS {rows}\n#define CS_POS (poss[row])\n#define CS_ROW_SELECT\n" + ap.rows_defines(rows)
    for i in range(n_comps):
        p = _prefix(i)
        ins = {p + name: (p + t if t in _CS_TEMPLATE else t) for name, t in cs.ROW_IN.items()}
        outs = {p + name: p + "T" for name in cs.OUTPUTS}
        out += row_select(rows, ins, outs, macro=f"C{i}_ROW_SELECT")
    return out


def shared_text(n_comps: int, rows: int = 1, chain: bool = False) -> tuple[str, str]:
    """(header, body) of the fused kernel with `n_comps` compressors (1: HCA, 2: CSA) for `rows`
    sessions' rows, without the face's prelude, trig helpers and index block (the g++ emulation
    adds its own): the position and row defines and the compressor's common section; attn_prep's
    section for the first AP_TGS threadgroups, then each compressor's section for its C<i>_TGS
    groups (its row selection C<i>_ROW_SELECT); `chain`: the compressors' chain section
    (compressor_chain: each grid row the state after the chain's tokens 0..row)."""
    cs_sec = sections(cs.SOURCE)
    header = _row_defines(n_comps, rows, chain) + compact(cs_sec["common"])
    body = ["if (tgx < uint32_t(AP_TGS)) {\n", compact(sections(ap.SOURCE)["attn_prep"]), "}\n"]
    first = "uint32_t(AP_TGS)"
    for i in range(n_comps):
        p = _prefix(i)
        body.append(f"const uint32_t {p}tgx = tgx - ({first});\n")
        body.append(f"if (tgx >= {first} && {p}tgx < uint32_t({p.upper()}TGS)) {{\n")
        body += [f"#define {name} {p}{name}\n" for name in _RENAMED]
        if chain:  # token t's projections (compressor_chain's CC_KV(t), CC_GATE(t))
            for macro, name in (("CC_KV", "kv"), ("CC_GATE", "gate")):
                earlier = "".join(f"int32_t(t) == {t} ? {p}{name}_{t} : " for t in range(rows - 1))
                pick = earlier + f"{p}{name}_{rows - 1}"
                body.append(f"#define {macro}(t) ({pick})\n")
        body.append(f"#undef CS_ROW_SELECT\n#define CS_ROW_SELECT C{i}_ROW_SELECT\n")
        body.append(compact(cs_sec["compressor_chain" if chain else "compressor_step"]))
        body += [f"#undef {name}\n" for name in _RENAMED + (["CC_KV", "CC_GATE"] if chain else [])]
        body.append("}\n")
        first = f"{first} + uint32_t({p.upper()}TGS)"
    return header, "".join(body)


def kernel_sources(face: str, n_comps: int, rows: int = 1, chain: bool = False) -> tuple[str, str]:
    """(header, body) of the fused kernel for `face` ('metal' or 'cuda')."""
    header, body = shared_text(n_comps, rows, chain)
    return PRELUDE[face] + ap.TRIG[face] + header, INDEX[face] + body


def io(n_comps: int, rows: int = 1, chain: bool = False) -> tuple[list[str], list[str]]:
    """(input names, output names) of the fused kernel with `n_comps` compressors: attn_prep's
    (attn_prep_rows' for rows > 1), then each compressor's with its prefix (compressor_step_rows'
    per-row buffers for rows > 1; their positions are attn_prep_rows' `poss`).  `chain`: the
    chain's (attn_prep_chain's, then each compressor's inputs once, its outputs per token)."""
    if chain:
        ins, outs = ap.chain_io(rows)
        cs_ins = [n for n in _CS_INPUTS if n not in _CHAIN_TOKEN_IN] + row_inputs(_CHAIN_TOKEN_IN, rows)
        cs_outs = row_inputs(cs.OUTPUTS, rows)
    elif rows == 1:
        ins, outs = _AP_INPUTS + ["step_pos"], ["q_out", "ring_out", "iq_out"]
        cs_ins, cs_outs = _CS_INPUTS, cs.OUTPUTS
    else:
        ins, outs = ap.rows_io(rows)
        cs_ins = row_inputs(cs.ROW_IN, rows) + [n for n in cs.SHARED_IN if n != "poss"]
        cs_outs = row_inputs(cs.OUTPUTS, rows)
    ins = ins + [_prefix(i) + n for i in range(n_comps) for n in cs_ins]
    outs = outs + [_prefix(i) + n for i in range(n_comps) for n in cs_outs]
    return ins, outs


@cache
def _kernel(n_comps: int, rows: int = 1) -> Kernel:
    faces = {face: kernel_sources(face, n_comps, rows) for face in ("metal", "cuda")}
    name = f"ds4mlx_attn_prologue{n_comps}" + (f"_rows{rows}" if rows > 1 else "")
    return Kernel(name, *io(n_comps, rows), **faces)


@cache
def _chain_kernel(n_comps: int, tokens: int) -> Kernel:
    faces = {face: kernel_sources(face, n_comps, tokens, chain=True) for face in ("metal", "cuda")}
    return Kernel(f"ds4mlx_attn_prologue{n_comps}_chain{tokens}", *io(n_comps, tokens, chain=True), **faces)


def _separate(q_b, kv, kv_weight, ring, pos, rope, eps, index_q_b, comps, heads, index_heads, backend):
    """The reference face: attn_prep and each compressor_step as their own launches."""
    ap_face = "reference" if backend == "reference" else None
    q, ring, iq = ap.attn_prep(
        q_b, kv, kv_weight, ring, pos, rope, eps, index_q_b, heads=heads, index_heads=index_heads, backend=ap_face
    )
    states = []
    for c in comps:
        kw = dict(position_bias=c.position_bias, norm=c.norm, rope=c.rope, ratio=c.ratio, backend=ap_face)
        states.append(cs.compressor_step(c.kv, c.gate, pos, c.state, **kw))
    return q, ring, iq, states


def fusable(q_b, kv, ring, rope, index_q_b, index_heads: int, comps: list) -> bool:
    """Whether one launch takes these jobs: attn_prep's widths, every compressor's layout."""
    d = ring.shape[-1]
    di = 0 if index_q_b is None else index_q_b.shape[-1] // index_heads
    return (
        0 < len(comps) <= 2
        and ap.fusable(rope, d, di)
        and all(cs.supported(c.state, c.kv, c.gate, c.position_bias, c.rope) for c in comps)
    )


def attn_prologue(
    q_b,
    kv,
    kv_weight,
    ring,
    pos,
    rope,
    eps: float,
    index_q_b,
    comps: list,
    *,
    heads: int,
    index_heads: int = 0,
    backend: str | None = None,
):
    """See the module docstring: (q [1, NH, 1, D], ring, index_q or None, the compressors'
    new states in `comps`' order).  `pos` a 0-d int32 array (the compiled step's position)."""
    face = backend
    if face is None:
        face = auto_face("attn_prologue", _self_test)
    args = (q_b, kv, kv_weight, ring, pos, rope, eps, index_q_b, comps, heads, index_heads)
    if face == "reference" or not fusable(q_b, kv, ring, rope, index_q_b, index_heads, comps):
        return _separate(*args, backend)
    return _launch(face, *args)


def _launch(face, q_b, kv, kv_weight, ring, pos, rope, eps, index_q_b, comps, heads, index_heads):
    n = len(comps)
    if pos.dtype != mx.int32 or pos.ndim:
        pos = pos.astype(mx.int32).reshape(())
    iq, freqs, template, groups, out_shapes, out_dtypes = _prep_share(q_b, kv, kv_weight, [ring], rope, index_q_b, heads, index_heads)  # fmt: skip
    inputs = [q_b, kv, kv_weight, iq, ring, freqs, ap.params(float(eps), float(rope.attention_factor)), pos]
    for i, c in enumerate(comps):
        rows = c.state[-1]
        inputs += [*_state_inputs(c), c.kv, c.gate, *_fixed_inputs(c), cs.capacity_meta(rows.shape[-2])]
        tmpl, tgs = _comp_share(_prefix(i), c, rows.shape[-2])
        template, groups = template + tmpl, groups + tgs
        out_shapes += _state_shapes(c)
        out_dtypes += [rows.dtype] * 5
    out = _kernel(n)(
        face,
        inputs=inputs,
        template=template,
        grid=(groups * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=out_shapes,
        output_dtypes=out_dtypes,
    )
    states = []
    for i, c in enumerate(comps):
        st = out[3 + 5 * i : 8 + 5 * i]
        states.append(st if len(c.state) == 5 else [st[0], st[1], st[4]])
    return out[0], out[1], (out[2] if index_q_b is not None else None), states


def attn_prologue_rows(
    q_b,
    kv,
    kv_weight,
    rings: list,
    poss,
    rope,
    eps: float,
    index_q_b,
    jobs: list,
    *,
    heads: int,
    index_heads: int = 0,
    backend: str | None = None,
) -> list:
    """`attn_prologue` of B independent sessions' tokens of one layer (session batching): q_b
    [1, B, NH*D], kv [1, B, D], index_q_b [1, B, NHI*DI] or None (the rows' projections),
    rings[b] row b's ring, poss [B] int32, jobs[b] row b's compressor jobs (`comps`) -> per row
    (q [1, NH, 1, D], ring, index_q or None, the compressors' new states).  One launch where
    the rows can share it; else attn_prep_rows and compressor_step_rows (each where the rows
    can share it, else per row)."""
    face = backend
    if face is None:
        face = auto_face("attn_prologue.rows", _rows_self_test)
    n = len(rings)
    args = (q_b, kv, kv_weight, rings, poss, rope, eps, index_q_b, jobs, heads, index_heads)
    if face == "reference" or n < 2 or not _rows_fusable(*args[:9], index_heads):
        return _separate_rows(*args, backend)
    return _launch_rows(face, *args)


def _rows_fusable(q_b, kv, kv_weight, rings, poss, rope, eps, index_q_b, jobs, index_heads) -> bool:
    n_comps = len(jobs[0])
    if not ap.rings_alike(rings) or any(len(j) != n_comps for j in jobs):
        return False
    if not fusable(q_b, kv, rings[0], rope, index_q_b, index_heads, jobs[0]):
        return False
    by_comp = [[j[i] for j in jobs] for i in range(n_comps)]
    return all(
        cs.rows_alike([c.kv for c in cj], [c.gate for c in cj], [c.state for c in cj], cj[0].position_bias, cj[0].rope)
        for cj in by_comp
    )


def _separate_rows(q_b, kv, kv_weight, rings, poss, rope, eps, index_q_b, jobs, heads, index_heads, backend) -> list:
    """The reference face: attn_prep's rows, then each compressor's rows, in launches of their own."""
    ap_face = "reference" if backend == "reference" else None
    kw = dict(heads=heads, index_heads=index_heads, backend=ap_face)
    preps = ap.prep_rows_or_each(q_b, kv, kv_weight, rings, poss, rope, eps, index_q_b, **kw)
    states = [[] for _ in rings]
    for i in range(len(jobs[0])):
        cj = [j[i] for j in jobs]
        c = cj[0]
        ckw = dict(position_bias=c.position_bias, norm=c.norm, rope=c.rope, ratio=c.ratio)
        kvs, gates, sts = [x.kv for x in cj], [x.gate for x in cj], [x.state for x in cj]
        new = cs.compressor_step_rows(kvs, gates, poss, sts, **ckw, backend=ap_face)
        if new is None:
            new = [cs.compressor_step(x.kv, x.gate, poss[b : b + 1].squeeze(0), x.state, **ckw, backend=ap_face) for b, x in enumerate(cj)]  # fmt: skip
        for st, nw in zip(states, new):
            st.append(nw)
    return [(*prep, st) for prep, st in zip(preps, states)]


def _prep_share(q_b, kv, kv_weight, rings: list, rope, index_q_b, heads: int, index_heads: int) -> tuple:
    """attn_prep's share of a fused launch of len(rings) rows: (the indexer input, the rope
    frequencies, the template, its threadgroups, the output shapes and dtypes: q, the rings,
    the indexer queries)."""
    n, ring = len(rings), rings[0]
    nhi, di, iq, freqs = ap.launch_inputs(q_b, index_q_b, index_heads, rope)
    template = ap.template_args(q_b, kv, kv_weight, iq, ring, heads, nhi, di, rope)  # THREADS and PER: attn_prep's
    groups = ap.launch_groups(heads, nhi, ring)
    template.append(("AP_TGS", groups))
    out_shapes = [(n, heads, 1, ring.shape[-1]), *[r.shape for r in rings], (n, max(nhi, 1), 1, max(di, 1))]
    return iq, freqs, template, groups, out_shapes, [q_b.dtype, *[r.dtype for r in rings], iq.dtype]


def _comp_share(p: str, c: CompressorJob, cap: int) -> tuple[list, int]:
    """Compressor job c's share of the template under prefix p, and its threadgroups for
    rows up to `cap`."""
    overlap, rows = len(c.state) == 5, c.state[-1]
    dt, dim = rows.dtype, rows.shape[-1]
    tmpl = cs.template_args(dt, c.kv, c.gate, c.position_bias, c.norm, c.rope, c.ratio, dim, overlap)
    tgs = cs.groups(cap, c.ratio, dim, overlap, dt.size)
    return [(p + name, v) for name, v in tmpl if name != "THREADS"] + [(p.upper() + "TGS", tgs)], tgs


def _state_inputs(c: CompressorJob) -> list:
    """Job c's five state inputs (without the overlap: its buffers again, not read)."""
    st = c.state
    return [st[0], st[1], *(st[2:4] if len(st) == 5 else st[:2]), st[-1]]


def _fixed_inputs(c: CompressorJob) -> list:
    """Job c's inputs that every row shares: position bias, norm weight, rope periods, params."""
    prm = cs.params(float(c.norm.eps), float(c.rope.attention_factor), c.state[-1].dtype)
    return [c.position_bias, c.norm.weight, c.rope.periods, prm]


def _state_shapes(c: CompressorJob) -> list:
    """The shapes of job c's five state outputs (without the overlap: placeholders, not written)."""
    st = c.state
    ov = [st[2].shape, st[3].shape] if len(st) == 5 else [(1,), (1,)]
    return [st[0].shape, st[1].shape, *ov, st[-1].shape]


def _rows_result(out: list, n: int, index_q_b, jobs: list) -> list:
    """A launch of n rows' outputs (each compressor's name by name, row by row) -> per row (q,
    ring, index query or None, its jobs[b]' new states)."""
    q, rings, iqs, rest = out[0], out[1 : 1 + n], out[1 + n], out[2 + n :]
    result = []
    for b in range(n):
        states = []
        for i, x in enumerate(jobs[b]):
            st = [rest[5 * n * i + k * n + b] for k in range(5)]
            states.append(st if len(x.state) == 5 else [st[0], st[1], st[4]])
        result.append((q[b : b + 1], rings[b], iqs[b : b + 1] if index_q_b is not None else None, states))
    return result


def _launch_rows(face, q_b, kv, kv_weight, rings, poss, rope, eps, index_q_b, jobs, heads, index_heads) -> list:
    n, n_comps = len(rings), len(jobs[0])
    if poss.dtype != mx.int32:
        poss = poss.astype(mx.int32)
    iq, freqs, template, groups, out_shapes, out_dtypes = _prep_share(q_b, kv, kv_weight, rings, rope, index_q_b, heads, index_heads)  # fmt: skip
    prm = ap.params(float(eps), float(rope.attention_factor))
    inputs = [q_b, kv, kv_weight, iq, *rings, freqs, prm, poss.reshape(-1)]
    for i in range(n_comps):
        cj = [j[i] for j in jobs]
        c = cj[0]
        per = [(*_state_inputs(x), x.kv, x.gate, cs.capacity_meta(x.state[-1].shape[-2])) for x in cj]
        inputs += [row[k] for k in range(len(cs.ROW_IN)) for row in per]  # name by name, row by row
        inputs += _fixed_inputs(c)
        tmpl, tgs = _comp_share(_prefix(i), c, max(x.state[-1].shape[-2] for x in cj))
        template, groups = template + tmpl, groups + tgs
        shapes = [_state_shapes(x) for x in cj]
        out_shapes += [sh[k] for k in range(5) for sh in shapes]  # name by name, row by row
        out_dtypes += [c.state[-1].dtype] * (5 * n)
    out = _kernel(n_comps, n)(
        face,
        inputs=inputs,
        template=template,
        grid=(groups * THREADS, n, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=out_shapes,
        output_dtypes=out_dtypes,
    )
    return _rows_result(out, n, index_q_b, jobs)


def attn_prologue_chain(
    q_b,
    kv,
    kv_weight,
    ring,
    poss,
    rope,
    eps: float,
    index_q_b,
    comps: list,
    *,
    heads: int,
    index_heads: int = 0,
    backend: str | None = None,
) -> list:
    """`attn_prologue` of one session's next T tokens of one layer (a speculative verify's
    chain), token t over the ring and compressor states token t - 1 left: q_b [1, T, NH*D], kv
    [1, T, D], index_q_b [1, T, NHI*DI] or None (the tokens' projections), ring and `comps`'
    states the session's before the chain, each job's kv / gate the T tokens' [1, T, ...],
    poss [T] int32 consecutive positions -> per token (q [1, NH, 1, D], ring, index_q or None,
    the compressors' new states).  One launch where the tokens can share it (a sliding layer's:
    attn_prep_chain); else attn_prologue token after token."""
    face = backend
    n = q_b.shape[1]
    args = (q_b, kv, kv_weight, ring, poss, rope, eps, index_q_b, comps, heads, index_heads)
    if n > 1 and not comps and face != "reference":
        chained = ap.attn_prep_chain(*args[:8], heads=heads, index_heads=index_heads, backend=face)
        if chained is not None:
            q, rings, iq = chained
            return [(q[t : t + 1], r, None if iq is None else iq[t : t + 1], []) for t, r in enumerate(rings)]
    elif n > 1 and face != "reference":
        if face is None:
            face = auto_face("attn_prologue.chain", _chain_self_test)
        if face != "reference" and _chain_fusable(*args[:9], index_heads):
            return _launch_chain(face, *args)
    return _each_token(*args, backend)


def _one_token(t: int, q_b, kv, index_q_b, comps: list) -> tuple:
    """Token t's slices of a chain's projections: (q_b, kv, index_q_b, comps with its kv / gate)."""
    r = slice(t, t + 1)
    jobs = [CompressorJob(c.kv[:, r], c.gate[:, r], c.state, c.position_bias, c.norm, c.rope, c.ratio) for c in comps]
    return q_b[:, r], kv[:, r], None if index_q_b is None else index_q_b[:, r], jobs


def _each_token(q_b, kv, kv_weight, ring, poss, rope, eps, index_q_b, comps, heads, index_heads, backend) -> list:
    """attn_prologue_chain's meaning: attn_prologue of each token over what the one before it left."""
    out = []
    for t in range(q_b.shape[1]):
        q_t, kv_t, iq_t, jobs = _one_token(t, q_b, kv, index_q_b, comps)
        pos = poss[t : t + 1].squeeze(0)
        kw = dict(heads=heads, index_heads=index_heads, backend=backend)
        out.append(attn_prologue(q_t, kv_t, kv_weight, ring, pos, rope, eps, iq_t, jobs, **kw))
        ring = out[-1][1]
        comps = [CompressorJob(c.kv, c.gate, st, c.position_bias, c.norm, c.rope, c.ratio) for c, st in zip(comps, out[-1][3])]  # fmt: skip
    return out


def _chain_fusable(q_b, kv, kv_weight, ring, poss, rope, eps, index_q_b, comps, index_heads) -> bool:
    """Whether one launch takes the chain: no two tokens share a ring slot, and the first
    token's jobs `fusable` (the others' are alike: slices of the same projections)."""
    n = q_b.shape[1]
    q_t, kv_t, iq_t, jobs = _one_token(0, q_b, kv, index_q_b, comps)
    return n <= ring.shape[2] and fusable(q_t, kv_t, ring, rope, iq_t, index_heads, jobs)


def _launch_chain(face, q_b, kv, kv_weight, ring, poss, rope, eps, index_q_b, comps, heads, index_heads) -> list:
    n, n_comps = q_b.shape[1], len(comps)
    if poss.dtype != mx.int32:
        poss = poss.astype(mx.int32)
    iq, freqs, template, groups, out_shapes, out_dtypes = _prep_share(q_b, kv, kv_weight, [ring] * n, rope, index_q_b, heads, index_heads)  # fmt: skip
    inputs = [*ap.chain_inputs(q_b, kv, iq, index_q_b), kv_weight, ring, freqs]
    inputs += [ap.params(float(eps), float(rope.attention_factor)), poss]
    for i, c in enumerate(comps):
        rows = c.state[-1]
        inputs += [*_state_inputs(c), *_fixed_inputs(c), cs.capacity_meta(rows.shape[-2])]
        inputs += [c.kv[:, t : t + 1] for t in range(n)] + [c.gate[:, t : t + 1] for t in range(n)]
        tmpl, tgs = _comp_share(_prefix(i), c, rows.shape[-2])
        template, groups = template + tmpl, groups + tgs
        out_shapes += [sh for sh in _state_shapes(c) for _ in range(n)]  # name by name, token by token
        out_dtypes += [rows.dtype] * (5 * n)
    out = _chain_kernel(n_comps, n)(
        face,
        inputs=inputs,
        template=template,
        grid=(groups * THREADS, n, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=out_shapes,
        output_dtypes=out_dtypes,
    )
    return _rows_result(out, n, index_q_b, [comps] * n)


# --------------------------------------------------------------------------- first-use self-test


def self_test_problem(n_comps: int, dtype, seed: int = 0):
    """A small prologue (3 query heads, a ring of 5, 2 indexer heads with two compressors):
    (args of attn_prologue without comps, comps); the compressors as compressor_step's
    self-test cases (CSA: the overlapping attention and indexer ones; HCA: the plain one)."""
    from ds4mlx.models.layers import RoPE

    cases = cs.self_test_cases()
    picked = [cases[0], cases[2]] if n_comps == 2 else [cases[1]]
    comps = []
    for j, (_, ratio, dim, rope_dims, overlap, cap, mscale) in enumerate(picked):
        kv, gate, state, bias, norm, crope = cs.random_problem(
            ratio, dim, rope_dims, overlap, cap, mscale, dtype, seed=seed + j
        )
        comps.append(CompressorJob(kv, gate, state, bias, norm, crope, ratio))
    rd = 8
    rope = RoPE(rd, 1.0 / (10000.0 ** (mx.arange(0, rd, 2, dtype=mx.float32) / rd)), 0.75)
    d, di = rd + 8, rd + 4
    k = mx.random.split(mx.random.key(seed + 11), 5)
    nhi = 2 if n_comps == 2 else 0
    args = dict(
        q_b=mx.random.normal((1, 1, 3 * d), key=k[1]).astype(dtype),
        kv=mx.random.normal((1, 1, d), key=k[2]).astype(dtype),
        kv_weight=1.0 + 0.1 * mx.random.normal((d,), key=k[0]),
        ring=mx.random.normal((1, 1, 5, d), key=k[4]).astype(dtype),
        rope=rope,
        eps=1e-6,
        index_q_b=mx.random.normal((1, 1, 2 * di), key=k[3]).astype(dtype) if nhi else None,
        heads=3,
        index_heads=nhi,
    )
    return args, comps


def self_test_positions(comps) -> list[int]:
    """Positions that end a window of every compressor (one past the ring's first lap), and
    one in a window's middle; every window within the compressors' capacities."""
    m = max(c.ratio for c in comps)
    return [2 * m - 1, m + m // 2, 3 * m - 1]


SELF_TEST_DTYPES = ((mx.float32, 1e-4), (mx.bfloat16, 3e-2))  # (activations and state, tolerance)


def _self_test(face: str) -> bool:
    """The fused launch on `face` against the separate reference launches, one and two
    compressors, float32 and bfloat16, at a window's end and elsewhere."""
    for n in (1, 2):
        for dt, tol in SELF_TEST_DTYPES:
            args, comps = self_test_problem(n, dt)
            for p in self_test_positions(comps):
                pos = mx.array(p, mx.int32)
                got = attn_prologue(**args, pos=pos, comps=comps, backend=face)
                want = attn_prologue(**args, pos=pos, comps=comps, backend="reference")
                if not _all_close(got, want, tol):
                    return False
    return True


def rows_self_test_problem(n_comps: int, dtype, rows: int = 3):
    """`self_test_problem` for `rows` sessions: (args of attn_prologue_rows without jobs and
    poss, jobs, poss): the rows' projections stacked, each row its own ring and compressor
    state (capacities differ), positions that end a window, sit in one's middle, start one."""
    probs = [self_test_problem(n_comps, dtype, seed=3 * b) for b in range(rows)]
    args = dict(probs[0][0])
    for name in ("q_b", "kv", "index_q_b"):
        if args[name] is not None:
            args[name] = mx.concatenate([p[0][name] for p in probs], axis=1)
    args["rings"] = [p[0].pop("ring") for p in probs]
    del args["ring"]
    jobs = [p[1] for p in probs]
    for b, js in enumerate(jobs):  # one bias / norm / rope per compressor: the layer's
        for i, j in enumerate(js):
            j.position_bias, j.norm, j.rope = jobs[0][i].position_bias, jobs[0][i].norm, jobs[0][i].rope
    m = max(c.ratio for c in jobs[0])
    poss = mx.array([2 * m - 1, m + m // 2, 2 * m][:rows] + [3 * m - 1] * max(0, rows - 3), mx.int32)
    return args, jobs, poss


def row_args(args: dict, b: int) -> dict:
    """`attn_prologue`'s arguments for row b of `attn_prologue_rows`' `args` (without jobs and
    poss): row b's own ring and its slice of the stacked projections."""
    row = slice(b, b + 1)
    one = {k: v for k, v in args.items() if k != "rings"}
    one.update(ring=args["rings"][b], q_b=args["q_b"][:, row], kv=args["kv"][:, row])
    if one["index_q_b"] is not None:
        one["index_q_b"] = one["index_q_b"][:, row]
    return one


def _rows_self_test(face: str) -> bool:
    """attn_prologue_rows on `face` against the reference of each row: three rows, one and
    two compressors, float32 and bfloat16."""
    for n in (1, 2):
        for dt, tol in SELF_TEST_DTYPES:
            args, jobs, poss = rows_self_test_problem(n, dt)
            got = attn_prologue_rows(**args, jobs=jobs, poss=poss, backend=face)
            for b, g in enumerate(got):
                want = attn_prologue(**row_args(args, b), pos=poss[b], comps=jobs[b], backend="reference")
                if not _all_close(g, want, tol):
                    return False
    return True


def chain_self_test_problem(n_comps: int, dtype, tokens: int = 5):
    """`self_test_problem` for a chain of `tokens` tokens: (args of attn_prologue_chain without
    comps and poss, comps, poss): the tokens' projections random, the state one session's, the
    positions from one before a window's end across two window ends (ratio 4) or one (ratio 8),
    the ring of 5 wrapping inside the chain."""
    args, comps = self_test_problem(n_comps, dtype)
    k = mx.random.split(mx.random.key(29), 4)
    for name, key in (("q_b", k[0]), ("kv", k[1]), ("index_q_b", k[2])):
        if args[name] is not None:
            args[name] = mx.random.normal((1, tokens, args[name].shape[-1]), key=key).astype(dtype)
    for j, c in enumerate(comps):
        kk = mx.random.split(mx.random.key(31 + j), 2)
        c.kv = mx.random.normal((1, tokens, c.kv.shape[-1]), key=kk[0])
        c.gate = mx.random.normal((1, tokens, c.gate.shape[-1]), key=kk[1])
    m = max(c.ratio for c in comps)
    return args, comps, mx.arange(2 * m - 2, 2 * m - 2 + tokens, dtype=mx.int32)


def _chain_self_test(face: str) -> bool:
    """attn_prologue_chain on `face` against the reference token after token: five tokens, one
    and two compressors, float32 and bfloat16."""
    for n in (1, 2):
        for dt, tol in SELF_TEST_DTYPES:
            args, comps, poss = chain_self_test_problem(n, dt)
            got = attn_prologue_chain(**args, comps=comps, poss=poss, backend=face)
            want = attn_prologue_chain(**args, comps=comps, poss=poss, backend="reference")
            if len(got) != len(want) or not all(_all_close(g, w, tol) for g, w in zip(got, want)):
                return False
    return True


def _all_close(got, want, tol: float) -> bool:
    g = [a for a in got[:3] if a is not None] + [a for st in got[3] for a in st]
    w = [a for a in want[:3] if a is not None] + [a for st in want[3] for a in st]
    return len(g) == len(w) and all(close_enough(a, b, rtol=tol, atol=tol) for a, b in zip(g, w))
