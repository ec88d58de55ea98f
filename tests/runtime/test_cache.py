"""The shape-keyed engine cache (runtime/cache.py) without artifacts: why a manifest cannot serve a
model, and what is served eagerly and counted when there is no engine or an engine fails.
Serving a real artifact directory through it is tests/runtime/test_runtime.py's."""
import logging
import types

import pytest
import torch

from c2w.runtime.cache import EngineCache, manifest_mismatch
from c2w.runtime.manifest import BackendRef, ModelRef
from c2w.runtime.model.weights import load_model
from c2w.runtime.units import SPECS, EagerRunner, ShapeKey

HIFT = ShapeKey("hift", (1, 50, 0), "float32")


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny")


def _manifest(m, **changes):
    fields = dict(model=ModelRef(spec="random:tiny", digest=m.digest, config="tiny"),
                  backend=BackendRef(name="onnxruntime", version="1.0"), device="cpu",
                  precision={"flow_encoder": "float32", "cfm": "float32", "hift": "float32", "tf32": False})
    return types.SimpleNamespace(**{**fields, **changes})


def test_manifest_mismatch_says_what_differs(model):
    cpu = torch.device("cpu")
    assert manifest_mismatch(_manifest(model), model, "1.0", cpu) is None
    assert manifest_mismatch(_manifest(model), model, None, cpu) is None         # version not checked
    other = _manifest(model, model=ModelRef(spec="random:tiny", digest="0123456789abcdef", config="tiny"))
    assert manifest_mismatch(other, model, "1.0", cpu) == f"model digest 0123456789abcdef != loaded model {model.digest}"
    assert manifest_mismatch(_manifest(model), model, "1.1", cpu) == "onnxruntime version 1.0 != installed 1.1"
    assert manifest_mismatch(_manifest(model, device="NVIDIA H200"), model, "1.0", cpu) == \
        "built for device 'NVIDIA H200', running on 'cpu'"
    half = _manifest(model, precision={"flow_encoder": "float32", "cfm": "float16", "hift": "float32"})
    assert manifest_mismatch(half, model, "1.0", cpu) == "cfm precision float16 != loaded model's float32"


def test_without_a_manifest_everything_is_served_eagerly_and_counted_as_misses(model, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="c2w.runtime")
    cache = EngineCache(tmp_path, model)
    assert cache.keys == [] and cache.backend is None and "manifest.json" in cache.reason_disabled
    assert "serving everything eagerly" in caplog.text
    inputs = SPECS["hift"].example_inputs(model.cfg, HIFT, torch.Generator().manual_seed(0))
    got = cache.run(HIFT, inputs)
    want = EagerRunner(model).run(HIFT, inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    cache.run(HIFT, inputs)
    assert cache.stats() == {"flow_encoder": {}, "cfm": {}, "hift": {HIFT.id: {"hits": 0, "misses": 2, "failures": 0}}}
    assert cache.load(HIFT) is False and cache.loaded == []


def test_an_engine_that_fails_at_run_time_is_served_eagerly_and_counted(model, tmp_path, caplog):
    class Failing:
        def run(self, inputs, trim=None):
            raise RuntimeError("device lost (stand-in)")

    cache = EngineCache(tmp_path, model)
    cache._engines[HIFT] = Failing()                # as if its artifact had loaded
    inputs = SPECS["hift"].example_inputs(model.cfg, HIFT, torch.Generator().manual_seed(1))
    caplog.set_level(logging.WARNING, logger="c2w.runtime")
    got = cache.run(HIFT, inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, EagerRunner(model).run(HIFT, inputs)))
    assert cache.stats()["hift"][HIFT.id] == {"hits": 0, "misses": 0, "failures": 1}
    assert f"engine {HIFT.id} failed (RuntimeError: device lost (stand-in)); serving it eagerly" in caplog.text


def test_the_engine_cache_reports_the_solve_graphs_of_its_engines(tmp_path):
    """EngineCache.solve_graphs: per loaded engine that has them, its counts; others are left out."""
    from c2w.runtime.engines.solve_graphs import SolveGraphs
    cache = EngineCache(tmp_path, load_model("random:tiny"))
    key, other = ShapeKey("cfm", (32, 150, 400), "float16"), ShapeKey("cfm", (1, 50, 300), "float16")
    graphs = SolveGraphs(lambda *a: None, torch.device("cpu"))
    graphs.captures, graphs.replays = 1, 5
    cache._engines = {key: types.SimpleNamespace(solve_graphs=graphs), other: types.SimpleNamespace(solve_graphs=None)}
    assert cache.solve_graphs() == {key.id: {"captures": 1, "replays": 5, "declined": 0, "held": 0}}
