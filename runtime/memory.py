"""What engines cost when they are loaded together: the measurement behind the memory budget.

A *measurement process* (`python -m c2w.runtime.memory`, started by `MeasureProcess`) holds what a
serving process holds: the eager model at the manifest's precision (TF32 as it says) and the
engines loaded so far. It loads one entry at a time next to the ones before it, runs it once on
example inputs, drops those inputs and outputs, and reports what stayed:

- on the CPU: anonymous resident memory (RssAnon), read after `gc.collect()` and `malloc_trim(0)`
  so that memory freed by the allocator but not yet returned to the OS is not counted; file-backed
  pages (shared libraries) are not memory an engine allocated;
- on CUDA: the bytes in use on the whole device (`cudaMemGetInfo`), read after synchronizing and
  `empty_cache()`, split into PyTorch-allocated, graph pools (reserved but not allocated) and
  outside PyTorch's allocator. Other processes on the device show up in it too.

The first entry of each component is loaded, run and released once before it is measured: what
stays after the release is state the backend shares across the component's engines (ONNX
Runtime's one copy of the component's weights), counted once per component (`shared`); each
entry's `bytes` is then its own. The eager weights are not measured: they are the manifest's
`weight_bytes`, exact. docs/budget.md says why each choice.

This module never imports `exporter`; the exporter and `c2w verify` use it through
`MeasureProcess` and `measure_directory`.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from c2w.runtime.engines import get_backend
from c2w.runtime.manifest import Entry, Manifest, Status, model_from_manifest
from c2w.runtime.units import SPECS, EagerRunner
from c2w.runtime.verify import artifact_info, entry_key, gpu_turn, unit_weights

MEASURE_SEED = 4321               # inputs of the one run each engine gets before it is measured
HOST_KIND, CUDA_KIND = "host_anon", "cuda_device"    # Entry.memory_kind of what this module measures


@dataclass(frozen=True)
class Reading:
    """Bytes in use now: host anonymous RSS, or the device's used bytes with PyTorch's part."""
    used: int
    allocated: int = 0          # CUDA: PyTorch-allocated
    reserved: int = 0           # CUDA: PyTorch-reserved (allocated + cached + graph pools)

    def minus(self, before: "Reading") -> dict:
        """What grew from `before` to this reading: {bytes} (+ the CUDA split), never negative."""
        out = {"bytes": max(0, self.used - before.used)}
        if self.reserved or before.reserved:
            out["allocated"] = self.allocated - before.allocated
            out["pool"] = (self.reserved - self.allocated) - (before.reserved - before.allocated)
            out["outside"] = (self.used - self.reserved) - (before.used - before.reserved)
        return out


def memory_kind(device: torch.device) -> str:
    return CUDA_KIND if device.type == "cuda" else HOST_KIND


def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


_TRIM = _malloc_trim()


def read(device: torch.device) -> Reading:
    """What this process holds now (see the module docstring), after giving back freed memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return Reading(total - free, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
    if _TRIM is not None:
        _TRIM(0)
    return Reading(_anon_rss())


def _anon_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Resident:
    """Engines of one artifact directory loaded next to each other in this process."""

    def __init__(self, out_dir: Path, manifest: Manifest, device: torch.device):
        self.out_dir, self.device = Path(out_dir), device
        self.backend = get_backend(manifest.backend.name)
        self.backend.require()                  # the SDK's libraries load before anything is measured
        self.model = model_from_manifest(manifest, device)
        self.eager = EagerRunner(self.model)
        self.kind = memory_kind(device)
        self.engines: dict[str, object] = {}
        self.primed: set[str] = set()           # components whose shared state is loaded

    def _load_and_run(self, entry: Entry):
        key = entry_key(entry)
        engine = self.backend.load(artifact_info(self.out_dir, entry, self.model.cfg),
                                   unit_weights(self.eager.unit(key)), self.device)
        try:
            inputs = SPECS[key.component].example_inputs(self.model.cfg, key, seed=MEASURE_SEED, device=self.device)
            engine.run(inputs)              # outputs and inputs are dropped here: they are one call's
        except BaseException:
            engine.release()
            raise
        return engine

    def add(self, entry: Entry) -> dict:
        """Load `entry` next to the engines held, run it once, keep it: {"bytes": its own
        resident bytes, "shared": {component: bytes} when this was the component's first entry,
        "seconds": the time this took: its load and first run (twice for a component's first entry,
        which is primed) and the readings}."""
        if entry.id in self.engines:
            raise ValueError(f"{entry.id} is loaded already")
        with gpu_turn(self.device):
            t0 = time.perf_counter()            # not counting a wait for the GPU's turn
            shared = {}
            if entry.component not in self.primed:
                before = read(self.device)
                self._load_and_run(entry).release()
                shared = {entry.component: read(self.device).minus(before)["bytes"]}
                self.primed.add(entry.component)
            before = read(self.device)
            self.engines[entry.id] = self._load_and_run(entry)
            return {**read(self.device).minus(before), "shared": shared,
                    "seconds": round(time.perf_counter() - t0, 3)}

    def drop(self, key_id: str) -> None:
        self.engines.pop(key_id).release()

    def close(self) -> None:
        for engine in self.engines.values():
            engine.release()
        self.engines.clear()
        self.backend.release_shared()


class MeasureError(RuntimeError):
    """The measurement process failed: the error it reported, or how it ended (with the tail of
    its stderr)."""


REPLY = "c2w-memory: "          # marks the process's replies on its stdout; any other line is skipped


class MeasureProcess:
    """A fresh measurement process for one artifact directory (a context manager).

    `add(entry)` -> {"bytes", "shared", ...} as `Resident.add`; `drop(id)` releases an entry
    loaded before. Stops the process on `close()`; a failure in it is a MeasureError."""

    def __init__(self, out_dir: Path, manifest: Manifest, device: torch.device | str):
        self.device = torch.device(device)
        self.kind = memory_kind(self.device)
        import c2w
        # The child imports the c2w this process did. A checkout's c2w/__init__.py (the one c2w with
        # a __file__; an installed c2w is a namespace package) is found through the checkout on
        # sys.path, where pytest puts it: the child gets that entry too, whatever c2w is installed.
        checkout = getattr(c2w, "__file__", None)
        paths = [str(Path(checkout).resolve().parents[1])] if checkout else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))}
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([sys.executable, "-m", "c2w.runtime.memory"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        header = dataclasses.replace(manifest, entries=[])
        try:
            self._ask({"out_dir": str(out_dir), "device": str(self.device), "manifest": header.to_dict()})
        except BaseException:
            self.close()
            raise

    def _ask(self, message: dict) -> dict:
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            while line and not line.startswith(REPLY):
                line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self._stop()
            self._log.seek(0)
            tail = self._log.read()[-1500:].strip() or "no output"
            raise MeasureError(f"the measurement process stopped (exit code {self._proc.returncode}): {tail}")
        reply = json.loads(line[len(REPLY):])
        if "error" in reply:
            raise MeasureError(reply["error"])
        return reply

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def add(self, entry: Entry) -> dict:
        return self._ask({"add": entry.to_dict()})

    def drop(self, key_id: str) -> None:
        self._ask({"drop": key_id})

    def _stop(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()         # the process releases its engines and exits
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def close(self) -> None:
        self._stop()
        self._log.close()

    def __enter__(self) -> "MeasureProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def summarize(weight_bytes: dict[str, int], loads: list[tuple[Entry, dict]]) -> dict:
    """What a measurement process holding exactly `loads` ([(entry, its `add` reply)], in load
    order) holds: {"keys", "weight_bytes": eager weights of the components in use (the manifest's
    numbers, not measured), "engine_shared_bytes": {component: bytes}, "key_bytes", "total_bytes",
    "per_key": [[id, its own bytes, the total with the entries up to it]], "load_seconds": the
    loads' time, + the CUDA split}."""
    shared: dict[str, int] = {}
    total, keys, per_key, split, seconds = 0, 0, [], {}, 0.0
    for e, got in loads:
        seconds += got["seconds"]
        if e.component not in shared:          # the component's first key: its weights and shared state
            shared[e.component] = got["shared"].get(e.component, 0)
            total += shared[e.component] + weight_bytes.get(e.component, 0)
        total += got["bytes"]
        keys += got["bytes"]
        for part in ("allocated", "pool", "outside"):
            if part in got:
                split[part] = split.get(part, 0) + got[part]
        per_key.append([e.id, got["bytes"], total])
    return {"keys": len(loads), "weight_bytes": sum(weight_bytes.get(c, 0) for c in shared),
            "engine_shared_bytes": shared, "key_bytes": keys, "total_bytes": total, "per_key": per_key,
            "load_seconds": round(seconds, 2), **({"split": split} if split else {})}


def measure_directory(out_dir: Path, manifest: Manifest, device: torch.device | str) -> dict:
    """Load the eager model and every built entry of `manifest` together in a fresh process, in
    manifest order (the plan's), each run once: `summarize` of what they hold, with its "kind".
    A failure to load or run one: MeasureError."""
    with MeasureProcess(out_dir, manifest, device) as probe:
        loads = [(e, probe.add(e)) for e in manifest.entries if e.status == Status.BUILT]
        return {"kind": probe.kind, **summarize(manifest.weight_bytes, loads)}


def _serve() -> int:
    """The measurement process: a header line, then one request per line on stdin; one JSON reply
    per line, marked REPLY, on the original stdout (what libraries print goes to stderr)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the parent's: it closes our stdin
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                                   # stray prints of libraries must not break replies
    sys.stdout = sys.stderr

    def reply(d: dict) -> None:
        replies.write(REPLY + json.dumps(d) + "\n")
        replies.flush()
    resident = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if resident is None:
                man = Manifest.from_dict(req["manifest"])
                resident = Resident(Path(req["out_dir"]), man, torch.device(req["device"]))
                reply({"ready": True})
            elif "add" in req:
                reply(resident.add(Entry.from_dict(req["add"])))
            elif "drop" in req:
                resident.drop(req["drop"])
                reply({"dropped": req["drop"]})
        except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
            reply({"error": f"{type(e).__name__}: {e}"[:2000]})
            if resident is None:
                return 1
    if resident is not None:
        resident.close()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
