"""`c2w export`: plan the sweep, build one artifact per selected key, verify it, write the manifest.

Resumable: the manifest is rewritten atomically after every key, and an entry whose identity
(model digest, key, backend + version, torch, device, precision) is unchanged and whose artifact
is intact is kept without rebuilding. Fail closed: an artifact that fails parity is `failed`.
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

from exporter.plan import Plan, make_plan, precision_weights, require_selection
from exporter.profile import Profile
from runtime.engines import get_backend
from runtime.errors import WRITE_ERRNOS, C2WUserError, write_error
from runtime.manifest import (Entry, ForeignManifestError, Manifest, entry_identity, file_problem, file_record,
                              file_sha256, read_manifest, write_manifest)
from runtime.model.weights import Code2Wav, load_model
from runtime.units import SPECS, ShapeKey, dtype_of
from runtime.verify import check_entry, device_name, unit_weights, weights_layout

log = logging.getLogger("c2w.export")


@dataclass
class ExportResult:
    out_dir: Path
    manifest: Manifest
    plan: Plan
    built: int = 0
    reused: int = 0
    failed: int = 0
    findings: list = field(default_factory=list)     # TensorRT compatibility findings (dry run)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def prepare_model(profile: Profile) -> tuple[Code2Wav, torch.device]:
    device = torch.device(profile.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise C2WUserError(f"profile {profile.source}: 'device'", "'cuda'", "a machine with a CUDA GPU",
                           "Use profiles/cpu.yaml on a CPU-only machine.")
    torch.backends.cuda.matmul.allow_tf32 = profile.precision.tf32
    torch.backends.cudnn.allow_tf32 = profile.precision.tf32
    model = load_model(profile.model)
    prec = {c: dtype_of(profile.precision.dtype(c)) for c in SPECS}
    model.to(device, prec)
    return model, device


def _in_shard(i: int, shard: tuple[int, int]) -> bool:
    k, n = shard
    return i % n == k - 1


def _artifact_ok(out_dir: Path, e: Entry) -> bool:
    return bool(e.artifact) and file_problem(out_dir, e.artifact, e.artifact_bytes, e.artifact_sha256) is None


def _record_shared(manifest: Manifest, out_dir: Path, e: Entry, known: dict) -> None:
    """List the shared files `e` reads (ONNX weights) in the manifest, so verify can check them."""
    for rel in e.extra.get("weights_files", []):
        manifest.shared[rel] = known.get(rel) or file_record(out_dir, rel)


class ExportInterrupted(KeyboardInterrupt):
    """Ctrl-C during an export: the manifest on disk lists what was built, the rest as pending."""

    def __init__(self, built: int, planned: int):
        super().__init__(f"interrupted: {built} of {planned} built; re-run to resume")
        self.built, self.planned = built, planned


def export_profile(profile: Profile, out_dir: Path, *, dry_run: bool = False, shard: tuple[int, int] = (1, 1),
                   on_progress: Callable[[str, int, int], None] | None = None) -> ExportResult:
    """Export every selected key of `profile` into `out_dir` (see the module docstring).
    Disk full, read-only or forbidden directory: C2WUserError; what was built stays listed."""
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
    backend = get_backend(profile.backend)
    if profile.backend == "tensorrt":
        from exporter.trt_export import export_tensorrt
        return export_tensorrt(profile, out_dir, dry_run=dry_run, shard=shard, on_progress=on_progress)
    backend.require()
    model, device = prepare_model(profile)
    plan = make_plan(model.cfg, profile, precision_weights(model, profile), shares_weights=True)
    require_selection(plan, profile.source)
    manifest = new_manifest(profile, model, backend, device, plan)
    result = ExportResult(out_dir, manifest, plan)
    if dry_run:
        return result
    previous, known = {}, {}
    if (out_dir / "manifest.json").is_file():
        try:        # an unreadable manifest is an error: it may not be c2w's directory at all
            old_manifest = read_manifest(out_dir)
            previous, known = old_manifest.by_id(), old_manifest.shared
        except ForeignManifestError as e:
            log.warning("ignoring the existing manifest: %s", e)
    (out_dir / profile.backend).mkdir(parents=True, exist_ok=True)
    todo = {pk.key: i for i, pk in enumerate(plan.selected)}          # shard assignment order
    build_options = None
    if profile.backend == "aoti":
        from exporter.backends.aoti import inductor_overrides
        build_options = inductor_overrides()
    mine = [pk for pk in plan.selected if _in_shard(todo[pk.key], shard)]
    try:
        for pk in plan.entries:
            _export_key(pk, model, device, profile, backend, out_dir, manifest, result, previous, known,
                        build_options, todo, shard, on_progress)
    except KeyboardInterrupt:
        write_manifest(out_dir, _with_pending(manifest, plan, len(manifest.entries)))
        built = {e.id for e in manifest.entries if e.status == "built"}
        raise ExportInterrupted(sum(pk.key.id in built for pk in mine), len(mine)) from None
    write_manifest(out_dir, manifest)
    return result


def _export_key(pk, model, device, profile, backend, out_dir: Path, manifest: Manifest, result: ExportResult,
                previous: dict, known: dict, build_options, todo: dict, shard, on_progress) -> None:
    """Reuse or build one planned key, then rewrite the manifest (later keys listed as pending)."""
    key = pk.key
    entry = entry_for(pk, "pending" if pk.selected else "skipped_budget")
    manifest.entries.append(entry)
    if not pk.selected:
        return
    entry.identity = entry_identity(model_digest=model.digest, key_id=key.id, backend=profile.backend,
                                    backend_version=manifest.backend["version"],
                                    torch_version=torch.__version__, device=manifest.device,
                                    precision=manifest.precision, build_options=build_options,
                                    weights_layout=weights_layout(SPECS[key.component].build(model, key)))
    old = previous.get(key.id)
    if old is not None and old.status == "built" and old.identity == entry.identity and _artifact_ok(out_dir, old):
        manifest.entries[-1] = old
        old.category, old.est_bytes = pk.category, pk.est_bytes
        _record_shared(manifest, out_dir, old, known)
        result.reused += 1
        return
    if not _in_shard(todo[key], shard):
        return
    # a manifest exists from the first build on and names every planned key, even if killed mid-key
    write_manifest(out_dir, _with_pending(manifest, result.plan, len(manifest.entries)))
    if on_progress:
        on_progress(key.id, todo[key], len(todo))
    _build_entry(model, device, profile, backend, out_dir / profile.backend, out_dir, key, entry, build_options)
    if entry.status == "built":
        _record_shared(manifest, out_dir, entry, known)
        result.built += 1
    else:
        result.failed += 1
    write_manifest(out_dir, _with_pending(manifest, result.plan, len(manifest.entries)))   # resumable


def dry_run_summary(profile: Profile, out_dir: Path) -> str:
    """What `c2w export --dry-run` is about to do, said before it starts."""
    if profile.backend != "tensorrt":
        return f"dry run: plans the keys of {profile.name} ({profile.backend}); writes nothing"
    return (f"dry run: plans the keys of {profile.name}, then exports one ONNX graph per graph variant into "
            f"{Path(out_dir) / 'tensorrt' / 'onnx'} (weights included) and checks each for TensorRT; no engine is "
            f"built. With model {profile.model} this can take minutes and hundreds of MB "
            "(h100: ~4 min, ~490 MB on 2 cores); progress follows.")


def entry_for(pk, status: str) -> Entry:
    """A manifest entry for a planned key, before anything is built."""
    key, spec = pk.key, SPECS[pk.key.component]
    return Entry(id=key.id, component=key.component, dtype=key.dtype, category=pk.category, status=status,
                 dims={n: v for n, v in key.to_dict().items() if n not in ("component", "dtype")},
                 est_bytes=pk.est_bytes, input_names=list(spec.input_names(key)),
                 output_names=list(spec.output_names))


def _with_pending(manifest: Manifest, plan: Plan, done: int) -> Manifest:
    """The manifest so far plus every later key (what a killed export leaves behind)."""
    import copy
    m = copy.copy(manifest)
    m.entries = list(manifest.entries) + [entry_for(pk, "pending" if pk.selected else "skipped_budget")
                                          for pk in plan.entries[done:]]
    return m


def new_manifest(profile: Profile, model: Code2Wav, backend, device: torch.device, plan: Plan) -> Manifest:
    return Manifest(
        profile={"name": profile.name, "digest": profile.digest, "source": profile.source},
        model={"spec": model.source, "digest": model.digest, "config": model.cfg.name},
        backend={"name": profile.backend, "version": backend.version()},
        torch_version=torch.__version__, device=device_name(device),
        precision={"flow_encoder": profile.precision.flow_encoder, "cfm": profile.precision.cfm,
                   "hift": profile.precision.hift, "tf32": profile.precision.tf32},
        budget_bytes=profile.budget_bytes, weight_bytes=plan.weight_bytes,
        schedule=dataclasses.asdict(profile.schedule))


def _build_entry(model, device, profile, backend, art_dir: Path, out_dir: Path, key: ShapeKey, entry: Entry,
                 build_options: dict | None = None) -> None:
    spec = SPECS[key.component]
    path = art_dir / f"{key.id}{backend.suffix}"
    t0 = time.perf_counter()
    try:
        unit = spec.build(model, key).eval()
        inputs = spec.example_inputs(model.cfg, key, torch.Generator().manual_seed(0), device=device)
        with torch.no_grad():
            if profile.backend == "onnxruntime":
                from exporter.backends.onnx_export import export_onnx
                stats = export_onnx(unit, inputs, spec.input_names(key), spec.output_names, path)
                entry.extra = {"initializer_bytes": stats.initializer_bytes, "unique_initializer_bytes":
                               stats.unique_bytes, "nodes": stats.node_count,
                               "weights_files": [str(path.parent.relative_to(out_dir) / f) for f in stats.files]}
                wbytes = sum(t.numel() * t.element_size() for t in unit_weights(unit).values())
                # slack for shape-specific constant tables (HiFT's phase interpolation, ~0.5 MB)
                if stats.unique_bytes > 1.25 * wbytes + (4 << 20):
                    raise RuntimeError(f"ONNX initializers hold {stats.unique_bytes} bytes against {wbytes} bytes of "
                                       "weights: the export duplicated or folded weights")
            else:
                from exporter.backends.aoti import build_aoti
                entry.extra = build_aoti(model, unit, key, inputs, path, build_options)
        entry.build_seconds = round(time.perf_counter() - t0, 2)
        entry.artifact = str(path.relative_to(out_dir))
        entry.artifact_bytes = path.stat().st_size
        entry.artifact_sha256 = file_sha256(path)
        check_entry(model, backend, out_dir, entry, device)      # sets parity, device_bytes, status
    except OSError as e:
        if e.errno in WRITE_ERRNOS:    # the directory's fault, not the key's: stop (export_profile says why)
            raise
        _failed(entry, e, t0)
    except Exception as e:  # one key failing must not lose the others: record it and go on
        _failed(entry, e, t0)


def _failed(entry: Entry, e: Exception, t0: float) -> None:
    entry.build_seconds = round(time.perf_counter() - t0, 2)
    entry.status = "failed"
    entry.error = f"{type(e).__name__}: {e}"[:2000]
    log.debug("build of %s failed:\n%s", entry.id, traceback.format_exc())


def verify_directory(out_dir: Path, device: str | None = None) -> tuple[Manifest, list[Entry]]:
    """Check size and sha256 of every file the manifest names, then re-run parity for every built
    entry of `out_dir` (fresh inputs). Returns (manifest, checked). Nothing built: C2WUserError."""
    import copy
    manifest = read_manifest(Path(out_dir))
    if not any(e.status == "built" for e in manifest.entries):
        counts = {s: sum(e.status == s for e in manifest.entries) for s in {e.status for e in manifest.entries}}
        raise C2WUserError("c2w verify", f"'{out_dir}' with nothing built ({counts or 'no entries'})",
                           "a directory with at least one built artifact",
                           "Run c2w export into it first (re-running resumes an interrupted export).")
    dev = torch.device("cpu" if manifest.device == "cpu" else "cuda") if device is None else _device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise C2WUserError("verify device", f"'{device or 'cuda'}' on a machine without CUDA" + (
            f" (the manifest's device is '{manifest.device}')" if device is None else ""),
                           "a device this machine has", "Verify on the machine it was built for, or pass --device cpu "
                           "for artifacts built for the CPU.")
    model = load_model(manifest.model["spec"])
    model.to(dev, {c: dtype_of(manifest.precision[c]) for c in SPECS})
    if model.digest != manifest.model["digest"]:
        raise C2WUserError(f"{out_dir}/manifest.json model digest", manifest.model["digest"],
                           f"{model.digest} (the digest of '{manifest.model['spec']}' now)",
                           "The model changed since export: re-run c2w export.")
    backend = get_backend(manifest.backend["name"])
    backend.require()
    bad_shared = {rel: why for rel, r in manifest.shared.items()
                  if (why := file_problem(out_dir, rel, r["bytes"], r["sha256"]))}
    checked = []
    for e in manifest.entries:
        if e.status != "built":
            continue
        c = copy.deepcopy(e)
        why = [file_problem(out_dir, e.artifact, e.artifact_bytes, e.artifact_sha256)]
        why += [bad_shared.get(rel) for rel in e.extra.get("weights_files", [])]
        if any(why):            # the runtime would refuse it: so does verify, before loading it
            c.status, c.error, c.parity = "failed", "; ".join(w for w in why if w), {}
            checked.append(c)
            continue
        try:
            check_entry(model, backend, Path(out_dir), c, dev)
        except Exception as exc:  # a broken artifact is a failed verification, not a crash
            c.status, c.error = "failed", f"{type(exc).__name__}: {exc}"
        checked.append(c)
    return manifest, checked


def _device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise C2WUserError("--device", repr(name), "cpu or cuda (optionally cuda:N)")
    return dev
