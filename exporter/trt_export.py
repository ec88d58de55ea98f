"""TensorRT export: per component graph variant, one ONNX with named dynamic dims -> one plan
holding one exact-shape optimization profile per selected key (weights stored once).

Without TensorRT installed: `--dry-run` still exports the ONNX graphs and runs the compatibility
check (exporter/trt_check.py); a real build fails fast with MissingBackendError (exit 2) before
anything is exported.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from exporter.plan import make_plan, precision_weights, require_selection
from runtime.engines import get_backend
from runtime.units import SPECS, ShapeKey

TRT_FLOOR = "10.12"
DYNAMIC_DIMS = {"cfm": frozenset("BTL"), "flow_encoder": frozenset("BNC"), "hift": frozenset("B")}


def graph_variant(key: ShapeKey) -> str:
    """Keys of one variant share input names and ranks, so they can share one plan."""
    if key.component == "flow_encoder":
        return "flow_encoder-last" if key.dims[3] else "flow_encoder"
    if key.component == "hift":
        return f"hift-F{key.dims[1]}" + ("-cached" if key.dims[2] else "")
    return key.component


def dynamic_shapes(key: ShapeKey):
    """torch.export dynamic dims named after the spec's dims, for the variant's varying inputs."""
    from torch.export import Dim
    comp = key.component
    B = Dim("B", min=1, max=256)
    if comp == "cfm":
        T, L = Dim("T", min=2, max=2048), Dim("L", min=1, max=4096)
        return ({0: B, 2: T}, {0: B}, {0: B, 2: T}, {0: B, 2: T}, {2: 2 * B}, {2: 2 * B, 4: L})
    if comp == "flow_encoder":
        N, C = Dim("N", min=4, max=512), Dim("C", min=1, max=4096)
        return ({0: B, 1: N}, {0: B}, {1: B, 3: C})
    # HiFT's phase-interpolation tables are built for a static frame count: B varies, F does not
    # (one plan per F: 50, 58, 158 ... a handful per profile).
    return ({0: B}, {0: B}) + (({0: B},) if key.dims[2] else ())


def variant_onnx(model, key: ShapeKey, variant: str, onnx_dir: Path, device) -> tuple[Path, list]:
    """Export one graph variant with named dynamic dims (static where that fails) and run the
    TensorRT compatibility check on it. Returns (onnx path, findings)."""
    from exporter.backends.onnx_export import export_onnx
    from exporter.trt_check import check_onnx_for_tensorrt

    if key.dims[0] == 1:               # torch.export specialises dims of size 1: trace at B = 2
        key = ShapeKey(key.component, (2,) + key.dims[1:], key.dtype)
    spec = SPECS[key.component]
    unit = spec.build(model, key).eval()
    inputs = spec.example_inputs(model.cfg, key, device=device)
    path = Path(onnx_dir) / f"{variant}-{key.dtype}.onnx"
    findings = []
    try:
        with torch.no_grad():
            export_onnx(unit, inputs, spec.input_names(key), spec.output_names, path, dynamic_shapes=dynamic_shapes(key))
        allow = DYNAMIC_DIMS[key.component]
    except Exception as exc:  # fall back to the static graph: op/dtype findings still apply
        findings.append(_finding("warning", "dynamic-export", f"{variant}: dynamic-dim export failed "
                                 f"({type(exc).__name__}: {str(exc)[:200]}); checked the static graph"))
        with torch.no_grad():
            export_onnx(unit, inputs, spec.input_names(key), spec.output_names, path)
        allow = frozenset()
    for f in check_onnx_for_tensorrt(path, TRT_FLOOR, allow_dynamic=allow):
        findings.append(type(f)(**{**f.__dict__, "message": f"{variant}: {f.message}"}))
    return path, findings


def export_tensorrt(profile, out_dir: Path, *, dry_run: bool, shard=(1, 1), on_progress=None):
    """Plan, export + check one ONNX per graph variant, and (with TensorRT) build one plan per
    variant and verify every key's profile against eager. `shard` splits the variants."""
    from exporter.export import ExportResult, entry_for, new_manifest, prepare_model
    from exporter.trt_check import errors
    from runtime.manifest import file_sha256, write_manifest
    from runtime.verify import check_entry

    backend = get_backend("tensorrt")
    if not dry_run:
        backend.require()                 # fail fast, before minutes of export
    model, device = prepare_model(profile) if not dry_run else _cpu_model(profile)
    plan = make_plan(model.cfg, profile, precision_weights(model, profile), shares_weights=True)
    require_selection(plan, profile.source)
    groups: dict[str, list] = defaultdict(list)
    for e in plan.selected:
        groups[graph_variant(e.key)].append(e)
    version = "not-installed" if dry_run else backend.version()
    manifest = new_manifest(profile, model, _VersionOnly(version), device, plan)
    result = ExportResult(Path(out_dir), manifest, plan)
    onnx_dir = Path(out_dir) / "tensorrt" / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    k, n = shard
    for i, (variant, pks) in enumerate(sorted(groups.items())):
        if i % n != k - 1:
            continue
        if on_progress:
            on_progress(f"onnx {variant}", i, len(groups))
        path, findings = variant_onnx(model, pks[0].key, variant, onnx_dir, device)
        result.findings += findings
        if dry_run:
            continue
        spec = SPECS[pks[0].key.component]
        entries = [entry_for(pk, "failed") for pk in pks]
        manifest.entries += entries
        if errors(findings):
            for e in entries:
                e.error = f"TensorRT compatibility check failed for {variant}: see `c2w export --dry-run`"
            result.failed += len(entries)
            continue
        from exporter.backends.tensorrt import build_engine_from_onnx, profiles_for_keys
        from runtime.engines.tensorrt import artifact_name
        plan_path = Path(out_dir) / "tensorrt" / artifact_name(variant, version, manifest.device)
        info = build_engine_from_onnx(
            path, profiles_for_keys([dict(zip(spec.input_names(pk.key), spec.input_shapes(model.cfg, pk.key)))
                                     for pk in pks]),
            plan_path, timing_cache_path=Path(out_dir) / "tensorrt", workspace_bytes=profile.workspace_bytes,
            tf32=profile.precision.tf32)
        for idx, e in enumerate(entries):
            e.artifact = str(plan_path.relative_to(out_dir))
            e.artifact_bytes, e.artifact_sha256 = plan_path.stat().st_size, file_sha256(plan_path)
            e.build_seconds = round(info.get("build_seconds", 0.0) / len(entries), 2)
            e.extra = {"profile_index": idx, "plan_device_memory": info.get("device_memory_per_profile", [None])[idx]}
            check_entry(model, backend, Path(out_dir), e, device)       # fail closed
            result.built += e.status == "built"
            result.failed += e.status != "built"
        write_manifest(Path(out_dir), manifest)
    return result


class _VersionOnly:
    def __init__(self, v):
        self._v = v

    def version(self):
        return self._v


def _cpu_model(profile):
    import dataclasses
    from exporter.export import prepare_model
    return prepare_model(dataclasses.replace(profile, device="cpu"))


def _finding(severity, code, message):
    from exporter.trt_check import Finding
    return Finding(severity=severity, code=code, message=message)
