"""ConformerEncoder against the step-audio2 oracle (UpsampleConformerEncoderV2), and its export paths."""
from __future__ import annotations

import math

import pytest
import torch

from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.config import FULL, TINY, EncoderConfig
from c2w.runtime.model.encoder import FUSED_ATTENTION_ROWS, MAX_POS, ConformerEncoder

from tests.oracle import oracle_encoder

pytest.importorskip("cosyvoice2")   # the step-audio2 oracle (README, command 2)

pytestmark = pytest.mark.oracle

TOL = 1e-4
LOOKAHEAD = 3


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_oracle(cfg: EncoderConfig, seed: int) -> torch.nn.Module:
    """Upstream encoder with every parameter redrawn (upstream init leaves LayerNorms at 1/0 and
    biases tiny, which would hide ordering/eps mistakes)."""
    m = oracle_encoder(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:                                   # linear / conv / per-head biases
                p.copy_(noise / math.sqrt(p[0].numel()))
            elif name.endswith("weight"):                      # LayerNorm gains
                p.copy_(1.0 + 0.1 * noise)
            else:                                              # biases
                p.copy_(0.1 * noise)
    return m


def oracle_step(oracle, xs, cnn, att, last):
    with torch.no_grad():
        return oracle.forward_chunk(xs, last_chunk=last, cnn_cache=cnn, att_cache=att)


def ours_for(oracle, cfg: EncoderConfig) -> ConformerEncoder:
    m = ConformerEncoder(cfg).eval()
    m.load_state_dict(oracle.state_dict(), strict=True)
    return m


@pytest.fixture(scope="module")
def tiny():
    oracle = make_oracle(TINY.encoder, seed=0)
    return oracle, ours_for(oracle, TINY.encoder)


def assert_close(ours, ref, what):
    names = ("h", "cnn_cache", "att_cache")
    for name, a, b in zip(names, ours, ref):
        assert a.shape == b.shape, f"{what} {name}: {tuple(a.shape)} vs {tuple(b.shape)}"
        err = rel_l2(a, b)
        assert err <= TOL, f"{what} {name}: rel-L2 {err:.3g}"


# ---- parity with the oracle --------------------------------------------------------------------

def test_state_dict_keys_equal_upstream(tiny):
    oracle, ours = tiny
    ref = oracle.state_dict()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.items()}
    assert "pos_table" not in ours.state_dict()


def test_q_k_v_are_one_product_and_their_weights_count_once():
    """Every block's q/k/v layers are views of its packed pair (runtime.model.dit.PackedQKV, tested
    there), and the planner counts that memory once."""
    from c2w.exporter.plan import weight_bytes
    from c2w.runtime.model.weights import load_model
    model = load_model("random:tiny")
    cfg = model.cfg.encoder
    attns = [m for m in model.flow.encoder.modules() if hasattr(m, "qkv_weight")]
    assert len(attns) == cfg.blocks + cfg.up_blocks
    assert all(a.linear_k.weight.untyped_storage().data_ptr() == a.qkv_weight.untyped_storage().data_ptr()
               for a in attns)
    tensors = {id(t): t for m in model.component_modules()["flow_encoder"]
               for name, t in list(m.named_parameters()) + list(m.named_buffers())
               if not any(f"linear_{c}." in name for c in "qkv")}
    assert weight_bytes(model)["flow_encoder"] == sum(t.numel() * t.element_size() for t in tensors.values())


# B=24: every block of a steady chunk has >= FUSED_ATTENTION_ROWS rows (24 x 25 at 25 Hz), the fused form
@pytest.mark.parametrize("batch", [1, 24])
def test_streaming_matches_oracle(tiny, batch):
    """Prompt setup (no cache), two steady chunks, then the zero-padded last chunk."""
    assert batch == 1 or batch * 25 >= FUSED_ATTENTION_ROWS
    oracle, ours = tiny
    cfg = TINY.encoder
    g = torch.Generator().manual_seed(1)
    prompt_tokens = 300 // 2 + LOOKAHEAD       # the usual 6 s prompt: P = 300 mel frames
    steps = [(prompt_tokens, False), (28, False), (28, False), (13, True)]
    cnn = att = ref_cnn = ref_att = None
    frames = 0
    for i, (n, last) in enumerate(steps):
        xs = torch.randn(batch, n, cfg.width, generator=g)
        with torch.no_grad():
            if i:
                ours.check_inputs(xs, cnn, att, last)
            h, cnn, att = ours.forward_chunk(xs, cnn, att, last)
        ref = oracle_step(oracle, xs, ref_cnn, ref_att, last)
        assert_close((h, cnn, att), ref, f"step {i}")
        _, ref_cnn, ref_att = ref
        t = ours.output_frames(n, last)
        frames += t
        assert h.shape == (batch, t, cfg.width)
        assert att.shape == ours.att_cache_shape(batch, frames)
        assert cnn.shape == ours.cnn_cache_shape(batch)


def test_batch_of_two_equals_two_single_streams(tiny):
    _, ours = tiny
    g = torch.Generator().manual_seed(2)
    steps = [(53, False), (28, False), (13, True)]
    inputs = [torch.randn(2, n, TINY.encoder.width, generator=g) for n, _ in steps]

    def run(rows):
        cnn = att = None
        outs = []
        with torch.no_grad():
            for xs, (_, last) in zip(inputs, steps):
                h, cnn, att = ours.forward_chunk(xs[rows], cnn, att, last)
                outs.append((h, cnn, att))
        return outs

    both = run(slice(0, 2))
    for row in (0, 1):
        single = run(slice(row, row + 1))
        for (hb, cb, ab), (hs, cs, as_) in zip(both, single):
            assert rel_l2(hb[row:row + 1], hs) <= TOL
            assert rel_l2(cb[row:row + 1], cs) <= TOL
            assert rel_l2(ab[:, row:row + 1], as_) <= TOL


def test_empty_cache_equals_no_cache(tiny):
    _, ours = tiny
    xs = torch.randn(1, 28, TINY.encoder.width, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = ours.forward_chunk(xs, None, None, False)
        b = ours.forward_chunk(xs, torch.zeros(ours.cnn_cache_shape(1)),
                               torch.zeros(ours.att_cache_shape(1, 0)), False)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("batch", [1, 24])      # 24: the fused attention (24 x 25 and 24 x 50 rows)
def test_full_size_chunk_matches_oracle(batch):
    cfg = FULL.encoder
    oracle = make_oracle(cfg, seed=4)
    ours = ours_for(oracle, cfg)
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(batch, 28, cfg.width, generator=g)
    cnn = torch.randn(ours.cnn_cache_shape(batch), generator=g)
    att = torch.randn(ours.att_cache_shape(batch, 300), generator=g)
    ours.check_inputs(xs, cnn, att, False)
    with torch.no_grad():
        got = ours.forward_chunk(xs, cnn, att, False)
    ref = oracle_step(oracle, xs, cnn, att, False)
    assert_close(got, ref, "full")
    assert got[0].shape == (batch, 50, cfg.width) and got[2].shape == (10, batch, 8, 350, 128)


# ---- input checks ------------------------------------------------------------------------------

def _good(b=1, n=28, c=300):
    e = TINY.encoder
    return (torch.zeros(b, n, e.width), torch.zeros(b, e.width, 6), torch.zeros(e.blocks + e.up_blocks, b,
                                                                              e.heads, c, 2 * e.d_k))


@pytest.mark.parametrize("mutate, last, match", [
    (lambda x, c, a: (x, torch.zeros(1, 128, 4), a), False,
     r"tensor 'cnn_cache': received shape \(1, 128, 4\); expected shape \(1, 128, 6\)"),
    (lambda x, c, a: (x, torch.zeros(2, 128, 6), a), False,
     r"tensor 'cnn_cache': received shape \(2, 128, 6\); expected shape \(1, 128, 6\)"),
    (lambda x, c, a: (x, c.double(), a), False, r"tensor 'cnn_cache': received dtype torch.float64"),
    (lambda x, c, a: (x, c, torch.zeros(2, 1, 4, 300, 64)), False,
     r"tensor 'att_cache': received shape \(2, 1, 4, 300, 64\); expected shape \(3, 1, 4, 300, 64\)"),
    (lambda x, c, a: (x, c, torch.zeros(3, 1, 4, 300, 32)), False,
     r"tensor 'att_cache'.*expected shape \(3, 1, 4, 300, 64\)"),
    (lambda x, c, a: (x, c, torch.zeros(3, 1, 4, 301, 64)), False, r"odd C=301.*with C even"),
    (lambda x, c, a: (x, c, torch.zeros(3, 4, 300, 64)), False, r"tensor 'att_cache'.*5-D"),
    (lambda x, c, a: (torch.zeros(1, 28, 64), c, a), False,
     r"tensor 'xs': received shape \(1, 28, 64\); expected shape \(B, N, 128\)"),
    (lambda x, c, a: (torch.zeros(1, 3, 128), c, a), False, r"received 3 tokens; expected at least 4 tokens"),
    (lambda x, c, a: (torch.zeros(1, 0, 128), c, a), True, r"received 0 tokens; expected at least 1"),
    (lambda x, c, a: (x, c, torch.zeros(3, 1, 4, MAX_POS - 40, 64)), False,
     r"attention span.*4960 cached \+ 50 new frames.*at most 5000"),
])
def test_check_inputs_rejects(tiny, mutate, last, match):
    _, ours = tiny
    with pytest.raises(C2WUserError, match=match):
        ours.check_inputs(*mutate(*_good()), last)


def test_check_inputs_accepts_valid(tiny):
    _, ours = tiny
    ours.check_inputs(*_good(), False)
    ours.check_inputs(*_good(b=2, n=13), True)
    ours.check_inputs(_good()[0], None, None, False)


def test_config_rejects_other_upsample_rates():
    with pytest.raises(C2WUserError, match=r"up_stride 3; expected up_stride 2"):
        ConformerEncoder(EncoderConfig(width=64, heads=4, ffn=64, blocks=1, up_blocks=1, up_stride=3))


# ---- export ------------------------------------------------------------------------------------

class _Step(torch.nn.Module):
    """Export key: (B, N, C, last_chunk) -- last_chunk baked in as a Python bool."""

    def __init__(self, enc: ConformerEncoder, last: bool):
        super().__init__()
        self.enc, self.last = enc, last

    def forward(self, xs, cnn_cache, att_cache):
        return self.enc.forward_chunk(xs, cnn_cache, att_cache, self.last)


def _chunk_inputs(n, c, seed, b=1):
    g = torch.Generator().manual_seed(seed)
    xs, cnn, att = _good(b=b, n=n, c=c)
    return torch.randn(xs.shape, generator=g), torch.randn(cnn.shape, generator=g), \
        torch.randn(att.shape, generator=g)


@pytest.mark.parametrize("last", [False, True])
def test_torch_export_matches_eager(tiny, last):
    _, ours = tiny
    args = _chunk_inputs(28, 300, seed=6)
    step = _Step(ours, last).eval()
    ep = torch.export.export(step, args, strict=False)
    sig = ep.graph_signature
    assert not sig.buffers_to_mutate and not sig.user_inputs_to_mutate
    # per block q/k/v (one product), out, pos, and the feed-forward's two; embed and up_embed one
    # each; the three convolutions one each (dit.conv_by_product), so no convolution op is left
    linears = sum(n.target is torch.ops.aten.linear.default for n in ep.graph.nodes)
    assert linears == 5 * (TINY.encoder.blocks + TINY.encoder.up_blocks) + 2 + 3
    assert not [n for n in ep.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]
    with torch.no_grad():
        got, ref = ep.module()(*args), step(*args)
    assert got[0].shape == (1, ours.output_frames(28, last), TINY.encoder.width)
    assert_close(got, ref, f"export last={last}")


@pytest.mark.parametrize("batch", [1, 24])      # 24: the fused attention
def test_onnx_export_matches_eager(tiny, tmp_path, batch):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    _, ours = tiny
    args = _chunk_inputs(28, 300, seed=7, b=batch)
    step = _Step(ours, False).eval()
    path = tmp_path / "encoder.onnx"
    names_in, names_out = ["xs", "cnn_cache", "att_cache"], ["h", "new_cnn_cache", "new_att_cache"]
    prog = torch.onnx.export(step, args, dynamo=True, optimize=False, verbose=False,
                             input_names=names_in, output_names=names_out)
    prog.save(str(path))

    model = onnx.load(str(path))
    ops = {n.op_type for n in model.graph.node}
    banned = {"ScatterND", "ScatterElements", "DFT", "STFT", "RandomNormal", "RandomNormalLike",
              "RandomUniform", "RandomUniformLike", "Resize"}
    assert not ops & banned, ops & banned
    # weights once: parameters + the position table, no per-use copies
    init_bytes = sum(math.prod(t.dims) * 4 for t in model.graph.initializer)
    expect = sum(p.numel() * 4 for p in ours.parameters()) + ours.pos_table.numel() * 4
    assert init_bytes <= expect

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == names_in
    outs = sess.run(names_out, {k: v.numpy() for k, v in zip(names_in, args)})
    with torch.no_grad():
        ref = step(*args)
    assert_close(tuple(torch.from_numpy(o) for o in outs), ref, "onnxruntime")
