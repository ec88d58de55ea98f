"""CFM estimator + whole Euler solve: parity with the step-audio2 oracle, batching, export."""
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("cosyvoice2")   # the step-audio2 oracle (README, command 2)

from c2w.runtime.model.config import FULL, TINY
from c2w.runtime.model.dit import MLP, Attention, CausalConvBlock, DiT, CFMSolver, euler_schedule
from c2w.runtime.model.encoder import _LookaheadConv, _RelPosSelfAttention, _Upsample
from c2w.runtime.model.weights import init_random_
from c2w.runtime.units import rel_l2
from tests.oracle import oracle_cfm, oracle_dit

pytestmark = pytest.mark.oracle

TOL = 1e-4     # fp32 parity bound (rel-L2) with the oracle


def build(cfg, seed=0):
    d = cfg.dit
    ours = DiT(d, cfg.mel_bins)
    spk_affine = torch.nn.Linear(cfg.spk_embed_dim, cfg.mel_bins)
    init_random_(ours, seed)
    init_random_(spk_affine, seed + 7)
    oracle = oracle_dit(d, cfg.mel_bins)
    oracle.load_state_dict(ours.state_dict(), strict=True)   # our keys are upstream's keys
    cfm = oracle_cfm(oracle, cfg)
    return CFMSolver(ours.eval(), spk_affine.eval(), cfg), cfm, spk_affine


def oracle_chunk(cfm, spk_affine, cfg, mu, spk, cond, x0, cnn, att):
    """Run the oracle's streaming solve on one stream; return (mel, cnn, att) trimmed to our shapes."""
    L = 0 if att is None else att.shape[4]
    cfm.rand_noise = torch.zeros(1, cfg.mel_bins, L + mu.shape[2] + 1)
    cfm.rand_noise[:, :, L:L + mu.shape[2]] = x0
    spk_p = spk_affine(F.normalize(spk, dim=1))
    mel, c, a = cfm.forward_chunk(mu, spk_p, cond, n_timesteps=cfg.n_timesteps, cnn_cache=cnn, att_cache=att)
    steps, depth = cfg.n_timesteps, cfg.dit.depth
    return mel.clone(), c[:steps, :depth].clone(), a[:steps, :depth].clone()


def inputs(cfg, B, T, L, seed=1):
    g = torch.Generator().manual_seed(seed)
    d = cfg.dit
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(B, 80, T), r(B, 192), r(B, 80, T), r(B, 80, T),
            r(cfg.n_timesteps, d.depth, 2 * B, 2 * d.hidden, 2) * 0.5,
            r(cfg.n_timesteps, d.depth, 2 * B, d.heads, L, 2 * d.head_dim) * 0.5)


def test_schedule_matches_upstream_recurrence():
    ts, dts = euler_schedule(10)
    assert ts[0] == 0.0 and abs(ts[-1] + dts[-1] - 1.0) < 1e-6
    assert all(d > 0 for d in dts)
    assert abs(ts[5] - (1 - torch.cos(torch.tensor(0.5 * 0.5 * torch.pi)).item())) < 1e-6


@torch.inference_mode()
def test_prompt_then_chunks_match_oracle_tiny():
    cfg = TINY
    ours, cfm, spk_affine = build(cfg)
    mu, spk, cond, x0, cnn, _ = inputs(cfg, 1, 60, 0)
    att0 = torch.zeros(cfg.n_timesteps, cfg.dit.depth, 2, cfg.dit.heads, 0, 2 * cfg.dit.head_dim)
    mel, c, a = ours(mu, spk, cond, x0, torch.zeros_like(cnn), att0)
    ref = oracle_chunk(cfm, spk_affine, cfg, mu, spk, cond, x0, None, None)
    for got, want in zip((mel, c, a), ref):
        assert got.shape == want.shape
        assert rel_l2(got, want) <= TOL
    assert mel.std() > 0.1          # random weights give a non-degenerate velocity
    # two streaming chunks feeding the caches forward, cond = 0 as in streaming
    for i in range(2):
        mu, spk2, _, x0, _, _ = inputs(cfg, 1, 50, 0, seed=10 + i)
        cond = torch.zeros_like(mu)
        mel, c2, a2 = ours(mu, spk, cond, x0, c, a)
        rmel, rc, ra = oracle_chunk(cfm, spk_affine, cfg, mu, spk, cond, x0, c, a)
        assert a2.shape[4] == a.shape[4] + 50
        assert rel_l2(mel, rmel) <= TOL and rel_l2(c2, rc) <= TOL and rel_l2(a2, ra) <= TOL
        c, a = c2, a2


@torch.inference_mode()
def test_full_size_chunk_matches_oracle():
    """All 16 DiT blocks of the full model (the tiny model has its widths and 2 blocks) with a
    full-size cache, over 2 Euler steps: the tiny tests run all 10, which repeat the same ops."""
    cfg = dataclasses.replace(FULL, n_timesteps=2)
    ours, cfm, spk_affine = build(cfg, seed=3)
    mu, spk, cond, x0, cnn, att = inputs(cfg, 1, 50, 300)
    cond = torch.zeros_like(mu)
    got = ours(mu, spk, cond, x0, cnn, att)
    ref = oracle_chunk(cfm, spk_affine, cfg, mu, spk, cond, x0, cnn, att)
    errs = [rel_l2(g, w) for g, w in zip(got, ref)]
    assert max(errs) <= TOL, errs


@torch.inference_mode()
def test_modulation_table_holds_each_steps_modulation():
    """The solver looks each step's adaLN modulation up in a table built once; a step computed
    from its table row equals the estimator computing the modulation from t itself (the per-call
    form), and a step indexed by a (1,) int64 tensor (what the AOTI step engine takes) equals one
    indexed by a Python int. fp32; bound 1e-6 rel-L2 (a 10-row GEMM against a 1-row one)."""
    solver, _, _ = build(TINY)
    d = TINY.dit
    assert solver.modulation_table.shape == (TINY.n_timesteps, d.depth * 9 * d.hidden + 2 * d.hidden)
    assert "modulation_table" not in solver.state_dict()            # derived, not a checkpoint key
    mu, spk, cond, x0, cnn, att = inputs(TINY, 2, 8, 6)
    g = torch.Generator().manual_seed(3)
    h_in = torch.randn(4, d.in_channels, 8, generator=g)
    for s, t in enumerate(solver.ts):
        per_call = solver.estimator(h_in, t, cnn[s], att[s])
        looked_up = solver.estimator.modulated(h_in, solver.modulation_table[s:s + 1], cnn[s], att[s])
        assert max(rel_l2(a, b) for a, b in zip(looked_up, per_call)) < 1e-6, s
    for s in (0, 9):
        by_int = solver.step(mu, spk, cond, x0, cnn[s], att[s], s, solver.dts[s])
        by_tensor = solver.step(mu, spk, cond, x0, cnn[s], att[s], torch.tensor([s]), torch.tensor([solver.dts[s]]))
        for a, b in zip(by_int, by_tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@torch.inference_mode()
def test_a_solver_built_after_new_weights_uses_them():
    """The table is computed from the weights when the solver is built (models are loaded, then
    their units built): a solver built after load_state_dict reflects the new weights."""
    solver, _, spk_affine = build(TINY, seed=0)
    other = DiT(TINY.dit, TINY.mel_bins)
    init_random_(other, 5)
    solver.estimator.load_state_dict(other.state_dict())
    rebuilt = CFMSolver(solver.estimator, spk_affine, TINY)
    want = other.eval().modulation(torch.tensor(rebuilt.ts))
    assert rel_l2(rebuilt.modulation_table, want) < 1e-6
    assert rel_l2(solver.modulation_table, want) > 0.1                # the old solver's table is stale


@torch.inference_mode()
def test_batch_equals_separate_streams():
    cfg = TINY
    ours, _, _ = build(cfg)
    B = 3
    mu, spk, cond, x0, cnn, att = inputs(cfg, B, 50, 40)
    mel, c, a = ours(mu, spk, cond, x0, cnn, att)
    for i in range(B):
        rows = [i, B + i]                               # cond row and uncond row of stream i
        m1, c1, a1 = ours(mu[i:i + 1], spk[i:i + 1], cond[i:i + 1], x0[i:i + 1], cnn[:, :, rows], att[:, :, rows])
        assert rel_l2(mel[i:i + 1], m1) <= 1e-5
        assert rel_l2(c[:, :, rows], c1) <= 1e-5 and rel_l2(a[:, :, rows], a1) <= 1e-5


def test_torch_export_static_shape():
    """The solve exports as one static graph that computes what eager does. 3 Euler steps: the
    unrolled steps repeat the same ops (the ONNX Runtime artifacts are 10-step exports)."""
    cfg = dataclasses.replace(TINY, n_timesteps=3)
    ours, _, _ = build(cfg)
    args = inputs(cfg, 1, 50, 40)
    ep = torch.export.export(ours, args, strict=False)
    with torch.inference_mode():
        want = ours(*args)
        got = ep.module()(*args)
    assert all(rel_l2(g, w) <= 1e-5 for g, w in zip(got, want))
    assert tuple(got[2].shape) == (3, cfg.dit.depth, 2, 8, 90, 128)


def _conv1d_reference(blk, x, cache):
    """CausalConvBlock by its definition: causal conv1d over [cache ; x], LayerNorm, Mish, conv1d.
    -> output (b, T, c), and the new cache: the last 2 frames entering each conv (b, 2c, 2)."""
    c1, c2 = cache.chunk(2, dim=1)
    h1 = torch.cat([c1, x.transpose(1, 2)], 2)
    h = F.conv1d(h1, blk.block[1].weight, blk.block[1].bias)
    h2 = torch.cat([c2, blk.block[4](blk.block[3](h.transpose(1, 2))).transpose(1, 2)], 2)
    y = F.conv1d(h2, blk.block[6].weight, blk.block[6].bias).transpose(1, 2)
    return y, torch.cat([h1[:, :, -2:], h2[:, :, -2:]], 1)


@torch.inference_mode()
def test_causal_conv_matches_conv1d():
    torch.manual_seed(0)
    blk = CausalConvBlock(48).eval()
    x, cache = torch.randn(3, 11, 48), torch.randn(3, 96, 2)
    y, new = blk(x, cache)
    want_y, want_new = _conv1d_reference(blk, x, cache)
    assert rel_l2(y, want_y) <= 1e-6
    assert rel_l2(new, want_new) <= 1e-6          # the last 2 frames entering each convolution


@torch.inference_mode()
def test_fp16_causal_conv_block_stays_within_rounding_of_float64():
    """In fp16 each tap's output is rounded before the shifted sum (docs/numerics.md): the
    full-width block stays within 1e-3 rel-L2 of float64 (7.4e-4 measured at this shape)."""
    torch.manual_seed(0)
    blk = CausalConvBlock(512).eval()
    for i in (1, 6):
        torch.nn.init.normal_(blk.block[i].weight, std=(1 / (3 * 512)) ** 0.5)
    x, cache = torch.randn(2, 50, 512), torch.randn(2, 1024, 2) * 0.5
    want = copy.deepcopy(blk).double()(x.double(), cache.double())[0]
    got = copy.deepcopy(blk).half()(x.half(), cache.half())[0].double()
    assert rel_l2(got, want) <= 1e-3


@pytest.mark.parametrize("make, convs, k", [
    (lambda: CausalConvBlock(16), ("block.1", "block.6"), (3, 3)),
    (lambda: _LookaheadConv(16, 3), ("conv1", "conv2"), (4, 3)),
    (lambda: _Upsample(16, 2), ("conv",), (5,)),
], ids=["dit", "encoder-lookahead", "encoder-upsample"])
def test_conv_weights_keep_upstream_shape_and_taps_outer_storage(make, convs, k):
    """The convolutions that run as one product (dit.conv_by_product), the DiT's and the flow encoder's."""
    sd = {n: v.contiguous().clone() for n, v in make().state_dict().items()}
    for name, taps in zip(convs, k):
        assert tuple(sd[f"{name}.weight"].shape) == (16, 16, taps)     # upstream's Conv1d shape
    fresh = make()
    fresh.load_state_dict(sd)                                        # a contiguous checkpoint
    for convert in (lambda m: m, lambda m: m.to(torch.float64), lambda m: m.half()):
        m = convert(fresh)
        for name in convs:
            w = m.get_submodule(name).weight
            assert w.permute(2, 0, 1).is_contiguous()                 # the products read views
            assert torch.equal(w, sd[f"{name}.weight"].to(w.dtype))
            assert w.requires_grad                                   # a parameter like the others


@pytest.mark.parametrize("make, keys", [
    (lambda: Attention(32, 2, 16), {f"{n}.{p}" for n in ("to_q", "to_k", "to_v", "q_norm", "k_norm", "proj")
                                    for p in ("weight", "bias")}),
    (lambda: _RelPosSelfAttention(32, 2), {"linear_q.weight", "linear_q.bias", "linear_k.weight", "linear_k.bias",
                                           "linear_v.weight", "linear_v.bias", "linear_out.weight", "linear_out.bias",
                                           "linear_pos.weight", "pos_bias_u", "pos_bias_v"}),
], ids=["dit", "encoder"])
def test_qkv_is_one_product_over_upstreams_three_weights_stored_once(make, keys):
    """The DiT's and the flow encoder's attention (PackedQKV)."""
    import copy
    import pickle
    attn = make()
    names = attn.QKV
    g = torch.Generator().manual_seed(1)
    sd = {k: torch.randn(v.shape, generator=g) for k, v in attn.state_dict().items()}
    assert set(sd) == keys                                          # upstream's keys, no packed one
    x = torch.randn(2, 5, 32, generator=g)

    def check(m):
        """The layers are views of the packed pair, and `project` computes upstream's three."""
        for name in names:
            layer = getattr(m, name)
            assert layer.weight.untyped_storage().data_ptr() == m.qkv_weight.untyped_storage().data_ptr()
            assert layer.bias.untyped_storage().data_ptr() == m.qkv_bias.untyped_storage().data_ptr()
            assert layer.weight.is_contiguous() and layer.weight.requires_grad
        dt = m.qkv_weight.dtype
        for got, name in zip(m.project(x.to(dt)), names):
            want = F.linear(x.double(), sd[f"{name}.weight"].double(), sd[f"{name}.bias"].double())
            assert rel_l2(got.double(), want) <= (1e-6 if dt != torch.float16 else 2e-3)

    attn.load_state_dict(sd)                                        # writes through the views
    check(attn)
    for convert in (lambda m: m.to(torch.float64), lambda m: copy.deepcopy(m),
                    lambda m: pickle.loads(pickle.dumps(m)), lambda m: m.half()):
        attn = convert(attn)
        check(attn)
    init_random_(attn, 3)                                           # so does the random init
    with torch.no_grad():
        assert torch.equal(attn.qkv_weight[:32], getattr(attn, names[0]).weight)


def test_weight_bytes_count_the_packed_qkv_once():
    from c2w.exporter.plan import weight_bytes
    from c2w.runtime.model.weights import load_model
    model = load_model("random:tiny")
    # every tensor of the CFM's modules except the q/k/v parameters, which are views of the
    # packed buffers (counted once, as the buffers)
    tensors = {id(t): t for m in model.component_modules()["cfm"]
               for name, t in list(m.named_parameters()) + list(m.named_buffers())
               if not any(f"to_{c}." in name for c in "qkv")}
    assert any(".qkv_weight" in name for name, _ in model.flow.named_buffers())
    assert weight_bytes(model)["cfm"] == sum(t.numel() * t.element_size() for t in tensors.values())


def test_each_conv_is_one_product_reading_the_weight_in_place_for_static_and_dynamic_shapes():
    """One product per convolution whatever the shape (2 per block), in a static export and in one
    with dynamic batch and time (the TensorRT graph), which stays right at other sizes; the taps'
    weights one after the other are a view of the stored weight (an AOTI package binds it as it is)."""
    blk = CausalConvBlock(16).eval()
    x, cache = torch.randn(16, 40, 16), torch.randn(16, 32, 2)

    def products(ep):
        return sum(n.target in (torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                   for n in ep.graph.nodes)

    static = torch.export.export(blk, (x, cache), strict=False)
    batch, time = torch.export.Dim("B", min=1, max=64), torch.export.Dim("T", min=2, max=512)
    dynamic = torch.export.export(blk, (x, cache), dynamic_shapes=({0: batch, 1: time}, {0: batch}), strict=False)
    assert products(static) == 2 and products(dynamic) == 2
    with torch.inference_mode():
        for b, t in ((3, 7), (1, 2)):                  # another size, and the smallest T the graph allows
            want = _conv1d_reference(blk, x[:b, :t], cache[:b])
            got = dynamic.module()(x[:b, :t], cache[:b])
            assert all(rel_l2(g, w) <= 1e-6 for g, w in zip(got, want))     # the output and the new cache
    for i in (1, 6):
        w = blk.block[i].weight.permute(2, 0, 1)
        assert w.reshape(-1, w.shape[2]).data_ptr() == blk.block[i].weight.data_ptr() and w.is_contiguous()


@pytest.mark.parametrize("device, dtype, tol", [
    ("cpu", torch.float32, 0.0),
    pytest.param("cuda", torch.float32, 1e-5, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
    pytest.param("cuda", torch.float16, 2e-3, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
])
def test_mlp_is_fc2_of_tanh_gelu_of_fc1_on_every_device(device, dtype, tol):
    """On CUDA the MLP takes fc1's bias and GELU from cuBLASLt's epilogue; on the CPU, where that op
    would compute the erf form (rel-L2 ~2e-4 from tanh on these inputs), the ops. Either way it is the
    layer's function: the CPU exactly, CUDA within matmul rounding (TF32 off)."""
    torch.manual_seed(0)
    mlp = MLP(64, 256).to(device, dtype)
    x = torch.randn(2, 9, 64, device=device, dtype=dtype) * 2
    want = mlp.fc2(F.gelu(mlp.fc1(x), approximate="tanh"))
    erf = mlp.fc2(F.gelu(mlp.fc1(x)))
    got = mlp(x)
    assert got.shape == want.shape and rel_l2(got.float(), want.float()) <= tol
    if tol == 0:                                       # the erf form differs by ~2e-4 here: told apart
        assert rel_l2(erf.float(), want.float()) > 1e-5
