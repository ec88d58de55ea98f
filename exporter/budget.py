"""The memory budget's arithmetic, in one place for export, merge, verify and report.

A directory costs the eager weights of every component it has a key for (counted once), the
state a backend shares across one component's engines (counted once: ONNX Runtime's copy of the
weights), and each kept key's own resident bytes, all as measured by runtime.memory. The budget
holds when that total is at most `budget_bytes` (docs/budget.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from c2w.runtime import memory
from c2w.runtime.manifest import Entry, FailedMeasurement, Manifest, Measurement, Status, write_manifest

# Two measurements of the same directory in fresh processes differ by about 0.1 % on a quiet CPU
# (docs/budget.md), and by up to 1.1 MiB beside other test processes: part of the noise is
# absolute (allocator arenas, thread stacks), 2.4 % of a 47 MiB test directory. `c2w verify`
# re-measures and allows measurement_slack(budget) over the budget before failing, so that a
# directory the export left just under its budget does not fail on the noise. The export itself
# and `c2w merge` hold the budget exactly.
MEASURE_TOLERANCE = 0.02
MEASURE_FLOOR_BYTES = 2 * 2**20


def measurement_slack(total: int | float) -> float:
    """Bytes by which two measurements of a directory of `total` bytes may differ."""
    return max(MEASURE_TOLERANCE * total, MEASURE_FLOOR_BYTES)


def mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


@dataclass
class Ledger:
    """The running total of kept keys against the budget."""
    budget: int
    weight_bytes: dict[str, int]                                  # eager weights per component
    shared: dict[str, int] = field(default_factory=dict)          # engine-shared bytes per component
    kept: dict[str, tuple[str, int]] = field(default_factory=dict)   # key id -> (component, own bytes)

    def components(self) -> set[str]:
        return {c for c, _ in self.kept.values()}

    def fixed(self, component: str) -> int:
        """What the first kept key of `component` brings besides its own bytes."""
        return self.weight_bytes.get(component, 0) + self.shared.get(component, 0)

    def total(self) -> int:
        return sum(self.fixed(c) for c in self.components()) + sum(n for _, n in self.kept.values())

    def cost(self, component: str, nbytes: int) -> int:
        """What keeping one more key of `component` with `nbytes` of its own adds to the total."""
        return nbytes + (0 if component in self.components() else self.fixed(component))

    def fits(self, component: str, nbytes: int) -> bool:
        return self.total() + self.cost(component, nbytes) <= self.budget

    def keep(self, entry: Entry, nbytes: int | None = None) -> None:
        """Count `entry` as kept, at `nbytes` (default: its measured bytes)."""
        self.kept[entry.id] = (entry.component, (entry.device_bytes or 0) if nbytes is None else nbytes)

    def over_budget_reason(self, entry: Entry) -> str:
        """Why `entry` is not kept, for its manifest `error`."""
        extra = self.cost(entry.component, entry.device_bytes or 0)
        what = f"its {mib(entry.device_bytes)} MiB"
        if extra != entry.device_bytes:
            what += f" + {mib(extra - (entry.device_bytes or 0))} MiB of {entry.component} weights and engine state"
        return (f"over budget: {what} on the {mib(self.total())} MiB kept would make {mib(self.total() + extra)} "
                f"MiB, budget {mib(self.budget)} MiB")

    def parts(self) -> str:
        comps = self.components()
        return (f"weights {mib(sum(self.weight_bytes.get(c, 0) for c in comps))} + engine state "
                f"{mib(sum(self.shared.get(c, 0) for c in comps))} + {len(self.kept)} keys "
                f"{mib(sum(n for _, n in self.kept.values()))} MiB")


def record_load(entry: Entry, got: dict) -> None:
    """Keep on `entry.extra` what its load into a measurement process showed (`MeasureProcess.add`'s
    reply): "load_seconds" (its load and first run) and, on CUDA, "memory_split" (its bytes as
    PyTorch-allocated, graph pool and outside the allocator: what the planner's estimate is fitted to)."""
    split = {part: got[part] for part in ("allocated", "pool", "outside") if part in got}
    entry.extra = {**(entry.extra or {}), "load_seconds": got["seconds"], **({"memory_split": split} if split else {})}


def recorded_ledger(m: Manifest) -> tuple[Ledger, list[str]]:
    """The manifest's built entries as the export measured them, and the ids of built entries
    with no measurement (written by a c2w before the budget was measured)."""
    led = Ledger(m.budget_bytes, dict(m.weight_bytes), dict(m.engine_shared_bytes))
    unmeasured = []
    for e in m.entries:
        if e.status == Status.BUILT:
            led.keep(e)
            if e.device_bytes is None:
                unmeasured.append(e.id)
    return led, unmeasured


def overrun(what: str, total: int, budget: int, parts: str) -> str:
    return (f"over budget: {what} {mib(total)} MiB ({parts}), budget {mib(budget)} MiB: {mib(total - budget)} MiB "
            "over")


def fit_by_measurement(out_dir: Path, manifest: Manifest, device: torch.device, got: dict | None = None,
                       on_cut: Callable[[Entry], None] | None = None) -> tuple[list[Entry], str | None]:
    """Hold the budget for the directory's built keys as they measure loaded together in a fresh
    process (`got`: such a measurement of exactly them, when one was already taken). While the
    total is over the budget, the key that takes it over becomes `over_budget`, its artifact is
    removed if no kept key uses it, and the rest, the keys after it included, are measured again
    in a new process: a key that measured small next to memory an unloaded key left behind can
    cost more in a fresh process, and the keys after it may still fit without it (run 13a,
    docs/budget.md). Each kept key's bytes, each component's engine state and the directory's
    total are recorded on the manifest (written after every cut). `on_cut(entry)` after each cut,
    before the next measurement. Returns (the entries it marked over budget, the measurement's
    error or None); after an error `manifest.measured` holds it."""
    budget, kind = manifest.budget_bytes, memory.memory_kind(device)
    built = [e for e in manifest.entries if e.status == Status.BUILT]
    dropped: list[Entry] = []
    while built:
        try:
            got = got or memory.measure_directory(out_dir, manifest, device)
        except memory.MeasureError as err:
            manifest.measured = FailedMeasurement(str(err))
            return dropped, str(err)
        per_key = got.pop("per_key")
        first = next((i for i, (_, _, total) in enumerate(per_key) if total > budget), None)
        if first is None:
            by_id = manifest.by_id()
            for key_id, own, _ in per_key:
                by_id[key_id].device_bytes, by_id[key_id].memory_kind = own, kind
            manifest.engine_shared_bytes.update(got["engine_shared_bytes"])
            manifest.measured = Measurement(**got)
            return dropped, None
        e = next(b for b in built if b.id == per_key[first][0])
        built.remove(e)
        e.status = Status.OVER_BUDGET
        e.error = (f"over budget: the directory measured {mib(per_key[first][2])} MiB in a fresh process with the "
                   f"keys up to {e.id}, budget {mib(budget)} MiB")
        dropped.append(e)
        # all cut so far: a plan an earlier cut key shared with a key kept then may be unused now
        remove_unused_artifacts(out_dir, manifest, dropped)
        write_manifest(out_dir, manifest)
        if on_cut is not None:
            on_cut(e)
        got = None
    manifest.measured = None
    return dropped, None


def keep_by_measurement(out_dir: Path, manifest: Manifest, device: torch.device,
                        on_key: Callable[[int, int, Entry, Ledger], None] | None = None,
                        on_cut: Callable[[Entry], None] | None = None
                        ) -> tuple[list[Entry], list[Entry], str | None]:
    """Hold the budget for built keys no export measured (a merge of `--measure-at-merge` shards),
    as an export does while it builds: in plan order, each built key is loaded into one fresh
    measurement process next to the keys kept before it and measured there; it is kept if its
    bytes fit what is left of the budget, else it is `over_budget` and unloaded, and the next key
    is tried. The kept keys are then recorded as measured together (`fit_by_measurement`, in a
    new process if any key was unloaded: memory it freed is reused by later loads).
    `on_key(i, n, entry, ledger)` after the i-th of n keys is measured (entry.extra["load_seconds"]:
    its load and first run); `on_cut(entry)` after each key the fresh measurement cuts. Returns
    (the entries over budget while measuring in plan order, those the fresh measurement then cut,
    the measurement's error or None)."""
    ledger, kind = Ledger(manifest.budget_bytes, dict(manifest.weight_bytes)), memory.memory_kind(device)
    held, over = [], []
    try:
        with memory.MeasureProcess(out_dir, manifest, device) as probe:
            built = [e for e in manifest.entries if e.status == Status.BUILT]
            for i, e in enumerate(built):
                got = probe.add(e)
                for comp, n in got["shared"].items():
                    ledger.shared.setdefault(comp, n)
                e.device_bytes, e.memory_kind = got["bytes"], kind
                record_load(e, got)
                if ledger.fits(e.component, e.device_bytes):
                    ledger.keep(e)
                    held.append((e, got))
                else:
                    e.status, e.error = Status.OVER_BUDGET, ledger.over_budget_reason(e)
                    over.append(e)
                    probe.drop(e.id)
                if on_key is not None:
                    on_key(i, len(built), e, ledger)
    except memory.MeasureError as err:
        manifest.measured = FailedMeasurement(str(err))
        return over, [], str(err)
    remove_unused_artifacts(out_dir, manifest, over)
    write_manifest(out_dir, manifest)
    got = None if over else {"kind": kind, **memory.summarize(manifest.weight_bytes, held)}
    dropped, error = fit_by_measurement(out_dir, manifest, device, got, on_cut)
    return over, dropped, error


def remove_unused_artifacts(out_dir: Path, manifest: Manifest, entries: list[Entry]) -> None:
    """Delete the artifacts of `entries` over budget that no built key of `manifest` uses (a
    TensorRT plan serves several keys) and clear their file fields."""
    in_use = {e.artifact for e in manifest.entries if e.status == Status.BUILT}
    for e in entries:
        if e.status == Status.OVER_BUDGET and e.artifact and e.artifact not in in_use:
            (Path(out_dir) / e.artifact).unlink(missing_ok=True)
            e.artifact, e.artifact_bytes, e.artifact_sha256 = None, 0, ""
