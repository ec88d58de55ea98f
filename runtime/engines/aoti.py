"""AOTInductor engines: one `.pt2` package per ShapeKey, compiled without its weights.

Packages of the encoder and the CFM take their constants from ONE shared set of tensors: the
eager model's own parameters and buffers (the runtime holds them anyway for the eager fallback),
bound with `load_constants(..., user_managed=True)`, so no copy is made. A package is never run
before its constants are bound (that segfaults). A unit whose export lifted constants of its own
(HiFT) is built with every constant inside the package (`extra["constants_in_so"]`).

The CFM is compiled as one Euler step (`extra["cfm_step"]`) and replayed n times by
`EulerReplay`. On CUDA an engine whose graph inputs are small enough (`graph_max_bytes`) is
captured into a CUDA graph at load (`CapturedCall` of runtime.engines.graphs: static input
buffers; packages loaded with run_single_threaded=True, as AOTI requires for capture), so a call
is: copy inputs in, one replay, clone outputs out. For the CFM the graph is ONE Euler step,
replayed n times per chunk: capturing the n-step replay of a single-threaded package as one graph
computes the right values only for the first inputs after capture and NaN for any other (H200;
docs/aoti.md, "GPU-only failures"). All graphs of a backend share one memory pool for their
intermediates (`GraphPool`, `AOTIBackend.pool`), so N graphs cost N x (static inputs + outputs),
not N x workspace. Larger engines run the package directly: their kernels are long enough to hide
the launches, and static copies of multi-GB stream caches would cost more memory and bandwidth
than the graph saves. Capture is a loading option (`runtime.load(..., cuda_graphs=False)`);
C2W_AOTI_CUDA_GRAPHS=0 or 1, when set, overrides it (`cuda_graphs_setting`).
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence

import torch

from c2w.runtime.engines.base import ArtifactInfo, Backend, Engine, torch_dtype
from c2w.runtime.engines.graphs import CapturedCall, GraphPool, as_list
from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.dit import euler_schedule
from c2w.runtime.trim import CacheTrim
from c2w.runtime.units import copy_bytes, tensor_bytes


class EulerReplay:
    """The whole n-step solve from one compiled step: same inputs/outputs as the CFM unit.

    Each step's outputs are written once, straight into the stacked (steps, ...) caches the
    solve returns (a graphed step copies its static outputs there; a plain package's fresh
    outputs are copied there). A step built with `chunk_frames` (manifest extra "step_att":
    "chunk_frames", runtime.units.CFMStepUnit) returns of its new attention cache only the
    chunk's T frames; the frames after them are the step's input cache as it came in, copied
    there from the input once. Given the stream's `trim` (runtime.trim.CacheTrim) such a replay
    writes only the frames the trim keeps when the chunk's frames lead them (P >= T): the solve
    returns the trimmed cache, and the input frames the trim drops are never copied. Nothing a step returns
    is kept: a package loaded with run_single_threaded=True may hand back the same buffers on
    every call.
    """

    def __init__(self, step, n_steps: int, device: torch.device, chunk_frames: bool = False):
        self.step, self.chunk_frames = step, chunk_frames
        _, dts = euler_schedule(n_steps)
        self.s = [torch.tensor([s], dtype=torch.int64, device=device) for s in range(n_steps)]
        self.dt = [torch.tensor([v], dtype=torch.float32, device=device) for v in dts]

    def __call__(self, mu, spk, cond, x0, cnn_cache, att_cache, trim: CacheTrim | None = None):
        T, L = mu.shape[2], att_cache.shape[-2]
        # upstream order: the chunk's frames first, then the cache; `runs` are the frames written
        runs = self._runs(T, L, trim)
        att_shape = list(att_cache.shape)
        att_shape[-2] = sum(length for _, length in runs)
        x = torch.empty(x0.shape, dtype=torch.float32, device=x0.device)
        cnn_out, att_out = torch.empty_like(cnn_cache), att_cache.new_empty(att_shape)
        if self.chunk_frames:           # the input cache's kept frames, for all steps at once
            at = 0
            for start, length in runs:
                lo = max(start, T)                         # frames [T, T + L) are the input's
                if start + length > lo:
                    copy_bytes(att_out.narrow(-2, at + lo - start, start + length - lo),
                               att_cache.narrow(-2, lo - T, start + length - lo))
                at += length
        x_in = x0
        for s in range(len(self.s)):
            args = (mu, spk, cond, x_in, cnn_cache[s], att_cache[s], self.s[s], self.dt[s])
            outs = (x, cnn_out[s], att_out[s].narrow(-2, 0, T) if self.chunk_frames else att_out[s])
            if isinstance(self.step, CapturedCall):
                self.step(*args, out=outs)
            else:
                for dst, src in zip(outs, as_list(self.step(*args))):
                    copy_bytes(dst, src)
            x_in = x
        return x, cnn_out, att_out

    def _runs(self, T: int, L: int, trim: CacheTrim | None) -> list[tuple[int, int]]:
        """The runs of the T + L frames of the new cache that the solve writes: those `trim`
        keeps when the chunk's T frames lead them (each step writes its T frames in one piece),
        else all (Engine.run trims after)."""
        if self.chunk_frames and trim is not None:
            runs = trim.kept(T + L)
            if runs[0][0] == 0 and runs[0][1] >= T:
                return runs
        return [(0, T + L)]

    def release(self) -> None:
        if isinstance(self.step, CapturedCall):
            self.step.release()


def graph_inputs(info: ArtifactInfo) -> tuple[list[tuple[int, ...]], list[torch.dtype]]:
    """Shapes and dtypes of what one CUDA graph of this artifact takes: the unit's inputs, or for
    a CFM step package ONE step's (mu, spk, cond, x, cnn and att caches of that step, its index, dt)."""
    shapes, dtypes = [tuple(s) for s in info.input_shapes], [torch_dtype(d) for d in info.input_dtypes]
    return step_graph_inputs(shapes, dtypes) if (info.extra or {}).get("cfm_step") else (shapes, dtypes)


def step_graph_inputs(shapes: list, dtypes: list) -> tuple[list, list]:
    """The CFM unit's input shapes and dtypes -> one Euler step's (its graph's inputs)."""
    return [tuple(s) for s in shapes[:4]] + [tuple(s[1:]) for s in shapes[4:6]] + [(1,), (1,)], \
        list(dtypes) + [torch.int64, torch.float32]


def nbytes(shapes, dtypes) -> int:
    return sum(tensor_bytes(shape, dt) for shape, dt in zip(shapes, dtypes))


# Measured on the H200 (depth-2 CFM proxy, run 3 at ee67881; docs/aoti.md): graphs pay off where launches
# dominate (CFM B=1: 3.2 vs 10.0 ms; B=8: 4.3 vs 10.1 ms per 2-block solve) and not at B=32
# (7.8 vs 7.8 ms), where one step's static att cache alone is 0.6-0.8 GB.
GRAPH_MAX_BYTES = 512 << 20


def check_layout(table: Mapping[str, torch.Tensor], built: Mapping[str, Sequence[int]]) -> None:
    """Refuse shared weights stored in another memory layout than the package was built for.

    `load_constants(..., user_managed=True)` takes each tensor's pointer as is: a weight whose
    strides differ from the build's is read in the wrong order, silently (e.g. a package built
    before the DiT's conv weights were stored tap-major). `built` holds the strides of the
    weights that were not contiguous at build time (`extra["constant_strides"]`); every other
    weight must be contiguous."""
    bad = []
    for fqn, t in table.items():
        want = built.get(fqn)
        if (t.is_contiguous() if want is None else list(t.stride()) == list(want)):
            continue
        bad.append(f"{fqn}: strides {tuple(t.stride())}, built for {tuple(want) if want else 'contiguous'}")
    if bad:
        raise RuntimeError(f"{len(bad)} shared weights are laid out differently from the package's build "
                           f"(e.g. {bad[0]}); AOTI would read them in the wrong order. Rebuild the artifact "
                           "with this version of c2w (c2w export).")


def load_runner(path: str, device: torch.device, single_threaded: bool):
    """The runner of the AOTI package at `path`.

    torch's `aoti_load_package` first compares the package's recorded host CPU vector ISA with
    this machine's, for a warning only, and finds this machine's by compiling and loading test
    programs with the host compiler. Where Inductor's cache holds none of them yet (a fresh
    machine or container), that took ~60 s of a process's first load on the H200 (docs/aoti.md,
    "The first load"). A CUDA package's kernels are GPU code, and the engine cache already
    refuses a manifest built for another GPU (runtime.cache), so on CUDA the runner is made by
    torch's package loader directly, as `aoti_load_package` does once its check is done. CPU
    packages keep torch's check: their kernels are compiled for the host's vector ISA."""
    if device.type == "cuda":
        try:
            from torch._inductor.package.package import AOTICompiledModel
            loader = torch._C._aoti.AOTIModelPackageLoader
        except (ImportError, AttributeError):       # another torch: its own loading, check included
            pass
        else:
            return AOTICompiledModel(loader(path, "model", single_threaded, 1, -1))
    return torch._inductor.aoti_load_package(path, run_single_threaded=single_threaded)


class AOTIEngine(Engine):
    def __init__(self, info: ArtifactInfo, fn, device: torch.device, keep: list):
        self.info, self._fn, self.device, self._keep = info, fn, device, keep

    def run_impl(self, inputs: Sequence[torch.Tensor], trim: CacheTrim | None = None) -> list[torch.Tensor]:
        args = [t.to(self.device).contiguous() for t in inputs]
        if isinstance(self._fn, EulerReplay):
            return as_list(self._fn(*args, trim=trim))
        return as_list(self._fn(*args))

    def release(self) -> None:
        if isinstance(self._fn, (EulerReplay, CapturedCall)):
            self._fn.release()
        self._fn = None
        self._keep = []


CUDA_GRAPHS_ENV = "C2W_AOTI_CUDA_GRAPHS"


def cuda_graphs_setting(requested: bool | None = None) -> bool:
    """Whether AOTI engines are captured in CUDA graphs at load: C2W_AOTI_CUDA_GRAPHS when set
    ('0' or '1'), else `requested` (the loading option), else on. The variable overrides the
    argument so that an operator can switch capture for a process without changing its code."""
    if requested not in (None, True, False):
        raise C2WUserError("cuda_graphs", repr(requested), "True, False or None (the backend's default)")
    raw = os.environ.get(CUDA_GRAPHS_ENV, "").strip()
    if raw:
        if raw not in ("0", "1"):
            raise C2WUserError(f"environment variable {CUDA_GRAPHS_ENV}", repr(raw), "'0' (no CUDA graphs) or '1'",
                               "Or unset it to follow the loading option (runtime.load(..., cuda_graphs=...)).")
        return raw == "1"
    return True if requested is None else bool(requested)


class AOTIBackend(Backend):
    name = "aoti"
    suffix = ".pt2"
    captures_cuda_graphs = True

    def __init__(self, cuda_graphs: bool | None = None, graph_max_bytes: int | None = GRAPH_MAX_BYTES):
        """cuda_graphs: capture engines that fit `graph_max_bytes` (None: on); C2W_AOTI_CUDA_GRAPHS
        overrides it (cuda_graphs_setting)."""
        self.cuda_graphs = cuda_graphs_setting(cuda_graphs)
        self.graph_max_bytes = graph_max_bytes      # None: capture every engine
        self._pools: dict[torch.device, GraphPool] = {}

    def graphed(self, info: ArtifactInfo, device: torch.device) -> bool:
        """Whether `load` captures this artifact (a CFM package: each of its steps) in a CUDA graph:
        on CUDA, when the static inputs of one graph are at most `graph_max_bytes`."""
        return (self.cuda_graphs and device.type == "cuda" and bool(info.input_shapes)
                and (self.graph_max_bytes is None or nbytes(*graph_inputs(info)) <= self.graph_max_bytes))

    def pool(self, device: torch.device) -> GraphPool:
        """The pool new graphs on `device` capture into: shared while any of its graphs lives."""
        if device not in self._pools or self._pools[device].retired:
            self._pools[device] = GraphPool(device)
        return self._pools[device]

    def release_shared(self) -> None:
        self._pools.clear()

    def require(self) -> None:
        return None                     # part of torch

    def version(self) -> str:
        return f"torch-{torch.__version__}"

    def load(self, info: ArtifactInfo, weights: Mapping[str, torch.Tensor] | None,
             device: torch.device) -> Engine:
        if weights is None:
            raise ValueError("AOTI packages are built without weights: pass the component's shared weights")
        graphed = self.graphed(info, device)
        runner = load_runner(str(info.path), device, single_threaded=graphed)
        keep = [runner]
        if not (info.extra or {}).get("constants_in_so"):
            table, missing = {}, []
            for fqn in runner.get_constant_fqns():
                t = weights.get(fqn)
                if t is None:
                    missing.append(fqn)
                else:
                    table[fqn] = t if t.device == device else t.to(device)
            if missing:
                raise RuntimeError(f"{len(missing)} constants have no shared tensor, e.g. {missing[:4]}")
            check_layout(table, (info.extra or {}).get("constant_strides", {}))
            runner.load_constants(table, check_full_update=True, user_managed=True)
            keep.append(table)
        fn = CapturedCall(runner, *graph_inputs(info), device, self.pool(device)) if graphed else runner
        if (info.extra or {}).get("cfm_step"):
            fn = EulerReplay(fn, int(info.extra.get("n_steps", 10)), device,
                             chunk_frames=info.extra.get("step_att") == "chunk_frames")
        return AOTIEngine(info, fn, device, keep)
