"""How well two engine calls overlap on one GPU when two lanes run them at the same time.

For pairs of CFM keys of an artifact directory (e.g. a B=1 first chunk beside a B=8 or B=32
steady batch): each key alone, then both at once from two threads, each thread with engine
instances of its own (`EngineCache.replica`) on a CUDA stream of its own, which is what the
stream server's `lanes=2` does; then both at once again with the first key's thread on a
high-priority CUDA stream. Prints a line per pair and writes JSON.

    python benchmarks/serving/overlap.py /tmp/art/all --out overlap.json
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from c2w import runtime
from c2w.runtime.units import SPECS, ShapeKey

PAIRS = [("cfm", (1, 50, 300), (1, 50, 400)), ("cfm", (1, 50, 300), (8, 50, 400)),
         ("cfm", (1, 50, 300), (32, 150, 400)), ("cfm", (8, 50, 300), (8, 50, 400))]


def timed_calls(cache, key: ShapeKey, inputs, seconds: float, stream, barrier, out: list) -> None:
    """Call `key` back to back (each call waited for, as a lane does) for `seconds`."""
    with torch.cuda.stream(stream), torch.inference_mode():
        cache.run(key, inputs)                              # warm
        stream.synchronize()
        barrier.wait()
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < seconds:
            cache.run(key, inputs)
            stream.synchronize()
            n += 1
        out.append((time.perf_counter() - t0) / n * 1e3)


def measure(caches, keys, inputs, seconds: float, priorities=(0, 0)) -> list[float]:
    """Mean ms per call of each key, the keys' threads running over the same window, each on a
    stream of the given priority (lower is more urgent; CUDA offers 0 and -1 or below)."""
    barrier, results = threading.Barrier(len(keys)), [[] for _ in keys]
    threads = [threading.Thread(target=timed_calls,
                                args=(c, k, x, seconds, torch.cuda.Stream(priority=p), barrier, r))
               for c, k, x, r, p in zip(caches, keys, inputs, results, priorities)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r[0] for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts")
    ap.add_argument("--seconds", type=float, default=1.5, help="window per measurement")
    ap.add_argument("--out", default="overlap.json")
    a = ap.parse_args()
    rt = runtime.load(a.artifacts)
    cfg, twin = rt.model.cfg, rt.cache.replica()
    built = set(rt.cache.keys)
    rows = []
    for comp, d1, d2 in PAIRS:
        k1, k2 = ShapeKey(comp, d1, "float16"), ShapeKey(comp, d2, "float16")
        if not {k1, k2} <= built:
            print(f"skip {k1.id} + {k2.id}: not built")
            continue
        x1 = SPECS[comp].example_inputs(cfg, k1, device="cuda")
        x2 = SPECS[comp].example_inputs(cfg, k2, device="cuda")
        alone1 = measure([rt.cache], [k1], [x1], a.seconds)[0]
        alone2 = measure([twin], [k2], [x2], a.seconds)[0]
        both = measure([rt.cache, twin], [k1, k2], [x1, x2], a.seconds)
        urgent = measure([rt.cache, twin], [k1, k2], [x1, x2], a.seconds, priorities=(-1, 0))
        # work done together per unit time, in units of one key alone: 1 = no better than taking
        # turns, 2 = each runs as fast as alone
        rows.append({"a": k1.id, "b": k2.id, "alone_ms": [alone1, alone2], "together_ms": both,
                     "throughput_vs_turns": alone1 / both[0] + alone2 / both[1],
                     "together_first_urgent_ms": urgent,
                     "throughput_vs_turns_first_urgent": alone1 / urgent[0] + alone2 / urgent[1]})
        print(f"{k1.id} {alone1:.1f} ms, {k2.id} {alone2:.1f} ms alone; together {both[0]:.1f} / {both[1]:.1f} ms "
              f"= {rows[-1]['throughput_vs_turns']:.2f} (1: no gain, 2: perfect overlap); first on a high-priority "
              f"stream {urgent[0]:.1f} / {urgent[1]:.1f} ms = {rows[-1]['throughput_vs_turns_first_urgent']:.2f}", flush=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seconds": a.seconds, "pairs": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    twin.release()
    rt.release()


if __name__ == "__main__":
    main()
