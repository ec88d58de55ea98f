"""The planner's estimate of a key's device bytes: what it keeps resident once loaded and run, next to
the keys loaded before it (the quantity runtime.memory measures; the eager weights excluded).

Two models (docs/budget.md, "The estimate"):

- **AOTInductor on CUDA** depends on load order, so it is a simulation of the load (`GraphPoolSizes`).
  A key keeps its package (~2 MiB of kernels) and, if captured in a CUDA graph, its static inputs
  (HiFT's package also carries its own constants). Its graph's outputs and intermediates come
  from ONE memory pool all graphs of the process share (runtime.engines.graphs): the outputs stay,
  the intermediates are freed when the capture ends and serve later captures. PyTorch's caching
  allocator places a tensor in one free block, so freed memory serves a later request only if it
  came in blocks at least that large: the CFM and the encoder free per-layer caches (tens of MiB),
  HiFT large signals. The pool is kept as extents (block size, free bytes): a capture's outputs
  take an extent whose blocks hold them, else the pool grows by them; its intermediates reuse the
  free bytes of extents with blocks at least as large as their tensors, and what is missing grows
  the pool by a new extent. The process's first graph brings a fixed amount the later ones share.
  A key whose graph inputs exceed GRAPH_MAX_BYTES is not captured: its package alone.
- **Everything else** (ONNX Runtime, TensorRT, AOTInductor on the CPU), order-free (`FixedSizes`):
  inputs + outputs (about the inputs' size, the caches growing by a chunk) + a workspace as large
  as the largest input. On the CPU the measurement replaces it at every export.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from c2w.runtime.engines.aoti import GRAPH_MAX_BYTES, nbytes, step_graph_inputs
from c2w.runtime.model.config import ModelConfig
from c2w.runtime.units import SPECS, ShapeKey, dtype_of, tensor_bytes

MiB = 1 << 20
# PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp): a request of at most 1 MiB is cut from
# a 2 MiB segment of the small-block pool, one under 10 MiB from a 20 MiB segment, a larger one gets a
# segment of its own, rounded up to 2 MiB; blocks of a segment merge when freed, so freed memory
# comes back in blocks of its segment's size, and small and large requests never share blocks.
SMALL_REQUEST_BYTES, SMALL_SEGMENT_BYTES = 1 * MiB, 2 * MiB
SEGMENT_BYTES, MIN_OWN_SEGMENT_BYTES, PAGE_BYTES = 20 * MiB, 10 * MiB, 2 * MiB

# A package's own device memory: the four B=32 CFM keys too large to capture measured 2 MiB each (run 10).
PACKAGE_BYTES = 2 * MiB


@dataclass(frozen=True)
class PoolModel:
    """The simulation's fitted constants (benchmarks/h200/estimate_fit.py --fit fits them to a
    measured sweep and prints this dataclass). The intermediates' structure comes from Inductor's
    wrapper of each unit (traced on the CPU; the CUDA wrapper was not traced), their sizes from the fit:
    - the process's first captured graph brings memory the later ones share;
    - a CFM Euler step keeps its 16 per-layer attention caches until it stacks them into its
      outputs, plus activations per row and frame; a prompt step (L = 0) keeps its 32 padded conv
      inputs instead (the CPU wrapper frees those early);
    - the encoder keeps its per-layer caches (in halves of a layer's) and their two stacks (in
      tensors of 0.3 of the stack), as factors of its output attention cache, plus activations;
    - HiFT's intermediates are its upsampled signals, per output sample, in `hift_blocks` blocks,
      per the unit's dtype (float16 convolutions keep narrower signals); its package's
      own constants are the weights plus phase and window tables per mel frame."""
    first_capture: int = 160 * MiB
    cfm_activation: int = 1_540                # bytes per batch row and frame
    encoder_cache_factor: float = 0.175
    encoder_stack_factor: float = 1.0
    encoder_activation: int = 35_000           # bytes per batch row and output frame
    hift_workspace: tuple[tuple[str, int], ...] = (("float32", 667), ("float16", 550))   # bytes per sample
    hift_blocks: int = 9
    hift_table: int = 108_000                  # bytes per mel frame

    def hift_workspace_bytes(self, dtype: str) -> int:
        return dict(self.hift_workspace)[dtype]


# Fitted to two H200 sweeps of h200.yaml's 96 keys, each loaded in its plan order in one process (torch
# 2.11): run 14 (benchmarks/h200/results/run14_sweep: float16 HiFT, captures sharing one warm-up stream,
# the traffic ranking's order) and run 11 (run11_sweep: float32 HiFT, priority order, replayed with the
# 32 MiB stream workspace of its first 30 captures): a fit by `estimate_fit.py run14_sweep run11_sweep@32
# --fit` from the run-10 constants, rounded (88 of 96 keys of run 14, 71 of run 11).
FITTED = PoolModel()


@dataclass(frozen=True)
class KeyCost:
    """What loading one key costs on CUDA, before the pool's state is known."""
    own: int                          # outside the graph pool: package, static inputs, HiFT's constants
    outputs: int = 0                  # the graph's outputs (kept in the pool); 0 when not captured
    parts: tuple[tuple[int, int], ...] = ()   # its intermediates: (bytes, bytes per tensor), freed at the end

    @property
    def captured(self) -> bool:
        return self.outputs > 0


def segment(nbytes: int | float) -> int:
    """The block a tensor of `nbytes` comes back in once its segment is free (the allocator above)."""
    if nbytes <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    return SEGMENT_BYTES if nbytes < MIN_OWN_SEGMENT_BYTES else pages(nbytes)


def holds(block: int, request: int | float) -> bool:
    """Whether free blocks of size `block` serve a request of `request` bytes (same pool, large enough)."""
    return block >= request and (block == SMALL_SEGMENT_BYTES) == (request <= SMALL_REQUEST_BYTES)


def pages(nbytes: int | float) -> int:
    return int(math.ceil(nbytes / PAGE_BYTES)) * PAGE_BYTES


def _encoder(cfg: ModelConfig, key: ShapeKey, m: PoolModel) -> tuple[int, tuple]:
    """Outputs: mu (B, 80, T) f32, cnn cache (B, D, 2 + 2 stride), att cache (layers, B, heads, C + T,
    2 d_k), T = stride * (N - lookahead) (N on the last chunk); the first layers' caches hold half as
    many frames (25 Hz)."""
    e, (B, N, C, last), dt = cfg.encoder, key.dims, dtype_of(key.dtype)
    T = e.up_stride * (N if last else N - e.pre_lookahead)
    layers = e.blocks + e.up_blocks
    att = tensor_bytes((layers, B, e.heads, C + T, 2 * e.d_k), dt)
    out = att + tensor_bytes((B, cfg.mel_bins, T), torch.float32) + tensor_bytes((B, e.width, 2 + 2 * e.up_stride), dt)
    act = m.encoder_activation * B * T
    return out, ((m.encoder_cache_factor * att, att / layers / 2), (m.encoder_stack_factor * att, 0.3 * att),
                 (act, act / layers))


def _cfm_step(cfg: ModelConfig, key: ShapeKey, m: PoolModel, step_att: str) -> tuple[int, tuple]:
    """Outputs and intermediates of one Euler step in the form it was built (manifest extra
    "step_att"). The fit's measurements (runs 10-14) are of the step that returned its whole att
    cache (depth, 2B, heads, L + T, 2 head_dim) with x (B, 80, T) f32 and the cnn cache (depth, 2B,
    2 hidden, 2), and that kept each block's [new | cache] as an intermediate; the chunk-frames step
    (runs 18-20) is estimated as that one. The in-place step (runtime.units.CFMStepUnit) returns
    x and the cnn cache only and builds no per-block cache: the same model without them (its
    static inputs, one step's buffers of T + L frames, are `step_graph_inputs`'), not yet fitted
    to a measurement."""
    d, (B, T, L), dt = cfg.dit, key.dims, dtype_of(key.dtype)
    out = tensor_bytes((B, cfg.mel_bins, T), torch.float32) + tensor_bytes((d.depth, 2 * B, 2 * d.hidden, 2), dt)
    pad = tensor_bytes((2 * B, T + 2, d.hidden), dt)
    act = m.cfm_activation * B * T
    if step_att == "in_place":
        return out, ((2 * d.depth * pad, pad), (act, act / d.depth))
    att = tensor_bytes((d.depth, 2 * B, d.heads, L + T, 2 * d.head_dim), dt)
    kept = (att, att / d.depth) if L else (2 * d.depth * pad, pad)
    return out + att, (kept, (act, act / d.depth))


def _hift(cfg: ModelConfig, key: ShapeKey, m: PoolModel) -> tuple[int, tuple]:
    """Outputs: speech (B, n) and source (B, 1, n) f32, n = F * samples_per_frame."""
    B, F, _ = key.dims
    samples = B * F * cfg.hift.samples_per_frame
    work = m.hift_workspace_bytes(key.dtype) * samples
    return 2 * tensor_bytes((samples,), torch.float32), ((work, work / m.hift_blocks),)


CAPTURES = {"flow_encoder": _encoder, "hift": _hift}       # the CFM's: _cfm_step, by its step's form


def step_form(cfg: ModelConfig) -> str:
    """The form of the CFM step the exporter builds now (the spec's export variant's "step_att")."""
    return SPECS["cfm"].export_variant.extra(cfg).get("step_att", "whole")


def key_cost(cfg: ModelConfig, key: ShapeKey, weights: dict[str, int], m: PoolModel = FITTED,
             step_att: str | None = None) -> KeyCost:
    """A key's costs as AOTInductor on CUDA loads it (runtime.engines.aoti): captured in a CUDA graph
    when one graph's inputs (a CFM key's: one Euler step's) are within GRAPH_MAX_BYTES, else its
    package alone (its inputs and outputs are one call's). weights: per-component weight bytes
    (HiFT's package carries its own copy). step_att: the form a CFM key's step was built in
    (a manifest entry's extra; None: the form built now, `step_form`)."""
    spec = SPECS[key.component]
    shapes, dtypes = list(spec.input_shapes(cfg, key)), list(spec.input_dtypes(key))
    form = step_att or step_form(cfg)
    if key.component == "cfm":
        shapes, dtypes = step_graph_inputs(shapes, dtypes, in_place=form == "in_place")
    static = nbytes(shapes, dtypes)
    if static > GRAPH_MAX_BYTES:
        return KeyCost(PACKAGE_BYTES)
    own = PACKAGE_BYTES + static
    if key.component == "hift":
        own += weights.get("hift", 0) + m.hift_table * key.dim("F")
    out, parts = _cfm_step(cfg, key, m, form) if key.component == "cfm" else CAPTURES[key.component](cfg, key, m)
    return KeyCost(own, out, tuple((int(n), int(size)) for n, size in parts if n))


class GraphPoolSizes:
    """AOTInductor keys on CUDA loaded one after another into one process: `cost(key)` is what the
    key would add after the keys `add`ed before it (module docstring).

    captured: a graph was captured before the first key (the first capture's bytes are paid already)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, int], captured: bool = False, model: PoolModel = FITTED):
        self.cfg, self.weights, self.captured, self.model = cfg, weights, captured, model
        self.extents: list[list[int]] = []       # the graph pool's free memory: [block size, free bytes]

    def _place(self, c: KeyCost) -> tuple[int, int | None, list[list[int]]]:
        """(bytes the pool grows by, index of the extent that takes the outputs or None, new extents)."""
        if not c.captured:
            return 0, None, []
        free = [n for _, n in self.extents]
        fit = [i for i, (block, n) in enumerate(self.extents) if holds(block, c.outputs) and n >= c.outputs]
        slot = min(fit, key=lambda i: self.extents[i][0]) if fit else None
        if slot is not None:
            free[slot] -= c.outputs
        new = []
        for n, size in c.parts:             # each part takes the smallest blocks that hold its tensors first
            for i in sorted(range(len(free)), key=lambda i: self.extents[i][0]):
                if holds(self.extents[i][0], size):
                    take = min(free[i], n)
                    free[i], n = free[i] - take, n - take
            if n > 0:
                new.append([segment(size), pages(n)])
        grow = (pages(c.outputs) if slot is None else 0) + sum(n for _, n in new)
        return grow + (0 if self.captured else self.model.first_capture), slot, new

    def cost(self, key: ShapeKey, step_att: str | None = None) -> int:
        c = key_cost(self.cfg, key, self.weights, self.model, step_att)
        return c.own + self._place(c)[0]

    def add(self, key: ShapeKey, step_att: str | None = None) -> int:
        """Load `key` after the keys added so far; -> the bytes it adds (= cost(key) before).
        step_att: key_cost's (a measured sweep's keys are replayed in the form they were built)."""
        c = key_cost(self.cfg, key, self.weights, self.model, step_att)
        grow, slot, new = self._place(c)
        if slot is not None:
            self.extents[slot][1] -= c.outputs
        self.extents += new
        self.captured = self.captured or c.captured
        return c.own + grow


class FixedSizes:
    """Sizes that do not depend on load order: `cost(key)` = `add(key)` = `sizes[key]`."""

    def __init__(self, sizes: dict[ShapeKey, int]):
        self.sizes = sizes

    def cost(self, key: ShapeKey) -> int:
        return self.sizes[key]

    def add(self, key: ShapeKey) -> int:
        return self.sizes[key]


def order_free_bytes(cfg: ModelConfig, key: ShapeKey) -> int:
    """Inputs + outputs (about the inputs' size) + a workspace as large as the largest input."""
    spec = SPECS[key.component]
    sizes = [tensor_bytes(shape, dt) for shape, dt in zip(spec.input_shapes(cfg, key), spec.input_dtypes(key))]
    return 2 * sum(sizes) + max(sizes)


def sequential(backend: str, device: str) -> bool:
    """Whether a key's bytes depend on the keys loaded before it (AOTInductor on CUDA)."""
    return backend == "aoti" and device.startswith("cuda")


def key_sizes(cfg: ModelConfig, keys: list[ShapeKey], backend: str, device: str,
              weights: dict[str, int]) -> GraphPoolSizes | FixedSizes:
    """A fresh load of `keys` (any subset, in any order) for the planner's budget fill."""
    if sequential(backend, device):
        return GraphPoolSizes(cfg, weights)
    return FixedSizes({k: order_free_bytes(cfg, k) for k in keys})


def estimate_bytes(cfg: ModelConfig, key: ShapeKey, backend: str = "", device: str = "cpu",
                   weights: dict[str, int] | None = None) -> int:
    """A key's bytes loaded on its own (AOTInductor on CUDA: into an empty graph pool, leaving out
    what only the process's first graph brings): what the traffic ranking weighs a key by."""
    if sequential(backend, device):
        return GraphPoolSizes(cfg, weights or {}, captured=True).cost(key)
    return order_free_bytes(cfg, key)
