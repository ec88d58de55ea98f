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

from exporter.plan import Plan, make_plan, precision_weights
from exporter.profile import Profile
from runtime.engines import get_backend
from runtime.errors import C2WUserError
from runtime.manifest import (Entry, ForeignManifestError, Manifest, entry_identity, file_sha256, read_manifest, write_manifest)
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
    if not e.artifact:
        return False
    p = out_dir / e.artifact
    return p.is_file() and p.stat().st_size == e.artifact_bytes and file_sha256(p) == e.artifact_sha256


def export_profile(profile: Profile, out_dir: Path, *, dry_run: bool = False, shard: tuple[int, int] = (1, 1),
                   on_progress: Callable[[str, int, int], None] | None = None) -> ExportResult:
    """Export every selected key of `profile` into `out_dir` (see the module docstring)."""
    backend = get_backend(profile.backend)
    if profile.backend == "tensorrt":
        from exporter.trt_export import export_tensorrt
        return export_tensorrt(profile, out_dir, dry_run=dry_run, shard=shard, on_progress=on_progress)
    backend.require()
    model, device = prepare_model(profile)
    plan = make_plan(model.cfg, profile, precision_weights(model, profile), shares_weights=True)
    out_dir = Path(out_dir)
    manifest = new_manifest(profile, model, backend, device, plan)
    result = ExportResult(out_dir, manifest, plan)
    if dry_run:
        return result
    previous = {}
    if (out_dir / "manifest.json").is_file():
        try:        # an unreadable manifest is an error: it may not be c2w's directory at all
            previous = read_manifest(out_dir).by_id()
        except ForeignManifestError as e:
            log.warning("ignoring the existing manifest: %s", e)
    art_dir = out_dir / profile.backend
    art_dir.mkdir(parents=True, exist_ok=True)
    first_write = True
    todo = {pk.key: i for i, pk in enumerate(plan.selected)}          # shard assignment order
    build_options = None
    if profile.backend == "aoti":
        from exporter.backends.aoti import inductor_overrides
        build_options = inductor_overrides()
    for pk in plan.entries:
        key = pk.key
        entry = entry_for(pk, "pending" if pk.selected else "skipped_budget")
        manifest.entries.append(entry)
        if not pk.selected:
            continue
        entry.identity = entry_identity(model_digest=model.digest, key_id=key.id, backend=profile.backend,
                                        backend_version=manifest.backend["version"],
                                        torch_version=torch.__version__, device=manifest.device,
                                        precision=manifest.precision, build_options=build_options,
                                        weights_layout=weights_layout(SPECS[key.component].build(model, key)))
        old = previous.get(key.id)
        if old is not None and old.status == "built" and old.identity == entry.identity and _artifact_ok(out_dir, old):
            manifest.entries[-1] = old
            old.category, old.est_bytes = pk.category, pk.est_bytes
            result.reused += 1
            continue
        if not _in_shard(todo[key], shard):
            continue
        if first_write:            # a manifest exists from the first build on, even if killed mid-key
            write_manifest(out_dir, _with_pending(manifest, plan, len(manifest.entries)))
            first_write = False
        if on_progress:
            on_progress(key.id, todo[key], len(todo))
        _build_entry(model, device, profile, backend, art_dir, out_dir, key, entry, build_options)
        if entry.status == "built":
            result.built += 1
        else:
            result.failed += 1
        write_manifest(out_dir, manifest)         # resumable after every key
    write_manifest(out_dir, manifest)
    return result


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
                               stats.unique_bytes, "nodes": stats.node_count}
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
    except Exception as e:  # one key failing must not lose the others: record it and go on
        entry.build_seconds = round(time.perf_counter() - t0, 2)
        entry.status = "failed"
        entry.error = f"{type(e).__name__}: {e}"[:2000]
        log.debug("build of %s failed:\n%s", key.id, traceback.format_exc())


def verify_directory(out_dir: Path, device: str | None = None) -> tuple[Manifest, list[Entry]]:
    """Re-run parity for every built entry of `out_dir` (fresh inputs). Returns (manifest, checked)."""
    import copy
    manifest = read_manifest(Path(out_dir))
    dev = torch.device(device or ("cpu" if manifest.device == "cpu" else "cuda"))
    model = load_model(manifest.model["spec"])
    model.to(dev, {c: dtype_of(manifest.precision[c]) for c in SPECS})
    if model.digest != manifest.model["digest"]:
        raise C2WUserError(f"{out_dir}/manifest.json model digest", manifest.model["digest"],
                           f"{model.digest} (the digest of '{manifest.model['spec']}' now)",
                           "The model changed since export: re-run c2w export.")
    backend = get_backend(manifest.backend["name"])
    backend.require()
    checked = []
    for e in manifest.entries:
        if e.status != "built":
            continue
        c = copy.deepcopy(e)
        try:
            check_entry(model, backend, Path(out_dir), c, dev)
        except Exception as exc:  # a broken artifact is a failed verification, not a crash
            c.status, c.error = "failed", f"{type(exc).__name__}: {exc}"
        checked.append(c)
    return manifest, checked
