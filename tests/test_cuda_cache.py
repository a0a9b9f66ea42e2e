"""The CUDA kernel cache (ds4mlx.kernels.cuda_cache): MLX's module naming reproduced (libstdc++'s
std::hash, checked against g++), the verbose capture parsed, entries written where and how MLX
reads them, each variant prepared once, and (with a CUDA toolkit on the machine) every kernel
variant of the decode step compiled from MLX's generated source with the stand-in header."""

import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from ds4mlx.kernels import cuda_cache, dispatch

ROOT = Path(__file__).resolve().parent.parent

# MLX's generated source for a custom kernel (mlx/backend/cuda/custom_kernel.cpp build_kernel,
# MLX 0.32), rebuilt here so that the stand-in header can be compiled against real variants
CUDA_TYPES = {
    mx.float32: "float", mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.int32: "int32_t",
    mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.bool_: "bool", mx.int64: "int64_t",
}  # fmt: skip
TYPE_NAMES = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16", mx.int32: "int32"}


def mlx_generated(kernel, kw) -> tuple[str, str]:
    header, body = kernel.faces["cuda"]
    tmpl = kw.get("template") or []

    def tag(v):
        if isinstance(v, bool):
            return "_t" if v else "_f"
        return f"_{v}" if isinstance(v, int) else "_" + TYPE_NAMES[v]

    name = "custom_kernel_" + kernel.name + "".join(tag(v) for _, v in tmpl)
    src = f'\n#include "{cuda_cache.DEVICE_HEADER}"\n\n#include <cooperative_groups.h>\n\n' + header
    src += f"namespace mlx::core::cu {{\n\nnamespace cg = cooperative_groups;\n\n__global__ void {name}(\n"
    src += "".join(f"    const {CUDA_TYPES[a.dtype]}* {n},\n" for n, a in zip(kernel.input_names, kw["inputs"]))
    src += ",\n".join(f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(kernel.output_names, kw["output_dtypes"])) + ") {\n"
    for n, v in tmpl:
        if isinstance(v, bool):
            src += f"  constexpr bool {n} = {str(v).lower()};\n"
        elif isinstance(v, int):
            src += f"  constexpr int {n} = {v};\n"
        else:
            src += f"  using {n} = {CUDA_TYPES[v]};\n"
    src += "\n" if tmpl else ""
    return name, src + body + "\n}\n\n} // namespace mlx::core::cu\n"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_std_hash_is_libstdcxx(tmp_path):
    texts = ["", "abc", "custom_kernel_x_1_2", "x" * 1000 + "\n\u00e9"]
    prog = tmp_path / "h.cpp"
    prog.write_text(
        "#include <iostream>\n#include <string>\n#include <fstream>\n#include <sstream>\n"
        "int main(int c, char** v) { std::ifstream f(v[1], std::ios::binary); std::stringstream s; s << f.rdbuf();"
        " std::cout << std::hash<std::string>{}(s.str()); }\n"
    )
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "h"), str(prog)], check=True)
    for i, t in enumerate(texts):
        f = tmp_path / f"t{i}"
        f.write_bytes(t.encode())
        want = int(subprocess.run([str(tmp_path / "h"), str(f)], capture_output=True, text=True).stdout)
        assert cuda_cache.std_hash(t) == want
    assert cuda_cache.module_name("k", "abc") == f"k_{cuda_cache.std_hash('abc'):x}"


def test_parse_capture_takes_the_exact_source():
    src = '\n#include "x"\n\nnamespace a {\n  int y = 1;\n}\n'
    printed = f"noise\nGenerated source code for `custom_kernel_k_1`:\n```\n{src}\n```\n"
    assert cuda_cache.parse_capture(printed) == ("custom_kernel_k_1", src)
    with pytest.raises(ValueError):
        cuda_cache.parse_capture("nothing printed")


def test_long_module_names_become_folders(tmp_path):
    short = cuda_cache.ptx_path("m_1", tmp_path)
    assert short == tmp_path / "m_1.ptx"
    name = "a" * 245 + "b" * 245 + "c" * 10
    assert cuda_cache.ptx_path(name, tmp_path) == tmp_path / ("a" * 245) / ("b" * 245) / ("c" * 10 + ".ptx")


def test_entry_is_what_mlx_reads(tmp_path):
    cuda_cache.write_entry("custom_kernel_k_1_ab", "custom_kernel_k_1", b"\x7fELF..", "_ZN3mlxE", "src", tmp_path)
    assert (tmp_path / "custom_kernel_k_1_ab.ptx").read_bytes() == b"\x7fELF.."
    # MLX splits each .txt line at its tab: kernel name as launched, then the symbol
    assert (tmp_path / "custom_kernel_k_1_ab.txt").read_text() == "mlx::core::cu::custom_kernel_k_1\t_ZN3mlxE\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


class FakeKernelFunction:
    """Prints what MLX's kernel function prints with verbose=True (to file descriptor 1)."""

    def __init__(self):
        self.verbose_calls = 0

    def __call__(self, verbose=False, **kw):
        if verbose:
            import os

            self.verbose_calls += 1
            os.write(1, b"Generated source code for `custom_kernel_k_7`:\n```\nBODY\n```\n")
        return [mx.zeros((1,))]


def test_prepare_compiles_each_variant_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cuda_cache, "_seen", set())
    monkeypatch.setattr(cuda_cache, "_failed", [])
    built = []
    monkeypatch.setattr(cuda_cache, "compile_source", lambda s, k: built.append((s, k)) or (b"CUBIN", "_Zsym"))
    kernel = dispatch.Kernel("k", ["x"], ["y"], metal=("", ""), cuda=("", ""))
    fn = FakeKernelFunction()
    kw = {"inputs": [mx.ones((3,))], "template": [("N", 7)], "output_shapes": [(1,)], "output_dtypes": [mx.float32]}
    with cuda_cache.deferred():
        cuda_cache.prepare(kernel, fn, kw)
        cuda_cache.prepare(kernel, fn, kw)  # the same variant: nothing more
    assert fn.verbose_calls == 1 and built == [("BODY", "custom_kernel_k_7")]
    module = cuda_cache.module_name("custom_kernel_k_7", "BODY")
    assert (tmp_path / f"{module}.ptx").read_bytes() == b"CUBIN"
    # another process (a fresh variant table) finds the entry: captures, compiles nothing
    monkeypatch.setattr(cuda_cache, "_seen", set())
    cuda_cache.prepare(kernel, fn, kw)
    assert fn.verbose_calls == 2 and len(built) == 1


def test_a_failure_leaves_the_launch_to_mlx(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cuda_cache, "_seen", set())
    monkeypatch.setattr(cuda_cache, "_failed", [])

    def broken(s, k):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cuda_cache, "compile_source", broken)
    kernel = dispatch.Kernel("k", ["x"], ["y"], metal=("", ""), cuda=("", ""))
    kw = {"inputs": [mx.ones((3,))], "template": [("N", 8)], "output_shapes": [(1,)], "output_dtypes": [mx.float32]}
    cuda_cache.prepare(kernel, FakeKernelFunction(), kw)
    assert not cuda_cache.enabled() and "no compiler" in caplog.text
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs a CUDA toolkit (nvcc)")
@pytest.mark.slow  # eight or more nvcc cubin builds: ~28 s of CPU
def test_every_decode_variant_compiles_with_the_stand_in_header(monkeypatch):
    """MLX's generated source of each kernel variant the decode step launches (narrow V4
    shapes), compiled with nvcc and the stand-in for MLX's device header: the cache can
    build every one of them; each cubin holds the symbol MLX asks for."""
    from ds4mlx.bench import census
    from ds4mlx.bench.synthetic import build_synthetic_v4_flash

    sys.path.insert(0, str(ROOT / "tools"))
    from launch_census import NARROW

    variants = {}
    placeholders = census.cuda_placeholders

    from contextlib import contextmanager

    @contextmanager
    def recording():
        with placeholders() as seen:
            fake = dispatch.Kernel.__call__

            def launch(self, face, **kw):
                name, src = mlx_generated(self, kw)
                variants.setdefault(self.name, (name, src))  # one variant per kernel: CI time
                return fake(self, face, **kw)

            dispatch.Kernel.__call__ = launch
            yield seen

    monkeypatch.setattr(census, "cuda_placeholders", recording)
    model, _, _ = build_synthetic_v4_flash(layers=4, experts=16, overrides=NARROW)
    census.decode_census(model, 2048)
    assert len(variants) >= 8
    for name, src in variants.values():
        cubin, symbol = cuda_cache.compile_nvcc(src, name, "sm_90a")
        assert cubin[:4] == b"\x7fELF" and symbol.startswith(f"_ZN3mlx4core2cu{len(name)}{name}E")


PROOF = r"""
import os, sys
import mlx.core as mx
from ds4mlx.kernels import cuda_cache, dispatch
k = dispatch.Kernel("ds4mlx_cache_proof", ["x"], ["y"], metal=("", ""), cuda=("", "y[threadIdx.x] = x[threadIdx.x] + 1.0f;"))
x = mx.arange(32).astype(mx.float32)
kw = dict(inputs=[x], template=[("N", 32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(32,)], output_dtypes=[mx.float32])
if sys.argv[1] == "plant":
    # the same variant's MLX source, compiled with another body: y = 42
    name, src = cuda_cache.parse_capture(cuda_cache._capture_stdout(lambda: k._build("cuda")(**kw, verbose=True)))
    cubin, sym = cuda_cache.compile_source(src.replace("x[threadIdx.x] + 1.0f", "42.0f"), name)
    cuda_cache.write_entry(cuda_cache.module_name(name, src), name, cubin, sym, src)
print(int(k("cuda", **kw)[0][5].item()))
"""


@pytest.mark.gpu
def test_gpu_mlx_loads_the_cached_entry(tmp_path):
    """A cubin planted under a variant's module name (built from a different body) is what MLX
    runs: proof that MLX reads the entries this cache writes instead of compiling; then a
    fresh cache: the kernel's own result, and the entry our cache wrote for it."""
    if dispatch.gpu_backend() != "cuda":
        pytest.skip("needs MLX's CUDA backend")
    import os

    def run(arg, cache_dir):
        env = dict(os.environ, MLX_PTX_CACHE_DIR=str(cache_dir), PYTHONPATH=os.pathsep.join(sys.path))
        # a stuck child (this test hung for 280 s on the H200 on 2026-12-02) prints its stacks
        cmd = [
            sys.executable,
            "-X",
            "faulthandler",
            "-c",
            "import faulthandler; faulthandler.dump_traceback_later(100)\n" + PROOF,
            arg,
        ]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=150)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            pytest.fail(f"the child hung; its stacks:\n{err[-4000:]}")
        assert r.returncode == 0, r.stderr[-3000:]
        return int(r.stdout.strip().splitlines()[-1])

    assert run("plant", tmp_path / "a") == 42
    assert run("run", tmp_path / "b") == 6
    assert list((tmp_path / "b").glob("custom_kernel_ds4mlx_cache_proof_32_*.ptx"))
