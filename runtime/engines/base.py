"""The small protocol every backend implements on the runtime side (load and run an artifact).

The exporter side (build an artifact from an exported program / ONNX graph) lives in
`exporter/backends/`, because the serving process must never import build code.

A backend module exports one subclass of `Backend`. Its SDK is imported lazily inside methods, so
`from c2w import runtime` works with none of them installed; `require()` raises `MissingBackendError`
with the exact install line.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

from c2w.runtime.errors import C2WUserError, check_shape
from c2w.runtime.ring import logical
from c2w.runtime.trim import CacheTrim, trim_last


@dataclass(frozen=True)
class ArtifactInfo:
    """What the runtime knows about one built artifact (from the manifest)."""
    path: Path                      # the artifact file
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]   # torch dtype names, e.g. "float16", "int64"
    extra: Mapping[str, object] = None   # backend-specific manifest fields (e.g. TRT profile index)


def torch_dtype(name: str) -> torch.dtype:
    """'float16' -> torch.float16 (the names ArtifactInfo.input_dtypes holds)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise C2WUserError("artifact input dtype", repr(name), "a torch dtype name such as 'float16' or 'int64'")
    return dtype


def check_inputs(info: ArtifactInfo, inputs: Sequence[torch.Tensor]) -> None:
    """Raise C2WUserError unless `inputs` are the artifact's: their number, and each one's exact
    shape and dtype (the unit spec's for the key, recorded in `info`)."""
    names = info.input_names
    if len(inputs) != len(names):
        raise C2WUserError(f"inputs for {Path(info.path).name}", f"{len(inputs)} tensors",
                           f"{len(names)} tensors {list(names)}")
    for name, t, shape, dtype in zip(names, inputs, info.input_shapes, info.input_dtypes):
        check_shape(name, t, shape, torch_dtype(dtype))


class Engine(abc.ABC):
    """One loaded artifact for one exact ShapeKey. Not thread-safe: the cache serialises calls.

    `run` checks the inputs against the artifact (`check_inputs`), then calls the backend's
    `run_impl`: a backend never sees a tensor of another shape or dtype."""

    info: ArtifactInfo
    takes_rings = False         # whether run_impl takes a runtime.ring.RingCache as it is
    solve_graphs = None         # where it solves resident rings in whole-solve graphs: their SolveGraphs

    def run(self, inputs: Sequence[torch.Tensor], trim: CacheTrim | None = None) -> list[torch.Tensor]:
        """Run on `inputs` (in `info.input_names` order, exact shapes); return outputs in order,
        the last one (the attention cache of the encoder and the CFM) trimmed by `trim`. A cache
        held as a RingCache reaches an engine that does not take rings as its logical tensor."""
        check_inputs(self.info, inputs)
        if not self.takes_rings:
            inputs = [logical(t) for t in inputs]
        return trim_last(self.run_impl(inputs, trim), trim)

    @abc.abstractmethod
    def run_impl(self, inputs: Sequence[torch.Tensor], trim: CacheTrim | None = None) -> list[torch.Tensor]:
        """`run` after the inputs were checked. An engine may apply `trim` itself as it writes
        its outputs (AOTI's Euler replay does); `run` trims after it, a no-op on a trimmed cache."""

    def release(self) -> None:
        """Free whatever the engine holds (sessions, contexts, graphs). Idempotent."""


class Backend(abc.ABC):
    """One backend's runtime side, including its CUDA-graph policy: `cuda_graphs` (the loading
    option as this backend resolved it) and `graphed(info, device)` (whether `load` captures that
    artifact). A backend that never captures keeps the defaults: off, nothing graphed. How a
    backend captures is runtime.engines.graphs (`CapturedCall`, `GraphPool`)."""
    name: str = ""
    suffix: str = ""                # artifact file suffix, e.g. ".onnx", ".pt2", ".plan"
    captures_cuda_graphs = False    # True: the constructor takes `cuda_graphs` (the loading option)
    cuda_graphs: bool = False       # whether this instance captures engines in CUDA graphs at load

    def graphed(self, info: ArtifactInfo, device: torch.device) -> bool:
        """Whether `load(info, ..., device)` returns an engine replayed from a CUDA graph (what the
        runtime serves for that key, and what `c2w bench` reports as served)."""
        return False

    def solve_graphed(self, info: ArtifactInfo, device: torch.device) -> bool:
        """Whether `load(info, ..., device)` returns a CFM engine that, though not graphed per call,
        solves the rings it returned and is handed back in one CUDA graph per ring (what the
        runtime serves a resident batch's steady chunks from: runtime.engines.solve_graphs)."""
        return False

    @abc.abstractmethod
    def require(self) -> None:
        """Import the SDK or raise MissingBackendError saying what to install."""

    @abc.abstractmethod
    def version(self) -> str:
        """SDK version string that goes into the manifest identity."""

    @abc.abstractmethod
    def load(self, info: ArtifactInfo, weights: Mapping[str, torch.Tensor] | None,
             device: torch.device) -> Engine:
        """Load one artifact. `weights`: the component's shared weights (FQN -> tensor), for
        backends whose artifacts are built without them; None when the artifact embeds them."""

    def release_shared(self) -> None:
        """Drop state shared across this backend's engines (e.g. shared scratch memory)."""
