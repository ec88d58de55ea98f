"""AOTInductor build side: exported program -> `.pt2` without weights (+ lifted constants file).

A unit whose spec has an export variant is built as that instead: the CFM as ONE Euler step (t
and dt are inputs), which the runtime replays n times, on CUDA from one graph per step
(docs/aoti.md has the measurements behind that choice). The other units are built whole.

Settings (docs/aoti.md, "Settings"): the profile's `aoti` section, each field overridden by its
environment variable when that is set (non-empty):
- `aoti.inductor_options` / C2W_AOTI_INDUCTOR (a JSON object, e.g. '{"combo_kernels": true}'):
  Inductor configs added to every build. They change the engine, so they join each entry's
  identity (`AOTIBuilder.build_options`): an artifact built with other options is rebuilt.
- `aoti.cxx` / C2W_AOTI_CXX: the C++ compiler. Default: the first `g++` on PATH, not $CXX.

Compiler: the model `.so` must link libstdc++ DYNAMICALLY. A `.so` that carries its own static
copy crashes or hangs at load, in the first locale call of the model constructor, once the
process already holds the shared libstdc++ (docs/aoti.md, "GPU-only failures"). On the
project's GPU image, $CXX points to a GCC tree that links it statically, so c2w compiles with the
first `g++` on PATH unless told otherwise, and checks every built package before accepting it.
The compiler is recorded in each entry's extra, not in its identity: any compiler whose package
passes that check and parity builds the same engine, and the default resolves to a different
path per machine.
"""
from __future__ import annotations

import contextlib
import difflib
import json
import os
import shutil
import time
import zipfile
from pathlib import Path

import torch

from c2w.exporter.backends.base import Builder, BuildJob
from c2w.exporter.profile import check_inductor_options
from c2w.runtime.atomic import atomic_output
from c2w.runtime.errors import C2WUserError
from c2w.runtime.units import SPECS, ShapeKey
from c2w.runtime.verify import weights_layout

INDUCTOR_CONFIGS = {
    # weights are bound at load from the runtime's single shared copy (user_managed=True)
    "aot_inductor.package_constants_in_so": False,
}
INDUCTOR_ENV = "C2W_AOTI_INDUCTOR"
CXX_ENV = "C2W_AOTI_CXX"


def inductor_overrides(configured: dict | None = None) -> dict:
    """The Inductor configs added to every build: C2W_AOTI_INDUCTOR when set (a JSON object),
    else `configured` (the profile's aoti.inductor_options), else {}. Checked against the configs
    c2w sets itself and against the names the installed torch knows."""
    raw = os.environ.get(INDUCTOR_ENV, "").strip()
    if raw:
        where = f"environment variable {INDUCTOR_ENV}"
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise C2WUserError(where, repr(raw), "a JSON object of Inductor config names and values",
                               f"e.g. {INDUCTOR_ENV}='{{\"combo_kernels\": true}}', or unset it to use the "
                               "profile's aoti.inductor_options")
        options = dict(check_inductor_options(where, parsed))
    else:
        where, options = "profile 'aoti.inductor_options'", dict(configured or {})
    fixed = sorted(set(options) & set(INDUCTOR_CONFIGS))
    if fixed:
        raise C2WUserError(where, f"{fixed}", "only configs c2w does not set itself",
                           "c2w decides where constants live (weight sharing); drop that key")
    if options:
        import torch._inductor.config as inductor_config
        known = inductor_config.get_config_copy()
        unknown = sorted(set(options) - set(known))
        if unknown:
            close = {n: difflib.get_close_matches(n, known, n=1) for n in unknown}
            hint = "; ".join(f"{n}: did you mean {c[0]}?" for n, c in close.items() if c)
            raise C2WUserError(where, f"unknown Inductor config(s) {unknown}",
                               f"names of torch._inductor.config in torch {torch.__version__}",
                               hint or "See torch/_inductor/config.py for the names.")
    return options


def aoti_compiler(configured: str | None = None) -> str:
    """The C++ compiler for AOTI builds: C2W_AOTI_CXX when set, else `configured` (the profile's
    aoti.cxx), else the first g++ on PATH ($CXX only when there is none). A compiler that was asked
    for by name must exist."""
    chosen = os.environ.get(CXX_ENV) or configured
    if not chosen:
        return shutil.which("g++") or os.environ.get("CXX") or "g++"
    if shutil.which(chosen) is None:
        where = f"environment variable {CXX_ENV}" if os.environ.get(CXX_ENV) else "profile 'aoti.cxx'"
        raise C2WUserError(where, f"'{chosen}' (not an executable, nor a command on PATH)",
                           "a C++ compiler that links libstdc++ dynamically, e.g. /usr/bin/g++",
                           f"Fix the path, or unset it for the first g++ on PATH ({shutil.which('g++')}).")
    return chosen


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


def build_aoti(model, unit: torch.nn.Module, key: ShapeKey, inputs: list[torch.Tensor], path: Path,
               overrides: dict | None = None, cxx: str | None = None) -> dict:
    """Compile `unit` (or the spec's export variant, e.g. the CFM's Euler step) at the inputs'
    exact shapes into `path`.
    `overrides`: Inductor configs added to the build (None: read C2W_AOTI_INDUCTOR); the exporter
    passes the ones it put in the artifact's identity. `cxx`: the compiler (None: aoti_compiler())."""
    extra = {}
    t0 = time.perf_counter()
    variant = SPECS[key.component].export_variant
    if variant is not None:
        unit = variant.build(model).eval()
        inputs = variant.inputs(model.cfg, inputs)
        extra.update(variant.extra(model.cfg))
        if inputs[0].is_cuda:
            # the unit's whole inputs are freed now (a B=32 CFM key's ten steps of caches: ~8 GB);
            # hand them back to the device, which the other shards' builds share, for the compile
            torch.cuda.empty_cache()
    ep = torch.export.export(unit, tuple(inputs), strict=False)
    exported = time.perf_counter()
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
    cxx = aoti_compiler() if cxx is None else cxx
    timers = inductor_timers()
    with atomic_output(path) as tmp, _compiler(cxx):     # a failed build leaves no package behind
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=configs)
        bad = static_libstdcxx_objects(tmp)
        if bad:
            raise RuntimeError(f"{bad} link libstdc++ statically (compiler {cxx}); such packages crash at load. "
                               "Set the profile's aoti.cxx (or C2W_AOTI_CXX) to a g++ that links it "
                               "dynamically (e.g. /usr/bin/g++).")
    phases = {"export": exported - t0, "compile": time.perf_counter() - exported}   # compile: Inductor + C++ + package
    return {**extra, "lifted_constants": len(lifted), "cxx": cxx, "build_phases": phases,
            "inductor_seconds": inductor_timers(since=timers)}


# Inductor's own timers worth keeping per build (they nest: lowering and codegen are inside the
# graph's compile; the C++ compile of the package is AotCodeCompiler.compile; Triton kernels are
# compiled and, on CUDA, benchmarked inside the codegen). Names as in torch 2.11-2.13.
INDUCTOR_TIMERS = ("fx_codegen_and_compile", "GraphLowering.run", "Scheduler.__init__", "Scheduler.codegen",
                   "GraphLowering.codegen", "AotCodeCompiler.compile", "aoti_precompile_header",
                   "async_compile.wait", "async_compile.precompile")


def inductor_timers(since: dict | None = None) -> dict:
    """Seconds Inductor's timers (torch._dynamo.utils.compilation_time_metrics) hold now, per name
    of INDUCTOR_TIMERS that is present; with `since` (an earlier reading), what they grew by (a
    timer below its earlier reading was cleared since, by dynamo: then all it holds)."""
    from torch._dynamo.utils import compilation_time_metrics as metrics
    now = {n: sum(metrics[n]) for n in INDUCTOR_TIMERS if n in metrics}
    if since is None:
        return now
    grown = {n: v - since.get(n, 0.0) for n, v in now.items()}
    return {n: round(d if d >= 0 else now[n], 2) for n, d in grown.items() if d != 0}


class AOTIBuilder(Builder):
    """One `.pt2` per key (the CFM's: one Euler step, its spec's export variant), built without the
    shared weights."""

    def build_options(self, profile) -> dict:
        """The Inductor configs (profile's aoti.inductor_options, or C2W_AOTI_INDUCTOR): they change
        the engine, so they join each entry's identity. {} by default, which leaves the identity of
        entries built before these settings existed unchanged."""
        aoti_compiler(profile.aoti.cxx)    # a compiler asked for by name that is missing stops the export here
        return inductor_overrides(profile.aoti.inductor)

    def build(self, job: BuildJob) -> list[dict]:
        (key,), (unit,) = job.keys, job.units
        cxx = aoti_compiler(job.profile.aoti.cxx)
        return [build_aoti(job.model, unit, key, job.example_inputs(key), job.path, job.build_options, cxx)]

