"""Which AOTI engines the runtime captures in CUDA graphs, and with which static inputs.

Pure bookkeeping (no GPU needed): the capture itself runs only on CUDA (benchmarks/h200)."""
from pathlib import Path

import pytest
import torch

from c2w.runtime.engines.aoti import GRAPH_MAX_BYTES, AOTIBackend, graph_inputs, nbytes
from c2w.runtime.engines.base import ArtifactInfo
from c2w.runtime.model.config import preset
from c2w.runtime.units import SPECS, ShapeKey

CUDA = torch.device("cuda")


def info_for(component, dims, dtype, model="full"):
    key, cfg = ShapeKey(component, dims, dtype), preset(model)
    spec = SPECS[component]
    extra = {"cfm_step": True, "n_steps": cfg.n_timesteps} if component == "cfm" else {}
    return ArtifactInfo(Path("x.pt2"), spec.input_names(key), spec.output_names, spec.input_shapes(cfg, key),
                        tuple(str(d).removeprefix("torch.") for d in spec.input_dtypes(key)), extra)


def test_cfm_graph_is_one_euler_step():
    info = info_for("cfm", (1, 50, 300), "float16")
    shapes, dtypes = graph_inputs(info)
    full = info.input_shapes
    assert shapes == [*full[:4], full[4][1:], full[5][1:], (1,), (1,)]     # caches of ONE step, s, dt
    assert dtypes == [torch.float32] * 4 + [torch.float16] * 2 + [torch.int64, torch.float32]
    # one step's att cache at B=1, L=300: depth 16 x 2B x 8 heads x 300 x 128 x 2 bytes
    assert nbytes(shapes[5:6], dtypes[5:6]) == 16 * 2 * 8 * 300 * 128 * 2


@pytest.mark.parametrize("component,dims,dtype,graphed", [
    ("cfm", (1, 50, 300), "float16", True),
    ("cfm", (8, 50, 400), "float16", True),
    ("cfm", (16, 50, 400), "float16", True),
    ("cfm", (32, 150, 400), "float16", False),         # 0.84 GB of static att cache per step
    ("flow_encoder", (32, 78, 400, 0), "float16", True),
    ("hift", (32, 158, 3840), "float32", True),
])
def test_graph_size_policy(component, dims, dtype, graphed):
    info = info_for(component, dims, dtype)
    assert AOTIBackend(cuda_graphs=True).graphed(info, CUDA) is graphed
    assert (nbytes(*graph_inputs(info)) <= GRAPH_MAX_BYTES) is graphed
    assert AOTIBackend(cuda_graphs=True, graph_max_bytes=None).graphed(info, CUDA)   # bench: capture all
    assert not AOTIBackend(cuda_graphs=False).graphed(info, CUDA)
    assert not AOTIBackend(cuda_graphs=True).graphed(info, torch.device("cpu"))


@pytest.mark.parametrize("env,requested,graphs", [
    (None, None, True), (None, True, True), (None, False, False),   # the loading option, default on
    ("0", None, False), ("0", True, False), ("1", False, True),     # the variable overrides it
    ("", False, False), (" ", None, True),                          # blank counts as unset
])
def test_graph_capture_setting_precedence(monkeypatch, env, requested, graphs):
    from c2w.runtime.engines.aoti import cuda_graphs_setting
    if env is None:
        monkeypatch.delenv("C2W_AOTI_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("C2W_AOTI_CUDA_GRAPHS", env)
    assert cuda_graphs_setting(requested) is graphs
    info = info_for("cfm", (1, 50, 300), "float16")
    assert AOTIBackend(cuda_graphs=requested).graphed(info, CUDA) is graphs


def test_graph_capture_setting_errors(monkeypatch):
    from c2w.runtime.engines.aoti import cuda_graphs_setting
    from c2w.runtime.errors import C2WUserError
    monkeypatch.setenv("C2W_AOTI_CUDA_GRAPHS", "false")
    with pytest.raises(C2WUserError, match=r"environment variable C2W_AOTI_CUDA_GRAPHS: received 'false'; expected "
                                           r"'0' \(no CUDA graphs\) or '1'\. Or unset it"):
        cuda_graphs_setting(True)
    monkeypatch.delenv("C2W_AOTI_CUDA_GRAPHS")
    with pytest.raises(C2WUserError, match=r"cuda_graphs: received 'no'; expected True, False or None"):
        cuda_graphs_setting("no")


def test_get_backend_passes_the_graph_option_to_backends_that_capture(monkeypatch):
    from c2w.runtime.engines import get_backend
    monkeypatch.delenv("C2W_AOTI_CUDA_GRAPHS", raising=False)
    assert get_backend("aoti").cuda_graphs is True
    assert get_backend("aoti", cuda_graphs=False).cuda_graphs is False
    assert get_backend("tensorrt").cuda_graphs is False                     # TensorRT's default: off
    assert get_backend("tensorrt", cuda_graphs=True).cuda_graphs is True
    assert get_backend("onnxruntime", cuda_graphs=True).name == "onnxruntime"   # never captures: ignored


def aoti_directory(tmp_path) -> Path:
    """An AOTI artifact directory with nothing built: enough for the cache to open its backend."""
    from c2w.runtime.manifest import BackendRef, Manifest, ModelRef, ProfileRef, write_manifest
    from c2w.runtime.model.weights import load_model
    model = load_model("random:tiny")
    write_manifest(tmp_path, Manifest(
        profile=ProfileRef(name="t", digest="", source=""), model=ModelRef("random:tiny", model.digest, "tiny"),
        backend=BackendRef("aoti", f"torch-{torch.__version__}"), torch_version=torch.__version__, device="cpu",
        precision={"flow_encoder": "float32", "cfm": "float32", "hift": "float32", "tf32": False},
        budget_bytes=1 << 30, weight_bytes={}))
    return tmp_path


@pytest.mark.parametrize("env,requested,graphs", [(None, False, False), (None, None, True), ("1", False, True)])
def test_runtime_load_passes_the_graph_option_to_every_engine_cache(monkeypatch, tmp_path, env, requested, graphs):
    """runtime.load(..., cuda_graphs=) reaches the backend that loads the engines, and the
    replicas a stream server runs its lanes with (C2W_AOTI_CUDA_GRAPHS still overrides it)."""
    from c2w import runtime
    from c2w.runtime.errors import C2WUserError
    if env is None:
        monkeypatch.delenv("C2W_AOTI_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("C2W_AOTI_CUDA_GRAPHS", env)
    rt = runtime.load(aoti_directory(tmp_path), cuda_graphs=requested)
    assert rt.cache.reason_disabled is None
    assert rt.cache.backend.name == "aoti" and rt.cache.backend.cuda_graphs is graphs
    twin = rt.cache.replica()
    assert twin.backend is not rt.cache.backend and twin.backend.cuda_graphs is graphs
    monkeypatch.setenv("C2W_AOTI_CUDA_GRAPHS", "yes")       # an error, not a cache that silently serves eagerly
    with pytest.raises(C2WUserError, match=r"C2W_AOTI_CUDA_GRAPHS: received 'yes'"):
        runtime.load(tmp_path, cuda_graphs=requested)


def test_a_pool_whose_graphs_are_all_gone_is_replaced(monkeypatch):
    """PyTorch releases a graph pool once its last graph is destroyed, and a later capture into
    the same handle trips an internal assert (`use_count > 0`: the exporter's second verified
    key on the H200). The backend hands out a new pool then, and keeps sharing a live one."""
    from c2w.runtime.engines import aoti
    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    monkeypatch.setattr(torch.cuda, "Event", lambda: None)
    backend = AOTIBackend()
    first = backend.pool(CUDA)
    assert not first.retired and backend.pool(CUDA) is first           # nothing captured yet: shared
    first.captured, first.live = 2, 2                                  # two engines' graphs alive
    assert backend.pool(CUDA) is first
    first._dropped()
    assert not first.retired and backend.pool(CUDA) is first           # one still alive: shared
    first._dropped()
    assert first.retired
    second = backend.pool(CUDA)
    assert second is not first and second.handle != first.handle and not second.retired
    assert isinstance(second, aoti.GraphPool)


def test_releasing_an_engine_retires_its_pool(monkeypatch):
    """The release path: AOTIEngine.release -> CapturedCall.release -> the pool counts the graph
    as gone, once, and the backend's next capture gets a fresh pool. (The capture runs on a fake
    of torch.cuda's graph calls, tests/runtime/engines/test_graphs.py; the real one needs a GPU.)"""
    from c2w.runtime.engines.aoti import AOTIEngine, CapturedCall, EulerReplay
    from tests.runtime.engines.test_graphs import fake_cuda
    cuda = fake_cuda(monkeypatch)
    backend = AOTIBackend()
    pool = backend.pool(CUDA)
    step = cuda.kernel(lambda *args: [a.clone() for a in args[:6]])
    graphs = [CapturedCall(step, [(1,)] * 8, [torch.float32] * 8, torch.device("cpu"), pool)
              for _ in range(2)]                         # two engines' graphs in one pool
    assert pool.captured == pool.live == 2
    cfm = AOTIEngine(info_for("cfm", (1, 50, 300), "float16"),
                     EulerReplay(graphs[0], 10, torch.device("cpu")), CUDA, [])
    enc = AOTIEngine(info_for("flow_encoder", (1, 28, 300, 0), "float16"), graphs[1], CUDA, [])
    cfm.release()
    cfm.release()                                        # twice: counted once
    assert pool.live == 1 and not pool.retired and backend.pool(CUDA) is pool
    del graphs
    enc.release()
    assert pool.live == 0 and pool.retired
    assert backend.pool(CUDA) is not pool


def test_weights_in_another_layout_than_the_build_are_refused():
    """AOTI binds shared weights by pointer: a weight whose strides differ from the build's would
    be read in the wrong order, so loading refuses it (a package built before the DiT's conv
    weights were stored taps-outer must not bind the taps-outer tensors, nor the reverse; nor a
    package built for the tap-major order of AOTI revisions 2-4)."""
    from c2w.runtime.engines.aoti import check_layout
    from c2w.runtime.model.dit import CausalConvBlock
    from c2w.runtime.verify import weights_layout
    blk = CausalConvBlock(8)
    built = weights_layout(blk)
    assert sorted(built) == ["block.1.weight", "block.6.weight"] and built["block.1.weight"] == [8, 1, 64]
    table = dict(blk.state_dict())
    check_layout(table, built)                                      # as built: fine
    with pytest.raises(RuntimeError, match=r"block\.1\.weight: strides \(8, 1, 64\), built for contiguous"):
        check_layout(table, {})                                     # a package built before tap-major
    with pytest.raises(RuntimeError, match=r"block\.1\.weight: strides \(8, 1, 64\), built for \(24, 1, 8\)"):
        check_layout(table, {"block.1.weight": [24, 1, 8], "block.6.weight": [24, 1, 8]})   # built tap-major
    with pytest.raises(RuntimeError, match=r"block\.6\.weight: strides \(24, 3, 1\), built for \(8, 1, 64\)"):
        check_layout({**table, "block.6.weight": table["block.6.weight"].contiguous()}, built)
