"""The small protocol every backend implements on the runtime side (load and run an artifact).

The exporter side (build an artifact from an exported program / ONNX graph) lives in
`exporter/backends/`, because the serving process must never import build code.

A backend module exports one subclass of `Backend`. Its SDK is imported lazily inside methods, so
`import runtime` works with none of them installed; `require()` raises `MissingBackendError`
with the exact install line.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch


@dataclass(frozen=True)
class ArtifactInfo:
    """What the runtime knows about one built artifact (from the manifest)."""
    path: Path                      # the artifact file
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]   # torch dtype names, e.g. "float16", "int64"
    extra: Mapping[str, object] = None   # backend-specific manifest fields (e.g. TRT profile index)


class Engine(abc.ABC):
    """One loaded artifact for one exact ShapeKey. Not thread-safe: the cache serialises calls."""

    info: ArtifactInfo

    @abc.abstractmethod
    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run on `inputs` (in `info.input_names` order, exact shapes); return outputs in order."""

    def release(self) -> None:
        """Free whatever the engine holds (sessions, contexts, graphs). Idempotent."""


class Backend(abc.ABC):
    name: str = ""
    suffix: str = ""                # artifact file suffix, e.g. ".onnx", ".pt2", ".plan"

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
