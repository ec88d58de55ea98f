"""benchmarks/h200/kernel_classes.py: the per-class kernel table of cfm_profile.py's results adds up."""
import re
from pathlib import Path

from benchmarks.h200 import kernel_classes

RESULTS = Path(__file__).parents[1] / "benchmarks" / "h200" / "results"


def test_kernel_names_fall_in_their_class():
    c = kernel_classes.classify
    assert c("nvjet_sm90_hsh_256x128_64x4_1x2_h_bz_coopA_gelubias_TNT") == "matrix products (cuBLAS)"
    assert c("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == kernel_classes.ATTENTION
    assert c("triton_poi_fused_stack_32") == c("Memcpy DtoD (Device -> Device)") == "cache stack, copies, memsets"
    assert c("triton_poi_fused_gelu_view_20") == "GELU (own kernel)"
    assert c("triton_per_fused_native_layer_norm_view_11").startswith("other Triton")
    assert c("triton_tem_fused__unsafe_view_add_addmm_index_select_mul_native_layer_norm") == "matrix products (Triton templates)"
    assert c("_attention_inputs_kernel") == kernel_classes.OWN_TRITON      # runtime/model/triton_kernels.py
    assert c("_attention_kernel") == kernel_classes.ATTENTION
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


def test_hift_kernels_fall_in_their_class():
    """cuDNN's convolutions and their layout changes are told from cuBLAS's products, and an
    Inductor kernel that fused a convolution's bias is still Inductor's."""
    c = kernel_classes.classify
    assert c("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc") == "convolutions (cuDNN)"
    assert c("cutlass__5x_cudnn::Kernel<cutlass_tensorop_f16_s16816fprop_optimized_f16>") == "convolutions (cuDNN)"
    assert c("void cudnn::engines_precompiled::nchwToNhwcKernel<__half>") == "convolutions (cuDNN)"
    assert c("triton_poi_fused_add_convolution_mul_sin_3").startswith("other Triton")
    # a cast fused into arithmetic is arithmetic (HiFT's Snake); a kernel of casts and moves alone is a copy
    assert c("triton_poi_fused__to_copy_add_mul_slice_sub_transpose_view_27").startswith("other Triton")
    assert c("triton_poi_fused__to_copy_add_clone_convolution_mul_pow_reciprocal_sin_unsqueeze_view_30").startswith("other")
    assert c("triton_poi_fused__to_copy_3") == c("triton_poi_fused_clone_transpose_5") == kernel_classes.COPIES
    assert c("triton_poi_fused_cat_clone_12") == kernel_classes.COPIES
    # a name cut at 90 characters: its last, partial op does not decide
    cut = ("triton_poi_fused__to_copy_clone_expand_permute_select_slice_squeeze_transpose_unsqueeze_vi")[:90]
    assert len(cut) == 90 and c(cut) == kernel_classes.COPIES
    assert c("triton_poi_fused__to_copy_add_clone_convolution_mul_pow_reciprocal_sin_unsqueeze_view_3xx"[:90]).startswith("other")
    assert c("void at::native::convert_kernel<float>") == kernel_classes.OTHER


def test_every_class_has_a_row():
    classes = {c for c, _ in kernel_classes.TRITON_CLASSES + kernel_classes.VENDOR_CLASSES}
    assert classes | {kernel_classes.OTHER_TRITON, kernel_classes.OTHER} <= set(kernel_classes.ROWS)


def test_profile_kernels_counts_and_ranks_the_cuda_kernels_of_one_call(monkeypatch):
    """Against a stand-in profiler: CPU events are left out, names are cut at 90 characters, and
    the ranking is by summed time."""
    import torch
    import torch.profiler

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda name, us, dev=cuda: type("E", (), {"name": name, "device_time": us, "device_type": dev})()  # noqa: E731
    events = [ev("gemm", 5.0), ev("gemm", 7.0), ev("x" * 100, 20.0), ev("host", 99.0, cpu)]

    class Profile:
        def __init__(self, activities):
            assert activities == [torch.profiler.ProfilerActivity.CUDA]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events
    calls = []
    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    prof = kernel_classes.profile_kernels(lambda: calls.append(1), top=1)
    assert calls == [1]
    assert prof["kernels_per_solve"] == 3 and abs(prof["kernel_ms_per_solve"] - 0.032) < 1e-12
    assert prof["top"] == [{"name": "x" * 90, "count": 1, "ms": 0.02}]
    assert abs(prof["mean_kernel_us"] - 32 / 3) < 1e-12
