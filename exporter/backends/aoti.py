"""AOTInductor build side: exported program -> `.pt2` without weights (+ lifted constants file).

The CFM is built as ONE Euler step (t and dt are inputs); the runtime replays it n times, on
CUDA from one graph per step (docs/aoti.md has the measurements behind that choice). The other
units are built whole.

C2W_AOTI_INDUCTOR (a JSON object of Inductor config names and values, e.g. '{"combo_kernels":
true}') adds to the build's Inductor configs: for experiments (benchmarks/h200/cfm_profile.py);
what was used is recorded in the manifest entry's extra.

Compiler: the model `.so` must link libstdc++ DYNAMICALLY. A `.so` that carries its own static
copy crashes or hangs at load, in the first locale call of the model constructor, once the
process already holds the shared libstdc++ (docs/aoti.md, "GPU-only failures"). On the project's GPU image,
$CXX points to a GCC tree that links it statically, so c2w compiles with `C2W_AOTI_CXX` if set,
else the first `g++` on PATH, and checks every built package before accepting it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import torch

from exporter.backends.base import Builder, BuildJob
from runtime.atomic import atomic_output
from runtime.errors import C2WUserError
from runtime.units import CFMStepUnit, ShapeKey
from runtime.verify import weights_layout

INDUCTOR_CONFIGS = {
    # weights are bound at load from the runtime's single shared copy (user_managed=True)
    "aot_inductor.package_constants_in_so": False,
}


def inductor_overrides() -> dict:
    """C2W_AOTI_INDUCTOR as a dict ({} when unset): Inductor configs added to every build."""
    raw = os.environ.get("C2W_AOTI_INDUCTOR", "").strip()
    if not raw:
        return {}
    try:
        extra = json.loads(raw)
    except json.JSONDecodeError as exc:
        extra = exc
    if not isinstance(extra, dict):
        raise C2WUserError("environment variable C2W_AOTI_INDUCTOR", repr(raw),
                           "a JSON object of Inductor config names and values",
                           "e.g. C2W_AOTI_INDUCTOR='{\"combo_kernels\": true}', or unset it")
    fixed = sorted(set(extra) & {"aot_inductor.package_constants_in_so"})
    if fixed:
        raise C2WUserError("environment variable C2W_AOTI_INDUCTOR", f"{fixed} in {raw!r}",
                           "only configs c2w does not set itself",
                           "c2w decides where constants live (weight sharing); drop that key")
    return extra


def aoti_compiler() -> str:
    cxx = os.environ.get("C2W_AOTI_CXX") or shutil.which("g++") or os.environ.get("CXX") or "g++"
    return cxx


@contextlib.contextmanager
def _compiler(cxx: str):
    import torch._inductor.config as cfg
    old = cfg.cpp.cxx
    cfg.cpp.cxx = (None, cxx)
    try:
        yield
    finally:
        cfg.cpp.cxx = old


def static_libstdcxx_objects(package: Path) -> list[str]:
    """Shared objects in the package that do not link libstdc++.so.6 yet define std::locale:
    a statically linked libstdc++ (the load-crash signature). Empty list = fine."""
    bad = []
    with zipfile.ZipFile(package) as z:
        for name in z.namelist():
            if name.endswith(".so"):
                data = z.read(name)
                if b"libstdc++.so.6" not in data and b"_ZNSt6locale7classicEv" in data:
                    bad.append(name)
    return bad


def step_inputs(cfg, key: ShapeKey, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The CFM unit's example inputs -> one Euler step's: caches of step 0, t and dt as (1,) tensors."""
    mu, spk, cond, x0, cnn, att = inputs
    t = torch.zeros(1, dtype=torch.float32, device=mu.device)
    dt = torch.full((1,), 0.1, dtype=torch.float32, device=mu.device)
    return [mu, spk, cond, x0, cnn[0].contiguous(), att[0].contiguous(), t, dt]


def build_aoti(model, unit: torch.nn.Module, key: ShapeKey, inputs: list[torch.Tensor], path: Path,
               overrides: dict | None = None) -> dict:
    """Compile `unit` (or its Euler step, for the CFM) at the inputs' exact shapes into `path`.
    `overrides`: Inductor configs added to the build (None: read C2W_AOTI_INDUCTOR); the exporter
    passes the ones it put in the artifact's identity."""
    extra = {}
    if key.component == "cfm":
        unit = CFMStepUnit(model).eval()
        inputs = step_inputs(model.cfg, key, inputs)
        extra.update(cfm_step=True, n_steps=model.cfg.n_timesteps)
    ep = torch.export.export(unit, tuple(inputs), strict=False)
    # Constants the export lifted from tensors built in forward (HiFT's shape-specific
    # interpolation tables) have no counterpart in the eager model, and the compiled model renames
    # them per device (`_tensor_constant<i>_cuda0`, plus copies it derives): such a unit keeps ALL
    # its constants inside the package. Its weights are then held per key (HiFT: ~80 MB at full
    # size), not shared; units without lifted constants share the eager model's tensors.
    lifted = [s.target for s in ep.graph_signature.input_specs if s.kind.name == "CONSTANT_TENSOR"]
    overrides = inductor_overrides() if overrides is None else overrides
    configs = {**INDUCTOR_CONFIGS, **({"aot_inductor.package_constants_in_so": True} if lifted else {}),
               **overrides}
    extra["constants_in_so"] = bool(lifted)
    if not lifted:
        # the layout the package will read the shared weights in (bound by pointer at load)
        extra["constant_strides"] = weights_layout(unit)
    if overrides:
        extra["inductor"] = overrides
    cxx = aoti_compiler()
    with atomic_output(path) as tmp, _compiler(cxx):     # a failed build leaves no package behind
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=configs)
        bad = static_libstdcxx_objects(tmp)
        if bad:
            raise RuntimeError(f"{bad} link libstdc++ statically (compiler {cxx}); such packages crash at load. "
                               "Set C2W_AOTI_CXX to a g++ that links it dynamically (e.g. /usr/bin/g++).")
    return {**extra, "lifted_constants": len(lifted), "cxx": cxx}


class AOTIBuilder(Builder):
    """One `.pt2` per key (the CFM's: one Euler step), built without the shared weights."""

    def build_options(self, profile) -> dict:
        return inductor_overrides()

    def build(self, job: BuildJob) -> list[dict]:
        (key,), (unit,) = job.keys, job.units
        return [build_aoti(job.model, unit, key, job.example_inputs(key), job.path, job.build_options)]

