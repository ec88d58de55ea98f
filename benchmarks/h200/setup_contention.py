"""Why a shard of a many-shard export spends minutes before its first build: N processes set up
the full model at once (as N `c2w export --shard K/N` on one machine do), each timing its phases.

    python benchmarks/h200/setup_contention.py --procs 26 [--threads 1] --out setup.json

--threads T: torch.set_num_threads(T) in each process first (default: torch's own, one per core).
Prints the slowest process's phases and writes every process's.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time


def one(threads: int, device: str, start: float, q) -> None:
    t = {"start": time.time() - start}
    import torch
    if threads:
        torch.set_num_threads(threads)
    t["import"] = time.time() - start
    torch.zeros(1, device=device)
    t["device_init"] = time.time() - start
    from c2w.runtime.model.weights import load_model
    model = load_model("random:full")
    t["model_cpu"] = time.time() - start
    from c2w.runtime.precision import component_dtypes
    model.to(torch.device(device), component_dtypes({"flow_encoder": "float16", "cfm": "float16", "hift": "float32"}))
    if device == "cuda":
        torch.cuda.synchronize()
    t["model_on_device"] = time.time() - start
    q.put(t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=26)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q, start = ctx.Queue(), time.time()
    ps = [ctx.Process(target=one, args=(a.threads, a.device, start, q)) for _ in range(a.procs)]
    for p in ps:
        p.start()
    got = [q.get() for _ in ps]
    for p in ps:
        p.join()
    worst = max(got, key=lambda t: t["model_on_device"])
    print(f"procs={a.procs} threads={a.threads or 'default'}: slowest " +
          ", ".join(f"{k} {v:.1f} s" for k, v in worst.items()), flush=True)
    if a.out:
        json.dump({"procs": a.procs, "threads": a.threads, "processes": got}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
