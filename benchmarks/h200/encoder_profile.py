"""The flow encoder's engine in the forms of its attention, side by side: times and kernel tables.

Builds one flow-encoder key (float16, the full model with random weights) with c2w's own AOTI path
(exporter.backends.aoti.build_aoti), loads it as served (AOTIBackend: one CUDA graph per call), and
records the median ms of eager, eager under one CUDA graph, the engine with and without its graph,
the kernel table of one graph-free call (kernel_classes.py reads it), and the output's rel-L2
against the float32 model. `--attn` picks the attention's form; the switch sets the model's
threshold, so eager and the float32 reference run the same form; `--conv` picks the convolutions'
form the same way:

  model    runtime.model.encoder._RelPosSelfAttention as the product has it: from
           FUSED_ATTENTION_ROWS rows (batch x queries) the position scores are the additive mask of
           one fused attention call, softmax((q + u) k^T / sqrt(d) + (q + v) P^T / sqrt(d)) v.
  unfused  the form before run 20 at every size, as upstream writes it: the content scores
           (q + u) k^T and the position scores (q + v) P^T as two products, summed, softmax, then
           the product with v (the same values up to rounding).

  --conv model  the lookahead layer's and the upsampler's convolutions as runtime.model.dit's
                conv_by_product (one product each in the (B, T, D) layout, the encoder's revision 2)
  --conv cudnn  as cuDNN convolutions over (B, D, T), the weights contiguous (revision 1's form)

Run 20c measured the fused form at 354d859, where q + u went to the fused call as the view it
is; the model's form since makes it contiguous first (the ONNX exporter needs it: docs/numerics.md).

Usage (device): python3 benchmarks/h200/encoder_profile.py --batch 32 --tokens 78 --cache 400 [--attn unfused]
  [--conv cudnn] [--tag TAG] [--phase build|time|all] --out $OUT. Writes
  $OUT/encoder_profile_B{B}_N{N}_C{C}_{attn}[_cudnn][_TAG].json;
  `--phase build` builds /tmp/<the same name>.pt2 only (several builds side by side, then time them
  one at a time with `--phase time`).
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
from benchmarks.h200.kernel_classes import profile_kernels  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from c2w.runtime.model import encoder  # noqa: E402

MODEL_ROWS = encoder.FUSED_ATTENTION_ROWS

def set_form(attn: str) -> None:
    """The encoder's attention in `attn`'s form, process-wide: "unfused" raises the model's
    fused-call threshold past any call, so every block takes upstream's form; "model" restores it."""
    encoder.FUSED_ATTENTION_ROWS = MODEL_ROWS if attn == "model" else sys.maxsize


ATTENTION = ("model", "unfused")
CONVOLUTIONS = ("model", "cudnn")
MODEL_CONV = encoder.conv_by_product


def _cudnn_conv(conv: torch.nn.Conv1d, h: torch.Tensor) -> torch.Tensor:
    """conv_by_product's contract (valid conv1d over time, (b, T + k - 1, c) -> (b, T, c_out)) as
    one cuDNN convolution over the transposed layout."""
    return F.conv1d(h.transpose(1, 2), conv.weight, conv.bias).transpose(1, 2)


def set_conv(form: str, *models: torch.nn.Module) -> None:
    """The encoder's convolutions in `form`, process-wide; "cudnn" also stores their weights
    contiguous again (taps_outer_ had stored them for the product's view)."""
    encoder.conv_by_product = MODEL_CONV if form == "model" else _cudnn_conv
    if form == "cudnn":
        for m in models:
            for conv in m.modules():
                if isinstance(conv, torch.nn.Conv1d):
                    conv.weight.data = conv.weight.data.contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=78)
    ap.add_argument("--cache", type=int, default=400)
    ap.add_argument("--attn", choices=ATTENTION, default="model")
    ap.add_argument("--conv", choices=CONVOLUTIONS, default="model")
    ap.add_argument("--tag", default="", help="appended to the build's and the result's name (a patched tree's build)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--phase", choices=("all", "build", "time"), default="all")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    from c2w.exporter.backends.aoti import build_aoti
    from c2w.exporter.bench.engines import timed
    from c2w.runtime.engines.aoti import AOTIBackend
    from c2w.runtime.engines.base import ArtifactInfo
    from c2w.runtime.engines.graphs import CapturedCall, GraphPool
    from c2w.runtime.model.weights import load_model
    from c2w.runtime.precision import load_at_precision
    from c2w.runtime.units import SPECS, ShapeKey, rel_l2
    from c2w.runtime.verify import unit_weights
    set_form(a.attn)
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = load_at_precision("random:full", dev, {"flow_encoder": "float16", "cfm": "float16", "hift": "float16"})
    set_conv(a.conv, model.flow.encoder)
    key, spec = ShapeKey("flow_encoder", (a.batch, a.tokens, a.cache, 0), "float16"), SPECS["flow_encoder"]
    unit = spec.build(model, key).eval()
    x = spec.example_inputs(model.cfg, key, seed=1, device=dev)
    name = f"encoder_profile_B{a.batch}_N{a.tokens}_C{a.cache}_{a.attn}" + ("_cudnn" if a.conv == "cudnn" else "") + (f"_{a.tag}" if a.tag else "")
    path, built = Path(f"/tmp/{name}.pt2"), Path(f"/tmp/{name}.build.json")
    if a.phase == "time" and path.is_file() and built.is_file():
        done = json.loads(built.read_text())
        extra, build_s = done["extra"], done["build_s"]
    else:
        t0 = time.time()
        extra = build_aoti(model, unit, key, x, path)
        build_s = time.time() - t0
        built.write_text(json.dumps({"extra": extra, "build_s": build_s}))
        if a.phase == "build":
            print(f"{name}: built in {build_s:.0f} s", flush=True)
            return
    info = ArtifactInfo(path, spec.input_names(key), spec.output_names, tuple(tuple(t.shape) for t in x),
                        tuple(str(t.dtype).removeprefix("torch.") for t in x), extra)
    weights = unit_weights(unit)
    res = {"B": a.batch, "N": a.tokens, "C": a.cache, "attn": a.attn, "conv": a.conv, "tag": a.tag, "build_s": round(build_s, 1),
           "commit": os.environ.get("C2W_COMMIT", "unknown")}
    with torch.inference_mode():
        want = unit(*x)
        res["eager"] = timed(lambda: unit(*x), dev, 3, a.reps)
        g = CapturedCall(lambda *i: unit(*i), info.input_shapes, [t.dtype for t in x], dev, GraphPool(dev))
        res["eager_graph"] = timed(lambda: g(*x), dev, 3, a.reps)
        graphed = AOTIBackend(cuda_graphs=True, graph_max_bytes=None).load(info, weights, dev)
        res["engine_graph"] = timed(lambda: graphed.run(x), dev, 3, a.reps)
        got = graphed.run(x)
        res["rel_l2_vs_eager"] = [rel_l2(o.float(), w.float()) for o, w in zip(got, want)]
        model32 = load_model("random:full").to(dev)
        set_conv(a.conv, model32.flow.encoder)
        want32 = spec.build(model32, key).eval()(*[t.float() if t.is_floating_point() else t for t in x])
        res["rel_l2_vs_fp32"] = {"engine": rel_l2(got[0].float(), want32[0]), "eager": rel_l2(want[0].float(), want32[0])}
        del model32, want32
        plain = AOTIBackend(cuda_graphs=False).load(info, weights, dev)
        res["engine"] = timed(lambda: plain.run(x), dev, 3, a.reps)
        res["profile"] = profile_kernels(lambda: plain.run(x))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, f"{name}.json").write_text(json.dumps(res, indent=1))
    p = res["profile"]
    print(f"{name}: eager {res['eager']['median_ms']:.3f} ms, eager+graph {res['eager_graph']['median_ms']:.3f}, "
          f"engine {res['engine']['median_ms']:.3f}, engine+graph {res['engine_graph']['median_ms']:.3f}; "
          f"{p['kernels_per_solve']} kernels, {p['kernel_ms_per_solve']:.3f} ms; h rel-L2 vs fp32 engine "
          f"{res['rel_l2_vs_fp32']['engine']:.2e} (eager fp16 {res['rel_l2_vs_fp32']['eager']:.2e}); build {build_s:.0f} s",
          flush=True)


if __name__ == "__main__":
    main()
