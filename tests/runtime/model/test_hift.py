"""HiftVocoder against the step-audio2 HiFTGenerator oracle (random weights, CPU, fp32).

The oracle draws two random tensors inside SineGen2: `torch.rand(B, H)` (initial phases) and then
`torch.randn_like(sine_waves)`, where sine_waves is a (B, T, H) view of a (B, H, T) tensor, so the
noise is a normal fill in (B, H, T) memory order. `_oracle_run` seeds the RNG, replays both draws
to recover the noise, reseeds and calls the oracle, so both models see the same noise.

Tolerances across batch sizes and backends. The reference keeps harmonic phases in float32 at up to
~1e4 rad, so an f0 that differs by one ulp (different conv accumulation order: another batch size,
another backend) flips phase roundings of ~1e-3 rad. Measured with these random weights: mel scaled
by (1 + 2^-23) moves the source by 3e-5..7e-5 and the speech by 3e-4..5e-4 (rel-L2), in the oracle
and here alike. So batch and ONNX checks run twice: with f0 pinned (classifier weight zeroed, f0 =
|bias| exactly everywhere) at tight tolerance, and with predicted f0 at a tolerance above that
measured sensitivity (a real bug, e.g. rows mixing, gives O(1) errors).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.config import FULL, TINY, HiftConfig
from c2w.runtime.model.hift import (HiftVocoder, _prefix_sum_f32, _upsample_phase,
                                hift_state_dict_from_checkpoint)

from tests.oracle import oracle_hift, sine_noise

pytest.importorskip("flashcosyvoice")   # the step-audio2 oracle (README, command 2)

pytestmark = pytest.mark.oracle

H = TINY.hift.nb_harmonics + 1
HOP = TINY.hift.samples_per_frame      # 480
CACHE = TINY.hift_source_cache          # 3840


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _make_oracle(cfg: HiftConfig, seed: int, f0_bias: float = 150.0) -> torch.nn.Module:
    """Oracle with weights far from upstream's near-zero init, so every branch matters.

    f0_bias ~150 Hz keeps every frame voiced; a small bias mixes voiced and unvoiced frames.
    """
    m = oracle_hift(cfg)
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=gen) * std

    with torch.no_grad():
        for mod in m.modules():
            transposed = isinstance(mod, torch.nn.ConvTranspose1d)
            if isinstance(mod, (torch.nn.Conv1d, torch.nn.ConvTranspose1d, torch.nn.Linear)):
                shape = mod.weight.shape
                fan_in = shape[0] * shape[2] / mod.stride[0] if transposed else math.prod(shape[1:])
                w = normal(shape, 1 / math.sqrt(fan_in))
                if hasattr(mod, "parametrizations"):
                    g = mod.parametrizations.weight.original0
                    mod.parametrizations.weight.original1.copy_(w)
                    g.copy_(w.flatten(1).norm(dim=1).view_as(g) * (0.8 + 0.4 * torch.rand(g.shape, generator=gen)))
                else:
                    mod.weight.copy_(w)
                mod.bias.copy_(normal(mod.bias.shape, 0.1))
            elif isinstance(getattr(mod, "alpha", None), torch.nn.Parameter):      # Snake
                mod.alpha.copy_(0.5 + torch.rand(mod.alpha.shape, generator=gen))
        m.f0_predictor.classifier.weight.mul_(20.0)        # f0 spread of ~ +-20 Hz
        m.f0_predictor.classifier.bias.fill_(f0_bias)
        m.conv_post.parametrizations.weight.original0.mul_(0.3)   # magnitudes ~exp(-1): little clipping
        m.conv_post.bias[: cfg.n_fft // 2 + 1].fill_(-1.0)
    return m.eval()


def _legacy_spelling(sd: dict) -> dict:
    """parametrizations.weight.original0/1 -> weight_g/weight_v, under a `generator.` prefix."""
    out = {}
    for k, v in sd.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g")
        k = k.replace(".parametrizations.weight.original1", ".weight_v")
        out["generator." + k] = v
    return out


def _oracle_run(oracle, mel, cache, seed):
    """-> (speech, source, noise) with noise the (B, T, H) draw the oracle made."""
    noise = sine_noise(seed, mel.shape[0], TINY.hift, mel.shape[2])     # H and HOP are FULL's too
    torch.manual_seed(seed)
    speech, source = oracle(mel, cache)
    return speech, source, noise


def _inputs(b, frames, cache_len, seed):
    gen = torch.Generator().manual_seed(seed)
    mel = torch.randn(b, 80, frames, generator=gen)
    cache = 0.1 * torch.randn(b, 1, cache_len, generator=gen)
    return mel, cache


@pytest.fixture(scope="module")
def oracle():
    return _make_oracle(TINY.hift, seed=0)


@pytest.fixture(scope="module")
def checkpoints(oracle, tmp_path_factory):
    """hift.pt in both weight-norm spellings, as a deployment would store them."""
    d = tmp_path_factory.mktemp("hift")
    torch.save(oracle.state_dict(), d / "hift.pt")
    torch.save(_legacy_spelling(oracle.state_dict()), d / "hift_legacy.pt")
    return d / "hift.pt", d / "hift_legacy.pt"


@pytest.fixture(scope="module")
def vocoder(checkpoints):
    sd = torch.load(checkpoints[0], map_location="cpu", weights_only=True)
    model = HiftVocoder(TINY.hift)
    model.load_state_dict(hift_state_dict_from_checkpoint(sd, TINY.hift))
    return model.eval()


@pytest.fixture(scope="module")
def vocoder_pinned_f0(vocoder):
    """Same weights with the f0 head's weight zeroed: f0 = |bias| bit-exactly on any backend."""
    model = HiftVocoder(TINY.hift)
    model.load_state_dict(vocoder.state_dict())
    with torch.no_grad():
        model.f0_predictor.classifier.weight.zero_()
    return model.eval()


# (speech, source) rel-L2 tolerances across batch sizes / backends; see the module docstring
PINNED_F0_TOL = (1e-4, 1e-5)
PREDICTED_F0_TOL = (2e-3, 3e-4)
F0_CASES = [("vocoder_pinned_f0", *PINNED_F0_TOL), ("vocoder", *PREDICTED_F0_TOL)]


# ---- loading ------------------------------------------------------------------------------------

def test_both_weight_norm_spellings_fold_to_identical_tensors(checkpoints, vocoder):
    new, legacy = (hift_state_dict_from_checkpoint(torch.load(p, weights_only=True), TINY.hift)
                   for p in checkpoints)
    assert sorted(new) == sorted(legacy) == sorted(vocoder.state_dict())
    for k in new:
        assert torch.equal(new[k], legacy[k]), k
    assert not any("weight_g" in k or "parametrizations" in k for k in new)
    # an already folded state dict passes through unchanged
    again = hift_state_dict_from_checkpoint(vocoder.state_dict(), TINY.hift)
    assert all(torch.equal(again[k], v) for k, v in vocoder.state_dict().items())


def test_checkpoint_for_another_config_lists_every_mismatch(checkpoints):
    sd = torch.load(checkpoints[0], weights_only=True)
    with pytest.raises(C2WUserError, match=r"base_channels=512.*mismatched.*"
                       r"conv_pre\.weight: \(32, 80, 7\) vs \(512, 80, 7\)") as info:
        hift_state_dict_from_checkpoint(sd, FULL.hift)
    msg = str(info.value)
    assert "f0_predictor.condnet.8.weight: (32, 32, 3) vs (512, 512, 3)" in msg
    assert "conv_post.weight: (18, 4, 7) vs (18, 64, 7)" in msg


def test_missing_and_unexpected_keys_are_listed_together(checkpoints):
    sd = torch.load(checkpoints[1], weights_only=True)
    del sd["generator.conv_post.bias"]
    sd["generator.extra.bias"] = torch.zeros(3)
    with pytest.raises(C2WUserError, match=r"1 missing, 1 unexpected, 0 mismatched: "
                       r"missing keys \['conv_post\.bias'\]; unexpected keys \['extra\.bias'\]"):
        hift_state_dict_from_checkpoint(sd, TINY.hift)


def test_folded_oracle_equals_live_weight_norm_oracle(oracle):
    # A second build, not copy.deepcopy: the copy would share the parametrized class, and removing
    # the parametrization deletes the `weight` property from that class, breaking the original.
    folded = _make_oracle(TINY.hift, seed=0)
    parametrize = torch.nn.utils.parametrize
    for mod in [m for m in folded.modules() if parametrize.is_parametrized(m, "weight")]:
        parametrize.remove_parametrizations(mod, "weight", leave_parametrized=True)
    assert not any(parametrize.is_parametrized(m) for m in folded.modules())
    mel, cache = _inputs(1, 58, CACHE, seed=1)
    live = _oracle_run(oracle, mel, cache, seed=2)
    fold = _oracle_run(folded, mel, cache, seed=2)
    torch.testing.assert_close(fold[0], live[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fold[1], live[1], rtol=0, atol=0)


# ---- parity with the oracle -----------------------------------------------------------------------

@pytest.mark.parametrize("b, frames, cache_len", [(1, 50, 0), (1, 58, CACHE), (2, 50, 0), (2, 58, CACHE)])
def test_matches_oracle(oracle, vocoder, b, frames, cache_len):
    mel, cache = _inputs(b, frames, cache_len, seed=10 + b)
    speech_ref, source_ref, noise = _oracle_run(oracle, mel, cache, seed=3)
    vocoder.check_inputs(mel, noise, cache)
    with torch.no_grad():
        speech, source = vocoder(mel, noise, cache if cache_len else None)
    assert speech.shape == (b, frames * HOP) and source.shape == (b, 1, frames * HOP)
    assert _rel_l2(speech, speech_ref) <= 1e-4
    assert _rel_l2(source, source_ref) <= 1e-4
    assert (speech_ref.abs() < TINY.hift.audio_limit).float().mean() > 0.8    # a test signal, not clipping
    if cache_len:
        assert torch.equal(source[:, :, :cache_len], cache)


def test_mixed_voicing_matches_oracle():
    """f0 around the 10 Hz voicing threshold: exercises the unvoiced (noise-only) branch."""
    oracle = _make_oracle(TINY.hift, seed=5, f0_bias=5.0)
    model = HiftVocoder(TINY.hift).eval()
    model.load_state_dict(hift_state_dict_from_checkpoint(oracle.state_dict(), TINY.hift))
    mel, cache = _inputs(1, 58, CACHE, seed=6)
    with torch.no_grad():
        voiced = (oracle.f0_predictor(mel) > TINY.hift.voiced_threshold).float().mean().item()
    assert 0.1 < voiced < 0.9
    speech_ref, source_ref, noise = _oracle_run(oracle, mel, cache, seed=7)
    with torch.no_grad():
        speech, source = model(mel, noise, cache)
    assert _rel_l2(speech, speech_ref) <= 1e-4
    assert _rel_l2(source, source_ref) <= 1e-4


def test_full_size_matches_oracle():
    oracle = _make_oracle(FULL.hift, seed=8)
    model = HiftVocoder(FULL.hift).eval()
    model.load_state_dict(hift_state_dict_from_checkpoint(oracle.state_dict(), FULL.hift))
    mel, cache = _inputs(1, 58, CACHE, seed=9)
    speech_ref, source_ref, noise = _oracle_run(oracle, mel, cache, seed=4)
    with torch.no_grad():
        speech, source = model(mel, noise, cache)
    assert _rel_l2(speech, speech_ref) <= 1e-4
    assert _rel_l2(source, source_ref) <= 1e-4


@pytest.mark.parametrize("model_name, tol_speech, tol_source", F0_CASES)
def test_batch_of_two_equals_two_single_calls(request, model_name, tol_speech, tol_source):
    model = request.getfixturevalue(model_name)
    mel, cache = _inputs(2, 58, CACHE, seed=12)
    noise = torch.randn(2, 58 * HOP, H, generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        speech, source = model(mel, noise, cache)
        for i in range(2):
            s1, src1 = model(mel[i:i + 1], noise[i:i + 1], cache[i:i + 1])
            assert _rel_l2(s1, speech[i:i + 1]) <= tol_speech
            assert _rel_l2(src1, source[i:i + 1]) <= tol_source


def test_initial_phase_never_reaches_the_output(oracle, monkeypatch):
    """Upstream adds a random phase at time sample 0 only; the 1/480 linear decimation after it
    reads samples 480*i + 239 and 480*i + 240, so the phase cannot matter. Check it on the oracle:
    same RNG stream (hence same noise), three different phase values, identical outputs."""
    real_rand = torch.rand
    mel, cache = _inputs(2, 58, CACHE, seed=14)
    outs = []
    for value in (None, 0.0, 0.7321):
        def rand(*args, value=value, **kwargs):
            r = real_rand(*args, **kwargs)                   # keep the RNG stream aligned
            return r if value is None else torch.full_like(r, value)
        monkeypatch.setattr(torch, "rand", rand)
        torch.manual_seed(15)
        outs.append(oracle(mel, cache))
    monkeypatch.setattr(torch, "rand", real_rand)
    for speech, source in outs[1:]:
        assert torch.equal(speech, outs[0][0]) and torch.equal(source, outs[0][1])


def test_phase_helpers_reproduce_torch_cpu_bit_for_bit():
    """The source is only reproducible because these match torch CPU exactly (see hift.py)."""
    gen = torch.Generator().manual_seed(16)
    x = torch.rand(2, 300, H, generator=gen)
    x[0, :5] = 0.0
    x[1, :5] = 1e-6 * torch.rand(5, H, generator=gen)       # tiny increments (f0 near 0 Hz)
    assert torch.equal(_prefix_sum_f32(x, dim=1), torch.cumsum(x, dim=1))
    v = torch.cumsum(torch.rand(2, H, 58, generator=gen), dim=-1) * 2 * math.pi * HOP   # up to ~1e5
    assert torch.equal(_upsample_phase(v, HOP), F.interpolate(v, scale_factor=float(HOP), mode="linear"))


# ---- input checks --------------------------------------------------------------------------------

def test_check_inputs_names_tensor_and_shapes(vocoder):
    noise = torch.zeros(1, 50 * HOP, H)
    with pytest.raises(C2WUserError, match=r"tensor 'mel': received shape \(1, 81, 50\); expected shape \(1, 80, 50\)"):
        vocoder.check_inputs(torch.zeros(1, 81, 50), noise)
    with pytest.raises(C2WUserError, match=r"tensor 'noise': received shape \(1, 24000, 8\); "
                                           r"expected shape \(1, 24000, 9\)"):
        vocoder.check_inputs(torch.zeros(1, 80, 50), torch.zeros(1, 50 * HOP, 8))
    with pytest.raises(C2WUserError, match=r"tensor 'mel': received dtype torch.float16"):
        vocoder.check_inputs(torch.zeros(1, 80, 50, dtype=torch.float16), noise)
    with pytest.raises(C2WUserError, match=r"tensor 'source_cache': received shape \(1, 1, 24001\); "
                                           r"expected shape \(1, 1, S\) with S <= 24000"):
        vocoder.check_inputs(torch.zeros(1, 80, 50), noise, torch.zeros(1, 1, 24001))
    with pytest.raises(C2WUserError, match=r"tensor 'source_cache': received shape \(2, 1, 3840\)"):
        vocoder.check_inputs(torch.zeros(1, 80, 50), noise, torch.zeros(2, 1, 3840))
    vocoder.check_inputs(torch.zeros(1, 80, 50), noise, torch.zeros(1, 1, 3840))


# ---- export --------------------------------------------------------------------------------------

def test_torch_export_matches_eager(vocoder):
    mel, cache = _inputs(1, 58, CACHE, seed=17)
    noise = torch.randn(1, 58 * HOP, H, generator=torch.Generator().manual_seed(18))
    ep = torch.export.export(vocoder, (mel, noise, cache), strict=False)
    with torch.no_grad():
        ref = vocoder(mel, noise, cache)
        out = ep.module()(mel, noise, cache)
    for a, b in zip(out, ref):
        assert _rel_l2(a, b) <= 1e-6


def test_onnx_export_runs_in_onnxruntime(vocoder, vocoder_pinned_f0, tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    mel, cache = _inputs(2, 58, CACHE, seed=19)
    noise = torch.randn(2, 58 * HOP, H, generator=torch.Generator().manual_seed(20))
    path = tmp_path / "hift.onnx"
    torch.onnx.export(vocoder, (mel, noise, cache), str(path), dynamo=True, optimize=False,
                      input_names=["mel", "noise", "source_cache"], output_names=["speech", "source"])
    proto = onnx.load(str(path))
    ops = {n.op_type for n in proto.graph.node}
    banned = {"DFT", "STFT", "ScatterND", "ScatterElements", "RandomNormal", "RandomNormalLike",
              "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli", "Mod"}
    assert not ops & banned
    # The pinned-f0 variant differs in one initializer: patch it instead of exporting again.
    head = next(t for t in proto.graph.initializer if t.name == "f0_predictor.classifier.weight")
    head.CopyFrom(onnx.numpy_helper.from_array(
        vocoder_pinned_f0.f0_predictor.classifier.weight.detach().numpy(), head.name))
    feeds = {"mel": mel.numpy(), "noise": noise.numpy(), "source_cache": cache.numpy()}
    for model, graph, (tol_speech, tol_source) in ((vocoder, str(path), PREDICTED_F0_TOL),
                                                   (vocoder_pinned_f0, proto.SerializeToString(), PINNED_F0_TOL)):
        speech, source = ort.InferenceSession(graph, providers=["CPUExecutionProvider"]).run(None, feeds)
        with torch.no_grad():
            speech_ref, source_ref = model(mel, noise, cache)
        assert _rel_l2(torch.from_numpy(speech), speech_ref) <= tol_speech
        assert _rel_l2(torch.from_numpy(source), source_ref) <= tol_source


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to TF32 (10-bit mantissa, nearest), as GPU tensor cores read conv operands."""
    i = x.contiguous().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32)


def test_verification_inputs_keep_tf32_noise_within_the_engine_tolerance(monkeypatch):
    """A float32 HiFT with TF32 on (profiles/h100.yaml) makes every engine check compare two
    TF32 computations. With every conv operand rounded to TF32 (CPU emulation), the full-size
    HiFT's speech on the verification inputs must move by less than the engine tolerance, first
    AND steady chunk. A source cache drawn at 10x a real source's scale made the steady chunk
    move by 2.5e-2 (and fail closed on the H200); at the real scale it moves by ~3.4e-3."""
    import types

    from c2w.runtime.model.weights import init_random_
    from c2w.runtime.units import SOURCE_STD, SPECS, ShapeKey, rel_l2
    from c2w.runtime.verify import VERIFY_SEED
    hift = HiftVocoder(FULL.hift)
    init_random_(hift, 1)                  # random:full's HiFT (load_model seeds it with the seed + 1)
    model = types.SimpleNamespace(cfg=FULL, hift=hift.eval())       # what the HiFT unit reads
    spec = SPECS["hift"]
    errs = {}
    for dims in ((1, 50, 0), (1, 58, 3840)):
        key = ShapeKey("hift", dims, "float32")
        unit = spec.build(model, key).eval()
        x = spec.example_inputs(model.cfg, key, torch.Generator().manual_seed(VERIFY_SEED))
        if dims[2]:
            assert abs(x[2].std().item() - SOURCE_STD) < 0.1 * SOURCE_STD
        with torch.inference_mode():
            want = unit(*x)[0]
            with monkeypatch.context() as m:
                for name in ("conv1d", "conv_transpose1d", "linear"):
                    fn = getattr(F, name)
                    m.setattr(F, name, lambda a, w, *r, _fn=fn, **k: _fn(_tf32(a), _tf32(w), *r, **k))
                got = unit(*x)[0]
        errs[key.id] = rel_l2(got, want)
    assert all(e < spec.tolerance(key) for e in errs.values()), errs
    assert all(e > 1e-4 for e in errs.values()), errs        # the rounding did reach the convolutions


def test_snake_sine_is_multiply_adds_only_when_a_compiler_traces_for_cuda():
    """The multiply-add sine is for the compiled engines; eager on CUDA (the runtime's fallback)
    keeps torch.sin, where the multiply-adds would be some twenty kernels per Snake."""
    from c2w.runtime.model.hift import _sine_as_multiply_adds

    seen: list[tuple[bool, bool]] = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append((_sine_as_multiply_adds(True), _sine_as_multiply_adds(False)))
            return x + 1

    probe = Probe()
    probe(torch.zeros(2))
    torch.export.export(probe, (torch.zeros(2),), strict=False)       # as exporter/backends/aoti.py
    assert seen == [(False, False), (True, False)]                    # eager either way; traced, for CUDA


def test_sin_squared_by_multiply_adds_is_within_4e7_of_the_exact_value():
    """Snake's GPU sine (hift.sin_squared_by_multiply_adds) against float64, over the arguments
    Snake sees and beyond: |alpha x| up to 60 densely, tiny ones (where sin^2 ~ z^2, relative
    error), and a few large ones up to 2^16."""
    from c2w.runtime.model.hift import _sin_squared, sin_squared_by_multiply_adds
    z = torch.cat([torch.linspace(-60, 60, 400_001), -torch.logspace(-8, 0, 500), torch.logspace(-8, 0, 500),
                   torch.tensor([1e4, -3e4, 6e4])]).float()
    got = sin_squared_by_multiply_adds(z).double()
    want = torch.sin(z.double()) ** 2
    assert (got - want).abs().max() < 4e-7
    tiny = z.abs() < 1e-3
    assert ((got - want).abs() / want)[tiny].max() < 1e-6
    assert torch.equal(_sin_squared(z), torch.sin(z).pow(2))           # the CPU keeps torch.sin
