"""The kernel table of built engines at their real keys: one call of each, under torch.profiler.

cfm_profile.py profiles a CFM proxy it builds itself (DEPTH blocks); this reads an artifact
directory that `c2w export` (or benchmarks/h200/run.sh) built and profiles the engines as the
runtime loads them, for any unit: the encoder and HiFT have no proxy. Per key: the engine is
loaded without CUDA graphs (a graph replay hides its kernels' launches, not their time: the
table is the GPU time a perfect launcher would leave), run `--warmup` times on the unit's
example inputs, then profiled over one call (for the CFM: the whole 10-step solve). A CFM engine
that takes its cache as a ring (AOTI's in-place step) is run as a steady stream serves it
(exporter.bench.engines.steady_call: each call handed the ring the last one returned, trimmed):
handed the example cache instead, its replay would first lay that cache out in a ring, one copy
of the whole cache (8.4 GB at B=32 T=150 L=400, 4.4 ms of run 29's table), which a steady
stream never pays. The JSON's "call" says which.

Usage (device): python3 benchmarks/h200/engine_kernels.py DIR KEY_ID [KEY_ID ...] --out $OUT
Writes $OUT/engine_kernels_<KEY_ID>.json with the "profile" object that kernel_classes.py
groups into classes:  python3 benchmarks/h200/kernel_classes.py $OUT/engine_kernels_*.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def profile_keys(directory: Path, key_ids: list[str], out: Path, warmup: int = 3) -> list[dict]:
    import torch
    from benchmarks.h200.kernel_classes import profile_kernels
    from c2w.exporter.bench.engines import STREAM_WARMUP, steady_call
    from c2w.runtime.engines import get_backend
    from c2w.runtime.manifest import model_from_manifest, read_manifest
    from c2w.runtime.units import SPECS, EagerRunner
    from c2w.runtime.verify import artifact_info, entry_key, unit_weights
    manifest = read_manifest(directory)
    entries = {e.id: e for e in manifest.entries if e.status == "built"}
    missing = [k for k in key_ids if k not in entries]
    if missing:
        raise SystemExit(f"not built in {directory}: {', '.join(missing)}; built: {', '.join(sorted(entries))}")
    device = torch.device("cpu" if manifest.device == "cpu" else "cuda")
    model = model_from_manifest(manifest, device)
    eager, backend = EagerRunner(model), get_backend(manifest.backend.name, cuda_graphs=False)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for key_id in key_ids:
        key = entry_key(entries[key_id])
        engine = backend.load(artifact_info(directory, entries[key_id], model.cfg),
                              unit_weights(eager.unit(key)), device)
        inputs = SPECS[key.component].example_inputs(model.cfg, key, seed=1, device=device)
        call = steady_call(engine, key, inputs)
        steady = call is not None
        call = call or (lambda: engine.run(inputs))
        for _ in range(max(warmup, STREAM_WARMUP) if steady else warmup):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        prof = profile_kernels(call) if device.type == "cuda" else None
        res = {"key": key_id, "backend": manifest.backend.name, "device": manifest.device,
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "commit": os.environ.get("C2W_COMMIT", ""), "profile_s": round(time.perf_counter() - t0, 2),
               "call": "steady stream" if steady else "example inputs", "profile": prof}
        engine.release()
        (out / f"engine_kernels_{key_id}.json").write_text(json.dumps(res, indent=1))
        results.append(res)
        if prof:
            print(f"{key_id}: {prof['kernels_per_solve']} kernels, {prof['kernel_ms_per_solve']:.2f} ms", flush=True)
        else:
            print(f"{key_id}: loaded and run; no CUDA device, no kernel table", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("keys", nargs="+")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    a = ap.parse_args()
    profile_keys(a.dir, a.keys, a.out, a.warmup)


if __name__ == "__main__":
    main()
