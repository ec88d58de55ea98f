"""`c2w merge OUT SHARD_DIR...`: combine the artifact directories of sharded export jobs.

Shards must come from the same profile, model digest, backend version and device; each key is
taken from the shard that built it (an entry `built` anywhere wins over `pending`).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from runtime.atomic import atomic_output
from runtime.errors import C2WUserError
from runtime.manifest import Manifest, Status, file_sha256, read_manifest, write_manifest

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
    rank = {Status.BUILT: 0, Status.FAILED: 1, Status.UNSUPPORTED: 2, Status.SKIPPED_BUDGET: 3, Status.PENDING: 4}
    best: dict[str, tuple] = {}
    for s, m in zip(shards, manifests):
        for e in m.entries:
            if e.id not in best or rank[e.status] < rank[best[e.id][1].status]:
                best[e.id] = (s, e)
    out = Path(out)
    merged = Manifest(**{**base.__dict__, "entries": [],
                         "shared": {k: v for m in manifests for k, v in m.shared.items()}})
    for s, e in (best[e.id] for e in base.entries if e.id in best):
        if e.status == Status.BUILT and Path(s).resolve() != out.resolve():
            _copy(s / e.artifact, out / e.artifact)
            for rel in e.extra.get("weights_files", []):               # ONNX Runtime's shared weights
                _copy(s / rel, out / rel)
        merged.entries.append(e)
    write_manifest(out, merged)
    return merged


def _copy(src: Path, dst: Path) -> None:
    """Copy one file atomically (a TensorRT plan shared by several entries is copied once)."""
    if dst.is_file() and dst.stat().st_size == src.stat().st_size and file_sha256(dst) == file_sha256(src):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(dst) as tmp:
        shutil.copy2(src, tmp)
