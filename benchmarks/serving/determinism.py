"""Where do a stream's PCM differences between serving modes come from?

One B=1 session (28-token chunks after the profile's prompt) served five ways on one runtime:
sequentially twice, in 4 threads at once (same inputs), through the stream server alone, and
through the server batched with 7 other streams at the same positions. Each is compared with the
first sequential run, per chunk, on the CFM's mel and on the PCM; a last row runs the HiFT engine
twice on identical inputs. Prints a table and writes JSON.

    python benchmarks/serving/determinism.py ARTIFACT_DIR --out determinism.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import threading

import torch

from c2w import runtime
from c2w.runtime.model.weights import load_model
from c2w.runtime.units import SPECS, EagerRunner, rel_l2


class Recorder:
    """Records the mel of one stream, told apart by its speaker embedding, from each CFM call."""

    def __init__(self, runner, spk: torch.Tensor):
        self.runner, self.spk, self.mels = runner, spk.reshape(-1).float(), []

    def run(self, key, inputs, trim=None):
        out = self.runner.run(key, inputs, trim)
        if key.component == "cfm":
            rows = (inputs[1].float().cpu() == self.spk).all(dim=1).nonzero()
            if len(rows):
                self.mels.append(out[0][int(rows[0])].float().cpu())
        return out


def inputs(cfg, P: int, seed: int, chunks: int = 5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (1, P // 2), generator=g), torch.randn(1, P, 80, generator=g),
            torch.randn(1, 192, generator=g), [torch.randint(0, cfg.vocab_size, (1, 28), generator=g)
                                               for _ in range(chunks)])


def sequential(rt, ins):
    rec = Recorder(rt.driver.runner, ins[2])
    drv = dataclasses.replace(rt.driver, runner=rec, _window={})
    st = drv.setup(*ins[:3])
    pcm = [drv.step(st, t)[0].float().cpu() for t in ins[3]]
    return pcm, rec.mels


def served(rt, ins, companions: int):
    """The session through the server, with `companions` other streams at the same positions."""
    cfg = rt.model.cfg
    others = [inputs(cfg, ins[1].shape[1], 100 + i, len(ins[3])) for i in range(companions)]
    rec = Recorder(rt.cache, ins[2])
    rt.driver.runner = rec
    try:
        with rt.serve(max_streams=companions + 1, max_wait_ms=1000) as srv:
            hs = [srv.open_stream(*x[:3]) for x in [ins] + others]
            for h in hs:
                h.ready.result()
            pcm = []
            for j in range(len(ins[3])):
                futs = srv.submit_many([(h, x[3][j], False) for h, x in zip(hs, [ins] + others)])
                pcm.append(futs[0].result())
                [f.result() for f in futs]
            calls = srv.stats()["calls"]
    finally:
        rt.driver.runner = rt.cache
    return pcm, rec.mels, calls


def compare(ref, got) -> dict:
    pcm = [rel_l2(a, b) for a, b in zip(got[0], ref[0])]
    mel = [rel_l2(a, b) for a, b in zip(got[1], ref[1])]
    return {"pcm_rel_l2": pcm, "mel_rel_l2": mel, "pcm_max": max(pcm), "mel_max": max(mel)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts")
    ap.add_argument("--out", default="determinism.json")
    ap.add_argument("--model", help="model spec, for a directory without a manifest (everything eager)")
    ap.add_argument("--device", help="cpu or cuda (default: the manifest's)")
    args = ap.parse_args()
    rt = runtime.load(args.artifacts, model=args.model, device=args.device)
    cfg, P = rt.model.cfg, int(rt.schedule.get("prompt_frames", 300))
    ins = inputs(cfg, P, 0)
    ref = sequential(rt, ins)
    rows = {"sequential again": compare(ref, sequential(rt, ins))}
    results = [None] * 4

    def worker(i):
        results[i] = sequential(rt, ins)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for i, r in enumerate(results):
        rows[f"thread {i} of 4"] = compare(ref, r)
    alone = served(rt, ins, 0)
    rows["server, alone"] = {**compare(ref, alone[:2]), "calls": alone[2]}
    batched = served(rt, ins, 7)
    rows["server, batched with 7"] = {**compare(ref, batched[:2]), "calls": batched[2]}
    # the HiFT engine on identical inputs, twice
    key = next((k for k in rt.cache.keys if k.component == "hift" and k.dims[0] == 1 and k.dims[2]), None)
    if key is not None:
        x = SPECS["hift"].example_inputs(cfg, key, device=rt.driver._device())
        a, b = (rt.cache.run(key, x)[0].float().cpu() for _ in range(2))
        rows[f"{key.id} twice"] = {"pcm_max": rel_l2(a, b), "mel_max": None}
        torch.backends.cudnn.deterministic = True          # deterministic cuDNN algorithms only
        a, b = (rt.cache.run(key, x)[0].float().cpu() for _ in range(2))
        torch.backends.cudnn.deterministic = False
        rows[f"{key.id} twice, cudnn.deterministic"] = {"pcm_max": rel_l2(a, b), "mel_max": None}
    # fidelity: the session alone and batched, each against the float32 model run eagerly
    m32 = load_model(rt.model.source)
    m32.to(rt.driver._device(), {c: torch.float32 for c in SPECS})
    fp32 = sequential(runtime.Runtime(m32, EagerRunner(m32)), ins)
    for name, got in (("alone vs float32 eager", ref), ("batched with 7 vs float32 eager", batched[:2])):
        rows[name] = compare(fp32, got)
    print(f"{'mode':34s} {'mel max rel-L2':>15s} {'PCM max rel-L2':>15s}")
    for name, r in rows.items():
        mel = "-" if r["mel_max"] is None else f"{r['mel_max']:.1e}"
        print(f"{name:34s} {mel:>15s} {r['pcm_max']:>15.1e}")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "torch": torch.__version__, "rows": rows}, f, indent=1)
    rt.release()


if __name__ == "__main__":
    main()
