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
