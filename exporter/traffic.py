"""Traffic-weighted selection: which keys a deployment's sessions hit, how often, and what an
engine saves per call, so that the budget goes to the keys that save the most time per byte.

A profile's `traffic` section (exporter.profile.Traffic, docs/profiles.md) gives the mix of
sessions: batch size, chunk size, number of non-final chunks, final-chunk size. Each session sets
up its prompt once, then calls the three units once per chunk (exporter.sessions walks it). Per
key: expected calls per session (probability-weighted over the mix) x expected milliseconds an
engine saves per call (eager minus engine) = the key's value.

Timings per key: measured, from the calibration file `c2w bench` writes, for the keys it holds;
for the other keys of a component it measured, a straight line in the key's FLOPs
(exporter.flops) fitted to that component's measured keys; for a component it lacks, or without a
calibration, the timing model: eager ms = FLOPs / eager_tflops, engine ms = eager / engine_speedup.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from c2w.exporter.flops import unit_flops
from c2w.exporter.profile import EAGER_TFLOPS
from c2w.exporter.sessions import chunk_keys, setup_keys, tail_keys
from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.config import ModelConfig
from c2w.runtime.units import ShapeKey

CALIBRATION_FORMAT = "c2w-calibration/1"
UNKNOWN_TAIL_CALLS = 3       # a final chunk of unknown size: encoder, CFM and HiFT, all eager


@dataclass(frozen=True)
class KeyTiming:
    eager_ms: float
    engine_ms: float
    source: str                  # measured | fitted | model

    @property
    def saved_ms(self) -> float:
        return self.eager_ms - self.engine_ms


@dataclass(frozen=True)
class Prediction:
    hit_rate: float              # share of the session's unit calls an engine serves
    saved_ms_per_session: float  # expected eager minus engine time, summed over a session's calls
    calls_per_session: float     # expected unit calls of a session, hits and misses


@dataclass
class Usage:
    """What the traffic does with the plan's keys: calls per session and timing of each."""
    calls: dict[ShapeKey, float]          # every key the sessions hit, planned or not
    total_calls: float                    # per session, including final chunks of unknown size
    timings: dict[ShapeKey, KeyTiming]    # the planned keys
    timing_source: str                    # one line: where the timings come from

    def value(self, key: ShapeKey) -> float:
        """Expected ms an engine for `key` saves per session (0 when it would not save)."""
        return self.calls.get(key, 0.0) * max(self.timings[key].saved_ms, 0.0)

    def predict(self, selected: list[ShapeKey]) -> Prediction:
        hits = sum(self.calls.get(k, 0.0) for k in selected)
        saved = sum(self.calls.get(k, 0.0) * self.timings[k].saved_ms for k in selected)
        return Prediction(hits / self.total_calls, saved, self.total_calls)


def session_calls(cfg: ModelConfig, profile) -> tuple[dict[ShapeKey, float], float]:
    """Expected calls per session of every key the traffic hits, and expected unit calls per
    session in all (a final chunk of unknown size counts as UNKNOWN_TAIL_CALLS eager calls)."""
    tr = profile.traffic
    calls: dict[ShapeKey, float] = {}
    total = 0.0

    def add(keys: list[ShapeKey], weight: float) -> None:
        nonlocal total
        for k in keys:
            calls[k] = calls.get(k, 0.0) + weight
        total += weight * len(keys)

    for B, pb in tr.batch_sizes:
        for N, pn in tr.chunk_tokens:
            for n, ps in tr.session_chunks:
                w = pb * pn * ps
                if w == 0:
                    continue
                add(setup_keys(cfg, profile, B), w)
                chunks, C, L = chunk_keys(cfg, profile, B, N, n)
                for keys in chunks:
                    add(keys, w)
                for t, pt in tr.tail_tokens:
                    add(tail_keys(cfg, profile, B, t, C, L), w * pt)
                if not tr.tail_tokens:
                    total += w * UNKNOWN_TAIL_CALLS
    return calls, total


# ---- timings ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Calibration:
    source: str
    device: str
    measured: dict[ShapeKey, tuple[float, float]]     # key -> (eager ms, engine ms)


def load_calibration(path: str | Path, profile, cfg: ModelConfig) -> Calibration:
    """Read a calibration file and check it was measured for this profile's device type, backend,
    precision and model size (timings of another set-up would rank keys wrongly)."""
    where = f"calibration '{path}'"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise C2WUserError(where, f"an unreadable file ({e})", "the JSON that c2w bench writes") from None
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise C2WUserError(where, f"format {got!r}", f"format {CALIBRATION_FORMAT!r}",
                           "Write it with c2w bench (calibration.json beside bench.json).")
    device = str(data.get("device", ""))
    want = {"device type": ("cpu" if profile.device == "cpu" else "cuda",
                            "cpu" if device == "cpu" else "cuda"),
            "backend": (profile.backend, (data.get("backend") or {}).get("name")),
            "precision": (dataclasses.asdict(profile.precision), data.get("precision")),
            "model config": (cfg.name, (data.get("model") or {}).get("config"))}
    for what, (expected, got) in want.items():
        if expected != got:
            raise C2WUserError(f"{where} {what}", repr(got), f"{expected!r}, the profile's",
                               "Calibrate with artifacts exported from this profile (c2w bench DIR).")
    measured = {}
    for i, row in enumerate(data.get("keys") or []):
        at = f"{where} keys[{i}]"
        if not isinstance(row, dict) or not isinstance(row.get("key"), dict):
            raise C2WUserError(at, repr(row)[:120], "a mapping {key: {...}, eager_ms, engine_ms}")
        key = ShapeKey.from_dict(row["key"])
        ms = tuple(row.get(f) for f in ("eager_ms", "engine_ms"))
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in ms):
            raise C2WUserError(at, f"eager_ms {ms[0]!r}, engine_ms {ms[1]!r}", "positive milliseconds")
        measured[key] = (float(ms[0]), float(ms[1]))
    if not measured:
        raise C2WUserError(where, "no timed keys", "at least one key's eager and engine times",
                           "Re-run c2w bench; a key whose engine failed to run is left out of the file.")
    return Calibration(str(path), device, measured)


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) >= 0 of y over x: least squares, else flat if y falls with x, else
    through the origin if the intercept would be negative (or fewer than two distinct x)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx > 0:
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx
        if slope < 0:
            return my, 0.0
        if my - slope * mx >= 0:
            return my - slope * mx, slope
    return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)


def key_timings(cfg: ModelConfig, keys: list[ShapeKey], profile) -> tuple[dict[ShapeKey, KeyTiming], str]:
    """Eager and engine ms per key (see the module docstring), and one line naming the source."""
    tr = profile.traffic
    tflops = tr.eager_tflops or EAGER_TFLOPS["cpu" if profile.device == "cpu" else "cuda"]
    model = (f"timing model: eager at {tflops:g} TFLOP/s of the key's FLOPs, engines {tr.engine_speedup:g}x "
             "faster")
    cal = load_calibration(tr.calibration, profile, cfg) if tr.calibration else None
    lines: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {}
    if cal is not None:
        for comp in {k.component for k in cal.measured}:
            pts = [(unit_flops(cfg, k), ms) for k, ms in cal.measured.items() if k.component == comp]
            lines[comp] = (_line([(f, e) for f, (e, _) in pts]), _line([(f, g) for f, (_, g) in pts]))
    out = {}
    for k in keys:
        flops = unit_flops(cfg, k)
        if cal is not None and k in cal.measured:
            out[k] = KeyTiming(*cal.measured[k], "measured")
        elif k.component in lines:
            (a, b), (c, d) = lines[k.component]
            out[k] = KeyTiming(a + b * flops, c + d * flops, "fitted")
        else:
            eager = flops / (tflops * 1e12) * 1e3
            out[k] = KeyTiming(eager, eager / tr.engine_speedup, "model")
    if cal is None:
        return out, model + " (no calibration file)"
    missing = sorted({k.component for k in keys} - set(lines))
    n = sum(t.source == "measured" for t in out.values())
    return out, (f"calibration {cal.source} ({cal.device}): {n} keys measured, the rest fitted per component "
                 "(a line in FLOPs)" + (f"; {', '.join(missing)}: {model}" if missing else ""))


def usage(cfg: ModelConfig, profile, keys: list[ShapeKey]) -> Usage:
    calls, total = session_calls(cfg, profile)
    timings, source = key_timings(cfg, keys, profile)
    return Usage(calls, total, timings, source)


# ---- ranking ------------------------------------------------------------------------------------

def rank_keys(keys: list[ShapeKey], value, cost: dict[ShapeKey, int], weights: dict[str, int],
              shares_weights: bool = True) -> list[ShapeKey]:
    """`keys` (in priority order, which breaks ties) ordered by value per byte, greedily.

    value(key): ms saved per session; cost: the key's own bytes. A component's weights are paid
    by its first key only (shares_weights), so a component not yet ranked is judged by the best
    value per byte of a prefix of its keys with the weights included (a component whose weights
    dwarf any one key still wins if its keys together are worth them); once it is in, each of
    its keys by its own value per byte."""
    pos = {k: i for i, k in enumerate(keys)}
    remaining, charged, out = list(keys), set(), []
    while remaining:
        best = None
        for comp in dict.fromkeys(k.component for k in remaining):
            own = 0 if shares_weights else weights[comp]
            ks = sorted((k for k in remaining if k.component == comp),
                        key=lambda k: (-value(k) / max(cost[k] + own, 1), pos[k]))
            if shares_weights and comp not in charged:
                v = b = 0
                ratio = 0.0
                for k in ks:
                    v, b = v + value(k), b + cost[k]
                    ratio = max(ratio, v / max(weights[comp] + b, 1))
            else:
                ratio = value(ks[0]) / max(cost[ks[0]] + own, 1)
            cand = (ratio, -pos[ks[0]])
            if best is None or cand > best[0]:
                best = (cand, ks[0])
        out.append(best[1])
        remaining.remove(best[1])
        charged.add(best[1].component)
    return out
