"""Builds the native module ``dlion_kernels.kernels._C`` with CMake (see CMakeLists.txt).

    pip install .                                   # wheel
    pip install -e .                                # editable
    pip install --no-build-isolation --no-deps -e . # editable, with the torch already installed

Environment:
    DLION_BUILD_CUDA   auto (default) | 1 (CUDA required) | 0 (CPU only)
    DLION_CUDA_ARCHS   CUDA architectures, default "80;90"
    CMAKE_BUILD_PARALLEL_LEVEL  parallel jobs (default: all cores)
    DLION_CMAKE_ARGS   extra arguments for the CMake configure step
    DLION_BUILD_DIR    where CMake builds (default: build/ in the source tree; kept, incremental)

The module uses neither the torch C++ API nor torch.utils.cpp_extension: it takes raw pointers and
a CUDA stream handle, so the same build works with any installed torch.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def _working_tool(name: str) -> str | None:
    """The first ``name`` on PATH that runs. A venv may hold pip's ``cmake``/``ninja`` wrapper
    scripts, which cannot import their package inside pip's isolated build environment."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        exe = shutil.which(name, path=folder)
        if exe is None:
            continue
        try:
            ok = subprocess.run([exe, "--version"], capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return exe
    return None


@contextlib.contextmanager
def _locked(folder: Path):
    """One build of ``folder`` at a time (a second waits): two builds of one CMake folder would
    write the same files."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        yield
        return
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _stable_pybind11(build_root: Path) -> str:
    """pybind11's CMake folder, from a copy of the package kept in the build folder. pip builds in
    a new temporary environment every time: pointing CMake at that environment's pybind11 would
    change the compile commands and recompile everything at each install."""
    import pybind11

    package = Path(pybind11.__file__).resolve().parent
    cmake_dir = Path(pybind11.get_cmake_dir()).resolve()
    copy = build_root / f"pybind11-{pybind11.__version__}"
    done = copy / ".copied"
    if not done.exists():
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(package, copy)
        done.touch()
    return str(copy / cmake_dir.relative_to(package))


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        cmake = _working_tool("cmake")
        if cmake is None:
            raise RuntimeError(
                "dlion_kernels needs CMake >= 3.18 to build its native module, and no working "
                "`cmake` is on PATH. Install it (e.g. `apt install cmake`, `conda install cmake` "
                "or `pip install cmake`) and retry."
            )
        extdir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # A build folder that outlives pip's temporary one, so that rebuilds are incremental.
        build_root = os.environ.get("DLION_BUILD_DIR") or ROOT / "build"
        build_temp = Path(build_root).resolve() / f"cmake-{sys.implementation.cache_tag}"
        build_temp.mkdir(parents=True, exist_ok=True)
        with _locked(build_temp):
            self._cmake(cmake, extdir, Path(build_root).resolve(), build_temp)

    def _cmake(self, cmake: str, extdir: Path, build_root: Path, build_temp: Path) -> None:
        config = "Debug" if self.debug else "Release"

        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY_{config.upper()}={extdir}",
            f"-DCMAKE_BUILD_TYPE={config}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={_stable_pybind11(build_root)}",
            f"-DDLION_BUILD_CUDA={os.environ.get('DLION_BUILD_CUDA', 'auto') or 'auto'}",
        ]
        archs = os.environ.get("DLION_CUDA_ARCHS")
        if archs:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={archs}")
        args += shlex.split(os.environ.get("DLION_CMAKE_ARGS", ""))
        cache = build_temp / "CMakeCache.txt"
        ninja = _working_tool("ninja")
        if not cache.exists() and ninja:
            args += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]

        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        print(f"dlion_kernels: cmake {' '.join(args)}", flush=True)
        subprocess.run([cmake, str(ROOT), *args], cwd=build_temp, check=True)
        subprocess.run(
            [cmake, "--build", ".", "--config", config, "--parallel", jobs],
            cwd=build_temp,
            check=True,
        )


setup(ext_modules=[CMakeExtension("dlion_kernels.kernels._C")], cmdclass={"build_ext": CMakeBuild})
