"""The file tools' confinement under attack: a thread swapping symbolic links in
and out of the project while the tools run lets nothing through; links inside
the project still work; malformed paths (NUL bytes, over-long) are tool errors
the model reads; `more` walks the path again."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from ds4mlx.agent.paths import NAME_MAX, PATH_MAX, ProjectRoot
from ds4mlx.agent.tools import ToolBox

SECRET = "TOPSECRET"


@pytest.fixture
def project(tmp_path):
    proj, outside = tmp_path / "proj", tmp_path / "outside"
    proj.mkdir()
    outside.mkdir()
    (outside / "secret").write_text(SECRET + "\n")
    (outside / "outside-only.txt").write_text("o\n")  # a listing that escaped would name it
    (proj / "real").mkdir()
    (proj / "real" / "secret").write_text("inside\n")
    (proj / "f").write_text("plain file\n")
    return proj, outside


@pytest.fixture
def box(project):
    b = ToolBox(str(project[0]))
    yield b
    b.close()


def _swap(link_target: str, name: str, proj) -> None:
    """Make proj/name a link to `link_target` in one atomic rename."""
    tmp = proj / (name + ".swap")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    os.symlink(link_target, tmp)
    os.replace(tmp, proj / name)


def test_a_thread_swapping_links_in_and_out_lets_nothing_through(project, box):
    proj, outside = project
    _swap("real", "d", proj)
    stop = threading.Event()
    swaps = [0]

    def swapper():
        while not stop.is_set():
            _swap(str(outside), "d", proj)  # a directory link leading out ...
            _swap(str(outside / "secret"), "f", proj)  # ... a file link leading out
            _swap(str(outside / "planted"), "w", proj)  # ... a dangling link leading out
            _swap("real", "d", proj)  # ... and back to things inside
            (proj / "f.new").write_text("plain file\n")
            os.replace(proj / "f.new", proj / "f")
            (proj / "w.new").write_text("w\n")
            os.replace(proj / "w.new", proj / "w")
            swaps[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the two threads as finely as the GIL allows
    t = threading.Thread(target=swapper, daemon=True)
    t.start()
    results = []
    try:
        for i in range(1000):
            results.append(box.call("read", {"path": "d/secret"}))
            results.append(box.call("read", {"path": "f"}))
            results.append(box.call("write", {"path": "w", "content": f"mine {i}\n"}))
            results.append(box.call("write", {"path": "d/new.txt", "content": "x\n"}))
            k = i % 4
            if k == 0:
                results.append(box.call("list", {"path": "d"}))
            elif k == 1:
                results.append(box.call("search", {"query": "TOP.ECRET", "mode": "regex", "path": "d"}))
            elif k == 2:
                results.append(box.call("edit", {"path": "f", "old": "plain", "new": "PLAIN"}))
            else:
                results.append(box.call("more", {}))
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert swaps[0] > 10  # the links really moved while the tools ran
    leaked = [r for r in results if SECRET in r or "outside-only" in r]
    assert leaked == []
    assert sorted(p.name for p in outside.iterdir()) == ["outside-only.txt", "secret"]  # nothing written outside
    assert (outside / "secret").read_text() == SECRET + "\n"
    assert any(r.startswith("real/secret (lines 1-1 of 1)") for r in results)  # the inside link still works
    assert not [p.name for p in proj.iterdir() if p.name.startswith(".ds4mlx-agent-")]  # no temp left


def test_links_inside_the_project_are_followed(project, box):
    proj, _ = project
    os.symlink("real", proj / "alias")
    os.symlink(str(proj / "real" / "secret"), proj / "abs-link")
    assert box.call("read", {"path": "alias/secret"}).startswith("real/secret (lines 1-1 of 1)\n1: inside")
    assert box.call("read", {"path": "abs-link"}).startswith("real/secret")
    assert box.call("read", {"path": str(proj / "alias" / "secret")}).startswith("real/secret")
    assert box.call("write", {"path": "alias/new.txt", "content": "n\n"}).startswith("created real/new.txt")
    assert (proj / "real" / "new.txt").read_text() == "n\n"
    assert "alias -> real" in box.call("list", {"path": "."})
    assert box.call("read", {"path": "real/../f"}).startswith("f (lines 1-1 of 1)")


def test_a_link_loop_and_a_fifo_are_refused_not_hung(project, box):
    proj, _ = project
    os.symlink("loop2", proj / "loop1")
    os.symlink("loop1", proj / "loop2")
    assert "too many levels of symbolic links" in box.call("read", {"path": "loop1"})
    os.mkfifo(proj / "pipe")
    assert box.call("read", {"path": "pipe"}) == "Tool error: pipe is not a regular file"


def test_nul_bytes_and_over_long_paths_are_tool_errors(box):
    for call in (
        ("read", {"path": "f\0../../etc/passwd"}),
        ("write", {"path": "a\0b", "content": "x"}),
        ("edit", {"path": "\0", "old": "a", "new": "b"}),
        ("list", {"path": "real\0"}),
        ("search", {"query": "x", "path": "f\0"}),
    ):
        assert box.call(*call) == "Tool error: path contains a NUL byte: refused", call
    long_path = "/".join(["a" * 200] * (PATH_MAX // 200 + 1))
    assert "over the 4096 byte limit" in box.call("read", {"path": long_path})
    assert f"over the {NAME_MAX} byte limit" in box.call("write", {"path": "b" * 300, "content": "x"})
    assert box.call("bash", {"command": "echo a\0b"}).startswith("Tool error:")  # the OS refuses it: still text


def test_more_walks_the_path_again(project, box):
    proj, outside = project
    (proj / "long.txt").write_text("".join(f"line {i}\n" for i in range(1, 601)))
    assert "more lines available" in box.call("read", {"path": "long.txt"})
    (outside / "long.txt").write_text(SECRET + "\n" * 600)
    os.replace(proj / "long.txt", proj / "moved.txt")
    os.symlink(str(outside / "long.txt"), proj / "long.txt")
    out = box.call("more", {})
    assert out.startswith("Tool error:") and "outside the project" in out and SECRET not in out


def test_project_root_check_text_limits():
    assert ProjectRoot.check_text("a/b") == "a/b"
    with pytest.raises(ValueError, match="path is required"):
        ProjectRoot.check_text("")
