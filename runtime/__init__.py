"""c2w runtime: what a serving process imports. It never compiles and never imports `exporter`.

    from c2w import runtime
    rt = runtime.load("artifacts/cpu")              # the model spec comes from the manifest
    state = rt.setup(prompt_tokens, prompt_mel, spk) # once per voice (set-up keys or eager)
    pcm = rt.step(state, tokens)                     # per chunk, B streams at once
    pcm = rt.step(state, tail_tokens, last=True)
    rt.stats()                                       # hits / misses / failures per key
    rt.release()
"""
from __future__ import annotations

from pathlib import Path

import torch

from c2w.runtime.cache import EngineCache
from c2w.runtime.errors import C2WUserError
from c2w.runtime.manifest import model_from_manifest, read_manifest
from c2w.runtime.model.weights import Code2Wav, load_model
from c2w.runtime.precision import load_at_precision, set_tf32
from c2w.runtime.serving import StreamHandle, StreamServer
from c2w.runtime.slots import ServerFullError
from c2w.runtime.stream import StreamDriver, StreamState
from c2w.runtime.units import ShapeKey

__all__ = ["Runtime", "load", "C2WUserError", "ShapeKey", "StreamState", "load_model", "StreamServer",
           "StreamHandle", "ServerFullError"]


class Runtime:
    """An eager model, an engine cache over one artifact directory, and the streaming driver."""

    def __init__(self, model: Code2Wav, cache: EngineCache, trim_conformer: bool = True, seed: int = 0,
                 schedule: dict | None = None):
        self.model, self.cache = model, cache
        self.schedule = dict(schedule or {})       # the profile's streaming schedule, from the manifest
        self.driver = StreamDriver(model, cache, trim_conformer=trim_conformer, seed=seed)

    def setup(self, prompt_tokens, prompt_mel, spk) -> StreamState:
        return self.driver.setup(prompt_tokens, prompt_mel, spk)

    def step(self, state: StreamState, tokens, last: bool = False) -> torch.Tensor:
        return self.driver.step(state, tokens, last=last)

    def stats(self) -> dict:
        return self.cache.stats()

    def serve(self, **options) -> StreamServer:
        """A StreamServer over this runtime: many independent streams, batched by exact shape
        (runtime/serving.py lists the options)."""
        return StreamServer(self, **options)

    def release(self) -> None:
        self.cache.release()


def load(artifact_dir: str | Path, model: str | Code2Wav | None = None, device: str | None = None,
         *, lazy: bool | None = None, trim_conformer: bool | None = None, cuda_graphs: bool | None = None) -> Runtime:
    """Load an artifact directory for serving.

    model: a model spec (checkpoint dir or 'random:...') or an already built Code2Wav; default:
    the spec recorded in the manifest. device: default: the manifest's ('cpu' or 'cuda').
    Precision follows the manifest: a spec is loaded at its component dtypes, and TF32 is set as
    it says, process-wide (logged at INFO on "c2w.precision"). A directory that does not match is
    served eagerly (warning).
    lazy: load engines on first use (default on CPU) or all at once (default on CUDA, where a
    CUDA-graph capture during serving would collide with other threads' kernels).
    cuda_graphs: capture engines in CUDA graphs at load (CUDA only). None: the backend's default
    (AOTInductor: on for engines whose graph inputs fit GRAPH_MAX_BYTES; TensorRT: off; ONNX Runtime
    never captures). C2W_AOTI_CUDA_GRAPHS=0|1, when set, overrides it for AOTInductor.
    """
    artifact_dir = Path(artifact_dir)
    try:
        manifest = read_manifest(artifact_dir)
    except C2WUserError as e:
        if model is None:
            raise C2WUserError("runtime.load", f"no model and no readable manifest in '{artifact_dir}' ({e})",
                               "a model spec (checkpoint dir or 'random:tiny') or an artifact directory") from None
        manifest = e                 # EngineCache warns with the reason and serves eagerly
    readable = not isinstance(manifest, C2WUserError)
    if model is None:
        model = manifest.model.spec
    if device is None:
        device = "cpu" if not readable or manifest.device == "cpu" else "cuda"
    if not readable:
        if isinstance(model, str):
            model = load_at_precision(model, device, {})        # float32: everything runs eagerly
    elif isinstance(model, str):
        model = model_from_manifest(manifest, device, model)    # the manifest's dtypes and TF32
    else:          # the caller's model keeps its dtypes (the cache checks them); TF32 follows the manifest
        set_tf32(manifest.precision.get("tf32", False), "the manifest's precision.tf32")
    if lazy is None:
        lazy = torch.device(device).type != "cuda"
    if trim_conformer is None:
        trim_conformer = bool(manifest.schedule.get("trim_conformer", True)) if readable else True
    cache = EngineCache(artifact_dir, model, device, lazy=lazy, manifest=manifest, cuda_graphs=cuda_graphs)
    return Runtime(model, cache, trim_conformer=trim_conformer, schedule=manifest.schedule if readable else {})
