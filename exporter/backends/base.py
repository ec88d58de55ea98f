"""The build side of a backend: what one needs to join `c2w export` (exporter/export.py).

The export loop owns everything that is the same for every backend: which keys to build (plan,
budget, shard), whether an existing artifact can be kept (identity, file intact), timing, the
artifact's size and sha256, verification against eager, per-key failure and the manifest. A
`Builder` only builds, and declares what the loop cannot know:

- `artifact_group(key)`: which keys share one artifact file (the graph policy). ONNX Runtime and
  AOTInductor: one exact-shape artifact per key. TensorRT: one plan per graph variant, holding
  one exact-shape profile per key.
- `artifact_name(group, ...)`: the file's name (its suffix is the runtime backend's).
- `build_options(profile)`: settings beyond the manifest's identity fields that change the
  artifact (they join each entry's identity, so a resumed export rebuilds what they changed).
- `build(job)`: write the artifact for one group, return one manifest `extra` per key.
- `check(job)`: what `c2w export --dry-run` does for one group without building it.

The runtime side (load and run an artifact) is `runtime.engines`; a builder holds its backend
for the SDK check, the version and the suffix.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path

import torch

from c2w.runtime.engines.base import Backend
from c2w.runtime.units import SPECS, ShapeKey

EXAMPLE_SEED = 0          # the inputs a graph is traced with (verification uses others)


@dataclass
class BuildJob:
    """One artifact to build: the keys that share it (in manifest order) and their unit modules,
    built once by the export loop."""
    model: object                    # runtime.model.weights.Code2Wav, at the profile's precision
    device: torch.device
    profile: object                  # exporter.profile.Profile
    group: str
    keys: list[ShapeKey]
    units: list[torch.nn.Module]
    path: Path                       # where the artifact goes
    out_dir: Path                    # the artifact directory (manifest paths are relative to it)
    build_options: dict              # Builder.build_options(profile), as the entries' identity records them
    findings: list = field(default_factory=list)   # compatibility findings to show the user

    def example_inputs(self, key: ShapeKey) -> list[torch.Tensor]:
        return SPECS[key.component].example_inputs(self.model.cfg, key, seed=EXAMPLE_SEED,
                                                   device=self.device)


class Builder(abc.ABC):
    def __init__(self, backend: Backend):
        self.backend = backend

    @property
    def name(self) -> str:
        return self.backend.name

    def artifact_group(self, key: ShapeKey) -> str:
        """Keys with the same group share one artifact file. Default: one artifact per key."""
        return key.id

    def artifact_name(self, group: str, backend_version: str, device_name: str) -> str:
        return f"{group}{self.backend.suffix}"

    def build_options(self, profile) -> dict:
        """Build settings that change the artifact beyond the manifest's identity fields."""
        return {}

    @abc.abstractmethod
    def build(self, job: BuildJob) -> list[dict]:
        """Write the artifact `job.path` for `job.keys`; return each key's manifest `extra`.
        Raise on failure: the loop records the error on every key of the group and goes on."""

    def check(self, job: BuildJob) -> None:
        """A dry run's work for one group (nothing by default); findings go to `job.findings`."""

    def dry_run_summary(self, profile, out_dir: Path) -> str:
        """What `c2w export --dry-run` is about to do, said before it starts."""
        return f"dry run: plans the keys of {profile.name} ({profile.backend}); writes nothing"
