"""`c2w bench` plumbing on the tiny CPU artifacts: schema and same-function checks, never a time."""
import json

from typer.testing import CliRunner

from cli import app
from exporter.bench import bench_dir, to_markdown
from runtime.units import SPECS


def test_bench_schema_and_same_function(ort_artifacts):
    res = bench_dir(ort_artifacts, reps=2, warmup=1, peer=False,
                    keys=["cfm-B1-T50-L150-float32", "hift-B1-F58-S3840-float32"])
    assert {"device", "torch", "backend", "model", "precision", "commit", "keys", "stream"} <= set(res)
    assert [r["id"] for r in res["keys"]] == ["cfm-B1-T50-L150-float32", "hift-B1-F58-S3840-float32"]
    for r in res["keys"]:
        for v in ("eager", "engine"):
            assert r[v]["reps"] == 2 and r[v]["median_ms"] > 0 and r[v]["p95_ms"] >= r[v]["median_ms"]
        # the engine timed is the eager function: same outputs on the same inputs
        assert r["engine"]["max_rel_l2_vs_eager"] <= SPECS[r["component"]].rtol[r["dtype"]]
        assert r["speedup_vs_eager"] > 0
    rows = [s for s in res["stream"] if "B" in s]
    assert [(s["B"], s["chunk_tokens"]) for s in rows] == [(1, 28)]
    assert rows[0]["audio_s_per_s_first"] > 0
    stats = res["stream"][-1]["cache_stats"]
    assert stats["cfm"]["cfm-B1-T50-L100-float32"]["hits"] > 0        # the engine rows used engines
    md = to_markdown(res)
    assert "| cfm-B1-T50-L150-float32 |" in md and "| 1 | 28 |" in md


def test_bench_cli_writes_json_and_markdown(ort_artifacts, tmp_path):
    out = tmp_path / "b.json"
    r = CliRunner().invoke(app, ["bench", str(ort_artifacts), "--out", str(out), "--reps", "1", "--no-peer",
                                 "--keys", "flow_encoder-B1-N28-C100-last0-float32", "--batches", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["keys"][0]["id"] == "flow_encoder-B1-N28-C100-last0-float32"
    assert out.with_suffix(".md").read_text().startswith("Device cpu")
