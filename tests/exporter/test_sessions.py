"""The ShapeKeys a stream's calls hit (exporter/sessions.py): set-up, chunks with their growing
and trimmed caches, the final chunk, in the schedule's stream order."""
import dataclasses

from c2w.exporter.sessions import chunk_keys, setup_keys, stream_keys, tail_keys
from c2w.runtime.model.config import TINY
from c2w.runtime.model.weights import load_model
from c2w.runtime.units import ShapeKey
from c2w.exporter.profile import load_profile
from tests.conftest import small_profile


def _profile(**schedule):
    """profiles/cpu.yaml (P = 100, 28-token chunks) with `schedule` changed."""
    p = load_profile("cpu")
    return dataclasses.replace(p, schedule=dataclasses.replace(p.schedule, **schedule))


def test_planner_follows_the_stream_schedule():
    p = small_profile(tail_tokens=(13,))
    model = load_model(p.model)
    keys = stream_keys(model.cfg, p)
    cfm = [k.dims for c, k in keys if k.component == "cfm" and c != "tail"]
    assert cfm == [(1, 50, 100), (1, 50, 150), (1, 50, 200)]        # P -> P+50 -> P+100 (trimmed)
    hift = [k.dims for c, k in keys if k.component == "hift" and c != "tail"]
    assert hift == [(1, 50, 0), (1, 58, 3840), (1, 58, 3840)]
    tail = {k.component: k.dims for c, k in keys if c == "tail"}
    assert tail == {"flow_encoder": (1, 13, 200, 1), "cfm": (1, 26, 200), "hift": (1, 34, 3840)}


def test_setup_keys_run_the_encoder_over_half_the_prompt_plus_lookahead_and_the_cfm_over_it():
    p = _profile()                                                # P = 100 mel frames
    assert setup_keys(TINY, p, 2) == [ShapeKey("flow_encoder", (2, 53, 0, 0), "float32"),
                                      ShapeKey("cfm", (2, 100, 0), "float32")]


def test_without_trim_conformer_only_the_estimator_cache_is_trimmed():
    """Four 28-token chunks (T = 50 frames each) after a P = 100 prompt: the estimator cache stops
    at P + 100; the conformer cache keeps growing unless the schedule trims it too."""
    trimmed = _profile(max_chunks=4)
    untrimmed = _profile(max_chunks=4, trim_conformer=False)
    chunks, C, L = chunk_keys(TINY, untrimmed, 1, 28, 4)
    assert [k[0].dim("C") for k in chunks] == [100, 150, 200, 250] and (C, L) == (300, 200)
    assert [k[1].dim("L") for k in chunks] == [100, 150, 200, 200]
    chunks, C, L = chunk_keys(TINY, trimmed, 1, 28, 4)
    assert [k[0].dim("C") for k in chunks] == [100, 150, 200, 200] and (C, L) == (200, 200)
    # HiFT: the first chunk has no source cache, every later one 8 cached frames and 3840 samples
    assert [k[2].dims for k in chunks] == [(1, 50, 0)] + [(1, 58, 3840)] * 3
    assert tail_keys(TINY, untrimmed, 1, 13, 300, 200)[0] == ShapeKey("flow_encoder", (1, 13, 300, 1), "float32")


def test_stream_keys_list_set_up_chunks_tails_and_extra_keys_per_batch_size():
    extra = ShapeKey("hift", (4, 58, 3840), "float32")
    p = _profile(batch_sizes=(1, 2), max_chunks=2, setup_keys=True, tail_tokens=(13, 7))
    p = dataclasses.replace(p, extra_keys=(extra,))
    cats = [(c, k.dim("B") if k is not extra else None) for c, k in stream_keys(TINY, p)]
    per_b = ["setup"] * 2 + ["first"] * 3 + ["steady"] * 3 + ["tail"] * 6
    assert cats == [(c, 1) for c in per_b] + [(c, 2) for c in per_b] + [("extra", None)]
