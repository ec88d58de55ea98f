"""TensorRT backend, runtime side: load a `.plan`, run one exact-shape optimization profile of it.

One plan per component graph holds one exact-shape optimization profile per ShapeKey (weights
stored once); `ArtifactInfo.extra["profile_index"]` says which profile a key uses. The backend
deserializes each plan once, creates one execution context per (plan, profile) with
user-managed device memory, and points every context at ONE shared scratch buffer: engines of
one backend never run concurrently (the engine cache serialises calls on one stream), so they
can share it. Written from the TensorRT 10.12+/11.x Python API documentation; no engine has been
built or run by this project (docs/tensorrt.md says what was verified).

`import c2w.runtime.engines.tensorrt` never imports tensorrt; `import_tensorrt()` does, on first use.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from c2w.runtime.engines.base import ArtifactInfo, Backend, Engine
from c2w.runtime.engines.graphs import CapturedCall
from c2w.runtime.errors import C2WUserError, MissingBackendError

# The TensorRT releases c2w is written for (build, load and the compatibility check's operator
# data): the one place that says so. pyproject.toml's `trt` extra repeats the floor (a test
# keeps the two equal).
MIN_VERSION = (10, 12)
MAX_MAJOR = 11
FLOOR = f"{MIN_VERSION[0]}.{MIN_VERSION[1]}"
SUPPORTED_VERSIONS = f"{FLOOR}+ or {MAX_MAJOR}.x"
INSTALL_LINE = f'pip install --extra-index-url https://pypi.nvidia.com "tensorrt>={FLOOR}"'
ALIGNMENT = 256          # TensorRT's documented alignment for device memory and I/O addresses

# TensorRT DataType member name -> torch dtype. INT4/FP4/E8M0 have no torch storage type, so an
# engine exposing them on its I/O cannot be bound from torch.
TRT_TO_TORCH_DTYPE: dict[str, torch.dtype] = {
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT8": torch.int8,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "FP8": torch.float8_e4m3fn,
}


# ---- pure helpers (unit-tested without TensorRT) ----------------------------------------------

def parse_version(version: str) -> tuple[int, int]:
    """'10.12' / '10.12.0.36' / '11.0' -> (major, minor)."""
    m = re.match(r"^\s*(\d+)\.(\d+)", str(version))
    if not m:
        raise C2WUserError("TensorRT version", repr(version), f"'MAJOR.MINOR[...]', e.g. '{FLOOR}'")
    return int(m.group(1)), int(m.group(2))


def check_trt_version(version: str, what: str = "backend 'tensorrt'",
                      fix: str = f"Install it with: {INSTALL_LINE}") -> tuple[int, int]:
    """(major, minor) of `version`; refuses TensorRT releases c2w was not written for, naming
    `what` was given that version and saying `fix`. The runtime and the exporter's compatibility
    check (exporter/trt_check.py) both decide with this."""
    got = parse_version(version)
    if got < MIN_VERSION or got[0] > MAX_MAJOR:
        raise C2WUserError(what, f"tensorrt {version}", f"TensorRT {SUPPORTED_VERSIONS}", fix)
    return got


def torch_dtype_for_trt(trt_dtype) -> torch.dtype:
    """`trt.DataType.HALF` (or the name 'HALF') -> torch.float16."""
    name = trt_dtype if isinstance(trt_dtype, str) else getattr(trt_dtype, "name", None)
    if name is None:
        name = str(trt_dtype)
    name = name.rsplit(".", 1)[-1]
    if name not in TRT_TO_TORCH_DTYPE:
        raise C2WUserError("TensorRT tensor dtype", name, f"one of {sorted(TRT_TO_TORCH_DTYPE)}",
                           "Export the component's I/O in a dtype torch can hold.")
    return TRT_TO_TORCH_DTYPE[name]


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (int(n) + alignment - 1) // alignment * alignment


def scratch_bytes(per_profile_bytes: Iterable[int]) -> int:
    """Size of the one scratch buffer every context shares: the max over all profiles (contexts
    never run at the same time), aligned up to 256 bytes."""
    sizes = [int(s) for s in per_profile_bytes]
    if any(s < 0 for s in sizes):
        raise C2WUserError("device memory sizes", sizes, "non-negative byte counts")
    return align_up(max(sizes, default=0))


def _sanitize(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", str(text)).strip("_.")


def artifact_name(component: str, trt_version: str, gpu_name: str) -> str:
    """`cfm`, '10.12.0', 'NVIDIA H200' -> 'cfm.trt10.12.0.NVIDIA_H200.plan'. A plan is only valid
    for the TensorRT version and GPU model that built it, so both are in the name."""
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", component or ""):
        raise C2WUserError("component name", repr(component), "letters, digits, '_' or '-'")
    if not _sanitize(trt_version) or not _sanitize(gpu_name):
        raise C2WUserError("artifact identity", (trt_version, gpu_name),
                           "a non-empty TensorRT version and GPU name")
    return f"{component}.trt{_sanitize(trt_version)}.{_sanitize(gpu_name)}.plan"


def timing_cache_name(trt_version: str, gpu_name: str) -> str:
    """A timing cache is only valid for one TensorRT version + GPU model: key its file by both."""
    return f"timing.trt{_sanitize(trt_version)}.{_sanitize(gpu_name)}.cache"


def profile_index_of(info: ArtifactInfo, num_profiles: int | None = None) -> int:
    """The optimization profile a key uses, from `info.extra['profile_index']`."""
    extra = dict(info.extra or {})
    if "profile_index" not in extra:
        raise C2WUserError(f"TensorRT artifact {info.path}", f"extra keys {sorted(extra)}",
                           "extra['profile_index']", "Rebuild the artifact directory with c2w export.")
    idx = extra["profile_index"]
    if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0 or (
            num_profiles is not None and idx >= num_profiles):
        bound = f"0..{num_profiles - 1}" if num_profiles else "an int >= 0"
        raise C2WUserError(f"TensorRT artifact {info.path} profile_index", repr(idx), bound)
    return idx


def find_profile_index(profiles: Sequence[Mapping[str, Sequence[int]]],
                       input_shapes: Mapping[str, Sequence[int]]) -> int:
    """Index of the exact-shape profile whose shapes equal `input_shapes` (name -> shape)."""
    want = {k: tuple(int(d) for d in v) for k, v in input_shapes.items()}
    for i, prof in enumerate(profiles):
        if {k: tuple(int(d) for d in v) for k, v in prof.items()} == want:
            return i
    raise C2WUserError("input shapes", want, f"one of the engine's {len(profiles)} profiles",
                       "This shape has no engine; the cache should serve it eagerly.")


# ---- TensorRT import ---------------------------------------------------------------------------

def import_tensorrt():
    """Import tensorrt, or say exactly what to install."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise MissingBackendError(
            "tensorrt", "tensorrt",
            f"Install it with: {INSTALL_LINE} (supported: TensorRT {SUPPORTED_VERSIONS})") from e
    check_trt_version(trt.__version__)
    return trt


def _set_device_memory(ctx, ptr: int, size: int) -> None:
    # set_device_memory(memory, size) is the sized (V2) setter in the Python API since 10.1; the
    # unsized `device_memory` property is gone in 11.x, so it is never used here.
    setter = getattr(ctx, "set_device_memory", None) or getattr(ctx, "set_device_memory_v2", None)
    if setter is None:
        raise RuntimeError("this tensorrt module has no IExecutionContext.set_device_memory")
    setter(int(ptr), int(size))


class _Plan:
    """One deserialized plan: runtime + engine, and one context per profile (created on demand)."""

    def __init__(self, trt, logger, path: Path):
        self.path = path
        self.runtime = trt.Runtime(logger)
        data = path.read_bytes()
        self.engine = self.runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise C2WUserError(f"TensorRT plan {path}", "a plan this TensorRT/GPU cannot deserialize",
                               "a plan built by the same TensorRT version on the same GPU model",
                               "Rebuild it with c2w export on this machine's TensorRT and GPU.")
        self.contexts: dict[int, object] = {}
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]

    def device_bytes(self, profile: int) -> int:
        return int(self.engine.get_device_memory_size_for_profile_v2(profile))


class TensorRTEngine(Engine):
    """One key = one (plan, profile). Views the backend-owned context; owns only its CUDA graph."""

    def __init__(self, info: ArtifactInfo, backend: "TensorRTBackend", plan: _Plan, profile: int,
                 ctx, device: torch.device, cuda_graph: bool):
        self.info = info
        self._backend = backend
        self._plan = plan
        self._profile = profile
        self._ctx = ctx
        self._device = device
        self._use_graph = cuda_graph
        engine = plan.engine
        self._in_dtypes = [torch_dtype_for_trt(engine.get_tensor_dtype(n)) for n in info.input_names]
        self._out_dtypes = [torch_dtype_for_trt(engine.get_tensor_dtype(n)) for n in info.output_names]
        self._keepalive: list[torch.Tensor] = []
        self._graph: CapturedCall | None = None     # created on the first call when `cuda_graph`
        self._epoch = backend._epoch        # release_shared() frees what this engine points at
        self._released = False

    # ---- checks shared by both paths (Engine.run checked count, shapes and dtypes) ----
    def _checked_inputs(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self._released or self._epoch != self._backend._epoch:
            raise RuntimeError(f"TensorRT engine {self.info.path} profile {self._profile} was released "
                               "(or its backend's shared state was); load it again")
        for name, t in zip(self.info.input_names, inputs):
            if t.device != self._device:
                raise C2WUserError(f"tensor '{name}'", f"device {t.device}", f"device {self._device}")
        return [t.contiguous() for t in inputs]

    def _bind_and_enqueue(self, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        ctx = self._ctx
        for name, t in zip(self.info.input_names, ins):
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise C2WUserError(f"TensorRT input '{name}'", f"shape {tuple(t.shape)}",
                                   f"the exact shape of profile {self._profile}")
            ctx.set_tensor_address(name, t.data_ptr())
        for name, t in zip(self.info.output_names, outs):
            ctx.set_tensor_address(name, t.data_ptr())
        self._backend._ensure_bound()
        if not ctx.execute_async_v3(torch.cuda.current_stream(self._device).cuda_stream):
            raise RuntimeError(f"TensorRT execute_async_v3 failed for {self.info.path} "
                               f"profile {self._profile}")

    def _empty_outputs(self, ins: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        ctx = self._ctx
        for name, t in zip(self.info.input_names, ins):
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise C2WUserError(f"TensorRT input '{name}'", f"shape {tuple(t.shape)}",
                                   f"the exact shape of profile {self._profile}")
        outs = []
        for name, dtype in zip(self.info.output_names, self._out_dtypes):
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise RuntimeError(f"TensorRT output '{name}' shape {shape} is not resolved by the "
                                   "input shapes (data-dependent shapes are not supported here)")
            outs.append(torch.empty(shape, dtype=dtype, device=self._device))
        return outs

    def run_impl(self, inputs: Sequence[torch.Tensor], trim=None) -> list[torch.Tensor]:
        ins = self._checked_inputs(inputs)
        with torch.cuda.device(self._device):     # the context belongs to the plan's device
            if self._use_graph:
                return self._run_graph(ins)
            return self._run_eager(ins)

    def _run_eager(self, ins: list[torch.Tensor]) -> list[torch.Tensor]:
        outs = self._empty_outputs(ins)      # fresh tensors: never aliases an input
        self._bind_and_enqueue(ins, outs)
        # The work is queued, not done: hold the (possibly copied) inputs until the next call on
        # this stream, and tell the caching allocator they are in use on it.
        stream = torch.cuda.current_stream(self._device)
        for t in ins:
            t.record_stream(stream)
        self._keepalive = list(ins)
        return outs

    def _run_graph(self, ins: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._graph is None:
            # Capture bakes in every address (I/O and scratch): static inputs (the CapturedCall's)
            # and outputs (allocated here, outside the capture), recaptured whenever the shared
            # scratch was reallocated. Captured on the first call, not at load: loading a later
            # key may grow the scratch and would make a graph captured now stale at once.
            static_out = self._empty_outputs(ins)

            def enqueue(*static_in: torch.Tensor) -> list[torch.Tensor]:
                self._bind_and_enqueue(static_in, static_out)
                return static_out

            self._graph = CapturedCall(enqueue, [t.shape for t in ins], [t.dtype for t in ins], self._device,
                                       warmups=1, generation=lambda: self._backend._scratch_generation, lazy=True)
        return self._graph(*ins)    # outputs cloned: the static buffers are overwritten next call

    def release(self) -> None:
        if self._graph is not None:
            self._graph.release()
        self._graph = None
        self._keepalive = []
        self._ctx = self._plan = None      # the backend owns contexts; release_shared frees them
        self._released = True


class TensorRTBackend(Backend):
    """Loads plans built by exporter/backends/tensorrt.py. `cuda_graphs=True` replays each key
    under a torch CUDA graph (static shapes make that valid); off by default."""

    name = "tensorrt"
    suffix = ".plan"
    captures_cuda_graphs = True

    def __init__(self, cuda_graphs: bool = False):
        self.cuda_graphs = bool(cuda_graphs)
        self._trt = None
        self._logger = None
        self._plans: dict[Path, _Plan] = {}
        self._contexts: list[object] = []           # every user-managed context, for rebinding
        self._scratch: torch.Tensor | None = None    # raw allocation (+ALIGNMENT slack)
        self._scratch_ptr = 0
        self._scratch_size = 0
        self._scratch_device: torch.device | None = None
        self._scratch_generation = 0
        self._bound_generation = -1
        self._epoch = 0                              # bumped by release_shared()

    def graphed(self, info: ArtifactInfo, device: torch.device) -> bool:
        """Every key when `cuda_graphs` is on (plans run only on CUDA; each key's shapes are static)."""
        return self.cuda_graphs and torch.device(device).type == "cuda"

    def require(self) -> None:
        self._import()

    def _import(self):
        if self._trt is None:
            trt = import_tensorrt()
            self._logger = trt.Logger(trt.Logger.WARNING)
            self._trt = trt
        return self._trt

    def version(self) -> str:
        return str(self._import().__version__)

    def load(self, info: ArtifactInfo, weights: Mapping[str, torch.Tensor] | None,
             device: torch.device) -> Engine:
        """`weights` is unused: a plan embeds its weights (once per component plan)."""
        trt = self._import()
        device = torch.device(device)
        if device.type != "cuda":
            raise C2WUserError("device for backend 'tensorrt'", str(device), "a CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self._scratch_device is not None and device != self._scratch_device:
            raise C2WUserError("device for backend 'tensorrt'", str(device), str(self._scratch_device),
                               "Use one TensorRTBackend per device.")
        path = Path(info.path).resolve()
        with torch.cuda.device(device):
            plan = self._plans.get(path)
            if plan is None:
                if not path.is_file():
                    raise C2WUserError("TensorRT plan", str(path), "an existing .plan file")
                plan = self._plans[path] = _Plan(trt, self._logger, path)
            idx = profile_index_of(info, plan.engine.num_optimization_profiles)
            self._check_io(info, plan, idx)
            ctx = plan.contexts.get(idx)
            if ctx is None:
                ctx = self._create_context(trt, plan, idx, device)
            return TensorRTEngine(info, self, plan, idx, ctx, device, self.graphed(info, device))

    def _check_io(self, info: ArtifactInfo, plan: _Plan, idx: int) -> None:
        """Fail closed if the manifest and the plan disagree on names or the exact profile shape."""
        if set(info.input_names) != set(plan.inputs):
            raise C2WUserError(f"TensorRT plan {plan.path} inputs", sorted(plan.inputs),
                               f"the manifest's {list(info.input_names)}")
        if set(info.output_names) != set(plan.outputs):
            raise C2WUserError(f"TensorRT plan {plan.path} outputs", sorted(plan.outputs),
                               f"the manifest's {list(info.output_names)}")
        if len(info.input_shapes) != len(info.input_names):
            raise C2WUserError(f"manifest entry for {plan.path}", f"{len(info.input_shapes)} shapes",
                               f"one per input {list(info.input_names)}")
        for name, dtype_name in zip(info.input_names, info.input_dtypes or ()):
            have = torch_dtype_for_trt(plan.engine.get_tensor_dtype(name))
            if str(have).removeprefix("torch.") != dtype_name:
                raise C2WUserError(f"TensorRT plan {plan.path} input '{name}'", f"dtype {have}",
                                   f"the manifest's dtype {dtype_name}",
                                   "Strongly typed plans take dtypes from the ONNX graph; re-export.")
        for name, shape in zip(info.input_names, info.input_shapes):
            lo, opt, hi = (tuple(s) for s in plan.engine.get_tensor_profile_shape(name, idx))
            if not (lo == opt == hi == tuple(shape)):
                raise C2WUserError(f"TensorRT plan {plan.path} profile {idx} input '{name}'",
                                   f"min/opt/max {lo}/{opt}/{hi}", f"exactly {tuple(shape)}",
                                   "The manifest's profile_index does not match the plan; rebuild.")

    def _create_context(self, trt, plan: _Plan, idx: int, device: torch.device):
        ctx = plan.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if ctx is None:
            raise RuntimeError(f"TensorRT could not create an execution context for {plan.path}")
        self._grow_scratch(plan.device_bytes(idx), device)
        _set_device_memory(ctx, self._scratch_ptr, self._scratch_size)
        self._contexts.append(ctx)
        stream = torch.cuda.current_stream(device)
        # Chosen once per context: a context only ever runs its own profile.
        if not ctx.set_optimization_profile_async(idx, stream.cuda_stream):
            raise RuntimeError(f"TensorRT could not select profile {idx} of {plan.path}")
        stream.synchronize()
        plan.contexts[idx] = ctx
        return ctx

    def _grow_scratch(self, need: int, device: torch.device) -> None:
        size = scratch_bytes([need, self._scratch_size])
        if self._scratch is not None and size <= self._scratch_size:
            return
        if self._scratch is not None:
            # Queued work may still use the old buffer; captured graphs baked its address in.
            torch.cuda.current_stream(device).synchronize()
        raw = torch.empty(max(size, 1) + ALIGNMENT, dtype=torch.uint8, device=device)
        self._scratch = raw
        self._scratch_ptr = align_up(raw.data_ptr())
        self._scratch_size = size
        self._scratch_device = device
        self._scratch_generation += 1
        for ctx in self._contexts:
            _set_device_memory(ctx, self._scratch_ptr, self._scratch_size)
        self._bound_generation = self._scratch_generation

    def _ensure_bound(self) -> None:
        if self._bound_generation != self._scratch_generation:   # defensive: growth rebinds all
            for ctx in self._contexts:
                _set_device_memory(ctx, self._scratch_ptr, self._scratch_size)
            self._bound_generation = self._scratch_generation

    @property
    def scratch_size(self) -> int:
        return self._scratch_size

    def release_shared(self) -> None:
        if self._scratch_device is not None:
            torch.cuda.current_stream(self._scratch_device).synchronize()
        self._contexts.clear()
        for plan in self._plans.values():
            plan.contexts.clear()
        self._plans.clear()      # engines before runtimes: drop plan objects (engine, runtime)
        self._scratch = None
        self._scratch_ptr = self._scratch_size = 0
        self._scratch_device = None
        self._scratch_generation += 1
        self._epoch += 1
