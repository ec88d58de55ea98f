"""Whole-solve graphs over resident rings (runtime/engines/solve_graphs.py), on the CPU: which
rings get a graph, how many graphs live, when they are released, and that every chunk a graph
solves equals the same chunk solved step by step, bit for bit (the fake GPU of test_graphs.py
runs the same functions, so nothing but a wrong buffer, slot or input could differ)."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from c2w.runtime.engines.aoti import AOTIBackend, EulerReplay
from c2w.runtime.engines.base import ArtifactInfo
from c2w.runtime.model.config import preset
from c2w.runtime.ring import RingCache
from c2w.runtime.trim import CacheTrim
from c2w.runtime.units import SPECS, ShapeKey
from tests.runtime.engines.test_graphs import _in_place_step, _stream_inputs, cuda  # noqa: F401 (fixture)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
T, L, TRIM = 3, 102, CacheTrim(2)       # the trim keeps P + 100 = 102 = L frames: T slots free per chunk


def _replays(cuda, limit=2):
    return (EulerReplay(cuda.kernel(_in_place_step), 10, CPU, "in_place", solve_graphs=limit),
            EulerReplay(_in_place_step, 10, CPU, "in_place"))


class Stream:
    """One stream's state as the driver keeps it, solved by `replay`, and the same stream solved
    step by step (`plain`), chunk by chunk on the same inputs."""

    def __init__(self, seed: int, replay, plain):
        self.g = torch.Generator().manual_seed(seed)
        *_, self.cnn, att = _stream_inputs(self.g, T, L)
        self.replay, self.plain = replay, plain
        self.ring, self.want = RingCache.of(att), RingCache.of(att.clone())

    def chunk(self) -> None:
        mu, spk, cond, x0 = _stream_inputs(self.g, T, 1)[:4]
        got = self.replay(mu, spk, cond, x0, self.cnn, self.ring, trim=TRIM)
        want = self.plain(mu, spk, cond, x0, self.cnn, self.want, trim=TRIM)
        for a, b in zip(got[:2] + (got[2].logical(),), want[:2] + (want[2].logical(),)):
            assert torch.equal(a, b)
        assert got[2].order == want[2].order
        self.ring, self.want, self.cnn = got[2], want[2], got[1]


def test_each_resident_ring_gets_a_graph_of_its_own(cuda):
    """Two streams interleaved on one engine: each ring the replay returned is solved by a graph
    over its own buffer from the chunk after (captured once each), and every chunk equals the
    step-by-step solve."""
    replay, plain = _replays(cuda)
    streams = [Stream(seed, replay, plain) for seed in (1, 2)]
    for _ in range(4):
        for s in streams:
            s.chunk()
    graphs = replay.graphs
    assert graphs.captures == graphs.live == 2
    got = [graphs.held(s.ring.buffer) for s in streams]
    assert got[0] is not got[1] and [g.graph.replays for g in got] == [3, 3]
    assert graphs.pool.live == 2
    replay.release()
    assert graphs.live == 0 and graphs.pool.retired


def test_a_ring_the_replay_did_not_return_is_solved_step_by_step(cuda):
    """A copy of a stream's ring (RingCache.clone: the same layout, T slots free, another buffer)
    and a ring over a caller's tensor are solved without a graph; the stream's own ring, handed
    back, gets one."""
    replay, plain = _replays(cuda)
    s = Stream(3, replay, plain)
    s.chunk()                                           # laid out anew: the replay's own buffer
    twin = Stream(3, replay, plain)
    twin.ring, twin.want, twin.cnn = s.ring.clone(), s.want.clone(), s.cnn
    twin.chunk()
    assert replay.graphs.captures == 0
    s.chunk()
    assert replay.graphs.captures == 1 and replay.graphs.held(s.ring.buffer) is not None


def test_batches_beyond_the_limit_are_solved_step_by_step_until_a_graph_idles(cuda):
    """Three resident streams served in turn, two graphs at most: the third is solved step by
    step rather than evicting a graph that runs every third call (which would capture anew on
    every call); once the first stream stops, its graph idles, and after 2 x limit calls the
    third takes its place. Every chunk equals the plain solve."""
    replay, plain = _replays(cuda, limit=2)
    streams = [Stream(seed, replay, plain) for seed in (4, 5, 6)]
    for _ in range(4):
        for s in streams:
            s.chunk()
    graphs = replay.graphs
    assert graphs.captures == 2 and graphs.live == 2 and graphs.pool.live == 2
    assert graphs.held(streams[2].ring.buffer) is None
    for _ in range(3):                                  # the first stream has stopped
        for s in streams[1:]:
            s.chunk()
    assert graphs.captures == 3 and graphs.live == 2
    assert graphs.held(streams[0].ring.buffer) is None and graphs.held(streams[2].ring.buffer) is not None


def test_one_graph_at_most_moves_to_the_buffer_in_use(cuda):
    """limit=1: the graph moves to another buffer once the first has idled, the old pool's last
    graph released before the new one is captured (a new pool, not the retired one)."""
    replay, plain = _replays(cuda, limit=1)
    a, b = Stream(10, replay, plain), Stream(11, replay, plain)
    for _ in range(2):
        a.chunk()
        b.chunk()
    graphs = replay.graphs
    assert graphs.captures == 1 and graphs.held(a.ring.buffer) is not None and graphs.held(b.ring.buffer) is None
    first = graphs.pool
    for _ in range(4):
        b.chunk()
    assert graphs.captures == 2 and graphs.held(b.ring.buffer) is not None and graphs.held(a.ring.buffer) is None
    assert first.retired and graphs.pool is not first and graphs.pool.live == 1


def test_a_graph_goes_with_its_buffer(cuda):
    """When a ring's buffer is freed (the batch broke up and its rows went back to their slots),
    its graph is released at the next call, and the pool counts it gone. (SolveGraphs alone, over
    a solve whose fake kernels do not hold the buffer: a fake graph keeps the tensors it replays
    alive, where a CUDA graph holds only addresses.)"""
    from c2w.runtime.engines.solve_graphs import SolveGraphs
    double = cuda.kernel(lambda x: x * 2)
    graphs = SolveGraphs(lambda buffer, x: double(x), CPU)
    buffers = [torch.zeros(4) for _ in range(2)]
    x = torch.arange(3.0)
    for b in buffers:
        assert graphs.run(b, [x]) is None               # not returned yet: no graph
        graphs.returned(b)
        assert torch.equal(graphs.run(b, [x])[0], 2 * x)
    assert graphs.live == graphs.pool.live == 2
    del buffers[0]
    gc.collect()
    assert graphs.run(buffers[0], [x]) is not None
    assert graphs.live == graphs.pool.live == 1 and len(graphs._buffers) == 1
    graphs.release()
    assert graphs.live == 0 and graphs.pool.retired


def test_a_buffer_whose_capture_failed_is_solved_step_by_step_from_then_on(cuda):
    """A capture that raises fails that call (the engine cache serves it eagerly) and releases
    the graph; the buffer is not captured again, and the replay solves it step by step."""
    replay, plain = _replays(cuda)
    s = Stream(9, replay, plain)
    s.chunk()
    real = replay.step

    def failing(*args):
        if cuda.capturing is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(*args)
    replay.step = failing
    with pytest.raises(RuntimeError, match="capturing"):
        s.chunk()
    graphs = replay.graphs
    assert graphs.captures == 1 and graphs.live == 0 and graphs.pool.live == 0
    replay.step = real
    s.chunk()                                           # its state is as before the failed call
    s.chunk()
    assert graphs.captures == 1 and graphs.held(s.ring.buffer) is None


def test_solve_graphs_replay_an_ungraphed_in_place_step_only(cuda):
    from c2w.runtime.engines.graphs import CapturedCall
    with pytest.raises(ValueError, match="ungraphed in-place step; got a 'chunk_frames' step"):
        EulerReplay(_in_place_step, 10, CPU, "chunk_frames", solve_graphs=2)
    step = CapturedCall(cuda.kernel(_in_place_step), [(1,)], [torch.float32], CPU, lazy=True)
    with pytest.raises(ValueError, match="in a graph of its own"):
        EulerReplay(step, 10, CPU, "in_place", solve_graphs=2)


def _info(B, T, L, step_att):
    key, cfg = ShapeKey("cfm", (B, T, L), "float16"), preset("full")
    spec = SPECS["cfm"]
    return ArtifactInfo(Path("x.pt2"), spec.input_names(key), spec.output_names, spec.input_shapes(cfg, key),
                        tuple(str(d).removeprefix("torch.") for d in spec.input_dtypes(key)),
                        {"cfm_step": True, "n_steps": cfg.n_timesteps, "step_att": step_att})


@pytest.mark.parametrize("B, T, L, step_att, solve_graphed", [
    (32, 150, 400, "in_place", True),          # a step's buffers: 1.15 GB, no graph per step
    (1, 50, 300, "in_place", False),           # graphed per step
    (32, 150, 400, "chunk_frames", False),     # no ring to solve in place
])
def test_which_cfm_engines_solve_resident_rings_in_graphs(B, T, L, step_att, solve_graphed):
    info = _info(B, T, L, step_att)
    assert AOTIBackend().solve_graphed(info, CUDA) is solve_graphed
    assert not AOTIBackend(cuda_graphs=False).solve_graphed(info, CUDA)
    assert not AOTIBackend().solve_graphed(info, CPU)
    assert not AOTIBackend(graph_max_bytes=None).solve_graphed(info, CUDA)     # everything graphed per step


def test_the_counts_say_how_each_solve_ran(cuda):
    """captures, replays (solves from a graph, the capture's own included) and declined solves
    (step by step because every graph was in recent use), as EngineCache.solve_graphs and the
    server's stats report them: one stream, then a second one with limit=1."""
    replay, plain = _replays(cuda, limit=1)
    a, b = Stream(12, replay, plain), Stream(13, replay, plain)
    for _ in range(3):
        a.chunk()                                       # laid out, captured, replayed
    assert replay.graphs.counts() == {"captures": 1, "replays": 2, "declined": 0, "held": 1}
    b.chunk()
    b.chunk()                                           # a's graph ran two calls ago: b declined
    assert replay.graphs.counts() == {"captures": 1, "replays": 2, "declined": 1, "held": 1}
