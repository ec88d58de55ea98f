"""HiFT at the steady serving key with its convolutions in reduced precision (issue #15 item 4).

The key is B=32 F=158 S=3840: a steady chunk of 150 new mel frames behind the 8-frame mel cache,
with the 3840-sample source cache. B=1 F=58 S=3840 is measured too, for reference. Variants are
built here, from outside the product code (runtime/ is not touched):

  precision (conv stack = conv_pre, ups, source_downs, source_resblocks, resblocks, conv_post)
    fp32        everything float32, TF32 off: the reference every SNR is taken against
    tf32        float32 with TF32 on (cuDNN and cuBLAS): what h100.yaml serves (and h200.yaml up to
                run 13; it serves fp16-conv since)
    bf16-stack  the whole conv stack in bf16 (weights, Snake alphas, activations, residual sums);
    fp16-stack  the mel and the STFT of the source cast on the way in, the output on the way out
    bf16-conv   only the convolutions in bf16/fp16: each casts its input and its output back, so
    fp16-conv   Snake, leaky ReLU and the residual sums stay float32 (the casts fuse under compile)
  The f0 predictor, NSF source, STFT and ISTFT stay float32 (TF32 off) in every reduced variant:
  HiFT's source is ill-conditioned in f0 (runtime/model/hift.py, "Precision note").
  layout: `+nhwc` runs each 1-D conv as a 2-D conv on (B, C, 1, T) in torch.channels_last
    (activations stay 4-D and channels-last through the whole stack): channels-last for 1-D.
  cuDNN algorithm choice: every eager row is timed with torch.backends.cudnn.benchmark off and on.
  mode: eager; eager replayed under one CUDA graph (what the engines do); torch.compile
    (`--compile-mode`, whole forward, static shapes), called directly and under one CUDA graph.

The variant module computes the product's forward op for op (`fp32` reproduces HiftVocoder bit for
bit, checked at start), except that its host-side constants (interpolation weights, ISTFT window
envelope) are device buffers made once, so that it can be captured in a CUDA graph.

Inputs are built as a steady chunk is in runtime/stream.py: a smooth random mel (unit scale, as
the verification inputs), a first chunk of the new-frame length vocoded by the float32 model,
whose last 3840 source samples become the source cache and whose last 8 mel frames are prepended
to the next 150. SNR (dB) is of the speech against fp32 eager on the same inputs.

Fidelity bar (issue #15): session audio SNR against fp32 no lower than fp16 eager's minus 1 dB.
This script measures HiFT alone; if HiFT's error adds to the rest of the session's as independent
noise, a `--session-ref-db` session (docs/numerics.md: fp16 eager, 38.3 dB) loses at most 1 dB when
HiFT's own SNR is at least the threshold printed (44.2 dB for 38.3). The authoritative check is
`c2w bench`'s session fidelity once a variant is in the engines.

Budget: `--seconds` bounds the whole run (measured from the start of main); work that would not
fit is skipped and listed. Order: the 1-D eager variants, then the compile list, then the
`+nhwc` eager variants. JSON is rewritten after every row, so a run cut short keeps its rows.

A compile cannot be cut short: the budget check uses `--compile-estimate-s` until a compile has
been timed, so an Inductor build much slower than that overruns `--seconds`. Run under `timeout`:
on SIGTERM the script stops, prints the table of what it measured and keeps the JSON.

Usage (H200, one 120 s device call; ~100 s wall; `--kernels` adds each compiled variant's kernel
profile, for kernel_classes.py):
  timeout 112 python3 benchmarks/h200/hift_precision.py --out $OUT --seconds 80 --compile fp16-conv
CPU smoke (compile path checked with `--compile-backend eager`, no C++ build):
  python benchmarks/h200/hift_precision.py --model random:tiny --batch 2 --frames 16 --b1-frames 16 \\
      --device cpu --no-compile --reps 2 --seconds 200 --out /tmp/hift_smoke
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.h200.kernel_classes import profile_kernels  # noqa: E402
from c2w.exporter.bench.engines import snr_db, timed  # noqa: E402
from c2w.runtime.model import hift as H  # noqa: E402
from c2w.runtime.model.config import preset  # noqa: E402
from c2w.runtime.model.weights import init_random_, load_model  # noqa: E402
from c2w.runtime.units import rel_l2  # noqa: E402

# name -> (conv-stack dtype, where the casts are, TF32)
PRECISIONS = {
    "fp32": (torch.float32, "stack", False),
    "tf32": (torch.float32, "stack", True),
    "bf16-stack": (torch.bfloat16, "stack", False),
    "fp16-stack": (torch.float16, "stack", False),
    "bf16-conv": (torch.bfloat16, "conv", False),
    "fp16-conv": (torch.float16, "conv", False),
}
CONV_STACK = ("conv_pre", "ups", "source_downs", "source_resblocks", "resblocks", "conv_post")
NHWC = "+nhwc"


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on      # the legacy flags, as runtime/precision.py sets them
    torch.backends.cudnn.allow_tf32 = on


def parse_variant(name: str) -> tuple[str, bool]:
    prec, nhwc = (name[:-len(NHWC)], True) if name.endswith(NHWC) else (name, False)
    if prec not in PRECISIONS:
        raise SystemExit(f"unknown variant {name!r}: expected one of {sorted(PRECISIONS)}, optionally + {NHWC!r}")
    return prec, nhwc


# ---------------------------------------------------------------------------------------------
# the variant module
# ---------------------------------------------------------------------------------------------
class HiftVariant(nn.Module):
    """A copy of `base` whose conv stack runs in `dtype` (casts at the stack's boundary or around
    each conv), optionally as channels-last 2-D convs; f0 predictor, source, STFT, ISTFT float32."""

    def __init__(self, base: H.HiftVocoder, dtype: torch.dtype, casts: str, nhwc: bool, frame_counts):
        super().__init__()
        # Share base's modules (a deep copy can move CPU results by an ulp: oneDNN's blocking
        # follows the weights' alignment); copy only the conv stack, and only when it changes.
        m = copy.copy(base)
        m._modules, m._parameters, m._buffers = dict(base._modules), dict(base._parameters), dict(base._buffers)
        if dtype != torch.float32 or nhwc:
            for name in CONV_STACK:
                setattr(m, name, copy.deepcopy(getattr(base, name)))
        self.m, self.dtype, self.per_conv, self.nhwc = m, dtype, casts == "conv", nhwc
        for name in CONV_STACK:
            for mod in getattr(m, name).modules():
                if not self.per_conv or isinstance(mod, (nn.Conv1d, nn.ConvTranspose1d)):
                    mod.to(dtype)
                if nhwc and isinstance(mod, (nn.Conv1d, nn.ConvTranspose1d)):
                    w = mod.weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)
                    mod.register_buffer("weight2d", w, persistent=False)
        hop, stft_hop = m.hop_samples, m.stft_hop
        for frames in frame_counts:       # host constants of the product's forward, made device buffers
            for i, w in enumerate(H._upsample_weights(frames, hop)):
                self.register_buffer(f"up{frames}_{i}", torch.from_numpy(w.copy()), persistent=False)
            n = frames * hop // stft_hop + 1
            env = H._window_envelope(n, m.n_fft, stft_hop).copy()
            self.register_buffer(f"env{n}", torch.from_numpy(env), persistent=False)
        self.to(next(base.parameters()).device)

    # ---- float32 front end: as HiftVocoder.forward / NsfSource.forward, op for op
    def forward(self, mel, noise, source_cache=None):
        f0 = self.m.f0_predictor(mel)
        source = self._source(f0, noise)
        if source_cache is not None and source_cache.shape[-1] > 0:
            source = torch.cat([source_cache, source[:, :, source_cache.shape[-1]:]], dim=2)
        return self._decode(mel, source), source

    def _source(self, f0, noise):
        s = self.m.m_source
        b, frames = f0.shape
        rad = f0.unsqueeze(-1) * s.harmonics / s.sampling_rate
        rad = rad - torch.floor(rad)
        phase = H._prefix_sum_f32(rad, dim=1) * 2 * math.pi
        phase = self._upsample_phase(phase.transpose(1, 2) * s.hop, s.hop)
        sines = torch.sin(phase).transpose(1, 2) * s.sine_amp
        uv = (f0 > s.voiced_threshold).to(f0.dtype)
        uv = uv.unsqueeze(-1).expand(b, frames, s.hop).reshape(b, frames * s.hop, 1)
        noise_amp = uv * s.noise_std + (1 - uv) * (s.sine_amp / 3)
        excitation = sines * uv + noise_amp * noise
        return torch.tanh(s.l_linear(excitation)).transpose(1, 2)

    def _upsample_phase(self, v, hop):
        b, h, frames = v.shape
        half = hop // 2
        vp = torch.cat([v[..., :1], v, v[..., -1:]], dim=-1)

        def per_sample(first, second):
            return torch.cat([first.unsqueeze(-1).expand(b, h, frames, half),
                              second.unsqueeze(-1).expand(b, h, frames, hop - half)], dim=-1).reshape(b, h, frames * hop)

        left = per_sample(vp[..., :frames], vp[..., 1:frames + 1])
        right = per_sample(vp[..., 1:frames + 1], vp[..., 2:])
        l0, l0_hi, l0_lo, l1 = (getattr(self, f"up{frames}_{i}") for i in range(4))
        r = right * l1
        p = left * l0
        left_hi, left_lo = H._dekker_split(left)
        e = ((left_hi * l0_hi - p) + left_hi * l0_lo + left_lo * l0_hi) + left_lo * l0_lo
        s, e2 = H._two_sum(p, r)
        return s + (e + e2)

    def _istft(self, spec):
        m = self.m
        frames = spec.shape[-1]
        out = F.conv_transpose1d(spec, m.istft_kernel, stride=m.stft_hop)
        pad = m.n_fft // 2
        length = m.stft_hop * (frames - 1)
        return out[:, 0, pad:pad + length] / getattr(self, f"env{frames}")

    # ---- the conv stack, in self.dtype
    def _enter(self, t):
        if not self.per_conv:
            t = t.to(self.dtype)
        if self.nhwc:
            t = t.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        return t

    def _conv(self, c, x):
        if self.per_conv:
            x = x.to(self.dtype)
        s, p, d = c.stride[0], c.padding[0], c.dilation[0]
        if isinstance(c, nn.ConvTranspose1d):
            op = c.output_padding[0]
            y = (F.conv_transpose2d(x, c.weight2d, c.bias, (1, s), (0, p), (0, op), 1, (1, d)) if self.nhwc
                 else F.conv_transpose1d(x, c.weight, c.bias, s, p, op, 1, d))
        else:
            y = (F.conv2d(x, c.weight2d, c.bias, (1, s), (0, p), (1, d)) if self.nhwc
                 else F.conv1d(x, c.weight, c.bias, s, p, d))
        return y.float() if self.per_conv else y

    @staticmethod
    def _snake(act, x):
        a = act.alpha.view(1, -1, *([1] * (x.dim() - 2)))
        return x + (1.0 / (a + 1e-9)) * torch.sin(x * a).pow(2)

    def _resblock(self, rb, x):
        for act1, conv1, act2, conv2 in zip(rb.activations1, rb.convs1, rb.activations2, rb.convs2):
            x = x + self._conv(conv2, self._snake(act2, self._conv(conv1, self._snake(act1, x))))
        return x

    def _decode(self, mel, source):
        m, cfg = self.m, self.m.cfg
        s_spec = self._enter(m._stft(source))                        # STFT in float32
        x = self._conv(m.conv_pre, self._enter(mel))
        n_res = len(cfg.resblock_kernels)
        for i, up in enumerate(m.ups):
            x = self._conv(up, F.leaky_relu(x, cfg.lrelu_slope))
            if i == len(m.ups) - 1:
                x = F.pad(x, (1, 0, 0, 0) if self.nhwc else (1, 0), mode="reflect")
            x = x + self._resblock(m.source_resblocks[i], self._conv(m.source_downs[i], s_spec))
            acc = self._resblock(m.resblocks[i * n_res], x)
            for j in range(1, n_res):
                acc = acc + self._resblock(m.resblocks[i * n_res + j], x)
            x = acc / n_res
        x = self._conv(m.conv_post, F.leaky_relu(x))
        if self.nhwc:
            x = x.squeeze(2)
        x = x.float().contiguous()                                   # back to float32 for the ISTFT
        bins = m.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :bins]).clamp(max=1e2)
        phase = torch.sin(x[:, bins:])
        spec = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)
        return self._istft(spec).clamp(-cfg.audio_limit, cfg.audio_limit)


# ---------------------------------------------------------------------------------------------
# model and inputs
# ---------------------------------------------------------------------------------------------
def build_hift(spec: str):
    """(HiftVocoder, ModelConfig). `random:<preset>[:seed]` builds HiFT alone, seeded as load_model
    seeds it (seed + 1), without the flow model."""
    if spec.startswith("random:"):
        parts = spec.split(":")
        cfg = preset(parts[1])
        seed = int(parts[2]) if len(parts) == 3 else 0
        hift = H.HiftVocoder(cfg.hift)
        init_random_(hift, seed + 1)
        return hift.eval(), cfg
    model = load_model(spec)
    return model.hift.eval(), model.cfg


def smooth_mel(batch: int, bins: int, frames: int, g: torch.Generator) -> torch.Tensor:
    """(B, bins, frames): Gaussian noise smoothed over ~2 bins and ~1.5 frames, plus a spectral
    tilt, standardised per row (unit scale, like the verification inputs, but mel-like in shape)."""
    def kern(sigma, r):
        t = torch.arange(-r, r + 1, dtype=torch.float32)
        k = torch.exp(-0.5 * (t / sigma) ** 2)
        return k / k.sum()
    kf, kt = kern(2.0, 6), kern(1.5, 4)
    x = torch.randn(batch, 1, bins + 12, frames + 8, generator=g)
    y = F.conv2d(x, (kf[:, None] * kt[None, :])[None, None])[:, 0]
    y = y / y.std() + torch.linspace(1.0, -1.0, bins)[:, None]
    return ((y - y.mean(dim=(1, 2), keepdim=True)) / y.std(dim=(1, 2), keepdim=True)).contiguous()


@torch.inference_mode()
def steady_inputs(base, cfg, batch: int, frames: int, device, seed: int):
    """[mel (B, 80, F), noise (B, 480F, H), source_cache (B, 1, S)] as runtime/stream.py builds a
    steady chunk: a first chunk of F - 8 frames vocoded by float32 eager (TF32 off) leaves its last
    8 mel frames and last S source samples."""
    g = torch.Generator().manual_seed(seed)
    mc, n_src, spf, nh = cfg.hift_mel_cache, cfg.hift_source_cache, cfg.hift.samples_per_frame, cfg.hift.nb_harmonics + 1
    new = frames - mc
    if new < mc:
        raise SystemExit(f"frames {frames}: need at least {2 * mc} (8 cached + at least 8 new)")
    mel_all = smooth_mel(batch, cfg.mel_bins, 2 * new, g)
    first_mel = mel_all[:, :, :new].contiguous().to(device)
    first_noise = torch.randn(batch, new * spf, nh, generator=g).to(device)
    set_tf32(False)
    _, source = base(first_mel, first_noise)
    mel = mel_all[:, :, new - mc:].contiguous().to(device)
    noise = torch.randn(batch, frames * spf, nh, generator=g).to(device)
    return [mel, noise, source[:, :, -n_src:].contiguous()]


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------
def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def capture(fn, inputs):
    """Replay function of `fn(*inputs)` captured in one CUDA graph, and its static outputs."""
    static = [t.clone() for t in inputs]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*static)
    return g, out


def fid(out, ref) -> dict:
    speech, source = out
    finite = bool(torch.isfinite(speech).all())
    return {"snr_db": snr_db(speech, ref[0]) if finite else float("nan"),
            "rel_l2": rel_l2(speech.float(), ref[0].float()) if finite else float("nan"),
            "source_snr_db": snr_db(source, ref[1]), "finite": finite}


class Run:
    def __init__(self, args, dev):
        self.a, self.dev, self.t0 = args, dev, time.perf_counter()
        self.rows, self.skipped, self.notes = [], [], []
        self.meta: dict = {}
        self.est = {"eager": 0.0, "compile": args.compile_estimate_s}
        self.compile_times: list[float] = []

    def left(self) -> float:
        return self.a.seconds - (time.perf_counter() - self.t0)

    def save(self):
        out = Path(self.a.out)
        out.mkdir(parents=True, exist_ok=True)
        res = {**self.meta, "rows": self.rows, "skipped": self.skipped, "notes": self.notes,
               "elapsed_s": round(time.perf_counter() - self.t0, 1)}
        (out / "hift_precision.json").write_text(json.dumps(res, indent=1, default=str))

    def add(self, row):
        self.rows.append(row)
        ms = "  ".join(f"{k}={v['median_ms']:.3f}ms" for k, v in row.items()
                       if isinstance(v, dict) and "median_ms" in v)
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {row['variant']:16s} {row['mode']:8s} "
              f"bench={row['cudnn_benchmark']!s:5s} {row['case']:12s} {ms}  SNR {row.get('snr_db', float('nan')):.2f} dB"
              + (f"  compile {row['compile_s']:.1f}s" if row.get("compile_s") is not None else ""), flush=True)
        self.save()


def bench_settings(dev):
    return [False, True] if dev.type == "cuda" else [None]


def set_bench(flag):
    if flag is not None:
        torch.backends.cudnn.benchmark = flag


def measure(run: Run, name: str, mode: str, fn, cases: dict, compile_s=None):
    """Time `fn` (and its CUDA-graph replay on GPU) on every case, for each cudnn.benchmark setting."""
    a, dev = run.a, run.dev
    for flag in bench_settings(dev):
        set_bench(flag)
        for case, (inputs, ref) in cases.items():
            row = {"variant": name, "mode": mode, "cudnn_benchmark": flag, "case": case,
                   "compile_s": compile_s.get(case) if compile_s else None}
            try:
                out = fn(*inputs)
                sync(dev)
                row.update(fid(out, ref))
                del out
                row["direct"] = timed(lambda: fn(*inputs), dev, a.warmup, a.reps)
                if dev.type == "cuda" and not a.no_graph:
                    try:
                        g, gout = capture(fn, inputs)
                        row["graph"] = timed(g.replay, dev, a.warmup, a.reps)
                        row["graph_snr_db"] = fid(gout, ref)["snr_db"]
                        del g, gout
                    except Exception as e:     # noqa: BLE001 - reported, not fatal
                        row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
            except Exception as e:             # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"  {name} {mode} {case}: {row['error']}", flush=True)
            run.add(row)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            if "error" in row:
                return


def eager_variant(run: Run, name: str, base, cases, frame_counts):
    prec, nhwc = parse_variant(name)
    dtype, casts, tf32 = PRECISIONS[prec]
    if run.left() < run.est["eager"]:
        run.skipped.append(f"{name} eager: {run.left():.0f} s left, ~{run.est['eager']:.0f} s needed")
        return
    t = time.perf_counter()
    set_tf32(tf32)
    try:
        mod = HiftVariant(base, dtype, casts, nhwc, frame_counts).eval()
    except Exception as e:                     # noqa: BLE001
        run.skipped.append(f"{name}: cannot build ({type(e).__name__}: {e})")
        return
    measure(run, name, "eager", mod, cases)
    del mod
    run.est["eager"] = max(run.est["eager"], time.perf_counter() - t)


def compiled_variant(run: Run, name: str, base, cases, frame_counts):
    a, dev = run.a, run.dev
    prec, nhwc = parse_variant(name)
    dtype, casts, tf32 = PRECISIONS[prec]
    need = run.est["compile"] * (2 if a.compile_b1 else 1) + run.est["eager"]
    if run.left() < need:
        run.skipped.append(f"{name} compile: {run.left():.0f} s left, ~{need:.0f} s needed")
        return
    set_tf32(tf32)
    set_bench(bench_settings(dev)[-1])
    torch._dynamo.reset()
    mod = HiftVariant(base, dtype, casts, nhwc, frame_counts).eval()
    mode = None if a.compile_mode == "default" or a.compile_backend != "inductor" else a.compile_mode
    comp = torch.compile(mod, backend=a.compile_backend, mode=mode, dynamic=False)
    cases = dict(list(cases.items())[:None if a.compile_b1 else 1])     # the main key first
    compile_s = {}
    try:
        for case, (inputs, _) in cases.items():
            t = time.perf_counter()
            comp(*inputs)
            sync(dev)
            compile_s[case] = round(time.perf_counter() - t, 1)
            run.compile_times.append(compile_s[case])
            run.est["compile"] = max(run.compile_times)
    except Exception as e:                     # noqa: BLE001
        run.skipped.append(f"{name} compile failed: {type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc()
        return
    measure(run, name, "compile", comp, cases, compile_s)
    if a.kernels and dev.type == "cuda":
        case, (inputs, _) = next(iter(cases.items()))
        try:
            prof = profile_kernels(lambda: comp(*inputs))
            path = Path(a.out, f"hift_kernels_{name}.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"variant": name, "mode": "compile", "case": case, "profile": prof}, indent=1))
            print(f"  {name} compiled, {case}: {prof['kernels_per_solve']} kernels, {prof['kernel_ms_per_solve']:.2f} "
                  f"ms of kernel time -> {path.name} (kernel_classes.py tabulates it)", flush=True)
        except Exception as e:                 # noqa: BLE001 - the timed rows above still count
            run.notes.append(f"{name} kernel profile failed: {type(e).__name__}: {str(e)[:200]}")
    del comp, mod
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------------
def session_threshold(ref_db: float, loss_db: float = 1.0) -> float:
    """HiFT SNR at which independent noise lowers a ref_db session by loss_db."""
    return -10 * math.log10(10 ** (-(ref_db - loss_db) / 10) - 10 ** (-ref_db / 10))


def table(run: Run, b_main: str, b_one: str) -> str:
    """One line per variant and mode; on the GPU each time cell is 'cudnn.benchmark off / on'."""
    thr = session_threshold(run.a.session_ref_db)
    by: dict = {}
    for r in run.rows:
        by.setdefault((r["variant"], r["mode"]), {})[(r["cudnn_benchmark"], r["case"])] = r
    flags = bench_settings(run.dev)
    cases = (b_main, b_one) if run.a.b1_frames else (b_main,)

    def cell(cells, case, key):
        got = [cells[(f, case)][key]["median_ms"] if key in cells.get((f, case), {}) else None for f in flags]
        return "-" if all(g is None for g in got) else " / ".join("-" if g is None else f"{g:.2f}" for g in got)

    head = ["variant", "mode"]
    for c in cases:
        head += [f"ms {c}", f"ms {c} graph"]
    head += [f"SNR dB {c}" for c in cases] + [f"holds (>= {thr:.1f})", "compile s"]
    lines = [" | ".join(head), "|".join(["---"] * len(head))]
    if len(flags) > 1:
        lines.insert(0, "times: cudnn.benchmark off / on")
    for (variant, mode), cells in by.items():
        row = [variant, mode]
        for c in cases:
            row += [cell(cells, c, "direct"), cell(cells, c, "graph")]
        snrs = [cells.get((flags[0], c), {}).get("snr_db") for c in cases]
        row += ["-" if x is None else f"{x:.1f}" for x in snrs]
        row.append("-" if snrs[0] is None else ("yes" if snrs[0] >= thr else "no"))
        comp = cells.get((flags[0], b_main), {}).get("compile_s")
        row.append("-" if comp is None else f"{comp:.1f}")
        lines.append(" | ".join(row))
    return "\n".join(lines)


def _stop(signum, frame):
    raise SystemExit(f"signal {signum}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--frames", type=int, default=158, help="mel frames of the main key (8 cached + new)")
    ap.add_argument("--b1-frames", type=int, default=58, help="mel frames of the B=1 reference key; 0: skip")
    ap.add_argument("--variants", default=",".join(PRECISIONS),
                    help="eager variants, 1-D layout (comma list of " + ", ".join(PRECISIONS) + ")")
    ap.add_argument("--nhwc-variants", default="tf32,bf16-conv,fp16-conv,bf16-stack,fp16-stack",
                    help=f"precisions also run eagerly as channels-last 2-D convs ({NHWC}); '' for none")
    ap.add_argument("--compile", default="fp16-conv,bf16-conv,tf32",
                    help=f"variants to torch.compile, in order (names may end in {NHWC}); '' for none")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-mode", default="default",
                    help="default | max-autotune-no-cudagraphs | ... (torch.compile mode)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="inductor; 'eager' or 'aot_eager' only check the compile path (e.g. on CPU)")
    ap.add_argument("--compile-b1", action="store_true", help="also compile and time the B=1 key (a second compile)")
    ap.add_argument("--compile-estimate-s", type=float, default=35.0,
                    help="compile time assumed before the first compile is measured (budget check)")
    ap.add_argument("--no-graph", action="store_true", help="skip CUDA-graph replays")
    ap.add_argument("--kernels", action="store_true",
                    help="profile one call of each compiled variant at the main key: hift_kernels_<variant>.json")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=95.0, help="wall budget from the start of main")
    ap.add_argument("--session-ref-db", type=float, default=38.3,
                    help="fp16 eager session audio SNR vs fp32 (docs/numerics.md) for the 'holds' column")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/hift_precision"))
    a = ap.parse_args()

    dev = torch.device(a.device)
    run = Run(a, dev)
    torch.manual_seed(a.seed)
    base, cfg = build_hift(a.model)
    base = base.to(dev)
    b_main, b_one = f"B={a.batch} F={a.frames}", f"B=1 F={a.b1_frames}"
    if (a.batch, a.frames) == (1, a.b1_frames):
        a.b1_frames = 0                                 # the same key twice
    frame_counts = sorted({a.frames, a.frames - cfg.hift_mel_cache}
                          | ({a.b1_frames, a.b1_frames - cfg.hift_mel_cache} if a.b1_frames else set()))
    run.meta = {"script": "benchmarks/h200/hift_precision.py", "commit": os.environ.get("C2W_COMMIT", "unknown"),
                "args": vars(a), "torch": torch.__version__, "python": platform.python_version(),
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
                "cudnn": torch.backends.cudnn.version() if dev.type == "cuda" else None,
                "cudnn_benchmark_limit": getattr(torch.backends.cudnn, "benchmark_limit", None),
                "session_threshold_db": session_threshold(a.session_ref_db),
                "keys": {b_main: [a.batch, a.frames, cfg.hift_source_cache],
                         b_one: [1, a.b1_frames, cfg.hift_source_cache]}}
    print(f"model {a.model}: HiFT {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M params; "
          f"built in {time.perf_counter() - run.t0:.1f} s; device {run.meta['device']}", flush=True)

    signal.signal(signal.SIGTERM, _stop)             # `timeout` stops us: still report what was measured
    try:
        with torch.inference_mode():
            cases = {}
            for case, b, f in ((b_main, a.batch, a.frames), (b_one, 1, a.b1_frames)):
                if f:
                    inputs = steady_inputs(base, cfg, b, f, dev, a.seed + b)
                    set_tf32(False)
                    set_bench(False)
                    ref = base(*inputs)                   # the product's forward: the reference
                    cases[case] = (inputs, [t.clone() for t in ref])
            # the variant module at fp32 must be the product's forward, bit for bit
            check = HiftVariant(base, torch.float32, "stack", False, frame_counts).eval()
            for case, (inputs, ref) in cases.items():
                out = check(*inputs)
                d = max((o - r).abs().max().item() for o, r in zip(out, ref))
                run.meta.setdefault("fp32_variant_vs_product_max_abs", {})[case] = d
                print(f"check {case}: fp32 variant vs HiftVocoder.forward max |diff| {d:.3g}", flush=True)
                if d:
                    run.notes.append(f"fp32 variant differs from HiftVocoder.forward at {case} by {d:.3g}")
            del check, out
            print(f"inputs ready at {time.perf_counter() - run.t0:.1f} s", flush=True)

            if dev.type == "cpu":
                run.notes.append("CPU: no cuDNN algorithm choice and no CUDA graphs; times are perf_counter")
            variants = [v for v in a.variants.split(",") if v]
            for name in variants:
                eager_variant(run, name, base, cases, frame_counts)
            if not a.no_compile:
                for name in [v for v in a.compile.split(",") if v]:
                    compiled_variant(run, name, base, cases, frame_counts)
            for prec in [v for v in a.nhwc_variants.split(",") if v]:
                eager_variant(run, prec + NHWC, base, cases, frame_counts)
    except (SystemExit, KeyboardInterrupt) as e:
        run.notes.append(f"stopped early ({e or type(e).__name__}): rows after the last one printed are missing")

    for r in run.rows:
        if "error" in r and r["mode"] == "eager":
            note = f"{r['variant']} {r['case']}: {r['error']}"
            if dev.type == "cpu" and "fp16" in r["variant"]:
                note += " (fp16 convolutions may be unsupported on this CPU: skipped)"
            run.notes.append(note)
    run.save()
    print()
    for s in run.skipped:
        print("skipped:", s)
    for n in run.notes:
        print("note:", n)
    print(f"\nSNR is of the speech against fp32 eager (TF32 off) on the same inputs; 'holds' assumes HiFT's "
          f"error adds to a {a.session_ref_db} dB session's as independent noise (bar: lose <= 1 dB). "
          f"Elapsed {time.perf_counter() - run.t0:.1f} s.\n")
    print(table(run, b_main, b_one))


if __name__ == "__main__":
    main()
