"""The package as a wheel: ``pip wheel .`` builds one (the native build reuses the checkout's
CMake folder, ``build/``), pip installs it into a new virtual environment outside the source tree,
and from there every module of the package imports, the compiled module loads, and two gloo
processes take a D-Lion step. This catches what an editable install hides: a subpackage or file
left out of the wheel, a compiled module not copied into it.

The new environment has no pip and no packages of its own but the wheel; torch and numpy come
from the running environment, added as a path (its ``.pth`` files are not read, so the checkout's
editable install of the package is not seen there)."""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHECK = r'''
import importlib
import os
import pkgutil
import sys

import dlion_kernels as dk
from dlion_kernels.launch import spawn


def step(rank, n):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)
    opt = dk.DistributedLion(model.parameters(), lr=1e-3, backend="cpu")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    opt.step()
    return opt.last_stats.bytes_sent, opt.last_stats.backend, model.weight.sum().item()


if __name__ == "__main__":
    here = os.path.dirname(dk.__file__)
    assert here.startswith(sys.prefix), (here, sys.prefix)
    skip = ("dlion_kernels.demo",)  # imported below, with its optional dependencies absent
    for m in pkgutil.walk_packages(dk.__path__, "dlion_kernels."):
        if not m.name.startswith(skip):
            importlib.import_module(m.name)
    importlib.import_module("dlion_kernels.kernels._C")
    assert "cpu" in dk.available_backends("cpu"), dk.available_backends("cpu")
    results = spawn(2, step, timeout=120)
    assert results[0][0] > 0 and results[0][1] == "cpu", results
    assert results[0][2] == results[1][2], results  # the same weights on both ranks
    print("ok", here, results[0])
'''


def test_wheel_installs_and_trains_outside_the_checkout(tmp_path):
    env = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(dist), str(ROOT)], check=True, env=env, cwd=tmp_path)
    wheel = next(dist.glob("dlion_kernels-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("dlion_kernels/kernels/_C") for n in names), names
    assert "dlion_kernels/demo/cli.py" in names and "dlion_kernels/plan/model.py" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, env=env, cwd=tmp_path)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], check=True, capture_output=True,
                               text=True).stdout.strip())
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (tmp_path / "check.py").write_text(CHECK)
    run_env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "DLION_BACKEND")}
    out = subprocess.run([str(python), "check.py"], cwd=tmp_path, env=run_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("ok " + str(site)), out.stdout


@pytest.mark.parametrize("extra", ["elastic", "demo", "test"])
def test_extras_are_declared(extra):
    """The extras the docs install from a checkout (``pip install -e ".[elastic]"``) exist."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extra in extras
