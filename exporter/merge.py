"""`c2w merge OUT SHARD_DIR...`: combine the artifact directories of sharded export jobs.

Shards must come from the same profile, model digest, backend version and device; each key is
taken from the shard that built it (an entry `built` anywhere wins over `pending`).

Each shard held the budget for its own keys only; the merge holds it for the whole: in plan
order, a built key is kept while the eager weights and engine state of the components in use
(once each) plus the kept keys' measured bytes fit the budget, and the rest are `over_budget`
(not copied). When every kept key was measured by its shard, the merged directory has not been
loaded together (`measured` is empty) and `c2w verify` measures it in a fresh process. When
some kept key was not (shards exported with `--measure-at-merge`, parallel on one GPU), the
merge measures on its device what an export measures while it builds: each built key in plan
order, loaded next to the ones kept before it, kept if it fits (budget.keep_by_measurement; docs/
budget.md). On a machine without that device it says so and leaves the measurement to `c2w verify`.
"""
from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Callable

import torch

from c2w.exporter.budget import Ledger, keep_by_measurement, remove_unused_artifacts
from c2w.runtime.atomic import atomic_output
from c2w.runtime.errors import C2WUserError
from c2w.runtime.manifest import MANIFEST, Entry, Manifest, Status, file_sha256, read_manifest, write_manifest
from c2w.runtime.memory import memory_kind

# What the shards of one export share (a profile and a model by digest: their paths may differ
# between the machines that ran the shards).
_SAME = ("profile.digest", "model.digest", "backend", "device", "precision", "torch_version")


@dataclass
class MergeResult:
    manifest: Manifest
    over_budget: list[Entry] = field(default_factory=list)      # by the shards' measurements
    measured_over: list[Entry] = field(default_factory=list)    # by the merge's own measurement (all)
    fresh_cut: list[Entry] = field(default_factory=list)        # of those, the ones the fresh process cut
    not_measured: str | None = None         # why the merge did not measure keys no shard measured
    measure_error: str | None = None


def merge_dirs(out: Path, shards: list[Path], on_measured: Callable[[int, int, Entry, Ledger], None] | None = None,
               on_cut: Callable[[Entry], None] | None = None) -> MergeResult:
    """Merge `shards` into `out` (the module docstring); `on_measured` and `on_cut` are
    budget.keep_by_measurement's `on_key` (after each key the merge measures) and `on_cut` (after
    each key the fresh-process measurement cuts)."""
    if not shards:
        raise C2WUserError("c2w merge", "no shard directories", "one or more directories written by c2w export")
    shards = [Path(s) for s in shards]
    missing = [s for s in shards if not (s / MANIFEST).is_file()]
    for s in missing:            # a shard killed before its first key: nothing to take from it
        print(f"c2w merge: skipping '{s}' (no {MANIFEST})")
    shards = [s for s in shards if s not in missing]
    if not shards:
        raise C2WUserError("c2w merge", f"no shard directory with a {MANIFEST}", "at least one")
    manifests = [read_manifest(s) for s in shards]
    base = manifests[0]
    for s, m in zip(shards[1:], manifests[1:]):
        for f in _SAME:
            a, b = attrgetter(f)(base), attrgetter(f)(m)
            if a != b:
                raise C2WUserError(f"shard '{s}' {f}", repr(b), f"{a!r} (as in '{shards[0]}')",
                                   "Merge only shards of one export (same profile, model, backend, device).")
    rank = {Status.BUILT: 0, Status.FAILED: 1, Status.UNSUPPORTED: 2, Status.OVER_BUDGET: 3, Status.SKIPPED_BUDGET: 4,
            Status.PENDING: 5}
    best: dict[str, tuple] = {}
    for s, m in zip(shards, manifests):
        for e in m.entries:
            if e.id not in best or rank[e.status] < rank[best[e.id][1].status]:
                best[e.id] = (s, e)
    out = Path(out)
    shared_state: dict[str, int] = {}          # the same state in every shard: the largest measurement
    for m in manifests:
        for comp, n in m.engine_shared_bytes.items():
            shared_state[comp] = max(n, shared_state.get(comp, 0))
    ledger = Ledger(base.budget_bytes, dict(base.weight_bytes), shared_state)
    merged = dataclasses.replace(base, entries=[], shared={}, engine_shared_bytes=shared_state, measured=None)
    files = {k: v for m in manifests for k, v in m.shared.items()}
    for s, e in (best[e.id] for e in base.entries if e.id in best):
        if e.status == Status.BUILT and e.device_bytes is not None and not ledger.fits(e.component, e.device_bytes):
            e.status, e.error = Status.OVER_BUDGET, f"c2w merge: {ledger.over_budget_reason(e)}"
        if e.status == Status.BUILT:
            ledger.keep(e)
            weights = e.extra.get("weights_files", [])                  # ONNX Runtime's shared weights
            if Path(s).resolve() != out.resolve():
                for rel in [e.artifact, *weights]:
                    _copy(s / rel, out / rel)
            merged.shared.update({rel: files[rel] for rel in weights})
        merged.entries.append(e)
    result = MergeResult(merged, [e for e in merged.entries if e.status == Status.OVER_BUDGET])
    remove_unused_artifacts(out, merged, result.over_budget)   # merging into a shard's own directory
    write_manifest(out, merged)
    device = torch.device("cpu" if merged.device == "cpu" else "cuda")
    if any(e.status == Status.BUILT and (e.device_bytes is None or e.memory_kind != memory_kind(device))
           for e in merged.entries):
        if device.type == "cuda" and not torch.cuda.is_available():
            result.not_measured = (f"built on '{merged.device}' and this machine has no CUDA: run c2w verify on the GPU "
                                   "machine, which measures the directory")
        else:
            over, result.fresh_cut, result.measure_error = keep_by_measurement(out, merged, device, on_measured,
                                                                                on_cut)
            result.measured_over = over + result.fresh_cut
            write_manifest(out, merged)
    return result


def _copy(src: Path, dst: Path) -> None:
    """Copy one file atomically (a TensorRT plan shared by several entries is copied once)."""
    if dst.is_file() and dst.stat().st_size == src.stat().st_size and file_sha256(dst) == file_sha256(src):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(dst) as tmp:
        shutil.copy2(src, tmp)
