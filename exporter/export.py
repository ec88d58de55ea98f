"""`c2w export`: plan the sweep, build the selected keys' artifacts, verify each, write the manifest.

One loop for every backend; a backend's builder only builds (exporter/backends/base.py):
- the selected keys are grouped by the artifact they share (one per key; TensorRT: one plan per
  graph variant), and the shard K/N builds every N-th group;
- resumable: from the first build on, the manifest names every planned key (unbuilt ones as
  `pending`) and is rewritten atomically after every group; a group whose keys are all `built`
  with an unchanged identity (model digest, key, backend + version, torch, device, precision,
  build options, weights layout, the keys sharing the artifact) and whose artifact is intact is
  kept without rebuilding;
- fail closed: an artifact that fails parity against eager is `failed`; a build that raises fails
  the keys of its group, and the export goes on with the next group.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from exporter.backends import Builder, BuildJob, get_builder
from exporter.plan import Plan, PlannedKey, make_plan, precision_weights, require_selection
from exporter.profile import Profile
from runtime.errors import WRITE_ERRNOS, C2WUserError, write_error
from runtime.manifest import (Entry, ForeignManifestError, Manifest, Status, entry_identity, file_problem,
                              file_record, file_sha256, read_manifest, write_manifest)
from runtime.model.weights import Code2Wav
from runtime.precision import load_at_precision, set_tf32
from runtime.units import SPECS
from runtime.verify import check_entry, device_name, weights_layout

log = logging.getLogger("c2w.export")

DRY_RUN_VERSION = "dry-run"      # a dry run records no backend version (TensorRT need not be installed)


@dataclass
class ExportResult:
    out_dir: Path
    manifest: Manifest
    plan: Plan
    built: int = 0
    reused: int = 0
    failed: int = 0
    findings: list = field(default_factory=list)     # TensorRT compatibility findings

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


class ExportInterrupted(KeyboardInterrupt):
    """Ctrl-C during an export: the manifest on disk lists what was built, the rest as pending."""

    def __init__(self, built: int, planned: int):
        super().__init__(f"interrupted: {built} of {planned} built; re-run to resume")
        self.built, self.planned = built, planned


def prepare_model(profile: Profile) -> tuple[Code2Wav, torch.device]:
    """The profile's model on its device at its precision (TF32 set as it says)."""
    device = torch.device(profile.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise C2WUserError(f"profile {profile.source}: 'device'", "'cuda'", "a machine with a CUDA GPU",
                           "Use profiles/cpu.yaml on a CPU-only machine.")
    set_tf32(profile.precision.tf32, f"profile {profile.name}: precision.tf32")
    return load_at_precision(profile.model, device, dataclasses.asdict(profile.precision)), device


def artifact_groups(builder: Builder, plan: Plan) -> list[tuple[str, list[PlannedKey]]]:
    """The selected keys grouped by the artifact they share, groups and keys in plan order."""
    groups: dict[str, list[PlannedKey]] = {}
    for pk in plan.selected:
        groups.setdefault(builder.artifact_group(pk.key), []).append(pk)
    return list(groups.items())


def _in_shard(i: int, shard: tuple[int, int]) -> bool:
    k, n = shard
    return i % n == k - 1


def export_profile(profile: Profile, out_dir: Path, *, dry_run: bool = False, shard: tuple[int, int] = (1, 1),
                   on_progress: Callable[[str, int, int], None] | None = None) -> ExportResult:
    """Export every selected key of `profile` into `out_dir` (see the module docstring); with
    `dry_run`, plan (on the CPU) and run the builder's checks only. `on_progress(doing, i, n)`
    is called before the i-th of n artifacts. Disk full, read-only or forbidden directory:
    C2WUserError; what was built stays listed."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise C2WUserError("--out", f"'{out_dir}' (an existing file)", "a directory, existing or new",
                           "Name a directory for the artifacts.")
    try:
        return _export(profile, out_dir, dry_run, shard, on_progress)
    except OSError as e:
        err = write_error(e, out_dir, "Free space, fix permissions or choose another --out; re-run the same "
                                      "command to resume (finished keys are kept).")
        if err is None:
            raise
        raise err from None


def _export(profile: Profile, out_dir: Path, dry_run: bool, shard: tuple[int, int],
            on_progress: Callable[[str, int, int], None] | None) -> ExportResult:
    builder = get_builder(profile.backend)
    if not dry_run:
        builder.backend.require()           # fail fast, before minutes of export
    model, device = prepare_model(dataclasses.replace(profile, device="cpu") if dry_run else profile)
    plan = make_plan(model.cfg, profile, precision_weights(model, profile), shares_weights=True)
    require_selection(plan, profile.source)
    version = DRY_RUN_VERSION if dry_run else builder.backend.version()
    run = _Run(profile, out_dir, builder, model, device, new_manifest(profile, model, version, device, plan), plan)
    groups = artifact_groups(builder, plan)
    mine = [(i, name, pks) for i, (name, pks) in enumerate(groups) if _in_shard(i, shard)]
    if dry_run:
        for i, name, pks in mine:
            if on_progress:
                on_progress(f"checking {name}", i, len(groups))
            run.check(name, pks)
        return run.result
    if (out_dir / "manifest.json").is_file():
        run.read_previous()
    units = {name: run.identify(pks) for name, pks in groups}      # each key's unit, built once
    kept = {name for name, pks in groups if run.reuse(pks)}         # any shard's: the directory may be shared
    todo = [(i, name, pks) for i, name, pks in mine if name not in kept]
    (out_dir / profile.backend).mkdir(parents=True, exist_ok=True)
    try:
        for i, name, pks in todo:
            if on_progress:
                on_progress(f"building {name}", i, len(groups))
            run.build(name, pks, units[name])
    except KeyboardInterrupt:
        write_manifest(out_dir, run.manifest)
        ids = {pk.key.id for _, _, pks in mine for pk in pks}
        built = sum(e.status == Status.BUILT and e.id in ids for e in run.manifest.entries)
        raise ExportInterrupted(built, len(ids)) from None
    write_manifest(out_dir, run.manifest)
    return run.result


class _Run:
    """One export into one directory: what its per-group steps share."""

    def __init__(self, profile: Profile, out_dir: Path, builder: Builder, model: Code2Wav, device: torch.device,
                 manifest: Manifest, plan: Plan):
        self.profile, self.out_dir, self.builder, self.model, self.device = profile, out_dir, builder, model, device
        self.manifest = manifest
        self.build_options = builder.build_options(profile)
        self.result = ExportResult(out_dir, manifest, plan)
        manifest.entries = [entry_for(pk, Status.PENDING if pk.selected else Status.SKIPPED_BUDGET)
                            for pk in plan.entries]
        self._position = {e.id: i for i, e in enumerate(manifest.entries)}
        self.previous: dict[str, Entry] = {}
        self.known_shared: dict[str, dict] = {}

    def entry(self, key_id: str) -> Entry:
        return self.manifest.entries[self._position[key_id]]

    def read_previous(self) -> None:
        try:        # an unreadable manifest is an error: it may not be c2w's directory at all
            old = read_manifest(self.out_dir)
            self.previous, self.known_shared = old.by_id(), old.shared
        except ForeignManifestError as e:
            log.warning("ignoring the existing manifest: %s", e)

    def units(self, pks: list[PlannedKey]) -> list[torch.nn.Module]:
        return [SPECS[pk.key.component].build(self.model, pk.key).eval() for pk in pks]

    def job(self, name: str, pks: list[PlannedKey], units: list[torch.nn.Module]) -> BuildJob:
        file = self.builder.artifact_name(name, self.manifest.backend["version"], self.manifest.device)
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
                backend_version=m.backend["version"], torch_version=torch.__version__, device=m.device,
                precision=m.precision, build_options=self.build_options, weights_layout=weights_layout(unit),
                artifact_keys=[p.key.id for p in pks] if len(pks) > 1 else None)
        return units

    def reuse(self, pks: list[PlannedKey]) -> bool:
        """Keep the group's previous entries if every one is built with the identity it would get
        now and its artifact is intact (an artifact shared by several keys is hashed once)."""
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
        self.result.reused += len(pks)
        return True

    def record_shared(self, e: Entry) -> None:
        """List the shared files `e` reads (ONNX weights) in the manifest, so verify can check them."""
        for rel in e.extra.get("weights_files", []):
            self.manifest.shared[rel] = self.known_shared.get(rel) or file_record(self.out_dir, rel)

    def build(self, name: str, pks: list[PlannedKey], units: list[torch.nn.Module]) -> None:
        """Build, hash and verify one group's artifact, then rewrite the manifest. The manifest
        is also written before the build: it exists from the first build on, even if killed."""
        write_manifest(self.out_dir, self.manifest)
        entries = [self.entry(pk.key.id) for pk in pks]
        job = self.job(name, pks, units)
        _build_group(self.builder, job, entries)
        self.result.findings += job.findings
        for e in entries:
            if e.status == Status.BUILT:
                self.record_shared(e)
                self.result.built += 1
            else:
                self.result.failed += 1
        write_manifest(self.out_dir, self.manifest)


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
        entry.build_seconds = round(seconds, 2)
        entry.artifact, entry.artifact_bytes, entry.artifact_sha256, entry.extra = rel, size, sha, extra
        try:
            check_entry(job.model, builder.backend, job.out_dir, entry, job.device, unit=unit)  # parity, status
        except Exception as e:
            _stop_on_directory_errors(e)
            _failed(entry, e, seconds)


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
        profile={"name": profile.name, "digest": profile.digest, "source": profile.source},
        model={"spec": model.source, "digest": model.digest, "config": model.cfg.name},
        backend={"name": profile.backend, "version": backend_version},
        torch_version=torch.__version__, device=device_name(device),
        precision=dataclasses.asdict(profile.precision),
        budget_bytes=profile.budget_bytes, weight_bytes=plan.weight_bytes,
        schedule=dataclasses.asdict(profile.schedule))
