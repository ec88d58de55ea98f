"""How well the planner's AOTInductor-on-CUDA estimate (exporter/estimate.py) predicts a measured sweep.

Replays the manifest's keys in the manifest's order (the order its measurement loaded them: plan
order) through the estimate's graph-pool model: each measured key is estimated next to the
measured keys before it and then added; a key without a measurement (pending, failed) gets the
estimate it would have there and is not added (it was not loaded). Prints per key: measured and
estimated MiB, their ratio, and whether the estimate is within the bar (TOL of the measurement or
FLOOR MiB, whichever is more: a measurement is in 2 MiB pages, and a key whose static inputs share a
20 MiB allocator segment with what came before can read 0); then the count within the bar and,
per component, the estimate's and the measurement's sums.

With --beyond-own it prints instead, for each measured key captured in a CUDA graph, in load
order, what it held outside the graph pool (`extra.memory_split`: allocated + outside the
allocator) less the estimate's own part of it (package, static buffers, HiFT's constants): the
~32 MiB cuBLAS workspace a new warm-up stream cost the first 32 captures shows there (docs/aoti.md).

With --stream-workspace-mib W the replay adds W MiB to each of the first --stream-captures
captured keys (default 30): what a measurement taken before the captures shared one warm-up
stream (`d970cfe`) held besides what the estimate models (runs 10, 11, 13a: W = 32).

Usage: python benchmarks/h200/estimate_fit.py benchmarks/h200/results/run10_sweep/manifest.json
       [--tolerance 0.15] [--floor-mib 8] [--beyond-own] [--stream-workspace-mib 32 [--stream-captures 30]]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from c2w.exporter.estimate import GraphPoolSizes, key_cost
from c2w.runtime.manifest import read_manifest
from c2w.runtime.model.config import preset
from c2w.runtime.verify import entry_key

MIB = 1 << 20


def replay(manifest, stream_workspace: int = 0, stream_captures: int = 30) -> list[tuple[object, int]]:
    """(entry, estimated bytes) in manifest order; only measured entries join the simulated load.
    stream_workspace: bytes added to each of the first `stream_captures` captured keys loaded."""
    cfg, weights = preset(manifest.model.config), dict(manifest.weight_bytes)
    pool = GraphPoolSizes(cfg, weights)
    out, captures = [], 0
    for e in manifest.entries:
        key = entry_key(e)
        est = pool.add(key) if e.device_bytes is not None else pool.cost(key)
        if stream_workspace and e.device_bytes is not None and key_cost(cfg, key, weights).captured:
            captures += 1
            est += stream_workspace if captures <= stream_captures else 0
        out.append((e, est))
    return out


def beyond_own(manifest) -> None:
    cfg, weights, n = preset(manifest.model.config), dict(manifest.weight_bytes), 0
    print(f"{'capture':>7s}  {'key':44s} {'held outside the pool - own, MiB':>33s}")
    for e in manifest.entries:
        split = (e.extra or {}).get("memory_split")
        cost = key_cost(cfg, entry_key(e), weights)
        if e.device_bytes is None or not split or not cost.captured:
            continue
        n += 1
        held = split.get("allocated", 0) + split.get("outside", 0)
        print(f"{n:7d}  {e.id:44s} {(held - cost.own) / MIB:33.1f}")


def within(est: int, measured: int, tolerance: float, floor: int) -> bool:
    return abs(est - measured) <= max(tolerance * measured, floor)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("manifest", type=Path, help="a manifest.json or the directory holding it")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--floor-mib", type=float, default=8.0)
    ap.add_argument("--beyond-own", action="store_true", help="per captured key: held outside the pool - own")
    ap.add_argument("--stream-workspace-mib", type=float, default=0.0)
    ap.add_argument("--stream-captures", type=int, default=30)
    a = ap.parse_args(argv)
    m = read_manifest(a.manifest.parent if a.manifest.is_file() else a.manifest)
    if a.beyond_own:
        beyond_own(m)
        return 0
    floor = int(a.floor_mib * MIB)
    print(f"{'key':44s} {'measured':>9s} {'estimate':>9s} {'ratio':>6s}  within")
    ok = n = 0
    sums: dict[str, list[int]] = {}
    for e, est in replay(m, int(a.stream_workspace_mib * MIB), a.stream_captures):
        if e.device_bytes is None:
            print(f"{e.id:44s} {'-':>9s} {est / MIB:9.1f} {'':>6s}  ({e.status.value}, not loaded)")
            continue
        good = within(est, e.device_bytes, a.tolerance, floor)
        n, ok = n + 1, ok + good
        s = sums.setdefault(e.component, [0, 0, 0, 0])
        s[0], s[1], s[2], s[3] = s[0] + est, s[1] + e.device_bytes, s[2] + good, s[3] + 1
        ratio = f"{est / e.device_bytes:6.2f}" if e.device_bytes else f"{'-':>6s}"
        print(f"{e.id:44s} {e.device_bytes / MIB:9.1f} {est / MIB:9.1f} {ratio}  {'yes' if good else 'NO'}")
    print(f"\n{ok} of {n} measured keys within {a.tolerance:.0%} or {a.floor_mib:g} MiB")
    for comp, (est, meas, good, count) in sums.items():
        print(f"  {comp:13s} {good:3d} of {count:3d} within; estimate {est / MIB:9.1f} MiB, "
              f"measured {meas / MIB:9.1f} MiB ({est / meas - 1:+.1%})")
    est, meas = sum(v[0] for v in sums.values()), sum(v[1] for v in sums.values())
    print(f"  {'all':13s} {ok:3d} of {n:3d} within; estimate {est / MIB:9.1f} MiB, measured {meas / MIB:9.1f} MiB "
          f"({est / meas - 1:+.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
