"""How the host launches the CFM's in-place Euler step at B=32, and what serving a steady stream
from one CUDA graph per solve saves (issue #15). At B=32 AOTIBackend captures no graph per step:
one step's static inputs would be its blocks' whole attention buffers (over 1 GB). A resident
ring is solved instead from one graph of the whole solve over its own buffer
(runtime.engines.solve_graphs).

The in-place step (AOTI revision 4) served to a steady stream at B, T, L, each solve handed the
ring the previous one returned (as cfm_profile.served_forms), timed per 10-step solve:
  - served: the engine as AOTIBackend loads it (its default options): single-threaded package,
    the first solve of a ring step by step, the second captures the whole solve over the ring's
    buffer, the later ones replay it;
  - without graphs: AOTIBackend(cuda_graphs=False), the runner's thread-safe `run` (how the
    B=32 solve was served before solve graphs). Its container has one model instance, and a call
    that finds it busy waits on the host for that instance's last kernels
    (AOTInductorModelContainer::get_available_model): step s+1 is launched only once step s has
    finished on the GPU;
  - single-threaded: the package loaded with run_single_threaded=True, step by step (no such
    wait, no graph).
Also eager and eager under one graph (the ratios), the GPU timeline's idle time in one solve of
each variant, the host's time per solve call, the device memory a solve graph adds (its static
buffers, and the segments of the solve graphs' own pool: docs/budget.md counts them), and whether
each variant's outputs over three solves (on three chunks' inputs: the second is the served
graph's capture, the third its replay on other inputs) and its ring buffer after them equal the
served engine's, bit for bit.

Build with cfm_profile.py first (the same shape, depth and tag name the package), or name an
artifact directory that holds the key (c2w export; its model must be random:full):
    python3 benchmarks/h200/cfm_profile.py --phase build --batch 32 --T 150 --L 400 --depth 16 --tag inplace
    python3 benchmarks/h200/step_launch.py --batch 32 --T 150 --L 400 --depth 16 --tag inplace --out $OUT
    python3 benchmarks/h200/step_launch.py --from-dir /tmp/art/all-h200_stage --out $OUT
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
from benchmarks.h200.cfm_profile import artifact_info, built_package, first_ring, models  # noqa: E402
from c2w.exporter.bench.engines import timed  # noqa: E402
from c2w.runtime.engines.aoti import AOTIBackend, AOTIEngine, EulerReplay, bind_constants, load_runner  # noqa: E402
from c2w.runtime.engines.graphs import CapturedCall, GraphPool  # noqa: E402
from c2w.runtime.manifest import read_manifest  # noqa: E402
from c2w.runtime.trim import KEEP_RECENT, CacheTrim  # noqa: E402
from c2w.runtime.units import SPECS, ShapeKey  # noqa: E402
from c2w.runtime.verify import artifact_info as entry_info, entry_key, unit_weights  # noqa: E402


def single_threaded_engine(info, weights, dev) -> AOTIEngine:
    """The package as AOTIBackend.load makes an ungraphed engine, its runner loaded with
    run_single_threaded=True (the engine's `_fn` is its EulerReplay)."""
    runner = load_runner(str(info.path), dev, single_threaded=True)
    table = bind_constants(runner, info, weights, dev)
    replay = EulerReplay(runner, int(info.extra.get("n_steps", 10)), dev, "in_place")
    return AOTIEngine(info, replay, dev, [runner, table])


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
    """Time a variant in a steady stream. solve_from(inputs, ring) -> outputs, ring. One solve per
    chunk from the first ring, on the chunks' inputs (mu, spk, cond, x0, cnn caches; different
    draws: a graph must follow new inputs, design note 8), compared with `ref` (the first
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


def package(a, dev):
    """(model, key, info, weights, unit, x): the package's model (random:full cut to --depth, as
    cfm_profile.py builds it), its CFM key, manifest entry and example inputs (drawn on the
    device, seed 0). From --from-dir: that directory's B=--batch CFM key (the first one, with T
    and L as built)."""
    model, _ = models(a.depth, dev)
    x = None
    if a.from_dir:
        manifest = read_manifest(Path(a.from_dir))
        entries = [e for e in manifest.entries if e.status == "built" and e.component == "cfm" and e.dims["B"] == a.batch]
        if not entries or manifest.model.spec != "random:full" or a.depth != 16:
            raise SystemExit(f"{a.from_dir}: no built B={a.batch} CFM key of random:full (or --depth is not 16)")
        key = entry_key(entries[0])
        info = entry_info(Path(a.from_dir), entries[0], model.cfg)
    else:
        key = ShapeKey("cfm", (a.batch, a.T, a.L), "float16")
        path, extra = built_package(a.batch, a.T, a.L, a.depth, a.tag)
        x = SPECS["cfm"].example_inputs(model.cfg, key, device=dev)
        info = artifact_info(path, key, x, extra)
    if (info.extra or {}).get("step_att") != "in_place":
        raise SystemExit(f"{info.path} is a {(info.extra or {}).get('step_att', 'whole')!r} step; this measures the in-place one")
    unit = SPECS["cfm"].build(model, key).eval()
    x = x if x is not None else SPECS["cfm"].example_inputs(model.cfg, key, device=dev)
    return model, key, info, unit_weights(unit), unit, x


def device_bytes(dev) -> dict:
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return {"allocated": torch.cuda.memory_allocated(dev), "reserved": torch.cuda.memory_reserved(dev)}


def pool_bytes(pool: GraphPool) -> dict:
    """The device memory a graph pool's segments hold: reserved (the segments) and allocated (the
    blocks live in them: the graphs' static outputs and what a replay keeps), from PyTorch's
    allocator snapshot."""
    segs = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == tuple(pool.handle)]
    return {"segments": len(segs), "reserved": sum(s["total_size"] for s in segs),
            "allocated": sum(s["allocated_size"] for s in segs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--T", type=int, default=150)
    ap.add_argument("--L", type=int, default=400)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--tag", default="inplace", help="cfm_profile.py's --tag of the build")
    ap.add_argument("--from-dir", default="", help="an artifact directory holding a B=--batch CFM key instead")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    model, key, info, weights, unit, x = package(a, dev)
    B, T, L = key.dims
    # two more chunks: other inputs of the same shapes (their attention caches are not used)
    chunks = [x] + [SPECS["cfm"].example_inputs(model.cfg, key, device=dev, seed=seed)[:5] for seed in (1, 2)]
    trim = CacheTrim(L - KEEP_RECENT)

    def save(res):
        Path(a.out, f"step_launch_B{B}_T{T}_L{L}_d{a.depth}.json").write_text(json.dumps(res, indent=1))
    res = {"B": B, "T": T, "L": L, "depth": a.depth, "commit": os.environ.get("C2W_COMMIT", "unknown"),
           "trim_P": L - KEEP_RECENT, "package": str(info.path)}
    with torch.inference_mode():
        res["eager"] = timed(lambda: unit(*x), dev, 2, a.reps)
        g = CapturedCall(lambda *i: unit(*i), info.input_shapes, [t.dtype for t in x], dev, GraphPool(dev))
        res["eager_graph"] = timed(lambda: g(*x), dev, 2, a.reps)
        g.release()
        del g
        print(f"eager {res['eager']['median_ms']:.2f} ms, eager under one graph {res['eager_graph']['median_ms']:.2f} ms",
              flush=True)

        # served first: its graph is captured before torch.profiler runs (captured after it, a
        # graph's replay segfaulted on the H200, run 23)
        before = device_bytes(dev)
        served = AOTIBackend().load(info, weights, dev)
        res["served_solve_graphs"] = served.solve_graphs is not None
        res["served"], ref = measure("served", lambda i, r: served.run(i[:5] + [r], trim), chunks, trim, dev, a.reps,
                                     None)
        graphs = served.solve_graphs
        if graphs is not None:
            held = [e.graph for e in graphs._buffers.values() if e.graph is not None]
            res["solve_graphs"] = {**graphs.counts(),
                                   "static_bytes": sum(t.nbytes for c in held for t in c.inputs + c.outputs),
                                   "device_bytes_with_engine": {k: v - before[k] for k, v in device_bytes(dev).items()},
                                   "pool_bytes": pool_bytes(graphs.pool)}
            print(f"   solve graphs: {res['solve_graphs']}", flush=True)
        served.release()
        del served
        save(res)
        plain = AOTIBackend(cuda_graphs=False).load(info, weights, dev)
        res["without_graphs"], _ = measure("without graphs", lambda i, r: plain.run(i[:5] + [r], trim), chunks, trim,
                                           dev, a.reps, ref)
        plain.release()
        del plain
        save(res)
        st = single_threaded_engine(info, weights, dev)
        res["single_threaded"], _ = measure("single-threaded", lambda i, r: st.run(i[:5] + [r], trim), chunks, trim, dev,
                                            a.reps, ref)
        st.release()
        del st
    save(res)
    print(f"\nB={B} T={T} L={L} depth {a.depth}, ms per 10-step solve in a steady stream "
          f"(eager {res['eager']['median_ms']:.2f}, eager + graph {res['eager_graph']['median_ms']:.2f}):")
    for k in ("served", "without_graphs", "single_threaded"):
        r = res[k]
        print(f"  {k:16s} {r['steady']['median_ms']:7.2f}  ({res['eager']['median_ms'] / r['steady']['median_ms']:.2f}x "
              f"eager, {res['eager_graph']['median_ms'] / r['steady']['median_ms']:.2f}x eager + graph; GPU idle "
              f"{r['timeline']['idle_ms']:.2f} ms; = served: {r.get('equals_first', '-')}, largest |diff| "
              f"{max(r.get('max_abs_diff', {'-': 0}).values()):.2g})")


if __name__ == "__main__":
    main()
