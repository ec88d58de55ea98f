"""The product's Triton kernels, compiled for sm_90 (H100, H200) on the CPU as a launch at the
H200 keys' largest and smallest shapes would specialize them (benchmarks/h200/kernel_resources.py),
fit the H100's shared memory: at most 232,448 bytes per program. Triton's interpreter, which runs
the kernels' value tests, allocates none, so without this a kernel too large for the GPU shows
only on a device call (run 35).

Registers and their spills (stack bytes) are printed by the script, not held here: they cost
time, and time belongs in benchmarks."""
import json

import pytest

pytest.importorskip("triton")

from benchmarks.h200.kernel_resources import H100_SHARED_BYTES  # noqa: E402
from tests.jit_process import jit_process  # noqa: E402


def test_the_products_kernels_fit_an_h100():
    out = jit_process("from benchmarks.h200.kernel_resources import main; main()")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"_attention_inputs_kernel", "_attention_kernel", "_conv_norm_mish_kernel",
                       "_conv_residual_norm_kernel", "_conv3_elu_kernel"}, kernels
    assert {r["shape"] for r in rows} == {"dit b=2 T=50 L=400", "dit b=64 T=150 L=400", "f0 B=1 F=58",
                                          "f0 B=32 F=158"}
    too_large = [r for r in rows if r["shared"] > H100_SHARED_BYTES]
    assert not too_large, too_large
