"""How the host launches the CFM's ungraphed in-place Euler step, and what one CUDA graph over a
stream's own ring buffer would save (issue #15). At B=32 AOTIBackend captures no graph: one
step's static inputs would be its blocks' whole attention buffers (over 1 GB), so each step is
the package's own run.

The in-place step (AOTI revision 4) served to a steady stream at B, T, L, each solve handed the
ring the previous one returned (cfm_profile.served_forms), timed per 10-step solve:
  - served: the engine as AOTIBackend loads it at this size, the runner's thread-safe `run`. Its
    container has one model instance, and a call that finds it busy waits on the host for that
    instance's last kernels (AOTInductorModelContainer::get_available_model): step s+1 is
    launched only once step s has finished on the GPU;
  - single-threaded: the same package loaded with run_single_threaded=True (no such wait);
  - solve graph: the whole solve, ten single-threaded steps, captured in ONE CUDA graph whose
    attention buffers are the ring's own: a solve copies in the chunk's inputs and its free
    slots, replays, and no cache frame moves.
Also eager and eager under one graph (the ratios), the GPU timeline's idle time in one solve of
each variant, the host's time per solve call, and whether each variant's outputs over two solves
and its ring buffer after them equal the first variant's (the solve graph's), bit for bit.

Build with cfm_profile.py first (the same shape, depth and tag name the package):
    python3 benchmarks/h200/cfm_profile.py --phase build --batch 32 --T 150 --L 400 --depth 16 --tag inplace
    python3 benchmarks/h200/step_launch.py --batch 32 --T 150 --L 400 --depth 16 --tag inplace --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.h200.cfm_profile import artifact_info, first_ring, models  # noqa: E402
from c2w.exporter.bench.engines import timed  # noqa: E402
from c2w.runtime.engines.aoti import AOTIBackend, AOTIEngine, EulerReplay, bind_constants, load_runner  # noqa: E402
from c2w.runtime.engines.graphs import CapturedCall, GraphPool, warmup_stream  # noqa: E402
from c2w.runtime.ring import RingCache  # noqa: E402
from c2w.runtime.trim import KEEP_RECENT, CacheTrim  # noqa: E402
from c2w.runtime.units import SPECS, ShapeKey  # noqa: E402
from c2w.runtime.verify import unit_weights  # noqa: E402


def single_threaded_engine(info, weights, dev) -> AOTIEngine:
    """The package as AOTIBackend.load makes an ungraphed engine, its runner loaded with
    run_single_threaded=True (the engine's `_fn` is its EulerReplay)."""
    runner = load_runner(str(info.path), dev, single_threaded=True)
    table = bind_constants(runner, info, weights, dev)
    replay = EulerReplay(runner, int(info.extra.get("n_steps", 10)), dev, "in_place")
    return AOTIEngine(info, replay, dev, [runner, table])


class SolveGraph:
    """The whole in-place solve over one ring buffer, captured in one CUDA graph: the loop of an
    ungraphed single-threaded `replay` (runtime.engines.aoti.EulerReplay._in_place) with every
    input static. The graph writes the buffer it was captured on; a solve hands it a ring of that
    buffer."""

    def __init__(self, replay: EulerReplay, ring: RingCache, x, dev):
        self.replay, self.buffer = replay, ring.buffer
        self.static = [t.clone() for t in x[:5]]                # mu, spk, cond, x0, cnn caches
        self.index = replay._slots(ring.free())
        self.x = torch.empty(x[3].shape, dtype=torch.float32, device=dev)
        self.cnn = torch.empty_like(x[4])
        assert len(self.index) == x[0].shape[2]

        def solve():
            mu, spk, cond, x0, cnn = self.static
            x_in = x0
            for i, (s, dt) in enumerate(zip(replay.s, replay.dt)):
                out = replay.step(mu, spk, cond, x_in, cnn[i], s, dt, self.index, *self.buffer[i].unbind(0))
                self.x.copy_(out[0])
                self.cnn[i].copy_(out[1])
                x_in = self.x

        # the warm-ups write the ring's free slots, which the next solve writes anyway
        side = warmup_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                solve()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            solve()

    def __call__(self, x, ring: RingCache, trim: CacheTrim):
        if ring.buffer is not self.buffer:
            raise ValueError("this graph writes another buffer")
        slots = ring.free()
        self.index.copy_(self.replay._slots(slots))
        for dst, src in zip(self.static, x[:5]):
            dst.copy_(src)
        self.graph.replay()
        return [self.x.clone(), self.cnn.clone(), trim.apply(RingCache(self.buffer, [*slots, *ring.order]))]


def timeline(fn) -> dict:
    """One call of `fn` on the GPU's timeline (torch.profiler): kernels and copies, their summed
    time, the span from the first one's start to the last one's end, the idle time between them,
    and the largest gaps with the kernels around them."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    if not ev:                          # e.g. a graph replay the profiler does not see into
        return {"kernels": 0, "busy_ms": float("nan"), "span_ms": float("nan"), "idle_ms": float("nan"),
                "gaps_over_20us": 0, "idle_in_gaps_over_20us_ms": float("nan"), "largest_gaps": []}
    busy = sum(e.time_range.end - e.time_range.start for e in ev)
    span = ev[-1].time_range.end - ev[0].time_range.start
    gaps = sorted(((b.time_range.start - a.time_range.end, a.name[:60], b.name[:60]) for a, b in zip(ev, ev[1:])),
                  reverse=True)
    return {"kernels": len(ev), "busy_ms": busy / 1e3, "span_ms": span / 1e3, "idle_ms": (span - busy) / 1e3,
            "gaps_over_20us": sum(1 for g in gaps if g[0] > 20), "idle_in_gaps_over_20us_ms":
            sum(g[0] for g in gaps if g[0] > 20) / 1e3,
            "largest_gaps": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in gaps[:8]]}


def host_ms(fn, dev, reps: int = 5) -> float:
    """Median host time of one call of `fn`, the GPU idle before each (what the host spends
    launching, or waiting where the call waits)."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize(dev)
    return sorted(ts)[len(ts) // 2]


def measure(name: str, solve_from, chunks, trim, dev, reps: int, ref: dict | None) -> tuple[dict, dict]:
    """Time a variant in a steady stream. solve_from(inputs, ring) -> outputs, ring. Two solves
    from the first ring, on the two chunks' inputs (mu, spk, cond, x0, cnn caches; different
    draws: a graph must follow new inputs, design note 8), are compared with `ref` (the first
    variant's; None: this is it); the timing repeats the first chunk's."""
    x = chunks[0]
    ring = first_ring(x)
    outs = []
    for inputs in chunks:
        out = solve_from(inputs, ring)
        ring = out[2]
        outs.append([o.clone() for o in out[:2]])
    res = {}
    if ref is None:
        # a copy: the steady timing below goes on writing this variant's buffer (run 23's calls
        # 3-6 compared against the buffer itself, so their "buffer" difference is of later solves)
        ref = {"outs": outs, "buffer": ring.buffer.clone(), "order": ring.order}
    else:
        # max |diff| of each solve's x and cnn caches and of the ring's buffer (NaN where either has one)
        res["max_abs_diff"] = {f"solve{i + 1}_{n}": float((a.float() - b.float()).abs().max())
                               for i, (o, r) in enumerate(zip(outs, ref["outs"])) for n, a, b in zip(("x", "cnn"), o, r)}
        res["max_abs_diff"]["buffer"] = float(max((a.float() - b.float()).abs().max()
                                                  for a, b in zip(ring.buffer.flatten(0, 1), ref["buffer"].flatten(0, 1))))
        res["order_equal"] = ring.order == ref["order"]
        res["equals_first"] = res["order_equal"] and all(d == 0 for d in res["max_abs_diff"].values())
        print(f"   {name} against the first variant: {res['max_abs_diff']}, order equal: {res['order_equal']}", flush=True)
    state = {"ring": ring}

    def steady():
        state["ring"] = solve_from(x[:5], state["ring"])[2]
    res["steady"] = timed(steady, dev, 2, reps)
    res["host_ms"] = host_ms(steady, dev)
    res["timeline"] = timeline(steady)
    res["kept_its_buffer"] = state["ring"].buffer is ring.buffer
    tl = res["timeline"]
    print(f"{name:16s} steady {res['steady']['median_ms']:7.2f} ms  host {res['host_ms']:7.2f} ms  kernels "
          f"{tl['kernels']} busy {tl['busy_ms']:.2f} ms idle {tl['idle_ms']:.2f} ms ({tl['gaps_over_20us']} gaps > 20 us: "
          f"{tl['idle_in_gaps_over_20us_ms']:.2f} ms)" + (f"  = first variant: {res['equals_first']}" if "equals_first" in res else ""),
          flush=True)
    return res, ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--T", type=int, default=150)
    ap.add_argument("--L", type=int, default=400)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--tag", default="inplace", help="cfm_profile.py's --tag of the build")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    name = f"cfm_profile_B{a.batch}_T{a.T}_L{a.L}_d{a.depth}_{a.tag}"
    path = Path(f"/tmp/{name}.pt2")
    extra = json.loads(path.with_suffix(".build.json").read_text())["extra"]
    if extra.get("step_att") != "in_place":
        raise SystemExit(f"{path} is a {extra.get('step_att', 'whole')!r} step; this measures the in-place one")
    model, _ = models(a.depth, dev)
    key = ShapeKey("cfm", (a.batch, a.T, a.L), "float16")
    unit = SPECS["cfm"].build(model, key).eval()
    x = SPECS["cfm"].example_inputs(model.cfg, key, device=dev)     # drawn on the device, seed 0
    info, weights = artifact_info(path, key, x, extra), unit_weights(unit)
    # a second chunk: other inputs of the same shapes (its attention cache is not used)
    chunks = [x, SPECS["cfm"].example_inputs(model.cfg, key, device=dev, seed=1)[:5]]
    trim = CacheTrim(a.L - KEEP_RECENT)

    def save(res):
        Path(a.out, f"step_launch_B{a.batch}_T{a.T}_L{a.L}_d{a.depth}.json").write_text(json.dumps(res, indent=1))
    res = {"B": a.batch, "T": a.T, "L": a.L, "depth": a.depth, "commit": os.environ.get("C2W_COMMIT", "unknown"),
           "trim_P": a.L - KEEP_RECENT}
    with torch.inference_mode():
        res["eager"] = timed(lambda: unit(*x), dev, 2, a.reps)
        g = CapturedCall(lambda *i: unit(*i), info.input_shapes, [t.dtype for t in x], dev, GraphPool(dev))
        res["eager_graph"] = timed(lambda: g(*x), dev, 2, a.reps)
        g.release()
        del g
        print(f"eager {res['eager']['median_ms']:.2f} ms, eager under one graph {res['eager_graph']['median_ms']:.2f} ms",
              flush=True)

        # the graph first: captured after torch.profiler had run (the other variants' timelines),
        # its replay segfaulted on the H200 (torch 2.11); captured first, it is profiled like them
        st = single_threaded_engine(info, weights, dev)
        graph = {"now": None}

        def graphed(inputs, ring):
            if graph["now"] is None or graph["now"].buffer is not ring.buffer:
                graph["now"] = None
                graph["now"] = SolveGraph(st._fn, ring, x, dev)
            return graph["now"](inputs, ring, trim)
        res["solve_graph"], ref = measure("solve graph", graphed, chunks, trim, dev, a.reps, None)
        graph["now"] = None
        save(res)
        res["single_threaded"], _ = measure("single-threaded", lambda i, r: st.run(i[:5] + [r], trim), chunks, trim, dev,
                                            a.reps, ref)
        st.release()
        del st
        save(res)
        served = AOTIBackend().load(info, weights, dev)
        res["served_graphed"] = isinstance(served._fn.step, CapturedCall)
        res["served"], _ = measure("served", lambda i, r: served.run(i[:5] + [r], trim), chunks, trim, dev, a.reps,
                                  ref)
        served.release()
        del served
    save(res)
    print(f"\nB={a.batch} T={a.T} L={a.L} depth {a.depth}, ms per 10-step solve in a steady stream "
          f"(eager {res['eager']['median_ms']:.2f}, eager + graph {res['eager_graph']['median_ms']:.2f}):")
    for k in ("served", "single_threaded", "solve_graph"):
        r = res[k]
        print(f"  {k:16s} {r['steady']['median_ms']:7.2f}  ({res['eager']['median_ms'] / r['steady']['median_ms']:.2f}x "
              f"eager, {res['eager_graph']['median_ms'] / r['steady']['median_ms']:.2f}x eager + graph; GPU idle "
              f"{r['timeline']['idle_ms']:.2f} ms; = the solve graph's: {r.get('equals_first', '-')}, largest |diff| "
              f"{max(r.get('max_abs_diff', {'-': 0}).values()):.2g})")


if __name__ == "__main__":
    main()
