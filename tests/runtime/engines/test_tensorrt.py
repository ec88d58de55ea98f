"""The TensorRT runtime adapter (runtime/engines/tensorrt.py) without TensorRT: missing-backend
errors, and every pure part (a key's profile index, dtype map, file naming, scratch sizing).
Nothing here builds or runs an engine; the build side's pure parts (profiles per key, the check
against the graph's named dims, timing cache files) are tests/exporter/backends/test_tensorrt_plan.py."""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import c2w.runtime.engines.tensorrt as rt
from c2w.runtime.engines.base import ArtifactInfo
from c2w.runtime.errors import C2WUserError, MissingBackendError

PIP = 'pip install --extra-index-url https://pypi.nvidia.com "tensorrt>=10.12"'


# ---- missing / wrong TensorRT ---------------------------------------------------------------------

def test_modules_import_without_tensorrt():
    # A fresh interpreter where `import tensorrt` fails: importing the adapter must not touch it.
    code = ("import sys; sys.modules['tensorrt'] = None; "
            "import c2w.runtime.engines.tensorrt, c2w.exporter.backends.tensorrt, c2w.exporter.backends.tensorrt_plan, "
            "c2w.exporter.trt_check; "
            "print(sys.modules['tensorrt'])")
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


def test_load_without_tensorrt_says_what_to_install(no_tensorrt, tmp_path):
    info = ArtifactInfo(tmp_path / "cfm.plan", ("mu",), ("mel",), ((1, 80, 50),), ("float16",),
                        {"profile_index": 0})
    backend = rt.TensorRTBackend()
    with pytest.raises(MissingBackendError, match=r"pypi\.nvidia\.com.*tensorrt>=10\.12.*10\.12\+ or 11\.x"):
        backend.load(info, None, torch.device("cuda"))
    with pytest.raises(MissingBackendError, match="no importable 'tensorrt'"):
        backend.require()
    with pytest.raises(MissingBackendError):
        backend.version()


def test_old_or_future_tensorrt_is_refused(monkeypatch):
    for version in ("8.6.1", "10.11.0", "12.0.0"):
        monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__=version))
        with pytest.raises(C2WUserError, match=rf"tensorrt {version}.*TensorRT 10\.12\+ or 11\.x"):
            rt.import_tensorrt()
    for version in ("10.12.0.36", "10.15.1", "11.0.0"):
        assert rt.check_trt_version(version) >= (10, 12)


# ---- a key's profile --------------------------------------------------------------------------------

def test_profile_index_comes_from_the_manifest_extra():
    info = ArtifactInfo(Path("cfm.plan"), ("mu",), ("mel",), ((1, 80, 50),), ("float16",), {"profile_index": 2})
    assert rt.profile_index_of(info, num_profiles=3) == 2
    with pytest.raises(C2WUserError, match=r"profile_index: received 2; expected 0\.\.1"):
        rt.profile_index_of(info, num_profiles=2)
    missing = ArtifactInfo(Path("cfm.plan"), ("mu",), ("mel",), ((1, 80, 50),), ("float16",), {})
    with pytest.raises(C2WUserError, match=r"extra\['profile_index'\]"):
        rt.profile_index_of(missing)
    for bad in (True, "0", -1):
        info_bad = ArtifactInfo(Path("p.plan"), ("mu",), ("mel",), ((1,),), ("float16",), {"profile_index": bad})
        with pytest.raises(C2WUserError):
            rt.profile_index_of(info_bad)


# ---- dtype map -----------------------------------------------------------------------------------

def test_trt_dtype_map():
    fake_half = types.SimpleNamespace(name="HALF")       # what a pybind11 enum member exposes
    assert rt.torch_dtype_for_trt(fake_half) == torch.float16
    assert rt.torch_dtype_for_trt("DataType.FLOAT") == torch.float32
    expected = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
                "INT32": torch.int32, "INT64": torch.int64, "BOOL": torch.bool,
                "INT8": torch.int8, "UINT8": torch.uint8, "FP8": torch.float8_e4m3fn}
    assert {k: rt.torch_dtype_for_trt(k) for k in expected} == expected
    with pytest.raises(C2WUserError, match="TensorRT tensor dtype: received INT4"):
        rt.torch_dtype_for_trt("INT4")


# ---- file naming ---------------------------------------------------------------------------------

def test_artifact_and_timing_cache_names_carry_trt_version_and_gpu():
    assert rt.artifact_name("cfm", "10.12.0", "NVIDIA H200") == "cfm.trt10.12.0.NVIDIA_H200.plan"
    assert (rt.artifact_name("flow_encoder-last", "11.0.0.21", "NVIDIA H100 80GB HBM3")
            == "flow_encoder-last.trt11.0.0.21.NVIDIA_H100_80GB_HBM3.plan")
    assert rt.artifact_name("hift", "10.12", "GPU/0 (A)") == "hift.trt10.12.GPU_0_A.plan"
    with pytest.raises(C2WUserError, match="component name"):
        rt.artifact_name("../cfm", "10.12", "H200")
    with pytest.raises(C2WUserError, match="artifact identity"):
        rt.artifact_name("cfm", "10.12", "  ")
    assert rt.timing_cache_name("10.12.0", "NVIDIA H200") == "timing.trt10.12.0.NVIDIA_H200.cache"


# ---- scratch sizing ------------------------------------------------------------------------------

def test_scratch_is_the_max_over_profiles_aligned_to_256():
    assert rt.scratch_bytes([1000, 70_000, 513]) == 70_144           # 274 * 256
    assert rt.scratch_bytes([70_144, 256]) == 70_144                 # already aligned
    assert rt.scratch_bytes([]) == 0
    assert rt.scratch_bytes([1]) == 256
    assert rt.align_up(0) == 0 and rt.align_up(257) == 512
    assert all(rt.scratch_bytes([n]) % 256 == 0 and rt.scratch_bytes([n]) >= n for n in range(0, 3000, 37))
    with pytest.raises(C2WUserError, match="non-negative"):
        rt.scratch_bytes([-1])


def test_backend_protocol_fields():
    b = rt.TensorRTBackend()
    assert (b.name, b.suffix, b.scratch_size) == ("tensorrt", ".plan", 0)
    b.release_shared()       # idempotent on a backend that loaded nothing


def test_graph_policy_is_the_loading_option_for_every_key_on_cuda(no_tensorrt):
    """What `c2w bench` asks to time and to mark served: TensorRT replays every key from a CUDA
    graph when asked to (its shapes are static), and never without CUDA. No SDK is needed to say so."""
    from c2w.runtime.engines import get_backend
    info = ArtifactInfo(Path("cfm.plan"), ("mu",), ("mel",), ((32, 80, 150),), ("float16",), {"profile_index": 3})
    cuda = torch.device("cuda", 0)
    assert not get_backend("tensorrt").graphed(info, cuda)                 # off by default
    assert get_backend("tensorrt", cuda_graphs=True).graphed(info, cuda)
    assert not get_backend("tensorrt", cuda_graphs=True).graphed(info, torch.device("cpu"))
    assert not get_backend("tensorrt", cuda_graphs=False).graphed(info, cuda)


def test_the_version_floor_is_declared_once():
    """runtime.engines.tensorrt says which TensorRT c2w supports; the install line, the check's
    operator data and the package's `trt` extra follow it."""
    from c2w.exporter import trt_check
    assert rt.INSTALL_LINE == PIP and rt.FLOOR == "10.12"
    assert rt.check_trt_version(rt.FLOOR) == rt.MIN_VERSION
    assert trt_check.check_trt_version is rt.check_trt_version      # one decision for both sides
    pyproject = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    assert f'"tensorrt>={rt.FLOOR}"' in pyproject
