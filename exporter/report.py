"""`c2w report`: the shape-budget picture of an artifact directory (table, markdown, json, plot)."""
from __future__ import annotations

import json
from pathlib import Path

from runtime.atomic import atomic_output
from runtime.errors import MissingBackendError
from runtime.manifest import Manifest, Status

FORMATS = ("table", "markdown", "json")


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _parity(e) -> str:
    if not e.parity:
        return "-"
    worst = max(e.parity["rel_l2"].values()) if e.parity.get("rel_l2") else float("nan")
    return f"{worst:.1e} {'ok' if e.parity.get('passed') else 'FAIL'}"


def summary(m: Manifest) -> dict:
    built = [e for e in m.entries if e.status == Status.BUILT]
    comps = sorted({e.component for e in built})
    measured = sum(e.device_bytes or 0 for e in built)
    weights = sum(m.weight_bytes.get(c, 0) for c in comps)
    counts = {}
    for e in m.entries:
        counts[str(e.status)] = counts.get(str(e.status), 0) + 1
    return {"budget_bytes": m.budget_bytes, "weight_bytes": weights, "measured_key_bytes": measured,
            "estimated_key_bytes": sum(e.est_bytes for e in built), "total_bytes": weights + measured,
            "counts": counts, "build_seconds": round(sum(e.build_seconds for e in m.entries), 1)}


def rows(m: Manifest) -> list[list[str]]:
    out = []
    for e in sorted(m.entries, key=lambda e: (e.component, e.status != Status.BUILT, e.id)):
        dims = " ".join(f"{k}={v}" for k, v in e.dims.items())
        out.append([e.component, dims, e.dtype, e.category, str(e.status), _mib(e.artifact_bytes),
                    _mib(e.est_bytes), _mib(e.device_bytes), f"{e.build_seconds:.1f}", _parity(e),
                    (e.error or "")[:60]])
    return out


HEADER = ["component", "key", "dtype", "category", "status", "artifact MiB", "est MiB", "measured MiB",
          "build s", "parity (worst rel-L2)", "error"]


def render(m: Manifest, fmt: str = "table") -> str:
    s = summary(m)
    if fmt == "json":
        return json.dumps({"manifest": json.loads(m.to_json()), "summary": s}, indent=1)
    head = (f"profile {m.profile['name']}  backend {m.backend['name']} {m.backend['version']}  device {m.device}  "
            f"model {m.model['spec']} ({m.model['digest']})")
    tot = (f"budget {_mib(s['budget_bytes'])} MiB: weights {_mib(s['weight_bytes'])} + keys (measured) "
           f"{_mib(s['measured_key_bytes'])} = {_mib(s['total_bytes'])} MiB; "
           + ", ".join(f"{v} {k}" for k, v in sorted(s["counts"].items()))
           + f"; build {s['build_seconds']} s")
    pending = s["counts"].get(Status.PENDING, 0)
    if pending:
        planned = sum(n for k, n in s["counts"].items() if k != Status.SKIPPED_BUDGET)
        tot += (f"\n{pending} of {planned} planned keys are pending (an interrupted export, or another "
                "shard's keys): re-run the same c2w export to build them")
    if fmt == "markdown":
        lines = [f"**{head}**", "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(r) + " |" for r in rows(m)]
        return "\n".join(lines + ["", tot])
    widths = [max(len(h), *(len(r[i]) for r in rows(m))) if m.entries else len(h) for i, h in enumerate(HEADER)]
    fmt_row = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([head, fmt_row(HEADER), *(fmt_row(r) for r in rows(m)), tot])


def plot(m: Manifest, path: Path) -> Path:
    """Stacked bars: weights once per component, then each built key's measured bytes, vs the budget."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingBackendError("--plot", "matplotlib", "pip install matplotlib (or the c2w[plot] extra)") from e
    built = [e for e in m.entries if e.status == Status.BUILT]
    comps = sorted({e.component for e in built}) or sorted(m.weight_bytes)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, c in enumerate(comps):
        bottom = m.weight_bytes.get(c, 0) / 2**20
        ax.bar(i, bottom, color="0.6", label="weights (once)" if i == 0 else None)
        for e in (e for e in built if e.component == c):
            h = (e.device_bytes or e.est_bytes) / 2**20
            ax.bar(i, h, bottom=bottom, edgecolor="k", linewidth=0.3)
            bottom += h
    # the budget covers the whole directory: a last bar stacks every component's total
    bottom = 0.0
    for i, c in enumerate(comps):
        h = (m.weight_bytes.get(c, 0) + sum((e.device_bytes or e.est_bytes) for e in built if e.component == c)) / 2**20
        ax.bar(len(comps), h, bottom=bottom, color=f"C{i}", edgecolor="k", linewidth=0.3)
        ax.text(len(comps), bottom + h / 2, c, ha="center", va="center", fontsize=7)
        bottom += h
    ax.axhline(m.budget_bytes / 2**20, color="r", linestyle="--", label="budget (whole directory)")
    ax.set_xticks(range(len(comps) + 1), comps + ["total"])
    ax.set_ylabel("MiB")
    ax.set_title(f"{m.profile['name']} / {m.backend['name']}: memory per key (measured)")
    ax.legend()
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return Path(path)
