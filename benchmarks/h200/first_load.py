"""What a fresh process pays to load its first engines: per key, the load and the first run, and
every child process started through `subprocess.Popen` meanwhile (its command line, and how long
it ran when something waited for it; `os.system` and `multiprocessing` are not seen).

Run 19 found that whichever AOTI package a fresh process loads first takes ~64 s to load on the
H200 (every later one 0.06-0.2 s), 54 s of it spent waiting on 10 child processes started from
Python, and 5 s in Inductor's CPU vector-ISA probe; what the children are was not recorded. A
serving process pays this once at start, and so does every `c2w merge` measurement.

The children were Inductor's probe of the host CPU's vector ISA, which torch's
`aoti_load_package` runs for a warning: g++ compiling test programs and a Python process loading
each. The runtime now loads CUDA packages without it (runtime.engines.aoti.load_runner);
`--torch-loader` loads them through `aoti_load_package` as before, for the comparison. Give each
run a fresh TORCHINDUCTOR_CACHE_DIR: the probe's programs are cached there.

Usage (device): python3 benchmarks/h200/first_load.py DIR KEY_ID [KEY_ID ...] --out $OUT
  [--torch-loader] (keys in the order to load them; DIR: an artifact directory with a manifest).
  Writes $OUT/first_load.json (first_load_torch_loader.json with --torch-loader).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

CHILDREN: list[dict] = []


def record_children() -> None:
    """Note every subprocess.Popen's command line, and its run time when it is waited for."""
    init, wait = subprocess.Popen.__init__, subprocess.Popen.wait

    def recording_init(self, args, *a, **k):
        self._c2w_child = {"argv": args if isinstance(args, str) else [str(x) for x in args], "seconds": None}
        self._c2w_t0 = time.perf_counter()
        CHILDREN.append(self._c2w_child)
        init(self, args, *a, **k)

    def recording_wait(self, *a, **k):
        code = wait(self, *a, **k)
        if self._c2w_child["seconds"] is None:
            self._c2w_child["seconds"] = round(time.perf_counter() - self._c2w_t0, 3)
        return code

    subprocess.Popen.__init__, subprocess.Popen.wait = recording_init, recording_wait


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("keys", nargs="+")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--torch-loader", action="store_true",
                    help="load AOTI packages through torch._inductor.aoti_load_package (the runtime before run 20)")
    a = ap.parse_args()
    record_children()
    t0 = time.perf_counter()
    import torch
    if a.torch_loader:
        from c2w.runtime.engines import aoti
        aoti.load_runner = lambda path, device, single_threaded: torch._inductor.aoti_load_package(
            path, run_single_threaded=single_threaded)
    from c2w.runtime.engines import get_backend
    from c2w.runtime.manifest import model_from_manifest, read_manifest
    from c2w.runtime.units import SPECS, EagerRunner
    from c2w.runtime.verify import artifact_info, entry_key, unit_weights
    res = {"import_s": round(time.perf_counter() - t0, 2), "keys": []}
    manifest = read_manifest(a.dir)
    device = torch.device("cpu" if manifest.device == "cpu" else "cuda")
    t0 = time.perf_counter()
    model = model_from_manifest(manifest, device)
    res["model_s"] = round(time.perf_counter() - t0, 2)
    eager, backend = EagerRunner(model), get_backend(manifest.backend.name)
    entries = {e.id: e for e in manifest.entries}
    for key_id in a.keys:
        entry, first_child = entries[key_id], len(CHILDREN)
        key = entry_key(entry)
        t0 = time.perf_counter()
        engine = backend.load(artifact_info(a.dir, entry, model.cfg), unit_weights(eager.unit(key)), device)
        loaded = time.perf_counter() - t0
        inputs = SPECS[key.component].example_inputs(model.cfg, key, seed=1, device=device)
        t0 = time.perf_counter()
        engine.run(inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        res["keys"].append({"id": key_id, "load_s": round(loaded, 2), "first_run_s": round(time.perf_counter() - t0, 3),
                            "children": CHILDREN[first_child:]})
        engine.release()
        print(f"{key_id}: load {loaded:.2f} s, {len(CHILDREN) - first_child} child processes", flush=True)
    res["children_before_first_key"] = len(CHILDREN) - sum(len(k["children"]) for k in res["keys"])
    Path(a.out).mkdir(parents=True, exist_ok=True)
    res["torch_loader"] = a.torch_loader
    name = "first_load_torch_loader.json" if a.torch_loader else "first_load.json"
    (Path(a.out) / name).write_text(json.dumps(res, indent=1))
    for k in res["keys"]:
        for c in sorted(k["children"], key=lambda c: -(c["seconds"] or 0))[:5]:
            argv = c["argv"] if isinstance(c["argv"], str) else " ".join(c["argv"])
            print(f"  {k['id']}: {c['seconds']} s  {argv[:160]}")


if __name__ == "__main__":
    main()
