"""Python code run in a process of its own with Triton's JIT on (the test session runs Triton's
interpreter: tests/conftest.py sets TRITON_INTERPRET=1), from the repository's root."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def jit_process(code: str, timeout: float = 600) -> str:
    """The code's stdout; its stderr's end in the assertion if it fails."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
