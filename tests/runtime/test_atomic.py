"""Atomic writes: whole files, readable under the umask, nothing left behind on failure."""
import errno
import os

import pytest

from c2w.runtime import atomic
from c2w.runtime.atomic import atomic_write


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_replaces_the_whole_file_with_the_umask_mode(tmp_path, umask_022):
    target = tmp_path / "a.bin"
    atomic_write(target, b"first")
    atomic_write(target, memoryview(b"second"))
    atomic_write(tmp_path / "b.json", "{}")
    assert target.read_bytes() == b"second" and (tmp_path / "b.json").read_text() == "{}"
    assert {p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {0o644}
    os.umask(0o002)
    atomic_write(target, b"third")
    assert target.stat().st_mode & 0o777 == 0o664


def test_a_full_disk_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "a.bin"
    atomic_write(target, b"old")

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(atomic, "_write_all", full)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, b"new")
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"] and target.read_bytes() == b"old"


def test_exported_artifacts_are_readable_by_other_accounts(ort_artifacts):
    """The session's artifacts were written by the exporter (in this session, or by command 1 into
    artifacts/cpu and copied with their modes) under the shell's umask: every file gets 0o666
    filtered by it (mkstemp's 0o600 locked out a serving account other than the builder)."""
    mask = os.umask(0)
    os.umask(mask)
    files = [p for p in ort_artifacts.rglob("*") if p.is_file()]
    assert len(files) > 8
    assert {p.stat().st_mode & 0o777 for p in files} == {0o666 & ~mask}


def test_atomic_output_replaces_only_on_success(tmp_path):
    from c2w.runtime.atomic import atomic_output
    target = tmp_path / "p.pt2"
    target.write_bytes(b"old")
    with atomic_output(target) as tmp:
        assert tmp.suffix == ".pt2" and tmp.parent == tmp_path and ".tmp" in tmp.name
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new"
    with pytest.raises(RuntimeError, match="compiler failed"):
        with atomic_output(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("compiler failed")
    assert [p.name for p in tmp_path.iterdir()] == ["p.pt2"] and target.read_bytes() == b"new"
