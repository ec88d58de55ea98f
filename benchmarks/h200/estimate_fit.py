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

With --fit it searches the estimate's constants (exporter.estimate.PoolModel) for the most keys
within the bar over every manifest given (ties: the smaller summed log error): one constant at a
time over a grid of factors until no change helps, then again from seeded random perturbations of
the best; it prints the table for the fitted constants and the dataclass to paste into
exporter/estimate.py as FITTED (a minute or two on one core).

A manifest given as PATH@W (or every manifest, with --stream-workspace-mib W) is replayed with W MiB
added to each of its first 30 captured keys: what a measurement taken before the captures shared
one warm-up stream (`d970cfe`) held besides what the estimate models (runs 10, 11, 13a: W = 32).

Usage: python benchmarks/h200/estimate_fit.py benchmarks/h200/results/run14_sweep [MANIFEST[@W] ...]
       [--tolerance 0.15] [--floor-mib 8] [--beyond-own] [--fit] [--stream-workspace-mib W]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
from pathlib import Path

from c2w.exporter.estimate import FITTED, GraphPoolSizes, PoolModel, key_cost
from c2w.runtime.manifest import read_manifest
from c2w.runtime.model.config import preset
from c2w.runtime.verify import entry_key

MIB = 1 << 20


def built_form(entry) -> str | None:
    """The form a measured CFM key's step was built in (its manifest extra; sweeps before the
    chunk-frames step record none: the step that returned its whole cache)."""
    return (entry.extra or {}).get("step_att", "whole") if entry.component == "cfm" else None


def replay(manifest, stream_workspace: int = 0, stream_captures: int = 30,
           model: PoolModel = FITTED) -> list[tuple[object, int]]:
    """(entry, estimated bytes) in manifest order; only measured entries join the simulated load.
    stream_workspace: bytes added to each of the first `stream_captures` captured keys loaded."""
    cfg, weights = preset(manifest.model.config), dict(manifest.weight_bytes)
    pool = GraphPoolSizes(cfg, weights, model=model)
    out, captures = [], 0
    for e in manifest.entries:
        key, form = entry_key(e), built_form(e)
        est = pool.add(key, form) if e.device_bytes is not None else pool.cost(key, form)
        if stream_workspace and e.device_bytes is not None and key_cost(cfg, key, weights, model, form).captured:
            captures += 1
            est += stream_workspace if captures <= stream_captures else 0
        out.append((e, est))
    return out


def beyond_own(manifest) -> None:
    cfg, weights, n = preset(manifest.model.config), dict(manifest.weight_bytes), 0
    print(f"{'capture':>7s}  {'key':44s} {'held outside the pool - own, MiB':>33s}")
    for e in manifest.entries:
        split = (e.extra or {}).get("memory_split")
        cost = key_cost(cfg, entry_key(e), weights, step_att=built_form(e))
        if e.device_bytes is None or not split or not cost.captured:
            continue
        n += 1
        held = split.get("allocated", 0) + split.get("outside", 0)
        print(f"{n:7d}  {e.id:44s} {(held - cost.own) / MIB:33.1f}")


def within(est: int, measured: int, tolerance: float, floor: int) -> bool:
    return abs(est - measured) <= max(tolerance * measured, floor)


def score(sweeps, model: PoolModel, tolerance: float, floor: int) -> tuple[int, float]:
    """(keys within the bar, minus the summed |log| of estimate over measurement, floor added to both)
    over `sweeps`: (manifest, stream workspace bytes) pairs, each replayed as `replay` does."""
    good, err = 0, 0.0
    for m, workspace in sweeps:
        for e, est in replay(m, workspace, model=model):
            if e.device_bytes is not None:
                good += within(est, e.device_bytes, tolerance, floor)
                err += abs(math.log((est + floor) / (e.device_bytes + floor)))
    return good, -err


FACTORS = (0.5, 0.7, 0.8, 0.9, 0.95, 1.05, 1.1, 1.25, 1.4, 2.0)


def scaled(model: PoolModel, name: str, factor: float, dtypes: set[str]) -> PoolModel:
    """`model` with one constant scaled by `factor` (hift_blocks: one more or one fewer; hift_workspace:
    the entries of `dtypes`, the HiFT dtypes the manifests measured)."""
    v = getattr(model, name)
    if name == "hift_blocks":
        v = max(1, v + (1 if factor > 1 else -1))
    elif name == "hift_workspace":
        v = tuple((d, round(n * factor) if d in dtypes else n) for d, n in v)
    else:
        v = v * factor if isinstance(v, float) else round(v * factor)
    return dataclasses.replace(model, **{name: v})


def fit(sweeps, start: PoolModel, tolerance: float, floor: int, restarts: int = 30, seed: int = 0) -> PoolModel:
    """The best of a coordinate search from `start` and of `restarts` more, each from the best so
    far with about half its constants scaled at random (seeded: the same manifests give the same
    fit). The score has steps (a block holds a tensor or not), so one search stops at the first
    constants no single change improves."""
    dtypes = {e.dtype for m, _ in sweeps for e in m.entries if e.component == "hift"}
    rng = random.Random(seed)
    best = search(sweeps, start, tolerance, floor, dtypes)
    best_score = score(sweeps, best, tolerance, floor)
    for _ in range(restarts):
        cand = best
        for f in dataclasses.fields(PoolModel):
            if rng.random() < 0.5:
                cand = scaled(cand, f.name, rng.choice((0.5, 0.7, 0.85, 1.2, 1.4, 2.0)), dtypes)
        cand = search(sweeps, cand, tolerance, floor, dtypes)
        s = score(sweeps, cand, tolerance, floor)
        if s > best_score:
            best, best_score = cand, s
    return best


def search(sweeps, start: PoolModel, tolerance: float, floor: int, dtypes: set[str], rounds: int = 8) -> PoolModel:
    """Coordinate search: each constant in turn over FACTORS, keeping any change that scores higher."""
    best, best_score = start, score(sweeps, start, tolerance, floor)
    for _ in range(rounds):
        before = best_score
        for f in dataclasses.fields(PoolModel):
            for factor in FACTORS:
                cand = scaled(best, f.name, factor, dtypes)
                s = score(sweeps, cand, tolerance, floor)
                if s > best_score:
                    best, best_score = cand, s
        if best_score == before:
            break
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("manifest", nargs="+", help="manifest.json files or the directories holding them; PATH@W: "
                    "that sweep was measured before the shared warm-up stream, replay it with W MiB on its first "
                    "captured keys (as --stream-workspace-mib)")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--floor-mib", type=float, default=8.0)
    ap.add_argument("--beyond-own", action="store_true", help="per captured key: held outside the pool - own")
    ap.add_argument("--fit", action="store_true", help="fit the estimate's constants to the manifests")
    ap.add_argument("--stream-workspace-mib", type=float, default=0.0, help="W for manifests given without @W")
    a = ap.parse_args(argv)
    sweeps = [sweep(arg, a.stream_workspace_mib) for arg in a.manifest]
    floor, model = int(a.floor_mib * MIB), FITTED
    if a.fit:
        model = fit(sweeps, FITTED, a.tolerance, floor)
        print(f"fitted: {model}\n")
    for arg, (m, workspace) in zip(a.manifest, sweeps):
        if a.beyond_own:
            beyond_own(m)
        else:
            print(f"{arg}:")
            table(m, workspace, a, floor, model)
    return 0


def sweep(arg: str, default_mib: float) -> tuple[object, int]:
    """'PATH[@W]' -> (its manifest, W MiB of stream workspace in bytes)."""
    path, _, mib = arg.partition("@")
    p = Path(path)
    return read_manifest(p.parent if p.is_file() else p), int(float(mib or default_mib) * MIB)


def table(m, workspace: int, a, floor: int, model: PoolModel) -> None:
    print(f"{'key':44s} {'measured':>9s} {'estimate':>9s} {'ratio':>6s}  within")
    ok = n = 0
    sums: dict[str, list[int]] = {}
    for e, est in replay(m, workspace, model=model):
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
          f"({est / meas - 1:+.1%})\n")


if __name__ == "__main__":
    raise SystemExit(main())
