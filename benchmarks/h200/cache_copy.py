"""How fast the CFM's attention cache can be copied into a strided half of the solve's output.

Run 13c (benchmarks/h200/README.md) made the Euler step return only the chunk's T frames of each
new attention cache and copied the step's input cache into the frames after them in the solve's
output, instead of the step stacking all L + T frames and the replay copying them out. It was
slower: `copy_` into the strided halves ran at ~1.7 TB/s. This times that copy alone, at the steady
B=32 key's full size (10 steps x 16 blocks x 2B=64 rows x 8 heads, L=400 cache frames written
behind T=150 chunk frames, 128 fp16 values per frame: 8.4 GB read, 8.4 GB written), three ways:
  - copy_: `out.narrow(-2, T, L).copy_(cache)` as run 13c did;
  - int64: the same through int64 views of both sides (the last dim is contiguous, so each
    element moves 4 fp16 values: a quarter of the index arithmetic);
  - triton: a kernel that copies one contiguous run of L x 128 values per program;
and the contiguous copy of the same bytes (`torch.Tensor.copy_` between contiguous tensors) as the
bandwidth to compare with. Prints GB/s per way and writes $OUT/cache_copy.json.

With --trim it times instead the streaming driver's trim of a whole output cache (L + T frames down
to the first P and the last 100: `runtime.trim.CacheTrim.apply`, "trim_cache" in the JSON) against
the same trim as the `torch.cat` of two slices it was before run 14 (the steady key: 11.5 GB in,
8.4 GB kept). Since run 19 an AOTI chunk-frames replay writes the kept frames only (when P >= T)
and this copy is not made; other engines and eager still make it.

With --replay DIR it times, for every built CFM key with a cache (L > 0) in an artifact directory,
the solve as served followed by the trim (before run 19) against the solve given the trim, whose
replay writes only the kept frames (run 19), says whether the two caches are byte-identical, and
counts the calls the engine served (`calls`: hits, against misses and failures served eagerly).

Usage (device): python3 benchmarks/h200/cache_copy.py --out $OUT [--trim | --replay DIR] [--steps 10 ...]
CPU check (every way against copy_, small shapes; Triton under its interpreter):
  TRITON_INTERPRET=1 python3 benchmarks/h200/cache_copy.py --check
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch


def copy_plain(out: torch.Tensor, cache: torch.Tensor, T: int) -> None:
    out.narrow(-2, T, cache.shape[-2]).copy_(cache)


def copy_int64(out: torch.Tensor, cache: torch.Tensor, T: int) -> None:
    out.view(torch.int64).narrow(-2, T, cache.shape[-2]).copy_(cache.view(torch.int64))


def copy_triton(out: torch.Tensor, cache: torch.Tensor, T: int) -> None:
    import triton
    rows, run = cache.numel() // (cache.shape[-2] * cache.shape[-1]), cache.shape[-2] * cache.shape[-1]
    out_row = out.shape[-2] * out.shape[-1]
    BLOCK = 4096
    _copy_runs()[(rows, triton.cdiv(run, BLOCK))](cache, out, run, out_row, T * out.shape[-1], BLOCK=BLOCK)


@functools.cache
def _copy_runs():
    """The Triton kernel, defined on first use (Triton is imported only by the ways that need it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(src, dst, run, dst_row, dst_offset, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = i < run
        values = tl.load(src + row * run + i, mask=mask)
        tl.store(dst + row * dst_row + dst_offset + i, values, mask=mask)
    return kernel


WAYS = {"copy_": copy_plain, "int64": copy_int64, "triton": copy_triton}


def cache_of(steps, depth, rows, heads, T, L, width, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(steps, depth, rows, heads, L, width, generator=g, device=device).half()


def output_of(steps, depth, rows, heads, T, L, width, device):
    return torch.zeros(steps, depth, rows, heads, T + L, width, dtype=torch.float16, device=device)


def check() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--check runs under Triton's interpreter: TRITON_INTERPRET=1 python3 ... --check")
    for shape in ((2, 3, 2, 2, 5, 7, 8), (1, 2, 4, 1, 3, 11, 128)):
        cache, want = cache_of(*shape, device="cpu"), output_of(*shape, device="cpu")
        copy_plain(want, cache, shape[4])
        for name, way in WAYS.items():
            got = output_of(*shape, device="cpu")
            way(got, cache, shape[4])
            assert torch.equal(got, want), (name, shape)
    print("cache_copy --check: every way equals copy_ on 2 shapes")


def timed(fn, reps: int) -> float:
    """Median seconds of one call, each timed by CUDA events after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("steps", 10), ("depth", 16), ("rows", 64), ("heads", 8), ("T", 150), ("L", 400),
                          ("width", 128), ("reps", 10)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--check", action="store_true", help="CPU check of every way (see the docstring)")
    ap.add_argument("--trim", action="store_true", help="time the driver's trim instead (see the docstring)")
    ap.add_argument("--replay", metavar="DIR", help="time the CFM engines' solve with the trim (see the docstring)")
    ap.add_argument("--prompt-frames", type=int, default=300)
    a = ap.parse_args()
    if a.check:
        return check()
    if a.trim:
        return trim(a)
    if a.replay:
        return replay_trim(a)
    shape = (a.steps, a.depth, a.rows, a.heads, a.T, a.L, a.width)
    cache, want = cache_of(*shape, device="cuda"), output_of(*shape, device="cuda")
    copy_plain(want, cache, a.T)
    moved = 2 * cache.numel() * cache.element_size()             # read once, written once
    flat = torch.empty_like(cache)
    rows = {"contiguous copy_": timed(lambda: flat.copy_(cache), a.reps)}
    for name, way in WAYS.items():
        out = output_of(*shape, device="cuda")
        way(out, cache, a.T)
        assert torch.equal(out, want), name
        rows[name] = timed(lambda: way(out, cache, a.T), a.reps)
        del out
    result = {"shape": dict(zip(("steps", "depth", "rows", "heads", "T", "L", "width"), shape)),
              "bytes_moved": moved, "device": torch.cuda.get_device_name(),
              "commit": os.environ.get("C2W_COMMIT", "unknown"), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "ways": {k: {"ms": round(v * 1e3, 3), "GB_s": round(moved / v / 1e9, 1)} for k, v in rows.items()}}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "cache_copy.json").write_text(json.dumps(result, indent=1))
    for k, v in result["ways"].items():
        print(f"{k:18s} {v['ms']:8.3f} ms  {v['GB_s']:7.1f} GB/s  ({moved / 1e9:.1f} GB moved)")


def trim(a) -> None:
    from c2w.runtime.trim import KEEP_RECENT, CacheTrim
    P, n = a.prompt_frames, a.L + a.T
    cache = cache_of(a.steps, a.depth, a.rows, a.heads, 0, n, a.width, device="cuda")
    ways = {"cat (before run 14)": lambda: torch.cat([cache.narrow(4, 0, P), cache.narrow(4, n - KEEP_RECENT, KEEP_RECENT)], 4),
            "trim_cache": lambda: CacheTrim(P).apply(cache)}
    assert torch.equal(ways["cat (before run 14)"](), ways["trim_cache"]())
    kept = cache.numel() // n * (P + KEEP_RECENT) * cache.element_size()
    rows = {k: timed(way, a.reps) for k, way in ways.items()}
    result = {"shape": {"steps": a.steps, "depth": a.depth, "rows": a.rows, "heads": a.heads, "frames": n,
                        "kept": P + KEEP_RECENT, "width": a.width}, "bytes_moved": 2 * kept,
              "device": torch.cuda.get_device_name(), "commit": os.environ.get("C2W_COMMIT", "unknown"),
              "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "ways": {k: {"ms": round(v * 1e3, 3), "GB_s": round(2 * kept / v / 1e9, 1)} for k, v in rows.items()}}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "trim_copy.json").write_text(json.dumps(result, indent=1))
    for k, v in result["ways"].items():
        print(f"trim: {k:20s} {v['ms']:8.3f} ms  {v['GB_s']:7.1f} GB/s  ({2 * kept / 1e9:.1f} GB moved)")


def replay_trim(a) -> None:
    from c2w.runtime.cache import EngineCache
    from c2w.runtime.manifest import model_from_manifest, read_manifest
    from c2w.runtime.trim import CacheTrim
    from c2w.runtime.units import SPECS
    from c2w.runtime.verify import entry_key
    manifest, device, trim = read_manifest(a.replay), torch.device("cuda"), CacheTrim(a.prompt_frames)
    model = model_from_manifest(manifest, device)
    engines = EngineCache(a.replay, model, device)
    rows = []
    for e in manifest.entries:
        if e.status != "built" or e.component != "cfm" or not e.dims["L"]:
            continue
        key = entry_key(e)
        inputs = SPECS["cfm"].example_inputs(model.cfg, key, seed=7, device=device)
        after = lambda: trim.apply(engines.run(key, inputs)[2])           # noqa: E731
        given = lambda: engines.run(key, inputs, trim)[2]                 # noqa: E731
        same = torch.equal(after().view(torch.uint8), given().view(torch.uint8))
        rows.append({"key": e.id, "kept_frames": trim.kept(e.dims["T"] + e.dims["L"]), "identical": same,
                     "trim_after_ms": round(timed(after, a.reps) * 1e3, 3),
                     "trim_given_ms": round(timed(given, a.reps) * 1e3, 3),
                     "calls": engines.stats()["cfm"].get(e.id, {})})     # hits: the engine ran them
        print(f"replay: {e.id:28s} trim after {rows[-1]['trim_after_ms']:8.3f} ms, given "
              f"{rows[-1]['trim_given_ms']:8.3f} ms, identical: {same}")
    result = {"prompt_frames": a.prompt_frames, "device": torch.cuda.get_device_name(),
              "commit": os.environ.get("C2W_COMMIT", "unknown"), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "keys": rows}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "replay_trim.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
