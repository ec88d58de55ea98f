"""One CUDA graph per resident ring: the whole in-place Euler solve of a CFM engine too large for
a graph per step, captured over a stream batch's own attention buffer.

At B=32 one Euler step's attention buffers are over a gigabyte, too much to copy into and out of
a per-step graph's static inputs (runtime.engines.aoti, GRAPH_MAX_BYTES), so each step runs as
the package's own call: the host launches the solve's ~3,900 kernels one by one, and the GPU
idles ~2 us between them (H200: 9.4 ms of a 65.7 ms solve). But a batch that stays together (the
server's resident batches, runtime.serving) hands the replay the ring it returned, chunk after
chunk, and that ring's buffer never moves (runtime.ring). One graph of the whole solve over THAT
buffer then serves every later chunk: its static inputs are the chunk's mu, spk, cond, x0, cnn
caches and free slots (90 MB with the outputs at B=32 T=150, not the buffer), and its steps
write the chunk's frames straight into the buffer's free slots. H200, B=32 T=150 L=400
(benchmarks/h200, run 24): 61.35 ms per solve against 65.70 as the package's own calls, the
same outputs bit for bit.

Policy (`SolveGraphs`): a buffer the replay returned in a ring (`returned`) and is handed back
with exactly T free slots gets a graph (`run`), captured lazily on that call, on that chunk's
own inputs: its warm-up solve writes only the free slots, which the chunk writes anyway. Each
step's x is copied into a buffer the graph owns before the next step reads it (the steps never
read what the package handed back: a 10-step graph that did followed only its capture's inputs,
docs/aoti.md). A graph is released when its buffer is freed, with the engine, and to make room
for another buffer's once it has not run for a while (`SolveGraphs`); a buffer whose capture
failed is solved step by step from then on. The graphs of one engine share a memory pool of
their own, not the backend's: a solve holding the backend's pool would hold up the small
graphed engines of other serving lanes for its whole 60 ms.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from c2w.runtime.engines.graphs import CapturedCall, GraphPool, release_between_captures

SOLVE_GRAPHS = 4        # graphs per engine at most: a B=32 key's resident batches (64 streams: 2)


@dataclass(eq=False)
class _Buffer:
    ref: weakref.ref                        # the ring's buffer, held weakly
    graph: CapturedCall | None = None
    failed: bool = False                    # its capture raised: solved step by step from then on
    used: int = 0                           # the replay's call count when it last ran


class SolveGraphs:
    """The whole-solve graphs of one in-place replay, keyed by the ring buffers they write.

    solve(buffer, mu, spk, cond, x0, cnn_cache, index) -> (x, new cnn caches): the replay's
    ungraphed solve over `buffer`, writing the chunk's frames into slots `index`; captured as it
    is. Not thread-safe, like the engine that owns it (the engine cache serialises its calls);
    only the release of a freed buffer's graph may be noted from another thread.

    With `limit` graphs held, a new buffer takes the place of the least recently used graph only
    if that graph has not run in the last 2 x limit calls; otherwise the new buffer is solved
    step by step. So more resident batches than `limit` served in turn keep `limit` graphs
    instead of capturing anew on every call (a capture costs a warm-up solve, and PyTorch
    synchronises the device and empties its cache when a capture begins)."""

    def __init__(self, solve: Callable, device: torch.device, limit: int = SOLVE_GRAPHS):
        if limit < 1:
            raise ValueError(f"limit={limit}: expected at least one graph")
        self.solve, self.device, self.limit = solve, device, limit
        self.pool: GraphPool | None = None
        self.captures = 0                   # graphs captured so far (released ones too)
        self.calls = 0                      # run() calls on buffers the replay returned
        self.replays = 0                    # solves from a graph (a capture's own call included)
        self.declined = 0                   # solved step by step: every graph in recent use
        self._buffers: OrderedDict[int, _Buffer] = OrderedDict()   # id(buffer) -> entry, least recent first
        self._freed: list[int] = []         # ids whose buffer was freed (appended by weakref callbacks)

    @property
    def live(self) -> int:
        """Graphs held now."""
        return sum(e.graph is not None for e in self._buffers.values())

    def returned(self, buffer: torch.Tensor) -> None:
        """The replay returned a ring over `buffer`: handed back, it gets a graph (`run`)."""
        self._sweep()
        key = id(buffer)
        entry = self._buffers.get(key)
        if entry is None or entry.ref() is not buffer:
            if entry is not None and entry.graph is not None:       # a dead buffer's, not swept yet
                release_between_captures([entry.graph])
            self._buffers[key] = _Buffer(weakref.ref(buffer, lambda _, k=key: self._freed.append(k)))
        self._buffers.move_to_end(key)
        self._forget_oldest()

    def run(self, buffer: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The solve over `buffer` from its graph (captured on this call if it has none yet):
        (x, new cnn caches); None for a buffer the replay has not returned, whose capture failed
        once, or that finds every graph in recent use (the caller solves it step by step).
        inputs: mu, spk, cond, x0, cnn caches, slot index, as every chunk of the key passes them
        (their shapes are the graph's). A capture that fails raises (the engine cache serves that
        call eagerly)."""
        self._sweep()
        entry = self._buffers.get(id(buffer))
        if entry is None or entry.ref() is not buffer or entry.failed:
            return None
        self.calls += 1
        entry.used = self.calls
        self._buffers.move_to_end(id(buffer))
        if entry.graph is None and not self._make_room():
            self.declined += 1
            return None
        if entry.graph is None:
            if self.pool is None or self.pool.retired:
                self.pool = GraphPool(self.device)
            ref = entry.ref
            entry.graph = CapturedCall(lambda *a: self.solve(ref(), *a), [tuple(t.shape) for t in inputs],
                                       [t.dtype for t in inputs], self.device, self.pool, warmups=1, lazy=True)
            self.captures += 1
        graph = entry.graph
        try:
            out = graph(*inputs)
            self.replays += 1
            return out
        except Exception:
            if not graph.captured:          # the capture failed: never again for this buffer
                entry.failed, entry.graph = True, None
                release_between_captures([graph])
            raise

    def counts(self) -> dict[str, int]:
        """captures, replays, declined (see __init__) and graphs held now."""
        return {"captures": self.captures, "replays": self.replays, "declined": self.declined, "held": self.live}

    def held(self, buffer: torch.Tensor) -> CapturedCall | None:
        """The graph held for `buffer` now, if any."""
        entry = self._buffers.get(id(buffer))
        return entry.graph if entry is not None and entry.ref() is buffer else None

    def _make_room(self) -> bool:
        """Whether a new graph may be captured: fewer than `limit` are held, or the least
        recently used one has not run in the last 2 x limit calls (it is released)."""
        held = [e for e in self._buffers.values() if e.graph is not None]
        if len(held) < self.limit:
            return True
        oldest = held[0]
        if self.calls - oldest.used <= 2 * self.limit:
            return False
        graph, oldest.graph = oldest.graph, None
        release_between_captures([graph])
        return True

    def _forget_oldest(self) -> None:
        """Remember at most 4 x limit buffers that hold no graph and did not fail: forget the
        least recently used."""
        plain = [key for key, e in self._buffers.items() if e.graph is None and not e.failed]
        for key in plain[:max(0, len(plain) - 4 * self.limit)]:
            del self._buffers[key]

    def _sweep(self) -> None:
        """Release the graphs of freed buffers (noted by their weakref callbacks)."""
        dropped = []
        while self._freed:
            key = self._freed.pop()
            entry = self._buffers.get(key)
            if entry is not None and entry.ref() is None:
                del self._buffers[key]
                if entry.graph is not None:
                    dropped.append(entry.graph)
        release_between_captures(dropped)

    def release(self) -> None:
        """Release every graph (the engine is being released). Idempotent."""
        graphs = [e.graph for e in self._buffers.values() if e.graph is not None]
        self._buffers.clear()
        self._freed.clear()
        release_between_captures(graphs)
