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
is: copy inputs in, one replay, clone outputs out. For the CFM that graph is ONE Euler step,
replayed n times per chunk: the first design, the n-step replay of a whole-cache step captured
as one graph, computed the right values only for the first inputs after capture and NaN for any
other (H200; docs/aoti.md, "GPU-only failures"). All graphs of a backend share one memory pool
for their intermediates (`GraphPool`, `AOTIBackend.pool`), so N graphs cost N x (static inputs
+ outputs), not N x workspace. An in-place CFM step too large for that (a step's static
attention buffers would be GBs at B=32) runs as the package's own calls, except for resident
stream batches: a ring handed back to the replay that returned it is solved by one graph of the
whole solve over that ring's buffer (runtime.engines.solve_graphs). Other large engines run the
package directly: their kernels are long enough to hide the launches. Capture is a loading
option (`runtime.load(..., cuda_graphs=False)`); C2W_AOTI_CUDA_GRAPHS=0 or 1, when set,
overrides it (`cuda_graphs_setting`). A package that is captured in any way is loaded with
run_single_threaded=True; the others keep AOTI's thread-safe run (the engine cache serialises
the calls of each engine either way).
"""
from __future__ import annotations

import contextlib
import os
from typing import Mapping, Sequence

import torch

from c2w.runtime.engines.base import ArtifactInfo, Backend, Engine, torch_dtype
from c2w.runtime.engines.graphs import CapturedCall, GraphPool, as_list
from c2w.runtime.engines.solve_graphs import SOLVE_GRAPHS, SolveGraphs
from c2w.runtime.errors import C2WUserError
from c2w.runtime.ring import RingCache, logical
from c2w.runtime.model.dit import euler_schedule
from c2w.runtime.trim import CacheTrim
from c2w.runtime.units import copy_bytes, tensor_bytes


class EulerReplay:
    """The whole n-step solve from one compiled step: same inputs/outputs as the CFM unit.

    The step's form is its manifest extra "step_att" (runtime.units.CFMStepUnit builds the first):

    - "in_place": the step writes the chunk's frames into slots of per-block buffers and attends
      to the whole buffer; nothing returns a cache. The replay holds the solve's new cache as a
      runtime.ring.RingCache: given a ring with exactly T free slots (the previous chunk's, once
      the trim drops as many frames as a chunk adds), the chunk writes its frames there and no
      cache frame moves; the trim then only shortens the ring's order. Given a tensor, or a ring
      without T free slots, the cache is laid out anew first (one copy: the chunk's slots, then
      the frames in order), and a tensor in gives a tensor out (Engine.run trims it).
    - "chunk_frames": the step returns of its new attention cache only the chunk's T frames; the
      frames after them are the step's input cache as it came in, copied there from the input
      once. Given the stream's `trim` (runtime.trim.CacheTrim) such a replay writes only the
      frames the trim keeps when the chunk's frames lead them (P >= T).
    - "whole" (packages built before either): the step returns its whole new cache.

    Each step's outputs are written once, straight into the solve's outputs. Nothing a step
    returns is kept: a package loaded with run_single_threaded=True may hand back the same
    buffers on every call. A graphed in-place step (CapturedCall over `step_graph_inputs`) takes
    its blocks' buffers as one static tensor; the replay copies the chunk's slots back out of it.
    An ungraphed in-place step may instead solve the rings it returned, once handed back, from one
    graph of the whole solve over their buffer (`solve_graphs`, runtime.engines.solve_graphs).
    """

    FORMS = ("whole", "chunk_frames", "in_place")

    def __init__(self, step, n_steps: int, device: torch.device, form: str = "whole", solve_graphs: int = 0):
        """solve_graphs: for an in-place step that is not itself graphed, how many whole-solve
        graphs over resident rings to hold at most (runtime.engines.solve_graphs); 0: none."""
        if form not in self.FORMS:
            raise ValueError(f"step form {form!r}: expected one of {self.FORMS}")
        if solve_graphs and (form != "in_place" or isinstance(step, CapturedCall)):
            raise ValueError(f"solve graphs replay an ungraphed in-place step; got a {form!r} step"
                             + (" in a graph of its own" if isinstance(step, CapturedCall) else ""))
        self.step, self.form, self.device = step, form, device
        _, dts = euler_schedule(n_steps)
        self.s = [torch.tensor([s], dtype=torch.int64, device=device) for s in range(n_steps)]
        self.dt = [torch.tensor([v], dtype=torch.float32, device=device) for v in dts]
        self.graphs = SolveGraphs(self._solve_in_place, device, solve_graphs) if solve_graphs else None
        self._done = None               # CUDA event: the last solve's work (`_in_turn`)

    def __call__(self, mu, spk, cond, x0, cnn_cache, att_cache, trim: CacheTrim | None = None):
        if self.form == "in_place":
            return self._in_place(mu, spk, cond, x0, cnn_cache, att_cache, trim)
        chunk_frames = self.form == "chunk_frames"
        T, L = mu.shape[2], att_cache.shape[-2]
        # upstream order: the chunk's frames first, then the cache; `runs` are the frames written
        runs = self._runs(T, L, trim)
        att_shape = list(att_cache.shape)
        att_shape[-2] = sum(length for _, length in runs)
        x = torch.empty(x0.shape, dtype=torch.float32, device=x0.device)
        cnn_out, att_out = torch.empty_like(cnn_cache), att_cache.new_empty(att_shape)
        if chunk_frames:                # the input cache's kept frames, for all steps at once
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
            outs = (x, cnn_out[s], att_out[s].narrow(-2, 0, T) if chunk_frames else att_out[s])
            self._run_step(args, outs)
            x_in = x
        return x, cnn_out, att_out

    def _in_place(self, mu, spk, cond, x0, cnn_cache, att_cache, trim):
        T = mu.shape[2]
        ring = att_cache if isinstance(att_cache, RingCache) else None
        free = ring.free() if ring is not None else []
        kept = ring is not None and len(free) == T and ring.buffer.is_contiguous() and ring.device == x0.device
        if kept:
            buffer, slots, order = ring.buffer, free, ring.order
        else:                           # laid out anew: the chunk's T slots, then the frames in order
            cache = logical(att_cache).to(x0.device)
            L = cache.shape[-2]
            shape = list(cache.shape)
            shape[-2] = T + L
            buffer = cache.new_empty(shape)
            copy_bytes(buffer.narrow(-2, T, L), cache)
            slots, order = list(range(T)), range(T, T + L)
        args = [mu, spk, cond, x0, cnn_cache, self._slots(slots)]
        with self._in_turn():
            out = self.graphs.run(buffer, args) if kept and self.graphs is not None else None
            x, cnn_out = out if out is not None else self._solve_in_place(buffer, *args)
        new = RingCache(buffer, [*slots, *order])
        if ring is None:
            return x, cnn_out, new.logical()        # a tensor in, a tensor out: the buffer in order
        if self.graphs is not None:
            self.graphs.returned(buffer)
        return x, cnn_out, trim.apply(new) if trim is not None else new

    @contextlib.contextmanager
    def _in_turn(self):
        """A replay with solve graphs runs its package single-threaded, graphed or not, and the
        engine cache orders its calls only on the host: on CUDA each solve's stream waits for the
        previous solve's work first, whichever stream that ran on (AOTI's thread-safe run, which
        such packages no longer use, waited on the host), so that two serving lanes' streams never
        run the package's work at once."""
        if self.graphs is None or self.device.type != "cuda":
            yield
            return
        stream = torch.cuda.current_stream(self.device)
        if self._done is not None:
            stream.wait_event(self._done)
        yield
        if self._done is None:
            self._done = torch.cuda.Event()
        self._done.record(stream)

    def _solve_in_place(self, buffer, mu, spk, cond, x0, cnn_cache, index):
        """The n steps over `buffer`, each writing the chunk's frames into slots `index` of its
        step's buffers: (x, new cnn caches), in tensors of their own (a solve graph's own buffers
        when captured, runtime.engines.solve_graphs)."""
        x = torch.empty(x0.shape, dtype=torch.float32, device=x0.device)
        cnn_out = torch.empty_like(cnn_cache)
        x_in = x0
        for s in range(len(self.s)):
            args = (mu, spk, cond, x_in, cnn_cache[s], self.s[s], self.dt[s], index)
            if isinstance(self.step, CapturedCall):
                self.step(*args, buffer[s], out=(x, cnn_out[s]))
                static = self.step.inputs[-1]                   # the blocks' buffers, as the graph left them
                buffer[s].index_copy_(-2, index, static.index_select(-2, index))
            else:
                self._run_step(args + tuple(buffer[s].unbind(0)), (x, cnn_out[s]))
            x_in = x
        return x, cnn_out

    def _run_step(self, args, outs) -> None:
        """One step on `args`, its outputs written into `outs`."""
        if isinstance(self.step, CapturedCall):
            self.step(*args, out=outs)
        else:
            for dst, src in zip(outs, as_list(self.step(*args))):
                copy_bytes(dst, src)

    def _slots(self, slots: list[int]) -> torch.Tensor:
        """The chunk's slots as an int64 tensor on the device; on CUDA through pinned memory, as
        an asynchronous transfer (one from pageable memory waits for the device: the host would
        stall on the chunk's earlier kernels). PyTorch's pinned-memory cache does not reuse the
        host copy before the transfer has read it."""
        host = torch.tensor(slots, dtype=torch.int64)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _runs(self, T: int, L: int, trim: CacheTrim | None) -> list[tuple[int, int]]:
        """The runs of the T + L frames of the new cache that the solve writes: those `trim`
        keeps when the chunk's T frames lead them (each step writes its T frames in one piece),
        else all (Engine.run trims after)."""
        if self.form == "chunk_frames" and trim is not None:
            runs = trim.kept(T + L)
            if runs[0][0] == 0 and runs[0][1] >= T:
                return runs
        return [(0, T + L)]

    def release(self) -> None:
        if isinstance(self.step, CapturedCall):
            self.step.release()
        if self.graphs is not None:
            self.graphs.release()


def graph_inputs(info: ArtifactInfo) -> tuple[list[tuple[int, ...]], list[torch.dtype]]:
    """Shapes and dtypes of what one CUDA graph of this artifact takes: the unit's inputs, or for
    a CFM step package ONE step's (step_graph_inputs)."""
    shapes, dtypes = [tuple(s) for s in info.input_shapes], [torch_dtype(d) for d in info.input_dtypes]
    extra = info.extra or {}
    if not extra.get("cfm_step"):
        return shapes, dtypes
    return step_graph_inputs(shapes, dtypes, in_place=extra.get("step_att") == "in_place")


def step_graph_inputs(shapes: list, dtypes: list, in_place: bool = True) -> tuple[list, list]:
    """The CFM unit's input shapes and dtypes -> one Euler step's, as its graph takes them:
    mu, spk, cond, x, the step's cnn cache, then for an in-place step (runtime.units.CFMStepUnit)
    its index, dt, the chunk's T slots and the blocks' buffers of T + L frames as one tensor
    (depth, 2B, heads, T + L, 2 head_dim); for the older forms the step's att cache, index, dt."""
    head, (cnn, att), (_, cache_dtype) = [tuple(s) for s in shapes[:4]], shapes[4:6], dtypes[4:6]
    if not in_place:
        return head + [tuple(cnn[1:]), tuple(att[1:]), (1,), (1,)], list(dtypes) + [torch.int64, torch.float32]
    T = shapes[0][2]
    buffers = (*att[1:-2], T + att[-2], att[-1])
    return head + [tuple(cnn[1:]), (1,), (1,), (T,), buffers], \
        list(dtypes[:5]) + [torch.int64, torch.float32, torch.int64, cache_dtype]


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


def bind_constants(runner, info: ArtifactInfo, weights: Mapping[str, torch.Tensor],
                   device: torch.device) -> dict[str, torch.Tensor] | None:
    """Bind the shared weights to `runner`'s constants (user-managed: no copy) and return the
    table, which must outlive the runner; None for a package with its constants inside its .so."""
    if (info.extra or {}).get("constants_in_so"):
        return None
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
    return table


class AOTIEngine(Engine):
    takes_rings = True          # run_impl: an in-place replay keeps a ring as it is, else its logical tensor

    def __init__(self, info: ArtifactInfo, fn, device: torch.device, keep: list):
        self.info, self._fn, self.device, self._keep = info, fn, device, keep

    def run_impl(self, inputs: Sequence[torch.Tensor], trim: CacheTrim | None = None) -> list[torch.Tensor]:
        if isinstance(self._fn, EulerReplay) and self._fn.form == "in_place":
            # the attention cache as it is: a ring keeps its buffer (EulerReplay lays out anything else)
            *rest, att = inputs
            return as_list(self._fn(*[t.to(self.device).contiguous() for t in rest], att, trim=trim))
        args = [logical(t).to(self.device).contiguous() for t in inputs]
        if isinstance(self._fn, EulerReplay):
            return as_list(self._fn(*args, trim=trim))
        return as_list(self._fn(*args))

    @property
    def solve_graphs(self) -> SolveGraphs | None:
        """The whole-solve graphs this engine serves resident rings from (None: it has none)."""
        return self._fn.graphs if isinstance(self._fn, EulerReplay) else None

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

    def solve_graphed(self, info: ArtifactInfo, device: torch.device) -> bool:
        """Whether `load` solves resident rings of this artifact in whole-solve graphs
        (runtime.engines.solve_graphs): an in-place CFM step on CUDA that is not graphed per step."""
        extra = info.extra or {}
        return (self.cuda_graphs and device.type == "cuda" and bool(extra.get("cfm_step"))
                and extra.get("step_att") == "in_place" and not self.graphed(info, device))

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
        graphed, solve_graphed = self.graphed(info, device), self.solve_graphed(info, device)
        runner = load_runner(str(info.path), device, single_threaded=graphed or solve_graphed)
        keep = [runner, bind_constants(runner, info, weights, device)]
        extra = info.extra or {}
        form = extra.get("step_att", "whole") if extra.get("cfm_step") else None
        fn = runner
        if graphed:
            # an in-place step's graph takes its blocks' buffers as one tensor (step_graph_inputs)
            call = (lambda *a: runner(*a[:-1], *a[-1].unbind(0))) if form == "in_place" else runner
            fn = CapturedCall(call, *graph_inputs(info), device, self.pool(device))
        if form is not None:
            fn = EulerReplay(fn, int(extra.get("n_steps", 10)), device, form,
                             solve_graphs=SOLVE_GRAPHS if solve_graphed else 0)
        return AOTIEngine(info, fn, device, keep)
