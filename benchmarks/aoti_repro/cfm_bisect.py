"""Why does the compiled CFM Euler step give wrong values on the GPU (run 2/3: rel-L2 ~0.95)?

One process, the full-width DiT cut to DEPTH blocks (fast to compile), random weights. Each
variant runs ONE step on the same inputs and is compared with the eager step (rel-L2 per output):
  export   - the exported program run eagerly (is torch.export right?)
  compile  - torch.compile (Inductor, no AOT) of the step
  compile_nosdpa - the same with scaled_dot_product_attention replaced by explicit math
  aoti_um  - c2w's AOTI build (weights bound user_managed) called directly
  aoti_so  - AOTI with the weights inside the package
and the WHOLE 10-step solve against the eager CFM unit, from c2w's own build (build_aoti):
  replay_mt    - EulerReplay over a package loaded with run_single_threaded=False
  replay_st    - the same, loaded with run_single_threaded=True (what CUDA-graph capture needs)
  replay_graph - single-threaded, the whole 10-step replay captured as ONE CUDA graph
  replay_graph_step - single-threaded, one CUDA graph per Euler step, replayed 10 times
Usage (device): python3 benchmarks/aoti_repro/cfm_bisect.py [--depth 2] [--dtype float16]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from exporter.backends.aoti import _compiler, aoti_compiler, step_inputs  # noqa: E402
from runtime.model import dit as dit_mod  # noqa: E402
from runtime.model.config import preset  # noqa: E402
from runtime.model.flow import FlowModel  # noqa: E402
from runtime.model.weights import init_random_  # noqa: E402
from runtime.units import SPECS, CFMStepUnit, ShapeKey, rel_l2  # noqa: E402


class _Model:                      # what CFMStepUnit / build_aoti need: .flow, .cfg
    def __init__(self, flow, cfg):
        self.flow, self.cfg = flow, cfg


def explicit_sdpa(q, k, v, *a, **kw):
    w = torch.softmax((q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5, dim=-1)
    return (w @ v.float()).to(q.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--variants", default="export,compile,compile_nosdpa,aoti_um,aoti_so")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 (as profiles/h200.yaml does)")
    ap.add_argument("--seeds", default="7", help="input seeds the replay variants are checked on "
                    "(the package is built on the first; 1234 = c2w verify's)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = a.tf32
    full = preset("full")
    cfg = dataclasses.replace(full, dit=dataclasses.replace(full.dit, depth=a.depth))
    flow = FlowModel(cfg)
    init_random_(flow, 0)
    flow.eval()
    dt = getattr(torch, a.dtype)
    flow.to(dev)
    flow.decoder.estimator.to(dt)
    flow.spk_embed_affine_layer.to(dt)
    model = _Model(flow, cfg)
    unit = CFMStepUnit(model).eval()
    key = ShapeKey("cfm", (1, 50, 300), a.dtype)
    full_inputs = SPECS["cfm"].example_inputs(cfg, key, torch.Generator().manual_seed(int(a.seeds.split(",")[0])),
                                              device=dev)
    inputs = step_inputs(cfg, key, full_inputs)
    inputs[6].fill_(0.35)                                 # a t that is not the example's 0
    with torch.inference_mode():
        want = [o.clone() for o in unit(*inputs)]
    rows = {}

    def record(name, fn):
        t0 = time.time()
        try:
            with torch.inference_mode():
                got = fn()
            rows[name] = {"rel_l2": [rel_l2(g.float(), w.float()) for g, w in zip(got, want)],
                          "seconds": round(time.time() - t0, 1)}
        except Exception as exc:
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:400], "tb": traceback.format_exc()[-800:]}
        print(name, rows[name], flush=True)

    ep = torch.export.export(unit, tuple(inputs), strict=False)
    todo = a.variants.split(",")
    if "export" in todo:
        record("export", lambda: ep.module()(*inputs))
    if "compile" in todo:
        record("compile", lambda: torch.compile(unit)(*inputs))
    if "compile_nosdpa" in todo:
        torch._dynamo.reset()
        orig = dit_mod.F.scaled_dot_product_attention
        dit_mod.F.scaled_dot_product_attention = explicit_sdpa
        try:
            record("compile_nosdpa", lambda: torch.compile(unit)(*inputs))
        finally:
            dit_mod.F.scaled_dot_product_attention = orig
    for name, in_so in (("aoti_um", False), ("aoti_so", True)):
        if name not in todo:
            continue
        def run(in_so=in_so):
            path = Path(f"/tmp/cfm_bisect_{name}.pt2")
            with _compiler(aoti_compiler()):
                torch._inductor.aoti_compile_and_package(
                    ep, package_path=str(path),
                    inductor_configs={"aot_inductor.package_constants_in_so": in_so})
            runner = torch._inductor.aoti_load_package(str(path))
            if not in_so:
                params = dict(unit.named_parameters()) | dict(unit.named_buffers())
                runner.load_constants({k: params[k] for k in runner.get_constant_fqns()},
                                      check_full_update=True, user_managed=True)
            return runner(*inputs)
        record(name, run)
    replays = [v for v in todo if v.startswith("replay")]
    if replays:
        seeds = [int(x) for x in a.seeds.split(",")]
        replay_variants(model, key, full_inputs, replays, rows, dev, seeds)
    print("outputs: x_next, new_cnn_cache, new_att_cache (replay_*: mel, caches of all steps)")
    for k, v in rows.items():
        print(f"{k:16s} {v.get('rel_l2', v.get('error')) if 'rel_l2' in v or 'error' in v else v}")
    Path(a.out, f"cfm_bisect_d{a.depth}_{a.dtype}{'_tf32' if a.tf32 else ''}.json").write_text(json.dumps(rows, indent=1))


def replay_variants(model, key, inputs, todo, rows, dev, seeds) -> None:
    from exporter.backends.aoti import build_aoti
    from runtime.engines.aoti import AOTIBackend, CudaGraphed, EulerReplay
    from runtime.engines.base import torch_dtype
    from runtime.engines.base import ArtifactInfo
    from runtime.verify import unit_weights
    spec = SPECS["cfm"]
    whole = spec.build(model, key).eval()
    cases = {}
    for seed in seeds:
        x = spec.example_inputs(model.cfg, key, torch.Generator().manual_seed(seed), device=dev)
        with torch.inference_mode():
            cases[seed] = (x, [o.clone() for o in whole(*x)])
    path = Path("/tmp/cfm_bisect_replay.pt2")
    t0 = time.time()
    extra = build_aoti(model, whole, key, inputs, path)
    print("build_aoti", round(time.time() - t0, 1), "s", extra, flush=True)
    weights = unit_weights(whole)
    info = ArtifactInfo(path, spec.input_names(key), spec.output_names, tuple(tuple(t.shape) for t in inputs),
                        tuple(str(t.dtype).removeprefix("torch.") for t in inputs), extra)
    assert all(torch_dtype(d) for d in info.input_dtypes)
    for name in todo:
        try:
            if name == "replay_graph_step":           # what c2w serves
                fn = AOTIBackend(cuda_graphs=True, graph_max_bytes=None).load(info, weights, dev).run
            elif name == "replay_graph":              # c2w's first design: the 10-step replay as one graph
                runner = torch._inductor.aoti_load_package(str(path), run_single_threaded=True)
                runner.load_constants({k: weights[k] for k in runner.get_constant_fqns()},
                                      check_full_update=True, user_managed=True)
                g = CudaGraphed(EulerReplay(runner, model.cfg.n_timesteps, dev), info.input_shapes,
                                [torch_dtype(d) for d in info.input_dtypes], dev)
                fn = lambda x, g=g: g(*x)  # noqa: E731
            else:
                runner = torch._inductor.aoti_load_package(str(path), run_single_threaded=name == "replay_st")
                runner.load_constants({k: weights[k] for k in runner.get_constant_fqns()},
                                      check_full_update=True, user_managed=True)
                rep = EulerReplay(runner, model.cfg.n_timesteps, dev)
                fn = lambda x, rep=rep: rep(*x)  # noqa: E731
            rows[name] = {}
            for seed, (x, want) in cases.items():
                with torch.inference_mode():
                    got = fn(x)
                    got2 = fn(x)
                rows[name][f"seed{seed}"] = {
                    "rel_l2": [rel_l2(g.float(), w.float()) for g, w in zip(got, want)],
                    "second_call_rel_l2": [rel_l2(g.float(), w.float()) for g, w in zip(got2, want)],
                    "per_step_att_rel_l2": [rel_l2(got[2][s].float(), want[2][s].float())
                                            for s in range(want[2].shape[0])]}
        except Exception as exc:
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:400], "tb": traceback.format_exc()[-800:]}
        print(name, rows[name], flush=True)


if __name__ == "__main__":
    main()
