"""Run-time choice between a kernel's three faces: pure-MLX reference, Metal, CUDA.

Every custom kernel in `ds4mlx.kernels` has the same three implementations with the
same grid, tiling, inputs and outputs.  `backend()` names the one to use for a
device; `Kernel` builds (once, lazily) and launches the Metal or CUDA face through
``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel``; `sections()` reads the
``// @@ name`` sections of a kernel source file under ``kernels/metal/`` so one file can
hold the code shared by both GPU faces.

``DS4MLX_KERNELS=reference`` forces the reference face everywhere (debugging,
bisecting a kernel); ``DS4MLX_KERNELS=metal|cuda`` insists on that face.

`auto_face` is what the model paths use: `backend()`, except that a face this
project has never run on real hardware (`UNVERIFIED_FACES`: Metal, no Apple GPU was
available) must first pass a small self-test against the reference, once per
kernel; a failure (a compile error or a wrong result) is logged and that kernel
falls back to the reference face.  ``DS4MLX_KERNEL_SELFTEST=1`` tests every GPU
face, ``0`` none.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from functools import cache, lru_cache
from pathlib import Path

import mlx.core as mx

from ds4mlx.kernels import cuda_cache

BACKENDS = ("reference", "metal", "cuda")
METAL_DIR = Path(__file__).resolve().parent / "metal"  # package data: ships in the wheel
# GPU faces never run on real hardware here (the CUDA faces ran their tests on an H200)
UNVERIFIED_FACES = ("metal",)
# kernels (auto_face names) whose every GPU face is self-tested at first use: their CUDA
# face has passed the g++ emulation and nvcc but not yet its `pytest -m gpu` run
UNVERIFIED_KERNELS = {  # every other kernel's CUDA face passed its `pytest -m gpu` tests (docs/device.md)
    "affine_qmv.norm",  # the plain mode with an RMSNorm folded in (the decode step's q_a norm): no GPU test of its own
    # the rows kernels' first-use self-tests passed on an H100 (2026-12-07); no test at V4 Flash's
    # shapes on a GPU yet (the `batched` phase's rows-vs-alone is it)
    "sparse_attention.attend_rows",  # B sessions' decode queries in one attend launch (session batching)
    "compressor_step.rows",  # B sessions' tokens through one compressor in one launch (session batching)
    "attn_prep.rows",  # B sessions' attention prologues of one layer in one launch (session batching)
    "attn_prologue.rows",  # attn_prologue for B sessions' rows of one layer (session batching)
    # a dense mat-vec and the next mHC site in one launch: one row passed on an H100 (2026-12-07),
    # 4 bfloat16 rows differ from the two calls (automatic launches fuse one row: qmv_hc.AUTO_ROWS)
    "qmv_hc",
    "grouped_qmm_mma.Q8_0",  # prefill's GGUF expert GEMMs on tensor cores / simdgroup matrices (grouped_qmm mma)
    "grouped_qmm_mma.Q2_K",
    "grouped_qmm_mma.Q4_K",
    "grouped_qmm_mma.IQ2_XXS",
}

log = logging.getLogger("ds4mlx.kernels")
_self_tests: dict[tuple[str, str], bool] = {}
_chosen: list[str] = []  # faces chosen by `use_face` (innermost last)


@contextmanager
def use_face(face: str | None):
    """Run the block with every automatic launch on `face` (None: the device's face),
    like ``DS4MLX_KERNELS`` but scoped and without touching the environment; the
    kernel bench compares the faces of a whole model this way."""
    if face is not None and face not in BACKENDS:
        raise ValueError(f"face must be one of {BACKENDS}, got {face!r}")
    _chosen.append(face or "")
    try:
        yield
    finally:
        _chosen.pop()


def _forced_face() -> str:
    """The face `use_face` or ``DS4MLX_KERNELS`` insists on ('' when none)."""
    if _chosen:
        return _chosen[-1]
    return os.environ.get("DS4MLX_KERNELS", "").strip().lower()


def gpu_backend() -> str | None:
    """'metal' or 'cuda' when this MLX build has that GPU backend and a device."""
    try:
        if mx.metal.is_available():
            return "metal"
    except Exception:  # pragma: no cover - builds without the metal module
        pass
    cuda = getattr(mx, "cuda", None)
    try:
        if cuda is not None and cuda.is_available():
            return "cuda"
    except Exception:  # pragma: no cover
        pass
    return None


def backend(device=None) -> str:
    """The face to run on `device` (an ``mx.Device`` or ``mx.cpu`` / ``mx.gpu``;
    default: MLX's default device)."""
    forced = _forced_face()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"DS4MLX_KERNELS must be one of {BACKENDS}, got {forced!r}")
        return forced
    device = mx.default_device() if device is None else device
    kind = device if isinstance(device, mx.DeviceType) else device.type
    if kind != mx.DeviceType.gpu:
        return "reference"
    return gpu_backend() or "reference"


def _wants_self_test(face: str, kernel: str = "") -> bool:
    mode = os.environ.get("DS4MLX_KERNEL_SELFTEST", "").strip()
    if mode in ("0", "1"):
        return mode == "1"
    return face in UNVERIFIED_FACES or kernel in UNVERIFIED_KERNELS


def auto_face(kernel: str, self_test) -> str:
    """The face for an automatic (not caller-chosen) launch of `kernel`: `backend()`,
    unless that face must pass `self_test(face) -> bool` (once per kernel and face;
    it compares the face with the reference on a small input) and does not: then
    'reference', with a warning.  A face forced by DS4MLX_KERNELS is not tested."""
    face = backend()
    if face == "reference" or _forced_face() or not _wants_self_test(face, kernel):
        return face
    key = (kernel, face)
    ok = _self_tests.get(key)
    if ok is None:
        try:
            ok, why = bool(self_test(face)), "its result differs from the reference"
        except Exception as e:  # a kernel that does not compile or launch
            ok, why = False, f"{type(e).__name__}: {e}"
        _self_tests[key] = ok
        if ok:
            log.info("kernel %s: the %s face passed its first-use self-test", kernel, face)
        else:
            log.warning(
                "kernel %s: the %s face failed its first-use self-test (%s); using the MLX reference path for it",
                kernel,
                face,
                why,
            )
    return face if ok else "reference"


def close_enough(got, want, rtol: float = 1e-3, atol: float = 1e-4) -> bool:
    """Self-test comparison: finite and within tolerance (float32 sums in another order)."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return bool(mx.all(mx.isfinite(got)).item()) and bool(mx.allclose(got, want, rtol=rtol, atol=atol).item())


@cache
def sections(path: str | Path) -> dict[str, str]:
    """``// @@ name`` delimited sections of a source file -> {name: text}."""
    text = Path(path).read_text()
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines(keepends=True):
        m = re.match(r"^\s*//\s*@@\s*([A-Za-z0-9_]+)\s*$", line)
        if m:
            name = m.group(1)
            out.setdefault(name, "")
        elif name is not None:
            out[name] += line
    return out


class Kernel:
    """One custom kernel, two GPU faces built from (header, source) pairs.

    `metal` and `cuda` are ``(header, source)``; the source is the kernel body as
    ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` expect.  Calling the kernel
    passes through ``inputs``, ``template``, ``grid`` (total threads, the Metal
    convention, which MLX's CUDA backend follows too), ``threadgroup``,
    ``output_shapes`` and ``output_dtypes``.
    """

    def __init__(self, name, input_names, output_names, *, metal, cuda):
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.faces = {"metal": metal, "cuda": cuda}
        self._built: dict[str, object] = {}

    def source(self, face: str) -> tuple[str, str]:
        return self.faces[face]

    def _build(self, face: str):
        if face not in self._built:
            header, source = self.faces[face]
            # mx.fast.metal_kernel / mx.fast.cuda_kernel: the same arguments, one per face
            make = {"metal": "metal_kernel", "cuda": "cuda_kernel"}.get(face)
            if make is None:
                raise ValueError(f"no GPU face {face!r}")
            fn = getattr(mx.fast, make)(
                name=self.name,
                input_names=self.input_names,
                output_names=self.output_names,
                source=source,
                header=header,
            )
            self._built[face] = fn
        return self._built[face]

    def __call__(self, face: str, **kwargs) -> list[mx.array]:
        fn = self._build(face)
        if face == "cuda":
            cuda_cache.prepare(self, fn, kwargs)  # compiled once per machine, not once per process
        return fn(**kwargs)


# --------------------------------------------------------------------------- shared preludes
#
# Kernels written as one text for both GPU faces (hyper_connection, sparse_attention)
# use these names, defined per face below (and by a CPU prelude in the tests, which
# compile the same text with g++, emulating a threadgroup with fibers):
#   DS4_FN                       helper-function qualifier
#   DS4_DEV                      address space of kernel buffers (device / nothing)
#   DS4_SHARED                   declares a threadgroup array in a kernel body
#   DS4_SHARED_ATOMIC            declares a threadgroup array of atomic 32-bit counters
#   ds4_atomic_add/load/store(p) relaxed operations on such a counter
#   ds4_warp_sum(f)              sum over the 32 lanes of a SIMD group / warp
#   ds4_warp_barrier()           SIMD-group barrier (with threadgroup memory ordering)
#   ds4_tg_barrier()             threadgroup barrier
#   ds4_exp, ds4_rsqrt, ds4_fmax, ds4_float_bits, ds4_as_float (bits -> float), DS4_NEG_INF
# and, from the index section, the 1-D threadgroup coordinates
#   tid (thread in threadgroup), lane = tid % 32, warp = tid / 32, tgx, tgy, tgz
# (threadgroup position in the grid).  Grids are given in threads (Metal's
# convention, which MLX's CUDA backend follows); threadgroups are (THREADS, 1, 1).

PRELUDE = {
    "metal": r"""
#define DS4_FN inline
#define DS4_DEV device
#define DS4_SHARED threadgroup
#define DS4_SHARED_ATOMIC threadgroup atomic_uint
#define DS4_NEG_INF (-INFINITY)
#define ds4_atomic_add(p, v) atomic_fetch_add_explicit((p), (v), memory_order_relaxed)
#define ds4_atomic_load(p) atomic_load_explicit((p), memory_order_relaxed)
#define ds4_atomic_store(p, v) atomic_store_explicit((p), (v), memory_order_relaxed)
inline float ds4_warp_sum(float v) { return simd_sum(v); }
inline void ds4_warp_barrier() { simdgroup_barrier(mem_flags::mem_threadgroup); }
inline void ds4_tg_barrier() { threadgroup_barrier(mem_flags::mem_threadgroup); }
inline float ds4_exp(float x) { return metal::precise::exp(x); }
inline float ds4_rsqrt(float x) { return metal::precise::rsqrt(x); }
inline float ds4_fmax(float a, float b) { return metal::fmax(a, b); }
inline uint32_t ds4_float_bits(float f) { return as_type<uint32_t>(f); }
inline float ds4_as_float(uint32_t u) { return as_type<float>(u); }
""",
    "cuda": r"""
#define DS4_FN __device__ __forceinline__
#define DS4_DEV
#define DS4_SHARED __shared__
#define DS4_SHARED_ATOMIC __shared__ unsigned int
#define DS4_NEG_INF (__int_as_float(0xff800000))
#define ds4_atomic_add(p, v) atomicAdd((p), (v))
#define ds4_atomic_load(p) (*(volatile unsigned int*)(p))
#define ds4_atomic_store(p, v) (*(p) = (v))
__device__ __forceinline__ float ds4_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ void ds4_warp_barrier() { __syncwarp(); }
__device__ __forceinline__ void ds4_tg_barrier() { __syncthreads(); }
__device__ __forceinline__ float ds4_exp(float x) { return expf(x); }
__device__ __forceinline__ float ds4_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ float ds4_fmax(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ uint32_t ds4_float_bits(float f) { return __float_as_uint(f); }
__device__ __forceinline__ float ds4_as_float(uint32_t u) { return __uint_as_float(u); }
""",
}

INDEX = {
    "metal": r"""
const uint32_t tid = thread_position_in_threadgroup.x;
const uint32_t tgx = threadgroup_position_in_grid.x;
const uint32_t tgy = threadgroup_position_in_grid.y;
const uint32_t tgz = threadgroup_position_in_grid.z;
const uint32_t lane = tid & 31u;
const uint32_t warp = tid >> 5;
""",
    "cuda": r"""
const uint32_t tid = threadIdx.x;
const uint32_t tgx = blockIdx.x;
const uint32_t tgy = blockIdx.y;
const uint32_t tgz = blockIdx.z;
const uint32_t lane = tid & 31u;
const uint32_t warp = tid >> 5;
""",
}


# Ticket buffers per owner, handed out round robin.  MLX orders a graph's launches by data
# only (a node waits for the node that wrote one of its inputs; CUDA graphs and Metal's
# concurrent encoders alike), and no launch writes a ticket buffer as an output, so two
# data-independent launches of one owner (two rows' layers, two hc_pre of one x) may run
# at once: on one shared buffer their threadgroups counted into each other's tickets (the
# GPU: stale tickets and a wrong output in test_gpu_tails_equal_two_launches).
# Launches TICKET_RING apart reuse a buffer: more than the ops of one graph
# (MLX_MAX_OPS_PER_BUFFER, 400 here), and graphs run one after another on the stream.
TICKET_RING = max(512, int(os.environ.get("MLX_MAX_OPS_PER_BUFFER", "400")) + 1)
_TICKETS: dict[str, list] = {}
_TICKET_NEXT: dict[str, int] = {}


def tickets(owner: str, n: int, at_least: int) -> mx.array:
    """A zeroed uint32 buffer of >= n counters (>= at_least) for one "last threadgroup" launch
    of `owner`: the next of the owner's TICKET_RING buffers.  Each launch leaves its buffer
    zeroed (the threadgroup that counts last resets its counter), so no launch needs MLX's
    `init_value`, which fills every output of the launch first (a kernel per output, per
    layer and token).  Under `mx.compile` each traced launch keeps the buffer it got."""
    ring = _TICKETS.setdefault(owner, [])
    i = _TICKET_NEXT.get(owner, 0)
    _TICKET_NEXT[owner] = (i + 1) % TICKET_RING
    if i == len(ring):
        ring.append(None)
    buf = ring[i]
    if buf is None or buf.size < n:
        buf = mx.zeros((max(n, at_least),), mx.uint32)
        mx.eval(buf)  # a constant: allowed (and kept) while a decode step is traced
        ring[i] = buf
    return buf


@cache
def placeholder(dtype) -> mx.array:
    """A one-element array for a kernel input the launch does not read (an absent bias,
    indexer query or RoPE table: the kernel's inputs are fixed)."""
    a = mx.zeros((1,), dtype)
    mx.eval(a)  # a constant: allowed (and kept) while a decode step is traced
    return a


@lru_cache(maxsize=64)
def f32_scalar(v: float) -> mx.array:
    """[v] float32: a scalar kernel input (a scale), one array per value."""
    a = mx.array([v], dtype=mx.float32)
    mx.eval(a)  # a constant: allowed (and kept) while a decode step is traced
    return a


def ticket_buffers(owner: str) -> list[mx.array]:
    """Every ticket buffer `owner` has handed out (tests: all zero between launches)."""
    return [b for b in _TICKETS.get(owner, []) if b is not None]


def compact(text: str) -> str:
    """Kernel text without comments, indentation and blank lines (a line holding a string
    literal keeps its comment): MLX hashes a custom kernel's whole source on every launch
    (~0.15 µs of host time per KB on the H200), the .metal file keeps them."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if '"' not in line:
            line = re.sub(r"\s*//.*$", "", line)
        if line:
            out.append(line)
    return "\n".join(out) + "\n"


def row_select(n: int, inputs: dict, outputs: dict = None, macro: str = "DS4_ROW_SELECT", row: str = "row") -> str:
    """A define `macro` for the "rows" variant of a shared-text kernel (session batching: n
    sessions' rows in one launch, each with its own buffers): declares each name of `inputs`
    / `outputs` (name -> element type) as the pointer of this threadgroup's row, the variable
    `row` (inputs `name_0` .. `name_{n-1}`: `row_inputs`), so the kernel text reads its usual
    names.  The kernel defines `row` before it expands `macro`."""

    def pick(name):
        return "".join(f"{row} == {r}u ? {name}_{r} : " for r in range(n - 1)) + f"{name}_{n - 1}"

    decl = [f"const DS4_DEV {t}* {name} = {pick(name)};" for name, t in inputs.items()]
    decl += [f"DS4_DEV {t}* {name} = {pick(name)};" for name, t in (outputs or {}).items()]
    return f"#define {macro} " + " \\\n    ".join(decl) + "\n"


def row_inputs(names, n: int) -> list[str]:
    """`name_0` .. `name_{n-1}` of each name (in that order): a rows variant's per-row buffers."""
    return [f"{name}_{r}" for name in names for r in range(n)]


def shared_sources(path: str | Path, face: str, kernel: str, common: str = "common") -> tuple[str, str]:
    """(header, body) for `kernel` of a shared-text source file on `face`: the face's
    PRELUDE plus the file's `common` section, then INDEX plus the kernel's section."""
    sec = sections(path)
    return PRELUDE[face] + sec.get(common, ""), INDEX[face] + sec[kernel]
