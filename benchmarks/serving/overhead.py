"""Where a chunk's time goes in the stream server, beside a direct `Runtime.step` of the same batch.

N streams (default 1) of K-token chunks in lockstep: each round submits every stream's next
chunk at once (`submit_many`) as soon as the last round's PCM is all back, so the server runs
each round as one batch of N, resident from the third round on (docs/serving.md). The direct
reference steps the same N streams as one batch with `Runtime.step`, PCM on the host; two parts of
the server's after-step phase are timed there alone: the PCM's copy to the host, and freeing the
state the step replaced (the server drops its resident batch's previous state after the step).
The server's path is cut into phases by wrapping its methods from outside (nothing in runtime/ is
changed): submit (the caller's checks and queueing), wake (until the chunk lane has picked the
batch), before step (gather / in-place set-up), step (the driver's call, waited for on the
device), after step (PCM to the host, bookkeeping), delivery (until the caller has every PCM).
Rounds from the fourth on count (the first three change keys; at B=32 the fourth is the first
that finds a resident ring, whose solve graph it captures; `--skip` more to leave it out). Prints
the medians and writes JSON.

    python benchmarks/serving/overhead.py /tmp/art/all --out overhead.json
    python benchmarks/serving/overhead.py /tmp/art/all --streams 32 --chunk-tokens 78 --skip 4 --out o32.json
"""
from __future__ import annotations

import argparse
import copy
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
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--chunk-tokens", type=int, default=28)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--skip", type=int, default=2, help="rounds not counted after the first")
    ap.add_argument("--out", default="overhead.json")
    args = ap.parse_args()

    rt = runtime.load(args.artifacts)
    cfg, device = rt.model.cfg, rt.driver._device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    P, N = int(rt.schedule.get("prompt_frames", 300)), args.streams
    ins = [session_inputs(cfg, 5 + i, P, args.chunk_tokens, args.chunks) for i in range(N)]
    rounds = len(ins[0][3]) - 1                        # the final chunk is not a steady one
    counted = lambda j: j > args.skip                  # noqa: E731

    # direct: Runtime.step on the N streams as one batch, PCM on the host, as a caller would
    state = rt.setup(*[torch.stack([x[k] for x in ins]) for k in range(3)])
    direct, to_host, release = [], [], []
    for j in range(rounds):
        previous = copy.copy(state)                    # the server keeps the state a step replaces until after it
        t0 = time.perf_counter()
        pcm = rt.step(state, torch.stack([x[3][j][0] for x in ins]))
        sync()
        t1 = time.perf_counter()
        pcm.float().cpu()
        t2 = time.perf_counter()
        del previous                                   # the replaced caches freed (on the CPU: pages unmapped)
        t3 = time.perf_counter()
        if counted(j):
            direct.append(t3 - t0)
            to_host.append(t2 - t1)
            release.append(t3 - t2)
    del state                                          # the batch's caches (~17 GB at N=32): not kept beside the server's

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
    phases, served, batches = {p: [] for p in PHASES}, [], []
    try:
        with rt.serve(max_streams=max(2, N)) as srv:
            handles = [srv.open_stream(*x[:3]) for x in ins]
            for h in handles:
                h.ready.result()
            for j in range(rounds):
                t0 = time.perf_counter()
                futures = srv.submit_many([(h, x[3][j][0], False) for h, x in zip(handles, ins)])
                t_sub = time.perf_counter()
                for fut in futures:
                    fut.result()
                t1 = time.perf_counter()
                if not counted(j):
                    continue
                served.append(t1 - t0)
                for p, v in zip(PHASES, (t_sub - t0, marks["picked"] - t_sub, marks["step0"] - marks["picked"],
                                         marks["step1"] - marks["step0"], marks["chunk1"] - marks["step1"],
                                         t1 - marks["chunk1"])):
                    phases[p].append(v)
            stats = srv.stats()
    finally:
        serving.StreamServer._next_batch, serving.StreamServer._chunk = next_batch, chunk
        del rt.driver.step

    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "streams": N,
           "chunk_tokens": args.chunk_tokens, "rounds_counted": len(served), "direct_ms": ms(direct),
           "direct_pcm_to_host_ms": ms(to_host), "direct_state_release_ms": ms(release),
           "served_ms": ms(served), "phases_ms": {p: ms(v) for p, v in phases.items()},
           "server_calls": stats["calls"], "in_place_calls": stats.get("in_place_calls", 0),
           "solve_graphs": stats.get("solve_graphs", {})}
    res["overhead"] = res["served_ms"] / res["direct_ms"] - 1
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"N={N}, {args.chunk_tokens}-token chunks: direct {res['direct_ms']:.2f} ms (PCM to the host "
          f"{res['direct_pcm_to_host_ms']:.3f} of it; freeing the state the step replaced "
          f"{res['direct_state_release_ms']:.3f}), served {res['served_ms']:.2f} ms "
          f"({res['overhead'] * 100:+.1f} %); " + ", ".join(f"{p} {v:.3f}" for p, v in res["phases_ms"].items())
          + f"; in-place calls {res['in_place_calls']}; solve graphs {res['solve_graphs']}")


if __name__ == "__main__":
    main()
