"""Export profiles: YAML -> one frozen `Profile`. The schema is documented in docs/profiles.md.

Every default lives in the dataclasses below; a key set to null means "use the default".
Unknown keys, wrong types and impossible values raise C2WUserError naming the file, the key,
what was received and what is allowed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from c2w.runtime.engines import NAMES as BACKENDS        # the runtime's registry names the backends
from c2w.runtime.errors import C2WUserError
from c2w.runtime.precision import check_policy
from c2w.runtime.units import SPECS, ShapeKey

DEVICES = ("cpu", "cuda")
CATEGORIES = ("first", "steady", "setup", "tail", "extra")
BUNDLED = Path(__file__).resolve().parent.parent / "profiles"


@dataclass(frozen=True)
class Precision:
    flow_encoder: str = "float32"
    cfm: str = "float32"
    hift: str = "float32"
    tf32: bool = False

    def dtype(self, component: str) -> str:
        return getattr(self, component)


@dataclass(frozen=True)
class Schedule:
    prompt_frames: int = 300                 # P: mel frames of the prompt (50 Hz)
    chunk_tokens: tuple[int, ...] = (28,)    # tokens per non-final chunk incl. 3 lookahead
    batch_sizes: tuple[int, ...] = (1,)
    tail_tokens: tuple[int, ...] = ()        # final-chunk lengths to build (else: eager)
    trim_conformer: bool = True              # MiniCPM-o trims the conformer cache too
    max_chunks: int = 8                      # chunks simulated per stream when planning
    setup_keys: bool = True                  # build the prompt set-up's keys (encoder C=0, CFM L=0)


@dataclass(frozen=True)
class Traffic:
    """The traffic a deployment expects (docs/profiles.md). Shares are ((value, share), ...) with
    shares summing to 1. A session is B streams opened, stepped and closed together: one prompt
    set-up, `session_chunks` non-final chunks of `chunk_tokens` tokens, one final chunk."""
    batch_sizes: tuple[tuple[int, float], ...]       # share of sessions (and so of unit calls) per B
    chunk_tokens: tuple[tuple[int, float], ...]      # share of sessions per non-final chunk size
    session_chunks: tuple[tuple[int, float], ...]    # share of sessions per count of non-final chunks
    tail_tokens: tuple[tuple[int, float], ...] = ()  # share per final-chunk size; () = sizes unknown
    calibration: str | None = None                   # c2w bench's calibration.json (path)
    engine_speedup: float = 3.0                      # timing model without calibration: eager / engine
    eager_tflops: float | None = None                # its eager throughput; None: EAGER_TFLOPS[device]


EAGER_TFLOPS = {"cpu": 0.02, "cuda": 20.0}           # the timing model's eager TFLOP/s by device


@dataclass(frozen=True)
class AOTISettings:
    """Build settings of the AOTInductor backend, used when `backend` is aoti (docs/aoti.md). The
    environment variable named beside each field overrides it when set (exporter/backends/aoti.py)."""
    # Inductor configs added to every build, (name, value) sorted by name; C2W_AOTI_INDUCTOR overrides
    inductor_options: tuple[tuple[str, object], ...] = ()
    # the C++ compiler; None: the first g++ on PATH, never $CXX; C2W_AOTI_CXX overrides
    cxx: str | None = None

    @property
    def inductor(self) -> dict:
        return dict(self.inductor_options)


@dataclass(frozen=True)
class Profile:
    name: str
    model: str = "random:tiny"
    device: str = "cpu"
    backend: str = "onnxruntime"
    precision: Precision = field(default_factory=Precision)
    budget_bytes: int = 8 << 30
    schedule: Schedule = field(default_factory=Schedule)
    extra_keys: tuple[ShapeKey, ...] = ()
    priority: tuple[str, ...] = ("steady", "first", "setup", "tail", "extra")
    workspace_bytes: int = 1 << 30           # TensorRT builder workspace limit
    traffic: Traffic | None = None           # None: the budget follows `priority`
    aoti: AOTISettings = field(default_factory=AOTISettings)
    source: str = ""                         # file it was read from
    digest: str = ""                         # sha256 of the file's canonical content

    def with_overrides(self, **kw) -> "Profile":
        kw = {k: v for k, v in kw.items() if v is not None}
        if "backend" in kw and kw["backend"] not in BACKENDS:
            raise C2WUserError("--backend", repr(kw["backend"]), f"one of {list(BACKENDS)}")
        return dataclasses.replace(self, **kw)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(v, where: str) -> int:
    if isinstance(v, bool):
        raise C2WUserError(where, repr(v), "a byte count such as 8589934592 or '8GiB'")
    if isinstance(v, int):
        n = v
    elif isinstance(v, str) and (m := re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", v)) and m.group(2).lower() in _UNITS:
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise C2WUserError(where, repr(v), "a byte count such as 8589934592 or '8GiB'")
    if n <= 0:
        raise C2WUserError(where, repr(v), "a positive byte count")
    return n


def _check_keys(where: str, d, allowed) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise C2WUserError(where, f"{type(d).__name__} {d!r}", "a mapping")
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise C2WUserError(where, f"unknown key(s) {unknown}", f"keys among {sorted(allowed)}")
    return {k: v for k, v in d.items() if v is not None}


def _typed(where: str, v, typ, *, positive=False, choices=None):
    ok = isinstance(v, typ) and not (typ is int and isinstance(v, bool))
    if not ok:
        raise C2WUserError(where, f"{type(v).__name__} {v!r}", typ.__name__)
    if positive and v <= 0:
        raise C2WUserError(where, repr(v), "a positive value")
    if choices is not None and v not in choices:
        raise C2WUserError(where, repr(v), f"one of {list(choices)}")
    return v


def _int_list(where: str, v, *, minimum=1) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise C2WUserError(where, repr(v), "a list of integers")
    bad = [x for x in v if x < minimum]
    if bad:
        raise C2WUserError(where, f"{bad}", f"integers >= {minimum}")
    return tuple(dict.fromkeys(v))


def parse_profile(data: dict, source: str = "<dict>") -> Profile:
    """Validate a profile mapping (as read from YAML) and build the frozen Profile."""
    top = {f.name for f in dataclasses.fields(Profile)} - {"source", "digest"}
    d = _check_keys(f"{source}", data, top)
    w = lambda key: f"{source}: '{key}'"  # noqa: E731
    kw: dict = {"name": _typed(w("name"), d.get("name", Path(source).stem), str)}
    if "model" in d:
        kw["model"] = _typed(w("model"), d["model"], str)
    if "device" in d:
        kw["device"] = _typed(w("device"), d["device"], str, choices=DEVICES)
    if "backend" in d:
        kw["backend"] = _typed(w("backend"), d["backend"], str, choices=BACKENDS)
    if "budget_bytes" in d:
        kw["budget_bytes"] = parse_bytes(d["budget_bytes"], w("budget_bytes"))
    if "workspace_bytes" in d:
        kw["workspace_bytes"] = parse_bytes(d["workspace_bytes"], w("workspace_bytes"))

    p = _check_keys(w("precision"), d.get("precision"), {f.name for f in dataclasses.fields(Precision)})
    for comp, v in p.items():
        _typed(w(f"precision.{comp}"), v, bool if comp == "tf32" else str)
    check_policy(p, lambda key: w(f"precision.{key}"))       # each unit's dtypes, TF32 where it must be off
    kw["precision"] = Precision(**p)

    s = _check_keys(w("schedule"), d.get("schedule"), {f.name for f in dataclasses.fields(Schedule)})
    sk = {}
    if "prompt_frames" in s:
        pf = _typed(w("schedule.prompt_frames"), s["prompt_frames"], int, positive=True)
        if pf % 2:
            raise C2WUserError(w("schedule.prompt_frames"), pf, "an even number (2 mel frames per token)")
        sk["prompt_frames"] = pf
    if "chunk_tokens" in s:
        sk["chunk_tokens"] = _int_list(w("schedule.chunk_tokens"), s["chunk_tokens"], minimum=4)
    if "batch_sizes" in s:
        sk["batch_sizes"] = _int_list(w("schedule.batch_sizes"), s["batch_sizes"])
    if "tail_tokens" in s:
        sk["tail_tokens"] = _int_list(w("schedule.tail_tokens"), s["tail_tokens"])
    if "trim_conformer" in s:
        sk["trim_conformer"] = _typed(w("schedule.trim_conformer"), s["trim_conformer"], bool)
    if "setup_keys" in s:
        sk["setup_keys"] = _typed(w("schedule.setup_keys"), s["setup_keys"], bool)
    if "max_chunks" in s:
        sk["max_chunks"] = _typed(w("schedule.max_chunks"), s["max_chunks"], int, positive=True)
    kw["schedule"] = Schedule(**sk)

    if "extra_keys" in d:
        if not isinstance(d["extra_keys"], list):
            raise C2WUserError(w("extra_keys"), repr(d["extra_keys"]), "a list of mappings")
        keys = []
        for i, e in enumerate(d["extra_keys"]):
            where = w(f"extra_keys[{i}]")
            if not isinstance(e, dict):
                raise C2WUserError(where, repr(e), "a mapping like {component: cfm, B: 1, T: 50, L: 300}")
            comp = e.get("component")
            if comp not in SPECS:
                raise C2WUserError(f"{where}.component", repr(comp), f"one of {sorted(SPECS)}")
            names = SPECS[comp].dim_names
            _check_keys(where, e, {"component", *names})
            missing = [n for n in names if n not in e]
            if missing:
                raise C2WUserError(where, f"no {missing}", f"all of {list(names)} for {comp}")
            for n in names:
                _typed(f"{where}.{n}", e[n], int)
                if e[n] < (0 if n in ("C", "L", "S", "last") else 1):
                    raise C2WUserError(f"{where}.{n}", e[n], "a positive size" if n not in ("C", "L", "S", "last")
                                       else "a size >= 0")
            dtype = kw["precision"].dtype(comp)
            keys.append(ShapeKey(comp, tuple(e[n] for n in names), dtype))
        kw["extra_keys"] = tuple(keys)

    if "priority" in d:
        pr = d["priority"]
        if not isinstance(pr, list) or any(c not in CATEGORIES for c in pr) or len(set(pr)) != len(pr):
            raise C2WUserError(w("priority"), repr(pr), f"a list of distinct categories from {list(CATEGORIES)}")
        kw["priority"] = tuple(pr) + tuple(c for c in CATEGORIES if c not in pr)

    if "traffic" in d:
        kw["traffic"] = _parse_traffic(d["traffic"], kw["schedule"], source, w)
    if "aoti" in d:
        kw["aoti"] = _parse_aoti(d["aoti"], w)

    canon = yaml.safe_dump(data, sort_keys=True).encode()
    return Profile(source=source, digest=hashlib.sha256(canon).hexdigest()[:16], **kw)


# traffic maps: smallest size and an example
_SHARES = {"batch_sizes": (1, "{1: 0.6, 8: 0.4}"), "chunk_tokens": (4, "{28: 0.7, 78: 0.3}"),
           "session_chunks": (1, "{4: 0.5, 10: 0.5}"), "tail_tokens": (1, "{13: 0.5, 20: 0.5}")}
SHARE_SUM_TOLERANCE = 1e-3
MAX_SESSION_CHUNKS = 10_000


def _shares(where: str, v, minimum: int, example: str) -> tuple[tuple[int, float], ...]:
    """{value: share} with integer values >= minimum, shares >= 0 summing to 1."""
    example = f"a mapping of sizes to shares summing to 1, e.g. {example}"
    if not isinstance(v, dict) or not v:
        raise C2WUserError(where, repr(v), example)
    bad_keys = [k for k in v if not isinstance(k, int) or isinstance(k, bool) or k < minimum]
    if bad_keys:
        raise C2WUserError(where, f"sizes {bad_keys!r}", f"integers >= {minimum} as keys of {example}")
    bad = {k: x for k, x in v.items() if isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0}
    if bad:
        raise C2WUserError(where, f"shares {bad!r}", "numbers >= 0")
    total = sum(v.values())
    if abs(total - 1) > SHARE_SUM_TOLERANCE:
        raise C2WUserError(where, f"shares summing to {total:.4g}", f"shares summing to 1 (+-{SHARE_SUM_TOLERANCE})",
                           "Give each size its fraction of the whole.")
    return tuple(sorted((k, float(x)) for k, x in v.items()))


def _parse_traffic(t, schedule: Schedule, source: str, w) -> Traffic:
    where = w("traffic")
    t = _check_keys(where, t, {f.name for f in dataclasses.fields(Traffic)})
    missing = [k for k in ("batch_sizes", "chunk_tokens", "session_chunks") if k not in t]
    if missing:
        raise C2WUserError(where, f"no {missing}", "batch_sizes, chunk_tokens and session_chunks, each a mapping "
                           "of sizes to shares", "See docs/profiles.md, section Traffic.")
    kw = {k: _shares(w(f"traffic.{k}"), t[k], *_SHARES[k]) for k in _SHARES if k in t}
    longest = max(n for n, _ in kw["session_chunks"])
    if longest > MAX_SESSION_CHUNKS:
        raise C2WUserError(w("traffic.session_chunks"), f"a session of {longest} chunks",
                           f"at most {MAX_SESSION_CHUNKS} chunks (beyond a few, caches are trimmed and every "
                           "chunk hits the same keys)")
    if schedule.tail_tokens and "tail_tokens" not in kw:
        raise C2WUserError(w("traffic.tail_tokens"), "nothing", f"the shares of final-chunk sizes, since "
                           f"schedule.tail_tokens builds final-chunk keys {list(schedule.tail_tokens)}",
                           "Add e.g. tail_tokens: {13: 0.5, 20: 0.5}.")
    for name, above, what in (("engine_speedup", 1, "eager time / engine time"), ("eager_tflops", 0, "TFLOP/s")):
        if name in t:
            x = t[name]
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > above:
                raise C2WUserError(w(f"traffic.{name}"), repr(x), f"a number > {above} ({what})")
            kw[name] = float(x)
    if "calibration" in t:
        rel = _typed(w("traffic.calibration"), t["calibration"], str)
        path = Path(rel) if os.path.isabs(rel) else Path(source).parent / rel
        if not path.is_file():
            raise C2WUserError(w("traffic.calibration"), f"'{rel}' (no file at '{path}')",
                               "a calibration.json written by c2w bench, relative to the profile's folder",
                               "Run c2w bench on built artifacts, or remove the key to use the timing model.")
        kw["calibration"] = os.path.normpath(path)
    return Traffic(**kw)


def _parse_aoti(a, w) -> AOTISettings:
    a = _check_keys(w("aoti"), a, {f.name for f in dataclasses.fields(AOTISettings)})
    kw = {}
    if "inductor_options" in a:
        kw["inductor_options"] = check_inductor_options(w("aoti.inductor_options"), a["inductor_options"])
    if "cxx" in a:
        cxx = _typed(w("aoti.cxx"), a["cxx"], str)
        if not cxx.strip():
            raise C2WUserError(w("aoti.cxx"), repr(cxx), "a compiler name or path such as /usr/bin/g++",
                               "Remove the key (or set it to null) for the first g++ on PATH.")
        kw["cxx"] = cxx
    return AOTISettings(**kw)


INDUCTOR_EXAMPLE = '{combo_kernels: true}'


def check_inductor_options(where: str, v) -> tuple[tuple[str, object], ...]:
    """A mapping of Inductor config names to values -> sorted (name, value) pairs. Whether the names
    exist in the installed torch is checked when the AOTI builder starts (exporter/backends/aoti.py)."""
    if not isinstance(v, dict):
        raise C2WUserError(where, f"{type(v).__name__} {v!r}",
                           f"a mapping of Inductor config names to values, e.g. {INDUCTOR_EXAMPLE}")
    bad = [k for k in v if not isinstance(k, str) or not k]
    if bad:
        raise C2WUserError(where, f"names {bad!r}", "Inductor config names (strings) such as combo_kernels")
    unset = sorted(k for k, x in v.items() if x is None)
    if unset:
        raise C2WUserError(where, f"null for {unset}", "a value for every name",
                           "Leave a name out to keep Inductor's default.")
    return tuple(sorted(v.items()))


def resolve_profile_path(name: str | Path) -> Path:
    """An existing file is used as is. A bare name (`h100`, `h100.yaml`) that is no file in the
    working directory resolves to the bundled profiles/. Anything else is an error: a path with a
    directory part never falls back to a bundled profile that happens to share its last part."""
    raw = str(name)
    p = Path(raw)
    known = sorted(x.stem for x in BUNDLED.glob("*.yaml"))
    if p.is_file():
        return p
    if p.is_dir():
        raise C2WUserError("profile", f"'{raw}' (a directory)", "a YAML file path or one of the bundled names "
                           f"{known}", "Name the .yaml file inside it.")
    if os.path.dirname(raw) == "":
        for cand in (BUNDLED / f"{p.name}.yaml", BUNDLED / p.name):
            if cand.suffix == ".yaml" and cand.is_file():
                return cand
    raise C2WUserError("profile", f"'{raw}' (no such file" + (")" if os.path.dirname(raw) else
                                                                ", and not a bundled profile)"),
                       f"an existing YAML file path or one of the bundled names {known}")


def load_profile(name: str | Path) -> Profile:
    path = resolve_profile_path(name)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise C2WUserError(f"profile {where}", f"invalid YAML ({e.problem or e.context})",
                           "a YAML mapping", "Fix the file at that line and column.") from None
    except yaml.YAMLError as e:
        raise C2WUserError(f"profile {path}", f"invalid YAML ({e})", "a YAML mapping") from None
    except (UnicodeDecodeError, OSError) as e:
        raise C2WUserError(f"profile {path}", f"an unreadable file ({e})", "a UTF-8 YAML file") from None
    if not isinstance(data, dict):
        raise C2WUserError(f"profile {path}", f"{type(data).__name__}", "a YAML mapping at the top level")
    return parse_profile(data, str(path))
