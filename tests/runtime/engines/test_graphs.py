"""The CUDA-graph helper every backend uses (runtime/engines/graphs.py), on the CPU.

`fake_cuda` replaces what the helper calls in torch.cuda with a fake that keeps CUDA graphs'
semantics where they matter, for work launched through `FakeCuda.kernel`: under capture it is
recorded, not run (its outputs stay NaN until a replay), and a replay calls the recorded functions
again on the very tensors they were given, writing into the very tensors they returned, as a
graph's baked-in addresses do. Every other torch call made under capture (the copies between a
replay's steps, say) runs at once and is recorded as well, so a replay repeats it in its place
among the kernels. A pool whose last graph is destroyed is gone, and capturing into it fails, as
in PyTorch. The real capture runs in tests/runtime/test_cuda.py (GPU).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

from c2w.runtime.engines import graphs
from c2w.runtime.engines.graphs import CapturedCall, GraphPool, as_list

CPU = torch.device("cpu")


class FakeGraph:
    def __init__(self, cuda: "FakeCuda"):
        self.cuda, self.launches, self.replays, self.handle = cuda, [], 0, None

    def replay(self) -> None:
        self.replays += 1
        for fn, args, outs in self.launches:
            for dst, src in zip(outs, as_list(fn(*args))):
                if isinstance(dst, torch.Tensor) and dst is not src:
                    dst.copy_(src)

    def __del__(self):
        if self.handle is not None:
            self.cuda.graphs_in_pool[self.handle] -= 1


class FakeStream:
    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


class FakeEvent:
    def __init__(self):
        self.recorded = 0

    def record(self, stream=None) -> None:
        self.recorded += 1


class _Recorder(TorchFunctionMode):
    """Under a fake capture, records each torch call made outside FakeCuda.kernel that returns
    tensors, with its arguments and results, for the graph's replay."""

    def __init__(self, cuda: "FakeCuda"):
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        graph = self.cuda.capturing
        if graph is not None and not self.cuda.in_kernel and any(isinstance(o, torch.Tensor) for o in as_list(out)):
            graph.launches.append((functools.partial(func, **kwargs), args, as_list(out)))
        return out


class FakeCuda:
    """What the fake GPU did: calls run outside capture (`eager_calls`), and per pool handle the
    graphs that hold it (`graphs_in_pool`)."""

    def __init__(self):
        self.capturing: FakeGraph | None = None
        self.in_kernel = False
        self.capture_modes: list[str] = []
        self.eager_calls = 0
        self.graphs_in_pool: dict[int, int] = {}
        self._handles = itertools.count()
        self._stream = FakeStream()

    def graph_pool_handle(self) -> int:
        return next(self._handles)

    @contextlib.contextmanager
    def graph(self, g: FakeGraph, pool=None, capture_error_mode="global"):
        if self.graphs_in_pool.get(pool, None) == 0:      # PyTorch: internal assert `use_count > 0`
            raise RuntimeError(f"capture into pool {pool}, released with its last graph")
        g.handle = pool
        self.graphs_in_pool[pool] = self.graphs_in_pool.get(pool, 0) + 1
        self.capture_modes.append(capture_error_mode)
        self.capturing = g
        try:
            with _Recorder(self):
                yield
        finally:
            self.capturing = None

    def kernel(self, fn):
        """`fn` as the fake GPU runs it: at once outside capture; recorded under capture (with the
        tensors it was given and returned, which it leaves unwritten: NaN)."""
        def launch(*args):
            self.in_kernel = True
            try:
                outs = fn(*args)
                if self.capturing is None:
                    self.eager_calls += 1
                else:
                    self.capturing.launches.append((fn, args, as_list(outs)))
                    for o in as_list(outs):
                        o.fill_(float("nan"))
            finally:
                self.in_kernel = False
            return outs
        return launch


def fake_cuda(monkeypatch) -> FakeCuda:
    """Patch torch.cuda's graph, stream and event calls with one FakeCuda (undone by monkeypatch)."""
    cuda = FakeCuda()
    for name, value in {"CUDAGraph": lambda: FakeGraph(cuda), "graph": cuda.graph,
                        "graph_pool_handle": cuda.graph_pool_handle, "Event": FakeEvent,
                        "Stream": lambda device=None, priority=0: FakeStream(),
                        "current_stream": lambda device=None: cuda._stream,
                        "stream": lambda s: contextlib.nullcontext()}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(graphs, "_warmup_streams", {})      # no fake stream outlives the test
    return cuda


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    return fake_cuda(monkeypatch)


def test_inputs_are_copied_into_static_buffers_on_every_call(cuda):
    """Captured at construction on zeros (after two warm-up calls), then each call's values reach
    the graph through the static buffers: a later call with new values gives new outputs."""
    cc = CapturedCall(cuda.kernel(lambda x, y: (x * 2 + y, x - y)), [(2, 3), (3,)],
                      [torch.float32, torch.float32], CPU)
    assert cc.captured and cuda.eager_calls == 2 and cc.pool.captured == 1 and cc.pool.live == 1
    assert [a for a in cc.graph.launches[0][1]] == cc.inputs        # the graph reads the static inputs
    for seed in (1, 2, 3):
        x, y = torch.randn(2, 3, generator=torch.Generator().manual_seed(seed)), torch.randn(3)
        x0 = x.clone()
        a, b = cc(x, y)
        torch.testing.assert_close(a, x * 2 + y)
        torch.testing.assert_close(b, x - y)
        assert torch.equal(x, x0) and all(s is not t for s, t in zip(cc.inputs, (x, y)))
    assert cc.graph.replays == 3 and cuda.eager_calls == 2 and cc.pool.captured == 1


def test_every_capture_on_a_device_warms_up_on_one_stream(cuda, monkeypatch):
    """cuBLAS keeps a 32 MiB workspace per stream it ran on (H100/H200): the warm-ups of every
    capture on a device, in one pool or in pools of their own (the exporter verifies each key with
    a fresh pool), run on one high-priority side stream, so only the first capture makes one (the
    H200's first ~30 captured keys of a process each held ~32 MiB more, runs 11 and 13a)."""
    made, entered = [], []
    monkeypatch.setattr(torch.cuda, "Stream",
                        lambda device=None, priority=0: made.append((FakeStream(), priority)) or made[-1][0])
    monkeypatch.setattr(torch.cuda, "stream", lambda s: entered.append(s) or contextlib.nullcontext())
    pool = GraphPool(CPU)
    calls = [CapturedCall(cuda.kernel(lambda x: x + i), [(2,)], [torch.float32], CPU, pool) for i in range(3)]
    calls.append(CapturedCall(cuda.kernel(lambda x: x * 2), [(2,)], [torch.float32], CPU))   # a pool of its own
    assert len(made) == 1 and made[0][1] < 0                   # one stream, of higher priority than the default
    assert len(entered) == 4 and all(s is made[0][0] for s in entered) and cuda.eager_calls == 8
    assert graphs.warmup_stream(CPU) is made[0][0] and pool.captured == 3
    for c in calls:
        c.release()


def test_outputs_are_cloned_copied_or_the_static_buffers_as_asked(cuda):
    cc = CapturedCall(cuda.kernel(lambda x: x + 1), [(4,)], [torch.float32], CPU)
    first = cc(torch.zeros(4))
    second = cc(torch.ones(4))
    assert torch.equal(first[0], torch.ones(4)) and torch.equal(second[0], torch.full((4,), 2.0))
    assert first[0].data_ptr() != second[0].data_ptr() != cc.outputs[0].data_ptr()   # never aliased
    out = [torch.empty(4)]
    assert cc(torch.full((4,), 5.0), out=out) is out and torch.equal(out[0], torch.full((4,), 6.0))
    static = cc(torch.zeros(4), clone=False)
    assert static[0] is cc.outputs[0] and torch.equal(static[0], torch.ones(4))
    cc(torch.full((4,), 9.0), clone=False)
    assert torch.equal(static[0], torch.full((4,), 10.0))      # overwritten by the next replay
    assert torch.equal(first[0], torch.ones(4))                 # a clone is the caller's to keep


def test_release_and_collection_count_each_graph_once_then_the_pool_retires(cuda):
    """The pool's bookkeeping: a released or collected graph is counted as gone once; once all
    are gone PyTorch has freed the pool, so a capture into it is refused before it asserts."""
    pool = GraphPool(CPU)
    fn = cuda.kernel(lambda x: x * 3)
    a, b, c = (CapturedCall(fn, [(2,)], [torch.float32], CPU, pool) for _ in range(3))
    assert (pool.captured, pool.live, pool.retired) == (3, 3, False)
    a.release()
    a.release()                                          # idempotent: counted once
    assert (pool.live, pool.retired) == (2, False)
    with pytest.raises(RuntimeError, match="this CapturedCall was released"):
        a(torch.zeros(2))
    torch.testing.assert_close(b(torch.ones(2))[0], torch.full((2,), 3.0))   # the others still replay
    del c
    gc.collect()
    assert (pool.live, pool.retired) == (1, False)
    b.release()
    assert (pool.live, pool.retired) == (0, True) and cuda.graphs_in_pool[pool.handle] == 0
    with pytest.raises(RuntimeError, match=r"capture into a retired GraphPool \(all its graphs were released\)"):
        CapturedCall(fn, [(2,)], [torch.float32], CPU, pool)
    assert pool.captured == 3                            # refused before capturing


def test_a_failed_capture_retires_a_pool_with_no_other_graph(cuda):
    def broken(x):
        if cuda.capturing is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return x
    pool = GraphPool(CPU)
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        CapturedCall(broken, [(2,)], [torch.float32], CPU, pool)
    assert (pool.captured, pool.live, pool.retired) == (1, 0, True)


class Scratch:
    """A TensorRT backend's shared scratch as the fake sees it: reallocating it frees the old
    buffer (NaN here) and moves the generation on."""

    def __init__(self):
        self.buffer, self.generation = torch.full((3,), 10.0), 0

    def reallocate(self, value: float) -> None:
        self.buffer.fill_(float("nan"))
        self.buffer, self.generation = torch.full((3,), value), self.generation + 1


def trt_style(cuda: FakeCuda, scratch: Scratch, *, hook: bool) -> CapturedCall:
    """As TensorRTEngine._run_graph: static outputs allocated outside the capture, an enqueue that
    binds the scratch's address of the moment, captured on the first call."""
    static_out = [torch.empty(3)]
    run = cuda.kernel(lambda x, buf, out: out.copy_(x + buf))

    def enqueue(x):
        run(x, scratch.buffer, static_out[0])
        return static_out
    return CapturedCall(enqueue, [(3,)], [torch.float32], CPU, warmups=1, lazy=True,
                        generation=(lambda: scratch.generation) if hook else None)


def test_a_moved_scratch_makes_the_next_call_capture_again(cuda):
    scratch = Scratch()
    cc = trt_style(cuda, scratch, hook=True)
    assert not cc.captured and cuda.eager_calls == 0 and cc.pool.captured == 0       # lazy: nothing yet
    torch.testing.assert_close(cc(torch.ones(3))[0], torch.full((3,), 11.0))
    first = weakref.ref(cc.graph)           # not a reference: the helper alone keeps it alive
    assert cuda.eager_calls == 1 and first().replays == 1
    torch.testing.assert_close(cc(torch.full((3,), 2.0))[0], torch.full((3,), 12.0))
    assert cc.graph is first() and cc.pool.captured == 1                             # same scratch: same graph
    scratch.reallocate(100.0)
    torch.testing.assert_close(cc(torch.ones(3))[0], torch.full((3,), 101.0))
    assert first() is None and cuda.eager_calls == 2                                # the stale graph is gone
    # captured into the same pool before the stale graph was dropped: the pool never emptied
    assert (cc.pool.captured, cc.pool.live, cuda.graphs_in_pool[cc.pool.handle]) == (2, 1, 1)
    cc.release()
    assert cc.pool.retired


def test_without_the_hook_a_moved_scratch_is_read_stale(cuda):
    """What the generation hook prevents (and that the fake models baked-in addresses)."""
    scratch = Scratch()
    cc = trt_style(cuda, scratch, hook=False)
    torch.testing.assert_close(cc(torch.ones(3))[0], torch.full((3,), 11.0))
    scratch.reallocate(100.0)
    assert torch.isnan(cc(torch.ones(3))[0]).all()


def test_tensorrt_engine_captures_on_first_call_and_again_after_the_scratch_grows(cuda):
    """TensorRTEngine's graph path on the helper, with its TensorRT calls replaced: the scratch
    generation is the backend's, and release drops the graph from its pool."""
    from c2w.runtime.engines.tensorrt import TensorRTEngine
    backend = type("Backend", (), {})()
    backend._scratch_generation, scratch = 0, Scratch()
    engine = TensorRTEngine.__new__(TensorRTEngine)
    engine._backend, engine._device, engine._graph = backend, CPU, None
    engine._empty_outputs = lambda ins: [torch.empty(3)]
    run = cuda.kernel(lambda x, buf, out: out.copy_(x * buf))
    engine._bind_and_enqueue = lambda ins, outs: run(ins[0], scratch.buffer, outs[0])
    assert engine._graph is None
    torch.testing.assert_close(engine._run_graph([torch.ones(3)])[0], torch.full((3,), 10.0))
    graph = engine._graph
    assert isinstance(graph, CapturedCall) and graph.pool.captured == 1
    scratch.reallocate(2.0)
    backend._scratch_generation += 1
    torch.testing.assert_close(engine._run_graph([torch.full((3,), 3.0)])[0], torch.full((3,), 6.0))
    assert engine._graph is graph and graph.pool.captured == 2
    engine.release()
    assert engine._graph is None and graph.pool.retired


def test_a_step_of_chunk_frames_replays_to_the_whole_cache(cuda):
    """A step that returns only the chunk's frames of the new attention cache (the AOTI build's,
    runtime.units.CFMStepUnit): EulerReplay writes them first and the step's input cache after
    them, graphed or not, and gives what a step returning the whole cache gives."""
    from c2w.runtime.engines.aoti import EulerReplay

    def whole(mu, spk, cond, x, cnn, att, s, dt):
        x_new = x + dt * (mu + cond + spk[..., None] * s)
        return x_new, cnn * 0.5 + s, torch.cat([x_new.transpose(1, 2) * s, att], dim=1)

    def chunk(*args):
        x_new, cnn, att = whole(*args)
        return x_new, cnn, att[:, :3].clone()             # T = 3 frames

    shapes = [(1, 2, 3), (1, 2), (1, 2, 3), (1, 2, 3), (1, 4), (1, 5, 2), (1,), (1,)]
    dtypes = [torch.float32] * 6 + [torch.int64, torch.float32]
    want_of = EulerReplay(whole, 10, CPU)
    replays = [EulerReplay(chunk, 10, CPU, "chunk_frames"),
               EulerReplay(CapturedCall(cuda.kernel(chunk), shapes, dtypes, CPU), 10, CPU, "chunk_frames")]
    g = torch.Generator().manual_seed(3)
    args = [torch.randn(s, generator=g) for s in shapes[:4]] + [
        torch.randn(10, 1, 4, generator=g), torch.randn(10, 1, 5, 2, generator=g)]
    want = want_of(*args)
    for replay in replays:
        got = replay(*args)
        assert [tuple(t.shape) for t in got] == [(1, 2, 3), (10, 1, 4), (10, 1, 8, 2)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(want[2][:, :, 3:], args[5])
    replays[1].release()


@pytest.mark.parametrize("P, written", [(30, 123), (20, 120), (5, 105), (3, 103), (2, 123), (0, 123)])
def test_a_replay_of_chunk_frames_writes_only_what_the_trim_keeps(cuda, P, written):
    """Given the stream's trim, a chunk-frames replay writes only the kept frames of the new
    cache (L=120, T=3: P + 100 of 123 once P < 23), graphed or not, when the chunk's frames lead
    them (P >= T); otherwise (P < T) it writes all 123 and Engine.run trims after. Either way
    the engine's cache is the whole solve's, trimmed."""
    from c2w.runtime.engines.aoti import EulerReplay
    from c2w.runtime.trim import CacheTrim

    def chunk(mu, spk, cond, x, cnn, att, s, dt):
        x_new = x + dt * (mu + cond + spk[..., None] * s)
        return x_new, cnn * 0.5 + s, x_new.transpose(1, 2) * s + att[:, :3].sum()

    def whole(*args):
        x_new, cnn, new = chunk(*args)
        return x_new, cnn, torch.cat([new, args[5]], dim=1)

    shapes = [(1, 2, 3), (1, 2), (1, 2, 3), (1, 2, 3), (1, 4), (1, 120, 2), (1,), (1,)]
    dtypes = [torch.float32] * 6 + [torch.int64, torch.float32]
    g = torch.Generator().manual_seed(4)
    args = [torch.randn(s, generator=g) for s in shapes[:4]] + [
        torch.randn(10, 1, 4, generator=g), torch.randn(10, 1, 120, 2, generator=g)]
    trim = CacheTrim(P)
    want = EulerReplay(whole, 10, CPU)(*args)
    want = want[:2] + (trim.apply(want[2]),)
    graphed = EulerReplay(CapturedCall(cuda.kernel(chunk), shapes, dtypes, CPU), 10, CPU, "chunk_frames")
    for replay in (EulerReplay(chunk, 10, CPU, "chunk_frames"), graphed):
        got = replay(*args, trim=trim)
        assert got[2].shape == (10, 1, written, 2)
        got = got[:2] + (trim.apply(got[2]),)                 # what AOTIEngine.run returns
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    graphed.release()


def _in_place_step(mu, spk, cond, x, cnn, s, dt, slots, *buffers):
    """A toy in-place Euler step (runtime.units.CFMStepUnit's form): the chunk's frames go into
    slots `slots` of each buffer, and x moves by the mean over ALL of a buffer's frames (order-free,
    as attention without a mask is)."""
    new = torch.stack([x, -x]).transpose(-1, -2) * (s + 1)          # (2, 1, T, 2): the chunk's frames
    for buffer in buffers:
        buffer.index_copy_(-2, slots, new)
    pull = sum(b.mean(dim=(0, 2)) for b in buffers)                  # (1, 2)
    return x + dt * (mu + cond + spk[..., None] * s + pull[..., None]), cnn * 0.5 + s


def _in_place_reference(mu, spk, cond, x0, cnn, att):
    """What the in-place step computes, upstream's way: each step's new cache = [chunk | input]."""
    from c2w.runtime.model.dit import euler_schedule
    _, dts = euler_schedule(10)
    x, cnns, atts = x0, [], []
    for s in range(10):
        new = torch.stack([x, -x]).transpose(-1, -2) * (s + 1)
        kv = torch.cat([new.unsqueeze(0).expand(att.shape[1], -1, -1, -1, -1), att[s]], dim=-2)
        pull = sum(block.mean(dim=(0, 2)) for block in kv)            # as the step sums
        x = x + dts[s] * (mu + cond + spk[..., None] * s + pull[..., None])
        cnns.append(cnn[s] * 0.5 + s)
        atts.append(kv)
    return x, torch.stack(cnns), torch.stack(atts)


def _in_place_replays(cuda, T, L):
    from c2w.runtime.engines.aoti import EulerReplay, step_graph_inputs
    # unit inputs: mu, spk, cond, x0 (B=1, 2 bins, T), cnn (10, 1, 4), att (10, depth 2, 2B=2, 1 head, L, 2)
    shapes, dtypes = step_graph_inputs([(1, 2, T), (1, 2), (1, 2, T), (1, 2, T), (10, 1, 4), (10, 2, 2, 1, L, 2)],
                                       [torch.float32] * 6)
    assert shapes[-2:] == [(T,), (2, 2, 1, T + L, 2)] and dtypes[-2:] == [torch.int64, torch.float32]
    graphed = CapturedCall(cuda.kernel(lambda *a: _in_place_step(*a[:-1], *a[-1].unbind(0))), shapes, dtypes, CPU)
    return {"plain": EulerReplay(_in_place_step, 10, CPU, "in_place"),
            "graphed": EulerReplay(graphed, 10, CPU, "in_place"),
            # the step ungraphed, resident rings solved by one graph each (runtime.engines.solve_graphs)
            "solve_graphs": EulerReplay(cuda.kernel(_in_place_step), 10, CPU, "in_place", solve_graphs=2)}


def _stream_inputs(g, T, L):
    return [torch.randn(s, generator=g) for s in ((1, 2, T), (1, 2), (1, 2, T), (1, 2, T), (10, 1, 4),
                                                   (10, 2, 2, 1, L, 2))]


@pytest.mark.parametrize("form", ["plain", "graphed", "solve_graphs"])
def test_an_in_place_step_replays_to_upstreams_cache_from_a_tensor(cuda, form):
    """Handed the cache as a tensor, the in-place replay lays it out after the chunk's T slots
    and returns the new cache as a tensor in upstream's order, graphed or not: exactly what the
    step computes upstream's way (the same sums in the same order)."""
    replay = _in_place_replays(cuda, 3, 5)[form]
    args = _stream_inputs(torch.Generator().manual_seed(3), 3, 5)
    got, want = replay(*args), _in_place_reference(*args)
    assert [tuple(t.shape) for t in got] == [(1, 2, 3), (10, 1, 4), (10, 2, 2, 1, 8, 2)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    replay.release()


@pytest.mark.parametrize("form", ["plain", "graphed", "solve_graphs"])
def test_an_in_place_replay_keeps_a_streams_cache_in_its_buffer(cuda, form):
    """A stream's chunks at its steady key (T=3, L=102: the trim keeps P + 100 = 102 frames),
    each handed the last one's ring. Chunk 0's ring fills its buffer (no slot free): the cache is
    laid out anew in T + L = 105 slots; from chunk 1 on, the trim has freed exactly T slots, the
    chunk writes its frames there and the ring keeps its buffer. Graphed per step, ungraphed, or
    with solve graphs (chunk 1 captures the whole solve over the buffer chunk 0 returned, chunks
    2 and 3 replay it on their own inputs), each chunk matches upstream's way fed its own trimmed
    cache (only the sums' order differs: rtol 1e-5, atol 1e-6)."""
    from c2w.runtime.ring import RingCache
    from c2w.runtime.trim import CacheTrim
    replay, trim = _in_place_replays(cuda, 3, 102)[form], CacheTrim(2)
    calls, captures = cuda.eager_calls, len(cuda.capture_modes)     # the per-step graph's, at its construction
    g = torch.Generator().manual_seed(4)
    *_, cnn, att = _stream_inputs(g, 3, 102)
    want_att, got_att, buffers = att, RingCache.of(att), []
    for chunk in range(4):
        mu, spk, cond, x0 = _stream_inputs(g, 3, 1)[:4]
        want = _in_place_reference(mu, spk, cond, x0, cnn, want_att)
        want_att = trim.apply(want[2])
        got = replay(mu, spk, cond, x0, cnn, got_att, trim=trim)
        got_att = got[2]
        assert isinstance(got_att, RingCache) and got_att.frames == want_att.shape[-2] == 102
        for a, b in zip(got[:2] + (got_att.logical(),), want[:2] + (want_att,)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        buffers.append(got_att.buffer)
        cnn = want[1]
    assert buffers[0].shape[-2] == 105 and buffers[0] is not att
    assert buffers[0] is buffers[1] is buffers[2] is buffers[3]
    if form == "solve_graphs":
        graph = replay.graphs.held(buffers[0])
        assert replay.graphs.captures == 1 and graph.graph.replays == 3
        assert cuda.eager_calls - calls == 20              # chunk 0's ten steps, the warm-up solve's ten
        assert cuda.capture_modes[captures:] == ["thread_local"]    # captured on a serving thread's call
    replay.release()


def test_the_cfm_replays_one_graph_per_euler_step(cuda):
    """AOTI's CFM: EulerReplay over ONE captured Euler step writes each step's outputs straight
    into the stacked caches, and matches the same step run without a graph on every input."""
    from c2w.runtime.engines.aoti import EulerReplay

    def step(mu, spk, cond, x, cnn, att, s, dt):
        x_new = x + dt * (mu + cond + spk[..., None] * s)
        return x_new, cnn * 0.5 + s, torch.cat([att, x_new.transpose(1, 2)], dim=1)

    shapes = [(1, 2, 3), (1, 2), (1, 2, 3), (1, 2, 3), (1, 4), (1, 5, 2), (1,), (1,)]
    dtypes = [torch.float32] * 6 + [torch.int64, torch.float32]
    graphed = EulerReplay(CapturedCall(cuda.kernel(step), shapes, dtypes, CPU), 10, CPU)
    plain = EulerReplay(step, 10, CPU)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        args = [torch.randn(s, generator=g) for s in shapes[:4]] + [
            torch.randn(10, 1, 4, generator=g), torch.randn(10, 1, 5, 2, generator=g)]
        got, want = graphed(*args), plain(*args)
        assert [tuple(t.shape) for t in got] == [(1, 2, 3), (10, 1, 4), (10, 1, 8, 2)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert graphed.step.graph.replays == 20 and graphed.step.pool.captured == 1
    graphed.release()
    assert graphed.step.pool.retired
