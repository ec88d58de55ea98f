"""AOTInductor engines: one `.pt2` package per ShapeKey, compiled without its weights.

Every package of a component takes its constants from ONE shared set of tensors: the eager
model's own parameters and buffers (the runtime holds them anyway for the eager fallback), plus
the few non-parameter constants the export lifted, saved beside the package (`.consts.pt`).
They are bound with `load_constants(..., user_managed=True)`, so no copy is made. A package is
never run before its constants are bound (that segfaults).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch

from runtime.engines.base import ArtifactInfo, Backend, Engine


def consts_path(artifact: Path) -> Path:
    return artifact.with_suffix(".consts.pt")


class AOTIEngine(Engine):
    def __init__(self, info: ArtifactInfo, runner, device: torch.device, keep: dict):
        self.info, self._runner, self.device, self._keep = info, runner, device, keep

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        args = [t.to(self.device).contiguous() for t in inputs]
        out = self._runner(*args)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def release(self) -> None:
        self._runner = None
        self._keep = {}


class AOTIBackend(Backend):
    name = "aoti"
    suffix = ".pt2"

    def require(self) -> None:
        return None                     # part of torch

    def version(self) -> str:
        return f"torch-{torch.__version__}"

    def load(self, info: ArtifactInfo, weights: Mapping[str, torch.Tensor] | None,
             device: torch.device) -> Engine:
        if weights is None:
            raise ValueError("AOTI packages are built without weights: pass the component's shared weights")
        runner = torch._inductor.aoti_load_package(str(info.path))
        extra = torch.load(consts_path(info.path), map_location=device, weights_only=True) \
            if consts_path(info.path).is_file() else {}
        fqns = runner.get_constant_fqns()
        table = {}
        missing = []
        for fqn in fqns:
            t = extra.get(fqn, weights.get(fqn))
            if t is None:
                missing.append(fqn)
            else:
                table[fqn] = t if t.device == device else t.to(device)
        if missing:
            raise RuntimeError(f"{len(missing)} constants have no shared tensor, e.g. {missing[:4]}")
        runner.load_constants(table, check_full_update=True, user_managed=True)
        return AOTIEngine(info, runner, device, table)
