"""The artifact directory contract: `<out>/manifest.json` (versioned, written atomically).

Written by the exporter, read by the runtime, `c2w report` and `c2w verify`. Users' CI parses it:
change FORMAT_VERSION on any incompatible change; a reader treats another version as foreign.
Version 2 added the `over_budget` status, `engine_shared_bytes` and `measured`, and changed what
`device_bytes` means (resident bytes, docs/budget.md); a version-1 manifest is still read, its
per-key numbers (peaks during load + one run) dropped as unmeasured.

In memory each record of the file is a dataclass: ProfileRef, ModelRef, BackendRef, an Entry's
Parity, the directory's Measurement (or FailedMeasurement). `Manifest.from_dict` checks these
records field by field, types included (Entry and Manifest: their field names), and `to_json`
writes them back as the same JSON objects (an unset parity or measurement as {}).
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

from c2w.runtime.atomic import atomic_write
from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.weights import Code2Wav
from c2w.runtime.precision import load_at_precision, set_tf32

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
# Part of every artifact's identity: bump it when every artifact built by an older c2w must be
# rebuilt; a change to one unit's artifacts from one backend bumps that unit's `revisions` instead
# (runtime/units.py), so the others are kept. Independent of FORMAT_VERSION: a manifest field
# changing does not change an artifact.
# 2: a CFM step package takes the step's index (int64), not its time (the modulation is a table).
ARTIFACT_FORMAT = 2
MANIFEST = "manifest.json"


class Status(str, enum.Enum):
    """An entry's state. A str: it equals its value and is written to JSON as it."""
    BUILT = "built"                     # built and verified against eager: the runtime serves it
    FAILED = "failed"                   # its build or its parity check failed (`error` says why)
    PENDING = "pending"                 # selected, not built yet (an interrupted export, another shard's key)
    SKIPPED_BUDGET = "skipped_budget"   # not built: its estimate does not fit the measured room left
    OVER_BUDGET = "over_budget"         # built and verified, but its measured bytes do not fit: not served
    UNSUPPORTED = "unsupported"         # the backend cannot build this key

    def __str__(self) -> str:
        return self.value


class ForeignManifestError(C2WUserError):
    """A readable manifest of another format version: its entries are misses (re-export them)."""


@dataclass(frozen=True)
class ProfileRef:
    """The profile the directory was exported with."""
    name: str
    digest: str                    # exporter.profile's hash of its content
    source: str                    # the file it was read from (`c2w bench --traffic` reads it again)


@dataclass(frozen=True)
class ModelRef:
    """The model the artifacts were built from: the runtime serves them only for this digest."""
    spec: str                      # a checkpoint directory or "random:<preset>" (runtime.model.weights.load_model)
    digest: str                    # Code2Wav.digest
    config: str                    # its ModelConfig's name


@dataclass(frozen=True)
class BackendRef:
    """The backend that built the artifacts: the runtime serves them only with this version."""
    name: str                      # a runtime.engines name
    version: str


@dataclass(frozen=True)
class Parity:
    """An artifact's check against eager on fresh inputs (runtime.verify.check_entry)."""
    rel_l2: dict[str, float]       # output name -> relative L2 error (inf: a shape that differs)
    tol: float
    passed: bool


@dataclass(frozen=True)
class Measurement:
    """The directory's built keys loaded together in a fresh process (runtime.memory.measure_directory,
    docs/budget.md)."""
    kind: str                      # runtime.memory.memory_kind: "cuda_device" or "host_anon"
    keys: int
    weight_bytes: int              # eager weights of the components in use (the manifest's numbers)
    engine_shared_bytes: dict[str, int]     # component -> state its engines share
    key_bytes: int
    total_bytes: int
    split: dict[str, int] | None = None     # CUDA only: allocated / pool / outside
    load_seconds: float | None = None       # loading and first-running the keys, one after another

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not (k in ("split", "load_seconds") and v is None)}


@dataclass(frozen=True)
class FailedMeasurement:
    """The directory could not be measured: why."""
    error: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Entry:
    id: str
    component: str
    dims: dict                     # dim name -> int, in the spec's order
    dtype: str
    category: str                  # first | steady | tail | extra
    status: Status
    identity: str = ""             # hash of everything that determines the artifact
    artifact: str | None = None    # path relative to the manifest's directory
    artifact_bytes: int = 0
    artifact_sha256: str = ""
    est_bytes: int = 0             # planner estimate (per-key, weights excluded)
    device_bytes: int | None = None    # resident bytes of its own, loaded next to the keys kept before it (runtime.memory)
    memory_kind: str = ""          # "cuda_device" (device memory in use) or "host_anon" (anonymous RSS)
    build_seconds: float = 0.0    # building and verifying it (its phases: extra['build_phases'])
    parity: Parity | None = None   # None until checked against eager ({} in the file)
    input_names: list = field(default_factory=list)
    output_names: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)    # backend-specific (e.g. TensorRT profile index)
    error: str | None = None

    def __post_init__(self):
        self.status = Status(self.status)       # a value no Status has: ValueError
        _require_type(self, "parity", Parity, None)

    @classmethod
    def from_dict(cls, d: dict) -> "Entry":
        """An entry as manifest.json holds it; a field that does not fit: TypeError or ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"an entry that is a JSON {_json_type(d)}, expected an object")
        d = dict(d)
        if "parity" in d:
            p = d["parity"]
            d["parity"] = None if p == {} else _record(Parity, p, f"entry {d.get('id')!r} parity")
        return cls(**d)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["parity"] = d["parity"] or {}
        return d


@dataclass
class Manifest:
    profile: ProfileRef
    model: ModelRef
    backend: BackendRef
    torch_version: str
    device: str                    # "cpu" or the GPU's name
    precision: dict
    budget_bytes: int
    weight_bytes: dict             # per component, at the profile's precision
    schedule: dict = field(default_factory=dict)  # the profile's streaming schedule (trim rule, P, ...)
    shared: dict = field(default_factory=dict)   # shared files (ONNX weights): path -> {bytes, sha256}
    entries: list[Entry] = field(default_factory=list)
    engine_shared_bytes: dict = field(default_factory=dict)   # component -> state its engines share, measured
    # the directory loaded together in a fresh process (docs/budget.md); None: not measured ({} in the file)
    measured: Measurement | FailedMeasurement | None = None
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        _require_type(self, "profile", ProfileRef)
        _require_type(self, "model", ModelRef)
        _require_type(self, "backend", BackendRef)
        _require_type(self, "measured", Measurement, FailedMeasurement, None)

    def by_id(self) -> dict[str, Entry]:
        return {e.id: e for e in self.entries}

    def to_dict(self) -> dict:
        """The JSON object manifest.json holds: each record as an object, an unset parity or
        measurement as {}."""
        d = asdict(dataclasses.replace(self, entries=[], measured=None))
        d["entries"] = [e.to_dict() for e in self.entries]
        d["measured"] = {} if self.measured is None else self.measured.to_dict()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        """A manifest as manifest.json holds it (format_version 1 or 2); a field that does not fit:
        TypeError or ValueError (read_manifest says which file)."""
        d = dict(d)
        entries = d.get("entries", [])
        if not isinstance(entries, list):
            raise ValueError(f"entries: a JSON {_json_type(entries)}, expected a list")
        d["entries"] = [Entry.from_dict(e) for e in entries]
        for name, record in (("profile", ProfileRef), ("model", ModelRef), ("backend", BackendRef)):
            if name in d:
                d[name] = _record(record, d[name], name)
        if "measured" in d:
            m = d["measured"]
            d["measured"] = (None if m == {} else
                             _record(FailedMeasurement if isinstance(m, dict) and "error" in m else Measurement,
                                     m, "measured"))
        if d.get("format_version") == 1:       # its device_bytes were peaks, not resident bytes
            for e in d["entries"]:
                e.device_bytes, e.memory_kind = None, ""
            d["format_version"] = FORMAT_VERSION
        return cls(**d)


_JSON_TYPES = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number",
               type(None): "null"}


def _json_type(value) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _fits(value, tp) -> bool:
    """Whether a JSON value has the annotated type `tp` (str, int, float, bool, None, dict[str, X], X | Y)."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return any(_fits(value, t) for t in typing.get_args(tp))
    if typing.get_origin(tp) is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and _fits(v, typing.get_args(tp)[1])
                                               for k, v in value.items())
    if tp is float:                            # JSON writes 1.0 as 1.0, but a hand-made 1 is a number too
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _record(cls, value, where: str):
    """The record `cls` (a dataclass) from the JSON object `value`: exactly its fields, each of its
    type. Else a ValueError that names `where`, the field and what it expected."""
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    required = [f.name for f in fields if f.default is dataclasses.MISSING]
    optional = [n for n in names if n not in required]
    expected = ", ".join(required) + (f"; optional: {', '.join(optional)}" if optional else "")
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a JSON {_json_type(value)}, expected an object ({expected})")
    if not set(required) <= set(value) <= set(names):
        raise ValueError(f"{where}: fields ({', '.join(value)}), expected ({expected})")
    hints = typing.get_type_hints(cls)
    for k, v in value.items():
        if not _fits(v, hints[k]):
            raise ValueError(f"{where}.{k}: a JSON {_json_type(v)} ({v!r:.60}), expected {_type_name(hints[k])}")
    return cls(**value)


def _type_name(tp) -> str:
    return str(tp).replace("typing.", "") if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))


def _require_type(obj, name: str, *types_) -> None:
    """A programming error, not a file's: a field set to something other than its record."""
    value = getattr(obj, name)
    if not any(value is None if t is None else isinstance(value, t) for t in types_):
        raise TypeError(f"{type(obj).__name__}.{name}: {value!r:.80} is not a "
                        + " or ".join("None" if t is None else t.__name__ for t in types_))


def write_manifest(out_dir: Path, manifest: Manifest) -> Path:
    """Atomic (runtime.atomic): a reader sees the previous manifest or this one, never a part."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return atomic_write(out_dir / MANIFEST, manifest.to_json())


def read_manifest(out_dir: Path) -> Manifest:
    """The directory's manifest; any manifest that cannot be read (missing, unreadable bytes,
    not the JSON c2w writes, another format version) is a C2WUserError saying which and why."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise C2WUserError("artifact directory", f"'{out_dir}' with no {MANIFEST}",
                           "a directory written by `c2w export`", "Run `c2w export --profile ... --out DIR` first.")
    redo = "Re-export into this directory (c2w export --out DIR) or restore the file."
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, OSError) as e:
        raise C2WUserError(f"manifest '{path}'", f"an unreadable file ({type(e).__name__}: {e})",
                           "the UTF-8 JSON c2w export writes", redo) from None
    if not isinstance(d, dict):
        raise C2WUserError(f"manifest '{path}'", f"a JSON {type(d).__name__}", "a JSON object", redo)
    if d.get("format_version") not in READABLE_VERSIONS:
        raise ForeignManifestError(f"manifest '{path}'", f"format_version {d.get('format_version')!r}",
                           f"format_version {FORMAT_VERSION}", "Re-export with this version of c2w.")
    try:
        return Manifest.from_dict(d)
    except (TypeError, AttributeError, ValueError) as e:     # missing, unknown or mistyped fields
        raise C2WUserError(f"manifest '{path}'", f"fields that do not match ({e})",
                           f"the fields of format_version {FORMAT_VERSION}", redo) from None


def model_from_manifest(manifest: Manifest, device, spec: str | None = None) -> Code2Wav:
    """The eager model the manifest's artifacts were built from (or the model `spec`), on `device`
    at the manifest's precision, with TF32 set as the manifest says (process-wide, logged)."""
    set_tf32(manifest.precision.get("tf32", False), "the manifest's precision.tf32")
    return load_at_precision(spec or manifest.model.spec, device, manifest.precision)


def file_problem(out_dir: Path, rel: str, size: int, sha256: str) -> str | None:
    """Why the file `rel` under `out_dir` is not the one the manifest recorded, or None."""
    p = Path(out_dir) / rel
    if not p.is_file():
        return f"{rel}: missing"
    if p.stat().st_size != size:
        return f"{rel}: {p.stat().st_size} bytes, the manifest says {size} (truncated or replaced)"
    if file_sha256(p) != sha256:
        return f"{rel}: sha256 differs from the manifest (modified since export)"
    return None


def file_record(out_dir: Path, rel: str) -> dict:
    """What the manifest records of a shared file: {"bytes", "sha256"}."""
    p = Path(out_dir) / rel
    return {"bytes": p.stat().st_size, "sha256": file_sha256(p)}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def entry_identity(*, model_digest: str, key_id: str, backend: str, backend_version: str,
                   torch_version: str, device: str, precision: dict, build_options: dict | None = None,
                   weights_layout: dict | None = None, artifact_keys: list[str] | None = None,
                   revision: int = 0) -> str:
    """Canonical hash of everything that determines one artifact: equal identity => reusable.
    `build_options` (a builder's settings such as the AOTI builder's extra Inductor configs),
    `weights_layout` (strides of weights not stored contiguously, runtime.verify.weights_layout),
    `artifact_keys` (the ids of the keys sharing one artifact, in its order: a TensorRT plan's
    profiles) and `revision` (the unit's revision for the backend, UnitSpec.revisions) count only
    when given."""
    fields = {"model": model_digest, "key": key_id, "backend": backend, "backend_version": backend_version,
              "torch": torch_version, "device": device, "precision": precision, "format": ARTIFACT_FORMAT}
    if build_options:
        fields["build_options"] = build_options
    if weights_layout:
        fields["weights_layout"] = weights_layout
    if artifact_keys:
        fields["artifact_keys"] = list(artifact_keys)
    if revision:
        fields["revision"] = revision
    blob = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
