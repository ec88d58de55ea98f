"""The TensorRT adapter without TensorRT: missing-backend errors, and every pure part (profile
mapping, dtype map, file naming, scratch sizing). Nothing here builds or runs an engine."""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

import c2w.runtime.engines.tensorrt as rt
from c2w.exporter.backends import tensorrt_plan as bt
from c2w.runtime.engines.base import ArtifactInfo
from c2w.runtime.errors import C2WUserError, MissingBackendError

PIP = 'pip install --extra-index-url https://pypi.nvidia.com "tensorrt>=10.12"'


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)     # `import tensorrt` -> ImportError


def _cfm_like_onnx(path: Path) -> Path:
    """Inputs with named dims as the exporter declares them: B, T, L and a derived 2*B."""
    inputs = [helper.make_tensor_value_info("mu", TensorProto.FLOAT16, ["B", 80, "T"]),
              helper.make_tensor_value_info("spk", TensorProto.FLOAT16, ["B", 80]),
              helper.make_tensor_value_info("att_cache", TensorProto.FLOAT16, [10, 16, "2*B", 8, "L", 128])]
    outputs = [helper.make_tensor_value_info("mel", TensorProto.FLOAT16, ["B", 80, "T"])]
    graph = helper.make_graph([helper.make_node("Identity", ["mu"], ["mel"])], "cfm", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    onnx.save(model, str(path))
    return path


def _cfm_inputs(B, T, L):
    return {"mu": (B, 80, T), "spk": (B, 80), "att_cache": (10, 16, 2 * B, 8, L, 128)}


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


def test_build_without_tensorrt_says_what_to_install(no_tensorrt, tmp_path):
    onnx_path = _cfm_like_onnx(tmp_path / "cfm.onnx")
    with pytest.raises(MissingBackendError, match=r'extra-index-url https://pypi\.nvidia\.com "tensorrt>=10\.12"'):
        bt.build_engine_from_onnx(onnx_path, [_cfm_inputs(1, 50, 300)], tmp_path / "cfm.plan",
                                  timing_cache_path=tmp_path, workspace_bytes=1 << 30, tf32=False)
    assert not (tmp_path / "cfm.plan").exists()


def test_build_argument_errors_come_before_the_import(no_tensorrt, tmp_path):
    with pytest.raises(C2WUserError, match="an existing .onnx file"):
        bt.build_engine_from_onnx(tmp_path / "missing.onnx", [{"x": (1,)}], tmp_path / "a.plan",
                                  timing_cache_path=None, workspace_bytes=1, tf32=True)
    onnx_path = _cfm_like_onnx(tmp_path / "cfm.onnx")
    with pytest.raises(C2WUserError, match="at least one exact-shape profile"):
        bt.build_engine_from_onnx(onnx_path, [], tmp_path / "a.plan",
                                  timing_cache_path=None, workspace_bytes=1, tf32=True)


def test_old_or_future_tensorrt_is_refused(monkeypatch):
    for version in ("8.6.1", "10.11.0", "12.0.0"):
        monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__=version))
        with pytest.raises(C2WUserError, match=rf"tensorrt {version}.*TensorRT 10\.12\+ or 11\.x"):
            rt.import_tensorrt()
    for version in ("10.12.0.36", "10.15.1", "11.0.0"):
        assert rt.check_trt_version(version) >= (10, 12)


# ---- profile per key ------------------------------------------------------------------------------

def test_profiles_for_keys_one_exact_profile_per_key_in_order():
    keys = {("cfm", 1, 50, 300): _cfm_inputs(1, 50, 300),
            ("cfm", 1, 50, 350): _cfm_inputs(1, 50, 350),
            ("cfm", 4, 50, 400): _cfm_inputs(4, 50, 400)}
    profiles = bt.profiles_for_keys(keys)
    assert len(profiles) == 3
    assert profiles[1] == {"mu": (1, 80, 50), "spk": (1, 80), "att_cache": (10, 16, 2, 8, 350, 128)}
    assert profiles[2]["att_cache"][2] == 8
    # The runtime finds a key's profile back from its exact input shapes.
    assert rt.find_profile_index(profiles, _cfm_inputs(4, 50, 400)) == 2
    with pytest.raises(C2WUserError, match="has no engine"):
        rt.find_profile_index(profiles, _cfm_inputs(2, 50, 300))


def test_profiles_for_keys_rejects_mixed_graph_variants_and_duplicates():
    with pytest.raises(C2WUserError, match=r"key b: inputs \['mel', 'noise', 'source_cache'\] differ"):
        bt.profiles_for_keys({"a": {"mel": (1, 80, 50), "noise": (1, 9, 24000)},
                              "b": {"mel": (1, 80, 58), "noise": (1, 9, 27840), "source_cache": (1, 1, 3840)}})
    with pytest.raises(C2WUserError, match="key 1: same shapes as key 0"):
        bt.profiles_for_keys([_cfm_inputs(1, 50, 300), _cfm_inputs(1, 50, 300)])
    with pytest.raises(C2WUserError, match="ranks of"):
        bt.profiles_for_keys([{"x": (1, 2)}, {"x": (1, 2, 3)}])
    with pytest.raises(C2WUserError, match="at least one key"):
        bt.profiles_for_keys({})


def test_profiles_are_checked_against_the_onnx_named_dims(tmp_path):
    model = onnx.load(str(_cfm_like_onnx(tmp_path / "cfm.onnx")))
    good = bt.profiles_for_keys([_cfm_inputs(1, 50, 300), _cfm_inputs(2, 150, 400)])
    assert bt.check_profiles_against_onnx(model, good) == []
    bad = [{"mu": (1, 80, 50), "spk": (2, 80), "att_cache": (10, 16, 2, 8, 300, 128)},   # B = 1 and 2
           {"mu": (1, 80, 50), "spk": (1, 80), "att_cache": (10, 16, 1, 8, 300, 128)},   # 2*B != 1
           {"mu": (1, 81, 50), "spk": (1, 80), "att_cache": (10, 16, 2, 8, 300, 128)},   # fixed 80
           {"mu": (1, 80, 50), "spk": (1, 80)}]                                          # missing input
    problems = bt.check_profiles_against_onnx(model, bad)
    assert any(p.startswith("profile 0: dim 'B' is 1 and 2") for p in problems)
    assert any(p.startswith("profile 1: 'att_cache' axis 2 = 1; '2*B' gives 2") for p in problems)
    assert any(p.startswith("profile 2: 'mu' axis 1 = 81; the graph fixes 80") for p in problems)
    assert any(p.startswith("profile 3: inputs ['mu', 'spk']") for p in problems)
    assert len(problems) == 4


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

def test_artifact_and_timing_cache_names_carry_trt_version_and_gpu(tmp_path):
    assert rt.artifact_name("cfm", "10.12.0", "NVIDIA H200") == "cfm.trt10.12.0.NVIDIA_H200.plan"
    assert (rt.artifact_name("flow_encoder-last", "11.0.0.21", "NVIDIA H100 80GB HBM3")
            == "flow_encoder-last.trt11.0.0.21.NVIDIA_H100_80GB_HBM3.plan")
    assert rt.artifact_name("hift", "10.12", "GPU/0 (A)") == "hift.trt10.12.GPU_0_A.plan"
    with pytest.raises(C2WUserError, match="component name"):
        rt.artifact_name("../cfm", "10.12", "H200")
    with pytest.raises(C2WUserError, match="artifact identity"):
        rt.artifact_name("cfm", "10.12", "  ")
    assert rt.timing_cache_name("10.12.0", "NVIDIA H200") == "timing.trt10.12.0.NVIDIA_H200.cache"
    assert bt.timing_cache_file(tmp_path, "10.12.0", "NVIDIA H200") == tmp_path / "timing.trt10.12.0.NVIDIA_H200.cache"
    assert (bt.timing_cache_file(tmp_path / "shared.cache", "11.0", "NVIDIA H200")
            == tmp_path / "shared.trt11.0.NVIDIA_H200.cache")
    assert bt.timing_cache_file(None, "10.12", "H200") is None


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
