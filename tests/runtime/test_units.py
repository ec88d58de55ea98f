"""The per-component facts on the unit specs: which dims select the unit module, the export
variant, the dynamic dims and graph variants; keys built and read by dim name."""
import pytest
import torch

from c2w.runtime.cache import EngineCache
from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.weights import load_model
from c2w.runtime.units import SPECS, CFMStepUnit, EagerRunner, ShapeKey

ENC = ShapeKey.named("flow_encoder", "float32", B=2, N=28, C=100, last=0)
ENC_OTHER_CACHE = ENC.with_dims(N=13, C=200)
ENC_LAST = ENC.with_dims(last=1)
CFM = ShapeKey.named("cfm", "float32", B=2, T=50, L=100)
HIFT = ShapeKey.named("hift", "float32", B=2, F=58, S=3840)
HIFT_FIRST = HIFT.with_dims(F=50, S=0)


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny")


def test_named_key_equals_the_positional_one_and_reads_back_by_name():
    assert ENC == ShapeKey("flow_encoder", (2, 28, 100, 0), "float32")
    assert CFM == ShapeKey("cfm", (2, 50, 100), "float32")
    assert HIFT == ShapeKey("hift", (2, 58, 3840), "float32")
    assert (ENC.dim("B"), ENC.dim("N"), ENC.dim("C"), ENC.dim("last")) == (2, 28, 100, 0)
    assert (HIFT.dim("F"), HIFT.dim("S")) == (58, 3840)


@pytest.mark.parametrize("dims, match", [
    ({"B": 1, "T": 50}, r"dims of a cfm key: received \['B', 'T'\].*exactly the names \['B', 'T', 'L'\]"),
    ({"B": 1, "T": 50, "L": 0, "N": 3}, r"\['B', 'L', 'N', 'T'\].*exactly the names"),
])
def test_named_key_needs_exactly_the_specs_dims(dims, match):
    with pytest.raises(C2WUserError, match=match):
        ShapeKey.named("cfm", "float32", **dims)


def test_named_key_of_an_unknown_component():
    with pytest.raises(C2WUserError, match=r"component: received 'vocoder'.*one of \['cfm', 'flow_encoder', 'hift'\]"):
        ShapeKey.named("vocoder", "float32", B=1)


def test_module_key_names_the_dims_that_select_the_unit_module():
    assert SPECS["flow_encoder"].module_dims == ("last",)
    assert SPECS["cfm"].module_dims == SPECS["hift"].module_dims == ()
    assert SPECS["flow_encoder"].module_key(ENC) == ("flow_encoder", 0)
    assert SPECS["flow_encoder"].module_key(ENC_OTHER_CACHE) == ("flow_encoder", 0)
    assert SPECS["flow_encoder"].module_key(ENC_LAST) == ("flow_encoder", 1)
    assert SPECS["cfm"].module_key(CFM) == ("cfm",)
    assert SPECS["hift"].module_key(HIFT) == SPECS["hift"].module_key(HIFT_FIRST) == ("hift",)


def test_eager_runner_and_engine_cache_share_one_module_per_module_key(model, tmp_path):
    runner = EagerRunner(model)
    assert runner.unit(ENC) is runner.unit(ENC_OTHER_CACHE)
    assert runner.unit(ENC) is not runner.unit(ENC_LAST)
    assert (runner.unit(ENC).last_chunk, runner.unit(ENC_LAST).last_chunk) == (False, True)
    assert runner.unit(HIFT) is runner.unit(HIFT_FIRST)

    cache = EngineCache(tmp_path, model)                 # no manifest: everything eager
    assert cache._shared_weights(ENC) is cache._shared_weights(ENC_OTHER_CACHE)
    assert cache._shared_weights(ENC) is not cache._shared_weights(ENC_LAST)
    assert sorted(cache._weights) == [("flow_encoder", 0), ("flow_encoder", 1)]


@pytest.mark.parametrize("key", [CFM, ShapeKey.named("cfm", "float32", B=1, T=30, L=0)], ids=["cache", "prompt"])
def test_the_in_place_step_replayed_is_the_whole_solve(model, key):
    """AOTI's CFM step writes the chunk's frames into slots of per-block buffers and attends to
    all of them; EulerReplay, handed the cache as a tensor, lays it out after the chunk's T slots
    (upstream's order). Replayed over the eager step, the solve's three outputs equal the unit's
    exactly (the same ops on the same values in the same order, CPU), with a cache and for a
    prompt (L=0)."""
    from c2w.runtime.engines.aoti import EulerReplay
    cfg, spec = model.cfg, SPECS["cfm"]
    inputs = spec.example_inputs(cfg, key)
    T = inputs[0].shape[2]
    assert inputs[5].shape[-2] == key.dim("L")
    with torch.no_grad():
        want = spec.build(model, key)(*inputs)
        step = spec.export_variant.build(model)
        got = EulerReplay(step, cfg.n_timesteps, torch.device("cpu"), "in_place")(*inputs)
    assert [t.shape for t in got] == [t.shape for t in want]
    for name, a, b in zip(spec.output_names, got, want):
        assert torch.equal(a, b), name
    assert torch.equal(got[2][..., T:, :], inputs[5])          # upstream order: the chunk first, then the cache


def test_a_stream_solved_in_place_chunk_after_chunk_is_the_eager_stream(model):
    """Four chunks of one stream (T=40, a 40-frame prompt), its attention cache trimmed to
    P + 100 = 102 frames after each, handed back as the stream driver hands it (RingCache.of).
    Until a chunk finds exactly T free slots the replay lays the cache out anew (chunk 1: 80
    frames, none free; chunk 2: 102 in 120 slots, 18 free); from then on each chunk writes its 40
    frames into the 40 slots the trim freed, in the same buffer (chunk 3). Each chunk's outputs
    and the cache in upstream's order match the eager unit fed its own trimmed caches (CPU, fp32:
    only the keys' order in the ring differs, so only rounding: values reach ~8, and the last chunk
    differs by up to ~2e-6, a few float32 steps at that size, which small values downstream
    inherit; hence atol 1e-5 beside rtol 1e-5, and rel-L2 <= 1e-6 per tensor)."""
    from c2w.runtime.engines.aoti import EulerReplay
    from c2w.runtime.ring import RingCache
    from c2w.runtime.trim import CacheTrim
    cfg, spec, trim = model.cfg, SPECS["cfm"], CacheTrim(2)
    key = ShapeKey.named("cfm", "float32", B=1, T=40, L=40)
    g = torch.Generator().manual_seed(5)
    first = spec.example_inputs(cfg, key)
    with torch.no_grad():
        unit, step = spec.build(model, key), spec.export_variant.build(model)
        replay = EulerReplay(step, cfg.n_timesteps, torch.device("cpu"), "in_place")
        want_att, got_att, buffers = first[5], first[5], []
        for chunk in range(4):
            mu, spk, cond, x0 = [torch.randn(t.shape, generator=g) for t in first[:4]]
            cnn = first[4] if chunk == 0 else want[1]
            want = unit(mu, spk, cond, x0, cnn, want_att)
            want_att = trim.apply(want[2])
            att_in = got_att if chunk == 0 else RingCache.of(got_att)
            got = replay(mu, spk, cond, x0, cnn if chunk == 0 else got[1], att_in, trim=trim)
            got_att = got[2]
            assert isinstance(got_att, RingCache if chunk else torch.Tensor)
            for a, b in zip(got[:2] + (RingCache.of(got_att).logical(),), want[:2] + (want_att,)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
                assert ((a - b).norm() / b.norm()).item() <= 1e-6
            if chunk:
                buffers.append(got_att.buffer)
    assert want_att.shape[-2] == 102 and got_att.frames == 102
    assert [b.shape[-2] for b in buffers] == [120, 142, 142] and buffers[2] is buffers[1]   # chunk 3: in place


def test_only_the_cfm_has_an_export_variant_one_in_place_euler_step(model):
    assert SPECS["flow_encoder"].export_variant is None and SPECS["hift"].export_variant is None
    variant = SPECS["cfm"].export_variant
    cfg = model.cfg
    assert variant.extra(cfg) == {"cfm_step": True, "n_steps": cfg.n_timesteps, "step_att": "in_place"}
    assert isinstance(variant.build(model), CFMStepUnit)
    inputs = SPECS["cfm"].example_inputs(cfg, CFM)
    T, L = inputs[0].shape[2], inputs[5].shape[-2]
    step = variant.inputs(cfg, inputs)
    assert len(step) == 8 + cfg.dit.depth
    assert [t.shape for t in step[:4]] == [t.shape for t in inputs[:4]]
    assert torch.equal(step[4], inputs[4][0]) and step[4].is_contiguous()             # step 0's cnn cache
    assert step[5].tolist() == [0] and step[6].tolist() == pytest.approx([0.1])        # s, dt
    assert step[7].tolist() == list(range(T))                                          # the chunk's slots
    for i, buffer in enumerate(step[8:]):                     # step 0's att cache, block i, after T slots
        assert buffer.shape[-2] == T + L and buffer.is_contiguous()
        assert torch.equal(buffer[..., T:, :], inputs[5][0, i])


@pytest.mark.parametrize("L", [0, 10])
def test_the_step_inputs_of_a_cache_shorter_than_the_chunk(model, L):
    """A prompt's key (L=0: h200_core's B=1 T=300 setup key) and any cache shorter than the chunk
    get buffers of T + L frames too: the chunk's T slots zero, then the cache (these failed to
    build on the H200 in run 29 before the fix: the chunk's zeros were cut from the cache)."""
    key = ShapeKey.named("cfm", "float32", B=1, T=30, L=L)
    inputs = SPECS["cfm"].example_inputs(model.cfg, key)
    step = SPECS["cfm"].export_variant.inputs(model.cfg, inputs)
    for i, buffer in enumerate(step[8:]):
        assert buffer.shape == (*inputs[5].shape[2:4], 30 + L, inputs[5].shape[-1])
        assert not buffer[..., :30, :].any() and torch.equal(buffer[..., 30:, :], inputs[5][0, i])


def test_dynamic_dims_and_ranges_per_component():
    assert SPECS["flow_encoder"].dynamic_dims == {"B": (1, 256), "N": (4, 512), "C": (1, 4096)}
    assert SPECS["cfm"].dynamic_dims == {"B": (1, 256), "T": (2, 2048), "L": (1, 4096)}
    assert SPECS["hift"].dynamic_dims == {"B": (1, 256)}     # F static: one graph per frame count


def test_dynamic_shapes_per_input_in_input_order():
    # plain ints stand in for torch.export Dims: 2 * B must come out as the doubled value
    d = {"B": 3, "N": 5, "C": 7, "T": 11, "L": 13}
    assert SPECS["flow_encoder"].dynamic_shapes(ENC, d) == ({0: 3, 1: 5}, {0: 3}, {1: 3, 3: 7})
    assert SPECS["cfm"].dynamic_shapes(CFM, d) == (
        {0: 3, 2: 11}, {0: 3}, {0: 3, 2: 11}, {0: 3, 2: 11}, {2: 6}, {2: 6, 4: 13})
    assert SPECS["hift"].dynamic_shapes(HIFT, d) == ({0: 3}, {0: 3}, {0: 3})
    assert SPECS["hift"].dynamic_shapes(HIFT_FIRST, d) == ({0: 3}, {0: 3})


def test_dynamic_shapes_refuse_axes_of_an_input_the_key_does_not_have(monkeypatch):
    import dataclasses
    bad = dataclasses.replace(SPECS["cfm"], dynamic_axes=lambda k, d: {"mel": {0: d["B"]}})
    with pytest.raises(ValueError, match=r"cfm dynamic axes for inputs \['mel'\]: expected inputs among \['mu'"):
        bad.dynamic_shapes(CFM, {"B": 1})


def test_graph_variants():
    variant = {c: SPECS[c].graph_variant for c in SPECS}
    assert variant["flow_encoder"](ENC) == variant["flow_encoder"](ENC_OTHER_CACHE) == "flow_encoder"
    assert variant["flow_encoder"](ENC_LAST) == "flow_encoder-last"
    assert variant["cfm"](CFM) == variant["cfm"](CFM.with_dims(B=1, T=100, L=0)) == "cfm"
    assert variant["hift"](HIFT) == "hift-F58-cached"
    assert variant["hift"](HIFT_FIRST) == "hift-F50"
    assert variant["hift"](HIFT_FIRST.with_dims(B=7)) == "hift-F50"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_eager_outputs_have_the_dtypes_the_spec_declares(dtype):
    """The spec is the one place that says a unit's input and output dtypes; verification holds
    engines to the output dtypes. HiFT's are float32 under its float16 policy too."""
    from c2w.runtime.precision import load_at_precision
    m = load_at_precision("random:tiny", "cpu", {c: dtype for c in SPECS})
    runner = EagerRunner(m)
    for key in (ENC, ENC_LAST, CFM.with_dims(B=1, T=8, L=4), HIFT_FIRST.with_dims(B=1)):
        key = ShapeKey(key.component, key.dims, dtype)
        spec = SPECS[key.component]
        inputs = spec.example_inputs(m.cfg, key)
        assert [t.dtype for t in inputs] == list(spec.input_dtypes(key))
        outputs = runner.run(key, inputs)
        assert [t.dtype for t in outputs] == list(spec.output_dtypes(key)), key.id
    assert SPECS["hift"].output_dtypes(HIFT.with_dims()) == (torch.float32, torch.float32)


def test_a_float16_hift_model_names_its_hift_keys_float16_and_nothing_else():
    """The driver asks the engine cache for HiFT keys of the policy's dtype, the one the manifest
    check compares, while the model's f0 predictor stays float32."""
    from c2w.runtime.cache import manifest_mismatch
    from c2w.runtime.manifest import BackendRef, ModelRef
    from c2w.runtime.precision import load_at_precision
    from c2w.runtime.stream import StreamDriver
    m = load_at_precision("random:tiny", "cpu", {"hift": "float16"})
    assert {c: m.component_dtype(c) for c in SPECS} == {"flow_encoder": torch.float32, "cfm": torch.float32,
                                                         "hift": torch.float16}
    asked = []

    class Recording(EagerRunner):
        def run(self, key, inputs, trim=None):
            asked.append(key)
            return super().run(key, inputs, trim)

    drv = StreamDriver(m, Recording(m), trim_conformer=True)
    g = torch.Generator().manual_seed(0)
    st = drv.setup(torch.randint(0, m.cfg.vocab_size, (1, 10), generator=g), torch.randn(1, 20, 80, generator=g),
                   torch.randn(1, 192, generator=g))
    pcm = drv.step(st, torch.randint(0, m.cfg.vocab_size, (1, 7), generator=g))
    assert pcm.dtype == torch.float32 and pcm.shape == (1, 8 * 480 - m.cfg.hift_source_cache)
    assert {(k.component, k.dtype) for k in asked} == {("flow_encoder", "float32"), ("cfm", "float32"),
                                                        ("hift", "float16")}
    manifest = type("M", (), {"model": ModelRef(spec="random:tiny", digest=m.digest, config="tiny"),
                              "backend": BackendRef(name="onnxruntime", version="x"), "device": "cpu",
                              "precision": {"flow_encoder": "float32", "cfm": "float32", "hift": "float32"}})
    assert manifest_mismatch(manifest, m, None, torch.device("cpu")) == \
        "hift precision float32 != loaded model's float16"
