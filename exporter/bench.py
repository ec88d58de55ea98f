"""`c2w bench`: engines against eager at the same precision, per key and per streaming chunk.

Per built key: median / p95 latency of eager, of the engine called directly, and of the engine
under CUDA-graph replay (CUDA events after warm-up on GPU; perf_counter on CPU), and the rel-L2
of the engine's outputs against eager on the same inputs (the timed calls compute the same
function). Per batch size: stage latency of a first and a steady chunk (encoder + CFM + HiFT +
cache handling) through the streaming driver, eager vs engines, and audio-seconds per second.
If step-audio2 is importable: its B=1 eager chunk as the peer row. Never asserts a time.
"""
from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from runtime.cache import EngineCache
from runtime.engines import get_backend
from runtime.manifest import read_manifest
from runtime.model.weights import load_model
from runtime.stream import StreamDriver
from runtime.units import SPECS, EagerRunner, dtype_of, rel_l2
from runtime.verify import artifact_info, entry_key, unit_weights


def timed(fn, device: torch.device, warmup: int, reps: int) -> dict:
    for _ in range(warmup):
        fn()
    ts = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            ts.append(a.elapsed_time(b))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return {"median_ms": ts[len(ts) // 2], "p95_ms": ts[min(len(ts) - 1, int(round(0.95 * (len(ts) - 1))))],
            "reps": reps}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def bench_dir(artifact_dir: Path, *, reps: int = 20, warmup: int = 3, keys: list[str] | None = None,
              stream_batches: list[int] | None = None, peer: bool = True) -> dict:
    manifest = read_manifest(artifact_dir)
    device = torch.device("cpu" if manifest.device == "cpu" else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = bool(manifest.precision.get("tf32"))
    torch.backends.cudnn.allow_tf32 = bool(manifest.precision.get("tf32"))
    model = load_model(manifest.model["spec"])
    model.to(device, {c: dtype_of(manifest.precision[c]) for c in SPECS})
    eager = EagerRunner(model)
    res = {"device": manifest.device, "torch": torch.__version__, "backend": manifest.backend,
           "model": manifest.model, "precision": manifest.precision, "commit": _commit(),
           "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "keys": [], "stream": []}
    built = [e for e in manifest.entries if e.status == "built" and (not keys or e.id in keys)]
    for e in built:
        key = entry_key(e)
        spec = SPECS[key.component]
        inputs = spec.example_inputs(model.cfg, key, torch.Generator().manual_seed(7), device=device)
        row = {"id": e.id, "component": key.component, "dims": e.dims, "dtype": e.dtype,
               "build_seconds": e.build_seconds, "device_bytes": e.device_bytes}
        row["eager"] = timed(lambda: eager.run(key, inputs), device, warmup, reps)
        want = eager.run(key, inputs)
        weights = unit_weights(eager.unit(key))
        variants = [("engine", False), ("engine_graph", True)] if device.type == "cuda" else [("engine", False)]
        for name, graphs in variants:
            backend = get_backend(manifest.backend["name"])
            if hasattr(backend, "cuda_graphs"):
                backend.cuda_graphs = graphs
            try:
                eng = backend.load(artifact_info(artifact_dir, e, model.cfg), weights, device)
                got = eng.run(inputs)
                row[name] = timed(lambda: eng.run(inputs), device, warmup, reps)
                row[name]["max_rel_l2_vs_eager"] = max(rel_l2(g.to(w.device), w) for g, w in zip(got, want))
                eng.release()
            except Exception as exc:  # a variant that cannot run is reported, not fatal
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        best = min((row[v]["median_ms"] for v, _ in variants if "median_ms" in row[v]), default=None)
        row["speedup_vs_eager"] = row["eager"]["median_ms"] / best if best else None
        res["keys"].append(row)
        print(f"  {e.id}: eager {row['eager']['median_ms']:.2f} ms, best engine "
              f"{best if best is None else round(best, 3)} ms", flush=True)
    res["stream"] = bench_stream(model, artifact_dir, manifest, device, stream_batches, reps=max(5, reps // 2))
    if peer and device.type == "cuda":
        res["peer"] = bench_peer(model, device, reps=max(5, reps // 2))
    if device.type == "cuda":
        res["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return res


def bench_stream(model, artifact_dir, manifest, device, batches, reps: int) -> list[dict]:
    """Per batch size: the first chunk and a steady chunk, eager vs engines (28-token chunks and
    any other chunk size of the profile)."""
    sched = manifest.schedule
    P = sched.get("prompt_frames", 300)
    cache = EngineCache(artifact_dir, model, device)
    rows = []
    for B in batches or sched.get("batch_sizes", [1]):
        for N in sched.get("chunk_tokens", [28]):
            g = torch.Generator().manual_seed(B)
            prompt = torch.randint(0, model.cfg.vocab_size, (B, P // 2), generator=g)
            pmel, spk = torch.randn(B, P, 80, generator=g), torch.randn(B, 192, generator=g)
            tok = torch.randint(0, model.cfg.vocab_size, (B, N), generator=g).to(device)
            row = {"B": B, "chunk_tokens": N, "prompt_frames": P}
            for name, runner in (("eager", EagerRunner(model)), ("engines", cache)):
                drv = StreamDriver(model, runner, trim_conformer=sched.get("trim_conformer", True))
                st0 = drv.setup(prompt, pmel, spk)
                for phase in ("first", "steady"):
                    st = _copy_state(st0)
                    if phase == "steady":                 # advance to the saturated cache lengths
                        for _ in range(3):
                            drv.step(st, tok)
                    snap = _copy_state(st)
                    row[f"{name}_{phase}"] = timed(lambda: drv.step(_copy_state(snap), tok), device, 2, reps)
            T = 2 * (N - 3)
            for phase in ("first", "steady"):
                ms = row[f"engines_{phase}"]["median_ms"]
                row[f"audio_s_per_s_{phase}"] = B * T / 50 / (ms / 1e3)
                row[f"speedup_{phase}"] = row[f"eager_{phase}"]["median_ms"] / ms
            rows.append(row)
            print(f"  stream B={B} N={N}: first {row['engines_first']['median_ms']:.1f} ms "
                  f"(eager {row['eager_first']['median_ms']:.1f}), steady {row['engines_steady']['median_ms']:.1f} ms",
                  flush=True)
    res_stats = cache.stats()
    cache.release()
    rows.append({"cache_stats": res_stats})
    return rows


def _copy_state(st):
    import copy
    new = copy.copy(st)
    for f in ("conformer_cnn", "conformer_att", "estimator_cnn", "estimator_att", "hift_mel", "hift_source",
              "hift_speech"):
        setattr(new, f, getattr(st, f).clone())
    return new


def bench_peer(model, device, reps: int) -> dict:
    """step-audio2's reference (its own modules, our weights): B=1 fp32 eager flow chunk of 28
    tokens after a 300-frame prompt, and its HiFT on 58 frames with the 3840-sample cache."""
    try:
        from cosyvoice2.flow.decoder_dit import DiT
        from cosyvoice2.flow.flow import CausalMaskedDiffWithXvec
        from cosyvoice2.flow.flow_matching import CausalConditionalCFM
        from cosyvoice2.transformer.upsample_encoder_v2 import UpsampleConformerEncoderV2
    except ImportError:
        return {"skipped": "step-audio2 not importable"}
    cfg = model.cfg
    e, d = cfg.encoder, cfg.dit
    enc = UpsampleConformerEncoderV2(input_size=e.width, output_size=e.width, pre_lookahead_len=e.pre_lookahead,
                                     num_blocks=e.blocks, num_up_blocks=e.up_blocks, up_stride=2, up_scale_factor=2,
                                     attention_heads=e.heads, linear_units=e.ffn, dropout_rate=0.0,
                                     positional_dropout_rate=0.0)
    dit = DiT(in_channels=d.in_channels, out_channels=80, mlp_ratio=d.mlp_ratio, depth=d.depth, num_heads=d.heads,
              head_dim=d.head_dim, hidden_size=d.hidden)
    ref = CausalMaskedDiffWithXvec(input_size=e.width, output_size=80, spk_embed_dim=192, vocab_size=cfg.vocab_size,
                                   encoder=enc, decoder=CausalConditionalCFM(dit, inference_cfg_rate=cfg.cfg_rate))
    ref.load_state_dict({k: v.float() for k, v in model.flow.state_dict().items()}, strict=True)
    ref = ref.to(device).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, 153), generator=g).to(device)
    pmel, spk = torch.randn(1, 300, 80, generator=g).to(device), torch.randn(1, 192, generator=g).to(device)
    tok = torch.randint(0, cfg.vocab_size, (1, 28), generator=g).to(device)
    with torch.inference_mode():
        cache0 = {k: v.clone() for k, v in ref.setup_cache(prompt, pmel, spk).items()}
        flow = timed(lambda: ref.inference_chunk(tok, spk, dict(cache0), last_chunk=False), device, 2, reps)
    return {"what": "step-audio2 1.0.0 flow.inference_chunk, B=1, 28 tokens, fp32 eager (HiFT not included)",
            "flow_chunk": flow}


def to_markdown(res: dict) -> str:
    lines = [f"Device {res['device']}, torch {res['torch']}, backend {res['backend']['name']} "
             f"{res['backend']['version']}, model {res['model']['spec']}, precision {res['precision']}, "
             f"commit {res['commit']}, {res['date']}", "",
             "| key | eager ms (p50/p95) | engine ms | engine+graph ms | speed-up | rel-L2 vs eager | build s |",
             "|---|---|---|---|---|---|---|"]
    for r in res["keys"]:
        def cell(v):
            x = r.get(v)
            return "-" if not x or "median_ms" not in x else f"{x['median_ms']:.3f} / {x['p95_ms']:.3f}"
        rel = max((r[v].get("max_rel_l2_vs_eager", 0) for v in ("engine", "engine_graph") if v in r
                   and "median_ms" in r[v]), default=float("nan"))
        sp = r.get("speedup_vs_eager")
        lines.append(f"| {r['id']} | {cell('eager')} | {cell('engine')} | {cell('engine_graph')} | "
                     f"{'-' if sp is None else f'{sp:.1f}x'} | {rel:.1e} | {r['build_seconds']} |")
    lines += ["", "| B | chunk tokens | first: eager / engines ms | steady: eager / engines ms | steady audio-s/s | first speed-up | steady speed-up |",
              "|---|---|---|---|---|---|---|"]
    for r in res["stream"]:
        if "B" not in r:
            continue
        lines.append(f"| {r['B']} | {r['chunk_tokens']} | {r['eager_first']['median_ms']:.1f} / "
                     f"{r['engines_first']['median_ms']:.1f} | {r['eager_steady']['median_ms']:.1f} / "
                     f"{r['engines_steady']['median_ms']:.1f} | {r['audio_s_per_s_steady']:.0f} | "
                     f"{r['speedup_first']:.1f}x | {r['speedup_steady']:.1f}x |")
    peer = res.get("peer", {})
    if "flow_chunk" in peer:
        lines += ["", f"Peer: {peer['what']}: {peer['flow_chunk']['median_ms']:.1f} ms (p95 {peer['flow_chunk']['p95_ms']:.1f})"]
    if "peak_device_bytes" in res:
        lines += ["", f"Peak device memory during the run: {res['peak_device_bytes'] / 2**30:.2f} GiB"]
    return "\n".join(lines)


def write(res: dict, out: Path) -> None:
    out = Path(out)
    out.write_text(json.dumps(res, indent=1, default=str))
    out.with_suffix(".md").write_text(to_markdown(res) + "\n")
