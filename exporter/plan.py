"""Sweep planning: the exact ShapeKeys a profile's streams hit, their byte estimates, the budget cut.

The keys come from exporter.sessions (the schedule's streams), their bytes from exporter.estimate:
each key is estimated next to the keys selected before it in the plan's order (on CUDA, AOTInductor
keys share one graph pool, so what a key adds depends on them). The budget is filled in one order:
without a `traffic` section, the profile's priority (categories, then small batches first); with
one, expected milliseconds saved per byte under that traffic (exporter.traffic), and the plan
carries the predicted engine hit rate and saved time, next to what the priority order would give.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from c2w.exporter import traffic
from c2w.exporter.estimate import FixedSizes, GraphPoolSizes, estimate_bytes, key_sizes
from c2w.exporter.sessions import stream_keys  # noqa: F401  (the planner's keys; callers import it from here)
from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.config import ModelConfig
from c2w.runtime.units import DTYPES, SPECS, ShapeKey
from c2w.runtime.verify import distinct_memory


@dataclass(frozen=True)
class PlannedKey:
    key: ShapeKey
    category: str                 # first | steady | setup | tail | extra
    est_bytes: int                # device bytes it adds next to the selected keys before it (weights excluded)
    selected: bool = False
    calls_per_session: float | None = None    # with traffic: expected calls of this key per session
    saved_ms_per_call: float | None = None    # with traffic: eager minus engine ms


@dataclass
class Plan:
    entries: list[PlannedKey]
    weight_bytes: dict[str, int]          # per component, counted once
    budget_bytes: int
    shares_weights: bool
    notes: list[str] = field(default_factory=list)
    prediction: traffic.Prediction | None = None   # with traffic: of this plan's selection
    baseline: traffic.Prediction | None = None     # with traffic: of the priority order's selection
    timing_source: str = ""                        # with traffic: where the per-key timings come from

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


def weight_bytes(model, dtypes: dict[str, str] | None = None) -> dict[str, int]:
    """Bytes of each component's weights, counted once. dtypes: component -> its policy's dtype
    name, which the floating-point tensors of its precision modules take (Code2Wav.precision_modules;
    HiFT's other tensors stay float32); default: every tensor as it is now."""
    out = {}
    for comp, mods in model.component_modules().items():
        size = DTYPES[dtypes[comp]].itemsize if dtypes else None
        cast = {id(t) for m in model.precision_modules(comp) for t in list(m.parameters()) + list(m.buffers())}
        # memory shared by views counts once (the DiT's q/k/v parameters are views of its packed buffers)
        tensors = (t for m in mods for t in list(m.parameters()) + list(m.buffers()))
        out[comp] = sum(n * (size if size and id(t) in cast and t.is_floating_point() else t.element_size())
                        for t, n in distinct_memory(tensors))
    return out


def _fill(ordered: list[ShapeKey], sizes: GraphPoolSizes | FixedSizes, weights: dict[str, int], budget: int,
          shares_weights: bool) -> tuple[dict[ShapeKey, bool], dict[ShapeKey, int]]:
    """Select keys in `ordered` order while they fit; a component's weights count with its first key.

    sizes: a fresh load (exporter.estimate.key_sizes): each key is estimated next to the keys selected
    before it, and only a selected key joins the load. -> (selected?, estimate) per key."""
    chosen, est, used, charged = {}, {}, 0, set()
    for key in ordered:
        w = 0 if (shares_weights and key.component in charged) else weights[key.component]
        est[key] = sizes.cost(key)
        chosen[key] = used + w + est[key] <= budget
        if chosen[key]:
            used += w + sizes.add(key)
            charged.add(key.component)
    return chosen, est


def make_plan(cfg: ModelConfig, profile, weights: dict[str, int], shares_weights: bool = True) -> Plan:
    """Order keys (by priority, or by traffic when the profile declares it) and select within budget.

    weights: per-component weight bytes at the profile's precision (see weight_bytes).
    """
    first_cat: dict[ShapeKey, str] = {}
    keys = stream_keys(cfg, profile)
    listed = {c: i for i, c in enumerate(profile.priority)}
    rank = {cat: listed.get(cat, len(listed)) for cat, _ in keys}     # unlisted categories last
    for cat, key in keys:
        if key not in first_cat or rank[cat] < rank[first_cat[key]]:
            first_cat[key] = cat
    by_priority = sorted(first_cat, key=lambda k: (rank[first_cat[k]], k.dim("B"), k.component, k.dims))

    def fill(ordered: list[ShapeKey]) -> tuple[dict[ShapeKey, bool], dict[ShapeKey, int]]:
        sizes = key_sizes(cfg, ordered, profile.backend, profile.device, weights)
        return _fill(ordered, sizes, weights, profile.budget_bytes, shares_weights)

    if profile.traffic is None:
        chosen, est = fill(by_priority)
        plan = Plan([PlannedKey(k, first_cat[k], est[k], chosen[k]) for k in by_priority], weights,
                    profile.budget_bytes, shares_weights)
    else:
        use = traffic.usage(cfg, profile, by_priority)
        # ranked by each key's bytes on its own (the load order is what the ranking decides)
        alone = {k: estimate_bytes(cfg, k, profile.backend, profile.device, weights) for k in by_priority}
        ordered = traffic.rank_keys(by_priority, use.value, alone, weights, shares_weights)
        chosen, est = fill(ordered)
        plan = Plan([PlannedKey(k, first_cat[k], est[k], chosen[k], use.calls.get(k, 0.0), use.timings[k].saved_ms)
                     for k in ordered], weights, profile.budget_bytes, shares_weights, timing_source=use.timing_source)
        plan.prediction = use.predict([k for k in ordered if chosen[k]])
        old, _ = fill(by_priority)
        plan.baseline = use.predict([k for k in by_priority if old[k]])
    entries = plan.entries
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

