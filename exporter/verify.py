"""`c2w verify DIR`: every file the manifest names is the one recorded, every built artifact
still matches eager (runtime.verify.check_entry, on fresh inputs), and the directory holds its
budget: as the manifest records its keys, and measured again with every built key loaded
together in a fresh process (runtime.memory, docs/budget.md)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from c2w.exporter.budget import measurement_slack, mib, overrun, recorded_ledger
from c2w.runtime.engines import get_backend
from c2w.runtime.errors import C2WUserError
from c2w.runtime.manifest import Entry, Manifest, Status, file_problem, model_from_manifest, read_manifest
from c2w.runtime.memory import MeasureError, measure_directory
from c2w.runtime.verify import check_entry

OVERRUN_FIX = ("Re-run c2w export into this directory to keep only the keys that fit (c2w merge cuts shard "
               "directories to the budget), or raise budget_bytes in the profile and re-export.")


def verify_directory(out_dir: Path, device: str | None = None) -> tuple[Manifest, list[Entry]]:
    """Check size and sha256 of every file the manifest names, then re-run parity for every built
    entry of `out_dir` (fresh inputs). Returns (manifest, checked). Nothing built: C2WUserError."""
    manifest = read_manifest(Path(out_dir))
    if not any(e.status == Status.BUILT for e in manifest.entries):
        counts = {str(s): sum(e.status == s for e in manifest.entries) for s in {e.status for e in manifest.entries}}
        raise C2WUserError("c2w verify", f"'{out_dir}' with nothing built ({counts or 'no entries'})",
                           "a directory with at least one built artifact",
                           "Run c2w export into it first (re-running resumes an interrupted export).")
    dev = verify_device(manifest, device)
    model = model_from_manifest(manifest, dev)
    if model.digest != manifest.model.digest:
        raise C2WUserError(f"{out_dir}/manifest.json model digest", manifest.model.digest,
                           f"{model.digest} (the digest of '{manifest.model.spec}' now)",
                           "The model changed since export: re-run c2w export.")
    backend = get_backend(manifest.backend.name)
    backend.require()
    bad_shared = {rel: why for rel, r in manifest.shared.items()
                  if (why := file_problem(out_dir, rel, r["bytes"], r["sha256"]))}
    checked = []
    for e in manifest.entries:
        if e.status != Status.BUILT:
            continue
        c = copy.deepcopy(e)
        why = [file_problem(out_dir, e.artifact, e.artifact_bytes, e.artifact_sha256)]
        why += [bad_shared.get(rel) for rel in e.extra.get("weights_files", [])]
        if any(why):            # the runtime would refuse it: so does verify, before loading it
            c.status, c.error, c.parity = Status.FAILED, "; ".join(w for w in why if w), None
            checked.append(c)
            continue
        try:
            check_entry(model, backend, Path(out_dir), c, dev)
        except Exception as exc:  # a broken artifact is a failed verification, not a crash
            c.status, c.error = Status.FAILED, f"{type(exc).__name__}: {exc}"
        checked.append(c)
    return manifest, checked


@dataclass
class BudgetCheck:
    lines: list[str] = field(default_factory=list)      # what was checked, one line each
    problems: list[str] = field(default_factory=list)   # each overrun: what, by how much, what to do


def verify_budget(out_dir: Path, manifest: Manifest, device: str | None = None) -> BudgetCheck:
    """The budget against the built keys' measured bytes the manifest records (exactly), and
    against the directory measured again together in a fresh process on `device` (allowing
    measurement_slack(budget) for the measurement's own variation)."""
    out, budget = BudgetCheck(), manifest.budget_bytes
    ledger, unmeasured = recorded_ledger(manifest)
    if unmeasured:
        out.lines.append(f"recorded: {len(unmeasured)} built keys have no measurement (exported by an older c2w); "
                         "not checked")
    else:
        total = ledger.total()
        out.lines.append(f"recorded by the export: {ledger.parts()} = {mib(total)} MiB of {mib(budget)} MiB")
        if total > budget:
            out.problems.append(f"{overrun('the keys as the manifest records them add up to', total, budget, ledger.parts())}."
                                f" {OVERRUN_FIX}")
    try:
        got = measure_directory(Path(out_dir), manifest, verify_device(manifest, device))
    except MeasureError as e:
        out.problems.append(f"the directory could not be measured in a fresh process: {e}")
        return out
    total, slack = got["total_bytes"], measurement_slack(budget)
    parts = (f"weights {mib(got['weight_bytes'])} + engine state {mib(sum(got['engine_shared_bytes'].values()))} + "
             f"{got['keys']} keys {mib(got['key_bytes'])} MiB")
    out.lines.append(f"measured together in a fresh process ({got['kind']}): {parts} = {mib(total)} MiB of {mib(budget)} "
                     f"MiB" + (f" (over by less than the measurement tolerance of {mib(slack)} MiB)"
                               if budget < total <= budget + slack else ""))
    if total > budget + slack:
        out.problems.append(f"{overrun('the directory measured in a fresh process', total, budget, parts)}. {OVERRUN_FIX}")
    return out


def verify_device(manifest: Manifest, device: str | None) -> torch.device:
    """The device to verify on: `device`, else the manifest's; one this machine has."""
    dev = torch.device("cpu" if manifest.device == "cpu" else "cuda") if device is None else _device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise C2WUserError("verify device", f"'{device or 'cuda'}' on a machine without CUDA" + (
            f" (the manifest's device is '{manifest.device}')" if device is None else ""),
                           "a device this machine has", "Verify on the machine it was built for, or pass --device cpu "
                           "for artifacts built for the CPU.")
    return dev


def _device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise C2WUserError("--device", repr(name), "cpu or cuda (optionally cuda:N)")
    return dev
