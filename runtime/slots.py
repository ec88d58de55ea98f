"""Resident stream state: every open stream's caches live in one slot of preallocated pools.

A `SlotPool` holds, for `capacity` streams, each tensor a `StreamState` carries between chunks,
with the batch axis replaced by the slot axis and every growing axis (cache frames) sized to its
largest length. Serving a batch of streams is then

    state = pool.gather(slots, lengths)   # one copy per field into an exact-shape StreamState
    driver.step(state, tokens)            # engines / eager, as for any batch
    pool.scatter(slots, state)            # one copy per field back into the streams' slots

so nothing of stream-cache size is allocated per stream, a full server fails at `acquire()` with
a clear error rather than out of memory, and a slot is reused as soon as its stream closes.
`copy(src, dst)` duplicates a slot (the server keeps set-up prompts, voices, in slots of their own).
The estimator caches stack the CFG halves on their batch axis ([conditional rows | unconditional
rows], runtime.model.dit); their pools keep the halves on an axis of their own, so a gather of
any set of slots is one `index_select` and the result reshapes to the 2B layout without a copy.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from c2w.runtime.errors import C2WUserError
from c2w.runtime.ring import RingCache
from c2w.runtime.stream import StreamState
from c2w.runtime.trim import KEEP_RECENT


@dataclass(frozen=True)
class Field:
    """How one StreamState tensor maps onto a pool."""
    name: str
    batch_dim: int             # the B (or 2B) axis in the StreamState tensor
    halves: bool               # the batch axis is 2B: [conditional | unconditional]
    length_dim: int | None     # the axis whose size varies per stream (cache frames), if any


FIELDS = (
    Field("spk", 0, False, None),
    Field("conformer_cnn", 0, False, None),
    Field("conformer_att", 1, False, 3),
    Field("estimator_cnn", 2, True, None),
    Field("estimator_att", 2, True, 4),
    Field("hift_mel", 0, False, 2),
    Field("hift_source", 0, False, 2),
    Field("hift_speech", 0, False, 1),
)
LENGTH_FIELDS = tuple(f.name for f in FIELDS if f.length_dim is not None)


class ServerFullError(C2WUserError):
    """Every slot is taken: the caller should retry later or close streams (backpressure)."""


def _pool_dim(f: Field, dim: int) -> int:
    """Axis `dim` of a StreamState tensor, in the pool's layout (halves add an axis before B)."""
    return dim + 1 if f.halves and dim >= f.batch_dim else dim


class SlotPool:
    """Preallocated device tensors for `capacity` streams whose prompts are at most
    `max_prompt_frames` mel frames, shaped after `template` (a B=1 StreamState from setup)."""

    def __init__(self, template: StreamState, capacity: int, max_prompt_frames: int,
                 hift_mel_frames: int, hift_source_samples: int):
        if capacity < 1:
            raise C2WUserError("max_streams", capacity, "at least 1")
        self.capacity = capacity
        limits = {"conformer_att": max_prompt_frames + KEEP_RECENT,
                  "estimator_att": max_prompt_frames + KEEP_RECENT,
                  "hift_mel": hift_mel_frames, "hift_source": hift_source_samples,
                  "hift_speech": hift_source_samples}
        self.pools: dict[str, torch.Tensor] = {}
        for f in FIELDS:
            t = getattr(template, f.name)
            shape = list(t.shape)
            if f.length_dim is not None:
                shape[f.length_dim] = limits[f.name]
            if f.halves:
                shape[f.batch_dim:f.batch_dim + 1] = [2, capacity]
            else:
                shape[f.batch_dim] = capacity
            self.pools[f.name] = torch.zeros(shape, dtype=t.dtype, device=t.device)
        self.limits = limits
        self._free = list(range(capacity - 1, -1, -1))
        self._lock = threading.Lock()
        self._indices: dict[tuple, torch.Tensor] = {}     # slot lists on the device, reused

    def _index(self, slots: list[int]) -> torch.Tensor:
        """The slot list as a device tensor; cached, since steady serving repeats the same lists
        and each new one is a host-to-device copy that waits for the device."""
        key = tuple(slots)
        idx = self._indices.get(key)
        if idx is None:
            if len(self._indices) >= 4096:
                self._indices.clear()
            idx = self._indices[key] = torch.tensor(slots, dtype=torch.long, device=self.pools["spk"].device)
        return idx

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools.values())

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise ServerFullError("stream server", f"{self.capacity} open streams",
                                      f"at most max_streams={self.capacity}",
                                      "Close finished streams, retry later, or start the server with more max_streams.")
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)

    @torch.inference_mode()
    def copy(self, src: int, dst: int) -> None:
        """Copy everything slot `src` holds into slot `dst` (a cached voice into a new stream)."""
        for f in FIELDS:
            pool = self.pools[f.name]
            d = _pool_dim(f, f.batch_dim)
            pool.select(d, dst).copy_(pool.select(d, src))

    @torch.inference_mode()
    def gather(self, slots: list[int], lengths: dict[str, int], prompt_frames: int,
               generators: list) -> StreamState:
        """An exact-shape StreamState for streams in `slots` (a slot may repeat: padding rows),
        `lengths`: the current size of each growing field (equal for every stream in a batch)."""
        idx = self._index(slots)
        out = {}
        for f in FIELDS:
            pool = self.pools[f.name]
            if f.length_dim is not None:
                pool = pool.narrow(_pool_dim(f, f.length_dim), 0, lengths[f.name])
            t = pool.index_select(_pool_dim(f, f.batch_dim), idx)
            if f.halves:
                t = t.flatten(f.batch_dim, f.batch_dim + 1)           # (.., 2, B, ..) -> (.., 2B, ..)
            out[f.name] = t
        return StreamState(prompt_frames=prompt_frames, generators=list(generators), **out)

    def lengths(self, state: StreamState) -> dict[str, int]:
        """The size of each growing field of `state`; refuses one its slots cannot hold."""
        out = {}
        for f in FIELDS:
            if f.length_dim is None:
                continue
            size = getattr(state, f.name).shape[f.length_dim]
            if size > self.limits[f.name]:
                raise C2WUserError(f"stream cache '{f.name}'", f"{size} frames",
                                   f"at most {self.limits[f.name]} (the server's max_prompt_frames + "
                                   f"{KEEP_RECENT})", "Serve streams whose caches are trimmed.")
            out[f.name] = size
        return out

    @torch.inference_mode()
    def scatter(self, slots: list[int], state: StreamState, rows: list[int] | None = None) -> dict[str, int]:
        """Write rows `rows` of `state` (default: the first len(slots)) into `slots`; returns the
        new lengths. Other rows (padding) are dropped. Every length is checked before anything is
        written, so a refused state leaves the slots as they were."""
        lengths = self.lengths(state)
        idx = self._index(slots)
        pick = None if rows is None else self._index(rows)
        for f in FIELDS:
            value, d = getattr(state, f.name), _pool_dim(f, f.batch_dim)
            pool = self.pools[f.name]
            if f.length_dim is not None:
                pool = pool.narrow(_pool_dim(f, f.length_dim), 0, lengths[f.name])
            # a ring's frames go to their places in upstream's order, one run of slots at a time
            parts = ([(pool.narrow(-2, frame, n), value.buffer.narrow(-2, slot, n)) for frame, slot, n in value.runs()]
                     if isinstance(value, RingCache) else [(pool, value)])
            for dst, t in parts:
                if f.halves:
                    t = t.unflatten(f.batch_dim, (2, t.shape[f.batch_dim] // 2))
                t = t.narrow(d, 0, len(slots)) if pick is None else t.index_select(d, pick)
                dst.index_copy_(d, idx, t)
        return lengths
