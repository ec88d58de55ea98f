"""AOTInductor build side: exported program -> `.pt2` without weights (+ lifted constants file)."""
from __future__ import annotations

from pathlib import Path

import torch

from runtime.engines.aoti import consts_path

INDUCTOR_CONFIGS = {
    # weights are bound at load from the runtime's single shared copy (user_managed=True)
    "aot_inductor.package_constants_in_so": False,
}


def build_aoti(unit: torch.nn.Module, inputs: list[torch.Tensor], path: Path) -> dict:
    """Compile `unit` at the inputs' exact shapes into `path`. Returns manifest extras."""
    ep = torch.export.export(unit, tuple(inputs), strict=False)
    tmp = path.with_name(path.name + ".tmp")
    torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=INDUCTOR_CONFIGS)
    # Constants the export lifted that are neither parameters nor buffers of the unit (e.g. a
    # tensor built in forward): the runtime cannot rebuild them from the eager model.
    named = {n for n, _ in unit.named_parameters()} | {n for n, _ in unit.named_buffers()}
    lifted = {k: v.detach().cpu() for k, v in ep.constants.items() if k not in named and isinstance(v, torch.Tensor)}
    if lifted:
        torch.save(lifted, consts_path(path))
    tmp.replace(path)
    return {"lifted_constants": len(lifted)}
