"""TensorRT builder: one plan per graph variant of a component, one exact-shape profile per key.

Keys of one graph variant have the same input names and ranks, so they share one ONNX graph with
named dynamic dims and one plan, which stores the weights once (`artifact_group`). For each
group the builder exports that graph (static where the dynamic export fails), checks it for
TensorRT at c2w's version floor (exporter/trt_check.py) and builds the plan
(exporter/backends/tensorrt_plan.py); a key's manifest `extra["profile_index"]` names its
profile. A dry run exports and checks the graphs without TensorRT.
"""
from __future__ import annotations

from pathlib import Path

import torch

from c2w.exporter.backends.base import Builder, BuildJob
from c2w.exporter.backends.onnx_export import export_onnx
from c2w.exporter.trt_check import Finding, check_onnx_for_tensorrt, errors
from c2w.runtime.engines.tensorrt import FLOOR, artifact_name
from c2w.runtime.units import SPECS, ShapeKey

ONNX_DIR = "onnx"            # beside the plans: the graphs they were built from


def dynamic_shapes(key: ShapeKey) -> tuple[dict, ...]:
    """torch.export dynamic dims, named after the spec's dims, per input of the key's variant."""
    from torch.export import Dim
    spec = SPECS[key.component]
    return spec.dynamic_shapes(key, {n: Dim(n, min=lo, max=hi) for n, (lo, hi) in spec.dynamic_dims.items()})


def variant_onnx(model, key: ShapeKey, name: str, onnx_dir: Path, device,
                 unit: torch.nn.Module | None = None) -> tuple[Path, list[Finding]]:
    """Export the graph variant of `key` (its `unit`, built here if not given) with named dynamic
    dims, static where that fails, to `onnx_dir/<name>.onnx`, and check it for TensorRT.
    Returns (onnx path, findings)."""
    if key.dim("B") == 1:               # torch.export specialises dims of size 1: trace at B = 2
        key = key.with_dims(B=2)
    spec = SPECS[key.component]
    unit = (unit if unit is not None else spec.build(model, key)).eval()
    inputs = spec.example_inputs(model.cfg, key, device=device)
    path = Path(onnx_dir) / f"{name}.onnx"
    findings = []
    try:
        with torch.no_grad():
            export_onnx(unit, inputs, spec.input_names(key), spec.output_names, path, dynamic_shapes=dynamic_shapes(key))
        allow = frozenset(spec.dynamic_dims)
    except Exception as exc:  # fall back to the static graph: op/dtype findings still apply
        findings.append(Finding("warning", "dynamic-export", f"{name}: dynamic-dim export failed "
                                f"({type(exc).__name__}: {str(exc)[:200]}); checked the static graph"))
        with torch.no_grad():
            export_onnx(unit, inputs, spec.input_names(key), spec.output_names, path)
        allow = frozenset()
    for f in check_onnx_for_tensorrt(path, FLOOR, allow_dynamic=allow):
        findings.append(type(f)(**{**f.__dict__, "message": f"{name}: {f.message}"}))
    return path, findings


class TensorRTBuilder(Builder):
    def artifact_group(self, key: ShapeKey) -> str:
        return f"{SPECS[key.component].graph_variant(key)}-{key.dtype}"

    def artifact_name(self, group: str, backend_version: str, device_name: str) -> str:
        return artifact_name(group, backend_version, device_name)

    def build_options(self, profile) -> dict:
        return {"workspace_bytes": profile.workspace_bytes}

    def _graph(self, job: BuildJob) -> Path:
        onnx_dir = job.out_dir / self.name / ONNX_DIR
        path, findings = variant_onnx(job.model, job.keys[0], job.group, onnx_dir, job.device, job.units[0])
        job.findings += findings
        return path

    def check(self, job: BuildJob) -> None:
        self._graph(job)

    def build(self, job: BuildJob) -> list[dict]:
        from c2w.exporter.backends.tensorrt_plan import build_engine_from_onnx, profiles_for_keys
        onnx_path = self._graph(job)
        bad = errors(job.findings)
        if bad:
            raise RuntimeError(f"TensorRT compatibility check failed for {job.group} ({len(bad)} error(s), first: "
                               f"{bad[0].message}); `c2w export --dry-run` lists them all")
        cfg = job.model.cfg
        shapes = [dict(zip(SPECS[k.component].input_names(k), SPECS[k.component].input_shapes(cfg, k)))
                  for k in job.keys]
        info = build_engine_from_onnx(onnx_path, profiles_for_keys(shapes), job.path,
                                      timing_cache_path=job.path.parent,
                                      workspace_bytes=job.build_options["workspace_bytes"],
                                      tf32=job.profile.precision.tf32)
        per_profile = info["device_memory_per_profile"] or [None] * len(job.keys)
        return [{"profile_index": i, "plan_device_memory": per_profile[i]} for i in range(len(job.keys))]

    def dry_run_summary(self, profile, out_dir: Path) -> str:
        return (f"dry run: plans the keys of {profile.name}, then exports one ONNX graph per graph variant into "
                f"{Path(out_dir) / self.name / ONNX_DIR} (weights included) and checks each for TensorRT; no engine "
                f"is built. With model {profile.model} this can take minutes and hundreds of MB "
                "(h100: ~4 min, ~490 MB on 2 cores); progress follows.")
