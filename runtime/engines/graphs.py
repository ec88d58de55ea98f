"""CUDA graphs, for every backend: `GraphPool` (one memory pool several captures share, and what
makes sharing it safe) and `CapturedCall` (a function captured once with static input buffers,
then replayed per call).

Whether a backend captures an artifact is its policy (`Backend.cuda_graphs`, `Backend.graphed`);
how it captures is here. AOTInductor captures each graphed engine at load into the backend's
shared pool (for the CFM: ONE Euler step, runtime.engines.aoti says why), and an in-place CFM
engine too large for that captures the whole solve of each resident ring lazily, in a pool of its
own (runtime.engines.solve_graphs). TensorRT captures a key
on its first call and again whenever the backend's shared scratch memory moves (`generation`).
`c2w bench` times eager under one graph with a pool of its own.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Sequence

import torch

from c2w.runtime.units import copy_bytes


def as_list(out) -> list[torch.Tensor]:
    """A function's outputs as a list: one tensor, or a tuple/list of them."""
    return list(out) if isinstance(out, (list, tuple)) else [out]


class GraphPool:
    """One CUDA-graph memory pool shared by several captures, and what makes sharing it safe.

    Graphs in one pool reuse each other's intermediate memory, so their replays must never
    overlap: a replay (copy in, replay, hand the outputs back) holds `lock`, and waits on the GPU
    for the previous replay, whichever stream that ran on (no host sync).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.handle = torch.cuda.graph_pool_handle()
        self.lock = threading.Lock()
        self.done = torch.cuda.Event()
        self.used = False
        self.captured = 0               # captures attempted into this pool (failed ones too)
        self.live = 0                   # graphs captured and not yet released
        self._count_lock = threading.Lock()   # not `lock`: a finalizer may run while it is held

    @property
    def retired(self) -> bool:
        """Every graph of the pool is gone, so PyTorch has released the pool: capturing into the
        same handle again trips an internal assert (`use_count > 0`, seen on the H200 when the
        exporter verified a second key after releasing the first one's engine). Use a new pool."""
        return self.captured > 0 and self.live == 0

    def _added(self) -> None:
        with self._count_lock:
            self.live += 1

    def _dropped(self) -> None:
        with self._count_lock:
            self.live -= 1


_warmup_streams: dict[torch.device, torch.cuda.Stream] = {}
_capture_lock = threading.Lock()        # one capture at a time in the process, warm-ups included


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream every capture on `device` warms up on, whatever its pool (the caller
    holds `_capture_lock`). PyTorch gives cuBLAS a workspace per (handle, stream) it runs on and
    keeps it for the process's life (32 MiB on an H100/H200), and each new torch.cuda.Stream is the
    next of 32 pooled streams: a stream per capture cost each of the first 32 captures 32 MiB
    (docs/aoti.md). It is a high-priority stream: those come from a pool of their own, apart from
    the default-priority streams that serving lanes and PyTorch's capture stream are taken from,
    so another thread's work never lands on it."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _warmup_streams:
        _warmup_streams[device] = torch.cuda.Stream(device, priority=-1)
    return _warmup_streams[device]


class CapturedCall:
    """`fn(*static_inputs)` captured in one CUDA graph. A call copies its inputs into the static
    buffers, replays, and hands the outputs back: cloned (the default), copied into `out`, or, with
    `clone=False`, the static output buffers themselves (valid until the pool's next replay).

    Outputs are cloned by default because callers keep them (stream caches) while the next replay,
    for another stream, overwrites the static buffers.

    fn: called with the static input buffers; returns its outputs (a tensor or a sequence of
        them): tensors it allocates (they come from the pool during capture) or buffers it owns.
    shapes, dtypes: one per input, exactly what every call passes.
    pool: the pool to capture into; None: a pool of its own.
    warmups: calls of `fn` on a side stream before each capture (PyTorch's recipe: lazy
        initialisation and the allocator's first requests stay out of the graph).
    generation: what the capture baked in besides the static buffers, as a number that changes
        when it moves (TensorRT: the address of the backend's shared scratch memory); a call that
        sees another number captures again first. None: the capture never goes stale.
    lazy: capture on the first call (warming up on its inputs), not now (on zeros). A lazy
        capture runs on a serving thread while other threads may be running theirs, so it is
        captured in CUDA's thread-local mode: a call that is unsafe during a capture (cudaMalloc
        on an allocator miss) fails only on the capturing thread, not on every thread of the
        process as in the default global mode.
    """

    def __init__(self, fn: Callable, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype],
                 device: torch.device, pool: GraphPool | None = None, *, warmups: int = 2,
                 generation: Callable[[], int] | None = None, lazy: bool = False):
        self.fn, self.device, self.warmups, self.generation, self.lazy = fn, device, warmups, generation, lazy
        self.pool = pool or GraphPool(device)
        self.inputs = [torch.zeros(tuple(s), dtype=d, device=device) for s, d in zip(shapes, dtypes)]
        self.graph = None
        self.outputs: list[torch.Tensor] = []
        self._captured_at = None        # `generation()` when the graph was captured
        self._finalizer = None
        self._released = False
        if not lazy:
            with self.pool.lock:
                self._capture()

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _stale(self) -> bool:
        return self.graph is None or (self.generation is not None and self.generation() != self._captured_at)

    def _capture(self) -> None:
        """Warm up and capture from the static inputs as they are; the caller holds `pool.lock`.
        A stale graph is replaced only once its successor is captured: the pool keeps a live
        graph throughout, so it never retires between the two. Captures take turns process-wide
        (PyTorch captures on one stream of its own): a lazy capture on one serving thread never
        overlaps another's."""
        with _capture_lock:
            pool, device = self.pool, self.device
            side = warmup_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(self.warmups):
                    self.fn(*self.inputs)
            torch.cuda.current_stream(device).wait_stream(side)
            if pool.retired:
                raise RuntimeError("capture into a retired GraphPool (all its graphs were released); "
                                   "take a new pool (AOTIBackend.pool does)")
            at = self.generation() if self.generation is not None else None
            graph = torch.cuda.CUDAGraph()
            # counted before capturing: a capture that fails may still have registered the pool
            # with PyTorch, and a pool with no live graph must not be captured into again
            pool.captured += 1
            mode = "thread_local" if self.lazy else "global"
            with torch.cuda.graph(graph, pool=pool.handle, capture_error_mode=mode):
                outputs = as_list(self.fn(*self.inputs))
            self.graph, self.outputs, self._captured_at = graph, outputs, at
            if self._finalizer is None:
                pool._added()
                # the pool counts this object's graph as gone once it is collected or released
                self._finalizer = weakref.finalize(self, pool._dropped)

    def __call__(self, *inputs: torch.Tensor, out: Sequence[torch.Tensor] | None = None,
                 clone: bool = True) -> list[torch.Tensor]:
        """inputs: as `shapes`/`dtypes`. out: tensors to copy the outputs into (returned). clone:
        without `out`, return clones (True) or the static output buffers (False)."""
        if self._released:
            raise RuntimeError("this CapturedCall was released; capture the function again")
        pool = self.pool
        with pool.lock:
            stream = torch.cuda.current_stream(pool.device)
            if pool.used:
                stream.wait_event(pool.done)
            for dst, src in zip(self.inputs, inputs):
                dst.copy_(src)
            if self._stale():
                self._capture()
            self.graph.replay()
            if out is not None:
                for dst, src in zip(out, self.outputs):
                    copy_bytes(dst, src)
            else:
                out = [o.clone() for o in self.outputs] if clone else list(self.outputs)
            pool.done.record(stream)
            pool.used = True
        return out

    def release(self) -> None:
        """Drop the graph and its buffers; the pool counts the graph as gone (once). Idempotent."""
        self._released = True
        self.graph, self.inputs, self.outputs, self.fn = None, [], [], None
        if self._finalizer is not None:
            self._finalizer()


def release_between_captures(calls) -> None:
    """Release `calls` (CapturedCalls) while no capture runs in the process: for a serving thread
    that drops graphs while another thread may be capturing one (SolveGraphs)."""
    with _capture_lock:
        for call in calls:
            call.release()
