"""Kernel time per class from cfm_profile.py's JSON files: where a solve's GPU time goes, side by side.

cfm_profile.py records each solve's kernel count and time and its 40 most expensive kernel names
(`profile_kernels`; hift_precision.py --kernels records HiFT's the same way); this groups those names
into classes (matrix products, convolutions, attention, cache stacking and copies, fused Triton
kernels) and shows what the top 40 leave out as one more row. One column per file, in the order
given (e.g. the same key before and after a change):

    python benchmarks/h200/kernel_classes.py results/run5_conv/cfm_profile_B32_T150_L400_d2_pertap.json \
        results/run15_gelu_trim/cfm_profile_B32_T150_L400_d2_gelu-epilogue_gelu.json
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

OTHER_TRITON = "other Triton (norms, modulation, activations, residuals, conv taps' sums)"
COPIES = "cache stack, copies, memsets"
# First match wins: (class, substrings of the kernel name). Inductor's kernels (named triton_...)
# are told apart by their names' fused ops; a vendor kernel by its library's naming.
TRITON_CLASSES = (
    # Inductor's Triton GEMM templates (max_autotune), with whatever epilogue it fused into them
    ("matrix products (Triton templates)", ("triton_tem_",)),
    ("GELU (own kernel)", ("gelu",)),
)
# Inductor's ops that move or cast data without arithmetic: a Triton kernel that fused only these
# is a copy. Before run 18 any name with "copy" in it counted as one, and with it every kernel
# that fused a cast (`_to_copy`) into arithmetic (HiFT's Snake): tables up to run 18 count so.
MOVES = ("_to_copy", "_unsafe_view", "clone", "stack", "cat", "copy", "view", "unsqueeze", "squeeze", "slice",
         "select", "expand", "permute", "transpose", "constant_pad_nd", "narrow", "split", "fill", "zeros")
ATTENTION = "attention (cuDNN / flash / c2w's)"
VENDOR_CLASSES = (
    (ATTENTION, ("sdpa", "flash", "fmha")),
    (COPIES, ("Memcpy", "Memset", "elementwise_kernel", "copy")),
    # cuDNN's convolutions (implicit GEMMs, its CUTLASS fprop kernels) and the layout changes it makes
    ("convolutions (cuDNN)", ("convolve", "conv1d", "conv2d", "depthwise", "implicit_gemm", "fprop", "winograd",
                              "ToNhwc", "ToNchw")),
    ("matrix products (cuBLAS)", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
)
# c2w's own Triton kernels (runtime/model/triton_kernels.py), named for their function; its
# attention kernel counts with the attention it replaces
OWN_TRITON = "c2w's Triton kernels (attention inputs, conv block)"
OWN_KERNELS = {"_attention_inputs_kernel": OWN_TRITON, "_conv_norm_mish_kernel": OWN_TRITON,
               "_conv_residual_norm_kernel": OWN_TRITON, "_attention_kernel": ATTENTION}
OTHER = "other named kernels"
REST = "outside the 40 largest names"
ROWS = ("matrix products (cuBLAS)", "matrix products (Triton templates)", "convolutions (cuDNN)",
        ATTENTION, COPIES, "GELU (own kernel)", OTHER_TRITON, OWN_TRITON, OTHER, REST)


def only_moves(name: str) -> bool:
    """Whether an Inductor kernel's name (triton_poi_fused_<ops>_<n>) lists data movement only."""
    ops = re.sub(r"^triton_[a-z]+_(fused_)?", "", name)
    ops = re.sub(r"_[^_]*$", "", ops) if len(name) >= NAME_CHARS else re.sub(r"_?\d+$", "", ops)  # a cut name's last op is partial
    for op in sorted(MOVES, key=len, reverse=True):      # longest first: "_to_copy" before "copy"
        ops = ops.replace(op, "")
    return ops.strip("_") == ""


def classify(name: str) -> str:
    if name in OWN_KERNELS:
        return OWN_KERNELS[name]
    triton = name.startswith("triton_")
    for cls, keys in TRITON_CLASSES if triton else VENDOR_CLASSES:
        if any(k in name for k in keys):
            return cls
    if triton:
        return COPIES if only_moves(name) else OTHER_TRITON
    return OTHER


NAME_CHARS = 90          # profile_kernels keeps this much of a kernel's name


def profile_kernels(fn, top: int = 40) -> dict:
    """The CUDA kernels of one call of `fn` (torch.profiler): their count, summed time and mean,
    and the `top` names by time with their counts (names cut at 90 characters): the "profile"
    object of cfm_profile.py's JSON, which `table` reads."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.device_time for e in kernels)
    by_name: dict[str, list] = {}
    for e in kernels:
        s = by_name.setdefault(e.name[:NAME_CHARS], [0, 0.0])
        s[0] += 1
        s[1] += e.device_time
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels_per_solve": len(kernels), "kernel_ms_per_solve": total_us / 1e3,
            "mean_kernel_us": total_us / max(1, len(kernels)),
            "top": [{"name": n, "count": c, "ms": t / 1e3} for n, (c, t) in ranked]}


def table(paths: list[Path], where: str = "profile") -> str:
    """where: the profile object's place in each JSON file, a dotted path ("profile"; cfm_profile.py's
    served solves: "served.profile_from_tensor", "served.profile_ring_steady")."""
    cols = []
    for p in paths:
        prof = json.loads(p.read_text())
        for part in where.split("."):
            prof = prof[part]
        by: dict[str, list[float]] = {}
        for k in prof["top"]:
            c = by.setdefault(classify(k["name"]), [0, 0.0])
            c[0], c[1] = c[0] + k["count"], c[1] + k["ms"]
        named_n = sum(v[0] for v in by.values())
        named_ms = sum(v[1] for v in by.values())
        by[REST] = [prof["kernels_per_solve"] - named_n, prof["kernel_ms_per_solve"] - named_ms]
        cols.append((p, prof, by))
    rows = [r for r in ROWS if any(r in by for _, _, by in cols)]      # classes no column has: no row
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
    ap.add_argument("--profile", default="profile",
                    help="the profile's dotted path in each file, e.g. served.profile_ring_steady")
    a = ap.parse_args(argv)
    print(table(a.json, a.profile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
