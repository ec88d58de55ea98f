"""TensorRT goes through the same export loop as every backend: one plan per graph variant,
per-key failure, interrupt and resume.

TensorRT cannot be installed here, so stand-ins replace the calls that need it and a GPU: the
backend's SDK import gives a module with a version only, `build_engine_from_onnx` writes a JSON
file naming the ONNX graph and the profiles instead of a plan, and the backend's `load` returns
an engine that runs that ONNX graph in ONNX Runtime at the key's profile. Everything else is c2w's own code: grouping, the dynamic-dim ONNX
export and its TensorRT compatibility check, the profile per key, identity, resume, hashing and
the parity check. Nothing here says anything about what TensorRT computes.

Each graph is exported for real once per module: when the loop asks for the same graph again
(same variant, inputs and weights: a resume, the dry run), the files of the first export are
copied, since a graph export takes ~20 s on 2 cores. The export itself is checked graph by graph
in test_tensorrt_graphs.py.
"""
import dataclasses
import json
import shutil
import types

import numpy as np
import pytest
import torch

import c2w.exporter.backends.tensorrt as tensorrt_builder
import c2w.exporter.backends.tensorrt_plan as tensorrt_plan
import c2w.exporter.export as ex
import c2w.runtime.memory
from c2w.exporter.backends import get_builder
from c2w.exporter.export import ExportInterrupted, artifact_groups, export_profile
from c2w.exporter.plan import make_plan, precision_weights
from c2w.runtime.engines.base import Engine
from c2w.runtime.engines.tensorrt import TensorRTBackend
from c2w.runtime.manifest import read_manifest
from c2w.runtime.model.weights import load_model
from tests.conftest import EstimatedMemory, small_profile
from tests.exporter.backends.test_tensorrt_graphs import assert_clean_variant_graph

VERSION = "10.12.0"


class _OnnxStandIn(Engine):
    """Runs the plan's ONNX graph in ONNX Runtime after checking that the key's shapes are the
    plan's profile `profile_index`; `corrupt`: returns wrong outputs."""

    def __init__(self, info, corrupt: bool):
        import onnxruntime as ort
        plan = json.loads(info.path.read_text())
        profile = plan["profiles"][info.extra["profile_index"]]
        assert profile == {n: list(s) for n, s in zip(info.input_names, info.input_shapes)}
        self.info, self.corrupt = info, corrupt
        self.session = ort.InferenceSession(plan["onnx"], providers=["CPUExecutionProvider"])

    def run_impl(self, inputs, trim=None):
        feed = {n: t.numpy() for n, t in zip(self.info.input_names, inputs)}
        outs = [torch.from_numpy(np.ascontiguousarray(o)) for o in self.session.run(None, feed)]
        return [o + 1 for o in outs] if self.corrupt else outs

    def release(self):
        self.session = None


def _group(plan_path) -> str:
    return plan_path.name.split(".trt")[0]


@pytest.fixture(scope="module")
def graph_store(tmp_path_factory):
    """Graphs exported in this module: (variant, input names and shapes, weights) -> (the stored
    graph, what export_onnx returned)."""
    return tmp_path_factory.mktemp("graphs"), {}


def _fingerprint(unit) -> tuple:
    return tuple((k, tuple(v.shape), float(v.double().sum())) for k, v in unit.state_dict().items())


@pytest.fixture
def graph_export(monkeypatch, graph_store):
    """The TensorRT builder's graph export, real the first time a graph is asked for and copied
    afterwards; returns the set of `broken` groups whose export raises instead."""
    store, graphs = graph_store
    broken = set()
    real_export = tensorrt_builder.export_onnx

    def export(unit, inputs, input_names, output_names, path, **kw):
        if path.stem in broken:
            raise RuntimeError(f"export of {path.stem} fails")
        key = (path.stem, tuple(input_names), tuple(tuple(t.shape) for t in inputs), _fingerprint(unit))
        if key not in graphs:
            stats = real_export(unit, inputs, input_names, output_names, path, **kw)
            for rel in [path.name] + stats.files:
                (store / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path.parent / rel, store / rel)
            graphs[key] = (path.name, stats)
            return stats
        name, stats = graphs[key]
        for rel in stats.files:
            (path.parent / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(store / rel, path.parent / rel)
        shutil.copyfile(store / name, path)
        return stats
    monkeypatch.setattr(tensorrt_builder, "export_onnx", export)
    return broken


def install_fake_tensorrt(monkeypatch) -> set:
    """The stand-ins for the SDK, the plan build and the plan's engine (the graph export stays
    whatever the caller makes it); returns the `wrong` (group, profile index) pairs whose engine
    computes wrong outputs, empty, for the caller to fill."""
    wrong = set()
    # the SDK as the backend sees it (not in sys.modules: torch looks for a real tensorrt there)
    monkeypatch.setattr(TensorRTBackend, "_import", lambda self: types.SimpleNamespace(__version__=VERSION))

    def build(onnx_path, profiles, out_path, **kw):
        out_path.write_text(json.dumps({"onnx": str(onnx_path), "profiles": profiles}))
        return {"device_memory_per_profile": None}

    def load(self, info, weights, device):
        return _OnnxStandIn(info, (_group(info.path), info.extra["profile_index"]) in wrong)
    monkeypatch.setattr(tensorrt_plan, "build_engine_from_onnx", build)
    monkeypatch.setattr(TensorRTBackend, "load", load)
    # what TensorRT holds is not measured here: each key costs its estimate (a stand-in engine
    # in another process would not exist there)
    monkeypatch.setattr(c2w.runtime.memory, "MeasureProcess", EstimatedMemory)
    return wrong


@pytest.fixture
def fake_tensorrt(monkeypatch, graph_export):
    """The stand-ins, and the faults a test may inject: `wrong` (group, profile index) pairs whose
    engine computes wrong outputs, `broken` groups whose graph export raises."""
    return {"wrong": install_fake_tensorrt(monkeypatch), "broken": graph_export}


def _profile():
    return dataclasses.replace(small_profile(), backend="tensorrt", name="trt")


def _groups(p):
    model = load_model(p.model)
    return artifact_groups(get_builder("tensorrt"), make_plan(model.cfg, p, precision_weights(model, p)))


def test_one_plan_per_graph_variant_and_shards_never_split_one():
    groups = _groups(_profile())
    assert {name: len(pks) for name, pks in groups} == {
        "flow_encoder-float32": 3, "cfm-float32": 3, "hift-F50-float32": 1, "hift-F58-cached-float32": 1}
    shards = [[name for (name, _), s in zip(groups, ex.shard_of_groups(groups, 2)) if s == k] for k in (0, 1)]
    assert sorted(shards[0] + shards[1]) == sorted(name for name, _ in groups) and all(shards)


def _without_cfm(p):
    """The profile with a budget that leaves the CFM out (its graph is the slowest to export)."""
    model = load_model(p.model)
    weights = precision_weights(model, p)
    others = [e for e in make_plan(model.cfg, p, weights).entries if e.key.component != "cfm"]
    budget = weights["flow_encoder"] + weights["hift"] + sum(e.est_bytes for e in others) + (32 << 20)
    return dataclasses.replace(p, budget_bytes=budget)


@pytest.mark.slow
def test_tensorrt_export_fails_per_key_resumes_and_rebuilds_only_what_changed(tmp_path, monkeypatch, fake_tensorrt):
    out, profile = tmp_path / "trt", _without_cfm(_profile())
    (first, first_keys), _, (last, last_keys) = _groups(profile)
    assert (len(first_keys), len(last_keys)) == (3, 1)
    real, calls = ex._build_group, []

    def interrupt_at_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(ex, "_build_group", interrupt_at_second)
    with pytest.raises(ExportInterrupted, match="interrupted: 3 of 5 built"):
        export_profile(profile, out)
    entries = read_manifest(out).by_id()
    assert [e.status for e in entries.values()].count("pending") == 2
    built = [entries[pk.key.id] for pk in first_keys]          # one plan, one profile per key in order
    plan = f"tensorrt/{first}.trt{VERSION}.cpu.plan"
    assert {e.artifact for e in built} == {plan} and {e.status for e in built} == {"built"}
    assert [e.extra["profile_index"] for e in built] == [0, 1, 2]
    monkeypatch.setattr(ex, "_build_group", real)

    # resume: the first plan is kept, the second built, the last fails (its graph does not export)
    fake_tensorrt["broken"].add(last)
    res = export_profile(profile, out)
    assert (res.built, res.reused, res.failed) == (1, 3, 1)
    assert f"export of {last} fails" in read_manifest(out).by_id()[last_keys[0].key.id].error
    assert any(f.code == "initializer-bytes" for f in res.findings)       # the compatibility check ran

    # a deleted plan is rebuilt with all its profiles; one of them fails parity, alone
    (out / plan).unlink()
    fake_tensorrt["wrong"].add((first, 1))
    res = export_profile(profile, out)
    assert (res.built, res.reused, res.failed) == (2, 1, 2)
    entries = read_manifest(out).by_id()
    assert [pk.key.id for pk in first_keys if entries[pk.key.id].status != "built"] == [first_keys[1].key.id]
    assert "parity failed" in entries[first_keys[1].key.id].error


def test_dry_run_exports_and_checks_the_graphs_of_its_shard_without_tensorrt(tmp_path, graph_export):
    groups = [name for name, _ in _groups(_profile())]
    res = export_profile(_profile(), tmp_path, dry_run=True, shard=(3, 4))        # one group: a HiFT graph
    assert res.manifest.backend.version == ex.DRY_RUN_VERSION and res.built == 0
    assert {f.message.split(":")[0] for f in res.findings} == {groups[2]} == {"hift-F58-cached-float32"}
    graphs = sorted((tmp_path / "tensorrt" / "onnx").glob("*.onnx"))
    assert [p.name for p in graphs] == [f"{groups[2]}.onnx"]
    # the steady-chunk HiFT graph (the variant test_tensorrt_graphs.py leaves to this test) is clean
    assert_clean_variant_graph(graphs[0], res.findings, "hift")
    assert not (tmp_path / "manifest.json").exists()
