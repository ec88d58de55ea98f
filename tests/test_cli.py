"""The CLI as an adapter: help text and how user errors print."""
import sys

from typer.testing import CliRunner

from c2w.cli import app

runner = CliRunner()


def test_help_shows_no_type_label_on_flags():
    for cmd in ("export", "bench", "verify", "report", "plan"):
        out = runner.invoke(app, [cmd, "--help"]).output
        assert "--help" in out and "<bool>" not in out, out
    assert "--dry-run " in runner.invoke(app, ["export", "--help"]).output


def test_user_errors_print_brackets_as_written(tmp_path, monkeypatch, ort_artifacts):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # not installed
    r = runner.invoke(app, ["report", str(ort_artifacts), "--plot", str(tmp_path / "m.png")])
    assert r.exit_code == 2 and "c2w[plot]" in r.output and "pip install matplotlib" in r.output


def test_bench_serve_refuses_an_unknown_kind_of_client(tmp_path):
    """--clients is checked before anything loads: one line naming what came and what may."""
    r = runner.invoke(app, ["bench", str(tmp_path), "--serve", "--clients", "processes"])
    assert r.exit_code == 2 and "--clients: received 'processes'; expected threads or asyncio" in r.output, r.output
