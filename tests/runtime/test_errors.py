"""The one error format (runtime/errors.py): received / expected / fix, shape checks, state-dict
mismatches as one line, and which OSErrors become a user's error."""
import errno

import pytest
import torch

from c2w.runtime.errors import (
    C2WUserError, MissingBackendError, check_shape, state_dict_mismatch, write_error,
)


def test_a_user_error_says_what_came_what_was_expected_and_what_to_do():
    e = C2WUserError("budget_bytes", 0, "a positive byte count", "Raise it.")
    assert str(e) == "budget_bytes: received 0; expected a positive byte count. Raise it."
    assert (e.what, e.received, e.expected, e.fix) == ("budget_bytes", 0, "a positive byte count", "Raise it.")
    assert str(C2WUserError("x", 1, 2)) == "x: received 1; expected 2" and isinstance(e, ValueError)


def test_a_missing_backend_is_a_user_error_naming_the_package():
    e = MissingBackendError("tensorrt", "tensorrt", "pip install tensorrt")
    assert isinstance(e, C2WUserError)
    assert str(e) == "backend 'tensorrt': received no importable 'tensorrt'; expected 'tensorrt' installed. pip install tensorrt"


def test_check_shape_refuses_another_shape_or_dtype():
    x = torch.zeros(2, 80, 50)
    check_shape("mel", x, (2, 80, 50), torch.float32)
    with pytest.raises(C2WUserError, match=r"tensor 'mel': received shape \(2, 80, 51\); expected shape \(2, 80, 50\)\. "
                                           r"Check the batch size"):
        check_shape("mel", torch.zeros(2, 80, 51), (2, 80, 50))
    with pytest.raises(C2WUserError, match=r"tensor 'mel': received dtype torch.float16; expected dtype torch.float32$"):
        check_shape("mel", x.half(), (2, 80, 50), torch.float32)


def test_state_dict_mismatch_lists_each_kind_and_cuts_long_lists():
    expected = {"a": (2,), "b": (3,), "c": (4,)}
    assert state_dict_mismatch({"a": (2,), "b": (3,), "c": (4,)}, expected) is None
    line = state_dict_mismatch({"a": (5,), "b": (3,), "z": "list"}, expected, also=["not a state dict"])
    assert line == ("1 missing, 1 unexpected, 1 mismatched: not a state dict; missing keys ['c']; "
                    "unexpected keys ['z']; shape mismatches (received vs expected) [a: (5,) vs (2,)]")
    many = {f"k{i:02d}": (1,) for i in range(12)}
    assert state_dict_mismatch({}, many, shown=2) == "12 missing, 0 unexpected, 0 mismatched: missing keys ['k00', 'k01', ... 10 more]"
    assert "... " not in state_dict_mismatch({}, many, shown=None)


def test_write_error_rewords_only_what_a_user_fixes():
    full = write_error(OSError(errno.ENOSPC, "No space left on device", "/out/a.onnx"), "/out", "Free space.")
    assert str(full) == ("writing '/out/a.onnx': received ENOSPC (No space left on device); expected a writable "
                         "directory with free space. Free space.")
    assert "writing '/out'" in str(write_error(OSError(errno.EROFS, "Read-only file system"), "/out", "x"))
    assert write_error(OSError(errno.EIO, "Input/output error"), "/out", "x") is None     # a bug to surface
