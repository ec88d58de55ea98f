"""`c2w report` (exporter/report.py): the manifest as a table, markdown and JSON, and the memory plot."""
import json

from typer.testing import CliRunner

from c2w.cli import app
from c2w.exporter.report import plot, render
from c2w.runtime.manifest import read_manifest

runner = CliRunner()


def test_report_formats_and_plot(ort_artifacts, tmp_path):
    m = read_manifest(ort_artifacts)
    table = render(m, "table")
    assert "cfm" in table and "B=1 T=50 L=150" in table and "8 built" in table
    md = render(m, "markdown")
    assert md.count("\n| cfm") == 3
    js = json.loads(render(m, "json"))
    assert js["summary"]["counts"] == {"built": 8}
    assert js["summary"]["total_bytes"] == (js["summary"]["weight_bytes"] + js["summary"]["engine_shared_bytes"]
                                            + js["summary"]["measured_key_bytes"])
    png = plot(m, tmp_path / "mem.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    result = runner.invoke(app, ["report", str(ort_artifacts), "--format", "markdown"])
    assert result.exit_code == 0 and "| flow_encoder" in result.output
