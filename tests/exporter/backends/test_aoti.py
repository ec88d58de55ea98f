"""The AOTI builder's settings: the profile's `aoti` section, each field overridden by its
environment variable, and which of them reach an artifact's identity. Nothing is compiled."""
import dataclasses
import shutil

import pytest

from c2w.exporter.backends import get_builder
from c2w.exporter.backends.aoti import AOTIBuilder, aoti_compiler, inductor_overrides
from c2w.exporter.backends.base import BuildJob
from c2w.exporter.export import _Run, artifact_groups, new_manifest, prepare_model
from c2w.exporter.plan import make_plan, precision_weights
from c2w.exporter.profile import AOTISettings, load_profile, parse_profile
from c2w.runtime.errors import C2WUserError


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("C2W_AOTI_INDUCTOR", raising=False)
    monkeypatch.delenv("C2W_AOTI_CXX", raising=False)


def aoti_profile(**aoti):
    p = load_profile("cpu")
    return dataclasses.replace(p, backend="aoti", schedule=dataclasses.replace(p.schedule, max_chunks=1),
                               aoti=AOTISettings(**aoti))


def first_identity(profile, tmp_path) -> str:
    """The identity the export loop gives the first artifact of `profile` (no build)."""
    builder = get_builder("aoti")
    model, device = prepare_model(profile)
    plan = make_plan(model.cfg, profile, precision_weights(model, profile), shares_weights=True)
    run = _Run(profile, tmp_path, builder, model, device, new_manifest(profile, model, "v", device, plan), plan)
    _, pks = artifact_groups(builder, plan)[0]
    run.identify(pks)
    return run.entry(pks[0].key.id).identity


def test_profile_section_parses_and_defaults():
    p = parse_profile({"backend": "aoti", "aoti": {"inductor_options": {"max_autotune": False, "combo_kernels": True},
                                                   "cxx": "/usr/bin/g++"}})
    assert p.aoti.inductor_options == (("combo_kernels", True), ("max_autotune", False))     # sorted
    assert p.aoti.inductor == {"combo_kernels": True, "max_autotune": False}
    assert p.aoti.cxx == "/usr/bin/g++"
    for section in (None, {}, {"inductor_options": None, "cxx": None}):                   # null: the default
        assert parse_profile({"aoti": section}).aoti == AOTISettings()
    assert parse_profile({}).aoti == AOTISettings(inductor_options=(), cxx=None)


@pytest.mark.parametrize("section,match", [
    ({"inductor": {}}, r"'aoti': received unknown key\(s\) \['inductor'\]; expected keys among \['cxx', "
                       r"'inductor_options'\]"),
    ("combo_kernels", r"'aoti': received str 'combo_kernels'; expected a mapping"),
    ({"inductor_options": ["combo_kernels"]}, r"'aoti.inductor_options': received list .*expected a mapping of "
                                              r"Inductor config names to values"),
    ({"inductor_options": {1: True}}, r"'aoti.inductor_options': received names \[1\]"),
    ({"inductor_options": {"combo_kernels": None}}, r"received null for \['combo_kernels'\]; expected a value for "
                                                    r"every name\. Leave a name out"),
    ({"cxx": 5}, r"'aoti.cxx': received int 5; expected str"),
    ({"cxx": " "}, r"'aoti.cxx': received ' '; expected a compiler name or path"),
])
def test_profile_section_errors(section, match):
    with pytest.raises(C2WUserError, match=match):
        parse_profile({"aoti": section}, "p.yaml")


def test_inductor_options_env_overrides_the_profile(monkeypatch):
    builder = AOTIBuilder(get_builder("aoti").backend)
    profile = aoti_profile(inductor_options=(("combo_kernels", True),))
    assert builder.build_options(aoti_profile()) == {}
    assert builder.build_options(profile) == {"combo_kernels": True}
    monkeypatch.setenv("C2W_AOTI_INDUCTOR", '{"max_autotune": true}')     # replaces the profile's, not merged
    assert builder.build_options(profile) == {"max_autotune": True}
    monkeypatch.setenv("C2W_AOTI_INDUCTOR", "  ")                          # blank counts as unset
    assert builder.build_options(profile) == {"combo_kernels": True}


def test_inductor_options_are_checked_wherever_they_come_from(monkeypatch):
    with pytest.raises(C2WUserError, match=r"profile 'aoti.inductor_options': received unknown Inductor config\(s\) "
                                           r"\['combo_kernel'\]; expected names of torch._inductor.config in torch "
                                           r".*combo_kernel: did you mean combo_kernels\?"):
        inductor_overrides({"combo_kernel": True})
    with pytest.raises(C2WUserError, match=r"profile 'aoti.inductor_options': received "
                                           r"\['aot_inductor.package_constants_in_so'\]; expected only configs c2w"):
        inductor_overrides({"aot_inductor.package_constants_in_so": True})
    monkeypatch.setenv("C2W_AOTI_INDUCTOR", '{"no_such_config": 1}')
    with pytest.raises(C2WUserError, match=r"environment variable C2W_AOTI_INDUCTOR: received unknown Inductor "
                                           r"config\(s\) \['no_such_config'\]"):
        inductor_overrides({"combo_kernels": True})
    monkeypatch.setenv("C2W_AOTI_INDUCTOR", '{"combo_kernels": null}')
    with pytest.raises(C2WUserError, match=r"C2W_AOTI_INDUCTOR: received null for \['combo_kernels'\]"):
        inductor_overrides()


def test_compiler_env_overrides_the_profile_and_the_default_stays_gpp(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "/opt/static-gcc/bin/g++")          # the GPU image's $CXX: never the default
    gpp = shutil.which("g++")
    assert aoti_compiler() == (gpp or "/opt/static-gcc/bin/g++")  # $CXX only when no g++ is on PATH
    cc = tmp_path / "my-g++"
    cc.write_text("#!/bin/sh\n")
    cc.chmod(0o755)
    assert aoti_compiler(str(cc)) == str(cc)
    monkeypatch.setenv("C2W_AOTI_CXX", "sh")                      # any command on PATH
    assert aoti_compiler(str(cc)) == "sh"
    monkeypatch.setenv("C2W_AOTI_CXX", str(tmp_path / "missing"))
    with pytest.raises(C2WUserError, match=r"environment variable C2W_AOTI_CXX: received '.*missing' \(not an "
                                           r"executable, nor a command on PATH\); expected a C\+\+ compiler"):
        aoti_compiler(str(cc))
    monkeypatch.delenv("C2W_AOTI_CXX")
    with pytest.raises(C2WUserError, match=r"profile 'aoti.cxx': received '.*nope'"):
        AOTIBuilder(get_builder("aoti").backend).build_options(aoti_profile(cxx=str(tmp_path / "nope")))


def test_the_build_gets_the_profiles_compiler_and_the_identitys_options(monkeypatch, tmp_path):
    from c2w.exporter.backends import aoti
    calls = []
    monkeypatch.setattr(aoti, "build_aoti", lambda *a: calls.append(a) or {})
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n")
    cc.chmod(0o755)
    profile = aoti_profile(cxx=str(cc), inductor_options=(("combo_kernels", True),))
    builder = AOTIBuilder(get_builder("aoti").backend)
    job = BuildJob(model=None, device=None, profile=profile, group="g", keys=["k"], units=["u"], path=tmp_path / "x",
                   out_dir=tmp_path, build_options=builder.build_options(profile))
    monkeypatch.setattr(BuildJob, "example_inputs", lambda self, key: ["in"])
    builder.build(job)
    assert calls[0][5:] == ({"combo_kernels": True}, str(cc))


def test_identity_follows_the_inductor_options(monkeypatch, tmp_path):
    """Inductor options change the engine: an entry built with others is a miss. The default
    leaves the identity as it was before these settings existed, so existing artifacts still hit."""
    default = first_identity(aoti_profile(), tmp_path)
    combo = first_identity(aoti_profile(inductor_options=(("combo_kernels", True),)), tmp_path)
    assert combo != default
    monkeypatch.setenv("C2W_AOTI_INDUCTOR", '{"combo_kernels": true}')
    assert first_identity(aoti_profile(), tmp_path) == combo           # same engine, however it was asked for
    monkeypatch.setenv("C2W_AOTI_INDUCTOR", '{"combo_kernels": false}')
    assert first_identity(aoti_profile(inductor_options=(("combo_kernels", True),)), tmp_path) not in (combo, default)
    monkeypatch.delenv("C2W_AOTI_INDUCTOR")
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n")
    cc.chmod(0o755)
    assert first_identity(aoti_profile(cxx=str(cc)), tmp_path) == default   # the compiler is recorded, not hashed


class _Exported(Exception):
    pass


@pytest.mark.parametrize("component", ["cfm", "hift"])
def test_build_compiles_the_specs_export_variant_where_it_has_one(monkeypatch, tmp_path, component):
    """The CFM's spec names one Euler step as its export variant: that module and its inputs are
    what gets exported; a unit without a variant is exported whole with its own inputs."""
    import torch

    from c2w.exporter.backends.aoti import build_aoti
    from c2w.runtime.model.weights import load_model
    from c2w.runtime.units import SPECS, CFMStepUnit, ShapeKey

    seen = []

    def export(unit, args, strict):
        seen.append((unit, args))
        raise _Exported

    monkeypatch.setattr(torch.export, "export", export)
    model = load_model("random:tiny")
    key = (ShapeKey.named("cfm", "float32", B=1, T=50, L=100) if component == "cfm"
           else ShapeKey.named("hift", "float32", B=1, F=50, S=0))
    spec = SPECS[component]
    unit, inputs = spec.build(model, key), spec.example_inputs(model.cfg, key)
    with pytest.raises(_Exported):
        build_aoti(model, unit, key, inputs, tmp_path / "x.pt2", {}, "g++")
    (got_unit, args), = seen
    if component == "cfm":
        assert isinstance(got_unit, CFMStepUnit) and not got_unit.training
        T, att = inputs[0].shape[2], inputs[5].shape    # per block: a buffer of T + L frames
        assert [tuple(a.shape) for a in args] == [tuple(t.shape) for t in inputs[:4]] + [
            tuple(inputs[4].shape[1:]), (1,), (1,), (T,)] + [(*att[2:4], T + att[4], att[5])] * att[1]
    else:
        assert got_unit is unit and [a is t for a, t in zip(args, inputs)] == [True, True]


def test_inductor_timers_report_what_each_build_added(monkeypatch):
    """A build records how much each of Inductor's timers grew during it; a timer that dynamo
    cleared in between counts from zero; timers that did not move are left out."""
    import torch._dynamo.utils as dynamo_utils

    from c2w.exporter.backends.aoti import inductor_timers
    metrics = {"GraphLowering.run": [1.0, 2.0], "AotCodeCompiler.compile": [5.0], "Scheduler.codegen": [1.0],
               "not.a.kept.timer": [9.0]}
    monkeypatch.setattr(dynamo_utils, "compilation_time_metrics", metrics)
    before = inductor_timers()
    assert before == {"GraphLowering.run": 3.0, "AotCodeCompiler.compile": 5.0, "Scheduler.codegen": 1.0}
    metrics["GraphLowering.run"].append(0.5)
    metrics["AotCodeCompiler.compile"][:] = [2.25]          # cleared, then 2.25 s
    metrics["fx_codegen_and_compile"] = [4.0]
    assert inductor_timers(since=before) == {"GraphLowering.run": 0.5, "AotCodeCompiler.compile": 2.25,
                                             "fx_codegen_and_compile": 4.0}
