"""Which AOTI engines the runtime captures in CUDA graphs, and with which static inputs.

Pure bookkeeping (no GPU needed): the capture itself runs only on CUDA (benchmarks/h200)."""
from pathlib import Path

import pytest
import torch

from runtime.engines.aoti import GRAPH_MAX_BYTES, AOTIBackend, graph_inputs, nbytes
from runtime.engines.base import ArtifactInfo
from runtime.model.config import preset
from runtime.units import SPECS, ShapeKey

CUDA = torch.device("cuda")


def info_for(component, dims, dtype):
    key, cfg = ShapeKey(component, dims, dtype), preset("full")
    spec = SPECS[component]
    extra = {"cfm_step": True, "n_steps": cfg.n_timesteps} if component == "cfm" else {}
    return ArtifactInfo(Path("x.pt2"), spec.input_names(key), spec.output_names, spec.input_shapes(cfg, key),
                        tuple(str(d).removeprefix("torch.") for d in spec.input_dtypes(key)), extra)


def test_cfm_graph_is_one_euler_step():
    info = info_for("cfm", (1, 50, 300), "float16")
    shapes, dtypes = graph_inputs(info)
    full = info.input_shapes
    assert shapes == [*full[:4], full[4][1:], full[5][1:], (1,), (1,)]     # caches of ONE step, t, dt
    assert dtypes == [torch.float32] * 4 + [torch.float16] * 2 + [torch.float32] * 2
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


def test_env_turns_graphs_off(monkeypatch):
    info = info_for("cfm", (1, 50, 300), "float16")
    monkeypatch.setenv("C2W_AOTI_CUDA_GRAPHS", "0")
    assert not AOTIBackend().graphed(info, CUDA)
    monkeypatch.setenv("C2W_AOTI_CUDA_GRAPHS", "1")
    assert AOTIBackend().graphed(info, CUDA)


def test_a_pool_whose_graphs_are_all_gone_is_replaced(monkeypatch):
    """PyTorch releases a graph pool once its last graph is destroyed, and a later capture into
    the same handle trips an internal assert (`use_count > 0`: the exporter's second verified
    key on the H200). The backend hands out a new pool then, and keeps sharing a live one."""
    from runtime.engines import aoti
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
    """The release path: AOTIEngine.release -> CudaGraphed.release -> the pool counts the graph
    as gone, once, and the backend's next capture gets a fresh pool. (The capture itself needs
    a GPU; the graph object is built around it.)"""
    import weakref

    from runtime.engines.aoti import AOTIEngine, CudaGraphed, EulerReplay
    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    monkeypatch.setattr(torch.cuda, "Event", lambda: None)
    backend = AOTIBackend()
    pool = backend.pool(CUDA)
    graphs = []
    for _ in range(2):                                   # two engines' graphs in one pool
        g = CudaGraphed.__new__(CudaGraphed)
        g.pool, g.graph, g.inputs, g.outputs = pool, object(), [], []
        pool.captured += 1
        pool._added()
        g._finalizer = weakref.finalize(g, pool._dropped)
        graphs.append(g)
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
    weights were stored tap-major must not bind the tap-major tensors, nor the reverse)."""
    from runtime.engines.aoti import check_layout
    from runtime.model.dit import CausalConvBlock
    from runtime.verify import weights_layout
    blk = CausalConvBlock(8)
    built = weights_layout(blk)
    assert sorted(built) == ["block.1.weight", "block.6.weight"] and built["block.1.weight"] == [24, 1, 8]
    table = dict(blk.state_dict())
    check_layout(table, built)                                      # as built: fine
    with pytest.raises(RuntimeError, match=r"block\.1\.weight: strides \(24, 1, 8\), built for contiguous"):
        check_layout(table, {})                                     # a package built before tap-major
    with pytest.raises(RuntimeError, match=r"block\.6\.weight: strides \(24, 3, 1\), built for \(24, 1, 8\)"):
        check_layout({**table, "block.6.weight": table["block.6.weight"].contiguous()}, built)
