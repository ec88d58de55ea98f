"""benchmarks/h200/first_load.py's record of the child processes a load starts (CPU)."""
import subprocess
import sys

from benchmarks.h200 import first_load


def test_children_started_from_python_are_recorded_with_their_command_and_run_time(monkeypatch):
    monkeypatch.setattr(first_load, "CHILDREN", [])
    monkeypatch.setattr(subprocess.Popen, "__init__", subprocess.Popen.__init__)   # restored after the test
    monkeypatch.setattr(subprocess.Popen, "wait", subprocess.Popen.wait)
    first_load.record_children()
    subprocess.check_call([sys.executable, "-c", "import time; time.sleep(0.2)"])
    subprocess.check_output("echo hi", shell=True)
    first, second = first_load.CHILDREN
    assert first["argv"][1:] == ["-c", "import time; time.sleep(0.2)"] and 0.2 <= first["seconds"] < 10
    assert second["argv"] == "echo hi" and second["seconds"] is not None
