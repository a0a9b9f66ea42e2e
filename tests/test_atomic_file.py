"""ds4mlx.io.atomic_file: the destination is the old file or the new one, never half,
and a failed write leaves no temporary behind."""

import os
import stat

import pytest

from ds4mlx.io.atomic_file import atomic_write, write_bytes_atomic


def test_writes_bytes_and_text(tmp_path):
    target = tmp_path / "out.bin"
    write_bytes_atomic(target, b"\x00new\xff", fsync=True)
    assert target.read_bytes() == b"\x00new\xff"
    with atomic_write(target, "w", encoding="utf-8", newline="") as f:
        f.write("héllo\r\n")
    assert target.read_bytes() == "héllo\r\n".encode()
    assert os.listdir(tmp_path) == ["out.bin"]


@pytest.mark.parametrize("temp_path", [None, "out.txt.tmp.1"])
def test_exception_mid_write_keeps_old_file_and_leaves_no_temp(tmp_path, temp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    named = None if temp_path is None else tmp_path / temp_path
    with pytest.raises(RuntimeError), atomic_write(target, "w", temp_path=named) as f:
        f.write("half of the new")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.txt"]


def test_failing_before_replace_keeps_old_file(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")

    def refuse():
        raise PermissionError("changed on disk")

    with pytest.raises(PermissionError):
        write_bytes_atomic(target, b"new", before_replace=refuse)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.txt"]


def test_temp_file_is_next_to_target_with_requested_name_and_mode(tmp_path):
    target = tmp_path / "out.json"
    seen = []
    write_bytes_atomic(
        target,
        b"{}",
        temp_prefix=".probe-",
        permissions=0o644,
        before_replace=lambda: seen.extend(os.listdir(tmp_path)),
    )
    assert len(seen) == 1 and seen[0].startswith(".probe-")
    assert stat.S_IMODE(target.stat().st_mode) == 0o644

    seen.clear()
    write_bytes_atomic(
        target, b"[]", temp_path=f"{target}.tmp.7", before_replace=lambda: seen.extend(os.listdir(tmp_path))
    )
    assert sorted(seen) == ["out.json", "out.json.tmp.7"]
    assert target.read_bytes() == b"[]"
