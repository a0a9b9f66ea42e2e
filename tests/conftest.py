"""Shared pytest fixtures.

`oracle(script, config=None)` returns the folder of a transformers oracle built by
`tests/oracle/<script> OUTDIR [--config NAME]` (config.json, model.safetensors,
reference.npz, summary.json).  Each folder is built once, in a subprocess, into
`$DS4MLX_TEST_CACHE/oracle/` (default `~/.cache/ds4mlx-tests/oracle/`) under a name keyed
by a hash of the oracle scripts and the config name, so editing a script rebuilds it.
Tests are skipped when torch/transformers are not installed and no cached build exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cache_dirs import cache_dir

# MLX's CUDA backend runs float32 matmuls in TF32 (~1e-3 relative) unless told not to;
# the GPU tests compare against float32/float64 oracles, so they run in full float32.
# (Set before any test imports MLX; CPU results do not depend on it.)
os.environ.setdefault("MLX_ENABLE_TF32", "0")

ORACLE_DIR = Path(__file__).parent / "oracle"


def _cache_root() -> Path:
    return cache_dir("oracle")


def _key(script: str, config: str | None) -> str:
    h = hashlib.sha256()
    for name in sorted(p.name for p in ORACLE_DIR.glob("*.py")):
        if name == script or not name.startswith(("make_", "probe_", "xcheck_")):
            h.update(name.encode())
            h.update((ORACLE_DIR / name).read_bytes())
    h.update(f"{script}:{config}".encode())
    return h.hexdigest()[:12]


def build_oracle(script: str, config: str | None = None) -> Path:
    stem = Path(script).stem.removeprefix("make_tiny_")
    out = _cache_root() / f"{stem}-{config or 'default'}-{_key(script, config)}"
    if (out / "summary.json").exists():
        return out
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        pytest.skip("torch/transformers not installed and no cached oracle build")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ORACLE_DIR / script), str(tmp)] + (["--config", config] if config else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ORACLE_DIR, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 or not (tmp / "summary.json").exists():
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"oracle build failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow_after(n): the first n cases of a parametrized test run in the fast tier, the rest are `slow`",
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """`slow_after(n)`: a kernel's full case matrix (each case a g++ or nvcc build) runs in the
    slow tier, its first n cases in the fast one, so the fast tier still builds every kernel."""
    seen: dict[str, int] = {}
    for item in items:
        mark = item.get_closest_marker("slow_after")
        if mark is None:
            continue
        key = item.nodeid.split("[")[0]
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > mark.args[0]:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def oracle():
    built: dict = {}

    def get(script: str, config: str | None = None) -> Path:
        if (script, config) not in built:
            built[(script, config)] = build_oracle(script, config)
        return built[(script, config)]

    return get


@pytest.fixture(scope="session")
def shared_demo():
    """`shared_demo(spec=None)` -> `ds4mlx.load(spec)`'s (model, tokenizer), loaded once per
    worker (reading the demo GGUF and its tokenizer is about a CPU second a load) for the
    modules that only run it: engines, servers, sessions, logits.  A test that changes the
    model (steering, an MTP head, streamed experts, new weights) loads its own; one that
    traces a compiled step under a patched kernel face calls `stepper.forget` after."""
    import ds4mlx

    loaded: dict = {}

    def get(spec: str | None = None):
        if spec not in loaded:
            loaded[spec] = ds4mlx.load(spec, verbose=False)
        return loaded[spec]

    return get


def load_summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


_GUARDED = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n))


def _signal_state():
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else None
    return {sig: signal.getsignal(sig) for sig in _GUARDED}, mask


@pytest.fixture(autouse=True)
def _signal_state_kept():
    """A test leaves this process's signal handlers and (main thread's) signal mask as it found
    them: every process a later test starts inherits the dispositions and the mask (a SIGINT
    left blocked made later Ctrl+C tests hang).  A change is undone and fails the test."""
    before = _signal_state()
    yield
    after = _signal_state()
    if after != before:
        for sig, handler in before[0].items():
            if handler is not None:
                signal.signal(sig, handler)
        if before[1] is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, before[1])
        pytest.fail(f"the test changed the process's signal state (undone): {before} -> {after}")


@pytest.fixture
def cpu_unless_gpu_test(request):
    """MLX work on the CPU for the test (exactness claims are about MLX's CPU kernels, and an
    oracle must not inherit a GPU's TF32 matmuls); `gpu`-marked tests keep the default device.
    Kernel test modules take it with `pytestmark = pytest.mark.usefixtures(...)`."""
    import mlx.core as mx

    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(old)


@pytest.fixture
def fake_gpu(monkeypatch):
    """dispatch.backend() -> 'metal' (an unverified face); self-test cache cleared: the
    first-use self-test and its fallback, exercised on the CPU (kernel test modules)."""
    from ds4mlx.kernels import dispatch

    monkeypatch.delenv("DS4MLX_KERNELS", raising=False)
    monkeypatch.delenv("DS4MLX_KERNEL_SELFTEST", raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device=None: "metal")
    monkeypatch.setattr(dispatch, "_self_tests", {})
    return monkeypatch
