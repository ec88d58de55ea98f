"""A precision policy (runtime/precision.py): checked the same way for a profile and a manifest,
each component's dtype, and TF32 set process-wide."""
import logging

import pytest
import torch

from c2w.runtime.errors import C2WUserError
from c2w.runtime.precision import check_policy, component_dtypes, set_tf32


def test_the_runtime_checks_a_manifests_policy_too():
    """A manifest's precision goes through the same check when its model is loaded."""
    import torch

    from c2w.runtime.precision import component_dtypes, load_at_precision
    assert component_dtypes({"hift": "float16"})["hift"] == torch.float16
    with pytest.raises(C2WUserError, match=r"precision.tf32: received true; expected false with hift: float16"):
        load_at_precision("random:tiny", "cpu", {"hift": "float16", "tf32": True})
    with pytest.raises(C2WUserError, match=r"precision.hift: received 'bfloat16'"):
        component_dtypes({"hift": "bfloat16"})


def test_component_dtypes_default_to_float32():
    assert component_dtypes({"cfm": "bfloat16", "tf32": True}) == {
        "flow_encoder": torch.float32, "cfm": torch.bfloat16, "hift": torch.float32}


def test_check_policy_names_the_key_where_the_caller_says():
    with pytest.raises(C2WUserError, match=r"^p.yaml: 'precision.cfm': received 'int8'"):
        check_policy({"cfm": "int8"}, where=lambda key: f"p.yaml: 'precision.{key}'")
    with pytest.raises(C2WUserError, match=r"^m.json precision.tf32: received true; expected false with hift: float16"):
        check_policy({"hift": "float16", "tf32": True}, where=lambda key: f"m.json precision.{key}")
    check_policy({"flow_encoder": "float16", "cfm": "float16", "tf32": True})    # float16 CFM: TF32 may stay on


def test_set_tf32_sets_both_switches_and_logs_its_source(caplog):
    caplog.set_level(logging.INFO, logger="c2w.precision")
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        set_tf32(False, "a test")
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
        set_tf32(1, "a test")
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
        assert "TF32 off for CUDA matmuls and cuDNN convolutions in this process (a test)" in caplog.text
        assert "TF32 on for CUDA matmuls" in caplog.text
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
