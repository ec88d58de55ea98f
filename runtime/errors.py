"""One error format for the whole project: what was received, what was expected, what to do.

`C2WUserError` is for bad input a user can fix (a profile, a tensor shape, a checkpoint); the CLI
turns it into one line and exit code 2. Anything else escaping is a bug in c2w.
"""
from __future__ import annotations

import errno
import os
from typing import Mapping, Sequence


class C2WUserError(ValueError):
    """Bad input from the user; the message names the thing, what came and what was expected."""

    def __init__(self, what: str, received: object, expected: object, fix: str | None = None):
        self.what, self.received, self.expected, self.fix = what, received, expected, fix
        msg = f"{what}: received {received}; expected {expected}"
        if fix:
            msg += f". {fix}"
        super().__init__(msg)


class MissingBackendError(C2WUserError):
    """An optional backend SDK (tensorrt, onnxruntime, ...) is not installed."""

    def __init__(self, backend: str, package: str, how: str):
        super().__init__(f"backend '{backend}'", f"no importable '{package}'", f"'{package}' installed", how)


def check_shape(name: str, tensor, expected: tuple, dtype=None) -> None:
    """Raise C2WUserError unless `tensor` has exactly `expected` shape (and dtype, if given)."""
    got = tuple(tensor.shape)
    if got != tuple(expected):
        raise C2WUserError(f"tensor '{name}'", f"shape {got}", f"shape {tuple(expected)}",
                           "Check the batch size, chunk length and cache lengths against the model config.")
    if dtype is not None and tensor.dtype != dtype:
        raise C2WUserError(f"tensor '{name}'", f"dtype {tensor.dtype}", f"dtype {dtype}")


def state_dict_mismatch(received: Mapping[str, object], expected: Mapping[str, tuple], *,
                        also: Sequence[str] = (), shown: int | None = 8) -> str | None:
    """What keeps a state dict from loading where another is wanted, as one line, or None when
    nothing does. `received`, `expected`: key -> shape (a received value that is no tensor: its
    type's name). `also`: further problems the caller found, listed first. Each list names its
    first `shown` keys in sorted order and how many more there are (a checkpoint of another
    preset differs in hundreds); `shown=None` lists every key."""
    missing = sorted(set(expected) - set(received))
    unexpected = sorted(set(received) - set(expected))
    mismatched = [f"{k}: {received[k]} vs {expected[k]}" for k in sorted(set(received) & set(expected))
                  if received[k] != tuple(expected[k])]
    if not (missing or unexpected or mismatched or also):
        return None

    def listed(items: list[str], sep: str) -> str:
        cut = len(items) if shown is None else shown
        more = f"{sep}... {len(items) - cut} more" if len(items) > cut else ""
        return f"[{sep.join(items[:cut])}{more}]"
    problems = list(also)
    if missing:
        problems.append(f"missing keys {listed([repr(k) for k in missing], ', ')}")
    if unexpected:
        problems.append(f"unexpected keys {listed([repr(k) for k in unexpected], ', ')}")
    if mismatched:
        problems.append(f"shape mismatches (received vs expected) {listed(mismatched, '; ')}")
    return f"{len(missing)} missing, {len(unexpected)} unexpected, {len(mismatched)} mismatched: " + "; ".join(problems)


# OSErrors a user fixes on their side (space, permissions, a file where a directory should be)
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                          errno.EISDIR, errno.EEXIST})


def write_error(exc: OSError, where, fix: str) -> C2WUserError | None:
    """The C2WUserError for an OSError of WRITE_ERRNOS while writing under `where`, else None
    (any other OSError is a bug to surface, not to reword)."""
    if exc.errno not in WRITE_ERRNOS:
        return None
    target = exc.filename or where
    return C2WUserError(f"writing '{target}'", f"{errno.errorcode.get(exc.errno, exc.errno)} "
                        f"({os.strerror(exc.errno)})", "a writable directory with free space", fix)
