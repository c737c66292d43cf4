"""The package ``__init__``: every public name loads on first use (PEP 562), ``__all__`` and
``dir()`` list them, and ``import dlion_kernels`` / ``dlion_kernels.plan`` (the runtime model,
its CLI included) work in an interpreter where torch cannot be imported."""

import importlib
import os
import subprocess
import sys

import pytest

import dlion_kernels as dk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN_ARGS = ["--params", "124M", "--ranks", "32", "--ranks-per-node", "8", "--inter-gbps", "25",
             "--intra-gbps", "1600", "--fwd-ms", "80", "--bwd-ms", "160"]
# Runs before anything else in the child: every `import torch` then raises ImportError.
NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def _python(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` from the repository root (this checkout's dlion_kernels first)."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_plan_without_torch():
    out = _python(NO_TORCH + (
        "import dlion_kernels, dlion_kernels.plan as plan\n"
        "assert sys.modules['torch'] is None\n"
        "rows = plan.predict('124M', 32, 8, inter_gbps=25, intra_gbps=1600, fwd_ms=80, "
        "bwd_ms=160)\n"
        "print(plan.best(rows))\n"
        "try:\n"
        "    dlion_kernels.DistributedLion\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"))
    assert out.returncode == 0, out.stderr
    fastest, refused = out.stdout.splitlines()
    assert "dlion-" in fastest  # a D-Lion row: flat, hierarchical or on FSDP2
    assert refused.startswith("refused:") and "torch" in refused  # torch really was blocked


def test_plan_cli_without_torch_prints_what_it_prints_with_torch():
    with_torch = subprocess.run([sys.executable, "-m", "dlion_kernels.plan", *PLAN_ARGS],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert with_torch.returncode == 0, with_torch.stderr
    without = _python(NO_TORCH + (
        "import runpy\n"
        f"sys.argv = ['dlion_kernels.plan', *{PLAN_ARGS!r}]\n"
        "runpy.run_module('dlion_kernels.plan', run_name='__main__', alter_sys=True)\n"
        "assert sys.modules['torch'] is None\n"))
    assert without.returncode == 0, without.stderr
    assert "fastest:" in without.stdout
    assert without.stdout == with_torch.stdout


def test_import_loads_nothing_heavy():
    out = _python("import sys, dlion_kernels\n"
                  "print(sorted(m for m in sys.modules if m == 'torch' or "
                  "m.startswith('dlion_kernels.')))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['dlion_kernels._version']"


def test_public_names():
    assert dk.__all__ == sorted(dk._PUBLIC) and len(dk.__all__) == 20
    listed = dir(dk)
    for name in dk.__all__:
        value = getattr(dk, name)
        assert importlib.import_module(dk._PUBLIC[name], "dlion_kernels").__dict__[name] is value
        assert name in listed
    for name in dk._SUBMODULES:
        assert getattr(dk, name) is importlib.import_module(f"dlion_kernels.{name}")
        assert name in listed
    assert dk.plan.predict is importlib.import_module("dlion_kernels.plan.model").predict


def test_from_import_in_a_fresh_interpreter():
    names = ", ".join(dk.__all__)
    out = _python(f"from dlion_kernels import {names}\n"
                  "import dlion_kernels as dk\n"
                  "ns = {}\n"
                  "exec('from dlion_kernels import *', ns)\n"
                  "print(sorted(k for k in ns if not k.startswith('__')) == dk.__all__)\n"
                  "print(DistributedLion.__module__, save_state.__module__)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "dlion_kernels.optim.dlion", "dlion_kernels.checkpoint"]


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="'dlion_kernels' has no attribute 'DistributedAdam'"):
        dk.DistributedAdam
    with pytest.raises(ImportError, match="cannot import name 'nope'"):
        exec("from dlion_kernels import nope", {})
