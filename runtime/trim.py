"""Upstream's trim of a growing attention cache: once it passes P + 100 frames, keep its first P
frames and its last 100.

Both attention caches hold their frames on axis -2: the conformer's (layers, B, heads, C, 2 d_k)
and the estimator's (steps, depth, 2B, heads, L, 2 head_dim). `CacheTrim.kept(n)` says which
frames of an n-frame cache survive; `apply` copies them into a new tensor, or, for a cache held
as a runtime.ring.RingCache (AOTI's in-place Euler replay), drops the others from its order
without a copy. An engine that writes the cache itself can write only the kept frames (AOTI's
chunk-frames replay, runtime/engines/aoti.py), so the trim costs no copy of its own; `apply` on a
cache trimmed already returns it unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from c2w.runtime.ring import RingCache
from c2w.runtime.units import copy_bytes

KEEP_RECENT = 100     # frames kept after the prompt when a cache is trimmed


@dataclass(frozen=True)
class CacheTrim:
    prompt_frames: int                                  # P

    def kept(self, n: int) -> list[tuple[int, int]]:
        """(start, length) of each run of frames an n-frame cache keeps, in order: all of it
        within P + 100 frames, else its first P and its last 100."""
        P = self.prompt_frames
        if n <= P + KEEP_RECENT:
            return [(0, n)]
        return [(0, P), (n - KEEP_RECENT, KEEP_RECENT)] if P else [(n - KEEP_RECENT, KEEP_RECENT)]

    def apply(self, cache: torch.Tensor | RingCache) -> torch.Tensor | RingCache:
        """The kept frames of `cache` (frames on axis -2): `cache` itself when it keeps them all,
        a ring's own buffer with the others dropped from its order (RingCache.kept),
        else a new tensor written by one copy per run, through 8-byte views where the rows allow
        them (a strided copy of fp16 values ran at ~1.8 TB/s on the H200, the same bytes as int64
        at ~3.9 TB/s, near a contiguous copy's 4.3: benchmarks/h200/README.md, run 14). Bytes are
        copied, not values."""
        runs = self.kept(cache.shape[-2])
        if len(runs) == 1 and runs[0][0] == 0:
            return cache
        if isinstance(cache, RingCache):
            return cache.kept(runs)
        shape = list(cache.shape)
        shape[-2] = sum(length for _, length in runs)
        out, at = cache.new_empty(shape), 0
        for start, length in runs:
            copy_bytes(out.narrow(-2, at, length), cache.narrow(-2, start, length))
            at += length
        return out


def trim_last(outputs: Sequence[torch.Tensor], trim: CacheTrim | None) -> list[torch.Tensor]:
    """A unit's outputs with the last one, its attention cache, trimmed (None: as they are)."""
    outputs = list(outputs)
    if trim is not None:
        outputs[-1] = trim.apply(outputs[-1])
    return outputs
