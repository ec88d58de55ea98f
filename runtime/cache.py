"""Shape-keyed engine cache with eager fallback: what a serving process calls per unit.

`EngineCache.run(key, inputs)` runs the built, verified artifact for exactly `key`, or the same
PyTorch unit eagerly when there is none. Nothing here compiles, and nothing here raises into the
serving process because of an artifact: a foreign manifest, a missing, truncated or unloadable
file, or an engine that fails at run time is logged once (file + reason) and served eagerly.
"""
from __future__ import annotations

import copy
import logging
import threading
from collections import defaultdict
from pathlib import Path

import torch

from c2w.runtime.engines import get_backend
from c2w.runtime.engines.aoti import cuda_graphs_setting
from c2w.runtime.errors import C2WUserError
from c2w.runtime.manifest import Entry, Manifest, Status, file_sha256, read_manifest
from c2w.runtime.trim import CacheTrim
from c2w.runtime.units import DTYPE_NAMES, SPECS, EagerRunner, ShapeKey
from c2w.runtime.verify import artifact_info, device_name, entry_key, unit_weights

log = logging.getLogger("c2w.runtime")


def manifest_mismatch(manifest: Manifest, model, backend_version: str | None, device: torch.device) -> str | None:
    """Why this manifest's artifacts cannot serve this model/device, or None if they can."""
    if manifest.model.digest != model.digest:
        return f"model digest {manifest.model.digest} != loaded model {model.digest}"
    if backend_version is not None and manifest.backend.version != backend_version:
        return f"{manifest.backend.name} version {manifest.backend.version} != installed {backend_version}"
    if manifest.device != device_name(device):
        return f"built for device '{manifest.device}', running on '{device_name(device)}'"
    for comp in model.component_modules():
        dt = DTYPE_NAMES[model.component_dtype(comp)]
        if manifest.precision.get(comp) != dt:
            return f"{comp} precision {manifest.precision.get(comp)} != loaded model's {dt}"
    return None


class EngineCache:
    def __init__(self, artifact_dir: str | Path, model, device: torch.device | str = "cpu", *, lazy: bool = True,
                 manifest: Manifest | C2WUserError | None = None, cuda_graphs: bool | None = None):
        """manifest: the directory's manifest already read, or the error reading it gave (then
        everything is served eagerly); None: read it here. cuda_graphs: capture engines in CUDA
        graphs at load (None: the backend's default; runtime.engines.get_backend)."""
        cuda_graphs_setting(cuda_graphs)   # a malformed C2W_AOTI_CUDA_GRAPHS is an error, not an eager cache
        self.cuda_graphs = cuda_graphs
        self.dir = Path(artifact_dir)
        self.model = model
        self.device = torch.device(device)
        self.eager = EagerRunner(model)
        self._entries: dict[ShapeKey, Entry] = {}
        self._engines: dict[ShapeKey, object] = {}
        self._bad: dict[ShapeKey, str] = {}
        self._weights: dict[tuple, dict] = {}
        self._locks: dict[ShapeKey, threading.Lock] = defaultdict(threading.Lock)
        self._load_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._counts = defaultdict(lambda: {"hits": 0, "misses": 0, "failures": 0})
        self._warned_miss: set[ShapeKey] = set()
        self.backend = None
        self.reason_disabled: str | None = None
        self._open(manifest)
        if not lazy:
            for key in list(self._entries):
                self.load(key)

    def load(self, key: ShapeKey) -> bool:
        """Load the engine for `key` now rather than on its first call; True if it is usable."""
        return self._engine(key) is not None

    def replica(self) -> "EngineCache":
        """A cache with engine instances of its own over the same artifacts, counting into the same
        stats: for a thread that runs engines while this cache's users run theirs (an engine is
        not thread-safe, and one backend's CUDA graphs share a memory pool, so their replays take
        turns). Entries, weights and the eager fallback are shared. On CUDA its engines load now:
        a graph capture while other threads launch kernels would collide with them."""
        twin = copy.copy(self)
        twin._engines, twin._bad = {}, dict(self._bad)
        twin._locks, twin._load_lock = defaultdict(threading.Lock), threading.Lock()
        if self.backend is not None:
            twin.backend = get_backend(self.backend.name, cuda_graphs=self.cuda_graphs)
        if self.device.type == "cuda":
            for key in twin.keys:
                twin.load(key)
        return twin

    # ------------------------------------------------------------------ loading
    def _disable(self, reason: str) -> None:
        self.reason_disabled = reason
        log.warning("c2w: serving everything eagerly: %s", reason)

    def _open(self, manifest: Manifest | C2WUserError | None) -> None:
        try:
            if manifest is None:
                manifest = read_manifest(self.dir)
            if isinstance(manifest, C2WUserError):
                raise manifest
        except C2WUserError as e:
            return self._disable(str(e))
        try:
            self.backend = get_backend(manifest.backend.name, cuda_graphs=self.cuda_graphs)
            self.backend.require()
            version = self.backend.version()
        except C2WUserError as e:
            return self._disable(f"{self.dir}: {e}")
        why = manifest_mismatch(manifest, self.model, version, self.device)
        if why:
            return self._disable(f"{self.dir / 'manifest.json'}: {why}")
        for e in manifest.entries:
            if e.status == Status.BUILT and e.parity is not None and e.parity.passed:
                self._entries[entry_key(e)] = e

    def _shared_weights(self, key: ShapeKey) -> dict:
        k = SPECS[key.component].module_key(key)      # keys of one unit module share its weights
        if k not in self._weights:
            self._weights[k] = unit_weights(self.eager.unit(key))
        return self._weights[k]

    def _engine(self, key: ShapeKey):
        if key in self._engines or key in self._bad or key not in self._entries:
            return self._engines.get(key)
        with self._load_lock:
            if key in self._engines or key in self._bad:
                return self._engines.get(key)
            e = self._entries[key]
            path = self.dir / e.artifact
            try:
                if not path.is_file():
                    raise FileNotFoundError("file is missing")
                if path.stat().st_size != e.artifact_bytes or file_sha256(path) != e.artifact_sha256:
                    raise ValueError(f"size/sha256 differ from the manifest (truncated or modified; "
                                     f"{path.stat().st_size} bytes, manifest says {e.artifact_bytes})")
                self._engines[key] = self.backend.load(artifact_info(self.dir, e, self.model.cfg),
                                                       self._shared_weights(key), self.device)
            except Exception as exc:  # a bad artifact must never take the serving process down
                self._bad[key] = f"{type(exc).__name__}: {exc}"
                log.warning("c2w: artifact %s for %s unusable (%s); serving it eagerly", path, key.id, self._bad[key])
            return self._engines.get(key)

    # ------------------------------------------------------------------ serving
    def _count(self, key: ShapeKey, what: str) -> None:
        with self._stats_lock:
            self._counts[key][what] += 1

    def run(self, key: ShapeKey, inputs: list[torch.Tensor], trim: CacheTrim | None = None) -> list[torch.Tensor]:
        """The unit's outputs for `inputs`, its attention cache (the last output) trimmed by
        `trim` (runtime.trim): the engine's for `key`, or eager ones."""
        engine = self._engine(key)
        if engine is not None:
            try:
                with self._locks[key]:                    # an engine is not thread-safe
                    out = engine.run(inputs, trim)
                self._count(key, "hits")
                return out
            except Exception as exc:
                self._count(key, "failures")
                log.warning("c2w: engine %s failed (%s: %s); serving it eagerly", key.id, type(exc).__name__, exc)
        else:
            self._count(key, "misses")
            if key not in self._warned_miss:
                self._warned_miss.add(key)
                log.info("c2w: no engine for %s; serving it eagerly", key.id)
        return self.eager.run(key, inputs, trim)

    def stats(self) -> dict:
        """{component: {key id: {hits, misses, failures}}} since load."""
        out: dict = {c: {} for c in SPECS}
        with self._stats_lock:
            for key, c in self._counts.items():
                out[key.component][key.id] = dict(c)
        return out

    def solve_graphs(self) -> dict[str, dict[str, int]]:
        """{key id: {captures, replays, declined, held}} of the loaded engines that solve resident
        rings from whole-solve graphs (runtime.engines.solve_graphs), since load."""
        with self._load_lock:
            engines = dict(self._engines)
        return {k.id: e.solve_graphs.counts() for k, e in sorted(engines.items())
                if getattr(e, "solve_graphs", None) is not None}

    def unusable(self) -> dict[str, str]:
        """Artifacts that were skipped, with the reason (key id -> reason)."""
        return {k.id: v for k, v in self._bad.items()}

    @property
    def keys(self) -> list[ShapeKey]:
        return sorted(self._entries)

    @property
    def loaded(self) -> list[ShapeKey]:
        """Keys whose engine is loaded now (with lazy=False: every usable artifact)."""
        return sorted(self._engines)

    def release(self) -> None:
        with self._load_lock:
            for eng in self._engines.values():
                eng.release()
            self._engines.clear()
            self._weights.clear()
            if self.backend is not None:
                self.backend.release_shared()
