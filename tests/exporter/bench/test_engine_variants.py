"""Which engine rows `c2w bench` times for a key, and which one it reports as served: the
backend's graph policy decides (`Backend.cuda_graphs` / `Backend.graphed`), never a probe of its
attributes. Pure bookkeeping: no GPU, no TensorRT, no artifacts."""
import dataclasses

import pytest
import torch

from c2w.exporter.bench.engines import engine_variants, served_variant
from c2w.runtime.engines import get_backend
from tests.runtime.engines.test_aoti import info_for

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
SMALL = info_for("cfm", (1, 50, 300), "float16")        # graph inputs well within GRAPH_MAX_BYTES
LARGE = info_for("cfm", (32, 150, 400), "float16")      # 0.84 GB of static att cache per step
LARGE_IN_PLACE = dataclasses.replace(LARGE, extra={**LARGE.extra, "step_att": "in_place"})


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv("C2W_AOTI_CUDA_GRAPHS", raising=False)


@pytest.mark.parametrize("info", [SMALL, LARGE])
def test_tensorrt_times_its_graph_row_under_a_graph_and_serves_it_with_cuda_graphs(info):
    variants = engine_variants("tensorrt", info, CUDA)
    assert {name: (b.name, b.cuda_graphs, b.graphed(info, CUDA)) for name, b in variants.items()} == {
        "engine": ("tensorrt", False, False), "engine_graph": ("tensorrt", True, True)}
    assert served_variant(get_backend("tensorrt", cuda_graphs=True), info, CUDA) == "engine_graph"
    assert served_variant(get_backend("tensorrt", cuda_graphs=False), info, CUDA) == "engine"
    assert served_variant(get_backend("tensorrt"), info, CUDA) == "engine"      # TensorRT's default: off


def test_aoti_graph_row_follows_its_size_limit_and_the_variable(monkeypatch):
    variants = engine_variants("aoti", SMALL, CUDA)
    assert [(name, b.cuda_graphs) for name, b in variants.items()] == [("engine", False), ("engine_graph", True)]
    assert served_variant(get_backend("aoti"), SMALL, CUDA) == "engine_graph"   # AOTI's default: on
    large = engine_variants("aoti", LARGE, CUDA)
    assert large["engine"].cuda_graphs is False
    assert large["engine_graph"] == ("not timed: backend aoti asked for cuda_graphs=True does not capture "
                                     "this key in a CUDA graph (its graph policy)")
    assert served_variant(get_backend("aoti"), LARGE, CUDA) == "engine"
    monkeypatch.setenv("C2W_AOTI_CUDA_GRAPHS", "1")       # overrides cuda_graphs=False: no graph-free row
    forced = engine_variants("aoti", SMALL, CUDA)
    assert forced["engine"].startswith("not timed: backend aoti asked for cuda_graphs=False captures")
    assert forced["engine_graph"].graphed(SMALL, CUDA)


def test_aoti_in_place_key_too_large_for_a_graph_per_call_serves_its_graph_row_from_solve_graphs(monkeypatch):
    """The B=32 T=150 in-place CFM key: no graph per call, but the runtime serves a resident batch's
    steady chunks from one graph per ring, so the graph row is timed and is the one served."""
    variants = engine_variants("aoti", LARGE_IN_PLACE, CUDA)
    assert {name: (b.cuda_graphs, b.graphed(LARGE_IN_PLACE, CUDA), b.solve_graphed(LARGE_IN_PLACE, CUDA))
            for name, b in variants.items()} == {"engine": (False, False, False),
                                                 "engine_graph": (True, False, True)}
    assert served_variant(get_backend("aoti"), LARGE_IN_PLACE, CUDA) == "engine_graph"
    assert served_variant(get_backend("aoti", cuda_graphs=False), LARGE_IN_PLACE, CUDA) == "engine"
    assert not get_backend("aoti").solve_graphed(LARGE_IN_PLACE, CPU)
    monkeypatch.setenv("C2W_AOTI_CUDA_GRAPHS", "0")
    assert engine_variants("aoti", LARGE_IN_PLACE, CUDA)["engine_graph"].startswith(
        "not timed: backend aoti asked for cuda_graphs=True does not capture")


def test_onnxruntime_never_has_a_graph_row_to_time_or_serve():
    variants = engine_variants("onnxruntime", SMALL, CUDA)
    assert variants["engine"].name == "onnxruntime"
    assert variants["engine_graph"].startswith("not timed: backend onnxruntime asked for cuda_graphs=True "
                                               "does not capture")
    assert served_variant(get_backend("onnxruntime", cuda_graphs=True), SMALL, CUDA) == "engine"


@pytest.mark.parametrize("name", ["onnxruntime", "aoti", "tensorrt"])
def test_on_the_cpu_only_the_graph_free_row(name):
    assert list(engine_variants(name, SMALL, CPU)) == ["engine"]
    assert served_variant(get_backend(name, cuda_graphs=True), SMALL, CPU) == "engine"
