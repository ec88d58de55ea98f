"""Atomic file writes: a reader sees the old file or the new one, never a part of one.

Every file c2w writes goes through here: `atomic_write` for data in memory, `atomic_output` for
a file another tool writes (a compiler's package, a copied file). The data goes to a temporary
file beside the target, which is renamed over it once complete. `atomic_write` creates the
temporary with mode 0o666 filtered by the process umask, like `open()` would create the target
(mkstemp's 0o600 would lock out a serving account other than the builder), and fsyncs it. The
temporary is removed on any failure: a full disk or an interrupt leaves no `.tmp` file behind.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator


def _temporary(path: Path) -> Path:
    """A fresh name beside `path` that keeps its suffix (some writers insist on one: `.pt2`)."""
    return path.with_name(f".{path.stem}.{secrets.token_hex(6)}.tmp{path.suffix}")


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def atomic_write(path: str | Path, data) -> Path:
    """Replace `path` with `data` (bytes-like; str is written as UTF-8) atomically; returns `path`."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = _temporary(path)
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


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path for a writer to fill; on a clean exit it replaces `path`, on any
    exception (the writer's, a full disk, an interrupt) it is removed and `path` is untouched."""
    path = Path(path)
    tmp = _temporary(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
