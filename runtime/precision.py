"""A precision policy, as a profile writes it and a manifest records it: each component's dtype
and TF32, e.g. {"flow_encoder": "float16", "cfm": "float16", "hift": "float32", "tf32": True}.

The exporter builds and verifies at it; the runtime serves at it. Both go through here.
"""
from __future__ import annotations

import logging
from typing import Mapping

import torch

from c2w.runtime.model.weights import Code2Wav, load_model
from c2w.runtime.units import SPECS, dtype_of

log = logging.getLogger("c2w.precision")


def component_dtypes(precision: Mapping) -> dict[str, torch.dtype]:
    """Each component's dtype (float32 where the policy names none)."""
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
