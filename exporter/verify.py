"""`c2w verify DIR`: every file the manifest names is the one recorded, and every built
artifact still matches eager (runtime.verify.check_entry, on fresh inputs)."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from runtime.engines import get_backend
from runtime.errors import C2WUserError
from runtime.manifest import Entry, Manifest, Status, file_problem, model_from_manifest, read_manifest
from runtime.verify import check_entry


def verify_directory(out_dir: Path, device: str | None = None) -> tuple[Manifest, list[Entry]]:
    """Check size and sha256 of every file the manifest names, then re-run parity for every built
    entry of `out_dir` (fresh inputs). Returns (manifest, checked). Nothing built: C2WUserError."""
    manifest = read_manifest(Path(out_dir))
    if not any(e.status == Status.BUILT for e in manifest.entries):
        counts = {str(s): sum(e.status == s for e in manifest.entries) for s in {e.status for e in manifest.entries}}
        raise C2WUserError("c2w verify", f"'{out_dir}' with nothing built ({counts or 'no entries'})",
                           "a directory with at least one built artifact",
                           "Run c2w export into it first (re-running resumes an interrupted export).")
    dev = torch.device("cpu" if manifest.device == "cpu" else "cuda") if device is None else _device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise C2WUserError("verify device", f"'{device or 'cuda'}' on a machine without CUDA" + (
            f" (the manifest's device is '{manifest.device}')" if device is None else ""),
                           "a device this machine has", "Verify on the machine it was built for, or pass --device cpu "
                           "for artifacts built for the CPU.")
    model = model_from_manifest(manifest, dev)
    if model.digest != manifest.model["digest"]:
        raise C2WUserError(f"{out_dir}/manifest.json model digest", manifest.model["digest"],
                           f"{model.digest} (the digest of '{manifest.model['spec']}' now)",
                           "The model changed since export: re-run c2w export.")
    backend = get_backend(manifest.backend["name"])
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
            c.status, c.error, c.parity = Status.FAILED, "; ".join(w for w in why if w), {}
            checked.append(c)
            continue
        try:
            check_entry(model, backend, Path(out_dir), c, dev)
        except Exception as exc:  # a broken artifact is a failed verification, not a crash
            c.status, c.error = Status.FAILED, f"{type(exc).__name__}: {exc}"
        checked.append(c)
    return manifest, checked


def _device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise C2WUserError("--device", repr(name), "cpu or cuda (optionally cuda:N)")
    return dev
