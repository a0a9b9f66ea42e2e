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
from ds4mlx import stepper
from ds4mlx.kernels import attn_prep as ap
from ds4mlx.kernels import attn_prologue as apl
from ds4mlx.kernels import compressor_step as cs
from ds4mlx.kernels import dispatch
from ds4mlx.kernels import sparse_attention as sparse
from ds4mlx.models import cache as row_cache
from ds4mlx.models import deepseek_v4
from ds4mlx.models.layers import RMSNorm

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import maxdiff  # noqa: E402

pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")

_TYPES = ("TQ", "TKV", "TWN", "TI", "TR") + tuple(f"c{i}_{t}" for i in range(2) for t in ("T", "TK", "TG", "TB", "TW"))


def _emulated_kernel(tmp_path, launches):
    """A stand-in for apl._kernel(n): the fused text on the g++ emulation, with the inputs,
    template and grid the module passes."""

    def kernel(n):
        header, body = apl.shared_text(n)
        return emulated_launch(tmp_path, launches, CPU_TRIG + header, body, apl.io(n), float_consts=_TYPES)

    return kernel


@pytest.fixture
def small_threadgroups(monkeypatch):
    """64-thread threadgroups (the emulation runs a thread per std::thread)."""
    for mod in (ap, cs, apl):
        monkeypatch.setattr(mod, "THREADS", 64)
    monkeypatch.setattr(cs, "PER", 2)
    return monkeypatch


def _flat(out) -> list:
    return [a for a in out[:3] if a is not None] + [a for st in out[3] for a in st]


@pytest.mark.parametrize("n", [1, 2], ids=["hca", "csa"])
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

    def ring_unwritten(n):  # a kernel that returns the ring as it was
        launch = emulated(n)

        def run(face, **kw):
            out = launch(face, **kw)
            return [kw["inputs"][4] if i == 1 else o for i, o in enumerate(out)]

        return run

    small_threadgroups.setattr(apl, "_kernel", ring_unwritten)
    assert not apl._self_test("cuda")


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2], ids=["hca", "csa"])
def test_cuda_face_compiles_with_nvcc(n, dtype, tmp_path):
    """The CUDA translation unit mx.fast.cuda_kernel builds at V4 Flash shapes (64 heads of 512,
    window 128, rope 64; CSA: ratio 4, the indexer's 64 x 128 query and its 128-wide compressor;
    HCA: ratio 128), projections in float32, for sm_90 with warnings as errors."""
    f, i32 = "float32", "int32"
    h, b = apl.kernel_sources("cuda", n)
    in_names, out_names = apl.io(n)
    ins = dict(q=dtype, kv=dtype, kv_w=f, iq=dtype, ring=dtype, freqs=f, prm=f, step_pos=i32)
    outs = dict(q_out=dtype, ring_out=dtype, iq_out=dtype)
    nhi = 64 if n == 2 else 0
    tmpl = [("TQ", dtype), ("TKV", dtype), ("TWN", f), ("TI", dtype), ("TR", dtype)]
    tmpl += [("NH", 64), ("D", 512), ("NHI", nhi), ("DI", 128), ("W", 128), ("RD", 64)]
    tmpl += [("THREADS", ap.THREADS), ("PER", ap.COPY_PER), ("AP_TGS", 12)]
    comps = [(4, 512, True), (4, 128, True)] if n == 2 else [(128, 512, False)]
    for c, (ratio, dim, overlap) in enumerate(comps):
        p = f"c{c}_"
        kinds = dict(kv=f, gate=f, periods=f, prm=f, meta=i32)
        ins.update({p + name: kinds.get(name, dtype) for name in apl._CS_INPUTS})
        outs.update({p + name: dtype for name in cs._OUTPUTS})
        tmpl += [(p + "T", dtype), (p + "TK", f), (p + "TG", f), (p + "TB", dtype), (p + "TW", dtype)]
        tmpl += [(p + "M", ratio), (p + "D", dim), (p + "OVERLAP", overlap), (p + "ROPE", 64), (p + "PER", cs.PER)]
        tmpl += [(p.upper() + "TGS", 9)]
    assert list(ins) == in_names and list(outs) == out_names
    nvcc_compile(tmp_path, mlx_cuda_source(f"attn_prologue{n}", h, b, ins, outs, tmpl))


# ------------------------------------------------------------------ the compiled decode step through the launch


class StandInKernel:
    """Takes `_launch`'s call (inputs by `io` name, template, grid, output shapes) and computes
    its outputs with the separate reference faces from those very inputs: the CPU runs the
    model's compiled step through the fused path's plumbing."""

    def __init__(self, ropes):
        self.ropes, self.calls = ropes, 0

    def _rope(self, periods):
        return next(r for r in self.ropes if r.periods is periods)  # the layer's own RoPE object

    def __call__(self, n):
        def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            self.calls += 1
            a = dict(zip(apl.io(n)[0], inputs))
            t = dict(template)
            assert threadgroup == (apl.THREADS, 1, 1) and t["THREADS"] == ap.THREADS and t["PER"] == ap.COPY_PER
            total = t["AP_TGS"] + sum(t[f"C{i}_TGS"] for i in range(n))
            assert grid == (total * apl.THREADS, 1, 1) and t["AP_TGS"] == ap._groups(t["NH"], t["NHI"], a["ring"])
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
                assert t[f"C{i}_TGS"] == cs.groups(cap, ct["M"], ct["D"], overlap, state[-1].dtype.size)
                comps.append(apl.CompressorJob(c["kv"], c["gate"], state, c["bias"], norm, self._rope(c["periods"]), ct["M"]))  # fmt: skip
            q, ring, iq_out, states = apl._separate(
                a["q"], a["kv"], a["kv_w"], a["ring"], a["step_pos"], rope, float(a["prm"][0].item()), iq, comps,
                t["NH"], t["NHI"], "reference",
            )  # fmt: skip
            out = [q, ring, iq_out if iq_out is not None else mx.zeros(output_shapes[2], output_dtypes[2])]
            for st in states:
                out += st if len(st) == 5 else [st[0], st[1], mx.zeros((1,), st[0].dtype), mx.zeros((1,), st[0].dtype), st[2]]  # fmt: skip
            assert [tuple(o.shape) for o in out] == [tuple(s) for s in output_shapes]
            assert [o.dtype for o in out] == list(output_dtypes)
            return out

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


# ------------------------------------------------------------------ GPU faces


@pytest.mark.gpu
def test_gpu_self_test_passes():
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    assert apl._self_test(face)
