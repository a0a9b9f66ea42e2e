"""A compressed layer's attention prologue and compressor steps in one launch
(ds4mlx/kernels/attn_prologue.py).

CPU: the fused kernel's shared text compiled with g++ (emulated threadgroups,
test_kernel_emulation.py) through the module's own inputs, template and grid, against the
reference (attn_prep's and compressor_step's reference faces, the separate launches), HCA (one
compressor) and CSA (two); its first-use self-test on that emulation, and its fallback; the
CUDA translation unit compiled by nvcc at V4 Flash shapes; the tiny V4 models' compiled decode
over >= 64 steps through the launch (a stand-in computing the outputs from the launch's own
inputs) against the legacy path, in float32 and under the GPU weight policy (bfloat16
weights, ``dtype=None``).  GPU (``-m gpu``): the self-test on the device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_gpu_policy_numerics import PREFILL, _copy_as
from test_kernel_attn_prep import CPU_TRIG
from test_kernel_emulation import emulated_launch, mlx_cuda_source, nvcc_compile

import ds4mlx
from ds4mlx.kernels import attn_prep as ap
from ds4mlx.kernels import attn_prologue as apl
from ds4mlx.kernels import compressor_step as cs
from ds4mlx.kernels import dispatch
from ds4mlx.kernels import sparse_attention as sparse
from ds4mlx.models import cache as row_cache
from ds4mlx.models import deepseek_v4
from ds4mlx.models.layers import RMSNorm
from ds4mlx.runtime import stepper

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import maxdiff  # noqa: E402

pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")

_TYPES = ("TQ", "TKV", "TWN", "TI", "TR") + tuple(f"c{i}_{t}" for i in range(2) for t in ("T", "TK", "TG", "TB", "TW"))


def _emulated_kernel(tmp_path, launches):
    """A stand-in for apl._kernel(n): the fused text on the g++ emulation, with the inputs,
    template and grid the module passes."""

    def kernel(n, rows=1):
        header, body = apl.shared_text(n, rows)
        return emulated_launch(tmp_path, launches, CPU_TRIG + header, body, apl.io(n, rows), float_consts=_TYPES)

    return kernel


@pytest.fixture
def small_threadgroups(monkeypatch):
    """64-thread threadgroups (the emulation runs a fiber per thread)."""
    for mod in (ap, cs, apl):
        monkeypatch.setattr(mod, "THREADS", 64)
    monkeypatch.setattr(cs, "PER", 2)
    return monkeypatch


def _flat(out) -> list:
    return [a for a in out[:3] if a is not None] + [a for st in out[3] for a in st]


@pytest.mark.parametrize("n", [1, 2], ids=["hca", "csa"])
@pytest.mark.slow_after(1)
def test_shared_text_on_the_cpu_emulation(n, tmp_path, small_threadgroups):
    """Every output of the one launch (query, ring, indexer query, each compressor's buffers,
    overlap rows and rows) equals the separate reference launches', at a window's end (the
    pooled row written), its middle and past the ring's first lap."""
    launches = []
    small_threadgroups.setattr(apl, "_kernel", _emulated_kernel(tmp_path, launches))
    args, comps = apl.self_test_problem(n, mx.float32, seed=n)
    for p in apl.self_test_positions(comps):
        pos = mx.array(p, mx.int32)
        got = apl.attn_prologue(**args, pos=pos, comps=comps, backend="cuda")
        want = apl.attn_prologue(**args, pos=pos, comps=comps, backend="reference")
        assert len(_flat(got)) == len(_flat(want)) == 3 - (n == 1) + sum(len(c.state) for c in comps)
        for i, (g, w) in enumerate(zip(_flat(got), _flat(want))):
            assert g.shape == w.shape and g.dtype == w.dtype, (p, i)
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5, err_msg=f"pos {p}, output {i}")
    assert len(launches) == 3 and all(grid[1:] == (1, 1) for _, grid in launches)


def test_self_test_passes_on_the_cpu_emulation_and_fails_a_wrong_kernel(tmp_path, small_threadgroups):
    """The first-use self-test on the emulation (float32: the emulation holds 16-bit buffers as
    float32, which a 16-bit state's copy groups cover half of): it passes, and fails for a
    kernel that leaves the ring unwritten."""
    small_threadgroups.setattr(apl, "SELF_TEST_DTYPES", apl.SELF_TEST_DTYPES[:1])
    launches = []
    emulated = _emulated_kernel(tmp_path, launches)
    small_threadgroups.setattr(apl, "_kernel", emulated)
    assert apl._self_test("cuda") and launches

    def ring_unwritten(n, rows=1):  # a kernel that returns the ring as it was
        launch = emulated(n, rows)

        def run(face, **kw):
            out = launch(face, **kw)
            return [kw["inputs"][4] if i == 1 else o for i, o in enumerate(out)]

        return run

    small_threadgroups.setattr(apl, "_kernel", ring_unwritten)
    assert not apl._self_test("cuda")


@pytest.mark.parametrize("n", [1, 2], ids=["hca", "csa"])
@pytest.mark.slow_after(1)
def test_rows_on_the_cpu_emulation(n, tmp_path, small_threadgroups):
    """attn_prologue_rows (session batching: B sessions' prologues and compressor steps of one
    layer in one launch) through the module's own inputs, template and grid, the kernel run by
    the g++ emulation: row b equals the single-row reference on row b's own projections, ring,
    compressor state and position (a window's end, its middle, its start)."""
    launches = []
    small_threadgroups.setattr(apl, "_kernel", _emulated_kernel(tmp_path, launches))
    args, jobs, poss = apl.rows_self_test_problem(n, mx.float32)
    got = apl.attn_prologue_rows(**args, jobs=jobs, poss=poss, backend="cuda")
    assert len(launches) == 1 and launches[0][1][1] == 3
    for b, g in enumerate(got):
        want = apl.attn_prologue(**apl.row_args(args, b), pos=poss[b], comps=jobs[b], backend="reference")
        assert len(_flat(g)) == len(_flat(want))
        for i, (x, w) in enumerate(zip(_flat(g), _flat(want))):
            assert x.shape == w.shape, (b, i)
            np.testing.assert_allclose(np.array(x), np.array(w), rtol=1e-5, atol=1e-5, err_msg=f"row {b}, output {i}")


def test_rows_self_test_on_the_cpu_emulation(tmp_path, small_threadgroups):
    """The rows variant's first-use self-test (float32 on the emulation, as above): it passes,
    and fails for a kernel that gives every row row 0's ring."""
    small_threadgroups.setattr(apl, "SELF_TEST_DTYPES", apl.SELF_TEST_DTYPES[:1])
    launches = []
    emulated = _emulated_kernel(tmp_path, launches)
    small_threadgroups.setattr(apl, "_kernel", emulated)
    assert apl._rows_self_test("cuda") and launches

    def same_ring(n, rows=1):
        launch = emulated(n, rows)

        def run(face, **kw):
            out = launch(face, **kw)
            return [out[0], *[out[1]] * rows, *out[1 + rows :]]

        return run

    small_threadgroups.setattr(apl, "_kernel", same_ring)
    assert not apl._rows_self_test("cuda")


def _emulated_chain_kernel(tmp_path, launches):
    """A stand-in for apl._chain_kernel(n, tokens): the chain's text on the g++ emulation."""

    def kernel(n, tokens):
        header, body = apl.shared_text(n, tokens, chain=True)
        io = apl.io(n, tokens, chain=True)
        return emulated_launch(tmp_path, launches, CPU_TRIG + header, body, io, float_consts=_TYPES)

    return kernel


@pytest.mark.parametrize("n", [1, 2], ids=["hca", "csa"])
@pytest.mark.parametrize("tokens,start", [(5, None), (4, 0), (3, 5)])
@pytest.mark.slow_after(1)
def test_chain_on_the_cpu_emulation(n, tokens, start, tmp_path, small_threadgroups):
    """attn_prologue_chain (a verify's T tokens of one compressed layer in one launch) through
    the module's own inputs, template and grid, the kernel run by the g++ emulation: token t's
    query, ring, indexer query and every compressor state equal attn_prologue's reference run
    token after token (the chain across one or two window ends, from the first position, from
    a window's middle)."""
    launches = []
    small_threadgroups.setattr(apl, "_chain_kernel", _emulated_chain_kernel(tmp_path, launches))
    args, comps, poss = apl.chain_self_test_problem(n, mx.float32, tokens)
    if start is not None:
        poss = mx.arange(start, start + tokens, dtype=mx.int32)
    got = apl.attn_prologue_chain(**args, comps=comps, poss=poss, backend="cuda")
    want = apl.attn_prologue_chain(**args, comps=comps, poss=poss, backend="reference")
    assert len(launches) == 1 and launches[0][1][1] == tokens and len(got) == len(want) == tokens
    for t, (g, w) in enumerate(zip(got, want)):
        assert len(_flat(g)) == len(_flat(w)) == 3 - (n == 1) + sum(len(c.state) for c in comps)
        for i, (x, y) in enumerate(zip(_flat(g), _flat(w))):
            assert x.shape == y.shape, (t, i)
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-5, atol=1e-5, err_msg=f"token {t}, output {i}")


def test_chain_self_test_on_the_cpu_emulation(tmp_path, small_threadgroups):
    """The chain's first-use self-test (float32 on the emulation, as above): it passes, and
    fails for a kernel that gives every token the first token's compressor states."""
    small_threadgroups.setattr(apl, "SELF_TEST_DTYPES", apl.SELF_TEST_DTYPES[:1])
    launches = []
    emulated = _emulated_chain_kernel(tmp_path, launches)
    small_threadgroups.setattr(apl, "_chain_kernel", emulated)
    assert apl._chain_self_test("cuda") and launches

    def first_state(n, tokens):
        launch = emulated(n, tokens)

        def run(face, **kw):
            out = launch(face, **kw)
            head, rest = out[: 2 + tokens], out[2 + tokens :]
            return head + [rest[k - k % tokens] for k in range(len(rest))]  # each name's token-0 output

        return run

    small_threadgroups.setattr(apl, "_chain_kernel", first_state)
    assert not apl._chain_self_test("cuda")


@pytest.mark.parametrize("behaviour", ["raise", "garbage"])
def test_bad_face_falls_back_to_the_separate_launches(fake_gpu, behaviour):
    """A face that does not compile or computes garbage fails the first-use self-test: the
    prologue then runs as attn_prep and compressor_step launches (here their reference
    faces: the fake GPU's self-tests of those fail the same way)."""
    from test_kernel_selftest import fake_launches

    for mod in (apl, ap, cs):
        fake_launches(fake_gpu, mod, behaviour)
    args, comps = apl.self_test_problem(2, mx.float32)
    pos = mx.array(7, mx.int32)
    got = apl.attn_prologue(**args, pos=pos, comps=comps)
    want = apl.attn_prologue(**args, pos=pos, comps=comps, backend="reference")
    assert dispatch._self_tests[("attn_prologue", "metal")] is False
    assert all(np.array_equal(np.array(g), np.array(w)) for g, w in zip(_flat(got), _flat(want)))


def test_sources_share_the_two_kernels_text():
    for n in (1, 2):
        h, b = apl.kernel_sources("cuda", n)
        assert "//" not in b and b.count("#define tgx") == n and b.count("#undef tgx") == n
        assert dispatch.compact(dispatch.sections(ap.SOURCE)["attn_prep"]) in b
        assert b.count(dispatch.compact(dispatch.sections(cs.SOURCE)["compressor_step"])) == n
        mh, mb = apl.kernel_sources("metal", n)
        assert mb.endswith(b[len(dispatch.INDEX["cuda"]) :])


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc (no GPU)


NVCC_CASES = [("float32", 1, False), ("bfloat16", 1, False), ("bfloat16", 4, False), ("bfloat16", 4, True)]


@pytest.mark.parametrize("dtype,rows,chain", NVCC_CASES)
@pytest.mark.parametrize("n", [1, 2], ids=["hca", "csa"])
@pytest.mark.slow_after(1)
def test_cuda_face_compiles_with_nvcc(n, dtype, rows, chain, tmp_path):
    """The CUDA translation unit mx.fast.cuda_kernel builds at V4 Flash shapes (64 heads of 512,
    window 128, rope 64; CSA: ratio 4, the indexer's 64 x 128 query and its 128-wide compressor;
    HCA: ratio 128), projections in float32, one row, 4 sessions' rows and a 4-token chain, for
    sm_90 with warnings as errors."""
    family = [_cuda_source(k, *case) for k in (1, 2) for case in NVCC_CASES]
    nvcc_compile(tmp_path, _cuda_source(n, dtype, rows, chain), family=family)


def _cuda_source(n, dtype, rows, chain):
    f, i32 = "float32", "int32"
    h, b = apl.kernel_sources("cuda", n, rows, chain)
    in_names, out_names = apl.io(n, rows, chain)
    kinds = dict(kv_w=f, freqs=f, prm=f, step_pos=i32, poss=i32)
    ins = {name: kinds.get(name, dtype) for name in in_names if not name.startswith("c")}
    outs = {name: dtype for name in out_names if not name.startswith("c")}
    nhi = 64 if n == 2 else 0
    tmpl = [("TQ", dtype), ("TKV", dtype), ("TWN", f), ("TI", dtype), ("TR", dtype)]
    tmpl += [("NH", 64), ("D", 512), ("NHI", nhi), ("DI", 128), ("W", 128), ("RD", 64)]
    tmpl += [("THREADS", ap.THREADS), ("PER", ap.COPY_PER), ("AP_TGS", 12)]
    comps = [(4, 512, True), (4, 128, True)] if n == 2 else [(128, 512, False)]
    for c, (ratio, dim, overlap) in enumerate(comps):
        p = f"c{c}_"
        kinds = dict(kv=f, gate=f, periods=f, prm=f, meta=i32)
        ins.update({name: kinds.get(_base(name[len(p) :]), dtype) for name in in_names if name.startswith(p)})
        outs.update({name: dtype for name in out_names if name.startswith(p)})
        tmpl += [(p + "T", dtype), (p + "TK", f), (p + "TG", f), (p + "TB", dtype), (p + "TW", dtype)]
        tmpl += [(p + "M", ratio), (p + "D", dim), (p + "OVERLAP", overlap), (p + "ROPE", 64), (p + "PER", cs.PER)]
        tmpl += [(p.upper() + "TGS", 9)]
    assert list(ins) == in_names and list(outs) == out_names
    return mlx_cuda_source(f"attn_prologue{n}_{'chain' if chain else 'rows'}{rows}", h, b, ins, outs, tmpl)


def _base(name: str) -> str:
    """A rows variant's per-row input name without its row: buf_kv_3 -> buf_kv."""
    head, _, tail = name.rpartition("_")
    return head if tail.isdigit() else name


# ------------------------------------------------------------------ the compiled decode step through the launch


STATE_IN = [name.removesuffix("_out") for name in cs.OUTPUTS]  # a compressor's state inputs, in its outputs' order


class StandInKernel:
    """Takes `_launch`'s / `_launch_rows`' call (inputs by `io` name, template, grid, output
    shapes) and computes its outputs with the separate reference faces from those very inputs,
    row by row: the CPU runs the model's compiled step through the fused path's plumbing."""

    def __init__(self, ropes):
        self.ropes, self.calls, self.rows = ropes, 0, []

    def _rope(self, periods):
        return next(r for r in self.ropes if r.periods is periods)  # the layer's own RoPE object

    @staticmethod
    def _row(a: dict, n: int, rows: int, b: int, nhi: int) -> dict:
        """Row b's inputs under the one-row launch's names."""
        if rows == 1:
            return a
        r = slice(b, b + 1)
        one = dict(q=a["q_rows"][:, r], kv=a["kv_rows"][:, r], kv_w=a["kv_w"], ring=a[f"ring_{b}"])
        one.update(
            iq=a["iq_rows"][:, r] if nhi else a["iq_rows"], freqs=a["freqs"], prm=a["prm"], step_pos=a["poss"][b]
        )
        for i in range(n):
            p = f"c{i}_"
            one.update({p + k: a[f"{p}{k}_{b}"] for k in cs.ROW_IN})
            one.update({p + k: a[p + k] for k in ("bias", "weight", "periods", "prm")})
        return one

    def _one(self, a: dict, t: dict, n: int) -> list:
        """One row's outputs, in the one-row launch's order."""
        assert t["AP_TGS"] == ap.launch_groups(t["NH"], t["NHI"], a["ring"])
        rope = self._rope(a["freqs"])
        assert a["prm"][1].item() == np.float32(rope.attention_factor)
        iq = a["iq"] if t["NHI"] else None
        comps = []
        for i in range(n):
            c = {k: a[f"c{i}_{k}"] for k in apl._CS_INPUTS}
            ct = {k: t[f"c{i}_{k}"] for k in apl._CS_TEMPLATE}
            overlap = ct["OVERLAP"]
            state = [c["buf_kv"], c["buf_gate"], *([c["ov_kv"], c["ov_gate"]] if overlap else []), c["rows"]]
            norm = RMSNorm(ct["D"], float(c["prm"][0].item()))
            norm.weight = c["weight"]
            cap = state[-1].shape[-2]
            assert int(c["meta"][0].item()) == cap and ct["M"] == c["bias"].shape[0]
            assert t[f"C{i}_TGS"] >= cs.groups(cap, ct["M"], ct["D"], overlap, state[-1].dtype.size)
            comps.append(apl.CompressorJob(c["kv"], c["gate"], state, c["bias"], norm, self._rope(c["periods"]), ct["M"]))  # fmt: skip
        q, ring, iq_out, states = apl._separate(
            a["q"], a["kv"], a["kv_w"], a["ring"], a["step_pos"], rope, float(a["prm"][0].item()), iq, comps,
            t["NH"], t["NHI"], "reference",
        )  # fmt: skip
        out = [q, ring, iq_out]
        for st in states:
            dummy = mx.zeros((1,), st[0].dtype)
            out += st if len(st) == 5 else [st[0], st[1], dummy, dummy, st[2]]
        return out

    @staticmethod
    def _pack(per_row: list, t: dict, n: int, output_shapes, output_dtypes) -> list:
        """Several rows' (or chained tokens') one-row outputs as the rows / chain launch returns
        them: the queries stacked, each row's ring, the indexer queries, then each compressor
        output name by name, row by row."""
        rows = len(per_row)
        iq = mx.concatenate([r[2] for r in per_row]) if t["NHI"] else mx.zeros(output_shapes[1 + rows], output_dtypes[1 + rows])  # fmt: skip
        out = [mx.concatenate([r[0] for r in per_row]), *[r[1] for r in per_row], iq]
        out += [r[3 + k] for k in range(5 * n) for r in per_row]
        assert [tuple(o.shape) for o in out] == [tuple(s) for s in output_shapes]
        assert [o.dtype for o in out] == list(output_dtypes)
        return out

    def __call__(self, n, rows=1):
        def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            self.calls += 1
            self.rows.append(rows)
            a = dict(zip(apl.io(n, rows)[0], inputs))
            t = dict(template)
            assert threadgroup == (apl.THREADS, 1, 1) and t["THREADS"] == ap.THREADS and t["PER"] == ap.COPY_PER
            total = t["AP_TGS"] + sum(t[f"C{i}_TGS"] for i in range(n))
            assert grid == (total * apl.THREADS, rows, 1)
            per_row = [self._one(self._row(a, n, rows, b, t["NHI"]), t, n) for b in range(rows)]
            if rows > 1:
                return self._pack(per_row, t, n, output_shapes, output_dtypes)
            out = per_row[0]
            out[2] = out[2] if out[2] is not None else mx.zeros(output_shapes[2], output_dtypes[2])
            assert [tuple(o.shape) for o in out] == [tuple(s) for s in output_shapes]
            assert [o.dtype for o in out] == list(output_dtypes)
            return out

        return launch

    def chain(self, n, tokens):
        """A stand-in for `_chain_kernel(n, tokens)`: token t's outputs from the one-row
        reference over the ring and states token t - 1's left (the chain's meaning)."""

        def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            self.calls += 1
            self.rows.append(tokens)
            a, t = dict(zip(apl.io(n, tokens, chain=True)[0], inputs)), dict(template)
            assert grid == ((t["AP_TGS"] + sum(t[f"C{i}_TGS"] for i in range(n))) * apl.THREADS, tokens, 1)
            ring, states = a["ring"], [[a[f"c{i}_{k}"] for k in STATE_IN] for i in range(n)]
            per_token = []
            for r in range(tokens):
                one = dict(q=a[f"q_{r}"], kv=a[f"kv_{r}"], kv_w=a["kv_w"], ring=ring, iq=a[f"iq_{r}"])
                one.update(freqs=a["freqs"], prm=a["prm"], step_pos=a["poss"][r])
                for i in range(n):
                    p = f"c{i}_"
                    one.update({p + k: a[p + k] for k in ("bias", "weight", "periods", "prm", "meta")})
                    one.update({p + k: v for k, v in zip(STATE_IN, states[i])})
                    one.update({p + "kv": a[f"{p}kv_{r}"], p + "gate": a[f"{p}gate_{r}"]})
                out = self._one(one, t, n)
                ring, states = out[1], [out[3 + 5 * i : 8 + 5 * i] for i in range(n)]
                per_token.append(out)
            return self._pack(per_token, t, n, output_shapes, output_dtypes)

        return launch


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def v4_model(request, oracle, tmp_path_factory):
    """The tiny V4 oracle with >= 64 decode steps of ids: float32, or its bfloat16 copy
    loaded as a GPU loads it (`dtype=None`: 16-bit weights, float32 activations)."""
    src = oracle("make_tiny_deepseek_v4.py", "long")
    ids = [int(t) for t in np.load(src / "reference.npz")["input_ids"][0]]
    ids += [int(t) for t in np.random.default_rng(7).integers(0, max(ids) + 1, max(0, PREFILL + 72 - len(ids)))]
    if request.param == "float32":
        lm, _ = ds4mlx.load(str(src), dtype="float32", verbose=False)
    else:
        folder = _copy_as(src, tmp_path_factory.mktemp("v4-bf16") / "m", mx.bfloat16)
        lm, _ = ds4mlx.load(str(folder), dtype=None, verbose=False)
        assert lm.model.model.embed_tokens.weight.dtype == mx.bfloat16
    return lm, ids


def _decode(lm, ids, monkeypatch, how):
    monkeypatch.setenv(stepper.MODE_ENV, how)
    s = lm.new_session(ctx=len(ids) + 8, chunk=7)
    s.prefill(ids[:PREFILL])
    return np.stack([s.decode(t) for t in ids[PREFILL:]])


def test_compiled_step_through_the_launch_matches_legacy(v4_model, monkeypatch):
    """Every CSA / HCA layer's prologue goes through the one fused launch (a stand-in on the
    CPU) in the compiled step, the attention through its sparse-attention path: >= 64 steps of
    logits within 1e-4 of the legacy path (the per-layer forward), across buckets, in float32
    and under the GPU weight policy."""
    lm, ids = v4_model
    assert len(ids) - PREFILL >= 64
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    legacy = _decode(lm, ids, monkeypatch, "legacy")
    fake = StandInKernel(list(lm.model.model.ropes().values()))
    real = apl.attn_prologue
    monkeypatch.setattr(sparse, "FORCE_FACE", "reference")  # the GPU step's attention path, reference faces
    monkeypatch.setattr(deepseek_v4, "attn_prologue", lambda *a, backend=None, **k: real(*a, backend="cuda", **k))
    monkeypatch.setattr(apl, "_kernel", fake)
    stepper.forget(lm.model)
    try:
        compiled = _decode(lm, ids, monkeypatch, "compiled")
    finally:
        stepper.forget(lm.model)
    types = lm.model.args.layer_types
    per_trace = sum(t != "sliding_attention" for t in types)
    assert per_trace and fake.calls >= per_trace and fake.calls % per_trace == 0
    assert maxdiff(compiled, legacy) <= 1e-4


def test_batched_rows_through_the_launch_match_legacy(v4_model, monkeypatch):
    """Two sessions stepped together (session batching, `step_together`) from different
    positions: each compressed layer's rows go through one attn_prologue_rows launch (the
    stand-in), every row's logits within 1e-4 of its own session's legacy decode."""
    from ds4mlx.runtime.session import can_step_together, step_together

    lm, ids = v4_model
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    n = 40
    legacy = _decode(lm, ids[:n], monkeypatch, "legacy")  # positions PREFILL .. n-1
    fake = StandInKernel(list(lm.model.model.ropes().values()))
    real = apl.attn_prologue_rows
    monkeypatch.setattr(sparse, "FORCE_FACE", "reference")
    monkeypatch.setattr(deepseek_v4, "attn_prologue_rows", lambda *a, backend=None, **k: real(*a, backend="cuda", **k))
    monkeypatch.setattr(apl, "_kernel", fake)
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    stepper.forget(lm.model)
    try:
        a, b = lm.new_session(ctx=n + 8), lm.new_session(ctx=n + 8)
        a.prefill(ids[:PREFILL])
        b.prefill(ids[: PREFILL + 3])
        stepper.assume_checked(lm.model)  # (rows run once a single step passed its check: no single step here)
        assert can_step_together([a, b])
        for pa in range(PREFILL, n - 3):
            la, lb = step_together([a, b], [ids[pa], ids[pa + 3]])
            assert maxdiff(np.array(la)[None], legacy[pa - PREFILL : pa - PREFILL + 1]) <= 1e-4, pa
            assert maxdiff(np.array(lb)[None], legacy[pa + 3 - PREFILL : pa + 4 - PREFILL]) <= 1e-4, pa
    finally:
        stepper.forget(lm.model)
    assert fake.calls and set(fake.rows) == {2}


def test_verify_chain_through_the_launch_matches_plain_steps(v4_model, monkeypatch):
    """A speculative verify's rows (`Session.verify`, the compiled step's chain): each
    compressed layer's prologue goes through one attn_prologue_chain launch (the stand-in) for
    all the rows, row t over the state row t - 1 left; the rows' logits within 1e-4 of plain
    steps, across window ends and buckets."""
    lm, ids = v4_model
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    monkeypatch.setattr(sparse, "FORCE_FACE", "reference")
    n = 40
    plain = lm.new_session(ctx=n + 8)
    plain.prefill(ids[:PREFILL])
    want = np.stack([plain.decode(t) for t in ids[PREFILL:n]])
    fake = StandInKernel(list(lm.model.model.ropes().values()))
    real = apl.attn_prologue_chain

    def chain_on_cuda(*a, backend=None, **k):  # the sliding layers' attn_prep_chain stays on the reference
        return real(*a, backend="cuda" if a[8] else "reference", **k)

    monkeypatch.setattr(deepseek_v4, "attn_prologue_chain", chain_on_cuda)
    monkeypatch.setattr(apl, "_chain_kernel", fake.chain)
    stepper.forget(lm.model)
    try:
        s = lm.new_session(ctx=n + 8)
        s.prefill(ids[:PREFILL])
        got, pos = [s.decode(ids[PREFILL])[None]], PREFILL + 1
        for k in (3, 1, 4, 2, 3, 4, 2, 1, 4):
            if pos + k + 1 > n:
                break
            got.append(np.array(s.verify(ids[pos : pos + k + 1])))
            pos += k + 1
    finally:
        stepper.forget(lm.model)
    got = np.concatenate(got)
    assert fake.calls and set(fake.rows) == {2, 3, 4, 5}
    assert maxdiff(got, want[: len(got)]) <= 1e-4


# ------------------------------------------------------------------ GPU faces


@pytest.mark.gpu
def test_gpu_self_test_passes():
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    assert apl._self_test(face)


@pytest.mark.gpu
def test_gpu_chain_self_test_passes():
    """attn_prologue_chain (dispatch.UNVERIFIED_KERNELS' attn_prologue.chain until this passes
    on the device): five tokens across window ends, HCA and CSA, float32 and bfloat16."""
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    assert apl._chain_self_test(face)


def v4_chain_problem(n_comps: int, tokens: int):
    """attn_prologue_chain's arguments at V4 Flash's compressed-layer shapes (64 heads of 512,
    window 128, rope 64; CSA: ratio 4, the indexer's 64 x 128 query and its 128-wide
    compressor; HCA: ratio 128), float32: (args, comps, poss), the tokens across a window end
    and the ring's wrap."""
    from ds4mlx.models.layers import RoPE

    specs = [(4, 512, True, 64), (4, 128, True, 64)] if n_comps == 2 else [(128, 512, False, 16)]
    comps = []
    for j, (ratio, dim, overlap, cap) in enumerate(specs):
        _, _, state, bias, norm, crope = cs.random_problem(ratio, dim, 64, overlap, cap, 1.0, mx.float32, seed=j)
        k = mx.random.split(mx.random.key(40 + j), 2)
        width = (2 if overlap else 1) * dim
        kv, gate = (mx.random.normal((1, tokens, width), key=x) for x in k)
        comps.append(apl.CompressorJob(kv, gate, state, bias, norm, crope, ratio))
    k = mx.random.split(mx.random.key(50), 5)
    nhi = 64 if n_comps == 2 else 0
    args = dict(
        q_b=mx.random.normal((1, tokens, 64 * 512), key=k[0]),
        kv=mx.random.normal((1, tokens, 512), key=k[1]),
        kv_weight=1.0 + 0.1 * mx.random.normal((512,), key=k[2]),
        ring=mx.random.normal((1, 1, 128, 512), key=k[3]),
        rope=RoPE(64, 1.0 / (10000.0 ** (mx.arange(0, 64, 2, dtype=mx.float32) / 64)), 1.0),
        eps=1e-6,
        index_q_b=mx.random.normal((1, tokens, 64 * 128), key=k[4]) if nhi else None,
        heads=64,
        index_heads=nhi,
    )
    return args, comps, mx.arange(126, 126 + tokens, dtype=mx.int32)  # slots 126, 127, 0, 1; a window ends at 127


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2], ids=["hca", "csa"])
def test_chain_at_v4_shapes_on_the_cpu_emulation(n, tmp_path, small_threadgroups):
    """The GPU test's problem below (V4 Flash's shapes) through the chain's text on the g++
    emulation (64-thread groups): every token's outputs as attn_prologue's token after token."""
    launches = []
    small_threadgroups.setattr(apl, "_chain_kernel", _emulated_chain_kernel(tmp_path, launches))
    args, comps, poss = v4_chain_problem(n, 4)
    got = apl.attn_prologue_chain(**args, comps=comps, poss=poss, backend="cuda")
    want = apl.attn_prologue_chain(**args, comps=comps, poss=poss, backend="reference")
    assert len(launches) == 1 and len(got) == len(want) == 4
    for t, (g, w) in enumerate(zip(got, want)):
        assert apl._all_close(g, w, 1e-3), t


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2], ids=["hca", "csa"])
def test_gpu_chain_matches_token_by_token_at_v4_shapes(n):
    """attn_prologue_chain of 4 tokens at V4 Flash's shapes on the GPU face against
    attn_prologue token after token on the reference face (float32)."""
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    args, comps, poss = v4_chain_problem(n, 4)
    got = apl.attn_prologue_chain(**args, comps=comps, poss=poss, backend=face)
    with mx.stream(mx.cpu):
        want = apl.attn_prologue_chain(**args, comps=comps, poss=poss, backend="reference")
    assert len(got) == len(want) == 4
    for t, (g, w) in enumerate(zip(got, want)):
        assert apl._all_close(g, w, 1e-3), t
