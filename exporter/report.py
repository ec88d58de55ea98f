"""`c2w report`: the shape-budget picture of an artifact directory (table, markdown, json, plot).

Per key: status, artifact, estimated and measured bytes, build time, parity. Then where the budget
goes: per component (its eager weights once, the engine state its keys share once, its kept keys'
measured bytes, their estimate) and per batch size, next to the budget, with the directory's
total as measured in a fresh process (docs/budget.md). An overrun is flagged on its own line.
"""
from __future__ import annotations

import json
from pathlib import Path

from c2w.exporter.budget import mib, recorded_ledger
from c2w.runtime.atomic import atomic_output
from c2w.runtime.errors import MissingBackendError
from c2w.runtime.manifest import FailedMeasurement, Manifest, Measurement, Status

FORMATS = ("table", "markdown", "json")


def _parity(e) -> str:
    if e.parity is None:
        return "-"
    worst = max(e.parity.rel_l2.values(), default=float("nan"))
    return f"{worst:.1e} {'ok' if e.parity.passed else 'FAIL'}"


def breakdown(m: Manifest) -> dict:
    """Where the budget goes: {"by_component": {c: {...}}, "by_batch": {B: {...}}} over kept keys."""
    kept = [e for e in m.entries if e.status == Status.BUILT]
    comps: dict[str, dict] = {}
    for c in m.weight_bytes:
        mine = [e for e in kept if e.component == c]
        comps[c] = {"keys": len(mine), "weight_bytes": m.weight_bytes[c] if mine else 0,
                    "engine_shared_bytes": m.engine_shared_bytes.get(c, 0) if mine else 0,
                    "measured_key_bytes": sum(e.device_bytes or 0 for e in mine),
                    "estimated_key_bytes": sum(e.est_bytes for e in mine),
                    "not_kept": sum(e.component == c and e.status != Status.BUILT for e in m.entries)}
        comps[c]["total_bytes"] = sum(comps[c][k] for k in ("weight_bytes", "engine_shared_bytes", "measured_key_bytes"))
    batches: dict[int, dict] = {}
    for e in kept:
        b = batches.setdefault(int(e.dims["B"]), {"keys": 0, "measured_key_bytes": 0, "estimated_key_bytes": 0,
                                                   "measured_by_component": {}})
        b["keys"] += 1
        b["measured_key_bytes"] += e.device_bytes or 0
        b["estimated_key_bytes"] += e.est_bytes
        b["measured_by_component"][e.component] = b["measured_by_component"].get(e.component, 0) + (e.device_bytes or 0)
    return {"by_component": comps, "by_batch": dict(sorted(batches.items()))}


def summary(m: Manifest) -> dict:
    ledger, unmeasured = recorded_ledger(m)
    comps = ledger.components()
    weights = sum(m.weight_bytes.get(c, 0) for c in comps)
    shared = sum(m.engine_shared_bytes.get(c, 0) for c in comps)
    measured = sum(n for _, n in ledger.kept.values())
    counts: dict[str, int] = {}
    for e in m.entries:
        counts[str(e.status)] = counts.get(str(e.status), 0) + 1
    total = weights + shared + measured
    directory = m.measured.total_bytes if isinstance(m.measured, Measurement) else None
    overruns = []
    if total > m.budget_bytes:
        overruns.append(f"the kept keys as measured add up to {mib(total)} MiB")
    if directory is not None and directory > m.budget_bytes:
        overruns.append(f"the directory measured {mib(directory)} MiB in a fresh process")
    return {"budget_bytes": m.budget_bytes, "weight_bytes": weights, "engine_shared_bytes": shared,
            "measured_key_bytes": measured, "estimated_key_bytes": sum(e.est_bytes for e in m.entries
                                                                       if e.status == Status.BUILT),
            "total_bytes": total, "unmeasured_keys": unmeasured,
            "directory_measured": {} if m.measured is None else m.measured.to_dict(),     # as in the manifest
            "over_budget": overruns, **breakdown(m),
            "counts": counts, "build_seconds": round(sum(e.build_seconds for e in m.entries), 1),
            "build_phases": build_phases(m)}


def build_phases(m: Manifest) -> dict:
    """Seconds per build phase summed over the keys that recorded them (an AOTI key: export,
    compile, verify; keys built by an older c2w record none)."""
    out: dict[str, float] = {}
    for e in m.entries:
        for phase, s in (e.extra or {}).get("build_phases", {}).items():
            out[phase] = round(out.get(phase, 0.0) + s, 1)
    return out


def rows(m: Manifest) -> list[list[str]]:
    out = []
    for e in sorted(m.entries, key=lambda e: (e.component, e.status != Status.BUILT, e.id)):
        dims = " ".join(f"{k}={v}" for k, v in e.dims.items())
        out.append([e.component, dims, e.dtype, e.category, str(e.status), mib(e.artifact_bytes),
                    mib(e.est_bytes), mib(e.device_bytes), f"{e.build_seconds:.1f}", _parity(e),
                    (e.error or "")[:60]])
    return out


HEADER = ["component", "key", "dtype", "category", "status", "artifact MiB", "est MiB", "measured MiB",
          "build s", "parity (worst rel-L2)", "error"]
BUDGET_HEADER = ["where the budget goes", "keys", "weights MiB", "engine state MiB", "keys measured MiB",
                 "keys estimated MiB", "total MiB"]


def budget_rows(s: dict) -> list[list[str]]:
    """Per component, the recorded total, per batch size (keys only: weights are per component)."""
    out = []
    for c, v in s["by_component"].items():
        note = f" ({v['not_kept']} not kept)" if v["not_kept"] else ""
        out.append([f"component {c}{note}", str(v["keys"]), mib(v["weight_bytes"]), mib(v["engine_shared_bytes"]),
                    mib(v["measured_key_bytes"]), mib(v["estimated_key_bytes"]), mib(v["total_bytes"])])
    n = sum(v["keys"] for v in s["by_component"].values())
    out.append(["all components", str(n), mib(s["weight_bytes"]), mib(s["engine_shared_bytes"]),
                mib(s["measured_key_bytes"]), mib(s["estimated_key_bytes"]), mib(s["total_bytes"])])
    for b, v in s["by_batch"].items():
        out.append([f"batch size {b}", str(v["keys"]), "", "", mib(v["measured_key_bytes"]),
                    mib(v["estimated_key_bytes"]), ""])
    return out


def _totals(m: Manifest, s: dict) -> list[str]:
    lines = []
    d = m.measured
    if isinstance(d, Measurement):
        lines.append(f"budget {mib(s['budget_bytes'])} MiB; the directory measured together in a fresh process: "
                     f"{mib(d.total_bytes)} MiB ({d.keys} keys, {d.kind}"
                     + ("" if d.load_seconds is None else f"; {d.load_seconds:.0f} s to load and first run them")
                     + ")")
    elif isinstance(d, FailedMeasurement):
        lines.append(f"budget {mib(s['budget_bytes'])} MiB; the directory could not be measured: {d.error[:200]}")
    else:
        lines.append(f"budget {mib(s['budget_bytes'])} MiB; the directory has not been measured together in a fresh "
                     "process (merged from shards, or exported by an older c2w): c2w verify measures it")
    if s["unmeasured_keys"]:
        lines.append(f"{len(s['unmeasured_keys'])} built keys have no measurement (a --measure-at-merge shard's, "
                     "which c2w merge measures, or an older c2w's)")
    phases = ", ".join(f"{k} {v}" for k, v in s["build_phases"].items())
    lines.append(", ".join(f"{v} {k}" for k, v in sorted(s["counts"].items())) + f"; build {s['build_seconds']} s"
                 + (f" ({phases})" if phases else ""))
    pending = s["counts"].get(Status.PENDING, 0)
    if pending:
        planned = sum(n for k, n in s["counts"].items() if k != Status.SKIPPED_BUDGET)
        lines.append(f"{pending} of {planned} planned keys are pending (an interrupted export, or another "
                     "shard's keys): re-run the same c2w export to build them")
    if s["over_budget"]:
        lines.append(f"OVER BUDGET ({mib(s['budget_bytes'])} MiB): " + "; ".join(s["over_budget"])
                     + ". Re-run c2w export into this directory to keep only what fits, or raise budget_bytes.")
    return lines


def render(m: Manifest, fmt: str = "table") -> str:
    s = summary(m)
    if fmt == "json":
        return json.dumps({"manifest": json.loads(m.to_json()), "summary": s}, indent=1)
    head = (f"profile {m.profile.name}  backend {m.backend.name} {m.backend.version}  device {m.device}  "
            f"model {m.model.spec} ({m.model.digest})")
    tot = _totals(m, s)
    if fmt == "markdown":
        lines = [f"**{head}**", ""] + _md_table(HEADER, rows(m)) + [""] + _md_table(BUDGET_HEADER, budget_rows(s))
        return "\n".join(lines + [""] + [f"**{t}**" if t.startswith("OVER BUDGET") else t for t in tot])
    return "\n".join([head, *_text_table(HEADER, rows(m)), "", *_text_table(BUDGET_HEADER, budget_rows(s)), *tot])


def _md_table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in body]


def _text_table(header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(header)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *body]]


def plot(m: Manifest, path: Path) -> Path:
    """Two panels against the budget: per component (weights once, engine state once, measured
    keys; an outline for the keys' estimate) with a last bar for the whole directory, and per
    batch size (the kept keys' measured bytes by component; an outline for their estimate)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingBackendError("--plot", "matplotlib", "pip install matplotlib (or the c2w[plot] extra)") from e
    s = summary(m)
    comps = list(s["by_component"])
    colour = {c: f"C{i}" for i, c in enumerate(comps)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [len(comps) + 1, 2]})
    for i, c in enumerate(comps):
        v, bottom = s["by_component"][c], 0.0
        for part, style in (("weight_bytes", {"color": "0.6"}), ("engine_shared_bytes", {"color": "0.85"}),
                            ("measured_key_bytes", {"color": colour[c]})):
            h = v[part] / 2**20
            left.bar(i, h, bottom=bottom, edgecolor="k", linewidth=0.3, **style,
                     label={"weight_bytes": "weights (once)", "engine_shared_bytes": "engine state (once)"}.get(part)
                     if i == 0 else None)
            bottom += h
        est = (v["weight_bytes"] + v["engine_shared_bytes"] + v["estimated_key_bytes"]) / 2**20
        left.bar(i, est, fill=False, edgecolor="k", linestyle=":", label="keys estimated" if i == 0 else None)
    bottom = 0.0
    for c in comps:                  # the budget covers the whole directory: a last bar stacks every component
        h = s["by_component"][c]["total_bytes"] / 2**20
        left.bar(len(comps), h, bottom=bottom, color=colour[c], edgecolor="k", linewidth=0.3)
        bottom += h
    if isinstance(m.measured, Measurement):
        left.plot([len(comps) - 0.4, len(comps) + 0.4], [m.measured.total_bytes / 2**20] * 2,
                  color="k", label="measured in a fresh process")
    left.axhline(m.budget_bytes / 2**20, color="r", linestyle="--", label="budget (whole directory)")
    left.set_xticks(range(len(comps) + 1), comps + ["directory"])
    left.set_ylabel("MiB")
    left.set_title("per component" + ("  OVER BUDGET" if s["over_budget"] else ""), color="r" if s["over_budget"] else "k")
    left.legend(fontsize=7)
    batches, labelled = list(s["by_batch"]), set()
    for i, b in enumerate(batches):
        v, bottom = s["by_batch"][b], 0.0
        for c in comps:
            h = v["measured_by_component"].get(c, 0) / 2**20
            right.bar(i, h, bottom=bottom, color=colour[c], edgecolor="k", linewidth=0.3,
                      label=c if h and c not in labelled else None)
            labelled |= {c} if h else set()
            bottom += h
        right.bar(i, v["estimated_key_bytes"] / 2**20, fill=False, edgecolor="k", linestyle=":")
    right.set_xticks(range(len(batches)), [f"B={b}" for b in batches])
    right.set_title("kept keys per batch size (measured)")
    if batches:
        right.legend(fontsize=7)
    fig.suptitle(f"{m.profile.name} / {m.backend.name}: where the budget goes")
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return Path(path)
