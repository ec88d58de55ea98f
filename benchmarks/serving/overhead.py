"""Where a lone stream's time goes in the stream server, beside a direct `Runtime.step`.

One stream of 28-token chunks, each submitted as soon as the last came back (concurrency 1).
The server's path is cut into phases by wrapping its methods from outside (nothing in
runtime/ is changed): submit (the caller's checks and queueing), wake (until the chunk lane has
picked the batch), before step (gather / in-place set-up), step (the driver's call, waited for
on the device), after step (PCM to the host, bookkeeping), delivery (until the caller has its
PCM). Prints the medians and writes JSON.

    python benchmarks/serving/overhead.py /tmp/art/all --out overhead.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from c2w import runtime
from c2w.exporter.bench.serving import session_inputs
from c2w.runtime import serving

PHASES = ("submit", "wake", "before_step", "step", "after_step", "delivery")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts")
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--out", default="overhead.json")
    args = ap.parse_args()

    rt = runtime.load(args.artifacts)
    cfg, device = rt.model.cfg, rt.driver._device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prompt, pmel, spk, chunks = session_inputs(cfg, 5, int(rt.schedule.get("prompt_frames", 300)), 28, args.chunks)
    steady = [t for t, _ in chunks[2:-1]]            # past the first two chunks: one steady key

    # direct: Runtime.step on one stream, PCM on the host, as a caller would
    state = rt.setup(prompt[None], pmel[None], spk[None])
    direct = []
    for j, (t, _) in enumerate(chunks[:-1]):
        t0 = time.perf_counter()
        rt.step(state, t[None]).float().cpu()
        if j >= 2:
            direct.append(time.perf_counter() - t0)

    # served, with the phases stamped
    marks: dict[str, float] = {}
    step = rt.driver.step

    def timed_step(st, tokens, last=False):
        marks["step0"] = time.perf_counter()
        out = step(st, tokens, last=last)
        sync()
        marks["step1"] = time.perf_counter()
        return out

    next_batch, chunk = serving.StreamServer._next_batch, serving.StreamServer._chunk

    def timed_next_batch(self, lane, now):
        got = next_batch(self, lane, now)
        if got[0] is not None:
            marks["picked"] = time.perf_counter()
        return got

    def timed_chunk(self, *a):
        out = chunk(self, *a)
        marks["chunk1"] = time.perf_counter()
        return out

    serving.StreamServer._next_batch, serving.StreamServer._chunk = timed_next_batch, timed_chunk
    rt.driver.step = timed_step
    phases, served = {p: [] for p in PHASES}, []
    try:
        with rt.serve(max_streams=2) as srv:
            h = srv.open_stream(prompt, pmel, spk)
            h.ready.result()
            for j, (t, _) in enumerate(chunks[:-1]):
                t0 = time.perf_counter()
                fut = srv.submit(h, t)
                t_sub = time.perf_counter()
                fut.result()
                t1 = time.perf_counter()
                if j < 2:
                    continue
                served.append(t1 - t0)
                for p, v in zip(PHASES, (t_sub - t0, marks["picked"] - t_sub, marks["step0"] - marks["picked"],
                                         marks["step1"] - marks["step0"], marks["chunk1"] - marks["step1"],
                                         t1 - marks["chunk1"])):
                    phases[p].append(v)
    finally:
        serving.StreamServer._next_batch, serving.StreamServer._chunk = next_batch, chunk
        del rt.driver.step

    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "steady_chunks": len(steady),
           "direct_ms": ms(direct), "served_ms": ms(served), "phases_ms": {p: ms(v) for p, v in phases.items()}}
    res["overhead"] = res["served_ms"] / res["direct_ms"] - 1
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"direct {res['direct_ms']:.2f} ms, served {res['served_ms']:.2f} ms ({res['overhead'] * 100:+.1f} %); "
          + ", ".join(f"{p} {v:.3f}" for p, v in res["phases_ms"].items()))


if __name__ == "__main__":
    main()
