"""benchmarks/h200/roofline.py: the per-class floors follow from the model's shapes, and the classes
of a measured solve add up to it."""
from pathlib import Path

import pytest

from benchmarks.h200 import roofline
from c2w.exporter.flops import cfm_flops
from c2w.runtime.model.config import FULL
from c2w.runtime.units import ShapeKey

RUN28B = Path(__file__).parents[1] / "benchmarks" / "h200" / "results" / "run28_stage_h100"


def test_the_products_and_attention_are_the_flop_counters_solve_but_its_one_row_projections():
    """exporter/flops.py (held to torch's counter) counts the same solve; what it has beyond the
    blocks' products and attention is the one-row adaLN and timestep projections and the input,
    final and speaker projections: under 1 % at B=32."""
    key = ShapeKey.named("cfm", "float16", B=32, T=150, L=400)
    work = roofline.block_step_work(FULL, 32, 150, 400)
    blocks = (work[roofline.PRODUCTS].flops + work[roofline.ATTENTION].flops) * FULL.n_timesteps * FULL.dit.depth
    total = cfm_flops(FULL, key)
    assert 0 < total - blocks < 0.01 * total


def test_a_products_bytes_and_flops_by_hand():
    """B=1 T=50 L=300: 100 rows of 512 into q/k/v (1536), fc1 (2048) and back, the two convs over
    104 rows, in float16."""
    w = roofline.block_step_work(FULL, 1, 50, 300)[roofline.PRODUCTS]
    shapes = [(100, 512, 1536), (100, 512, 512), (104, 512, 1536), (104, 512, 1536), (100, 512, 2048),
              (100, 2048, 512)]
    assert w.flops == sum(2 * m * k * n for m, k, n in shapes)
    assert w.bytes == sum(2 * (m * k + k * n + m * n) for m, k, n in shapes)
    att = roofline.block_step_work(FULL, 1, 50, 300)[roofline.ATTENTION]
    assert att.bytes == 2 * (2 * 100 * 512 + 2 * 350 * 1024)      # q and out, then [k | v] of 350 slots


@pytest.mark.parametrize("key", ["cfm-B32-T150-L400-float16", "cfm-B1-T50-L300-float16"])
def test_the_classes_of_run_28b_add_up_to_the_solve(key):
    import json
    import tarfile
    with tarfile.open(RUN28B / "stage_extras.tgz") as tar:
        res = json.load(tar.extractfile(f"engine_kernels_{key}.json"))
    rows = roofline.roofline(res["profile"], res["key"], "NVIDIA H100 80GB HBM3")
    whole = rows[-1]
    assert sum(r["kernels"] for r in rows[:-1]) == whole["kernels"] == res["profile"]["kernels_per_solve"]
    assert abs(sum(r["ms"] for r in rows[:-1]) - whole["ms"]) < 1e-9
    for r in rows[:-2]:
        assert r["kernels"] > 0 and r["over_floor"] >= 1          # nothing measured beats the data sheet
    assert roofline.classify("nvjet_sm90_hsh_192x128_64x5_1x2_h_bz_coopB_TNT") == roofline.PRODUCTS
    assert roofline.classify("triton_per_fused_add_index_select_mul_native_layer_norm_slice_unsqueeze_view_63") \
        == roofline.NORMS
    assert roofline.classify("Memset (Device)") == roofline.REST
    with pytest.raises(SystemExit, match="no peak rates for 'NVIDIA A100"):
        roofline.roofline(res["profile"], res["key"], "NVIDIA A100-SXM4-80GB")
