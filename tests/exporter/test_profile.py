"""Profile paths and YAML errors: what a user typing a path gets."""
import pytest
from typer.testing import CliRunner

from c2w.cli import app
from c2w.exporter.profile import BUNDLED, load_profile, resolve_profile_path
from c2w.runtime.errors import C2WUserError

runner = CliRunner()


@pytest.mark.parametrize("name", ["/some/dir/cpu.yaml", "./myprofiles/h200", "./h100", "myprofiles/h100.yaml"])
def test_a_missing_path_never_falls_back_to_a_bundled_profile(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(C2WUserError, match=r"no such file\); expected an existing YAML file path"):
        resolve_profile_path(name)


def test_a_directory_is_an_error_even_with_a_bundled_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d" / "h100").mkdir(parents=True)
    (tmp_path / "cpu").mkdir()
    for name in ("d/h100", "cpu"):
        with pytest.raises(C2WUserError, match=r"\(a directory\)"):
            resolve_profile_path(name)


def test_bare_names_resolve_to_bundled_unless_a_local_file_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_profile_path("h100") == BUNDLED / "h100.yaml"
    assert resolve_profile_path("h100.yaml") == BUNDLED / "h100.yaml"
    (tmp_path / "h100.yaml").write_text("name: mine\n")
    assert resolve_profile_path("h100.yaml").resolve() == (tmp_path / "h100.yaml").resolve()
    assert load_profile("h100.yaml").name == "mine"


def test_yaml_syntax_error_is_one_line_naming_file_line_and_column(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("name: x\nschedule:\n  batch_sizes: [1, 2\n  chunk_tokens: [28]\n")
    result = runner.invoke(app, ["plan", "--profile", str(f)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert f"{f}:4:15:" in " ".join(result.output.split()) and "<unicode string>" not in result.output


def test_non_utf8_profile_is_a_user_error(tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(C2WUserError, match="a UTF-8 YAML file"):
        load_profile(f)


def test_the_runtime_names_the_backends_and_each_has_a_builder():
    """One list of backend names, the runtime's registry: profiles accept exactly those, and the
    exporter has a builder for each (and for nothing else)."""
    from c2w.exporter import profile
    from c2w.exporter.backends import _BUILDERS, get_builder
    from c2w.runtime.engines import NAMES
    assert profile.BACKENDS is NAMES
    assert sorted(_BUILDERS) == sorted(NAMES)
    assert [get_builder(name).name for name in NAMES] == list(NAMES)


def test_hift_float16_parses_and_names_its_keys_float16():
    from c2w.exporter.profile import Precision, parse_profile
    p = parse_profile({"precision": {"cfm": "float16", "hift": "float16", "tf32": False},
                       "extra_keys": [{"component": "hift", "B": 32, "F": 158, "S": 3840}]}, "p.yaml")
    assert p.precision == Precision(cfm="float16", hift="float16", tf32=False)
    assert [k.id for k in p.extra_keys] == ["hift-B32-F158-S3840-float16"]


@pytest.mark.parametrize("precision, match", [
    ({"hift": "bfloat16"},
     r"p.yaml: 'precision.hift': received 'bfloat16'; expected one of \['float16', 'float32'\] \(bfloat16 "
     r"convolutions measured 27.7-29.7 dB SNR against float32 at B=32 F=158 on the H200 \(float16: 48.6 dB\), "
     r"below the fidelity bar"),
    ({"hift": "float16", "tf32": True},
     r"p.yaml: 'precision.tf32': received true; expected false with hift: float16 \(its float32 parts, the f0 "
     r"predictor above all, were measured with TF32 off; .*38.7 dB.*48.6 dB\)\. Set tf32: false"),
    ({"hift": "float64"}, r"'precision.hift': received 'float64'; expected one of \['float16', 'float32'\]$"),
    ({"flow_encoder": "int8"}, r"'precision.flow_encoder': received 'int8'; expected one of \['bfloat16', 'float16', "
                               r"'float32'\]$"),
    ({"hift": 16}, r"'precision.hift': received int 16; expected str"),
    ({"tf32": "yes"}, r"'precision.tf32': received str 'yes'; expected bool"),
])
def test_precision_policy_rejects_what_a_unit_does_not_support(precision, match):
    from c2w.exporter.profile import parse_profile
    with pytest.raises(C2WUserError, match=match):
        parse_profile({"precision": precision}, "p.yaml")
