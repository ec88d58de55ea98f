"""The TensorRT compatibility check on crafted ONNX graphs (CPU only; TensorRT is never imported)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from c2w.exporter.trt_check import (
    OP_SUPPORT, Finding, check_onnx_for_tensorrt, errors, format_findings, initializer_bytes,
    max_opset_for,
)
from c2w.runtime.errors import C2WUserError


def _model(nodes, inputs, outputs, initializers=(), opset=20, functions=(), value_info=()):
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs),
                              initializer=list(initializers), value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             functions=list(functions), ir_version=10)


def _f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _codes(findings, severity="error"):
    return {f.code for f in findings if f.severity == severity}


def _by_code(findings, code):
    return [f for f in findings if f.code == code]


def test_dft_node_is_an_unsupported_op():
    m = _model([helper.make_node("DFT", ["x"], ["y"], name="dft0", onesided=1)],
               [_f32("x", (1, 16, 1))], [_f32("y", (1, 9, 2))])
    found = _by_code(check_onnx_for_tensorrt(m), "unsupported-op")
    assert len(found) == 1
    assert (found[0].severity, found[0].node, found[0].op_type) == ("error", "dft0", "DFT")
    assert "real strided conv1d" in found[0].message


def test_complex_input_is_an_error():
    x = helper.make_tensor_value_info("x", TensorProto.COMPLEX64, [4])
    y = helper.make_tensor_value_info("y", TensorProto.COMPLEX64, [4])
    m = _model([helper.make_node("Identity", ["x"], ["y"])], [x], [y])
    found = _by_code(check_onnx_for_tensorrt(m), "complex-dtype")
    assert {f.node for f in found} == {"x", "y"}
    assert all(f.severity == "error" and "COMPLEX64" in f.message for f in found)


def test_float64_and_string_are_unsupported_dtypes():
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    m = _model([helper.make_node("Cast", ["x"], ["y"], name="c", to=TensorProto.FLOAT)], [x], [y])
    found = _by_code(check_onnx_for_tensorrt(m), "unsupported-dtype")
    assert [f.node for f in found] == ["x"] and "DOUBLE" in found[0].message
    m2 = _model([helper.make_node("Cast", ["y"], ["z"], name="c2", to=TensorProto.STRING)],
                [y], [helper.make_tensor_value_info("z", TensorProto.STRING, [4])])
    found2 = _by_code(check_onnx_for_tensorrt(m2), "unsupported-dtype")
    assert {f.node for f in found2} == {"z", "c2"}       # the output and the Cast target


def test_two_identical_1mb_initializers_are_duplicates():
    w = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)   # 1 MiB
    a, b = numpy_helper.from_array(w, "w_a"), numpy_helper.from_array(w.copy(), "w_b")
    m = _model([helper.make_node("Add", ["x", "w_a"], ["t"]), helper.make_node("Add", ["t", "w_b"], ["y"])],
               [_f32("x", (1 << 18,))], [_f32("y", (1 << 18,))], initializers=[a, b])
    findings = check_onnx_for_tensorrt(m)
    dup = _by_code(findings, "duplicate-initializers")
    assert len(dup) == 1 and dup[0].severity == "error"
    assert "1048576 duplicated bytes" in dup[0].message and "w_a=w_b" in dup[0].message
    summary = _by_code(findings, "initializer-bytes")[0]
    assert summary.severity == "info" and "2097152 bytes total, 1048576 bytes after" in summary.message
    assert initializer_bytes(m) == (2 << 20, 1 << 20)


def test_small_duplicate_constants_are_not_flagged():
    one = numpy_helper.from_array(np.ones(4, np.float32), "one_a")
    one_b = numpy_helper.from_array(np.ones(4, np.float32), "one_b")
    m = _model([helper.make_node("Add", ["x", "one_a"], ["t"]), helper.make_node("Add", ["t", "one_b"], ["y"])],
               [_f32("x", (4,))], [_f32("y", (4,))], initializers=[one, one_b])
    assert "duplicate-initializers" not in _codes(check_onnx_for_tensorrt(m))


@pytest.mark.parametrize("op", ["RandomNormal", "RandomUniform"])
def test_random_op_is_an_error(op):
    m = _model([helper.make_node(op, [], ["r"], name="rng", shape=[4], seed=1.0),
                helper.make_node("Add", ["x", "r"], ["y"])], [_f32("x", (4,))], [_f32("y", (4,))])
    found = _by_code(check_onnx_for_tensorrt(m), "random-op")
    assert len(found) == 1 and found[0].severity == "error" and found[0].op_type == op
    assert "ignores the seed" in found[0].message


def test_nonzero_is_a_warning():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [1, "n"])
    m = _model([helper.make_node("NonZero", ["x"], ["y"], name="nz")], [x], [y])
    findings = check_onnx_for_tensorrt(m, allow_dynamic=frozenset())
    assert [f.severity for f in _by_code(findings, "data-dependent-shape")] == ["warning"]
    assert _by_code(findings, "dynamic-dim")[0].node == "y"     # and its output dim is unknowable


def _attention_model(**attrs):
    q = _f32("q", (1, 8, 50, 64))
    kv = [_f32("k", (1, 8, 350, 64)), _f32("v", (1, 8, 350, 64))]
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], name="attn", **attrs)
    return _model([node], [q, *kv], [_f32("y", (1, 8, 50, 64))], opset=23)


def test_attention_needs_trt_10_14():
    m = _attention_model()
    old = _by_code(check_onnx_for_tensorrt(m, trt_version="10.12"), "op-needs-newer-trt")
    assert len(old) == 1 and old[0].op_type == "Attention" and "10.14" in old[0].message
    assert errors(check_onnx_for_tensorrt(m, trt_version="10.14")) == []
    assert errors(check_onnx_for_tensorrt(m, trt_version="11.0")) == []


def test_attention_restrictions_are_checked():
    m = _attention_model(softcap=30.0)
    found = _by_code(check_onnx_for_tensorrt(m, trt_version="10.14"), "op-restriction")
    assert len(found) == 1 and "softcap" in found[0].message


def test_dynamic_dim_must_be_allowed():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 80, "T"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 80, "2*T + 4"])
    m = _model([helper.make_node("Identity", ["x"], ["y"])], [x], [y])
    found = _by_code(check_onnx_for_tensorrt(m, allow_dynamic=frozenset({"B"})), "dynamic-dim")
    assert {(f.node, f.severity) for f in found} == {("x", "error"), ("y", "error")}
    assert all("'T'" in f.message or "2*T + 4" in f.message for f in found)
    assert "dynamic-dim" not in _codes(check_onnx_for_tensorrt(m, allow_dynamic=frozenset({"B", "T"})))


def test_unused_allow_dynamic_name_is_a_warning():
    m = _model([helper.make_node("Identity", ["x"], ["y"])], [_f32("x", (2,))], [_f32("y", (2,))])
    found = _by_code(check_onnx_for_tensorrt(m, allow_dynamic=frozenset({"L"})), "unused-dynamic-dim")
    assert [f.severity for f in found] == ["warning"]


def test_opset_range():
    m = _model([helper.make_node("Identity", ["x"], ["y"])], [_f32("x", (2,))], [_f32("y", (2,))], opset=8)
    assert "opset" in _codes(check_onnx_for_tensorrt(m))
    m24 = _model([helper.make_node("Identity", ["x"], ["y"])], [_f32("x", (2,))], [_f32("y", (2,))], opset=24)
    assert "opset" in _codes(check_onnx_for_tensorrt(m24, trt_version="10.12"))
    assert "opset" not in _codes(check_onnx_for_tensorrt(m24, trt_version="10.15"))
    assert max_opset_for((11, 0))[0] == 24 and max_opset_for((11, 5))[0] == 25


def test_subgraphs_and_local_functions_are_walked():
    then_g = helper.make_graph([helper.make_node("DFT", ["x"], ["t"], name="inner_dft")], "then", [],
                               [_f32("t", (1, 9, 2))])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["t2"])], "else", [],
                               [_f32("t2", (1, 9, 2))])
    cond = numpy_helper.from_array(np.array(True), "cond")
    fn = helper.make_function("c2w.test", "Noisy", ["a"], ["b"],
                              [helper.make_node("RandomNormalLike", ["a"], ["r"], name="fn_rng"),
                               helper.make_node("Add", ["a", "r"], ["b"])],
                              [helper.make_opsetid("", 20)])
    nodes = [helper.make_node("If", ["cond"], ["z"], name="branch", then_branch=then_g, else_branch=else_g),
             helper.make_node("Noisy", ["z"], ["y"], domain="c2w.test", name="call")]
    m = helper.make_model(helper.make_graph(nodes, "g", [_f32("x", (1, 16, 1))], [_f32("y", (1, 9, 2))],
                                           initializer=[cond]),
                          opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("c2w.test", 1)],
                          functions=[fn], ir_version=10)
    findings = check_onnx_for_tensorrt(m)
    dft = _by_code(findings, "unsupported-op")[0]
    assert dft.where == "main/branch.then_branch" and dft.node == "inner_dft"
    rng = _by_code(findings, "random-op")[0]
    assert rng.where == "function:c2w.test.Noisy" and rng.node == "fn_rng"
    assert "custom-domain-op" not in _codes(findings)


def test_custom_domain_without_function_is_an_error():
    m = helper.make_model(
        helper.make_graph([helper.make_node("FusedThing", ["x"], ["y"], domain="com.microsoft")], "g",
                          [_f32("x", (2,))], [_f32("y", (2,))]),
        opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    assert "custom-domain-op" in _codes(check_onnx_for_tensorrt(m))


def test_stft_conditions():
    sig = _f32("sig", (1, 64, 1))
    step = numpy_helper.from_array(np.array(4, np.int64), "step")
    win = numpy_helper.from_array(np.hanning(16).astype(np.float32), "win")
    node = helper.make_node("STFT", ["sig", "step", "win"], ["out"], name="stft", onesided=1)
    ok = _model([node], [sig], [_f32("out", (1, 13, 9, 2))], initializers=[step, win], opset=20)
    assert errors(check_onnx_for_tensorrt(ok)) == []
    assert not _by_code(check_onnx_for_tensorrt(ok), "op-restriction")
    cplx = _model([node], [_f32("sig", (1, 64, 2))], [_f32("out", (1, 13, 16, 2))],
                  initializers=[step, win], opset=20)
    found = _by_code(check_onnx_for_tensorrt(cplx), "op-restriction")
    assert found[0].severity == "error" and "complex" in found[0].message


def test_unknown_trt_version_is_refused():
    m = _model([helper.make_node("Identity", ["x"], ["y"])], [_f32("x", (2,))], [_f32("y", (2,))])
    with pytest.raises(C2WUserError, match=r"tensorrt 8\.6.*TensorRT 10\.12\+ or 11\.x"):
        check_onnx_for_tensorrt(m, trt_version="8.6")
    with pytest.raises(C2WUserError, match="MAJOR.MINOR"):
        check_onnx_for_tensorrt(m, trt_version="latest")


def test_op_table_facts():
    assert OP_SUPPORT["Attention"].since == (10, 14)
    assert not OP_SUPPORT["DFT"].supported
    for op in ("LayerNormalization", "Gelu", "Mish", "ConvTranspose", "Pad", "STFT"):
        assert OP_SUPPORT[op].supported, op


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(8, 16, 3, padding=1)
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.ConvTranspose1d(16, 8, 4, stride=2, padding=1)

    def forward(self, x):                       # x: (B, 8, T) float
        y = self.conv(x)
        y = self.norm(y.transpose(1, 2)).transpose(1, 2)
        y = torch.nn.functional.mish(torch.nn.functional.gelu(y, approximate="tanh"))
        return torch.nn.functional.pad(self.up(y), (2, 2), mode="reflect")   # (B, 8, 2T + 4)


@pytest.fixture(scope="module")
def tiny_onnx():
    torch.manual_seed(0)
    dims = {0: torch.export.Dim("B", max=64), 2: torch.export.Dim("T", min=4, max=4096)}
    prog = torch.onnx.export(_Tiny().eval(), (torch.randn(1, 8, 20),), dynamo=True, optimize=False,
                             dynamic_shapes=(dims,), input_names=["x"], output_names=["y"], verbose=False)
    return prog.model_proto


def test_exported_clean_graph_has_no_errors(tiny_onnx, tmp_path):
    ops = {n.op_type for n in tiny_onnx.graph.node}
    assert {"Conv", "LayerNormalization", "Gelu", "Mish", "ConvTranspose", "Pad"} <= ops
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_onnx, str(path))
    findings = check_onnx_for_tensorrt(path, allow_dynamic=frozenset({"B", "T"}))
    assert errors(findings) == [], format_findings(findings)
    assert [f.severity for f in findings if f.code == "initializer-bytes"] == ["info"]
    params = sum(p.numel() * 4 for p in _Tiny().parameters())
    total, dup = initializer_bytes(path)
    assert dup == 0 and params <= total < params + 1024      # + the Pad constant
    # Without the named dims allowed it is flagged: the multi-profile plan needs them by name.
    assert "dynamic-dim" in _codes(check_onnx_for_tensorrt(tiny_onnx))


def test_format_findings_lists_errors_first():
    fs = [Finding("info", "initializer-bytes", "n bytes"),
          Finding("error", "unsupported-op", "op DFT ...", node="dft0", op_type="DFT")]
    text = format_findings(fs)
    lines = text.splitlines()
    assert lines[0].startswith("ERROR") and "unsupported-op [DFT 'dft0' in main]" in lines[0]
    assert lines[-1] == "1 error(s), 0 warning(s), 1 info(s)"
    with pytest.raises(ValueError, match="severity"):
        Finding("fatal", "x", "y")
