"""Building a Code2Wav model: from a real checkpoint directory or from seeded random weights.

Model spec strings (used by profiles, the CLI and the runtime):
  - `random:full` / `random:tiny` (optionally `random:tiny:SEED`): seeded random weights.
  - a directory with `flow.pt` and `hift.pt` (upstream layout), optionally `c2w_config.json`
    (a ModelConfig dict; without it the `full` preset is assumed).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from c2w.runtime.errors import C2WUserError, state_dict_mismatch
from c2w.runtime.model.config import ModelConfig, preset
from c2w.runtime.model.flow import NOISE_SEED, FlowModel
from c2w.runtime.model.hift import HiftVocoder, hift_state_dict_from_checkpoint

CONFIG_FILE = "c2w_config.json"


@dataclass
class Code2Wav:
    """The whole stage in eager PyTorch: what exported units are built from and fall back to."""
    cfg: ModelConfig
    flow: FlowModel
    hift: HiftVocoder
    source: str          # the model spec it was built from
    digest: str          # sha256 over config + every weight tensor (see model_digest)

    def component_modules(self) -> dict[str, list[nn.Module]]:
        """The modules whose weights each exported unit uses (weights are shared, not copied)."""
        f = self.flow
        return {
            "flow_encoder": [f.input_embedding, f.encoder, f.encoder_proj],
            "cfm": [f.decoder.estimator, f.spk_embed_affine_layer],
            "hift": [self.hift],
        }

    def precision_modules(self, component: str) -> list[nn.Module]:
        """The modules whose floating-point weights take the component's policy dtype: its
        component modules, or what a module names through its own `precision_modules()` (HiFT:
        the conv stack's convolutions only; its other parts stay float32 under every policy)."""
        out = []
        for m in self.component_modules()[component]:
            out += m.precision_modules() if hasattr(m, "precision_modules") else [m]
        return out

    def component_dtype(self, component: str) -> torch.dtype:
        """The component's policy dtype as the model holds it now (what its keys are named by)."""
        return next(self.precision_modules(component)[0].parameters()).dtype

    def to(self, device=None, precision: dict[str, torch.dtype] | None = None) -> "Code2Wav":
        """Move to `device` and cast each component's precision modules to `precision[component]`,
        a dtype its policy supports (runtime.precision.check_policy says which)."""
        self.flow.to(device)
        self.hift.to(device)
        for comp, dtype in (precision or {}).items():
            # a module with its own policy applies it (HiFT: which parts take the dtype, and the
            # weights' layout its float16 convolutions read); the others are cast whole
            for m in self.component_modules()[comp]:
                if hasattr(m, "set_precision"):
                    m.set_precision(dtype)
                else:
                    m.to(dtype)
        return self


def model_digest(cfg: ModelConfig, *modules: nn.Module) -> str:
    h = hashlib.sha256(cfg.to_json().encode())
    h.update(f"cfm_noise_seed={NOISE_SEED}".encode())   # the noise table is not a parameter
    for m in modules:
        for name, t in sorted(m.state_dict().items()):
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def init_random_(module: nn.Module, seed: int) -> None:
    """Deterministic, non-degenerate random weights (unlike upstream's init, which zeroes adaLN
    and the DiT's final layer and so makes every velocity exactly zero).

    Matrices ~ N(0, 1/fan_in); biases ~ N(0, 0.02); norm scales 1 + N(0, 0.02); embeddings and
    other vectors ~ N(0, 0.02)-ish; the HiFT f0 classifier bias is set to ~150 Hz so the NSF
    source is voiced, as it is for real speech.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in module.named_parameters():
        def randn(std):
            return torch.randn(p.shape, generator=g, dtype=torch.float32) * std
        if name.endswith("input_embedding.weight"):
            val = randn(1.0)
        elif p.dim() >= 2:
            fan_in = p[0].numel() if not name.startswith("ups.") else p.shape[0] * p.shape[2]
            val = randn(1.0 / math.sqrt(fan_in))
        elif name.endswith(".alpha"):                      # Snake activations
            val = 1.0 + randn(0.02)
        elif name.endswith("weight"):                      # norm scales
            val = 1.0 + randn(0.02)
        else:                                              # biases, pos_bias_u/v
            val = randn(0.02)
        p.copy_(val.to(p.dtype))
    if isinstance(module, HiftVocoder):
        module.f0_predictor.classifier.bias.fill_(150.0)


def _load_tensor_file(path: Path) -> dict:
    if not path.is_file():
        raise C2WUserError("checkpoint file", f"'{path}' does not exist", "a file",
                           "A checkpoint directory needs flow.pt and hift.pt (upstream layout).")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        raise C2WUserError("checkpoint file", f"'{path}' that torch.load cannot read ({e})",
                           "a torch state dict") from e


def check_state_dict(what: str, module: nn.Module, sd: dict) -> None:
    """Raise one C2WUserError listing the missing, unexpected and mis-shaped keys."""
    problems = state_dict_mismatch({k: tuple(v.shape) for k, v in sd.items()},
                                   {k: tuple(v.shape) for k, v in module.state_dict().items()})
    if problems:
        raise C2WUserError(what, problems, "the keys and shapes of the configured model",
                           "Is the checkpoint for another model config? Put the right c2w_config.json beside it.")


def load_model(spec: str) -> Code2Wav:
    """Build the eager model from a spec string (see the module docstring). CPU, fp32, eval."""
    if spec.startswith("random:"):
        parts = spec.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].isdigit()):
            raise C2WUserError("model spec", repr(spec), "'random:<preset>' or 'random:<preset>:<seed>'")
        cfg = preset(parts[1])
        seed = int(parts[2]) if len(parts) == 3 else 0
        flow, hift = FlowModel(cfg), HiftVocoder(cfg.hift)
        init_random_(flow, seed)
        init_random_(hift, seed + 1)
    else:
        d = Path(spec)
        if not d.is_dir():
            raise C2WUserError("model spec", repr(spec),
                               "'random:full', 'random:tiny' or a checkpoint directory with flow.pt and hift.pt")
        cfg_file = d / CONFIG_FILE
        cfg = ModelConfig.from_dict(json.loads(cfg_file.read_text())) if cfg_file.is_file() else preset("full")
        flow, hift = FlowModel(cfg), HiftVocoder(cfg.hift)
        flow_sd = _load_tensor_file(d / "flow.pt")
        check_state_dict(f"'{d / 'flow.pt'}'", flow, flow_sd)
        flow.load_state_dict(flow_sd, strict=True)
        hift.load_state_dict(hift_state_dict_from_checkpoint(_load_tensor_file(d / "hift.pt"), cfg.hift), strict=True)
    flow.eval()
    hift.eval()
    return Code2Wav(cfg, flow, hift, spec, model_digest(cfg, flow, hift))
