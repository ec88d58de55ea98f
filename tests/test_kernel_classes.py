"""benchmarks/h200/kernel_classes.py: the per-class kernel table of cfm_profile.py's results adds up."""
import re
from pathlib import Path

from benchmarks.h200 import kernel_classes

RESULTS = Path(__file__).parents[1] / "benchmarks" / "h200" / "results"


def test_kernel_names_fall_in_their_class():
    c = kernel_classes.classify
    assert c("nvjet_sm90_hsh_256x128_64x4_1x2_h_bz_coopA_gelubias_TNT") == "matrix products (cuBLAS)"
    assert c("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention (cuDNN / flash)"
    assert c("triton_poi_fused_stack_32") == c("Memcpy DtoD (Device -> Device)") == "cache stack, copies, memsets"
    assert c("triton_poi_fused_gelu_view_20") == "GELU (own kernel)"
    assert c("triton_per_fused_native_layer_norm_view_11").startswith("other Triton")
    assert c("triton_tem_fused__unsafe_view_add_addmm_index_select_mul_native_layer_norm") == "matrix products (Triton templates)"
    assert c("some_new_kernel") == kernel_classes.OTHER


def test_each_column_adds_up_to_the_solves_kernels_and_time():
    """Run 15's B=32 pair (GELU kernel, then GELU in the epilogue): the class rows, the remainder
    outside the 40 largest names included, sum to the solve's count and ms; the GELU row empties."""
    files = [RESULTS / "run15_gelu_trim" / f"cfm_profile_B32_T150_L400_d2_{v}.json"
             for v in ("base", "gelu-epilogue_gelu")]
    rows = kernel_classes.table(files).splitlines()
    totals = [tuple(map(float, t)) for t in re.findall(r"\*\*(\d+) / ([\d.]+) ms\*\*", rows[-1])]
    assert totals == [(760, 10.62), (740, 10.23)]
    for col, (n, ms) in enumerate(totals):
        cells = [r.split(" | ")[col + 1].strip(" |") for r in rows[2:-1]]
        parts = [tuple(map(float, re.match(r"([\d.]+) / ([\d.]+) ms", c).groups())) for c in cells if c != "-"]
        assert sum(p[0] for p in parts) == n and abs(sum(p[1] for p in parts) - ms) < 0.02
    gelu = next(r for r in rows if r.startswith("| GELU"))
    assert gelu.split(" | ")[1] == "20 / 0.52 ms" and gelu.rstrip(" |").endswith("-")
