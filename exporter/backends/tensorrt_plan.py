"""TensorRT plans from ONNX graphs: one strongly typed `.plan` holding one exact-shape optimization
profile per ShapeKey (weights stored once for all keys).

The ONNX graph must declare NAMED DYNAMIC dims (e.g. B, T, L) on the inputs that vary between keys;
each profile fixes them with set_shape(name, s, s, s). Keys whose graphs differ (different input
sets, a `last_chunk` branch baked in) need separate ONNX files and so separate plans
(exporter/backends/tensorrt.py decides which keys share one).

Written from the TensorRT 10.x / 11.x Python API documentation: this project's machines cannot
install TensorRT, so no plan has been built here (docs/tensorrt.md).
"""
from __future__ import annotations

import ast
import logging
import time
from pathlib import Path
from typing import Mapping, Sequence

from c2w.runtime.atomic import atomic_write
from c2w.runtime.engines.tensorrt import (
    INSTALL_LINE, import_tensorrt, parse_version, scratch_bytes, timing_cache_name,
)
from c2w.runtime.errors import C2WUserError

log = logging.getLogger("c2w.tensorrt")

Profile = dict[str, tuple[int, ...]]


# ---- pure helpers (unit-tested without TensorRT) ----------------------------------------------

def profiles_for_keys(input_specs_per_key) -> list[Profile]:
    """One exact-shape profile per key, in the keys' order: profile i serves key i, and the
    manifest records i as `extra["profile_index"]`.

    input_specs_per_key: {key: {input name: shape}} (or a sequence of {input name: shape}).
    Every key of one plan must have the same input names and ranks and a distinct set of shapes.
    """
    if isinstance(input_specs_per_key, Mapping):
        items = list(input_specs_per_key.items())
    else:
        items = list(enumerate(input_specs_per_key))
    if not items:
        raise C2WUserError("TensorRT profiles", "no keys", "at least one key per plan")
    profiles: list[Profile] = []
    problems: list[str] = []
    seen: dict[tuple, object] = {}
    first_key, first = None, None
    for key, spec in items:
        shapes = {str(n): tuple(int(d) for d in s) for n, s in dict(spec).items()}
        if not shapes:
            problems.append(f"key {key}: no inputs")
            continue
        bad = [n for n, s in shapes.items() if any(d <= 0 for d in s)]
        if bad:
            problems.append(f"key {key}: non-positive dims in {bad}")
        if first is None:
            first_key, first = key, shapes
        elif set(shapes) != set(first):
            problems.append(f"key {key}: inputs {sorted(shapes)} differ from key {first_key}'s "
                            f"{sorted(first)}")
        else:
            ranks = [n for n in shapes if len(shapes[n]) != len(first[n])]
            if ranks:
                problems.append(f"key {key}: ranks of {ranks} differ from key {first_key}'s")
        sig = tuple(sorted(shapes.items()))
        if sig in seen:
            problems.append(f"key {key}: same shapes as key {seen[sig]}")
        seen.setdefault(sig, key)
        profiles.append(shapes)
    if problems:
        raise C2WUserError("TensorRT profiles", "; ".join(problems),
                           "for one plan: the same input names and ranks for every key, one distinct "
                           "exact shape per key",
                           "Group keys per component graph variant (e.g. flow_encoder last/non-last "
                           "chunk, hift with/without source cache) and build one plan per group.")
    return profiles


def _eval_dim(expr: str, env: Mapping[str, int]) -> int | None:
    """Evaluate a dim_param like '2*B' or 'L + T' with integer names; None if not evaluable."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None

    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.Name):
            if n.id not in env:
                raise KeyError(n.id)
            return env[n.id]
        if isinstance(n, ast.BinOp):
            a, b = ev(n.left), ev(n.right)
            ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b,
                   ast.FloorDiv: lambda: a // b, ast.Mod: lambda: a % b}
            if type(n.op) in ops:
                return ops[type(n.op)]()
        raise ValueError(ast.dump(n))

    try:
        return int(ev(tree))
    except (KeyError, ValueError, ZeroDivisionError):
        return None


def onnx_input_dims(model) -> dict[str, list[int | str | None]]:
    """Graph inputs (initializers excluded) -> dims: int, dim_param string, or None if unknown."""
    inits = {i.name for i in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = []
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param:
                dims.append(d.dim_param)
            else:
                dims.append(None)
        out[vi.name] = dims
    return out


def check_profiles_against_onnx(model, profiles: Sequence[Mapping[str, Sequence[int]]]) -> list[str]:
    """Every way the profiles disagree with the graph's inputs: names, ranks, fixed dims, and
    named dims that must take one value per profile (B in `mu` and in `spk`; '2*B' = 2 x B)."""
    graph_dims = onnx_input_dims(model)
    problems = []
    for i, prof in enumerate(profiles):
        shapes = {n: tuple(int(d) for d in s) for n, s in prof.items()}
        if set(shapes) != set(graph_dims):
            problems.append(f"profile {i}: inputs {sorted(shapes)}; the graph's are {sorted(graph_dims)}")
            continue
        env: dict[str, int] = {}
        exprs = []
        for name, dims in graph_dims.items():
            shape = shapes[name]
            if len(shape) != len(dims):
                problems.append(f"profile {i}: '{name}' rank {len(shape)}; the graph's is {len(dims)}")
                continue
            for axis, (want, got) in enumerate(zip(dims, shape)):
                if isinstance(want, int) and want != got:
                    problems.append(f"profile {i}: '{name}' axis {axis} = {got}; the graph fixes {want}")
                elif isinstance(want, str):
                    if want.isidentifier():
                        if env.setdefault(want, got) != got:
                            problems.append(f"profile {i}: dim '{want}' is {env[want]} and {got} "
                                            f"(at '{name}' axis {axis})")
                    else:
                        exprs.append((name, axis, want, got))
        for name, axis, expr, got in exprs:
            val = _eval_dim(expr, env)
            if val is not None and val != got:
                problems.append(f"profile {i}: '{name}' axis {axis} = {got}; '{expr}' gives {val}")
    return problems


def timing_cache_file(timing_cache_path, trt_version: str, gpu_name: str) -> Path | None:
    """Where the timing cache for this TensorRT version + GPU lives. A directory (or a path with
    no suffix) gets `timing.trt<ver>.<gpu>.cache` inside it; a file path gets the same key
    spliced in before its suffix. None: no timing cache."""
    if timing_cache_path is None:
        return None
    p = Path(timing_cache_path)
    keyed = timing_cache_name(trt_version, gpu_name)     # timing.trt<ver>.<gpu>.cache
    if p.is_dir() or not p.suffix:
        return p / keyed
    key = keyed[len("timing."):-len(".cache")]
    return p.with_name(f"{p.stem}.{key}{p.suffix}")


# ---- TensorRT-facing code ---------------------------------------------------------------------

def _make_logger(trt):
    error_levels = {trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR}
    py_level = {trt.ILogger.Severity.INTERNAL_ERROR: logging.ERROR,
                trt.ILogger.Severity.ERROR: logging.ERROR,
                trt.ILogger.Severity.WARNING: logging.WARNING,
                trt.ILogger.Severity.INFO: logging.DEBUG,
                trt.ILogger.Severity.VERBOSE: logging.DEBUG}

    class _CollectingLogger(trt.ILogger):
        """Forwards to `logging` and keeps error messages for the exception text."""

        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity in error_levels:
                self.errors.append(str(msg))
            log.log(py_level.get(severity, logging.DEBUG), "TensorRT: %s", msg)

    return _CollectingLogger()


def _parser_errors(parser) -> list[str]:
    out = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        node = ""
        name = getattr(e, "node_name", None)
        op = getattr(e, "node_operator", None)
        if name is not None:
            node = f"node {e.node()} '{name()}' ({op() if op else '?'})"
        else:
            node = f"node {e.node()}"
        out.append(f"{node}: {e.desc()}")
    return out


def _load_timing_cache(config, path: Path | None):
    data = path.read_bytes() if path is not None and path.is_file() else b""
    cache = config.create_timing_cache(data)
    if not config.set_timing_cache(cache, False):
        # A cache from another TensorRT/GPU despite the keyed name: start fresh, never mix.
        log.warning("timing cache %s does not match this TensorRT/GPU; starting a new one", path)
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
    return cache


def _save_timing_cache(config, path: Path) -> None:
    cache = config.get_timing_cache()
    if path.is_file():      # another shard may have saved since we loaded: merge, don't clobber
        other = config.create_timing_cache(path.read_bytes())
        if not cache.combine(other, False):
            log.warning("timing cache %s could not be merged; overwriting it", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, memoryview(cache.serialize()))


def build_engine_from_onnx(onnx_path, profiles: list[dict[str, tuple[int, ...]]], out_path, *,
                           timing_cache_path, workspace_bytes: int, tf32: bool,
                           check: bool = True) -> dict:
    """Build one strongly typed plan with one exact-shape profile per entry of `profiles`
    (see `profiles_for_keys`) and write it atomically to `out_path`.

    Returns {"path", "engine_bytes", "device_memory_per_profile" (list[int] | None),
    "scratch_bytes", "build_seconds", "trt_version", "gpu_name", "num_profiles",
    "timing_cache_path"}. Raises C2WUserError for anything the caller can fix (graph, profiles),
    MissingBackendError without tensorrt.
    """
    onnx_path, out_path = Path(onnx_path), Path(out_path)
    if not onnx_path.is_file():
        raise C2WUserError("ONNX graph", str(onnx_path), "an existing .onnx file")
    if not profiles:
        raise C2WUserError("TensorRT profiles", "none", "at least one exact-shape profile")
    if int(workspace_bytes) <= 0:
        raise C2WUserError("workspace_bytes", workspace_bytes, "a positive byte count")
    trt = import_tensorrt()
    import onnx
    import torch

    from c2w.exporter.trt_check import check_onnx_for_tensorrt, dim_param_names, errors, format_findings

    meta = onnx.load(str(onnx_path), load_external_data=False)
    problems = check_profiles_against_onnx(meta, profiles)
    if problems:
        raise C2WUserError(f"TensorRT profiles for {onnx_path.name}", "; ".join(problems),
                           "profiles matching the graph's inputs and named dims")
    version = str(trt.__version__)
    if check:
        dynamic = frozenset(n for dims in onnx_input_dims(meta).values() for d in dims
                            if isinstance(d, str) for n in dim_param_names(d))
        bad = errors(check_onnx_for_tensorrt(onnx_path, version, dynamic))
        if bad:
            raise C2WUserError(f"ONNX graph {onnx_path.name} for TensorRT {version}",
                               "\n" + format_findings(bad), "no compatibility errors",
                               "Fix the export (see exporter/trt_check.py); nothing was built.")
    if not torch.cuda.is_available():
        raise C2WUserError("device for a TensorRT build", "no CUDA device", "one CUDA GPU",
                           "Build plans on the GPU model that will serve them.")
    gpu_name = torch.cuda.get_device_name(torch.cuda.current_device())

    logger = _make_logger(trt)
    builder = trt.Builder(logger)
    flags = 0
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if parse_version(version)[0] < 11:
        # 10.x: opt in, so precision comes from the ONNX dtypes. 11.x: always on; the flag (if
        # still present) is deprecated and ignored, so it is not passed.
        if strongly_typed is None:
            raise C2WUserError("tensorrt", version, "a 10.x build with STRONGLY_TYPED networks",
                               f"Install it with: {INSTALL_LINE}")
        flags |= 1 << int(strongly_typed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise C2WUserError(f"ONNX graph {onnx_path.name}",
                           f"rejected by the TensorRT {version} parser: " + " | ".join(_parser_errors(parser)),
                           "a graph the parser imports",
                           "Run exporter.trt_check.check_onnx_for_tensorrt and fix the export.")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    tf32_flag = getattr(trt.BuilderFlag, "TF32", None)
    if tf32_flag is not None:
        (config.set_flag if tf32 else config.clear_flag)(tf32_flag)   # TF32 is on by default
    elif tf32:
        raise C2WUserError("tf32", True, "a TensorRT with BuilderFlag.TF32")
    # No FP16/BF16 flags: removed in 11.x, and a strongly typed network ignores them anyway.

    cache_file = timing_cache_file(timing_cache_path, version, gpu_name)
    _load_timing_cache(config, cache_file)

    for i, prof in enumerate(profiles):
        p = builder.create_optimization_profile()
        for name, shape in prof.items():
            s = tuple(int(d) for d in shape)
            p.set_shape(name, s, s, s)      # min = opt = max: one exact shape per key
        if config.add_optimization_profile(p) < 0:
            raise C2WUserError(f"TensorRT profile {i}", dict(prof), "a profile TensorRT accepts",
                               "; ".join(logger.errors) or None)

    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    build_seconds = time.perf_counter() - t0
    if plan is None:
        raise RuntimeError(f"TensorRT {version} failed to build {onnx_path.name} on {gpu_name}: "
                           + (" | ".join(logger.errors) or "no error message"))
    plan_bytes = memoryview(plan)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out_path, plan_bytes)
    if cache_file is not None:
        _save_timing_cache(config, cache_file)

    # Measure what the runtime will need: deserialize once and ask per profile.
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(plan_bytes)
    per_profile = None
    if engine is not None and hasattr(engine, "get_device_memory_size_for_profile_v2"):
        per_profile = [int(engine.get_device_memory_size_for_profile_v2(i))
                       for i in range(engine.num_optimization_profiles)]
    del engine, runtime
    return {
        "path": str(out_path),
        "engine_bytes": out_path.stat().st_size,
        "device_memory_per_profile": per_profile,
        "scratch_bytes": scratch_bytes(per_profile) if per_profile is not None else None,
        "build_seconds": build_seconds,
        "trt_version": version,
        "gpu_name": gpu_name,
        "num_profiles": len(profiles),
        "timing_cache_path": str(cache_file) if cache_file is not None else None,
    }
