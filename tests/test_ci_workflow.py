""".github/workflows/engines.yml run here, so the file cannot rot: its shard, merge, report,
verify and cache-key steps, as written, on a tiny CPU profile with two shards; the actions it
uses (checkout, cache, artifact transfer) are stood in for by copies between directories."""
import fnmatch
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from c2w.exporter.plan import make_plan, precision_weights
from c2w.runtime.model.weights import load_model
from tests.conftest import ROOT, THREADS, small_profile

WORKFLOW = ROOT / ".github" / "workflows" / "engines.yml"
SHARDS = 2


def _expand(text: str, values: dict) -> str:
    """Replace every ${{ expr }} by values[expr]; an expression the test does not know fails it."""
    def sub(m):
        expr = m.group(1)
        assert expr in values, f"engines.yml uses ${{{{ {expr} }}}}, which this test does not stand in for"
        return values[expr]
    return re.sub(r"\$\{\{\s*(.*?)\s*\}\}", sub, text)


def _run_steps(job: dict, values: dict, env: dict) -> dict[str, str]:
    """Run the job's `run` steps but the install, in order, in the repository root (the checkout);
    returns each step's stdout."""
    out = {}
    for step in job["steps"]:
        if "run" not in step or step.get("id") == "install":
            continue
        res = subprocess.run(["bash", "-eo", "pipefail", "-c", _expand(step["run"], values)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"step {step.get('id')}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
        out[step["id"]] = res.stdout
    return out


def _ci_profile(tmp_path: Path) -> Path:
    """profiles/cpu.yaml at B=1 and 3 chunks, with a budget that leaves the CFM out: 5 cheap keys."""
    p = small_profile()
    model = load_model(p.model)
    w = precision_weights(model, p)
    others = [e for e in make_plan(model.cfg, p, w).entries if e.key.component != "cfm"]
    budget = w["flow_encoder"] + w["hift"] + sum(e.est_bytes for e in others) + (96 << 20)
    data = yaml.safe_load((ROOT / "profiles" / "cpu.yaml").read_text())
    data.update(name="ci", budget_bytes=budget)
    data["schedule"].update(batch_sizes=list(p.schedule.batch_sizes), max_chunks=p.schedule.max_chunks)
    f = tmp_path / "ci.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def _with(step: dict, values: dict) -> dict:
    """The step's `with:` inputs, expressions replaced."""
    return {k: _expand(str(v), values) for k, v in step.get("with", {}).items()}


@pytest.mark.slow
def test_workflow_builds_two_shards_merges_verifies_and_keys_the_cache(ort_artifacts, tmp_path):
    wf = yaml.safe_load(WORKFLOW.read_text())
    build, merge = wf["jobs"]["build"], wf["jobs"]["merge"]
    assert merge["needs"] == "build"
    assert build["strategy"]["matrix"]["shard"][:SHARDS] == list(range(1, SHARDS + 1))
    by_id = {job: {s.get("id"): s for s in wf["jobs"][job]["steps"]} for job in ("build", "merge")}

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "c2w").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT / "cli.py"}" "$@"\n')
    (bin_dir / "c2w").chmod((bin_dir / "c2w").stat().st_mode | stat.S_IEXEC)
    prefix = wf["env"]["CACHE_PREFIX"]
    profile = _ci_profile(tmp_path)

    def runner(name: str, extra: dict) -> tuple[dict, dict]:
        d = tmp_path / name
        (d / "temp").mkdir(parents=True)
        env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               "OMP_NUM_THREADS": str(THREADS), "PROFILE": str(profile), "CACHE_PREFIX": prefix,
               "OUT": str(d / "engines"), "RUNNER_TEMP": str(d / "temp"),
               "GITHUB_OUTPUT": str(d / "output"), "GITHUB_STEP_SUMMARY": str(d / "summary.md")}
        values = {"env.OUT": env["OUT"], "env.PROFILE": env["PROFILE"], "env.CACHE_PREFIX": prefix,
                  "runner.temp": env["RUNNER_TEMP"], "strategy.job-total": str(SHARDS), **extra}
        return env, values

    # the shard jobs run side by side, each from the newest snapshot the cache holds (here: an
    # earlier export of these keys and the CFM's), and hand their directories to the merge job.
    # (Building a key here would take most of a minute on 2 cores; resume after a lost artifact is
    # test_export.py's test_resume_rebuilds_only_the_deleted_artifact.)
    merge_env, merge_values = runner("merge", {})
    shards_dir = Path(_with(by_id["merge"]["download"], merge_values)["path"])
    jobs = []
    for k in range(1, SHARDS + 1):
        env, values = runner(f"shard{k}", {"matrix.shard": str(k)})
        restore = _with(by_id["build"]["restore"], values)
        assert restore["path"] == env["OUT"] and restore["restore-keys"] == prefix    # the merge's snapshots
        assert f'--shard {k}/{SHARDS} --out "$OUT"' in _expand(by_id["build"]["export"]["run"], values)
        shutil.copytree(ort_artifacts, restore["path"])
        jobs.append((env, values))
    with ThreadPoolExecutor(SHARDS) as pool:
        exported = [o["export"] for o in pool.map(lambda job: _run_steps(build, job[1], job[0]), jobs)]
    for env, values in jobs:
        upload = _with(by_id["build"]["upload"], values)
        assert upload["path"] == env["OUT"]
        assert fnmatch.fnmatch(upload["name"], by_id["merge"]["download"]["with"]["pattern"])
        shutil.copytree(upload["path"], shards_dir / upload["name"])
    # an unchanged key is never rebuilt: every shard keeps all 5 (its own and the other's); the 3
    # CFM keys the restored directory holds do not fit this profile's budget by their recorded
    # measurement, so they are over budget (and their files removed), not rebuilt
    assert [re.search(r"\d+ built, \d+ reused, \d+ over budget, \d+ failed", o).group() for o in exported] == \
        ["0 built, 5 reused, 3 over budget, 0 failed"] * SHARDS, exported

    steps = _run_steps(merge, merge_values, merge_env)
    assert "5/5 artifacts pass" in " ".join(steps["verify"].split())
    summary = (tmp_path / "merge" / "summary.md").read_text()      # c2w report's markdown, one row per key
    assert "|---" in summary and all(f"| {dims} |" in summary for dims in (
        "B=1 N=28 C=150 last=0", "B=1 F=58 S=3840", "B=1 T=50 L=150"))
    merged = json.loads((Path(merge_env["OUT"]) / "manifest.json").read_text())
    assert sorted(e["id"] for e in merged["entries"] if e["status"] == "built") == sorted(
        ["flow_encoder-B1-N28-C100-last0-float32", "flow_encoder-B1-N28-C150-last0-float32",
         "flow_encoder-B1-N28-C200-last0-float32", "hift-B1-F50-S0-float32", "hift-B1-F58-S3840-float32"])

    # the snapshot is saved under a key the next run's restore finds, derived from what it holds
    key = re.fullmatch(r"cache-key=(.+)\n", (tmp_path / "merge" / "output").read_text()).group(1)
    save = _with(by_id["merge"]["save"], {**merge_values, "steps.key.outputs.cache-key": key})
    assert save["path"] == merge_env["OUT"] and re.fullmatch(re.escape(prefix) + "[0-9a-f]{24}", key)
    again = subprocess.run(["bash", "-eo", "pipefail", "-c", by_id["merge"]["key"]["run"]], cwd=ROOT,
                           env={**merge_env, "GITHUB_OUTPUT": str(tmp_path / "again")}, check=True)
    assert again.returncode == 0 and (tmp_path / "again").read_text() == f"cache-key={key}\n"
    changed = next(e for e in merged["entries"] if e["status"] == "built")
    changed["identity"] = "another"
    (Path(merge_env["OUT"]) / "manifest.json").write_text(json.dumps(merged))
    subprocess.run(["bash", "-eo", "pipefail", "-c", by_id["merge"]["key"]["run"]], cwd=ROOT, check=True,
                   env={**merge_env, "GITHUB_OUTPUT": str(tmp_path / "changed")})
    assert (tmp_path / "changed").read_text().startswith(f"cache-key={prefix}")
    assert (tmp_path / "changed").read_text() != f"cache-key={key}\n"
