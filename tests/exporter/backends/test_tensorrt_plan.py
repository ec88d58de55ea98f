"""TensorRT plans from ONNX graphs (exporter/backends/tensorrt_plan.py) without TensorRT: one
exact-shape profile per key, the profiles checked against the graph's named dims, the timing
cache file, and the errors a build gives before it needs TensorRT. Nothing here builds a plan."""
from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

import c2w.runtime.engines.tensorrt as rt
from c2w.exporter.backends import tensorrt_plan as bt
from c2w.runtime.errors import C2WUserError, MissingBackendError


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


def test_timing_cache_file_is_keyed_by_trt_version_and_gpu(tmp_path):
    assert bt.timing_cache_file(tmp_path, "10.12.0", "NVIDIA H200") == tmp_path / "timing.trt10.12.0.NVIDIA_H200.cache"
    assert (bt.timing_cache_file(tmp_path / "shared.cache", "11.0", "NVIDIA H200")
            == tmp_path / "shared.trt11.0.NVIDIA_H200.cache")
    assert bt.timing_cache_file(None, "10.12", "H200") is None


@pytest.mark.parametrize("expr, env, want", [
    ("2*B", {"B": 3}, 6), ("L + T", {"L": 300, "T": 50}, 350), ("B // 2", {"B": 5}, 2), ("7", {}, 7),
    ("2*B", {}, None),                   # a name with no value yet
    ("B / 2", {"B": 4}, None),           # true division is not a dim expression
    ("B +", {"B": 1}, None),             # not an expression
    ("B % 0", {"B": 1}, None),
])
def test_a_named_dim_expression_evaluates_or_says_it_cannot(expr, env, want):
    """A graph's derived dims ('2*B') are checked against the profile's values when they evaluate;
    anything else is left to TensorRT (None), never guessed."""
    assert bt._eval_dim(expr, env) == want


def test_onnx_input_dims_read_fixed_named_and_unknown_dims(tmp_path):
    inputs = [helper.make_tensor_value_info("mu", TensorProto.FLOAT16, ["B", 80, None])]
    weight = helper.make_tensor("w", TensorProto.FLOAT16, [1], [0.0])
    graph = helper.make_graph([helper.make_node("Identity", ["mu"], ["mel"])], "g",
                              inputs + [helper.make_tensor_value_info("w", TensorProto.FLOAT16, [1])],
                              [helper.make_tensor_value_info("mel", TensorProto.FLOAT16, ["B", 80, None])],
                              initializer=[weight])
    assert bt.onnx_input_dims(helper.make_model(graph)) == {"mu": ["B", 80, None]}     # the initializer is no input
