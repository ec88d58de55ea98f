"""`c2w export`: plan the sweep, build keys' artifacts, verify each, keep what the budget holds by
measurement, write the manifest.

One loop for every backend; a backend's builder only builds (exporter/backends/base.py):
- every planned key is grouped with the keys sharing its artifact (one per key; TensorRT: one plan
  per graph variant); the shard K/N builds its share of the groups, a family of keys that differ
  only in cache lengths together (`shard_of_groups`: they share compiled kernels);
- resumable: from the first build on, the manifest names every planned key (unreached ones as
  `pending`) and is rewritten atomically after every group; a group whose keys are all `built`
  with an unchanged identity (model digest, key, backend + version, torch, device, precision,
  build options, weights layout, the keys sharing the artifact) and whose artifact is intact is
  kept without rebuilding;
- fail closed: an artifact that fails parity against eager is `failed`; a build that raises fails
  the keys of its group, and the export goes on with the next group;
- the budget holds by measurement (docs/budget.md): groups are taken in plan order; a fresh
  measurement process (runtime.memory) holds the eager model and every kept key, and each built
  or reused key is loaded into it and measured there. A key whose measured bytes do not fit
  what is left of the budget is `over_budget` (its artifact removed unless a kept key shares it);
  a key whose *estimate* does not fit what is left is not built (`skipped_budget`). Whatever the
  plan's own estimate-based cut said, a key is tried whenever the measured room allows. At the
  end the directory is measured again in another fresh process and recorded in the manifest;
  a key that takes that total over the budget is `over_budget` too, and the rest is measured again.
  Parallel shards on one GPU cannot measure (a device-wide reading includes the other shards):
  with `measure=False` a shard keeps what it builds by the estimates and leaves the measurement
  to `c2w merge` (docs/budget.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from c2w.exporter.backends import Builder, BuildJob, get_builder
from c2w.exporter.budget import Ledger, fit_by_measurement, record_load, remove_unused_artifacts
from c2w.exporter.plan import Plan, PlannedKey, make_plan, precision_weights, require_selection
from c2w.exporter.profile import Profile
from c2w.runtime import memory
from c2w.runtime.errors import WRITE_ERRNOS, C2WUserError, write_error
from c2w.runtime.manifest import (MANIFEST, BackendRef, Entry, ForeignManifestError, Manifest, ModelRef, ProfileRef,
                              Status, entry_identity, file_problem, file_record, file_sha256, read_manifest,
                              write_manifest)
from c2w.runtime.model.weights import Code2Wav
from c2w.runtime.precision import load_at_precision, set_tf32
from c2w.runtime.units import SPECS, ShapeKey
from c2w.runtime.verify import check_entry, device_name, weights_layout

log = logging.getLogger("c2w.export")

DRY_RUN_VERSION = "dry-run"      # a dry run records no backend version (TensorRT need not be installed)


@dataclass
class ExportResult:
    out_dir: Path
    manifest: Manifest
    plan: Plan
    built: int = 0                  # built, verified and kept
    reused: int = 0                 # kept from an earlier export
    failed: int = 0
    over_budget: int = 0            # verified, but their measured bytes did not fit
    findings: list = field(default_factory=list)     # TensorRT compatibility findings
    measure_error: str | None = None    # the directory could not be measured at the end

    @property
    def exit_code(self) -> int:
        return 1 if self.failed or self.measure_error else 0


class ExportInterrupted(KeyboardInterrupt):
    """Ctrl-C during an export: the manifest on disk lists what was built, the rest as pending."""

    def __init__(self, built: int, planned: int):
        super().__init__(f"interrupted: {built} of {planned} built; re-run to resume")
        self.built, self.planned = built, planned


def export_threads(profile: Profile, requested: int | None = None, dry_run: bool = False) -> int | None:
    """PyTorch's intra-op threads for an export: `requested`, else 1 on CUDA (not for a dry run,
    which runs on the CPU), else None (torch's own, one per core). On CUDA the host only sets the
    model up and compiles, and each process of N shards on one machine would otherwise start a
    thread per core: 26 shards on the H200's 16 cores took 155 s to set the model up with torch's
    default against 18 s with one thread each (benchmarks/h200/results/setup_contention, docs/ci.md)."""
    if requested is not None:
        if requested < 1:
            raise C2WUserError("--threads", requested, "1 or more PyTorch threads for the export",
                               "Leave it out for the default (1 on CUDA, one per core on the CPU).")
        return requested
    return 1 if profile.device.startswith("cuda") and not dry_run else None


def prepare_model(profile: Profile) -> tuple[Code2Wav, torch.device]:
    """The profile's model on its device at its precision (TF32 set as it says)."""
    device = torch.device(profile.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise C2WUserError(f"profile {profile.source}: 'device'", "'cuda'", "a machine with a CUDA GPU",
                           "Use profiles/cpu.yaml on a CPU-only machine.")
    set_tf32(profile.precision.tf32, f"profile {profile.name}: precision.tf32")
    return load_at_precision(profile.model, device, dataclasses.asdict(profile.precision)), device


def artifact_groups(builder: Builder, plan: Plan, *, every_key: bool = False) -> list[tuple[str, list[PlannedKey]]]:
    """The keys the plan selects by its estimates (`every_key`: all planned keys) grouped by the
    artifact they share, groups and keys in plan order."""
    groups: dict[str, list[PlannedKey]] = {}
    for pk in plan.entries if every_key else plan.selected:
        groups.setdefault(builder.artifact_group(pk.key), []).append(pk)
    return list(groups.items())


# Relative compile time of a group on the H200 (h200.yaml run 10, 24 shards: a CFM key's compile
# took 337 s on average, an encoder or HiFT key's ~55 s), and of a group whose family was
# compiled before on the same machine: its kernels hit the compile cache (a CFM key after another
# of its batch and chunk size: 4-8 s of Triton compiles instead of 210-300 s; docs/ci.md).
BUILD_WEIGHT = {"cfm": 6.0}
WARM_FACTOR = 0.2


def build_family(key: ShapeKey) -> tuple:
    """Keys of one family differ only in their cache lengths (UnitSpec.cache_dims): they have the
    same rows, so most of their compiled kernels are the same."""
    names = SPECS[key.component].dim_names
    cache = SPECS[key.component].cache_dims
    return (key.component, key.dtype) + tuple(v for n, v in zip(names, key.dims) if n not in cache)


def shard_of_groups(groups: list[tuple[str, list[PlannedKey]]], n: int) -> list[int]:
    """The shard (0 .. n-1) that builds each group: every group of a family in the same shard, so
    that one machine compiles a family's kernels once and its later keys find them in the compile
    cache; families in order of their first group, each to the shard with the least weight so far
    (BUILD_WEIGHT; a family's later groups at WARM_FACTOR), ties to the lower shard. Depends on
    the plan alone, so every shard of one export (on any machine) computes the same split."""
    load = [0.0] * n
    families: dict[tuple, list[int]] = {}
    for i, (_, pks) in enumerate(groups):
        families.setdefault(build_family(pks[0].key), []).append(i)
    shard = [0] * len(groups)
    for fam, members in families.items():
        weight = BUILD_WEIGHT.get(fam[0], 1.0) * (1 + WARM_FACTOR * (len(members) - 1))
        k = min(range(n), key=lambda j: (load[j], j))
        load[k] += weight
        for i in members:
            shard[i] = k
    return shard


def export_profile(profile: Profile, out_dir: Path, *, dry_run: bool = False, shard: tuple[int, int] = (1, 1),
                   measure: bool = True, on_progress: Callable[[str, int, int], None] | None = None,
                   threads: int | None = None) -> ExportResult:
    """Export every selected key of `profile` into `out_dir` (see the module docstring); with
    `dry_run`, plan (on the CPU) and run the builder's checks only; with `measure=False` (a shard
    next to others on its GPU), keep built keys by their estimates and leave the memory
    measurement to `c2w merge`. `on_progress(doing, i, n)` is called before the i-th of n
    artifacts. `threads`: PyTorch's intra-op threads while it runs (`export_threads`). Disk full,
    read-only or forbidden directory: C2WUserError; what was built stays listed."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise C2WUserError("--out", f"'{out_dir}' (an existing file)", "a directory, existing or new",
                           "Name a directory for the artifacts.")
    n_threads, before = export_threads(profile, threads, dry_run), torch.get_num_threads()
    if n_threads is not None:
        torch.set_num_threads(n_threads)
    try:
        return _export(profile, out_dir, dry_run, shard, measure, on_progress)
    except OSError as e:
        err = write_error(e, out_dir, "Free space, fix permissions or choose another --out; re-run the same "
                                      "command to resume (finished keys are kept).")
        if err is None:
            raise
        raise err from None
    finally:
        torch.set_num_threads(before)


def _export(profile: Profile, out_dir: Path, dry_run: bool, shard: tuple[int, int], measure: bool,
            on_progress: Callable[[str, int, int], None] | None) -> ExportResult:
    builder = get_builder(profile.backend)
    if not dry_run:
        builder.backend.require()           # fail fast, before minutes of export
    progress = on_progress or (lambda doing, i, n: None)
    model, device = prepare_model(dataclasses.replace(profile, device="cpu") if dry_run else profile)
    plan = make_plan(model.cfg, profile, precision_weights(model, profile), shares_weights=True)
    require_selection(plan, profile.source)
    version = DRY_RUN_VERSION if dry_run else builder.backend.version()
    run = _Run(profile, out_dir, builder, model, device, new_manifest(profile, model, version, device, plan), plan,
               measure)
    if dry_run:                             # what the plan selects by its estimates
        groups = artifact_groups(builder, plan)
        mine = _mine(groups, shard)
        for i, (name, pks) in enumerate(groups):
            if mine[i]:
                progress(f"checking {name}", i, len(groups))
                run.check(name, pks)
        return run.result
    groups = artifact_groups(builder, plan, every_key=True)
    mine = _mine(groups, shard)
    if (out_dir / MANIFEST).is_file():
        run.read_previous()
    progress("identifying the keys (the model is set up)", 0, len(groups))   # its time: the model's set-up
    units = {name: run.identify(pks) for name, pks in groups}      # each key's unit, built once
    reusable = {name for name, pks in groups if run.reuse(pks)}     # any shard's: the directory may be shared
    (out_dir / profile.backend).mkdir(parents=True, exist_ok=True)
    try:
        with run.measuring():
            for i, (name, pks) in enumerate(groups):
                if name in reusable:
                    progress(f"{'measuring' if measure else 'keeping'} {name}", i, len(groups))
                elif not mine[i] or run.still_over_budget(pks) or run.skip_by_estimate(pks):
                    continue
                else:
                    progress(f"building {name}", i, len(groups))
                    run.build(name, pks, units[name])
                run.admit(pks)
                write_manifest(out_dir, run.manifest)
        if measure:
            progress("measuring the directory", len(groups), len(groups))
            run.measure_final()
    except KeyboardInterrupt:
        write_manifest(out_dir, run.manifest)
        ids = {pk.key.id for i, (_, pks) in enumerate(groups) if mine[i] for pk in pks if pk.selected}
        built = sum(e.status == Status.BUILT and e.id in ids for e in run.manifest.entries)
        raise ExportInterrupted(built, len(ids)) from None
    write_manifest(out_dir, run.manifest)
    return run.result


def _mine(groups: list, shard: tuple[int, int]) -> list[bool]:
    """Per group, whether the shard K/N builds it (shard_of_groups)."""
    k, n = shard
    return [s == k - 1 for s in shard_of_groups(groups, n)]


class _Run:
    """One export into one directory: what its per-group steps share."""

    def __init__(self, profile: Profile, out_dir: Path, builder: Builder, model: Code2Wav, device: torch.device,
                 manifest: Manifest, plan: Plan, measure: bool = True):
        self.profile, self.out_dir, self.builder, self.model, self.device = profile, out_dir, builder, model, device
        self.measure = measure              # False: kept by estimates, measured by c2w merge
        self.manifest = manifest
        self.build_options = builder.build_options(profile)
        self.result = ExportResult(out_dir, manifest, plan)
        manifest.entries = [entry_for(pk, Status.PENDING) for pk in plan.entries]
        self._position = {e.id: i for i, e in enumerate(manifest.entries)}
        self.previous: dict[str, Entry] = {}
        self.known_shared: dict[str, dict] = {}
        self.ledger = Ledger(profile.budget_bytes, dict(plan.weight_bytes))
        self.reused_ids: set[str] = set()
        self.probe = None                   # the measurement process (runtime.memory), while measuring()
        self.held: list[tuple[Entry, dict]] = []    # what it holds, in load order, with its measurements
        self.only_kept_loaded = True        # it never held a key it released

    def entry(self, key_id: str) -> Entry:
        return self.manifest.entries[self._position[key_id]]

    def read_previous(self) -> None:
        try:        # an unreadable manifest is an error: it may not be c2w's directory at all
            old = read_manifest(self.out_dir)
            self.previous, self.known_shared = old.by_id(), old.shared
            self.ledger.shared.update(old.engine_shared_bytes)
        except ForeignManifestError as e:
            log.warning("ignoring the existing manifest: %s", e)

    def units(self, pks: list[PlannedKey]) -> list[torch.nn.Module]:
        return [SPECS[pk.key.component].build(self.model, pk.key).eval() for pk in pks]

    def job(self, name: str, pks: list[PlannedKey], units: list[torch.nn.Module]) -> BuildJob:
        file = self.builder.artifact_name(name, self.manifest.backend.version, self.manifest.device)
        return BuildJob(self.model, self.device, self.profile, name, [pk.key for pk in pks], units,
                        self.out_dir / self.profile.backend / file, self.out_dir, self.build_options)

    def check(self, name: str, pks: list[PlannedKey]) -> None:
        """A dry run's work for one group."""
        job = self.job(name, pks, self.units(pks))
        self.builder.check(job)
        self.result.findings += job.findings

    def identify(self, pks: list[PlannedKey]) -> list[torch.nn.Module]:
        """Set the identity of the group's entries; returns their unit modules (for the build)."""
        units, m = self.units(pks), self.manifest
        for pk, unit in zip(pks, units):
            self.entry(pk.key.id).identity = entry_identity(
                model_digest=self.model.digest, key_id=pk.key.id, backend=self.profile.backend,
                backend_version=m.backend.version, torch_version=torch.__version__, device=m.device,
                precision=m.precision, build_options=self.build_options, weights_layout=weights_layout(unit),
                artifact_keys=[p.key.id for p in pks] if len(pks) > 1 else None,
                revision=SPECS[pk.key.component].revisions.get(self.profile.backend, 0))
        return units

    def reuse(self, pks: list[PlannedKey]) -> bool:
        """Keep the group's previous entries if every one is built with the identity it would get
        now and its artifact is intact (an artifact shared by several keys is hashed once). They
        stay `built` until `admit` measures them against the budget."""
        olds = [self.previous.get(pk.key.id) for pk in pks]
        intact: dict[str, bool] = {}
        for old, pk in zip(olds, pks):
            if old is None or old.status != Status.BUILT or old.identity != self.entry(pk.key.id).identity:
                return False
            if old.artifact not in intact:
                intact[old.artifact] = _artifact_ok(self.out_dir, old)
            if not intact[old.artifact]:
                return False
        for old, pk in zip(olds, pks):
            old.category, old.est_bytes = pk.category, pk.est_bytes
            self.manifest.entries[self._position[old.id]] = old
            self.record_shared(old)
            self.reused_ids.add(old.id)
        return True

    def record_shared(self, e: Entry) -> None:
        """List the shared files `e` reads (ONNX weights) in the manifest, so verify can check them."""
        for rel in e.extra.get("weights_files", []):
            self.manifest.shared[rel] = self.known_shared.get(rel) or file_record(self.out_dir, rel)

    def build(self, name: str, pks: list[PlannedKey], units: list[torch.nn.Module]) -> None:
        """Build, hash and verify one group's artifact. The manifest is written before the build:
        it exists from the first build on, even if killed."""
        write_manifest(self.out_dir, self.manifest)
        entries = [self.entry(pk.key.id) for pk in pks]
        job = self.job(name, pks, units)
        _build_group(self.builder, job, entries)
        self.result.findings += job.findings
        self.result.failed += sum(e.status == Status.FAILED for e in entries)

    # ------------------------------------------------------------------ the budget
    @contextlib.contextmanager
    def measuring(self):
        """The measurement process for the loop (docs/budget.md), stopped whatever happens; none
        when the export does not measure."""
        if not self.measure:
            yield
            return
        self.probe = memory.MeasureProcess(self.out_dir, self.manifest, self.device)
        try:
            yield
        finally:
            self.probe.close()

    def still_over_budget(self, pks: list[PlannedKey]) -> bool:
        """Keep the group's keys over budget without rebuilding them when an earlier export
        measured each one (same identity) and none fits the room by that measurement."""
        kind = memory.memory_kind(self.device)
        olds = [self.previous.get(pk.key.id) for pk in pks]
        if not all(old is not None and old.status == Status.OVER_BUDGET and old.device_bytes is not None
                   and old.memory_kind == kind and old.identity == self.entry(old.id).identity for old in olds):
            return False
        if any(self.ledger.fits(old.component, old.device_bytes) for old in olds):
            return False
        for old, pk in zip(olds, pks):
            old.category, old.est_bytes = pk.category, pk.est_bytes
            self.manifest.entries[self._position[old.id]] = old
            self._over_budget(old, self.ledger.over_budget_reason(old))
        return True

    def skip_by_estimate(self, pks: list[PlannedKey]) -> bool:
        """Leave the group unbuilt (`skipped_budget`) when no key's estimate fits the measured room."""
        if any(self.ledger.fits(pk.key.component, pk.est_bytes) for pk in pks):
            return False
        for pk in pks:
            self.entry(pk.key.id).status = Status.SKIPPED_BUDGET
        return True

    def admit(self, pks: list[PlannedKey]) -> None:
        """Keep each built key of the group whose measured bytes fit the budget's room, next to
        the keys kept so far; mark the others over budget. A key kept by an earlier export is
        judged on its recorded bytes (a resumed export keeps what it kept); any other is loaded
        into the measurement process and measured there. An artifact no kept key uses is removed."""
        kind = memory.memory_kind(self.device)
        entries = [self.entry(pk.key.id) for pk in pks]
        if not self.measure:
            self._keep_unmeasured(entries, kind)
            return
        for e in entries:
            if e.status != Status.BUILT:
                continue
            recorded = e.id in self.reused_ids and e.device_bytes is not None and e.memory_kind == kind
            if recorded and not self.ledger.fits(e.component, e.device_bytes):
                self._over_budget(e, self.ledger.over_budget_reason(e))
                continue
            try:
                got = self._load(e)
            except memory.MeasureError as err:
                _failed(e, RuntimeError(f"measuring its memory failed: {err}"), e.build_seconds)
                self.result.failed += 1
                continue
            if not recorded:
                e.device_bytes, e.memory_kind = got["bytes"], kind
            if self.ledger.fits(e.component, e.device_bytes):
                self.ledger.keep(e)
                self.record_shared(e)
                self.result.reused += e.id in self.reused_ids
                self.result.built += e.id not in self.reused_ids
            else:
                self._over_budget(e, self.ledger.over_budget_reason(e))
                self._unload(e.id)
        self.manifest.engine_shared_bytes = dict(self.ledger.shared)
        remove_unused_artifacts(self.out_dir, self.manifest, entries)

    def _keep_unmeasured(self, entries: list[Entry], kind: str) -> None:
        """`admit` for an export that does not measure: every built key is kept, counted in the
        ledger at its recorded bytes if it has them, else at its estimate (so that the estimate
        cut of the groups after it sees the room it takes)."""
        for e in entries:
            if e.status == Status.BUILT:
                measured = e.device_bytes is not None and e.memory_kind == kind
                self.ledger.keep(e, e.device_bytes if measured else e.est_bytes)
                self.record_shared(e)
                self.result.reused += e.id in self.reused_ids
                self.result.built += e.id not in self.reused_ids

    def _load(self, e: Entry) -> dict:
        """Load `e` into the measurement process (restarted with the kept keys if it died)."""
        if not self.probe.alive:
            self.probe.close()
            self.probe = memory.MeasureProcess(self.out_dir, self.manifest, self.device)
            self.held = [(self.entry(k), self.probe.add(self.entry(k))) for k in self.ledger.kept]
            self.only_kept_loaded = True
        got = self.probe.add(e)
        record_load(e, got)
        for comp, n in got["shared"].items():
            self.ledger.shared.setdefault(comp, n)      # a resumed export keeps the recorded number
        self.held.append((e, got))
        return got

    def _unload(self, key_id: str) -> None:
        """Release a key the budget has no room for. Memory it freed is reused by the next loads,
        which then read low (docs/budget.md): from now on the process is no fresh measurement of
        the directory, and `measure_final` measures it in a new one."""
        self.probe.drop(key_id)
        self.held = [(e, got) for e, got in self.held if e.id != key_id]
        self.only_kept_loaded = False

    def _over_budget(self, e: Entry, why: str) -> None:
        e.status, e.error = Status.OVER_BUDGET, why
        self.ledger.kept.pop(e.id, None)
        self.result.over_budget += 1

    def measure_final(self) -> None:
        """Record the directory's keys measured together in a fresh process: the loop's own
        measurement process if it held exactly them, else a new one; a key that takes the total
        over the budget becomes `over_budget` and the rest is measured again
        (budget.fit_by_measurement)."""
        write_manifest(self.out_dir, self.manifest)
        built = [e.id for e in self.manifest.entries if e.status == Status.BUILT]
        got = None
        if self.only_kept_loaded and [e.id for e, _ in self.held] == built:
            got = {"kind": memory.memory_kind(self.device), **memory.summarize(self.manifest.weight_bytes, self.held)}
        dropped, error = fit_by_measurement(self.out_dir, self.manifest, self.device, got)
        for e in dropped:
            self.ledger.kept.pop(e.id, None)
            self.result.over_budget += 1
            self.result.reused -= e.id in self.reused_ids
            self.result.built -= e.id not in self.reused_ids
        if error:
            self.result.measure_error = f"the directory could not be measured: {error}"


def _artifact_ok(out_dir: Path, e: Entry) -> bool:
    return bool(e.artifact) and file_problem(out_dir, e.artifact, e.artifact_bytes, e.artifact_sha256) is None


def _build_group(builder: Builder, job: BuildJob, entries: list[Entry]) -> None:
    """Build the group's artifact and check every key against eager. A failure is recorded on
    the keys it concerns (a build's on all of them); an OSError of the directory itself (disk
    full, read-only) stops the export."""
    t0 = time.perf_counter()
    try:
        extras = builder.build(job)
        if len(extras) != len(entries):
            raise RuntimeError(f"the {builder.name} builder returned {len(extras)} entries for {len(entries)} keys")
    except Exception as e:
        _stop_on_directory_errors(e)
        for entry in entries:
            _failed(entry, e, time.perf_counter() - t0)
        return
    seconds = (time.perf_counter() - t0) / len(entries)
    rel = str(job.path.relative_to(job.out_dir))
    size, sha = job.path.stat().st_size, file_sha256(job.path)
    for entry, unit, extra in zip(entries, job.units, extras):
        entry.artifact, entry.artifact_bytes, entry.artifact_sha256, entry.extra = rel, size, sha, extra
        t1 = time.perf_counter()
        try:
            check_entry(job.model, builder.backend, job.out_dir, entry, job.device, unit=unit)  # parity, status
        except Exception as e:
            _stop_on_directory_errors(e)
            _failed(entry, e, seconds)
        verify = time.perf_counter() - t1
        # where the key's build time went: the builder's own phases (if it times them) and verification
        extra["build_phases"] = {**{k: round(v, 2) for k, v in extra.get("build_phases", {}).items()},
                                 "verify": round(verify, 2)}
        entry.build_seconds = round(seconds + verify, 2)


def _stop_on_directory_errors(e: Exception) -> None:
    if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:   # the directory's fault, not the key's
        raise e


def _failed(entry: Entry, e: Exception, seconds: float) -> None:
    entry.build_seconds = round(seconds, 2)
    entry.status = Status.FAILED
    entry.error = f"{type(e).__name__}: {e}"[:2000]
    log.debug("build of %s failed:\n%s", entry.id, "".join(traceback.format_exception(e)))


def dry_run_summary(profile: Profile, out_dir: Path) -> str:
    """What `c2w export --dry-run` is about to do, said before it starts."""
    return get_builder(profile.backend).dry_run_summary(profile, out_dir)


def entry_for(pk: PlannedKey, status: Status) -> Entry:
    """A manifest entry for a planned key, before anything is built."""
    key, spec = pk.key, SPECS[pk.key.component]
    return Entry(id=key.id, component=key.component, dtype=key.dtype, category=pk.category, status=status,
                 dims={n: v for n, v in key.to_dict().items() if n not in ("component", "dtype")},
                 est_bytes=pk.est_bytes, input_names=list(spec.input_names(key)),
                 output_names=list(spec.output_names))


def new_manifest(profile: Profile, model: Code2Wav, backend_version: str, device: torch.device, plan: Plan) -> Manifest:
    return Manifest(
        profile=ProfileRef(name=profile.name, digest=profile.digest, source=profile.source),
        model=ModelRef(spec=model.source, digest=model.digest, config=model.cfg.name),
        backend=BackendRef(name=profile.backend, version=backend_version),
        torch_version=torch.__version__, device=device_name(device),
        precision=dataclasses.asdict(profile.precision),
        budget_bytes=profile.budget_bytes, weight_bytes=plan.weight_bytes,
        schedule=dataclasses.asdict(profile.schedule))
