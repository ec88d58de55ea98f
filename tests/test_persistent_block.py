"""The persistent DiT block prototype (benchmarks/h200/persistent_block.py) computes the model's
block: a variant that is faster but wrong must not reach a device call.

Under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) the kernel runs one phase
per launch (`by_phases`): the interpreter runs programs one after another, so the grid barrier of
the one-launch form would never be passed there; the device run checks that form.

Tolerance: the kernel in float16 against the block in float32 is held to rel-L2 2e-3, about four
times what the model's own float16 ops reach against float32 here (4.5e-4 to 5.6e-4: float16's
rounding of values near 1 is 4.9e-4). Cache slots the chunk does not write must keep their bits.
"""
import copy
import json
import os

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":   # tests/conftest.py sets it
    pytest.skip("no CUDA and Triton's interpreter is off (TRITON_INTERPRET is not 1)", allow_module_level=True)

from benchmarks.h200.kernel_resources import H100_SHARED_BYTES  # noqa: E402
from benchmarks.h200.persistent_block import _block, block_forward, fits, inputs  # noqa: E402
from tests.jit_process import jit_process  # noqa: E402
from c2w.runtime.model.config import DiTConfig  # noqa: E402
from c2w.runtime.units import rel_l2  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = DiTConfig(hidden=128, heads=2, head_dim=64)        # two heads of the real head size, four times narrower
REL_L2 = 2e-3


@pytest.mark.parametrize("shifted", [True, False])
@pytest.mark.parametrize("b, frames, cache", [(2, 12, 8), (4, 5, 0)])
def test_the_block_in_one_kernel_is_the_models_block(shifted, b, frames, cache):
    x, mod, cnn, kv, slots = inputs(CFG, b, frames, cache, DEVICE)
    ref, half = _block(CFG, DEVICE, torch.float32), _block(CFG, DEVICE, torch.float16)
    with torch.no_grad():
        kv_ref = kv.clone()
        want_x, want_cnn, _ = ref.modulated(x, mod, cnn, kv_ref, slots)
        x16, mod16, cnn16, kv16 = (t.half() for t in (x, mod, cnn, kv))
        assert fits(half, x16, kv16)
        before = kv16.clone()
        got_x, got_cnn = block_forward(half, x16, mod16, cnn16, kv16, slots, programs=3, by_phases=True,
                                       tiles={"SHIFTED": shifted})
    assert rel_l2(got_x.float(), want_x) < REL_L2
    assert rel_l2(got_cnn.float(), want_cnn) < REL_L2
    written = torch.zeros(kv.shape[2], dtype=torch.bool, device=DEVICE)
    written[slots] = True
    assert rel_l2(kv16[:, :, written].float(), kv_ref[:, :, written]) < REL_L2
    assert torch.equal(kv16[:, :, ~written], before[:, :, ~written])


def test_a_block_whose_norms_are_skipped_fails_the_bar():
    """The bar can fail: the same kernel on a block whose q/k norms were reset to the identity
    (the kernel then skips nothing, but computes another function than the reference's)."""
    x, mod, cnn, kv, slots = inputs(CFG, 2, 12, 8, DEVICE)
    ref, half = _block(CFG, DEVICE, torch.float32), _block(CFG, DEVICE, torch.float16)
    wrong = copy.deepcopy(half)
    with torch.no_grad():
        wrong.attn.q_norm.weight.fill_(1.0)
        wrong.attn.q_norm.bias.zero_()
        want_x, _, _ = ref.modulated(x, mod, cnn, kv.clone(), slots)
        got_x, _ = block_forward(wrong, *(t.half() for t in (x, mod, cnn, kv)), slots, programs=3, by_phases=True)
    assert rel_l2(got_x.float(), want_x) > 10 * REL_L2


def test_the_one_launch_kernel_fits_an_h100s_shared_memory():
    """The interpreter never allocates shared memory, so it cannot see a kernel too large to run
    (run 35: 561,152 bytes asked at the real shapes). Compiled for sm_90 as a launch would
    specialize it (persistent_block.compiled_for), in a process with Triton's JIT on, the full
    model's block at the device run's default tiles must fit."""
    code = ("import json, torch; from benchmarks.h200 import persistent_block as pb; "
            "print(json.dumps(pb.resources(90, variants=({},))[0]))")
    usage = json.loads(jit_process(code).splitlines()[-1])
    assert 0 < usage["shared"] <= H100_SHARED_BYTES, usage
