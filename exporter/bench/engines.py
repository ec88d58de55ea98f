"""`c2w bench`: engines against eager at the same precision, per key and per streaming chunk.

Per built key: median / p95 latency of eager, of eager under CUDA-graph replay (GPU), of the engine
called directly, and of the engine under CUDA-graph replay where its backend captures that key
(CUDA events after warm-up on GPU; perf_counter on CPU); for a CFM engine that writes its cache in
place, also as a steady stream serves it (`steady_stream`); the rel-L2 of the engine's outputs against
eager on the same inputs (the timed calls compute the same function), and, for reduced precision,
the fidelity (rel-L2, SNR dB) of eager and engine against the float32 model. Per batch size: stage
latency of a first and a steady chunk (encoder + CFM + HiFT + cache handling) through the streaming
driver, eager vs engines, and audio-seconds per second; device memory before/after loading every
engine; the session's audio SNR against float32 eager. If step-audio2 is importable: its B=1 eager
chunk as the peer row. Never asserts a time.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from c2w.runtime.atomic import atomic_write
from c2w.runtime.cache import EngineCache
from c2w.runtime.engines import get_backend
from c2w.runtime.engines.graphs import CapturedCall, GraphPool
from c2w.runtime.manifest import Manifest, model_from_manifest, read_manifest
from c2w.runtime.model.weights import load_model
from c2w.runtime.ring import RingCache
from c2w.runtime.stream import StreamDriver
from c2w.runtime.trim import KEEP_RECENT, CacheTrim
from c2w.runtime.units import SPECS, EagerRunner, rel_l2
from c2w.runtime.verify import artifact_info, entry_key, unit_weights


def timed(fn, device: torch.device, warmup: int, reps: int, setup=None) -> dict:
    """Median / p95 ms of `fn()`, or of `fn(setup())` with `setup` run before each call OUTSIDE
    the timed window (e.g. a fresh copy of a stream's state)."""
    prepare = setup or (lambda: None)
    run = fn if setup is not None else (lambda _: fn())
    for _ in range(warmup):
        run(prepare())
    ts = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            arg = prepare()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run(arg)
            b.record()
            torch.cuda.synchronize(device)
            ts.append(a.elapsed_time(b))
    else:
        for _ in range(reps):
            arg = prepare()
            t0 = time.perf_counter()
            run(arg)
            ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return {"median_ms": ts[len(ts) // 2], "p95_ms": ts[min(len(ts) - 1, int(round(0.95 * (len(ts) - 1))))],
            "reps": reps}


def snr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |x - ref|^2) in float64 (inf when equal)."""
    x, ref = x.double().cpu(), ref.double().cpu()
    err = (x - ref).pow(2).sum().item()
    return float("inf") if err == 0 else 10 * torch.log10(ref.pow(2).sum() / err).item()


def fidelity(got: torch.Tensor, ref: torch.Tensor) -> dict:
    return {"rel_l2": rel_l2(got.float().cpu(), ref.float().cpu()), "snr_db": snr_db(got, ref)}


def _commit() -> str:
    """C2W_COMMIT if set (the device tool's copy of the tree carries stale git metadata), else git
    (documented in docs/profiles.md with the other environment variables)."""
    if os.environ.get("C2W_COMMIT"):
        return os.environ["C2W_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


VARIANTS = (("engine", False), ("engine_graph", True))     # a key's engine rows: name, CUDA graphs asked for


def engine_variants(backend_name: str, info, device: torch.device) -> dict:
    """The engine variants `c2w bench` times for one key: row name -> the backend that loads it,
    built as the runtime builds one (get_backend(name, cuda_graphs=...)), or, where that backend's
    graph policy would make the row's name untrue, why the row is not timed (ONNX Runtime never
    captures; AOTI captures per call only graph inputs within GRAPH_MAX_BYTES, the larger in-place
    CFM keys per resident ring, and C2W_AOTI_CUDA_GRAPHS overrides what it is asked). The graph
    row exists on CUDA only."""
    variants = {}
    for name, graphs in VARIANTS:
        if graphs and device.type != "cuda":
            continue
        backend = get_backend(backend_name, cuda_graphs=graphs)
        graphed = captures(backend, info, device)
        variants[name] = backend if graphed == graphs else (
            f"not timed: backend {backend_name} asked for cuda_graphs={graphs} "
            f"{'captures' if graphed else 'does not capture'} this key in a CUDA graph (its graph policy)")
    return variants


def captures(backend, info, device: torch.device) -> bool:
    """Whether `backend` serves this key from CUDA graphs: one per call (`graphed`), or, for a CFM
    key too large for that, one per resident ring (`solve_graphed`), which only the steady-stream
    cell (steady_stream) replays: the per-call cells hand the example cache, not a returned ring."""
    return backend.graphed(info, device) or backend.solve_graphed(info, device)


def served_variant(policy, info, device: torch.device) -> str:
    """The engine row the runtime serves for this key: `policy` is the backend as the runtime
    loads it (get_backend(name, cuda_graphs=the loading option))."""
    return "engine_graph" if captures(policy, info, device) else "engine"


def bench_dir(artifact_dir: Path, *, reps: int = 20, warmup: int = 3, keys: list[str] | None = None,
              stream_batches: list[int] | None = None, peer: bool = True, out: Path | None = None,
              stream_reps: int | None = None, stream_warmup: int = 2, traffic=None,
              cuda_graphs: bool | None = None) -> dict:
    """The streaming rows, then every built key (or `keys`), then the peer. With `out`, the JSON
    and its markdown are rewritten after every streaming row and every key, so a run cut short by
    a time limit keeps what it measured. `reps` / `warmup`: per key; `stream_reps` (default
    max(5, reps // 2)) / `stream_warmup`: per streaming chunk. traffic: a profile with a traffic
    section: its sessions' measured engine hit rate against the prediction (bench_traffic).
    cuda_graphs: the loading option the runtime serves with (runtime.load): which variant counts as
    served per key, and how the streaming and traffic rows load engines. Each key is timed with and
    without graphs either way, where its backend's graph policy captures it (engine_variants)."""
    manifest = read_manifest(artifact_dir)          # the only read: every part below is handed it
    device = torch.device("cpu" if manifest.device == "cpu" else "cuda")
    model = model_from_manifest(manifest, device)
    eager = EagerRunner(model)
    reduced = any(manifest.precision[c] != "float32" for c in SPECS)
    eager32 = EagerRunner(load_model(manifest.model.spec).to(device)) if reduced else None
    res = {"device": manifest.device, "torch": torch.__version__, "backend": dataclasses.asdict(manifest.backend),
           "model": dataclasses.asdict(manifest.model), "precision": manifest.precision, "commit": _commit(),
           "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "keys": [], "stream": []}
    save = (lambda: write(res, out)) if out is not None else (lambda: None)
    stream_reps = max(5, reps // 2) if stream_reps is None else stream_reps
    bench_stream(model, artifact_dir, manifest, device, stream_batches, reps=stream_reps, warmup=stream_warmup,
                 model32=eager32.model if eager32 is not None else None, rows=res["stream"], save=save,
                 cuda_graphs=cuda_graphs)
    built = [e for e in manifest.entries if e.status == "built" and (not keys or e.id in keys)]
    policy = get_backend(manifest.backend.name, cuda_graphs=cuda_graphs)   # the graph policy served with
    for e in built:
        key = entry_key(e)
        spec = SPECS[key.component]
        inputs = spec.example_inputs(model.cfg, key, seed=7, device=device)
        row = {"id": e.id, "component": key.component, "dims": e.dims, "dtype": e.dtype,
               "build_seconds": e.build_seconds, "device_bytes": e.device_bytes}
        want, ref32 = eager_cells(row, eager, eager32 if e.dtype != "float32" else None, key, inputs,
                                  device, warmup, reps, artifact_dir)
        info = artifact_info(artifact_dir, e, model.cfg)
        weights = unit_weights(eager.unit(key))
        variants = engine_variants(manifest.backend.name, info, device)
        if device.type == "cuda" and want is not None:
            row["eager_graph"] = eager_graph_cell(eager, key, info, inputs, want, device, warmup, reps, artifact_dir)
            _free(device)                      # the graph's pool goes before the engines load
        for name, backend in variants.items():
            if isinstance(backend, str):
                row[name] = {"skipped": backend}
                continue
            try:
                t0 = time.perf_counter()
                eng = backend.load(info, weights, device)                # includes graph capture
                got = eng.run(inputs)
                load_s = time.perf_counter() - t0
                row[name] = timed(lambda: eng.run(inputs), device, warmup, reps)
                row[name]["load_and_first_call_s"] = load_s
                stream = steady_stream(eng, key, inputs, device, warmup, reps)
                if stream is not None:
                    row[name]["steady_stream"] = stream
                if want is not None:
                    row[name]["max_rel_l2_vs_eager"] = max(rel_l2(g.to(w.device), w) for g, w in zip(got, want))
                if ref32 is not None:
                    row[name]["fp32_fidelity"] = fidelity(got[0], ref32)
                eng.release()
            except Exception as exc:  # a variant that cannot run is reported, not fatal
                row[name] = {"error": _failure(exc, f"the {name} variant of {key.id}", key.id, artifact_dir)}
            backend.release_shared()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row["served_variant"] = served_variant(policy, info, device)
        served = row.get(row["served_variant"], {}).get("median_ms")
        best = min((row[v]["median_ms"] for v in variants if "median_ms" in row[v]), default=None)
        eager_ms = row["eager"].get("median_ms")
        row["speedup_vs_eager"] = eager_ms / served if served and eager_ms else None
        row["best_speedup_vs_eager"] = eager_ms / best if best and eager_ms else None
        stream = row.get(row["served_variant"], {}).get("steady_stream", {}).get("median_ms")
        if stream:
            row["stream_speedup_vs_eager"] = eager_ms / stream if eager_ms else None
        res["keys"].append(row)
        save()
        print(f"  {e.id}: eager {'failed' if eager_ms is None else f'{eager_ms:.2f} ms'}, served engine "
              f"{served if served is None else round(served, 3)} ms ({row['served_variant']}), best "
              f"{best if best is None else round(best, 3)} ms" + (f", in a steady stream {stream:.3f} ms" if stream else ""),
              flush=True)
    if traffic is not None:
        res["traffic"] = bench_traffic(artifact_dir, traffic, model, cuda_graphs=cuda_graphs, manifest=manifest)
        save()
    res["omitted"] = omitted_sections(device, peer, reduced)
    if peer and device.type == "cuda":
        res["peer"] = bench_peer(model, device, reps=max(5, reps // 2))
    if device.type == "cuda":
        res["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    save()
    return res


def eager_cells(row: dict, eager, eager32, key, inputs, device: torch.device, warmup: int, reps: int,
                artifact_dir: Path) -> tuple[list | None, torch.Tensor | None]:
    """Times eager on `inputs` into row["eager"] and returns (its outputs, the float32 model's first
    output, for reduced precision: `eager32`). A key whose eager run fails, most often for device
    memory (an 80 GB H100 does not hold the B=32 CFM key's eager solve, which stacks ten steps' caches),
    keeps its row: row["eager"] says why, and its engine is timed without the comparisons that
    need eager; the run goes on to the next key."""
    try:
        row["eager"] = timed(lambda: eager.run(key, inputs), device, warmup, reps)
        want = eager.run(key, inputs)
    except Exception as exc:
        row["eager"] = {"error": _failure(exc, f"eager {key.id}", key.id, artifact_dir)}
        _free(device)
        return None, None
    if eager32 is None:
        return want, None
    try:
        ref32 = eager32.run(key, [t.float() if t.is_floating_point() else t for t in inputs])[0]
    except Exception as exc:
        row["eager"]["fp32_fidelity_error"] = _failure(exc, f"the float32 model's {key.id}", key.id, artifact_dir)
        _free(device)
        return want, None
    row["eager"]["fp32_fidelity"] = fidelity(want[0], ref32)
    return want, ref32


def eager_graph_cell(eager, key, info, inputs, want, device: torch.device, warmup: int, reps: int,
                     artifact_dir: Path) -> dict:
    """Times eager replayed from one CUDA graph and compares it with eager's outputs `want`. The
    graph and its memory pool live only inside this call: at the B=32 CFM key they hold about as
    much device memory as the eager solve itself, which the engines timed next need."""
    try:
        g = CapturedCall(lambda *a: eager.run(key, list(a)), info.input_shapes,
                         [t.dtype for t in inputs], device, GraphPool(device))
        cell = timed(lambda: g(*inputs), device, warmup, reps)
        cell["max_rel_l2_vs_eager"] = max(rel_l2(a, b) for a, b in zip(g(*inputs), want))
        return cell
    except Exception as exc:
        return {"error": _failure(exc, "eager under one CUDA graph", key.id, artifact_dir)}


# a stream's first call lays its cache out in a ring of the engine's own; its second writes it in
# place (and captures the solve graph, if any)
STREAM_WARMUP = 4


def steady_stream(eng, key, inputs, device: torch.device, warmup: int, reps: int) -> dict | None:
    """A CFM engine that takes its attention cache as a ring (`takes_rings`: AOTI's in-place step)
    timed as a steady stream is served: each call handed the ring the last one returned, the cache
    trimmed back to the key's L frames (upstream's trim with P = L - 100), so that each chunk
    writes its T frames into the slots the trim freed, and, where the engine solves resident rings
    in one graph, from that graph. The example cache goes in as a ring (as the stream driver hands
    a cache on: a tensor in gives a tensor out, laid out anew on every call); the first call lays
    it out in a ring of the engine's own, hence at least STREAM_WARMUP untimed ones. The outputs
    are not compared: each call attends to the cache the last one left, not to the key's example
    cache. None for other engines, and for a cache too short to trim back (L < 100)."""
    call = steady_call(eng, key, inputs)
    if call is None:
        return None
    out = timed(call, device, max(warmup, STREAM_WARMUP), reps)
    if eng.solve_graphs is not None:
        out["solve_graphs"] = eng.solve_graphs.counts()
    return out


def steady_call(eng, key, inputs):
    """One chunk of `steady_stream`'s stream per call (a closure over the ring the last call
    returned), or None where it times no stream. Its first STREAM_WARMUP calls are not yet steady."""
    L = key.dim("L") if key.component == "cfm" else 0
    if not eng.takes_rings or L < KEEP_RECENT:
        return None
    trim, state = CacheTrim(L - KEEP_RECENT), {"cache": RingCache.of(inputs[5])}

    def call():
        state["cache"] = eng.run(list(inputs[:5]) + [state["cache"]], trim)[2]
    return call


def _failure(exc: Exception, what: str, key_id: str, artifact_dir: Path) -> str:
    """One line for a failed measurement of `what`; for device memory, what to do about it."""
    first = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:200]
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return (f"{what} ran out of device memory ({first}); to time it, bench the key on its own "
                f"(c2w bench {artifact_dir} --keys {key_id}) or on a GPU with more memory")
    return f"{what} failed: {first}"


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _prompt(model, B: int, P: int, N: int, device):
    g = torch.Generator().manual_seed(B)
    prompt = torch.randint(0, model.cfg.vocab_size, (B, P // 2), generator=g)
    pmel, spk = torch.randn(B, P, 80, generator=g), torch.randn(B, 192, generator=g)
    tok = torch.randint(0, model.cfg.vocab_size, (B, N), generator=g).to(device)
    return prompt, pmel, spk, tok


def _cuda_counters(device):
    """() -> (allocated, reserved, used on the device) in bytes, after returning cached blocks."""
    def read():
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), total - free
    return read


def load_memory(cache_factory, model, device, counters=None) -> dict:
    """Device bytes each engine adds as it loads, one at a time (the eager model, whose weights
    the engines share, is already resident). An engine that copied its component's weights
    would add at least their size; one that shares them adds only its own buffers (CUDA-graph
    static inputs/outputs and pool, workspace, constants of its own).

    `counters()` -> (allocated, reserved, used): PyTorch's allocated bytes, its reserved bytes
    and the bytes in use on the whole device, read after cached blocks are returned. Per engine
    the device-level delta is the total, split into three parts: allocated (graph static
    buffers, AOTI's tensors), reserved but not allocated (what graph capture keeps in the
    graph's private pool) and outside the allocator (cudaMalloc by the engine itself: AOTI's
    constant blob of a package that carries its constants, and kernel code, which loads lazily
    so it lands on whichever engine runs first: captured engines at load, others at their first
    call). Other processes on the GPU would show up too."""
    from c2w.exporter.plan import weight_bytes
    read = counters or _cuda_counters(device)
    cache = cache_factory()                                   # lazy: nothing loaded yet
    first = read()
    per_engine: dict[str, dict] = {}
    for key in cache.keys:
        a0, r0, u0 = read()
        if cache.load(key):
            a1, r1, u1 = read()
            per_engine[key.id] = {"total": u1 - u0, "allocated": a1 - a0, "pool": (r1 - a1) - (r0 - a0),
                                  "outside": (u1 - r1) - (u0 - r0)}
    engines: dict[str, int] = {}
    for key in cache.loaded:
        engines[key.component] = engines.get(key.component, 0) + 1
    last = read()
    return cache, {"weights_bytes": weight_bytes(model), "engines": engines, "per_engine_bytes": per_engine,
                   "per_engine_added_bytes": {k: v["allocated"] for k, v in per_engine.items()},
                   "allocated_before": first[0], "allocated_after": last[0],
                   "added_bytes": last[0] - first[0],             # PyTorch's allocator, as in runs 4-5
                   "added_device_bytes": last[2] - first[2],      # the whole device
                   "unusable": cache.unusable()}


def chunk_sizes(manifest, B: int) -> list[int]:
    """Chunk sizes (tokens) to stream at batch B: the schedule's, plus the N of every built
    non-final flow-encoder key of this batch size that continues a stream (extra keys such as
    h200.yaml's B=32 78-token ones; final-chunk keys are not steady chunks, and a key without a
    conformer cache, C = 0, is the prompt's set-up: run 14 streamed its 153 tokens as a chunk)."""
    sizes = list(manifest.schedule.get("chunk_tokens", [28]))
    for e in manifest.entries:
        key = entry_key(e)
        if (e.status == "built" and key.component == "flow_encoder" and key.dim("B") == B
                and not key.dim("last") and key.dim("C") > 0 and key.dim("N") not in sizes):
            sizes.append(key.dim("N"))
    return sizes


def _served(cache) -> tuple[int, int]:
    """(engine calls, eager fallbacks) of an EngineCache so far; (0, 0) for an eager runner."""
    if not isinstance(cache, EngineCache):
        return 0, 0
    counts = [c for per in cache.stats().values() for c in per.values()]
    return sum(c["hits"] for c in counts), sum(c["misses"] + c["failures"] for c in counts)


def bench_stream(model, artifact_dir, manifest, device, batches, reps: int, model32=None,
                 rows: list | None = None, save=lambda: None, warmup: int = 2,
                 cuda_graphs: bool | None = None) -> list[dict]:
    """Per batch size and chunk size: the first chunk and a steady chunk, eager vs engines, with
    how many unit calls of the engine row an engine served (the rest fell back to eager); on GPU
    also the memory the engines add at load and a B=1 session's audio SNR against float32."""
    sched = manifest.schedule
    P = sched.get("prompt_frames", 300)
    trim = sched.get("trim_conformer", True)
    rows = [] if rows is None else rows
    if device.type == "cuda":
        cache, mem = load_memory(lambda: EngineCache(artifact_dir, model, device, manifest=manifest,
                                                     cuda_graphs=cuda_graphs), model, device)
        mem["budget_bytes"] = manifest.budget_bytes
        added = max(mem["added_bytes"], mem["added_device_bytes"])
        mem["within_budget"] = sum(mem["weights_bytes"].values()) + added <= manifest.budget_bytes
        rows.append({"memory": mem})
        save()
    else:
        cache = EngineCache(artifact_dir, model, device, manifest=manifest, cuda_graphs=cuda_graphs)
    for B in batches or sched.get("batch_sizes", [1]):
        for N in chunk_sizes(manifest, B):
            try:
                row = _stream_row(model, cache, device, B, N, P, trim, reps, warmup=warmup)
            except Exception as exc:  # e.g. out of memory at a large batch: report it, go on
                row = {"B": B, "chunk_tokens": N, "prompt_frames": P, "error": f"{type(exc).__name__}: {exc}"[:300]}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            save()
            if "error" in row:
                print(f"  stream B={B} N={N}: {row['error']}", flush=True)
                continue
            print(f"  stream B={B} N={N}: first {row['engines_first']['median_ms']:.1f} ms "
                  f"(eager {row['eager_first']['median_ms']:.1f}), steady {row['engines_steady']['median_ms']:.1f} ms",
                  flush=True)
    if model32 is not None:
        rows.append({"session_fidelity": session_fidelity(model, model32, cache, device, P, trim)})
    res_stats = cache.stats()
    cache.release()
    rows.append({"cache_stats": res_stats})
    return rows


def _stream_row(model, cache, device, B: int, N: int, P: int, trim: bool, reps: int, warmup: int = 2) -> dict:
    """One (B, N) row: first and steady chunk, eager and engines (`warmup` untimed chunks, then
    `reps` timed ones, each)."""
    prompt, pmel, spk, tok = _prompt(model, B, P, N, device)
    row = {"B": B, "chunk_tokens": N, "prompt_frames": P}
    for name, runner in (("eager", EagerRunner(model)), ("engines", cache)):
        drv = StreamDriver(model, runner, trim_conformer=trim)
        st0 = drv.setup(prompt, pmel, spk)
        for phase in ("first", "steady"):
            st = _copy_state(st0)
            if phase == "steady":
                # to the saturated cache lengths (three chunks), and one more: the first chunk
                # that finds its ring with T slots free captures the solve graph of an engine
                # that has them (runtime.engines.solve_graphs), so no timed chunk does
                for _ in range(4):
                    drv.step(st, tok)
            hits, falls = _served(runner)
            if phase == "first":
                # each timed first chunk starts from a fresh copy of the set-up state, copied
                # outside the timed window (at B=32 the copy alone moves ~17 GB)
                snap = _copy_state(st)
                row[f"{name}_{phase}"] = timed(lambda st: drv.step(st, tok), device, warmup, reps,
                                               setup=lambda: _copy_state(snap))
            else:
                # steady chunks follow each other in one stream, as a server's resident batch
                # runs them: each hands the engine the cache the last one left (at these
                # saturated lengths every chunk has the same keys), so an engine that keeps a
                # stream's cache where it wrote it, or solves it from a graph over that buffer
                # (runtime.engines.solve_graphs), is timed as it serves
                row[f"{name}_{phase}"] = timed(lambda: drv.step(st, tok), device, warmup, reps)
            if name == "engines":
                h, f = _served(runner)
                row[f"engines_{phase}"].update(engine_calls=h - hits, eager_fallbacks=f - falls)
    T = 2 * (N - 3)
    for phase in ("first", "steady"):
        ms = row[f"engines_{phase}"]["median_ms"]
        row[f"audio_s_per_s_{phase}"] = B * T / 50 / (ms / 1e3)
        row[f"speedup_{phase}"] = row[f"eager_{phase}"]["median_ms"] / ms
    return row


def session_fidelity(model, model32, cache, device, P: int, trim: bool, chunks: int = 4) -> dict:
    """A B=1 session (first chunk + steady 28-token chunks): PCM of the engines (profile
    precision) and of reduced-precision eager, against float32 eager."""
    prompt, pmel, spk, tok = _prompt(model, 1, P, 28, device)
    pcm = {}
    for name, m, runner in (("engines", model, cache), ("eager", model, EagerRunner(model)),
                            ("eager_fp32", model32, EagerRunner(model32))):
        drv = StreamDriver(m, runner, trim_conformer=trim, seed=0)
        st = drv.setup(prompt, pmel, spk)
        pcm[name] = torch.cat([drv.step(st, tok).float().cpu() for _ in range(chunks)], dim=-1)
    ref = pcm["eager_fp32"]
    return {"chunks": chunks, "samples": ref.shape[-1],
            "engines_vs_fp32": fidelity(pcm["engines"], ref), "eager_vs_fp32": fidelity(pcm["eager"], ref)}


def _copy_state(st):
    import copy
    new = copy.copy(st)
    for f in ("conformer_cnn", "conformer_att", "estimator_cnn", "estimator_att", "hift_mel", "hift_source",
              "hift_speech"):
        setattr(new, f, getattr(st, f).clone())
    return new


def bench_peer(model, device, reps: int) -> dict:
    """step-audio2's reference (its own modules, our weights): B=1 fp32 eager flow chunk of 28
    tokens after a 300-frame prompt, and its HiFT on 58 frames with the 3840-sample cache."""
    try:
        from cosyvoice2.flow.decoder_dit import DiT
        from cosyvoice2.flow.flow import CausalMaskedDiffWithXvec
        from cosyvoice2.flow.flow_matching import CausalConditionalCFM
        from cosyvoice2.transformer.upsample_encoder_v2 import UpsampleConformerEncoderV2
    except ImportError:
        return {"skipped": "step-audio2 not importable"}
    cfg = model.cfg
    e, d = cfg.encoder, cfg.dit
    enc = UpsampleConformerEncoderV2(input_size=e.width, output_size=e.width, pre_lookahead_len=e.pre_lookahead,
                                     num_blocks=e.blocks, num_up_blocks=e.up_blocks, up_stride=2, up_scale_factor=2,
                                     attention_heads=e.heads, linear_units=e.ffn, dropout_rate=0.0,
                                     positional_dropout_rate=0.0)
    dit = DiT(in_channels=d.in_channels, out_channels=80, mlp_ratio=d.mlp_ratio, depth=d.depth, num_heads=d.heads,
              head_dim=d.head_dim, hidden_size=d.hidden)
    ref = CausalMaskedDiffWithXvec(input_size=e.width, output_size=80, spk_embed_dim=192, vocab_size=cfg.vocab_size,
                                   encoder=enc, decoder=CausalConditionalCFM(dit, inference_cfg_rate=cfg.cfg_rate))
    ref.load_state_dict({k: v.float() for k, v in model.flow.state_dict().items()}, strict=True)
    ref = ref.to(device).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, 153), generator=g).to(device)
    pmel, spk = torch.randn(1, 300, 80, generator=g).to(device), torch.randn(1, 192, generator=g).to(device)
    tok = torch.randint(0, cfg.vocab_size, (1, 28), generator=g).to(device)
    with torch.inference_mode():
        cache0 = {k: v.clone() for k, v in ref.setup_cache(prompt, pmel, spk).items()}
        flow = timed(lambda: ref.inference_chunk(tok, spk, dict(cache0), last_chunk=False), device, 2, reps)
    return {"what": "step-audio2 1.0.0 flow.inference_chunk, B=1, 28 tokens, fp32 eager (HiFT not included)",
            "flow_chunk": flow}


_CELLS = ("eager", "eager_graph", "engine", "engine_graph")      # a key row's timed cells


def _cell(x) -> str:
    return "-" if not x or "median_ms" not in x else f"{x['median_ms']:.3f} / {x['p95_ms']:.3f}"


def _fid(x) -> str:
    f = (x or {}).get("fp32_fidelity")
    return "-" if not f else f"{f['rel_l2']:.1e} / {f['snr_db']:.1f}"


def _stream_cell(r: dict) -> str:
    st = r.get(r.get("served_variant", ""), {}).get("steady_stream")
    if not st:
        return "-"
    sp = r.get("stream_speedup_vs_eager")
    return f"{st['median_ms']:.3f} / {'-' if sp is None else f'{sp:.1f}x'}"


def _served_cell(x: dict) -> str:
    return f"{x['engine_calls']} / {x['eager_fallbacks']}" if "engine_calls" in x else "-"


def to_markdown(res: dict) -> str:
    head = (f"Device {res['device']}, torch {res['torch']}, backend {res['backend']['name']} "
            f"{res['backend']['version']}, model {res['model']['spec']}, precision {res['precision']}, "
            f"commit {res['commit']}, {res['date']}")
    lines = [head, "", "Per key, ms median / p95. Speed-up: eager / the engine as the runtime serves it "
             "(with or without a CUDA graph, by the backend's graph policy; * marks the served cell), "
             "each call handed the key's example cache; the last column: a CFM engine that writes its "
             "cache in place, handed back the cache it returned, trimmed to the key's L (a steady stream; "
             "where a key is too large for a graph per call, engine+graph replays one graph per resident "
             "ring there only, so its per-call cell is the engine's own calls). "
             "Fidelity: first output against the float32 model, rel-L2 / SNR dB (reduced-precision keys).", "",
             "| key | eager | eager+graph | engine | engine+graph | speed-up | rel-L2 vs eager "
             "| fidelity eager | fidelity engine | build s | served in a steady stream: ms / speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["keys"]:
        rel = max((r[v]["max_rel_l2_vs_eager"] for v in ("engine", "engine_graph")
                   if "max_rel_l2_vs_eager" in r.get(v, {})), default=float("nan"))
        sp = r.get("speedup_vs_eager")
        best = min((r[v] for v in ("engine_graph", "engine") if "median_ms" in r.get(v, {})),
                   key=lambda x: x["median_ms"], default=None)
        best = r.get(r.get("served_variant", ""), best)
        mark = {v: " *" if r.get("served_variant") == v else "" for v in ("engine", "engine_graph")}
        lines.append(f"| {r['id']} | {_cell(r.get('eager'))} | {_cell(r.get('eager_graph'))} | "
                     f"{_cell(r.get('engine'))}{mark['engine']} | {_cell(r.get('engine_graph'))}{mark['engine_graph']} | "
                     f"{'-' if sp is None else f'{sp:.1f}x'} | {rel:.1e} | {_fid(r.get('eager'))} | "
                     f"{_fid(best)} | {r['build_seconds']} | {_stream_cell(r)} |")
    failed = [f"- {r['id']}, {'fidelity' if what == 'fp32_fidelity_error' else cell}: {r[cell][what]}"
              for r in res["keys"] for cell in _CELLS
              for what in ("error", "fp32_fidelity_error") if what in r.get(cell, {})]
    if failed:
        lines += ["", "Cells left empty above, and why:"] + failed
    lines += ["", "Streaming chunks (encoder + CFM + HiFT + cache handling), ms median. Served: unit calls "
              "an engine ran / fell back to eager in the engines row.", "",
              "| B | chunk tokens | first: eager / engines ms | served | steady: eager / engines ms | served | "
              "steady audio-s/s | first speed-up | steady speed-up |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["stream"]:
        if "B" in r and "error" in r:
            lines.append(f"| {r['B']} | {r['chunk_tokens']} | failed: {r['error']} |")
        elif "B" in r:
            lines.append(f"| {r['B']} | {r['chunk_tokens']} | {r['eager_first']['median_ms']:.1f} / "
                         f"{r['engines_first']['median_ms']:.1f} | {_served_cell(r['engines_first'])} | "
                         f"{r['eager_steady']['median_ms']:.1f} / {r['engines_steady']['median_ms']:.1f} | "
                         f"{_served_cell(r['engines_steady'])} | {r['audio_s_per_s_steady']:.0f} | "
                         f"{r['speedup_first']:.1f}x | {r['speedup_steady']:.1f}x |")
    for r in res["stream"]:
        if "memory" in r:
            m = r["memory"]
            device_total = (f" ({m['added_device_bytes'] / 2**20:.0f} MiB on the whole device)"
                            if "added_device_bytes" in m else "")
            lines += ["", f"Loading every engine ({m['engines']}) added {m['added_bytes'] / 2**20:.0f} MiB of "
                      f"PyTorch-allocated memory{device_total} to the eager model's weights "
                      f"({sum(m['weights_bytes'].values()) / 2**20:.0f} MiB: "
                      f"{ {k: round(v / 2**20) for k, v in m['weights_bytes'].items()} } MiB); budget "
                      f"{m['budget_bytes'] / 2**30:.0f} GiB, within: {m['within_budget']}."]
            split = m.get("per_engine_bytes")
            if split:
                lines += ["", "Added by each engine as it loaded, MiB: total (allocated / graph pool / outside "
                          "PyTorch's allocator): " + ", ".join(
                              f"{k} {v['total'] / 2**20:.0f} ({v['allocated'] / 2**20:.0f} / {v['pool'] / 2**20:.0f}"
                              f" / {v['outside'] / 2**20:.0f})" for k, v in split.items()) + "."]
            elif m.get("per_engine_added_bytes"):       # JSON of runs 4-5: allocator only
                lines += ["", "Added by each engine as it loaded, MiB (PyTorch's allocator): " + ", ".join(
                    f"{k} {v / 2**20:.0f}" for k, v in m["per_engine_added_bytes"].items()) + "."]
        if "session_fidelity" in r:
            f = r["session_fidelity"]
            lines += ["", f"Audio of a B=1 session ({f['chunks']} chunks, {f['samples']} samples) against the "
                      f"float32 model: engines rel-L2 {f['engines_vs_fp32']['rel_l2']:.1e} / SNR "
                      f"{f['engines_vs_fp32']['snr_db']:.1f} dB; reduced-precision eager "
                      f"{f['eager_vs_fp32']['rel_l2']:.1e} / {f['eager_vs_fp32']['snr_db']:.1f} dB."]
    if "traffic" in res:
        t = res["traffic"]
        lines += ["", f"Traffic mix of profile {t['profile']}: {len(t['sessions'])} kinds of session through the "
                  f"streaming driver; engines served {t['measured_hit_rate']:.1%} of unit calls (planner's "
                  f"prediction for the keys built here: {t['predicted_hit_rate']:.1%})."]
    peer = res.get("peer", {})
    if "flow_chunk" in peer:
        lines += ["", f"Peer: {peer['what']}: {peer['flow_chunk']['median_ms']:.1f} ms (p95 {peer['flow_chunk']['p95_ms']:.1f})"]
    if "peak_device_bytes" in res:
        lines += ["", f"Peak device memory during the run: {res['peak_device_bytes'] / 2**30:.2f} GiB"]
    if res.get("omitted"):
        lines += [""] + [f"Omitted: {why}." for why in res["omitted"]]
    return "\n".join(lines)


def omitted_sections(device: torch.device, peer: bool, reduced: bool) -> list[str]:
    """One line per section this run leaves out, and why (so a CPU run does not look complete)."""
    out = []
    if device.type != "cuda":
        out.append("device memory the engines add at load: measured on CUDA only; this run is on the CPU")
    if not peer:
        out.append("step-audio2 peer row: turned off (--no-peer)")
    elif device.type != "cuda":
        out.append("step-audio2 peer row: timed on CUDA only; this run is on the CPU")
    if not reduced:
        out.append("B=1 session audio SNR against float32: the artifacts are float32 already")
    return out


def write(res: dict, out: Path, render=None) -> None:
    """The JSON and its markdown table (`render(res)`, default this module's), each replaced
    atomically (a run killed by a time limit leaves the previous complete files, never a
    truncated one)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = (render or to_markdown)(res)
    for path, text in ((out, json.dumps(res, indent=1, default=str)), (out.with_suffix(".md"), md + "\n")):
        atomic_write(path, text)


def bench_traffic(artifact_dir: Path, profile, model=None, cuda_graphs: bool | None = None,
                  manifest: Manifest | None = None) -> dict:
    """One session of every kind in `profile`'s traffic mix (exporter.traffic: batch size x chunk
    size x number of chunks x final-chunk size) through the streaming driver and this directory's
    engine cache: the share of unit calls an engine served, weighted by each kind's share, next
    to what the planner predicts for the keys built here. A final chunk of unknown size (no
    traffic.tail_tokens) is not run and counts as UNKNOWN_TAIL_CALLS misses, as in the prediction.
    The mix is the profile's; the schedule and precision are the ones the artifacts were built with.
    model: the directory's model at its precision on its device (default: loaded here).
    manifest: the directory's, already read (default: read here)."""
    from c2w.exporter.profile import Precision, Schedule
    from c2w.exporter.traffic import UNKNOWN_TAIL_CALLS, session_calls
    manifest = read_manifest(artifact_dir) if manifest is None else manifest
    profile = dataclasses.replace(profile, precision=Precision(**manifest.precision), schedule=Schedule(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in manifest.schedule.items()}))
    device = torch.device("cpu" if manifest.device == "cpu" else "cuda")
    if model is None:
        model = model_from_manifest(manifest, device)
    cache = EngineCache(artifact_dir, model, device, manifest=manifest, cuda_graphs=cuda_graphs)
    tr, P, trim = profile.traffic, profile.schedule.prompt_frames, profile.schedule.trim_conformer
    calls, total = session_calls(model.cfg, profile)
    built = {entry_key(e) for e in manifest.entries if e.status == "built"}
    predicted = sum(n for k, n in calls.items() if k in built) / total
    hits = served = 0.0
    rows = []
    tails = tr.tail_tokens or ((None, 1.0),)
    for B, pb in tr.batch_sizes:
        for N, pn in tr.chunk_tokens:
            for n, ps in tr.session_chunks:
                for t, pt in tails:
                    w = pb * pn * ps * pt
                    if w == 0:
                        continue
                    h0, f0 = _served(cache)
                    prompt, pmel, spk, tok = _prompt(model, B, P, N, device)
                    drv = StreamDriver(model, cache, trim_conformer=trim)
                    st = drv.setup(prompt, pmel, spk)
                    for _ in range(n):
                        drv.step(st, tok)
                    if t is not None:
                        drv.step(st, tok[:, :1].expand(B, t).contiguous(), last=True)
                    h, f = _served(cache)
                    h, f = h - h0, f - f0 + (UNKNOWN_TAIL_CALLS if t is None else 0)
                    rows.append({"B": B, "chunk_tokens": N, "chunks": n, "tail_tokens": t, "share": w,
                                 "engine_calls": h, "eager_calls": f})
                    hits, served = hits + w * h, served + w * (h + f)
    cache.release()
    return {"profile": profile.name, "measured_hit_rate": hits / served, "predicted_hit_rate": predicted,
            "sessions": rows}


def calibration(res: dict) -> dict:
    """The per-key timings of a bench result as the planner reads them (exporter.traffic): for
    every key whose eager and served-engine medians were measured, both in ms. The set-up
    (device, backend, precision, model config) travels with them: the planner refuses timings
    measured for another."""
    from c2w.exporter.traffic import CALIBRATION_FORMAT
    keys = []
    for r in res["keys"]:
        eager, served = r.get("eager", {}), r.get(r.get("served_variant", ""), {})
        if "median_ms" in eager and "median_ms" in served:
            keys.append({"key": {"component": r["component"], "dtype": r["dtype"], **r["dims"]},
                         "eager_ms": eager["median_ms"], "engine_ms": served["median_ms"],
                         "engine_variant": r["served_variant"]})
    return {"format": CALIBRATION_FORMAT, "device": res["device"], "backend": res["backend"], "model": res["model"],
            "precision": res["precision"], "torch": res["torch"], "commit": res["commit"], "date": res["date"],
            "keys": keys}


def write_calibration(res: dict, path: Path) -> int:
    """Write calibration(res) to `path` atomically; the number of keys it holds (0: nothing written)."""
    cal = calibration(res)
    if cal["keys"]:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(Path(path), json.dumps(cal, indent=1))
    return len(cal["keys"])
