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

from exporter.plan import make_plan, precision_weights
from runtime.engines import get_backend
from runtime.units import SPECS, ShapeKey

TRT_FLOOR = "10.12"


def graph_variant(key: ShapeKey) -> str:
    """Keys of one variant share input names and ranks, so they can share one plan."""
    if key.component == "flow_encoder":
        return "flow_encoder-last" if key.dims[3] else "flow_encoder"
    if key.component == "hift":
        return "hift-cached" if key.dims[2] else "hift"
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
    F = Dim("F", min=2, max=2048)
    return ({0: B, 2: F}, {0: B, 1: 480 * F}) + (({0: B},) if key.dims[2] else ())


def export_tensorrt(profile, out_dir: Path, *, dry_run: bool, shard=(1, 1), on_progress=None):
    from exporter.backends.onnx_export import export_onnx
    from exporter.export import ExportResult, new_manifest, prepare_model
    from exporter.trt_check import check_onnx_for_tensorrt

    backend = get_backend("tensorrt")
    if not dry_run:
        backend.require()                 # fail fast, before minutes of export
    model, device = prepare_model(profile) if not dry_run else _cpu_model(profile)
    plan = make_plan(model.cfg, profile, precision_weights(model, profile), shares_weights=True)
    groups: dict[str, list[ShapeKey]] = defaultdict(list)
    for e in plan.selected:
        groups[graph_variant(e.key)].append(e.key)
    version = "not-installed" if dry_run else backend.version()
    manifest = new_manifest(profile, model, _VersionOnly(version), device, plan)
    result = ExportResult(Path(out_dir), manifest, plan)
    onnx_dir = Path(out_dir) / "tensorrt" / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    for i, (variant, keys) in enumerate(sorted(groups.items())):
        if on_progress:
            on_progress(f"onnx {variant}", i, len(groups))
        key = keys[0]
        spec = SPECS[key.component]
        unit = spec.build(model, key).eval()
        inputs = spec.example_inputs(model.cfg, key, device=device)
        path = onnx_dir / f"{variant}-{key.dtype}.onnx"
        try:
            with torch.no_grad():
                export_onnx(unit, inputs, spec.input_names(key), spec.output_names, path,
                            dynamic_shapes=dynamic_shapes(key))
            allow = frozenset(spec.dim_names)
        except Exception as exc:  # fall back to the static graph: op/dtype findings still apply
            result.findings.append(_finding("warning", "dynamic-export", f"{variant}: dynamic-dim export failed "
                                            f"({type(exc).__name__}: {str(exc)[:200]}); checked the static graph"))
            with torch.no_grad():
                export_onnx(unit, inputs, spec.input_names(key), spec.output_names, path)
            allow = frozenset()
        for f in check_onnx_for_tensorrt(path, TRT_FLOOR, allow_dynamic=allow):
            result.findings.append(type(f)(**{**f.__dict__, "message": f"{variant}: {f.message}"}))
        if not dry_run:
            from exporter.backends.tensorrt import build_engine_from_onnx, profiles_for_keys
            from runtime.engines.tensorrt import artifact_name
            profs = profiles_for_keys({k: dict(zip(spec.input_names(k), spec.input_shapes(model.cfg, k))) for k in keys})
            build_engine_from_onnx(path, profs, Path(out_dir) / "tensorrt" / artifact_name(
                variant, version, manifest.device), timing_cache_path=Path(out_dir) / "tensorrt",
                workspace_bytes=profile.workspace_bytes, tf32=profile.precision.tf32)
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
