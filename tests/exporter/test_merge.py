"""`c2w merge`: each key from the shard that built it, its files copied, the result verifiable."""
import json
import shutil

import pytest
from typer.testing import CliRunner

from c2w.cli import app
from c2w.runtime.manifest import read_manifest

runner = CliRunner()


def _as_shard(src, dst, keep):
    """A copy of `src` as if a shard job had built only the entries `keep` selects."""
    shutil.copytree(src, dst)
    d = json.loads((dst / "manifest.json").read_text())
    for e in d["entries"]:
        if not keep(e):
            (dst / e["artifact"]).unlink()
            e.update(status="pending", artifact=None, artifact_bytes=0, artifact_sha256="", parity={})
    (dst / "manifest.json").write_text(json.dumps(d))
    return dst


@pytest.mark.slow
def test_merge_takes_each_key_from_the_shard_that_built_it(ort_artifacts, tmp_path, recorded_parity):
    cfm = _as_shard(ort_artifacts, tmp_path / "s1", lambda e: e["component"] == "cfm")
    rest = _as_shard(ort_artifacts, tmp_path / "s2", lambda e: e["component"] != "cfm")
    result = runner.invoke(app, ["merge", str(tmp_path / "all"), str(cfm), str(rest)])
    assert result.exit_code == 0 and "8 built entries from 2 shards" in result.output, result.output
    merged = read_manifest(tmp_path / "all")
    assert [e.id for e in merged.entries] == [e.id for e in read_manifest(ort_artifacts).entries]
    assert {e.status for e in merged.entries} == {"built"}
    assert [p.name for p in (tmp_path / "all").rglob("*") if ".tmp" in p.name] == []
    # every file the merged manifest names has its recorded size and sha256 (parity: as recorded)
    assert runner.invoke(app, ["verify", str(tmp_path / "all")]).exit_code == 0
    assert len(recorded_parity) == 8
