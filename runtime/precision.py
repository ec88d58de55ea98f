"""A precision policy, as a profile writes it and a manifest records it: each component's dtype
and TF32, e.g. {"flow_encoder": "float16", "cfm": "float16", "hift": "float32", "tf32": True}.

The exporter builds and verifies at it; the runtime serves at it. Both go through here.

A component's dtype is what its unit spec supports (`UnitSpec.dtypes`, runtime/units.py). For the
encoder and the CFM it is the dtype of all their weights; for HiFT, float16 means "convolutions in
float16, everything else float32" (runtime/model/hift.py), with TF32 off (`check_policy`).
"""
from __future__ import annotations

import logging
from typing import Callable, Mapping

import torch

from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.weights import Code2Wav, load_model
from c2w.runtime.units import SPECS, dtype_of

log = logging.getLogger("c2w.precision")


def check_policy(precision: Mapping, where: Callable[[str], str] = lambda key: f"precision.{key}") -> None:
    """Raise C2WUserError unless every component's dtype is one its unit supports (a refused one
    says why) and TF32 is off where a component's dtype needs it off (`UnitSpec.tf32_off`).
    `where(key)` names a key of the policy in the message (a profile's: "FILE: 'precision.hift'")."""
    for comp, spec in SPECS.items():
        spec.check_dtype(precision.get(comp, "float32"), where(comp))
    if precision.get("tf32", False):
        for comp, spec in SPECS.items():
            dtype = precision.get(comp, "float32")
            if dtype in spec.tf32_off:
                raise C2WUserError(where("tf32"), "true", f"false with {comp}: {dtype} ({spec.tf32_off[dtype]})",
                                   "Set tf32: false (float16 components never use TF32; float32 ones then compute "
                                   "exact float32).")


def component_dtypes(precision: Mapping) -> dict[str, torch.dtype]:
    """Each component's dtype (float32 where the policy names none), after check_policy."""
    check_policy(precision)
    return {c: dtype_of(precision.get(c, "float32")) for c in SPECS}


def set_tf32(enabled: bool, source: str) -> None:
    """TF32 for CUDA matmuls and cuDNN convolutions, process-wide (torch's two switches); logged
    with `source`, the policy that asked for it."""
    enabled = bool(enabled)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    log.info("c2w: TF32 %s for CUDA matmuls and cuDNN convolutions in this process (%s)",
             "on" if enabled else "off", source)


def load_at_precision(spec: str, device: torch.device | str, precision: Mapping) -> Code2Wav:
    """The eager model of `spec` on `device`, each component cast to the policy's dtype."""
    return load_model(spec).to(torch.device(device), component_dtypes(precision))
