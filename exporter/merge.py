"""`c2w merge OUT SHARD_DIR...`: combine the artifact directories of sharded export jobs.

Shards must come from the same profile, model digest, backend version and device; each key is
taken from the shard that built it (an entry `built` anywhere wins over `pending`).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from runtime.errors import C2WUserError
from runtime.manifest import Manifest, read_manifest, write_manifest

_SAME = ("profile", "model", "backend", "device", "precision", "torch_version")


def merge_dirs(out: Path, shards: list[Path]) -> Manifest:
    if not shards:
        raise C2WUserError("c2w merge", "no shard directories", "one or more directories written by c2w export")
    shards = [Path(s) for s in shards]
    missing = [s for s in shards if not (s / "manifest.json").is_file()]
    for s in missing:            # a shard killed before its first key: nothing to take from it
        print(f"c2w merge: skipping '{s}' (no manifest.json)")
    shards = [s for s in shards if s not in missing]
    if not shards:
        raise C2WUserError("c2w merge", "no shard directory with a manifest.json", "at least one")
    manifests = [read_manifest(s) for s in shards]
    base = manifests[0]
    for s, m in zip(shards[1:], manifests[1:]):
        for f in _SAME:
            a, b = getattr(base, f), getattr(m, f)
            if (a.get("digest", a) if isinstance(a, dict) and f in ("profile", "model") else a) != \
               (b.get("digest", b) if isinstance(b, dict) and f in ("profile", "model") else b):
                raise C2WUserError(f"shard '{s}' {f}", repr(b), f"{a!r} (as in '{shards[0]}')",
                                   "Merge only shards of one export (same profile, model, backend, device).")
    rank = {"built": 0, "failed": 1, "unsupported": 2, "skipped_budget": 3, "pending": 4}
    best: dict[str, tuple] = {}
    for s, m in zip(shards, manifests):
        for e in m.entries:
            if e.id not in best or rank[e.status] < rank[best[e.id][1].status]:
                best[e.id] = (s, e)
    out = Path(out)
    merged = Manifest(**{**base.__dict__, "entries": [],
                         "shared": {k: v for m in manifests for k, v in m.shared.items()}})
    for s, e in (best[e.id] for e in base.entries if e.id in best):
        if e.status == "built" and Path(s).resolve() != out.resolve():
            for f in (s / e.artifact).parent.glob(Path(e.artifact).stem + "*"):
                dst = out / Path(e.artifact).parent / f.name
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dst)
            wdir = s / Path(e.artifact).parent / "weights"          # ONNX Runtime's shared weights
            if wdir.is_dir():
                shutil.copytree(wdir, out / Path(e.artifact).parent / "weights", dirs_exist_ok=True)
        merged.entries.append(e)
    write_manifest(out, merged)
    return merged
