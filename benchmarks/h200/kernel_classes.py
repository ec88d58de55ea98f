"""Kernel time per class from cfm_profile.py's JSON files: where a solve's GPU time goes, side by side.

cfm_profile.py records each solve's kernel count and time and its 40 most expensive kernel names;
this groups those names into classes (matrix products, attention, cache stacking and copies, fused
Triton kernels) and shows what the top 40 leave out as one more row. One column per file, in the
order given (e.g. the same key before and after a change):

    python benchmarks/h200/kernel_classes.py results/run5_conv/cfm_profile_B32_T150_L400_d2_pertap.json \
        results/run15_gelu_trim/cfm_profile_B32_T150_L400_d2_gelu-epilogue_gelu.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# First match wins: (class, substrings of the kernel name).
CLASSES = (
    ("matrix products (cuBLAS)", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
    # Inductor's Triton GEMM templates (max_autotune), with whatever epilogue it fused into them
    ("matrix products (Triton templates)", ("triton_tem_",)),
    ("attention (cuDNN / flash)", ("sdpa", "flash", "fmha")),
    ("cache stack, copies, memsets", ("stack", "Memcpy", "Memset", "elementwise_kernel", "copy")),
    ("GELU (own kernel)", ("gelu",)),
    ("other Triton (norms, modulation, conv frames, residuals)", ("triton_",)),
)
OTHER = "other named kernels"
REST = "outside the 40 largest names"


def classify(name: str) -> str:
    for cls, keys in CLASSES:
        if any(k in name for k in keys):
            return cls
    return OTHER


def table(paths: list[Path]) -> str:
    cols = []
    for p in paths:
        prof = json.loads(p.read_text())["profile"]
        by: dict[str, list[float]] = {}
        for k in prof["top"]:
            c = by.setdefault(classify(k["name"]), [0, 0.0])
            c[0], c[1] = c[0] + k["count"], c[1] + k["ms"]
        named_n = sum(v[0] for v in by.values())
        named_ms = sum(v[1] for v in by.values())
        by[REST] = [prof["kernels_per_solve"] - named_n, prof["kernel_ms_per_solve"] - named_ms]
        cols.append((p, prof, by))
    rows = [c for c, _ in CLASSES] + [OTHER, REST]
    head = "| kernels per solve: class | " + " | ".join(f"`{p.name}`" for p, _, _ in cols) + " |"
    out = [head, "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        cells = [f"{by[r][0]:.0f} / {by[r][1]:.2f} ms" if r in by else "-" for _, _, by in cols]
        out.append(f"| {r} | " + " | ".join(cells) + " |")
    out.append("| **all** | " + " | ".join(f"**{prof['kernels_per_solve']} / {prof['kernel_ms_per_solve']:.2f} ms**"
                                        for _, prof, _ in cols) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", type=Path, nargs="+", help="cfm_profile.py result files")
    print(table(ap.parse_args(argv).json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
