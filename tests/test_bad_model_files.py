"""Broken model files and folders: every command that opens a model prints one
line naming the file and what is wrong, and exits 2 (no traceback); a size the
file cannot hold is refused before anything is allocated."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from bad_model_files import make_bad_models  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, Path]:
    from ds4mlx.io.demo import demo_model_path

    return make_bad_models(Path(demo_model_path("deepseek_v4")), tmp_path_factory.mktemp("bad"))


def command(name: str, path: Path, tmp: Path) -> list[str]:
    p = str(path)
    return {
        "serve": ["serve", "--model", p, "--port", "1"],  # never reached
        "generate": ["generate", "--model", p, "--prompt", "hi", "-n", "1"],
        "chat": ["chat", "--model", p],
        "eval": ["eval", "--model", p, "--plain", "--tokens", "4"],
        "bench": ["bench", "--model", p, "--ctx-start", "64", "--ctx-max", "64", "--gen-tokens", "1"],
        "convert": ["convert", p, str(tmp / "out.gguf")],
        "quantize": ["quantize", p, str(tmp / "out.gguf"), "--experts", "q4_k"],
        "inspect": ["inspect", p],
    }[name]


def ds4mlx(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "ds4mlx.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def assert_one_line(proc: subprocess.CompletedProcess, path: Path) -> None:
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # eval's "loading PATH ..." progress notice comes before the load: it is not an error line
    lines = [
        ln
        for ln in err
        if " error: " in ln or (ln.startswith("ds4-eval: ") and not ln.startswith("ds4-eval: loading "))
    ]
    assert len(lines) == 1 and str(path) in lines[0], err


def test_every_bad_file_is_one_line_through_inspect(bad, tmp_path):
    for case, path in bad.items():
        proc = ds4mlx(command("inspect", path, tmp_path), tmp_path)
        assert_one_line(proc, path)
        assert len(proc.stderr.splitlines()) == 1, (case, proc.stderr)


# inspect meets every case above; each command a few of each kind (a process costs seconds here)
CASES = ["nonexistent", "cut_in_half", "2e60_metadata", "text_named_gguf", "empty_dir", "broken_config_json"]


@pytest.mark.slow_after(2)  # serve and generate here; the other four (~11 CPU s of processes) in the slow tier
@pytest.mark.parametrize("name", ["serve", "generate", "chat", "eval", "bench", "quantize"])
def test_every_command_gives_one_line_and_exit_2(bad, tmp_path, name):
    for case in CASES:
        proc = ds4mlx(command(name, bad[case], tmp_path), tmp_path)
        assert_one_line(proc, bad[case])


def test_a_device_fifo_or_symlink_loop_is_named_as_what_it_is(tmp_path):
    fifo, loop = tmp_path / "fifo", tmp_path / "loop"
    os.mkfifo(fifo)
    loop.symlink_to(loop)
    for path, what in ((Path("/dev/zero"), "a character device"), (fifo, "a FIFO"), (loop, "symbolic links")):
        for name in ("inspect", "generate"):
            proc = ds4mlx(command(name, path, tmp_path), tmp_path)
            assert_one_line(proc, path)
            assert what in proc.stderr and "no such" not in proc.stderr, proc.stderr


def test_convert_gives_one_line_and_exit_2(bad, tmp_path):
    for case in ("nonexistent", "empty_dir", "broken_config_json", "config_wrong_types", "safetensors_huge_header"):
        proc = ds4mlx(command("convert", bad[case], tmp_path), tmp_path)
        assert_one_line(proc, bad[case])


def test_claimed_sizes_are_refused_before_allocating(bad):
    """The counts are checked against the file size before the reader loops."""
    import tracemalloc

    from ds4mlx.io.weights import GGUFFile

    for case, why in (
        ("2e60_tensors", "claims 1152921504606846976 tensors"),
        ("2e60_metadata", "1152921504606846976 metadata entries"),
        ("huge_string", "truncated"),
        ("huge_array", "truncated"),
    ):
        tracemalloc.start()
        with pytest.raises(ValueError, match=why):
            GGUFFile(bad[case])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1 << 20, (case, peak)
