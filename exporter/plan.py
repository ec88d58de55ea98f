"""Sweep planning: the exact ShapeKeys a profile's streams hit, their byte estimates, the budget cut.

The schedule is simulated the way runtime.stream drives a stream: prompt P frames, then chunks of
N tokens (2 (N - 3) mel frames each); the estimator cache goes P -> P+T -> ... and is trimmed to
P + 100 (the conformer cache too when `trim_conformer`); HiFT sees T frames with no cache first,
then T + 8 frames with the 3840-sample source cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.errors import C2WUserError
from runtime.model.config import ModelConfig
from runtime.stream import KEEP_RECENT
from runtime.units import DTYPES, SPECS, ShapeKey, tensor_bytes



@dataclass(frozen=True)
class PlannedKey:
    key: ShapeKey
    category: str                 # first | steady | setup | tail | extra
    est_bytes: int                # per-key device bytes (I/O + workspace), weights excluded
    selected: bool = False


@dataclass
class Plan:
    entries: list[PlannedKey]
    weight_bytes: dict[str, int]          # per component, counted once
    budget_bytes: int
    shares_weights: bool
    notes: list[str] = field(default_factory=list)

    @property
    def selected(self) -> list[PlannedKey]:
        return [e for e in self.entries if e.selected]

    @property
    def skipped(self) -> list[PlannedKey]:
        return [e for e in self.entries if not e.selected]

    def planned_total(self) -> int:
        comps = {e.key.component for e in self.selected}
        weights = sum(self.weight_bytes[c] for c in comps) if self.shares_weights else \
            sum(self.weight_bytes[e.key.component] for e in self.selected)
        return weights + sum(e.est_bytes for e in self.selected)


def _trim(n: int, prompt: int) -> int:
    return n if n <= prompt + KEEP_RECENT else prompt + KEEP_RECENT


def stream_keys(cfg: ModelConfig, profile) -> list[tuple[str, ShapeKey]]:
    """(category, key) for every chunk of every (batch, chunk size) stream, in stream order."""
    s, prec = profile.schedule, profile.precision
    hift_cache = cfg.hift_source_cache
    out = []
    for B in s.batch_sizes:
        if s.setup_keys:           # the prompt set-up: P/2 tokens + 3 lookahead, empty caches
            P = s.prompt_frames
            out.append(("setup", ShapeKey("flow_encoder", (B, P // cfg.up_rate + cfg.encoder.pre_lookahead, 0, 0),
                                          prec.flow_encoder)))
            out.append(("setup", ShapeKey("cfm", (B, P, 0), prec.cfm)))
        for N in s.chunk_tokens:
            T = cfg.up_rate * (N - cfg.encoder.pre_lookahead)
            C = L = s.prompt_frames
            for i in range(s.max_chunks):
                cat = "first" if i == 0 else "steady"
                out.append((cat, ShapeKey("flow_encoder", (B, N, C, 0), prec.flow_encoder)))
                out.append((cat, ShapeKey("cfm", (B, T, L), prec.cfm)))
                out.append((cat, ShapeKey("hift", (B, T, 0) if i == 0 else (B, T + cfg.hift_mel_cache, hift_cache),
                                          prec.hift)))
                C = _trim(C + T, s.prompt_frames) if s.trim_conformer else C + T
                L = _trim(L + T, s.prompt_frames)
            for n in s.tail_tokens:        # the final chunk, after the steady state
                Tt = cfg.up_rate * n
                out.append(("tail", ShapeKey("flow_encoder", (B, n, C, 1), prec.flow_encoder)))
                out.append(("tail", ShapeKey("cfm", (B, Tt, L), prec.cfm)))
                out.append(("tail", ShapeKey("hift", (B, Tt + cfg.hift_mel_cache, hift_cache), prec.hift)))
    out += [("extra", k) for k in profile.extra_keys]
    return out


def estimate_bytes(cfg: ModelConfig, key: ShapeKey) -> int:
    """Per-key device bytes, weights excluded: inputs + outputs (about the inputs' size, caches
    grow by T frames) + a workspace as large as the largest input. A planning estimate only:
    the manifest records the measured number after the build."""
    spec = SPECS[key.component]
    sizes = [tensor_bytes(shape, dt) for shape, dt in zip(spec.input_shapes(cfg, key), spec.input_dtypes(key))]
    return 2 * sum(sizes) + max(sizes)


def weight_bytes(model, dtypes: dict[str, str] | None = None) -> dict[str, int]:
    """Bytes of each component's weights, counted once. dtypes: component -> dtype name of its
    floating-point tensors (default: as they are now)."""
    out = {}
    for comp, mods in model.component_modules().items():
        size = DTYPES[dtypes[comp]].itemsize if dtypes else None
        seen, n = set(), 0
        for m in mods:
            for t in list(m.parameters()) + list(m.buffers()):
                if id(t) not in seen:
                    seen.add(id(t))
                    n += t.numel() * (size if size and t.is_floating_point() else t.element_size())
        out[comp] = n
    return out


def make_plan(cfg: ModelConfig, profile, weights: dict[str, int], shares_weights: bool = True) -> Plan:
    """Order keys by the profile's priority (then small batches first) and select within budget.

    weights: per-component weight bytes at the profile's precision (see weight_bytes).
    """
    first_cat: dict[ShapeKey, str] = {}
    keys = stream_keys(cfg, profile)
    listed = {c: i for i, c in enumerate(profile.priority)}
    rank = {cat: listed.get(cat, len(listed)) for cat, _ in keys}     # unlisted categories last
    for cat, key in keys:
        if key not in first_cat or rank[cat] < rank[first_cat[key]]:
            first_cat[key] = cat
    ordered = sorted(first_cat, key=lambda k: (rank[first_cat[k]], k.dims[0], k.component, k.dims))
    entries, used, charged = [], 0, set()
    for key in ordered:
        est = estimate_bytes(cfg, key)
        w = 0 if (shares_weights and key.component in charged) else weights[key.component]
        ok = used + w + est <= profile.budget_bytes
        if ok:
            used += w + est
            charged.add(key.component)
        entries.append(PlannedKey(key, first_cat[key], est, ok))
    plan = Plan(entries, weights, profile.budget_bytes, shares_weights)
    if entries and not any(e.selected for e in entries):
        need = min(entries, key=lambda e: weights[e.key.component] + e.est_bytes)
        plan.notes.append(f"no key fits the budget of {profile.budget_bytes / 2**20:.1f} MiB; the smallest "
                          f"({need.key.id}) needs {(weights[need.key.component] + need.est_bytes) / 2**20:.1f} MiB "
                          "with its component's weights: everything would be served eagerly")
    return plan


def require_selection(plan: Plan, source: str) -> None:
    """An export that would build nothing is an error (the note says what the budget lacks)."""
    if not plan.selected:
        raise C2WUserError(f"profile {source}: 'budget_bytes'", plan.notes[-1] if plan.notes else "no keys",
                           "a budget that fits at least one key", "Raise budget_bytes, or serve eagerly without "
                           "exporting.")


def precision_weights(model, profile) -> dict[str, int]:
    """Weight bytes per component at the profile's dtypes, whatever dtype the model holds now
    (`c2w plan` has the float32 model, the exporter the one already cast to the profile's)."""
    return weight_bytes(model, {c: profile.precision.dtype(c) for c in model.component_modules()})


def dims_str(key: ShapeKey) -> str:
    return " ".join(f"{n}={v}" for n, v in zip(SPECS[key.component].dim_names, key.dims))

