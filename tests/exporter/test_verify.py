"""`c2w verify`'s own decisions (exporter/verify.py) without a directory: the device it verifies
on, and the budget check when the fresh measurement fails. Verifying real artifacts is
tests/exporter/test_export.py's, the budget measured again tests/exporter/test_budget.py's."""
import types

import pytest
import torch

import c2w.exporter.verify as verify
from c2w.runtime.errors import C2WUserError
from c2w.runtime.memory import MeasureError


def _manifest(device="cpu", **fields):
    return types.SimpleNamespace(device=device, **fields)


def test_the_device_is_the_manifests_unless_one_is_given():
    assert verify.verify_device(_manifest(), None) == torch.device("cpu")
    assert verify.verify_device(_manifest("NVIDIA H200"), "cpu") == torch.device("cpu")
    for bad in ("gpu", "mps", "cuda:x"):
        with pytest.raises(C2WUserError, match=rf"--device: received '{bad}'; expected cpu or cuda \(optionally cuda:N\)"):
            verify.verify_device(_manifest(), bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_manifest_on_a_machine_without_cuda_names_the_manifests_device():
    with pytest.raises(C2WUserError, match=r"verify device: received 'cuda' on a machine without CUDA \(the manifest's "
                                           r"device is 'NVIDIA H200'\)"):
        verify.verify_device(_manifest("NVIDIA H200"), None)


def test_a_failed_measurement_is_a_budget_problem_not_a_crash(monkeypatch):
    def fails(out_dir, manifest, device):
        raise MeasureError("the engine's load crashed (stand-in)")
    monkeypatch.setattr(verify, "measure_directory", fails)
    monkeypatch.setattr(verify, "recorded_ledger", lambda m: (None, ["a", "b"]))
    check = verify.verify_budget("d", _manifest(budget_bytes=1 << 30), "cpu")
    assert check.lines == ["recorded: 2 built keys have no measurement (exported by an older c2w); not checked"]
    assert check.problems == ["the directory could not be measured in a fresh process: the engine's load crashed "
                              "(stand-in)"]
