"""Run the shared GPU kernel text on the CPU: g++ with an emulated threadgroup.

The kernels in ds4mlx/kernels/{hyper_connection,sparse_attention}.py are one text
for both GPU faces, written against the names of `ds4mlx.kernels.dispatch.PRELUDE`
and `INDEX`.  `run_on_cpu` compiles that very text with a CPU prelude in which a
threadgroup is THREADS fibers on one OS thread (ucontext; a barrier for the threadgroup
barrier, one per 32-thread "warp" for the SIMD-group barrier and the warp sum,
threadgroup arrays as function statics, GCC atomics for the counters) and runs the grid
one threadgroup at a time, in an order no GPU promises either way: threadgroups shuffled,
the threads between two barriers alternately last-first and first-last, threadgroup
arrays 0xFF (NaN) when a threadgroup starts.  That checks the indexing, the barriers'
placement and the arithmetic of the kernels without a GPU; it cannot catch GPU-only
issues (compilation by NVRTC / Metal, races between threads that run at once, speed).

This module also tests the emulation itself on a small kernel.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

CPU_PRELUDE = r"""
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS hides the ucontext calls without it
#endif
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>
#if defined(__SANITIZE_ADDRESS__)
#define DS4_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DS4_ASAN 1
#endif
#endif
#ifdef DS4_ASAN
#include <sanitizer/common_interface_defs.h>
#endif
#define DS4_FN static inline
#define DS4_DEV
#define DS4_SHARED static
#define DS4_SHARED_ATOMIC static uint32_t
#define DS4_NEG_INF (-INFINITY)
#define ds4_atomic_add(p, v) __atomic_fetch_add((p), (v), __ATOMIC_RELAXED)
#define ds4_atomic_load(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define ds4_atomic_store(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

// A threadgroup's threads are fibers on one OS thread: each runs until it reaches a
// barrier (or returns), then the next one runs; a barrier that every member reached
// releases them all for the next pass.  The order is adversarial, so that a kernel
// relying on an order no GPU promises fails here: the threadgroups of the grid run in a
// fixed shuffled order, the threads of a pass alternately from the last to the first and
// from the first to the last, and threadgroup arrays hold 0xFF bytes (NaN) when a
// threadgroup starts.  Threads that never meet at a barrier abort the run (a GPU hangs).
struct Ds4Fiber { ucontext_t ctx; char* stack; uint32_t tid; int wait; };  // wait: barrier, -1 runnable, -2 done
struct Ds4Bar { int n, count; };
static constexpr size_t DS4_STACK = size_t(1) << 19;  // per thread, mapped as it is touched
static std::vector<Ds4Fiber> ds4_fibers;
static std::vector<Ds4Bar> ds4_bars;  // [0]: the threadgroup's barrier, [1 + w]: warp w's
static std::vector<float> ds4_warp_vals;
static Ds4Fiber* ds4_cur;
static ucontext_t ds4_sched;
static const void* ds4_sched_bottom;
static size_t ds4_sched_size;
static void (*ds4_entry)(uint32_t, uint32_t, uint32_t, uint32_t);
static uint32_t ds4_group[3];
static unsigned ds4_group_serial;
struct Ds4Poisoned { void* p; unsigned serial; };
static std::vector<Ds4Poisoned> ds4_poisoned;

// after each threadgroup array's declaration: the first thread of a threadgroup to get
// there fills it with 0xFF bytes
static inline void ds4_poison(void* p, size_t n) {
    for (auto& e : ds4_poisoned)
        if (e.p == p) {
            if (e.serial != ds4_group_serial) { std::memset(p, 0xFF, n); e.serial = ds4_group_serial; }
            return;
        }
    ds4_poisoned.push_back({p, ds4_group_serial});
    std::memset(p, 0xFF, n);
}

static void ds4_to_scheduler() {
#ifdef DS4_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, ds4_sched_bottom, ds4_sched_size);
    swapcontext(&ds4_cur->ctx, &ds4_sched);
    __sanitizer_finish_switch_fiber(fake, &ds4_sched_bottom, &ds4_sched_size);
#else
    swapcontext(&ds4_cur->ctx, &ds4_sched);
#endif
}

static void ds4_fiber_main() {
#ifdef DS4_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &ds4_sched_bottom, &ds4_sched_size);
#endif
    ds4_entry(ds4_cur->tid, ds4_group[0], ds4_group[1], ds4_group[2]);
    ds4_cur->wait = -2;
#ifdef DS4_ASAN
    __sanitizer_start_switch_fiber(nullptr, ds4_sched_bottom, ds4_sched_size);
#endif
    setcontext(&ds4_sched);
}

static inline void ds4_arrive(int b) {
    ++ds4_bars[b].count;
    ds4_cur->wait = b;
    ds4_to_scheduler();
}

static inline void ds4_tg_barrier() { ds4_arrive(0); }
static inline void ds4_warp_barrier() { ds4_arrive(1 + int(ds4_cur->tid >> 5)); }
static inline float ds4_warp_sum(float v) {
    float* vals = &ds4_warp_vals[ds4_cur->tid & ~31u];
    vals[ds4_cur->tid & 31u] = v;
    ds4_warp_barrier();
    float s = 0.0f;
    for (int i = 0; i < 32; ++i) s += vals[i];
    ds4_warp_barrier();
    return s;
}

static void ds4_run_group(uint32_t threads, unsigned rank) {
    ++ds4_group_serial;
    for (uint32_t t = 0; t < threads; ++t) {
        Ds4Fiber& f = ds4_fibers[t];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = DS4_STACK;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, ds4_fiber_main, 0);
        // swapcontext does not read uc_stack; ASan's interceptor of it clears the shadow of
        // the whole stack it names at every switch (an mmap and two madvise calls each)
        f.ctx.uc_stack.ss_size = 0;
        f.wait = -1;
    }
    for (unsigned pass = rank;; ++pass) {
        const bool last_first = pass % 2 == 0;
        for (uint32_t k = 0; k < threads; ++k) {
            Ds4Fiber& f = ds4_fibers[last_first ? threads - 1 - k : k];
            if (f.wait != -1) continue;
            ds4_cur = &f;
#ifdef DS4_ASAN
            void* fake = nullptr;
            __sanitizer_start_switch_fiber(&fake, f.stack, DS4_STACK);
            swapcontext(&ds4_sched, &f.ctx);
            __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
            swapcontext(&ds4_sched, &f.ctx);
#endif
        }
        bool waiting = false, released = false;
        for (uint32_t t = 0; t < threads; ++t) {
            Ds4Fiber& f = ds4_fibers[t];
            if (f.wait < 0) continue;
            if (ds4_bars[f.wait].count == ds4_bars[f.wait].n) { f.wait = -1; released = true; }
            else waiting = true;
        }
        for (auto& b : ds4_bars) if (b.count == b.n) b.count = 0;
        if (!released && !waiting) return;
        if (!released) {
            std::fprintf(stderr, "emulation: threads wait at a barrier that the others of threadgroup (%u, %u, %u) never reach\n",
                         ds4_group[0], ds4_group[1], ds4_group[2]);
            std::abort();
        }
    }
}

// the grid, one threadgroup at a time in a fixed shuffled order (xorshift, Fisher-Yates)
static void ds4_launch(uint32_t threads, uint32_t gx, uint32_t gy, uint32_t gz,
                       void (*entry)(uint32_t, uint32_t, uint32_t, uint32_t)) {
    ds4_entry = entry;
    ds4_fibers.resize(threads);
    for (auto& f : ds4_fibers) {
        // a stack and, below it, a page that faults when the stack overflows
        void* p = mmap(nullptr, DS4_STACK + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED || mprotect(p, 4096, PROT_NONE) != 0) std::abort();
        f.stack = static_cast<char*>(p) + 4096;
    }
    for (uint32_t t = 0; t < threads; ++t) ds4_fibers[t].tid = t;
    ds4_bars.assign(1 + threads / 32, Ds4Bar{32, 0});
    ds4_bars[0].n = int(threads);
    ds4_warp_vals.assign(threads, 0.0f);
    const size_t n = size_t(gx) * gy * gz;
    std::vector<uint32_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = uint32_t(i);
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (size_t i = n; i > 1; --i) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        std::swap(order[i - 1], order[s % i]);
    }
    for (size_t r = 0; r < n; ++r) {
        const uint32_t g = order[r];
        ds4_group[0] = g % gx; ds4_group[1] = g / gx % gy; ds4_group[2] = g / gx / gy;
        ds4_run_group(threads, unsigned(r));
    }
}
static inline float ds4_exp(float x) { return std::exp(x); }
static inline float ds4_rsqrt(float x) { return 1.0f / std::sqrt(x); }
static inline float ds4_fmax(float a, float b) { return std::fmax(a, b); }
static inline uint32_t ds4_float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
#ifndef DS4_HAVE_AS_FLOAT  // defined once when both emulation preludes are combined
#define DS4_HAVE_AS_FLOAT
static inline float ds4_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
#endif
struct float4 { float x, y, z, w; };
struct uint4 { uint32_t x, y, z, w; };
#ifndef DS4_HAVE_BF16
#define DS4_HAVE_BF16
// bfloat16 as the GPUs round it (to nearest even); numpy uint16 arrays carry its bits
struct ds4_bf16 {
    uint16_t bits;
    ds4_bf16() = default;
    explicit ds4_bf16(float f) {
        uint32_t u; std::memcpy(&u, &f, 4);
        bits = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t((u >> 16) | 0x40u)
                                                : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
#endif
"""

# AddressSanitizer: an out-of-bounds read or write of any buffer or threadgroup array fails the run
_GXX = ["g++", "-std=c++20", "-O1", "-pthread", "-fsanitize=address", "-Wno-unused-variable"]
_cache: dict = {}  # "dir": this process's build folder; source hash -> built executable


def _build_dir() -> Path:
    """This process's build folder, with CPU_PRELUDE precompiled (a .gch next to the header;
    parsing the C++ standard headers was about half of every kernel's compile).  GCC takes
    the .gch only where it matches the flags, else it reads the header itself: the text
    compiled is the same either way."""
    if "dir" not in _cache:
        import atexit
        import tempfile

        d = Path(tempfile.mkdtemp(prefix="ds4mlx-emulation-"))
        atexit.register(shutil.rmtree, d, True)
        (d / "prelude.h").write_text(CPU_PRELUDE)
        subprocess.run(
            [*_GXX, "-x", "c++-header", "-o", str(d / "prelude.h.gch"), str(d / "prelude.h")], capture_output=True
        )
        _cache["dir"] = d
    return _cache["dir"]


def _build_key(text: str) -> str:
    """The executable's name: a hash of everything that made it (compiler and its version,
    flags, CPU_PRELUDE, the kernel's text)."""
    if "gxx" not in _cache:
        _cache["gxx"] = subprocess.run([_GXX[0], "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    for part in (_cache["gxx"], " ".join(_GXX), CPU_PRELUDE, text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _compile(tmp_path: Path, text: str) -> Path:
    """CPU_PRELUDE + `text` compiled (`-include` of the precompiled prelude) into an
    executable, kept in the suite's cache (cache_dirs.py): a text already built, by this
    process (a case that differs only in its data), the other worker or an earlier run,
    reuses that executable.  The source is kept as tmp_path/kernel.cpp."""
    from cache_dirs import cache_dir

    cpp = tmp_path / "kernel.cpp"
    cpp.write_text(text)
    key = _build_key(text)
    if key in _cache:
        return _cache[key]
    exe = cache_dir("emulation") / f"kernel-{key}"
    if not exe.exists():
        d = _build_dir()
        built = d / exe.name
        build = subprocess.run(
            [*_GXX, "-include", str(d / "prelude.h"), "-o", str(built), str(cpp)], capture_output=True, text=True
        )
        assert build.returncode == 0, build.stderr[-4000:]
        exe.parent.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_name(f"{exe.name}.tmp{os.getpid()}")
        shutil.copy2(built, tmp)
        os.replace(tmp, exe)  # atomic: the other worker may be writing the same key
    _cache[key] = exe
    return exe


_SHARED_DECL = re.compile(r"^(\s*(?:DS4_SHARED\s+[\w:]+|DS4_SHARED_ATOMIC)\s+(\w+)\s*\[[^;]*\];)", re.M)


def _poisoned(text: str) -> str:
    """`text` with `ds4_poison` after each threadgroup array's declaration (CPU_PRELUDE): the
    array holds 0xFF bytes when a threadgroup starts, as no GPU promises zeros."""
    return _SHARED_DECL.sub(r"\1 ds4_poison(\2, sizeof(\2));", text)


_CTYPE = {
    np.dtype(np.float32): "float",
    np.dtype(np.int32): "int32_t",
    np.dtype(np.uint32): "uint32_t",
    np.dtype(np.uint16): "ds4_bf16",  # bfloat16 bits (the CPU prelude's ds4_bf16)
}


def _const(name, value) -> str:
    if isinstance(value, bool):
        return f"constexpr bool {name} = {'true' if value else 'false'};\n"
    if isinstance(value, (int, np.integer)):
        return f"constexpr int {name} = {int(value)};\n"
    return f"using {name} = {_CTYPE[np.dtype(value)]};\n"


def run_on_cpu(
    tmp_path: Path,
    header: str,
    body: str,
    *,
    inputs: dict,
    outputs: dict,
    consts: dict,
    groups: tuple,
    threads: int,
    fill: float = np.nan,
    zeroed: tuple = (),
    inout: tuple = (),
) -> dict:
    """Compile `header` + `body` (a kernel's shared text, from its INDEX-free section) with
    the CPU prelude and run `groups` = (gx, gy, gz) threadgroups of `threads` threads.

    inputs: name -> array (float32 / int32 / uint32); outputs: name -> (shape, dtype);
    consts: template constants (int, bool, or a numpy dtype for a type name).
    Returns name -> output array (elements the kernel never wrote hold `fill`; outputs named in
    `zeroed` start at 0, as a launch with ``init_value=0`` gives them), and for each input named
    in `inout` its contents after the run (a kernel that writes through a const input)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    assert threads % 32 == 0
    tmp_path = Path(tmp_path)
    header, body = _poisoned(header), _poisoned(body)
    src = ["".join(_const(k, v) for k, v in consts.items()), header]  # after the prelude (see _compile)
    buffers = [(name, _CTYPE[np.asarray(arr).dtype], np.asarray(arr).size, "i") for name, arr in inputs.items()]
    buffers += [(name, _CTYPE[np.dtype(dt)], int(np.prod(shape)), "o") for name, (shape, dt) in outputs.items()]
    params = [f"{'const ' if kind == 'i' else ''}{ct}* {name}" for name, ct, _, kind in buffers]
    src.append(
        "static void ds4_body("
        + ", ".join(params)
        + ", uint32_t tid_, uint32_t tgx_, uint32_t tgy_, uint32_t tgz_) {\n"
        "    const uint32_t tid = tid_, tgx = tgx_, tgy = tgy_, tgz = tgz_;\n"
        "    const uint32_t lane = tid & 31u, warp = tid >> 5;\n"
        "    (void)tid; (void)tgx; (void)tgy; (void)tgz; (void)lane; (void)warp;\n" + body + "\n}\n"
    )
    main = [
        "".join(f"static std::vector<{ct}> v_{name};\n" for name, ct, _, _ in buffers),
        "static void ds4_thread(uint32_t t, uint32_t x, uint32_t y, uint32_t z) {\n"
        f"    ds4_body({''.join(f'v_{name}.data(), ' for name, *_ in buffers)}t, x, y, z);\n}}\n",
        "template <typename U> static std::vector<U> ds4_load(const char* p, size_t n) {\n"
        '    std::vector<U> v(n ? n : 1); FILE* f = std::fopen(p, "rb");\n'
        "    if (!f || (n && std::fread(v.data(), sizeof(U), n, f) != n)) std::abort();\n"
        "    std::fclose(f); return v; }\n",
        "int main(int argc, char** argv) {\n    int a = 1;\n",
    ]
    for name, ct, size, kind in buffers:
        main.append(f"    const int {kind}_{name} = a; v_{name} = ds4_load<{ct}>(argv[a++], {size});\n")
    gx, gy, gz = groups
    main.append(f"    ds4_launch({threads}u, {gx}u, {gy}u, {gz}u, ds4_thread);\n")
    for name, (shape, dt) in outputs.items():
        size = int(np.prod(shape))
        main.append(
            f'    {{ FILE* f = std::fopen(argv[o_{name}], "wb"); std::fwrite(v_{name}.data(), '
            f"sizeof(v_{name}[0]), {size}, f); std::fclose(f); }}\n"
        )
    for name in inout:
        size = np.asarray(inputs[name]).size
        main.append(
            f'    {{ FILE* f = std::fopen(argv[i_{name}], "wb"); std::fwrite(v_{name}.data(), '
            f"sizeof(v_{name}[0]), {size}, f); std::fclose(f); }}\n"
        )
    main.append("    return 0;\n}\n")
    exe = _compile(tmp_path, "".join(src) + "".join(main))
    files = []
    for name, arr in inputs.items():
        f = tmp_path / f"in_{name}"
        np.ascontiguousarray(arr).tofile(f)
        files.append(str(f))
    out_files = {}
    for name, (shape, dt) in outputs.items():
        f = tmp_path / f"out_{name}"
        if name in zeroed:
            init = np.zeros(shape, dt)
        elif np.dtype(dt).kind == "f":
            init = np.full(shape, fill, dtype=np.float64).astype(dt)
        else:
            init = np.full(shape, -7, dtype=np.int64).astype(dt)
        init.tofile(f)
        files.append(str(f))
        out_files[name] = (f, shape, dt)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")
    run = subprocess.run([str(exe), *files], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    got = {n: np.fromfile(f, dtype=dt).reshape(shape) for n, (f, shape, dt) in out_files.items()}
    for name in inout:
        arr = np.asarray(inputs[name])
        got[name] = np.fromfile(tmp_path / f"in_{name}", dtype=arr.dtype).reshape(arr.shape)
    return got


# ------------------------------------------------------------------ the emulation itself

_SELFTEST = r"""
DS4_SHARED float part[THREADS / 32];
DS4_SHARED_ATOMIC hist[4];
if (tid < 4u) ds4_atomic_store(&hist[tid], 0u);
ds4_tg_barrier();
const float v = x[tgx * THREADS + tid];
const float s = ds4_warp_sum(v);
if (lane == 0u) part[warp] = s;
ds4_atomic_add(&hist[tid & 3u], 1u);
ds4_tg_barrier();
if (tid == 0u) {
    float tot = 0.0f;
    for (int w = 0; w < THREADS / 32; ++w) tot += part[w];
    y[tgx] = tot;
    for (int b = 0; b < 4; ++b) counts[tgx * 4 + b] = ds4_atomic_load(&hist[b]);
}
"""


def emulated_launch(tmp_path, launches: list, header: str, body: str, io, *, float_consts, inout=(), grid_x=None):
    """A stand-in for a `dispatch.Kernel` launch (the kernels' "rows" variants): runs `body`
    after `header` through `run_on_cpu` with the inputs, template, grid and output shapes the
    module passes; `io` = (input names, output names); the template constants named in
    `float_consts` and 16-bit inputs become float32 (outputs come back in their dtypes);
    `grid_x(template, gx)` may widen the grid's x (a layout sized by the dtype).  Each launch
    appends (its template, its grid) to `launches`."""
    in_names, out_names = io

    def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        consts = {k: (np.float32 if k in float_consts else v) for k, v in template}
        arrays = {}
        for name, a in zip(in_names, inputs):
            a = a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a
            arrays[name] = np.array(a).reshape(-1)
        d = Path(tmp_path) / f"launch{len(launches)}"
        d.mkdir()
        launches.append((dict(template), grid))
        gx = grid[0] // threadgroup[0]
        out = run_on_cpu(
            d,
            header,
            body,
            inputs=arrays,
            outputs={
                name: (tuple(sh), np.float32 if dt in (mx.float32, mx.bfloat16, mx.float16) else np.int32)
                for name, sh, dt in zip(out_names, output_shapes, output_dtypes)
            },
            consts=consts,
            groups=(gx if grid_x is None else grid_x(dict(template), gx), grid[1], grid[2]),
            threads=threadgroup[0],
            inout=inout,
        )
        if "tickets" in inout:
            assert not out["tickets"].any()  # zero again after the launch
        return [mx.array(out[name]).astype(dt) for name, dt in zip(out_names, output_dtypes)]

    return launch


def test_emulated_threadgroup(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(-50, 50, (3, 96)).astype(np.float32)
    out = run_on_cpu(
        tmp_path,
        "",
        _SELFTEST,
        inputs={"x": x},
        outputs={"y": ((3,), np.float32), "counts": ((3, 4), np.uint32)},
        consts={"THREADS": 96},
        groups=(3, 1, 1),
        threads=96,
    )
    assert np.array_equal(out["y"], x.sum(axis=1))
    assert np.array_equal(out["counts"], np.full((3, 4), 24))


# Kernels a GPU does not promise to run right, one text (the mode an input: one build):
# 0 a thread reads its neighbour's threadgroup value with the barrier in place (right),
# 1 the same without the barrier, 2 a thread reads threadgroup memory nobody wrote,
# 3 a threadgroup reads what the one before it in the grid wrote in the same launch,
# 4 thread 0 leaves before a barrier the others wait at.
_ADVERSARIAL = r"""
DS4_SHARED float s[THREADS];
const int m = mode[0];
if (m == 4 && tid == 0u) return;
if (m != 2) s[tid] = x[tgx * THREADS + tid];
if (m != 1) ds4_tg_barrier();
float v = s[(tid + 1u) % THREADS];
if (m == 3) v = tgx == 0u ? 0.0f : y[(tgx - 1u) * THREADS + tid] + 1.0f;
y[tgx * THREADS + tid] = v;
"""


@pytest.mark.parametrize("mode", range(5))
def test_emulation_is_adversarial(tmp_path, mode):
    """What passes here must not lean on the emulation's order: its threadgroups run out of
    grid order, the threads between two barriers in both directions (alternately), threadgroup
    memory starts as NaN, and a barrier some threads never reach aborts the run."""
    threads, groups = 64, 8
    x = np.arange(groups * threads, dtype=np.float32).reshape(groups, threads)

    def run():
        return run_on_cpu(
            tmp_path / "run",
            "",
            _ADVERSARIAL,
            inputs={"x": x, "mode": np.array([mode], np.int32)},
            outputs={"y": ((groups, threads), np.float32)},
            consts={"THREADS": threads},
            groups=(groups, 1, 1),
            threads=threads,
        )["y"]

    (tmp_path / "run").mkdir()
    if mode == 4:
        with pytest.raises(AssertionError, match="never reach"):
            run()
        return
    y = run()
    if mode == 0:
        assert np.array_equal(y, np.roll(x, -1, axis=1))
    elif mode == 1:  # every threadgroup misses a neighbour's value: in some, the threads ran from
        # the first (all but the last miss theirs), in others from the last (only the last misses)
        bad = np.isnan(y)
        assert bad.any(axis=1).all() and bad[:, 0].any() and not bad[:, 0].all()
    elif mode == 2:
        assert np.isnan(y).all()
    else:  # grid order would give y[g] = g: some threadgroup ran before the one it reads
        assert np.isnan(y).any()


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc (no GPU needed)

_CUDA_TYPE = {
    "float32": "float",
    "bfloat16": "__nv_bfloat16",
    "float16": "__half",
    "int32": "int32_t",
    "uint32": "uint32_t",
}


# what MLX's device header brings in, ahead of the kernel's header: the only headers a kernel
# can count on (NVRTC builds it against the pip CUDA headers, which lack some of a toolkit's)
MLX_CUDA_PREAMBLE = (
    "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cooperative_groups.h>\n"
    "#include <cuda/std/cstdint>\n#include <cuda/std/limits>\n"
    "using cuda::std::uint32_t; using cuda::std::uint64_t; using cuda::std::int32_t; using cuda::std::uint16_t;\n"
    "#define inf cuda::std::numeric_limits<float>::infinity()\n"
)


def mlx_cuda_source(name: str, header: str, body: str, inputs: dict, outputs: dict, template: list) -> str:
    """The translation unit MLX 0.32's mx.fast.cuda_kernel builds (mlx/backend/cuda/custom_kernel.cpp:
    header, then `__global__ void` with `const T* input` / `T* output` parameters, the template
    arguments as constexpr / using lines, then the body), with MLX's own device header
    replaced by the CUDA headers it brings in.  inputs / outputs: name -> MLX dtype name."""

    def ty(v):
        return _CUDA_TYPE[v]

    params = [f"    const {ty(dt)}* {n}" for n, dt in inputs.items()] + [
        f"    {ty(dt)}* {n}" for n, dt in outputs.items()
    ]
    consts = []
    for n, v in template:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {n} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {n} = {v};")
        else:
            consts.append(f"  using {n} = {ty(v)};")
    return (
        MLX_CUDA_PREAMBLE
        + header
        + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        + f"__global__ void custom_kernel_{name}(\n"
        + ",\n".join(params)
        + ") {\n"
        + "\n".join(consts)
        + "\n\n"
        + body
        + "\n}\n\n} // namespace mlx::core::cu\n"
    )


_NVCC_FLAGS = ["-std=c++17", "--ptx", "-Werror", "all-warnings", "-diag-suppress", "177,550"]


def _nvcc_key(source: str, arch: str) -> str:
    """A source's name in the cache: a hash of nvcc's version, the flags and the source."""
    if "nvcc" not in _cache:
        _cache["nvcc"] = subprocess.run([shutil.which("nvcc"), "--version"], capture_output=True, text=True).stdout
    flags = [*_NVCC_FLAGS, f"-arch={arch}"]
    return hashlib.sha256("\0".join([_cache["nvcc"], *flags, source]).encode()).hexdigest()[:32]


def _nvcc(cu: Path, arch: str) -> subprocess.CompletedProcess:
    args = [shutil.which("nvcc"), *_NVCC_FLAGS, f"-arch={arch}", "-o", str(cu.with_suffix(".ptx")), str(cu)]
    return subprocess.run(args, capture_output=True, text=True)


def _cache_entry(entry: Path, data: bytes) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, entry)  # atomic: the other worker may be writing the same entry


def _one_unit(sources: list) -> str:
    """mlx_cuda_source texts as one translation unit: the CUDA headers once, then each text's
    header and kernel in a namespace of its own, the macros it defines undefined after it."""
    units = [MLX_CUDA_PREAMBLE]
    for i, src in enumerate(sources):
        own = src[len(MLX_CUDA_PREAMBLE) :]
        units.append(f"namespace ds4_unit{i} {{\n{own}\n}}  // namespace ds4_unit{i}\n")
        units += [f"#undef {m}\n" for m in dict.fromkeys(re.findall(r"^\s*#\s*define\s+(\w+)", own, re.M))]
    return "".join(units)


def nvcc_compile(tmp_path: Path, source: str, arch: str = "sm_90", family: tuple = ()) -> None:
    """Compile to PTX for `arch` (the H200 is sm_90); fails the test on any error or warning.

    A source this nvcc already compiled cleanly with these flags (an entry in the suite's cache)
    compiles cleanly again: its PTX is reused (tmp_path/kernel.ptx).  `family`: the sources of
    the test's cases, its own first (which compiles alone).  nvcc's start-up and the CUDA headers cost about a CPU second a
    call, most of a small kernel's build, so the family's uncached sources go through nvcc with
    this one, as one translation unit (_one_unit); when that compiles cleanly each of them is
    cached as clean (without a PTX of its own: pass no family to get kernel.ptx), else each
    source is compiled alone, for its own errors."""
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc")
    from cache_dirs import cache_dir

    cu = Path(tmp_path) / "kernel.cu"
    cu.write_text(source)
    entry = cache_dir("nvcc") / f"kernel-{_nvcc_key(source, arch)}"
    if entry.with_suffix(".ptx").exists():
        shutil.copyfile(entry.with_suffix(".ptx"), cu.with_suffix(".ptx"))
        return
    if family and entry.with_suffix(".ok").exists():
        return
    if family and source == family[0]:
        family = ()  # the fast tier's case (slow_after(1)) builds alone: the rest are the slow tier's
    failed = _cache.setdefault("nvcc_unit_failed", set())  # sources of a unit that did not compile
    batch = [source] + [
        s
        for s in dict.fromkeys(family)
        if s != source
        and s.startswith(MLX_CUDA_PREAMBLE)
        and not (cache_dir("nvcc") / f"kernel-{_nvcc_key(s, arch)}.ok").exists()
    ]
    if len(batch) > 1 and source.startswith(MLX_CUDA_PREAMBLE) and source not in failed:
        unit = Path(tmp_path) / "family.cu"
        unit.write_text(_one_unit(batch))
        if _nvcc(unit, arch).returncode == 0:
            for s in batch:
                _cache_entry(cache_dir("nvcc") / f"kernel-{_nvcc_key(s, arch)}.ok", b"")
            return
        failed.update(batch)  # one of them fails: each is compiled alone, for its own errors
    res = _nvcc(cu, arch)
    assert res.returncode == 0, res.stderr[-4000:]
    _cache_entry(entry.with_suffix(".ptx"), cu.with_suffix(".ptx").read_bytes())
    _cache_entry(entry.with_suffix(".ok"), b"")
