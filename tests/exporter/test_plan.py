"""Sweep planning (exporter/plan.py): weight bytes at the profile's precision, the budget filled
in order with each component's weights charged once, and the note and error when nothing fits."""
import dataclasses

import pytest

from c2w.exporter.estimate import FixedSizes, estimate_bytes
from c2w.exporter.plan import Plan, PlannedKey, _fill, dims_str, make_plan, precision_weights, require_selection
from c2w.exporter.profile import load_profile
from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.weights import load_model
from c2w.runtime.units import ShapeKey
from tests.conftest import small_profile

CFM_A, CFM_B = ShapeKey("cfm", (1, 50, 100), "float32"), ShapeKey("cfm", (1, 50, 150), "float32")
HIFT = ShapeKey("hift", (1, 58, 3840), "float32")


def test_weight_bytes_count_float16_only_on_hifts_conv_stack():
    """The planner charges HiFT's convolutions at 2 bytes and its float32 parts (f0 predictor, NSF
    source, Snake alphas, STFT / ISTFT kernels) at 4, before and after the exporter's cast."""
    import dataclasses

    from c2w.exporter.plan import precision_weights, weight_bytes
    from c2w.exporter.profile import Precision
    from c2w.runtime.model.weights import load_model
    from c2w.runtime.precision import component_dtypes
    model = load_model("random:tiny")
    stack = sum(t.numel() for m in model.hift.precision_modules() for t in m.parameters())
    total = weight_bytes(model)["hift"]
    p = dataclasses.replace(load_profile("cpu"), precision=Precision(hift="float16"))
    assert precision_weights(model, p)["hift"] == total - 2 * stack
    assert precision_weights(model.to("cpu", component_dtypes({"hift": "float16"})), p)["hift"] == total - 2 * stack
    assert weight_bytes(model)["hift"] == total - 2 * stack            # as the model holds them now


def test_fill_charges_a_components_weights_with_its_first_key_only_when_engines_share_them():
    """Budget 75, weights 50 per component: with shared weights two CFM keys fit (50 + 10 + 10) and
    HiFT (50 + 5 more) does not; with a copy of the weights per key only the first CFM key fits."""
    est, weights = {CFM_A: 10, CFM_B: 10, HIFT: 5}, {"cfm": 50, "hift": 50}
    assert _fill([CFM_A, CFM_B, HIFT], FixedSizes(est), weights, 75, True) == \
        ({CFM_A: True, CFM_B: True, HIFT: False}, est)
    assert _fill([CFM_A, CFM_B, HIFT], FixedSizes(est), weights, 75, False)[0] == \
        {CFM_A: True, CFM_B: False, HIFT: False}
    assert _fill([HIFT, CFM_A], FixedSizes(est), weights, 55, True)[0] == {HIFT: True, CFM_A: False}   # = budget fits


def test_planned_total_counts_the_selected_keys_and_their_weights():
    entries = [PlannedKey(CFM_A, "steady", 5, True), PlannedKey(CFM_B, "steady", 7, True),
               PlannedKey(HIFT, "first", 3, False)]
    weights = {"flow_encoder": 1, "cfm": 100, "hift": 10}
    assert Plan(entries, weights, 1000, shares_weights=True).planned_total() == 100 + 5 + 7
    assert Plan(entries, weights, 1000, shares_weights=False).planned_total() == 2 * 100 + 5 + 7
    assert [e.key for e in Plan(entries, weights, 1000, True).skipped] == [HIFT]


def test_a_budget_that_fits_no_key_leaves_a_note_and_require_selection_raises_it():
    p = dataclasses.replace(small_profile(), budget_bytes=1 << 20)
    model = load_model(p.model)
    plan = make_plan(model.cfg, p, precision_weights(model, p))
    assert plan.selected == [] and len(plan.entries) == 8
    assert plan.notes[-1].startswith("no key fits the budget of 1.0 MiB; the smallest (")
    assert plan.notes[-1].endswith("with its component's weights: everything would be served eagerly")
    with pytest.raises(C2WUserError, match=r"profile p\.yaml: 'budget_bytes': received no key fits the budget of "
                                           r"1\.0 MiB.*expected a budget that fits at least one key"):
        require_selection(plan, "p.yaml")
    require_selection(make_plan(model.cfg, small_profile(), precision_weights(model, p)), "p.yaml")   # 2 GiB: fine


def test_dims_str_names_each_dim_of_the_key():
    assert dims_str(CFM_B) == "B=1 T=50 L=150"
    assert dims_str(ShapeKey("flow_encoder", (2, 28, 100, 0), "float32")) == "B=2 N=28 C=100 last=0"


def test_aoti_cuda_keys_are_estimated_next_to_the_selected_keys_before_them():
    """h200.yaml (AOTInductor on CUDA, run 10's weight bytes): each entry's est_bytes is what it adds
    to a load of the selected keys before it in plan order (exporter.estimate.GraphPoolSizes), the
    ranking's own per-key estimate aside; a key the budget skips does not join the load. All 96 keys
    fit the 100 GiB budget; with a budget that skips one, the keys after it are estimated without it."""
    from pathlib import Path

    from c2w.exporter.estimate import GraphPoolSizes
    from c2w.runtime.manifest import read_manifest
    from c2w.runtime.model.config import preset
    cfg, p = preset("full"), load_profile("h200")
    weights = read_manifest(Path(__file__).parents[2] / "benchmarks" / "h200" / "results" / "run10_sweep").weight_bytes

    def replayed(plan):
        pool, out = GraphPoolSizes(cfg, weights), []
        for e in plan.entries:
            out.append(pool.cost(e.key))
            if e.selected:
                pool.add(e.key)
        return out

    plan = make_plan(cfg, p, weights)
    assert len(plan.entries) == len(plan.selected) == 96
    assert [e.est_bytes for e in plan.entries] == replayed(plan)
    # a budget 1 MiB short of the first CFM key that needs more than 200 MiB (in-place step): it and the ones like it go
    i = next(i for i, e in enumerate(plan.entries) if e.key.component == "cfm" and e.est_bytes > 200 << 20)
    head = plan.entries[:i + 1]
    room = sum(weights[c] for c in {e.key.component for e in head}) + sum(e.est_bytes for e in head) - (1 << 20)
    cut = make_plan(cfg, dataclasses.replace(p, budget_bytes=room), weights)
    assert [e.key for e in cut.entries] == [e.key for e in plan.entries]
    assert not cut.entries[i].selected and [e.est_bytes for e in cut.entries] == replayed(cut)
    assert cut.planned_total() <= room
    # other devices keep the order-free estimate, whatever the order
    cpu = make_plan(cfg, dataclasses.replace(p, device="cpu", traffic=None), weights)
    assert {e.key: e.est_bytes for e in cpu.entries} == {e.key: estimate_bytes(cfg, e.key) for e in cpu.entries}
