"""Results metadata names the interpreter and the repository's files, never a machine path."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import common  # noqa: E402


def test_shown_command_keeps_no_machine_path():
    script = os.path.join(ROOT, "bench", "bench_plan.py")
    shown = common.shown_command([sys.executable, script, "--clusters", "--out", "out dir"])
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    assert shown == f"{version} bench/bench_plan.py --clusters --out 'out dir'"
    assert common.shown_command([sys.executable, "-m", "pytest"]) == f"{version} -m pytest"


def test_metadata_records_the_interpreter_not_its_path():
    meta = common.metadata()
    assert sys.executable not in meta["command"]
    assert meta["command"].startswith(f"python{sys.version_info[0]}.{sys.version_info[1]} ")
    assert meta["interpreter"].endswith(meta["python"])
