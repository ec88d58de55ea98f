"""Atomic file writes: a reader sees the old file or the new one, never a part of one.

The data goes to a temporary file beside the target, is fsynced and renamed over it. The
temporary file is created with mode 0o666 filtered by the process umask, like `open()` would
create the target (mkstemp's 0o600 would lock out a serving account other than the builder),
and it is removed on any failure: a full disk or an interrupt leaves no `.tmp` file behind.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def atomic_write(path: str | Path, data) -> Path:
    """Replace `path` with `data` (bytes-like; str is written as UTF-8) atomically; returns `path`."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
