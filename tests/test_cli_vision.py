"""`--vision` / `--image` on `ds4mlx generate` and `/read IMAGE` in `ds4mlx chat`, on
the Qwen3.8 demo model with the demo encoder (docs/vision.md §2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from vision_helpers import image_bytes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_LINE = re.compile(r"prompt (\d+) tokens \((\d+) cached\)")
STATUS = re.compile(r"prompt (\d+) \((\d+) cached\)")


def _env(tmp_path) -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, DS4MLX_HISTORY=str(tmp_path / "history"), TERM="dumb", NO_COLOR="1")


def generate(tmp_path, *flags) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ds4mlx.cli", "generate", "-m", "demo:qwen4_exp", "-n", "2", "--temp", "0", *flags]
    return subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)


def _n_tokens(w: int, h: int) -> int:
    from ds4mlx.models import vision_preprocess as vp

    th, tw = vp.target_size(h, w, 16, 2, vp.MIN_TOKENS, vp.MAX_TOKENS)
    return th * tw // 32 // 32


def test_generate_with_two_images(tmp_path):
    (tmp_path / "a.png").write_bytes(image_bytes(64, 48, seed=1))
    (tmp_path / "b.jpg").write_bytes(image_bytes(300, 90, "JPEG", seed=2))
    r = generate(tmp_path, "--vision", "demo", "--image", "a.png", "--image", "b.jpg", "-p", "compare them")
    assert r.returncode == 0, r.stderr
    prompt, cached = (int(g) for g in PROMPT_LINE.search(r.stderr).groups())
    text_only = generate(tmp_path, "-p", "compare them")
    text_prompt = int(PROMPT_LINE.search(text_only.stderr).group(1))
    # each image adds its block: vision_start, one pad per merged token, vision_end
    assert prompt - text_prompt == _n_tokens(64, 48) + _n_tokens(300, 90) + 4 and cached == 0


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--image", "a.png", "-p", "x"], "--image needs --vision"),
        (["--vision", "demo", "--image", "missing.png", "-p", "x"], "cannot read image missing.png"),
        (["--vision", "demo", "--image", "not.png", "-p", "x"], "not a complete PNG or JPEG image"),
        (["--vision", "/nowhere", "-p", "x"], "--vision /nowhere: /nowhere: not a vision encoder"),
    ],
)
def test_generate_refusals(tmp_path, flags, message):
    (tmp_path / "a.png").write_bytes(image_bytes())
    (tmp_path / "not.png").write_bytes(b"not an image")
    r = generate(tmp_path, *flags)
    assert r.returncode == 2, r.stderr
    assert message in " ".join(r.stderr.split())


def test_vision_needs_a_family_with_image_input(tmp_path):
    cmd = [sys.executable, "-m", "ds4mlx.cli", "generate", "-m", "demo", "--vision", "demo", "-p", "x", "-n", "1"]
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "qwen4_exp" in r.stderr


def test_chat_read_attaches_an_image(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    (tmp_path / "shot.png").write_bytes(image_bytes(64, 48, seed=3))
    child = pexpect.spawn(
        sys.executable,
        ["-m", "ds4mlx.cli", "chat", "-m", "demo:qwen4_exp", "--vision", "demo", "--nothink", "-n", "2", "--temp", "0"],
        env=dict(_env(tmp_path), COLUMNS="160", PYTHONUNBUFFERED="1"),
        cwd=str(tmp_path),
        encoding="utf-8",
        timeout=180,
        dimensions=(50, 160),
    )
    child.logfile_read = open(tmp_path / "session.log", "w")
    try:
        child.expect("Ctrl\\+D quits")
        child.expect_exact("> ")
        child.sendline("/read shot.png")
        child.expect(r"image: shot\.png 64x48 \((\d+) tokens\), sent with the next message")
        assert int(child.match.group(1)) == _n_tokens(64, 48)
        child.expect_exact("> ")
        child.sendline("what is this?")
        child.expect(STATUS)
        with_image = int(child.match.group(1))
        child.expect_exact("> ")
        child.sendline("/reset")
        child.expect("conversation: cleared")
        child.expect_exact("> ")
        child.sendline("what is this?")
        child.expect(STATUS)
        assert with_image - int(child.match.group(1)) == _n_tokens(64, 48) + 2
        child.expect_exact("> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


def test_serve_refuses_vision_with_batched_sessions(tmp_path):
    """The image reuse state is the engine's, not a slot's: one clear line, not a wrong reuse."""
    cmd = [sys.executable, "-m", "ds4mlx.cli", "serve", "-m", "demo:qwen4_exp", "--vision", "demo",
           "--batched-session", "2", "--port", "18999"]  # fmt: skip
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "--vision with --batched-session > 1 is not supported yet" in r.stderr
