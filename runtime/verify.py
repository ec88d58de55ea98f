"""Parity of one built artifact against the eager unit, and the helpers loading needs.

Used by the exporter right after a build (fail closed) and by `c2w verify` on a whole directory.
"""
from __future__ import annotations

import contextlib
import fcntl
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from c2w.runtime.engines.base import ArtifactInfo
from c2w.runtime.manifest import Entry, Parity, Status
from c2w.runtime.units import SPECS, ShapeKey, rel_l2

VERIFY_SEED = 1234        # inputs differ from the ones the artifact was exported with


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def entry_key(entry: Entry) -> ShapeKey:
    return ShapeKey.from_dict({"component": entry.component, "dtype": entry.dtype, **entry.dims})


def artifact_info(out_dir: Path, entry: Entry, cfg) -> ArtifactInfo:
    key = entry_key(entry)
    spec = SPECS[key.component]
    return ArtifactInfo(path=Path(out_dir) / entry.artifact, input_names=tuple(entry.input_names),
                        output_names=tuple(entry.output_names),
                        input_shapes=tuple(tuple(s) for s in spec.input_shapes(cfg, key)),
                        input_dtypes=tuple(str(d).removeprefix("torch.") for d in spec.input_dtypes(key)),
                        extra=dict(entry.extra))


def unit_weights(unit: torch.nn.Module) -> dict[str, torch.Tensor]:
    """FQN -> tensor for every parameter and buffer of a unit module (shared, not copied)."""
    return {**dict(unit.named_parameters()), **dict(unit.named_buffers())}


def distinct_memory(tensors) -> Iterator[tuple[torch.Tensor, int]]:
    """Each block of memory among `tensors` once: (the first tensor seen in it, the elements it
    holds). Views of one storage (the DiT's q/k/v parameters and its packed buffers) are one block,
    counted whole; a tensor with no address to compare (meta, empty storage) is its own block."""
    seen = set()
    for t in tensors:
        ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
        where = (str(t.device), ptr) if ptr else id(t)
        if where not in seen:
            seen.add(where)
            yield t, (t.untyped_storage().nbytes() // t.element_size() if ptr else t.numel())


def unit_weight_bytes(unit: torch.nn.Module) -> int:
    """Bytes the weights of a unit module occupy: each storage once."""
    return sum(n * t.element_size() for t, n in distinct_memory(unit_weights(unit).values()))


def weights_layout(unit: torch.nn.Module) -> dict[str, list[int]]:
    """FQN -> strides of every weight of a unit that is not stored contiguously (the DiT's conv
    weights are stored tap-major). AOTI binds shared weights by pointer, so a package is valid
    only for the memory layout it was built with: the layout is part of an artifact's identity
    and is checked when a package is loaded."""
    return {fqn: list(t.stride()) for fqn, t in unit_weights(unit).items() if not t.is_contiguous()}


@contextlib.contextmanager
def gpu_turn(device: torch.device):
    """Processes verifying on the same GPU take turns (an exclusive lock file per device), and
    each gives its cached blocks back when done. A full-size B=32 CFM check holds the engine's
    and eager's 10-step caches at once (tens of GB): parallel export shards on one H200 ran out
    of memory when two or three of them coincided."""
    if device.type != "cuda":
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    # named by the GPU's UUID: processes given different GPUs through CUDA_VISIBLE_DEVICES all
    # see index 0, and must not wait for each other
    name = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or f"cuda{index}")
    with open(Path(tempfile.gettempdir()) / f"c2w-verify-{name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            try:
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
            except RuntimeError:        # a CUDA error of the check itself: let that one surface
                pass
            fcntl.flock(lock, fcntl.LOCK_UN)


def check_entry(model, backend, out_dir: Path, entry: Entry, device: torch.device,
                unit: torch.nn.Module | None = None) -> Entry:
    """Load the entry's artifact, run it on fresh random inputs, compare every output with eager
    (the key's `unit` module, built here if not given).

    Sets entry.parity and entry.status (built or failed). On CUDA it waits for its turn on the
    device (`gpu_turn`). What the engine costs in memory is measured elsewhere, with the other
    engines of its directory loaded (runtime.memory, docs/budget.md).
    """
    with gpu_turn(device):
        return _check_entry(model, backend, out_dir, entry, device, unit)


def _check_entry(model, backend, out_dir: Path, entry: Entry, device: torch.device, unit) -> Entry:
    key = entry_key(entry)
    spec = SPECS[key.component]
    unit = (unit if unit is not None else spec.build(model, key)).eval()
    engine = backend.load(artifact_info(out_dir, entry, model.cfg), unit_weights(unit), device)
    try:
        inputs = spec.example_inputs(model.cfg, key, seed=VERIFY_SEED, device=device)
        got = engine.run(inputs)
        with torch.inference_mode():
            want = list(unit(*inputs))
        errs, wrong = compare(spec, key, got, want)
        del got, want
        if getattr(engine, "solve_graphs", None) is not None:
            first, inputs = inputs, None        # handed over: the check drops its cache once laid out
            more, more_wrong = steady_ring_errors(engine, unit, model.cfg, key, first, device)
            errs.update(more)
            wrong += more_wrong
    finally:
        engine.release()
    tol = spec.tolerance(key)
    over = any(v > tol for v in errs.values())
    passed = not wrong and not over
    entry.parity = Parity(rel_l2=errs, tol=tol, passed=passed)
    entry.status = Status.BUILT if passed else Status.FAILED
    problems = ([f"rel-L2 {errs} above {tol}"] if over else []) + wrong
    entry.error = None if passed else "parity failed: " + "; ".join(problems)
    return entry


def compare(spec, key: ShapeKey, got, want, suffix: str = "") -> tuple[dict[str, float], list[str]]:
    """rel-L2 of each output against eager ({name + suffix: value}; inf for an output of another
    dtype or shape than the unit's, or a missing one), and what was wrong about those (an output
    of the wrong dtype or shape, missing, or too many)."""
    errs, wrong = {}, []
    if len(got) > len(want):
        wrong.append(f"{len(got)} outputs{suffix}, expected {len(want)}")
    for i, (name, w, dtype) in enumerate(zip(spec.output_names, want, spec.output_dtypes(key))):
        g = got[i] if i < len(got) else None
        if g is None or tuple(g.shape) != tuple(w.shape) or g.dtype != dtype:
            errs[name + suffix] = float("inf")
            wrong.append(f"{name}{suffix} " + ("missing" if g is None else f"{g.dtype} {tuple(g.shape)}")
                         + f", expected {dtype} {tuple(w.shape)}")
        else:
            errs[name + suffix] = rel_l2(g.to(w.device), w)
    return errs, wrong


RING_CHUNKS = ("capture", "replay")     # the chunks a steady ring check solves after laying the ring out


def steady_ring_errors(engine, unit, cfg, key: ShapeKey, inputs: list, device) -> tuple[dict[str, float], list[str]]:
    """A CFM engine that solves resident rings in whole-solve graphs (runtime.engines.solve_graphs)
    checked as a steady stream runs it, at the trim that keeps the key's L frames (P = L - 100):
    chunk 0 lays the cache out in a ring of the engine's own; chunk "capture" hands that ring
    back (the graph is captured on its inputs); chunk "replay" replays it on other inputs. A
    graph that followed only its capture's inputs (docs/aoti.md) fails the second, and an engine
    that solved either chunk without its graph fails too (the check would have checked nothing).
    Each chunk against the eager unit fed the same ring's frames; names "<output> (ring
    <chunk>)". A key whose L is under 100 frames is never steady (no trim frees T slots):
    nothing to check. A capture that raises fails the key (fail closed: serving would solve that
    ring step by step, but the engine is not what was meant). `inputs` (the key's, as the first
    check drew them) is taken over: its attention cache is dropped from it once laid out, and
    later chunks draw only their other inputs (at B=32 each cache is ~12 GB)."""
    from c2w.runtime.ring import RingCache
    from c2w.runtime.trim import KEEP_RECENT, CacheTrim
    L = key.dim("L")
    if L < KEEP_RECENT:
        return {}, []
    spec, trim, graphs = SPECS[key.component], CacheTrim(L - KEEP_RECENT), engine.solve_graphs
    ring = engine.run(inputs[:5] + [RingCache.of(inputs.pop())], trim)[2]
    errs, wrong = {}, []
    for i, chunk in enumerate(RING_CHUNKS, start=1):
        # the first five inputs do not depend on L: drawn for L=1, no cache of the key's size
        x = spec.example_inputs(cfg, key.with_dims(L=1), seed=VERIFY_SEED + i, device=device)[:5]
        with torch.inference_mode():
            want = list(unit(*x, ring.logical()))
        want[2] = trim.apply(want[2])
        captures = graphs.captures
        got = engine.run(x + [ring], trim)
        graph = graphs.held(got[2].buffer)
        if graph is None or graphs.captures != captures + (chunk == "capture"):
            wrong.append(f"chunk {chunk}: solved without its solve graph (held: {graph is not None}, "
                         f"captures {captures} -> {graphs.captures})")
        ring = got[2]
        e, w = compare(spec, key, got[:2] + [ring.logical()], want, f" (ring {chunk})")
        errs.update(e)
        wrong += w
        del got, want
    return errs, wrong
