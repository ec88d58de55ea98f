"""The README's set-up is what CI runs, and it installs everything the tests need."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_setup_commands() -> list[str]:
    """The command lines of the README's set-up block (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Set-up.*?```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no '## Set-up' bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_exactly_the_readme_commands():
    commands = readme_setup_commands()
    assert len(commands) == 2
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd ", "export "))]
    assert ci == commands


def test_the_dev_extra_has_what_the_tests_import():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0] for d in extras["dev"]}
    assert {"pytest", "pytest-xdist", "onnx", "onnxruntime", "scipy", "einops", "matplotlib", "websockets"} <= names
    assert '-e ".[dev]"' in readme_setup_commands()[0]
