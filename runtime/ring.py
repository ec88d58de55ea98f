"""The estimator's attention cache as frames in the slots of a buffer, in any order.

The DiT's attention has no mask and no positions: its output does not depend on the order of its
keys. Only the trim (runtime.trim) keeps frames by their place in upstream's order. So a cache
can keep every frame where it was first written, and remember that order instead of following it:

    RingCache(buffer, order)   buffer (steps, depth, 2B, heads, S, 2 head_dim), frames on axis -2;
                               order[i] = the slot of frame i in upstream's order

Upstream's cache is `buffer.index_select(-2, order)` (`logical()`). A chunk of T frames writes
them into T free slots; the trim then only drops slots from `order`, and the dropped slots take
the next chunk's frames. AOTI's in-place Euler replay (runtime.engines.aoti.EulerReplay) serves a
stream this way: once the trim keeps as many frames as each chunk adds, a chunk moves no cache
frame, where the replay otherwise copies the kept cache into each new one (design note 21).
The buffer is T frames larger than upstream's trimmed cache: its S = T + L slots stay allocated.

A RingCache stands in for the tensor wherever a unit takes the CFM's attention cache (its
`shape` and `dtype` are the logical tensor's). What takes only tensors (eager units, ONNX Runtime,
TensorRT, the slot pool) gets `logical()`; a ring whose frames are in upstream's order and fill
its buffer is the buffer itself, without a copy.
"""
from __future__ import annotations

from typing import Sequence

import torch


class RingCache:
    def __init__(self, buffer: torch.Tensor, order: Sequence[int]):
        order = tuple(int(i) for i in order)
        S = buffer.shape[-2]
        if len(set(order)) != len(order) or any(not 0 <= i < S for i in order):
            raise ValueError(f"order must name distinct slots of the buffer's {S}; got {len(order)} "
                             f"slots in [{min(order, default=0)}, {max(order, default=0)}]")
        self.buffer, self.order = buffer, order

    @classmethod
    def of(cls, cache: "torch.Tensor | RingCache") -> "RingCache":
        """`cache` as a ring: a tensor's frames in their order, filling its buffer."""
        return cache if isinstance(cache, RingCache) else cls(cache, range(cache.shape[-2]))

    # the logical tensor's attributes, so that shape checks take a ring as they take the tensor
    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.buffer.shape[:-2], len(self.order), self.buffer.shape[-1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def frames(self) -> int:
        return len(self.order)

    def free(self) -> list[int]:
        """The slots that hold no frame of the cache, in increasing order."""
        used = set(self.order)
        return [i for i in range(self.buffer.shape[-2]) if i not in used]

    def runs(self) -> list[tuple[int, int, int]]:
        """The order as runs of consecutive slots: (first frame, first slot, length) each."""
        out: list[tuple[int, int, int]] = []
        for frame, slot in enumerate(self.order):
            if out and out[-1][1] + out[-1][2] == slot:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
            else:
                out.append((frame, slot, 1))
        return out

    def logical(self) -> torch.Tensor:
        """The cache in upstream's order: a view of the buffer where the order is one run of
        consecutive slots, else a copy (one per run: after a trim, a few)."""
        runs = self.runs()
        if len(runs) <= 1:
            return self.buffer.narrow(-2, runs[0][1] if runs else 0, self.frames)
        out = self.buffer.new_empty(self.shape)
        for frame, slot, length in runs:
            out.narrow(-2, frame, length).copy_(self.buffer.narrow(-2, slot, length))
        return out

    def kept(self, runs: Sequence[tuple[int, int]]) -> "RingCache":
        """The ring that keeps only the frames in `runs` ((start, length) in upstream's order,
        runtime.trim.CacheTrim.kept): the same buffer, no copy."""
        return RingCache(self.buffer, [i for start, length in runs for i in self.order[start:start + length]])

    def clone(self) -> "RingCache":
        """An independent copy, laid out as this one (so a copy of a stream's state still runs in place)."""
        return RingCache(self.buffer.clone(), self.order)

    def __repr__(self) -> str:
        return f"RingCache({self.frames} frames in {self.buffer.shape[-2]} slots, buffer {tuple(self.buffer.shape)})"


def logical(x):
    """A unit's input as the tensors-only code takes it: a ring's logical tensor, anything else as it is."""
    return x.logical() if isinstance(x, RingCache) else x
