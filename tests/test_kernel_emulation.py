"""Run the shared GPU kernel text on the CPU: g++ with an emulated threadgroup.

The kernels in ds4mlx/kernels/{hyper_connection,sparse_attention}.py are one text
for both GPU faces, written against the names of `ds4mlx.kernels.dispatch.PRELUDE`
and `INDEX`.  `run_on_cpu` compiles that very text with a CPU prelude in which a
threadgroup is THREADS std::threads (a barrier for the threadgroup barrier,
one per 32-thread "warp" for the SIMD-group barrier and the warp sum, threadgroup
arrays as function statics, GCC atomics for the counters) and runs the grid one
threadgroup at a time.  That checks the indexing, the barriers' placement and the
arithmetic of the kernels without a GPU; it cannot catch GPU-only issues
(compilation by NVRTC / Metal, races the emulation happens to order, speed).

This module also tests the emulation itself on a small kernel.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

CPU_PRELUDE = r"""
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>
// a plain generation-counting barrier (libstdc++ 12's std::barrier hung here after a few
// hundred phases with changing thread sets)
struct Ds4Barrier {
    explicit Ds4Barrier(int n) : n_(n) {}
    void arrive_and_wait() {
        std::unique_lock<std::mutex> lk(m_);
        const unsigned long gen = gen_;
        if (++count_ == n_) { count_ = 0; ++gen_; cv_.notify_all(); return; }
        cv_.wait(lk, [&] { return gen_ != gen; });
    }
    int n_, count_ = 0;
    unsigned long gen_ = 0;
    std::mutex m_;
    std::condition_variable cv_;
};
#define DS4_FN static inline
#define DS4_DEV
#define DS4_SHARED static
#define DS4_SHARED_ATOMIC static uint32_t
#define DS4_NEG_INF (-INFINITY)
#define ds4_atomic_add(p, v) __atomic_fetch_add((p), (v), __ATOMIC_RELAXED)
#define ds4_atomic_load(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define ds4_atomic_store(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
struct Ds4Warp { Ds4Barrier* bar; float vals[32]; };
static thread_local uint32_t ds4_tl_lane, ds4_tl_warp;
static std::vector<Ds4Warp*> ds4_warps;
static Ds4Barrier* ds4_tg_bar;
static inline float ds4_warp_sum(float v) {
    Ds4Warp* w = ds4_warps[ds4_tl_warp];
    w->vals[ds4_tl_lane] = v;
    w->bar->arrive_and_wait();
    float s = 0.0f;
    for (int i = 0; i < 32; ++i) s += w->vals[i];
    w->bar->arrive_and_wait();
    return s;
}
static inline void ds4_warp_barrier() { ds4_warps[ds4_tl_warp]->bar->arrive_and_wait(); }
static inline void ds4_tg_barrier() { ds4_tg_bar->arrive_and_wait(); }
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
    src = ["".join(_const(k, v) for k, v in consts.items()), header]  # after the prelude (see _compile)
    params = []
    for name, arr in inputs.items():
        params.append(f"const {_CTYPE[np.asarray(arr).dtype]}* {name}")
    for name, (_, dt) in outputs.items():
        params.append(f"{_CTYPE[np.dtype(dt)]}* {name}")
    src.append(
        "static void ds4_body("
        + ", ".join(params)
        + ", uint32_t tid_, uint32_t tgx_, uint32_t tgy_, uint32_t tgz_) {\n"
        "    ds4_tl_lane = tid_ & 31u; ds4_tl_warp = tid_ >> 5;\n"
        "    const uint32_t tid = tid_, tgx = tgx_, tgy = tgy_, tgz = tgz_;\n"
        "    const uint32_t lane = tid & 31u, warp = tid >> 5;\n"
        "    (void)tid; (void)tgx; (void)tgy; (void)tgz; (void)lane; (void)warp;\n" + body + "\n}\n"
    )
    main = [
        "template <typename U> static std::vector<U> ds4_load(const char* p, size_t n) {\n"
        '    std::vector<U> v(n ? n : 1); FILE* f = std::fopen(p, "rb");\n'
        "    if (!f || (n && std::fread(v.data(), sizeof(U), n, f) != n)) std::abort();\n"
        "    std::fclose(f); return v; }\n",
        "int main(int argc, char** argv) {\n    int a = 1;\n",
    ]
    args = []
    for name, arr in inputs.items():
        arr = np.asarray(arr)
        main.append(
            f"    const int i_{name} = a; auto v_{name} = ds4_load<{_CTYPE[arr.dtype]}>(argv[a++], {arr.size});\n"
        )
        args.append(f"v_{name}.data()")
    for name, (shape, dt) in outputs.items():
        size = int(np.prod(shape))
        main.append(
            f"    const int o_{name} = a; auto v_{name} = ds4_load<{_CTYPE[np.dtype(dt)]}>(argv[a++], {size});\n"
        )
        args.append(f"v_{name}.data()")
    gx, gy, gz = groups
    main.append(
        f"    Ds4Barrier tg({threads}); ds4_tg_bar = &tg;\n"
        f"    for (int w = 0; w < {threads // 32}; ++w) ds4_warps.push_back(new Ds4Warp{{new Ds4Barrier(32), {{}}}});\n"
        f"    for (uint32_t z = 0; z < {gz}u; ++z) for (uint32_t y = 0; y < {gy}u; ++y) for (uint32_t x = 0; x < {gx}u; ++x) {{\n"
        f"        std::vector<std::thread> th;\n"
        f"        for (uint32_t t = 0; t < {threads}u; ++t) th.emplace_back(ds4_body, {', '.join(args)}, t, x, y, z);\n"
        f"        for (auto& t : th) t.join();\n    }}\n"
    )
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


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc (no GPU needed)

_CUDA_TYPE = {
    "float32": "float",
    "bfloat16": "__nv_bfloat16",
    "float16": "__half",
    "int32": "int32_t",
    "uint32": "uint32_t",
}


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
        "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cooperative_groups.h>\n"
        "#include <cuda/std/cstdint>\n#include <cuda/std/limits>\n"
        "using cuda::std::uint32_t; using cuda::std::uint64_t; using cuda::std::int32_t; using cuda::std::uint16_t;\n"
        "#define inf cuda::std::numeric_limits<float>::infinity()\n"
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


def nvcc_compile(tmp_path: Path, source: str, arch: str = "sm_90") -> None:
    """Compile to PTX for `arch` (the H200 is sm_90); fails the test on any error or warning."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    from cache_dirs import cache_dir

    cu = Path(tmp_path) / "kernel.cu"
    cu.write_text(source)
    flags = ["-std=c++17", f"-arch={arch}", "--ptx", "-Werror", "all-warnings", "-diag-suppress", "177,550"]
    # a source this nvcc already compiled cleanly with these flags (a PTX in the suite's
    # cache) compiles cleanly again: its PTX is reused
    if "nvcc" not in _cache:
        _cache["nvcc"] = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([_cache["nvcc"], *flags, source]).encode()).hexdigest()[:32]
    cached = cache_dir("nvcc") / f"kernel-{key}.ptx"
    if cached.exists():
        shutil.copyfile(cached, cu.with_suffix(".ptx"))
        return
    res = subprocess.run([nvcc, *flags, "-o", str(cu.with_suffix(".ptx")), str(cu)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    shutil.copyfile(cu.with_suffix(".ptx"), tmp)
    os.replace(tmp, cached)
