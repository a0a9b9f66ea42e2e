"""The agent's tools on a real temp project: bounded reads with continuation,
atomic writes that refuse a concurrent modification, exact edits (anchored only
behind the flag), list, search, bash with background jobs, and the project
confinement (symlinks and non-existent targets resolved)."""

from __future__ import annotations

import os

import pytest

from ds4mlx.agent.tools import ToolBox


@pytest.fixture
def box(tmp_path):
    b = ToolBox(str(tmp_path))
    yield b
    b.close()


def test_read_is_bounded_and_more_continues(box, tmp_path):
    (tmp_path / "f.txt").write_text("".join(f"line {i}\n" for i in range(1, 1201)))
    first = box.call("read", {"path": "f.txt"})
    assert first.startswith("f.txt (lines 1-500 of 1200)")
    assert "500: line 500" in first and "501: line 501" not in first
    assert "continue_offset=501" in first
    second = box.call("more", {"count": 500})
    assert second.startswith("f.txt (lines 501-1000 of 1200)") and "1000: line 1000" in second
    third = box.call("more", {})
    assert "lines 1001-1200 of 1200" in third and "more lines available" not in third
    assert box.call("more", {}).startswith("Tool error: nothing to continue")
    ranged = box.call("read", {"path": "f.txt", "start_line": 10, "max_lines": 2, "raw": True})
    assert ranged.splitlines()[1:3] == ["line 10", "line 11"]


def test_write_is_atomic_and_detects_concurrent_modification(box, tmp_path):
    assert box.call("write", {"path": "sub/new.py", "content": "x = 1\n"}).startswith("created sub/new.py")
    assert (tmp_path / "sub/new.py").read_text() == "x = 1\n"
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "sub/new.py").stat().st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's 0600
    os.chmod(tmp_path / "sub/new.py", 0o751)
    box.call("read", {"path": "sub/new.py"})
    (tmp_path / "sub/new.py").write_text("x = 2  # someone else\n")
    out = box.call("write", {"path": "sub/new.py", "content": "x = 3\n"})
    assert out.startswith("Tool error:") and "changed on disk" in out
    assert (tmp_path / "sub/new.py").read_text() == "x = 2  # someone else\n"
    box.call("read", {"path": "sub/new.py"})
    assert box.call("write", {"path": "sub/new.py", "content": "x = 3\n"}).startswith("overwrote")
    assert (tmp_path / "sub/new.py").stat().st_mode & 0o777 == 0o751  # an overwrite keeps the mode
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["new.py"]  # no temp file left


def test_edit_exact_once_and_anchored_only_behind_the_flag(tmp_path):
    (tmp_path / "a.c").write_text("int a;\nint b;\nint a;\nvoid f() {\n  body();\n}\n")
    box = ToolBox(str(tmp_path))
    assert "occurs 2 times" in box.call("edit", {"path": "a.c", "old": "int a;", "new": "int c;"})
    assert "edited a.c at line 2" in box.call("edit", {"path": "a.c", "old": "int b;", "new": "long b;"})
    assert "long b;" in (tmp_path / "a.c").read_text()
    upto = {"path": "a.c", "old": "void f() {[upto]}", "new": "void f() {}"}
    assert "occurs 0 times" in box.call("edit", upto)  # literal text without the flag
    flagged = ToolBox(str(tmp_path), edit_upto=True)
    assert flagged.call("edit", upto).startswith("edited a.c at line 4")
    assert (tmp_path / "a.c").read_text().endswith("void f() {}\n")


def test_list_and_search(box, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src/m.py").write_text("def alpha():\n    return 1\n\ndef Beta():\n    pass\n")
    (tmp_path / "notes.md").write_text("alpha notes\n")
    listing = box.call("list", {"path": "."})
    assert "src/" in listing and "notes.md (12 B)" in listing
    hits = box.call("search", {"query": "alpha"}).splitlines()
    assert hits == ["notes.md:1: alpha notes", "src/m.py:1: def alpha():"]
    assert box.call("search", {"query": "beta", "case_sensitive": True}) == "no matches for 'beta'"
    rx = box.call("search", {"query": r"^def \w+", "mode": "regex", "glob": "*.py", "context": 1})
    assert "src/m.py:4: def Beta():" in rx and "src/m.py:5- " in rx


def test_paths_outside_the_project_are_refused(box, tmp_path):
    outside = tmp_path.parent / (tmp_path.name + "-outside")
    outside.mkdir()
    (outside / "secret").write_text("s3cret\n")
    os.symlink(outside, tmp_path / "link")  # a directory link leading out
    os.symlink(outside / "missing", tmp_path / "dangling")  # a dangling link leading out
    for call in (
        ("read", {"path": "link/secret"}),
        ("read", {"path": "../" + outside.name + "/secret"}),
        ("write", {"path": "link/new", "content": "x"}),
        ("write", {"path": "dangling", "content": "x"}),
        ("list", {"path": "/"}),
        ("edit", {"path": "link/secret", "old": "s3", "new": "x"}),
    ):
        out = box.call(*call)
        assert out.startswith("Tool error:") and "outside the project" in out, (call, out)
    assert not (outside / "new").exists() and not (outside / "missing").exists()
    assert (outside / "secret").read_text() == "s3cret\n"


def test_bash_foreground_background_status_and_stop(box, tmp_path):
    out = box.call("bash", {"command": "echo hello; pwd; exit 3"})
    assert out.splitlines() == ["$ echo hello; pwd; exit 3", "hello", str(tmp_path.resolve()), "[exit code 3]"]
    bg = box.call("bash", {"command": "echo started; sleep 60", "refresh_sec": 0.2})
    assert "started" in bg and "job 2 (pid" in bg and "still running" in bg
    assert box.bash.running() == [2]
    st = box.call("bash_status", {"job": 2})
    assert "still running" in st and "started" not in st.splitlines()[1:]  # only new output
    stop = box.call("bash_stop", {"job": 2})
    assert stop.endswith("[job 2 stopped]") and box.bash.running() == []
    assert "killed: timeout" in box.call("bash", {"command": "sleep 30", "timeout_sec": 0.3})
    assert box.call("bash_status", {"job": 9}).startswith("Tool error: no bash job")
