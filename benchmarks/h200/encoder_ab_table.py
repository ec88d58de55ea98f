"""The summary table of one encoder_ab.sh call: every key, every tree, against the tree "main".

Reads the encoder_profile_*.json files that encoder_profile.py wrote into one folder and prints one
row per (key, tag): the engine under its CUDA graph (served ms), eager under one CUDA graph, their
ratio, the kernel count and kernel time of one graph-free call, the output's rel-L2 against the
float32 model, and the served time's change against main's at the same key.

Usage: python3 benchmarks/h200/encoder_ab_table.py /tmp/encoder_ab
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HEADER = ("key", "tag", "served ms", "eager+graph ms", "x eager+graph", "kernels", "kernel ms",
          "rel-L2 vs fp32", "vs main")


def load(folder: Path) -> list[dict]:
    rows = [json.loads(f.read_text()) for f in sorted(folder.glob("encoder_profile_*.json"))]
    if not rows:
        raise SystemExit(f"no encoder_profile_*.json in {folder}: run encoder_ab.sh (or encoder_profile.py "
                         "--out there) first")
    return rows


def tree(result: dict) -> str:
    """The tree a result came from: its tag, "main" for the untagged one."""
    return result["tag"] or "main"


def table(results: list[dict]) -> list[tuple[str, ...]]:
    """One row per result, sorted by key (B, N, C) and then with main first."""
    served = {(r["B"], r["N"], r["C"], tree(r)): r["engine_graph"]["median_ms"] for r in results}
    out = []
    for r in sorted(results, key=lambda r: (r["B"], r["N"], r["C"], tree(r) != "main", r["tag"])):
        tag, ms, eg = tree(r), r["engine_graph"]["median_ms"], r["eager_graph"]["median_ms"]
        base = served.get((r["B"], r["N"], r["C"], "main"))
        change = "" if tag == "main" or base is None else f"{100 * (ms / base - 1):+.1f} %"
        p = r.get("profile", {})
        out.append((f"B={r['B']} N={r['N']} C={r['C']}", tag, f"{ms:.3f}", f"{eg:.3f}", f"{eg / ms:.2f}x",
                    str(p.get("kernels_per_solve", "")), f"{p['kernel_ms_per_solve']:.3f}" if p else "",
                    f"{r['rel_l2_vs_fp32']['engine']:.2e}", change))
    return out


def render(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(c) for c in col) for col in zip(HEADER, *rows)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [HEADER, *rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="where encoder_profile.py wrote its JSON (encoder_ab.sh: /tmp/encoder_ab)")
    print(render(table(load(ap.parse_args().folder))))


if __name__ == "__main__":
    main()
