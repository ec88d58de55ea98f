"""Two or more builds of the CFM step at one shape, served side by side in ONE process and timed
in alternating rounds, so that what differs between processes (the host, the clocks, where the
allocator put things) does not enter the comparison.

Each build is a cfm_profile.py package (`--phase build --tag TAG`, from whichever tree); all are
loaded as AOTIBackend serves them (default options) with the weights of the same seeded model (in
the memory layout each build recorded) and solved on the same inputs. Per round and build: the median of `--reps` solves of a steady stream
(each handed the ring the previous returned; cfm_profile.first_ring). Then per build: the median
over rounds, its outputs against the first build's (max abs difference), its mel's SNR against
the float32 model's on the same inputs (issue #15's fidelity bar: >= 60 dB), and one solve's GPU
timeline (step_launch.timeline: busy, idle, largest gaps and the kernels around them).
    python3 benchmarks/h200/ab_engines.py --batch 1 --depth 2 --tags fused,ops --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.h200.cfm_profile import add_shape_arguments, artifact_info, built_package, first_ring, models  # noqa: E402
from benchmarks.h200.step_launch import timeline  # noqa: E402
from c2w.exporter.bench.engines import snr_db, timed  # noqa: E402
from c2w.runtime.engines.aoti import AOTIBackend  # noqa: E402
from c2w.runtime.trim import KEEP_RECENT, CacheTrim  # noqa: E402
from c2w.runtime.units import SPECS, ShapeKey  # noqa: E402
from c2w.runtime.verify import unit_weights  # noqa: E402


def laid_out(weights: dict, extra: dict) -> dict:
    """`weights` with each tensor in the memory layout the build recorded (`constant_strides`;
    contiguous where it records none), copied where this tree stores it otherwise, so that builds
    from trees with another weight layout (the DiT's conv weights, run 25) load beside each other."""
    strides = extra.get("constant_strides", {})
    out = {}
    for name, t in weights.items():
        want = strides.get(name)
        if want is None and not t.is_contiguous():
            t = t.contiguous()
        elif want is not None and list(t.stride()) != list(want):
            t = torch.empty_strided(t.shape, want, dtype=t.dtype, device=t.device).copy_(t)
        out[name] = t
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    add_shape_arguments(ap)
    ap.add_argument("--tags", required=True, help="comma-separated cfm_profile.py tags, the first the reference")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    model, flow32 = models(a.depth, dev)
    key = ShapeKey("cfm", (a.batch, a.T, a.L), "float16")
    x = SPECS["cfm"].example_inputs(model.cfg, key, device=dev)
    with torch.inference_mode():                    # the fidelity reference, then out of the way
        mel32 = SPECS["cfm"].build(flow32, key).eval()(*[t.float() for t in x])[0]
    del flow32
    weights = unit_weights(SPECS["cfm"].build(model, key).eval())
    trim = CacheTrim(a.L - KEEP_RECENT)
    tags = a.tags.split(",")
    engines, rings, solves = {}, {}, {}
    for tag in tags:
        path, extra = built_package(a.batch, a.T, a.L, a.depth, tag)
        engines[tag] = AOTIBackend().load(artifact_info(path, key, x, extra), laid_out(weights, extra), dev)
        rings[tag] = first_ring(x)

        def solve(tag=tag):
            out = engines[tag].run(x[:5] + [rings[tag]], trim)
            rings[tag] = out[2]
            return out
        solves[tag] = solve
    res = {"B": a.batch, "T": a.T, "L": a.L, "depth": a.depth, "commit": os.environ.get("C2W_COMMIT", "unknown"),
           "device": torch.cuda.get_device_name(dev), "builds": {}}
    with torch.inference_mode():
        first = {tag: solves[tag]()[0].float() for tag in tags}      # the same first chunk for each
        rounds = {tag: [] for tag in tags}
        for _ in range(a.rounds):
            for tag in tags:
                rounds[tag].append(timed(solves[tag], dev, 2, a.reps)["median_ms"])
        for tag in tags:
            res["builds"][tag] = {"median_ms": statistics.median(rounds[tag]), "rounds_ms": rounds[tag],
                                  "mel_max_abs_vs_first": float((first[tag] - first[tags[0]]).abs().max()),
                                  "mel_snr_db_vs_fp32": snr_db(first[tag], mel32),
                                  "timeline": timeline(solves[tag])}
    name = f"ab_B{a.batch}_T{a.T}_L{a.L}_d{a.depth}_{'_'.join(tags)}.json"
    Path(a.out, name).write_text(json.dumps(res, indent=1))
    for tag, r in res["builds"].items():
        t = r["timeline"]
        print(f"B={a.batch} depth={a.depth} {tag}: {r['median_ms']:.3f} ms (rounds {', '.join(f'{v:.2f}' for v in r['rounds_ms'])}); "
              f"{t['kernels']} kernels, busy {t['busy_ms']:.2f} ms, idle {t['idle_ms']:.2f} ms; mel vs {tags[0]} "
              f"{r['mel_max_abs_vs_first']:.2e}, SNR vs float32 {r['mel_snr_db_vs_fp32']:.1f} dB")
        for g in t["largest_gaps"][:3]:
            print(f"    gap {g['us']} us after {g['after']} before {g['before']}")


if __name__ == "__main__":
    main()
