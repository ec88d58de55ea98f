"""Where the CFM engine's time goes: kernel table of one Euler step, per batch size.

The full-width DiT cut to DEPTH blocks (fast to compile; per-block costs scale to 16 blocks),
built with c2w's own AOTI path (exporter.backends.aoti.build_aoti) and loaded as served
(AOTIBackend: one CUDA graph per Euler step). Per batch size B (T=50, L=300, fp16):
  - median ms of the whole 10-step solve: eager, eager under one CUDA graph, engine (graphs)
  - torch.profiler over one solve of the engine WITHOUT graphs: kernels per solve, summed kernel
    time (what a perfect launcher would cost), and the top kernels by time;
  - the caching allocator's counters per ungraphed solve (requests served, device blocks taken).
Usage (device): python3 benchmarks/h200/cfm_profile.py --batch 1 [--depth 2] [--tag NAME] > log
With C2W_AOTI_INDUCTOR='{...}' in the environment the build uses those Inductor configs too
(recorded in the JSON); --tag names the variant in the output file. `--attn legacy` swaps in the
DiT attention as it was before the att cache was written once (three concatenations per block
and step), so both forms are measured in the same call; `--attn bthd` takes q's LayerNorm before
its transpose (`bthd_attention_forward`); `--attn split` attends to the chunk's frames and to the
cache in two calls merged by their log-sum-exps, with no [new | cache] concatenation
(`split_attention_forward`). `--conv frames` or `--conv per-tap` runs each convolution
in one of the model's forms before run 17 (conv_variants.py's `frame_conv`, `per_tap_conv`; the
model took the frame product below 512 rows, the per-tap products from there on). The
switches patch the model's classes, so eager and the float32 reference run them too (the same
function: tests/test_dit_variants.py). `--triton-rows N --tiles A.json[,B.json]` builds
with the fused Triton kernels of fused_dit.py for calls of at most N rows, fusing the products
whose tuned tile (fused_tiles.py's results) beat the ops they replace (eager is timed without them), and
the JSON has the mel's SNR against the float32 model, engine and eager float16.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.h200.conv_variants import frame_conv, per_tap_conv  # noqa: E402
from benchmarks.h200.kernel_classes import profile_kernels  # noqa: E402
from c2w.exporter.backends.aoti import build_aoti  # noqa: E402
from c2w.exporter.bench.engines import timed  # noqa: E402
from c2w.runtime.engines.aoti import AOTIBackend  # noqa: E402
from c2w.runtime.engines.base import ArtifactInfo  # noqa: E402
from c2w.runtime.engines.graphs import CapturedCall, GraphPool  # noqa: E402
from c2w.runtime.model.config import preset  # noqa: E402
from c2w.runtime.model.dit import Attention, CausalConvBlock, parts  # noqa: E402
from c2w.runtime.model.flow import FlowModel  # noqa: E402
from c2w.runtime.model.weights import init_random_  # noqa: E402
from c2w.runtime.ring import RingCache  # noqa: E402
from c2w.runtime.trim import KEEP_RECENT, CacheTrim  # noqa: E402
from c2w.runtime.units import SPECS, ShapeKey, rel_l2  # noqa: E402
from c2w.runtime.verify import unit_weights  # noqa: E402


def legacy_attention_forward(self, x, att_cache):
    """`runtime.model.dit.Attention.forward` before it wrote the new cache once (same values):
    keys and values concatenated with the cache separately, then [k | v] once more."""
    b, t, _ = x.shape
    q = self.q_norm(self._heads(self.to_q(x)))
    k = self.k_norm(self._heads(self.to_k(x)))
    v = self._heads(self.to_v(x))
    k_cache, v_cache = parts(att_cache, 2, -1)
    k = torch.cat([k, k_cache], dim=2)
    v = torch.cat([v, v_cache], dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
    return self.proj(out), torch.cat([k, v], dim=-1)


def bthd_attention_forward(self, x, att_cache):
    """`runtime.model.dit.Attention.forward` with q normalized in (b, T, h, d) and transposed after
    (same values). cuDNN's attention gives its output q's memory layout (PyTorch's meta function
    allocates it so, and Inductor plans by that), so the output's way back to (b, T, h * d) is a
    view, where today it is one copy kernel per block and step (`clone_transpose` in the tables)."""
    b, t, _ = x.shape
    q, k, v = self.project(x)
    q = self.q_norm(q.unflatten(-1, (self.heads, self.head_dim))).transpose(1, 2)   # (b, h, T, d) view
    kv = torch.cat([torch.cat([self.k_norm(self._heads(k)), self._heads(v)], dim=-1), att_cache], dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(q, *parts(kv, 2, -1))
    return self.proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)), kv


def attention_with_lse(q, k, v):
    """softmax(q k^T / sqrt(d)) v and its log-sum-exp (b, h, T, 1) float32, by the fused kernel
    that PyTorch's attention calls on this device (cuDNN's on CUDA in half precision, which the
    engines use). cuDNN's kernel is for half precision: the float32 reference model got NaN mels
    through it (run 19b), so float32 on CUDA takes the explicit product and softmax."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    elif q.is_cuda:
        return explicit_attention_with_lse(q, k, v)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    return out, lse.float().reshape(*q.shape[:3], 1)


def explicit_attention_with_lse(q, k, v):
    """attention_with_lse as a product, a log-sum-exp and a product (any dtype, any device)."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse.float()


def split_attention_forward(self, x, att_cache):
    """`runtime.model.dit.Attention.forward` without the [new | cache] concatenation before
    attention (same values up to rounding): the chunk attends to its own frames and to the cache
    in two calls, and the two outputs are merged by their log-sum-exps, o = o_new * sigmoid(lse_new
    - lse_cache) + o_cache * sigmoid(lse_cache - lse_new). The returned cache is still [new |
    cache]; the AOTI step keeps only its first T frames (the chunk-frames step), so the cache's
    part of it is dead there (whether Inductor drops it shows in the kernel table)."""
    b, t, _ = x.shape
    q, k, v = self.project(x)
    q, k, v = self.q_norm(self._heads(q)), self.k_norm(self._heads(k)), self._heads(v)
    o_new, lse_new = attention_with_lse(q, k, v)
    o_cache, lse_cache = attention_with_lse(q, *parts(att_cache, 2, -1))
    out = (o_new.float() * torch.sigmoid(lse_new - lse_cache) + o_cache.float() * torch.sigmoid(lse_cache - lse_new))
    out = out.to(q.dtype).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
    return self.proj(out), torch.cat([torch.cat([k, v], dim=-1), att_cache], dim=2)


ATTENTION = {"current": None, "legacy": legacy_attention_forward, "bthd": bthd_attention_forward,
             "split": split_attention_forward}
CONV = {"current": None, "frames": frame_conv, "per-tap": per_tap_conv}


ALLOCATOR_COUNTS = ("allocation.all.allocated", "segment.all.allocated", "num_device_alloc", "num_device_free",
                    "num_alloc_retries")


def allocator_counts(solve, dev, solves: int = 10) -> dict:
    """The caching allocator's counters over `solves` calls of `solve`, per call: requests it served
    (allocation), blocks it took from the device (segment, num_device_alloc), gave back, retried."""
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_stats(dev)
    for _ in range(solves):
        solve()
    torch.cuda.synchronize(dev)
    after = torch.cuda.memory_stats(dev)
    return {k: (after.get(k, 0) - before.get(k, 0)) / solves for k in ALLOCATOR_COUNTS}


def first_ring(x) -> RingCache:
    """The CFM inputs' attention cache (x[5]) as the in-place replay lays out a tensor: T free
    slots, then the cache's frames in order."""
    T, L = x[0].shape[2], x[5].shape[-2]
    return RingCache(torch.cat([torch.zeros_like(x[5][..., :T, :]), x[5]], dim=-2), range(T, T + L))


def served_forms(info, weights, x, dev, reps: int) -> dict:
    """The engine as the stream driver runs it (AOTIBackend's defaults: graphed up to its byte bar),
    given a steady stream's trim (P = L - 100: a chunk's T + L frames trimmed back to L). For an
    in-place step (manifest extra step_att "in_place") as a stream runs it once its trim frees
    exactly T slots: each solve handed the ring the last one returned, so no cache frame moves
    (design note 21), and where the step is not graphed, from the second such solve on, from one
    graph of the whole solve over that ring's buffer (runtime.engines.solve_graphs); and from a
    tensor, as every AOTI step form can be handed the cache. Kernel tables of one solve of each,
    profiled after every capture: a graph captured after torch.profiler had run segfaulted in its
    replay (run 23)."""
    L = x[5].shape[-2]
    trim = CacheTrim(L - KEEP_RECENT)
    served = AOTIBackend().load(info, weights, dev)
    out = {"graphed": isinstance(served._fn.step, CapturedCall), "solve_graphs": served.solve_graphs is not None,
           "trim_P": L - KEEP_RECENT, "step_att": (info.extra or {}).get("step_att", "whole")}
    steady = None
    if out["step_att"] == "in_place":
        want = served.run(x, trim)
        # the layout the replay gives a tensor, as a ring: the same values, bit for bit
        start = first_ring(x)
        buffer = start.buffer
        first = served.run(x[:5] + [start], trim)
        out["ring_equals_tensor"] = all(torch.equal(a, b) for a, b in zip(first[:2] + [first[2].logical()], want))
        del want
        ring = {"now": first[2]}

        def steady():
            ring["now"] = served.run(x[:5] + [ring["now"]], trim)[2]
        out["ring_steady"] = timed(steady, dev, 3, reps)
        out["ring_kept_its_buffer"] = ring["now"].buffer is buffer
        if served.solve_graphs is not None:
            out["solve_graph_captures"] = served.solve_graphs.captures
    out["from_tensor"] = timed(lambda: served.run(x, trim), dev, 3, reps)
    out["profile_from_tensor"] = profile_kernels(lambda: served.run(x, trim))
    if steady is not None:
        out["profile_ring_steady"] = profile_kernels(steady)
    served.release()
    return out


class _Model:
    def __init__(self, flow, cfg):
        self.flow, self.cfg = flow, cfg


def models(depth: int, dev: torch.device) -> tuple[_Model, _Model]:
    """The full-width flow model cut to `depth` DiT blocks with seeded weights (seed 0), on `dev`:
    as served (estimator and speaker projection in float16) and a float32 copy (the SNR reference)."""
    full = preset("full")
    cfg = dataclasses.replace(full, dit=dataclasses.replace(full.dit, depth=depth))
    flow = FlowModel(cfg)
    init_random_(flow, 0)
    flow.eval().to(dev)
    flow32 = _Model(copy.deepcopy(flow), cfg)
    flow.decoder.estimator.half()
    flow.spk_embed_affine_layer.half()
    return _Model(flow, cfg), flow32


def build_name(batch: int, T: int, L: int, depth: int, switches: list[str] = (), tag: str = "") -> str:
    """The name of a build: its package is /tmp/<name>.pt2, what the build recorded (the manifest
    extra, its time) /tmp/<name>.build.json."""
    return "_".join([f"cfm_profile_B{batch}_T{T}_L{L}_d{depth}", *switches, *([tag] if tag else [])])


def built_package(batch: int, T: int, L: int, depth: int, tag: str) -> tuple[Path, dict]:
    """A build without variant switches, as `--phase build --tag TAG` leaves it: its package's path
    and the manifest extra its build recorded."""
    path = Path(f"/tmp/{build_name(batch, T, L, depth, tag=tag)}.pt2")
    return path, json.loads(path.with_suffix(".build.json").read_text())["extra"]


def artifact_info(path: Path, key: ShapeKey, x: list, extra: dict) -> ArtifactInfo:
    """The manifest entry of the CFM package at `path`, built for `key` on example inputs `x`."""
    spec = SPECS["cfm"]
    return ArtifactInfo(path, spec.input_names(key), spec.output_names, tuple(tuple(t.shape) for t in x),
                        tuple(str(t.dtype).removeprefix("torch.") for t in x), extra)


def add_shape_arguments(ap: argparse.ArgumentParser) -> None:
    """--batch, --T, --L, --depth: the key and model depth a build is named by (build_name)."""
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--T", type=int, default=50)
    ap.add_argument("--L", type=int, default=300)
    ap.add_argument("--depth", type=int, default=2)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_shape_arguments(ap)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tag", default="", help="variant name for the output file")
    ap.add_argument("--attn", choices=tuple(ATTENTION), default="current",
                    help="legacy: the DiT attention before the att cache was written once; bthd: q normalized "
                         "before its transpose")
    ap.add_argument("--conv", choices=tuple(CONV), default="current",
                    help="frames / per-tap: the model's convolution forms before run 17")
    ap.add_argument("--triton-rows", type=int, default=0,
                    help="build with the fused Triton DiT kernels of fused_dit.py up to this many rows; "
                         "eager is timed without them (needs --tiles)")
    ap.add_argument("--tiles", default="",
                    help="comma-separated fused_tiles.py results: the products fused and their tiles "
                         "(fused_dit.load_tiles)")
    ap.add_argument("--phase", choices=("all", "build", "time"), default="all",
                    help="build: compile only (run several at once); time: reuse that build, then time "
                         "and profile (run one at a time: concurrent timings disturb each other)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    if bool(a.triton_rows) != bool(a.tiles):
        raise SystemExit("--triton-rows and --tiles go together: the rows fused, and each product's tile")
    dev = torch.device("cuda")
    if ATTENTION[a.attn] and SPECS["cfm"].export_variant.extra(preset("full")).get("step_att") == "in_place":
        raise SystemExit(f"--attn {a.attn} patches Attention.forward, which the in-place Euler step (AOTI revision 4) "
                         "does not call: it measures eager only. Run it from a commit before the in-place step "
                         "(6cdc99c) to reproduce runs 5-19.")
    if ATTENTION[a.attn]:
        Attention.forward = ATTENTION[a.attn]
    if CONV[a.conv]:
        CausalConvBlock._conv = lambda self, conv, h: CONV[a.conv](conv, h)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    model, flow32 = models(a.depth, dev)
    cfg = model.cfg
    key = ShapeKey("cfm", (a.batch, a.T, a.L), "float16")
    spec = SPECS["cfm"]
    unit = spec.build(model, key).eval()
    x = spec.example_inputs(cfg, key, device=dev)     # drawn on the device (seed 0): the host took minutes at B=32
    # the variant switches are part of the name: a `--phase time` call must find ITS build
    switches = ([f"{a.attn}-attn"] if ATTENTION[a.attn] else []) + ([f"{a.conv}-conv"] if CONV[a.conv] else []) \
        + ([f"triton{a.triton_rows}"] if a.triton_rows else [])
    name = build_name(a.batch, a.T, a.L, a.depth, switches, a.tag)
    path = Path(f"/tmp/{name}.pt2")
    built = path.with_suffix(".build.json")
    if a.phase == "time" and built.is_file() and path.is_file():
        done = json.loads(built.read_text())
        extra, build_s, tiles = done["extra"], done["build_s"], done.get("tiles", {})
    else:
        t0 = time.time()
        if a.triton_rows:
            from benchmarks.h200 import fused_dit
            tiles = fused_dit.load_tiles(a.tiles.split(","))
            print(f"fused products and tiles: {tiles}", flush=True)
            fused_dit.apply(model.flow.decoder.estimator, a.triton_rows, tiles)
        try:
            extra = build_aoti(model, unit, key, x, path)
        finally:
            if a.triton_rows:
                fused_dit.apply(model.flow.decoder.estimator, 0)
        build_s = time.time() - t0
        built.write_text(json.dumps({"extra": extra, "build_s": build_s, "tiles": tiles if a.triton_rows else {}}))
        if a.phase == "build":
            print(f"{name}: built in {build_s:.0f} s", flush=True)
            return
    info = artifact_info(path, key, x, extra)
    weights = unit_weights(unit)
    res = {"B": a.batch, "T": a.T, "L": a.L, "depth": a.depth, "tag": a.tag, "attn": a.attn, "conv": a.conv,
           "triton_rows": a.triton_rows, "fused_tiles": tiles if a.triton_rows else {},
           "inductor": extra.get("inductor", {}),
           "commit": os.environ.get("C2W_COMMIT", "unknown"), "build_s": round(build_s, 1)}
    with torch.inference_mode():
        want = unit(*x)
        res["eager"] = timed(lambda: unit(*x), dev, 3, a.reps)
        g = CapturedCall(lambda *i: unit(*i), info.input_shapes, [t.dtype for t in x], dev, GraphPool(dev))
        res["eager_graph"] = timed(lambda: g(*x), dev, 3, a.reps)
        eng = AOTIBackend(cuda_graphs=True, graph_max_bytes=None).load(info, weights, dev)
        res["engine_graph"] = timed(lambda: eng.run(x), dev, 3, a.reps)
        got = eng.run(x)
        res["engine_graph"]["rel_l2"] = [rel_l2(o.float(), w.float()) for o, w in zip(got, want)]
        # the bar of issue #15: the engine's mel against the float32 model's, as an SNR
        unit32 = spec.build(flow32, key).eval()
        mel32 = unit32(*[t.float() if t.is_floating_point() else t for t in x])[0]
        res["mel_snr_db_vs_fp32"] = float(10 * torch.log10(mel32.pow(2).sum() / (got[0].float() - mel32).pow(2).sum()))
        res["eager_mel_snr_db_vs_fp32"] = float(10 * torch.log10(mel32.pow(2).sum() / (want[0].float() - mel32).pow(2).sum()))
        del unit32, mel32
        plain = AOTIBackend(cuda_graphs=False).load(info, weights, dev)
        res["engine"] = timed(lambda: plain.run(x), dev, 3, a.reps)
        res["allocator_per_solve"] = allocator_counts(lambda: plain.run(x), dev)
        res["served"] = served_forms(info, weights, x, dev, a.reps)
        try:
            res["profile"] = profile_kernels(lambda: plain.run(x))
        except Exception as exc:          # noqa: BLE001 - profiler API drift: the timings above still count
            res["profile"] = {"kernels_per_solve": -1, "kernel_ms_per_solve": float("nan"), "mean_kernel_us": 0.0,
                              "top": [], "error": repr(exc)}
    Path(a.out, f"{name}.json").write_text(json.dumps(res, indent=1))
    p = res["profile"]
    print(f"{a.tag or 'default'} B={a.batch} T={a.T} depth={a.depth}: eager {res['eager']['median_ms']:.2f} ms, eager+graph "
          f"{res['eager_graph']['median_ms']:.2f}, engine {res['engine']['median_ms']:.2f}, engine+graphs "
          f"{res['engine_graph']['median_ms']:.2f}; {p['kernels_per_solve']} kernels/solve, kernel time "
          f"{p['kernel_ms_per_solve']:.2f} ms, mean {p['mean_kernel_us']:.1f} us; build {build_s:.0f} s; mel SNR vs fp32 "
          f"{res['mel_snr_db_vs_fp32']:.1f} dB (eager fp16 {res['eager_mel_snr_db_vs_fp32']:.1f})", flush=True)
    print("   allocator per ungraphed solve: " + ", ".join(f"{k} {v:g}" for k, v in res["allocator_per_solve"].items()))
    sv = res["served"]
    print(f"   served ({sv['step_att']} step, {'graphed per step' if sv['graphed'] else 'solve graphs' if sv.get('solve_graphs') else 'no graph'}), trim P={sv['trim_P']}: "
          f"from a tensor {sv['from_tensor']['median_ms']:.2f} ms ({sv['profile_from_tensor']['kernels_per_solve']} "
          f"kernels, {sv['profile_from_tensor']['kernel_ms_per_solve']:.2f} ms)" + (
              f"; steady ring {sv['ring_steady']['median_ms']:.2f} ms ({sv['profile_ring_steady']['kernels_per_solve']} "
              f"kernels, {sv['profile_ring_steady']['kernel_ms_per_solve']:.2f} ms), ring = tensor: "
              f"{sv['ring_equals_tensor']}, buffer kept: {sv['ring_kept_its_buffer']}" if "ring_steady" in sv else ""))
    for t in p["top"][:8]:
        print(f"   {t['count']:5d} x  {t['ms']:7.3f} ms  {t['name']}")


if __name__ == "__main__":
    main()
