"""Candidate DiT changes, measured on the GPU before any of them goes into runtime/model/dit.py.

Each `apply_<name>(dit)` takes a DiT whose weights are loaded and already in their final dtype
and device, stores the packed tensors it needs as non-persistent buffers (so `unit_weights()`
binds them into an AOTI package like any other weight, and the state dict keeps upstream's
keys), and rebinds methods on the instances. Values are the model's; running this file checks
that on CPU.
  qkv  one q/k/v projection GEMM per block and step instead of three
(The adaLN modulation, once a candidate here, is now the model's own table:
runtime.model.dit.CFMSolver.modulation_table.) Used by cfm_profile.py --fuse qkv. A variant that wins would go into the model with the
packing kept in sync with the parameters (e.g. the parameters as views of the packed buffer, as
the conv weights are stored tap-major); these experiments copy once and never update.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import MethodType

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from c2w.runtime.model.dit import DiT, parts  # noqa: E402


def _packed_project(self, x):
    return parts(F.linear(x, self.qkv_weight, self.qkv_bias), 3, -1)


def apply_qkv(dit: DiT) -> None:
    for blk in dit.blocks:
        a = blk.attn
        a.register_buffer("qkv_weight", torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight]).detach().clone(),
                          persistent=False)
        a.register_buffer("qkv_bias", torch.cat([a.to_q.bias, a.to_k.bias, a.to_v.bias]).detach().clone(),
                          persistent=False)
        a.project = MethodType(_packed_project, a)


VARIANTS = {"qkv": apply_qkv}


def apply(dit: DiT, names: str) -> None:
    """names: comma-separated keys of VARIANTS ('' applies nothing)."""
    for name in filter(None, names.split(",")):
        if name not in VARIANTS:
            raise SystemExit(f"--fuse {names!r}: unknown variant {name!r}; expected a comma-separated subset of "
                             f"{sorted(VARIANTS)}")
        VARIANTS[name](dit)


if __name__ == "__main__":      # CPU check: each variant computes the model's values
    from c2w.runtime.model.config import TINY
    from c2w.runtime.model.weights import init_random_
    from c2w.runtime.units import rel_l2
    g = torch.Generator().manual_seed(0)
    d, B, T, L = TINY.dit, 2, 50, 40
    args = (torch.randn(2 * B, d.in_channels, T, generator=g), torch.tensor([0.3]),
            torch.randn(d.depth, 2 * B, 2 * d.hidden, 2, generator=g),
            torch.randn(d.depth, 2 * B, d.heads, L, 2 * d.head_dim, generator=g))
    for names in ("qkv",):
        dit = DiT(d, TINY.mel_bins).eval()
        init_random_(dit, 0)
        with torch.inference_mode():
            want = dit(*args)
            apply(dit, names)
            got = dit(*args)
            ep = torch.export.export(dit, args, strict=False)
            exported = ep.module()(*args)
        errs = [max(rel_l2(x, w), rel_l2(y, w)) for x, y, w in zip(got, exported, want)]
        assert max(errs) < 1e-5, (names, errs)
        print(f"{names}: rel-L2 vs the model {max(errs):.1e} (eager and exported)")
