"""A disk cache of our compiled CUDA kernels, in the place MLX itself looks.

MLX's CUDA backend NVRTC-compiles every ``mx.fast.cuda_kernel`` variant on first use in
each process and never writes the result to its PTX cache (``use_disk_cache=false`` for
custom kernels), so every fresh process spends seconds per variant compiling (about
three minutes for the V4 Flash decode step on an H200).  But before compiling, MLX
always *reads* its cache: ``$MLX_PTX_CACHE_DIR/<module>.ptx`` (+ ``.txt``: the kernel's
name and its mangled symbol), where ``<module>`` is the kernel's name followed by
``std::hash`` of its generated source in hex.  So this module writes those files itself:

1. the first launch of a variant (template values, dtypes) in a process asks MLX for the
   exact generated source (the kernel function's ``verbose=True`` print, captured);
2. if ``<module>.ptx`` is missing, it compiles that same source with NVRTC (the
   ``libnvrtc`` MLX loaded, through ctypes) or ``nvcc`` -- with a small stand-in for
   MLX's device header, which our kernels do not use (they bring their own prelude,
   `dispatch.PRELUDE`) -- and writes the cubin and the symbol the way MLX does;
3. MLX then loads it instead of compiling.  A later process compiles nothing.

Anything unexpected (no compiler, a capture that does not parse, a compile error) is
logged once and leaves the launch to MLX, which compiles as before: the cache can cost
time, never correctness.  ``DS4MLX_CUDA_CACHE=0`` turns it off.  `deferred()` lets a
caller that traces many launches before evaluating any (the compiled decode step)
compile the new variants in parallel, waiting for all of them on exit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import mlx.core as mx

from ..io.atomic_file import write_bytes_atomic

log = logging.getLogger("ds4mlx.kernels")

# MLX's generated source starts with these two includes (mlx/backend/cuda/custom_kernel.cpp)
DEVICE_HEADER = "mlx/backend/cuda/device/utils.cuh"
# ...a stand-in for the first: the types MLX's dtype names use (cuda/std/cstdint: NVRTC has no
# <stdint.h>, and its int64_t is long long), nothing else
STUB_HEADER = r"""
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/cstdint>
"""
MAX_FILE_NAME = 245  # MLX splits longer module names into folders (jit_module.cpp get_ptx_path)
_CAPTURE = re.compile(r"Generated source code for `([^`]+)`:\n```\n(.*)\n```\n", re.S)

_lock = threading.Lock()
_capture_lock = threading.Lock()
_seen: set = set()  # variants handled in this process
_failed: list[str] = []  # the first failure (then the cache stays off)
_pool: ThreadPoolExecutor | None = None
_pending: list[Future] = []
_defer_depth = 0


def enabled() -> bool:
    return os.environ.get("DS4MLX_CUDA_CACHE", "1").strip() != "0" and not _failed


def cache_dir() -> Path:
    """MLX's PTX cache folder: $MLX_PTX_CACHE_DIR, else <temp>/mlx/<version>/ptx."""
    env = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def ptx_path(module: str, root: Path | None = None) -> Path:
    """Where MLX looks for `module` (names over 245 characters become folders)."""
    root = cache_dir() if root is None else root
    parts = []
    while len(module) > MAX_FILE_NAME:
        parts.append(module[:MAX_FILE_NAME])
        module = module[MAX_FILE_NAME:]
    return root.joinpath(*parts, module + ".ptx")


@cache
def _hash_bytes():
    lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
    fn = lib._ZSt11_Hash_bytesPKvmm  # std::_Hash_bytes(const void*, size_t, size_t seed)
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
    return fn


def std_hash(text: str) -> int:
    """libstdc++'s std::hash<std::string> (what MLX keys a module by)."""
    data = text.encode()
    return _hash_bytes()(data, len(data), 0xC70F6907)


def module_name(kernel_name: str, source: str) -> str:
    return f"{kernel_name}_{std_hash(source):x}"


def parse_capture(text: str) -> tuple[str, str]:
    """(kernel name, source) from the kernel function's verbose print."""
    m = _CAPTURE.search(text)
    if not m:
        raise ValueError("no generated source in the captured output")
    return m.group(1), m.group(2)


def _capture_stdout(fn) -> str:
    """What `fn()` writes to file descriptor 1 (MLX prints with std::cout); one capture at a
    time (the descriptor is the process's)."""
    sys.stdout.flush()
    with _capture_lock, tempfile.TemporaryFile() as tmp:
        saved = os.dup(1)
        try:
            os.dup2(tmp.fileno(), 1)
            fn()
            # std::cout is flushed by the print's std::endl; flush C stdio too
            ctypes.CDLL(None).fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode(errors="replace")


# --------------------------------------------------------------------------- compilers


@cache
def _arch() -> str:
    """sm_XY(a) as MLX compiles for this device (an 'a' suffix from compute capability 9)."""
    env = os.environ.get("DS4MLX_CUDA_ARCH")
    if env:
        return env
    arch = str(mx.device_info(mx.gpu).get("architecture", ""))  # not the default device: a self-test may run on the CPU
    m = re.fullmatch(r"sm_(\d+)", arch)
    if not m:
        raise RuntimeError(f"unknown CUDA architecture {arch!r}")
    return arch + ("a" if int(m.group(1)) >= 90 else "")


def _site_roots() -> list[Path]:
    mlx_dir = Path(mx.__file__).resolve().parent
    roots = [mlx_dir.parent] if mlx_dir.name == "mlx" else [mlx_dir.parent.parent]
    roots += [Path(p) for p in sys.path if p and Path(p).is_dir()]
    return list(dict.fromkeys(roots))


def _cuda_homes() -> list[Path]:
    out = [Path(os.environ[k]) for k in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(k)]
    nvcc = shutil.which("nvcc")
    if nvcc:
        out.append(Path(nvcc).resolve().parent.parent)
    out += [Path(p) for p in sorted(glob.glob("/usr/local/cuda*"), reverse=True)]
    return out


@cache
def include_dirs() -> tuple[str, ...]:
    """MLX's include folders: CCCL (cooperative_groups needs cuda/std from CUDA 13 on: MLX's
    own copy, else a toolkit's), then the CUDA headers (the pip packages beside MLX first)."""
    cccl = [os.environ.get("MLX_CCCL_DIR", ""), str(Path(mx.__file__).resolve().parent / "include" / "cccl")]
    cccl += [str(h / "include" / "cccl") for h in _cuda_homes()]
    cccl = [d for d in cccl if d and Path(d, "cuda", "std").is_dir()][:1]
    found = []
    for root in _site_roots():
        found += glob.glob(str(root / "nvidia" / "*" / "include"))
        found += glob.glob(str(root / "nvidia" / "*" / "*" / "include"))
    found += [str(h / "include") for h in _cuda_homes()]
    cuda = [d for d in dict.fromkeys(found) if Path(d, "cuda_bf16.h").is_file()][:1]
    return tuple(cccl + cuda)


@cache
def _nvrtc():
    """The libnvrtc this process already loaded (MLX's), else one found beside MLX."""
    paths = []
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split()[-1] for line in f if "libnvrtc.so" in line and "builtins" not in line]
    except OSError:
        pass
    for root in _site_roots():
        paths += glob.glob(str(root / "nvidia" / "**" / "libnvrtc.so*"), recursive=True)
    paths += [str(p) for h in _cuda_homes() for p in sorted(h.glob("lib*/libnvrtc.so*"))]
    for p in dict.fromkeys(paths):
        if "builtins" in p or "alt" in Path(p).name:
            continue
        try:
            return ctypes.CDLL(p)
        except OSError:
            continue
    return None


def _check(lib, rc: int, what: str) -> None:
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}")


def compile_nvrtc(source: str, kernel_expr: str, arch: str) -> tuple[bytes, str]:
    """(cubin, mangled symbol of `kernel_expr`) with NVRTC, MLX's options."""
    lib = _nvrtc()
    if lib is None:
        raise RuntimeError("no libnvrtc")
    prog = ctypes.c_void_p()
    names = (ctypes.c_char_p * 1)(DEVICE_HEADER.encode())
    bodies = (ctypes.c_char_p * 1)(STUB_HEADER.encode())
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 1, bodies, names), "create")
    try:
        _check(lib, lib.nvrtcAddNameExpression(prog, kernel_expr.encode()), "name")
        opts = ["--device-as-default-execution-space", f"--gpu-architecture={arch}"]
        opts += [f"--include-path={d}" for d in include_dirs()]
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, buf)
            raise RuntimeError("NVRTC: " + buf.value.decode(errors="replace")[-2000:])
        mangled = ctypes.c_char_p()
        _check(lib, lib.nvrtcGetLoweredName(prog, kernel_expr.encode(), ctypes.byref(mangled)), "lowered name")
        symbol = mangled.value.decode()
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, buf), "cubin")
        return buf.raw, symbol
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_nvcc(source: str, kernel_name: str, arch: str) -> tuple[bytes, str]:
    """(cubin, mangled symbol) with nvcc (a machine with a toolkit but no NVRTC in reach)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("no nvcc")
    with tempfile.TemporaryDirectory() as tmp:
        header = Path(tmp, "inc", DEVICE_HEADER)
        header.parent.mkdir(parents=True)
        header.write_text(STUB_HEADER)
        src, out = Path(tmp, "k.cu"), Path(tmp, "k.cubin")
        src.write_text(source)
        incs = [f"-I{d}" for d in (f"{tmp}/inc", *include_dirs())]
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", *incs, "-o", str(out), str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("nvcc: " + (r.stderr or r.stdout)[-2000:])
        cubin = out.read_bytes()
    # the kernel's symbol: mlx::core::cu::<name>(...) mangles to _ZN3mlx4core2cu<len><name>E...
    stem = f"_ZN3mlx4core2cu{len(kernel_name)}{kernel_name}E".encode()
    at = cubin.find(stem)
    if at < 0:
        raise RuntimeError(f"symbol of {kernel_name} not in the cubin")
    return cubin, cubin[at : cubin.index(b"\0", at)].decode()


def compile_source(source: str, kernel_name: str, arch: str | None = None) -> tuple[bytes, str]:
    arch = arch or _arch()
    if _nvrtc() is not None:
        return compile_nvrtc(source, f"mlx::core::cu::{kernel_name}", arch)
    return compile_nvcc(source, kernel_name, arch)


def write_entry(module: str, kernel_name: str, cubin: bytes, symbol: str, source: str, root: Path | None = None):
    """The three files MLX's read_cached_ptx / write_cached_ptx use, written atomically
    (another process may be reading the cache)."""
    path = ptx_path(module, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    for suffix, data in ((".txt", f"mlx::core::cu::{kernel_name}\t{symbol}\n".encode()), (".cu", source.encode())):
        write_bytes_atomic(path.with_suffix(suffix), data, temp_prefix=".tmp-")
    write_bytes_atomic(path, cubin, temp_prefix=".tmp-")  # last: MLX treats the .ptx file as the entry's presence


# --------------------------------------------------------------------------- the hook


def _variant_key(kernel, kwargs) -> tuple:
    tmpl = tuple((n, v if not isinstance(v, mx.Dtype) else str(v)) for n, v in kwargs.get("template") or ())
    ins = tuple((str(a.dtype), a.ndim > 0) for a in kwargs["inputs"] if isinstance(a, mx.array))
    outs = tuple(str(d) for d in kwargs["output_dtypes"])
    return (kernel.name, tmpl, ins, outs)


def _build(module: str, kernel_name: str, source: str) -> None:
    try:
        if ptx_path(module).is_file():
            return
        cubin, symbol = compile_source(source, kernel_name)
        write_entry(module, kernel_name, cubin, symbol, source)
    except Exception as e:  # the launch still works: MLX compiles it itself
        _fail(f"{kernel_name}: {type(e).__name__}: {e}")


def _fail(why: str) -> None:
    with _lock:
        if not _failed:
            _failed.append(why)
            log.warning("CUDA kernel cache off for this process (MLX compiles each kernel itself): %s", why)


def prepare(kernel, fn, kwargs: dict) -> None:
    """Before a CUDA launch of `kernel` (its built MLX function `fn`): make sure MLX will
    find this variant compiled in its cache."""
    if not enabled():
        return
    key = _variant_key(kernel, kwargs)
    with _lock:
        if key in _seen:
            return
        _seen.add(key)
    try:
        kernel_name, source = parse_capture(_capture_stdout(lambda: fn(**kwargs, verbose=True)))
        module = module_name(kernel_name, source)
    except Exception as e:
        _fail(f"{kernel.name}: {type(e).__name__}: {e}")
        return
    if _defer_depth > 0:
        global _pool
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=max(1, min(16, (os.cpu_count() or 2))))
            _pending.append(_pool.submit(_build, module, kernel_name, source))
    else:
        _build(module, kernel_name, source)


@contextmanager
def deferred():
    """Compile the variants first launched inside the block in parallel; wait for all of
    them when it ends (before anything the block built is evaluated)."""
    global _defer_depth
    _defer_depth += 1
    try:
        yield
    finally:
        _defer_depth -= 1
        if _defer_depth == 0:
            wait()


def wait() -> None:
    while _pending:
        _pending.pop().result()
