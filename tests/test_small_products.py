"""The B=1 product prototype (benchmarks/h200/small_products.py) computes x @ w.T + b, with and
without GELU, whole-K and split over K: a tile that is faster but wrong must not reach a device call.

Under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) in float32 against float64,
rel-L2 1e-5 (float32 rounding over K <= 128 terms is ~1e-7). Each shape runs twice, so a split
launch that left its arrival counters non-zero fails the second run.
"""
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":   # tests/conftest.py sets it
    pytest.skip("no CUDA and Triton's interpreter is off (TRITON_INTERPRET is not 1)", allow_module_level=True)

from benchmarks.h200.small_products import SmallProduct, reference, rel_l2, weights  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("k_in, n_out, gelu, block_n, block_k, splits", [
    (96, 40, False, 16, 32, 1),      # whole K, a ragged last column tile
    (96, 40, True, 16, 32, 3),       # split three ways, GELU after the reduction
    (128, 48, False, 32, 32, 2),
    (100, 32, False, 16, 32, 4),     # K not a multiple of the step: the last split is short
])
def test_small_product_matches_float64(k_in, n_out, gelu, block_n, block_k, splits):
    tile = dict(BLOCK_N=block_n, BLOCK_K=block_k, splits=splits, num_warps=4, num_stages=2)
    x = torch.randn(20, k_in, device=DEVICE)
    w, b = weights(k_in, n_out, 1, DEVICE, torch.float32, 0)
    op = SmallProduct(20, k_in, n_out, gelu, tile, DEVICE)
    out = torch.empty(20, n_out, device=DEVICE)
    want = reference(x, w[0], b[0], gelu)
    for _ in range(2):
        out.zero_()
        assert rel_l2(op(x, w[0], b[0], out), want) < 1e-5
    assert int(op.counters.abs().sum()) == 0
