"""c2w installs as one package, c2w (c2w.runtime, c2w.exporter, c2w.cli, c2w.profiles), from the
product card's layout at the repository root; a checkout imports its own c2w, one copy of each
module. pyproject.toml says how; these tests keep it so.
"""
# c2w-namespace: skip  (this file names the bare top-level names on purpose)
import ast
import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BARE = ("runtime", "exporter", "cli")          # what the folders would be called without c2w
SKIP = {".git", "artifacts", "build", "dist", "__pycache__", ".pytest_cache", "_work"}


def _py_files(under: Path = ROOT) -> list[Path]:
    return sorted(p for p in under.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts)
                  and not any(part.endswith(".egg-info") for part in p.relative_to(ROOT).parts))


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import; `from c2w import runtime` gives c2w.runtime."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}" if node.module == "c2w" else node.module)
                    for a in node.names]
    return out


def _names_code(s: str) -> bool:
    """Whether a string is a bare module path of the tree ("runtime.engines.aoti", "exporter"), or an
    attribute of a module file ("exporter.export.make_plan"); "runtime.load" is an error's label."""
    parts = s.split(".")
    if parts[0] not in BARE or not all(p.isidentifier() for p in parts) or parts[-1] == "py":
        return False
    for i in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:i])
        if path.with_suffix(".py").is_file() or (i == len(parts) and (path / "__init__.py").is_file()):
            return True
    return False


def test_pyproject_installs_every_package_of_the_tree_under_c2w():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tools = cfg["tool"]["setuptools"]
    assert tools["package-dir"] == {"c2w": "."}
    tree = {"c2w", "c2w.profiles"} | {
        "c2w." + ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("runtime", "exporter") for p in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in p.parts}
    assert sorted(tools["packages"]) == sorted(tree)
    assert not (ROOT / "__init__.py").exists()      # c2w is a namespace package where installed
    assert cfg["project"]["scripts"] == {"c2w": "c2w.cli:app"}
    assert set(tools["package-data"]["c2w.profiles"]) >= {"*.yaml", "*.json"}


def test_no_module_imports_a_bare_top_level_name():
    """`import runtime` in a checkout would load a second copy of every module it reaches (and an
    installed c2w has no `runtime` at all). Imports, module-path strings (backend registries,
    `-m` arguments, patch targets) and code in strings, in every Python file of the tree."""
    bare = "|".join(BARE)
    code_in_string = re.compile(rf"(?:^|[;\s`'\"(])(?:from\s+(?:{bare})[\w.]*\s+import\b|(?<!c2w )import\s+(?:{bare})\b)")
    found = []
    for path in _py_files():
        if path == Path(__file__).resolve():
            continue
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        found += [f"{rel}:{line}: import {name}" for line, name in _imported(tree) if name.split(".")[0] in BARE]
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                s = node.value
                if _names_code(s) or code_in_string.search(s) or re.search(rf"-m\s+(?:{bare})\b", s):
                    found.append(f"{rel}:{node.lineno}: string {s!r}")
    assert not found, "bare top-level names (name them c2w.…):\n" + "\n".join(found)


def test_runtime_never_imports_exporter_or_cli():
    """A serving process imports c2w.runtime alone (the exporter needs more: onnx, the planner)."""
    found = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in _py_files(ROOT / "runtime")
             for line, name in _imported(ast.parse(p.read_text()))
             if name.startswith(("c2w.exporter", "c2w.cli"))]
    found += [f"{p.relative_to(ROOT)}: relative import out of runtime/" for p in _py_files(ROOT / "runtime")
              for node in ast.walk(ast.parse(p.read_text()))
              if isinstance(node, ast.ImportFrom) and node.level > len(p.relative_to(ROOT).parts) - 1]
    assert not found, found


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("c2w",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def _c2w_imports(path: Path, modules: set[str]) -> set[str]:
    """The c2w modules the file at `path` imports, anywhere in it (inside functions too): `from P
    import X` names P.X where that is a module, else P; a relative import is resolved from the
    file's package. Importing a module also runs its packages' __init__, which is not counted: a
    package may import its own submodules."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return (found & modules) - {name}


def _import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle_between_c2w_modules():
    """The layers import one way (runtime <- exporter <- cli) and so do the modules within each:
    a cycle, even one closed by an import inside a function, makes a module's import order matter
    and a refactor that moves that import to the top fail at import time."""
    files = _py_files(ROOT / "runtime") + _py_files(ROOT / "exporter") + [ROOT / "cli.py"]
    modules = {_module_name(p) for p in files}
    graph = {_module_name(p): _c2w_imports(p, modules) for p in files}
    assert graph["c2w.exporter.export"] >= {"c2w.runtime.memory", "c2w.exporter.backends"}    # the walk sees imports
    assert "c2w.exporter.backends.tensorrt_plan" in graph["c2w.exporter.backends.tensorrt"]  # inside functions too
    cycles = _import_cycles(graph)
    assert not cycles, "import cycles between c2w modules (each: the modules of one cycle):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_a_checkout_imports_its_own_c2w_once():
    """From the checkout (as pytest and `python cli.py` run), every c2w module comes from this
    checkout, whatever c2w is installed, and nothing is loaded under a bare name."""
    code = """
import importlib, pkgutil, sys
import c2w, c2w.cli, c2w.exporter, c2w.runtime
for pkg in (c2w.runtime, c2w.exporter):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
print(c2w.__file__)
for name, mod in sorted(sys.modules.items()):
    if name.split(".")[0] in ("runtime", "exporter", "cli", "profiles"):
        print("bare", name)
    elif name.startswith("c2w.") and not (getattr(mod, "__file__", None) or "").startswith(sys.argv[1]):
        print("elsewhere", name, getattr(mod, "__file__", None))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code, str(ROOT) + os.sep], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == str(ROOT / "c2w" / "__init__.py")
    assert lines[1:] == []


def _isolated_venv(path: Path) -> Path:
    """A venv that sees this interpreter's installed packages (torch, typer, ...) but runs none of
    their .pth files: an editable c2w installed there (a finder hook) stays out. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "_c2w_test_base.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


@pytest.mark.slow          # 26 to 51 s on 2 shared cores: the wheel build, a plan of the full model
def test_the_wheel_installs_c2w_alone_and_plans_with_a_bundled_profile(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*SKIP, "*.egg-info"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(tmp_path / "dist"), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("c2w-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert all(n.startswith(("c2w/", "c2w-")) for n in names), names
    assert {"c2w/cli.py", "c2w/runtime/__init__.py", "c2w/exporter/profile.py", "c2w/profiles/h200.yaml",
            "c2w/profiles/cpu.yaml", "c2w/profiles/h200.calibration.json"} <= set(names)
    assert "c2w/__init__.py" not in names           # the checkout shim points at its own folder's parent

    python = _isolated_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, env=env, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", """
import importlib.util, sys
import c2w.cli, c2w.runtime, c2w.exporter.profile as profile
print(c2w.cli.__file__, c2w.runtime.__file__, profile.resolve_profile_path("h200"), sep="\\n")
for name in ("runtime", "exporter", "cli", "profiles"):
    spec = importlib.util.find_spec(name)
    print(name, spec and spec.origin)
"""], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr
    lines = where.stdout.splitlines()
    installed = tmp_path / "venv"
    assert all(Path(f).resolve().is_relative_to(installed.resolve()) for f in lines[:3]), lines
    assert lines[2].endswith(os.path.join("c2w", "profiles", "h200.yaml"))
    for line in lines[3:]:                           # no bare name, or none from the checkout or the wheel
        name, origin = line.split(" ", 1)
        assert origin == "None" or not Path(origin).resolve().is_relative_to(ROOT) \
            and not Path(origin).resolve().is_relative_to(installed.resolve()), line

    plan = subprocess.run([str(installed / "bin" / "c2w"), "plan", "--profile", "h200"], cwd=elsewhere,
                          env=env, capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert re.search(r"^\d+ keys to build, \d+ skipped by budget; planned total .* of 102400 MiB$", plan.stdout, re.M)
    calibration = re.search(r"^timings: calibration (\S+) \(NVIDIA H200\): 7 keys measured", plan.stdout, re.M)
    assert calibration, plan.stdout[-2000:]
    assert Path(calibration.group(1)).resolve().is_relative_to(installed.resolve())
