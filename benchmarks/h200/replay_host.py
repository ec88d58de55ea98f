"""The host-side cost of the CFM's ungraphed Euler replay (runtime.engines.aoti.EulerReplay), on the CPU.

A stand-in step returns preallocated outputs at once, and every tensor is tiny, so what is timed is
the replay's own Python and op dispatch: its output copies and allocations per solve, for a step
returning the whole attention cache (AOTI packages before the CFM's revision 3) or only the
chunk's frames (--chunk-frames, what the exporter builds since run 18):

    python benchmarks/h200/replay_host.py [--chunk-frames]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from c2w.runtime.engines.aoti import EulerReplay  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk-frames", action="store_true", help="the step returns only the chunk's frames")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    B, T, L, steps = 1, 1, 1, 10                      # (one block, one head, 8-wide rows: tiny on purpose)
    x = torch.zeros(B, 80, T)
    cnn = torch.zeros(1, 2 * B, 4, 2)
    att = torch.zeros(1, 2 * B, 1, T if a.chunk_frames else T + L, 8, dtype=torch.float16)
    step = lambda *args: (x, cnn, att)                                       # noqa: E731
    replay = (EulerReplay(step, steps, torch.device("cpu"), chunk_frames=True) if a.chunk_frames
              else EulerReplay(step, steps, torch.device("cpu")))
    inputs = [torch.zeros(B, 80, T), torch.zeros(B, 192), torch.zeros(B, 80, T), torch.zeros(B, 80, T),
              torch.zeros(steps, 1, 2 * B, 4, 2), torch.zeros(steps, 1, 2 * B, 1, L, 8, dtype=torch.float16)]
    for _ in range(5):
        replay(*inputs)
    t0 = time.perf_counter()
    for _ in range(a.reps):
        replay(*inputs)
    print(f"{'chunk frames' if a.chunk_frames else 'base'}: {(time.perf_counter() - t0) / a.reps * 1e6:.0f} us per solve")


if __name__ == "__main__":
    main()
