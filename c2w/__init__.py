"""c2w as a checkout imports it: `import c2w` with the repository root on sys.path (pytest puts it
there, and so does `python cli.py` or `python -m c2w.cli` run from the root) finds this file, which
points the package at the root, where the product card keeps runtime/, exporter/, profiles/ and
cli.py. So a checkout's tests and scripts import that checkout's code, whatever c2w is installed.

An installed c2w never contains this file: pyproject.toml maps the package `c2w` to the root (a
namespace package, in the wheel and in `pip install -e .`)."""
from pathlib import Path

__path__ = [str(Path(__file__).resolve().parent.parent)]
