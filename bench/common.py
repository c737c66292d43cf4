"""Shared helpers for the benchmarks: results folder, metadata, JSON/CSV, markdown tables.

Every benchmark writes ``bench/results/<name>-<YYYYmmdd-HHMMSS>/`` (or ``--out DIR``) holding
``<name>.json`` (a ``metadata`` block, the ``rows`` and free-form ``notes``) and ``<name>.csv``
(the rows only), and prints its tables in markdown. ``run_ranks`` starts local gloo ranks.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")

# Run from a checkout without installing: the package lives one level up.
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# Rank processes of the whole-step benchmarks run with glibc malloc keeping freed memory
# (no mmap per large block, no trim). Otherwise each step's fresh gradients (set_to_none=True)
# come from new mmap pages: the backward of bench_training's MLP took 134 ms with page faults and
# 64 ms without, on one rank alone, and which of the two a variant got depended on what its
# optimizer allocated. A GPU has the same reuse from torch's caching allocator.
CACHING_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30),
                      "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}

SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


# ----------------------------------------------------------------------------- ranks


def run_ranks(n: int, fn, *args, timeout: float | None, threads: int = 1) -> list:
    """``fn(rank, n, *args)`` on n spawned gloo processes of this host; returns the per-rank
    results. The package's launcher (``dlion_kernels.launch.spawn``: file store, every rank
    killed and named on a failure or after ``timeout`` s, ``os._exit(0)`` after
    ``destroy_process_group``), so the benchmarks and the tests start ranks one way."""
    from dlion_kernels.launch import spawn

    return spawn(n, fn, *args, timeout=timeout, threads=threads)


# ----------------------------------------------------------------------------- arguments


def parse_count(text: str) -> int:
    """'1M' -> 1048576, '25m' -> 26214400, '4096' -> 4096 (binary suffixes k, M, G)."""
    t = text.strip().lower()
    if t and t[-1] in SUFFIXES:
        return int(float(t[:-1]) * SUFFIXES[t[-1]])
    return int(t)


def human_count(n: int) -> str:
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("k", 1 << 10)):
        if n >= scale and n % (scale // 1024 or 1) == 0:
            v = n / scale
            return f"{v:g}{suffix}"
    return str(n)


def human_bytes(b: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, 2 ranks: finishes in well under a minute (for CI)")
    parser.add_argument("--out", default=None,
                        help="results folder (default bench/results/<name>-<timestamp>/)")


# ----------------------------------------------------------------------------- metadata


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain"],
                               capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip() or "unknown"
        return commit + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def shown_command(argv: list[str]) -> str:
    """A command line as results record it: the interpreter by name and version and the files of
    this repository relative to its root, so that no path of the machine that ran it is kept."""
    shown = []
    for i, arg in enumerate(argv):
        if i == 0 and arg == sys.executable:
            arg = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        elif os.path.isabs(arg) and os.path.abspath(arg).startswith(REPO_ROOT + os.sep):
            arg = os.path.relpath(arg, REPO_ROOT)
        shown.append(arg)
    return shlex.join(shown)


def metadata(extra: dict | None = None) -> dict:
    """Where and how the benchmark ran: host, CPU, GPU, versions, date, exact command line."""
    import torch

    try:
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:  # noqa: BLE001 - a broken driver must not stop the benchmark
        gpu = "none"
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    try:
        import dlion_kernels as dk

        backends = dk.available_backends("cpu")
        dk_version = dk.__version__
    except Exception as e:  # noqa: BLE001
        backends, dk_version = f"import failed: {e}", "unknown"
    meta = {
        "hostname": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
                               1),
        "gpu": gpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numpy": _version("numpy"),
        "dlion_kernels": dk_version,
        "git_commit": _git_commit(),
        "available_backends_cpu": backends,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shown_command([sys.executable] + sys.argv),
        "interpreter": f"{platform.python_implementation()} {platform.python_version()}",
    }
    if extra:
        meta.update(extra)
    return meta


# ----------------------------------------------------------------------------- results


def results_dir(name: str, out: str | None) -> str:
    """``out`` if given, else bench/results/<name>-<YYYYmmdd-HHMMSS>/; created."""
    if out is None:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = os.path.join(RESULTS_DIR, f"{name}-{stamp}")
    os.makedirs(out, exist_ok=True)
    return out


def save(out_dir: str, name: str, rows: list[dict], meta: dict, **extra) -> tuple[str, str]:
    """Write <name>.json (metadata + rows + extra) and <name>.csv (rows); return both paths."""
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump({"metadata": meta, "rows": rows, **extra}, f, indent=2, default=str)
        f.write("\n")
    return json_path, save_csv(out_dir, name, rows)


def save_csv(out_dir: str, name: str, rows: list[dict]) -> str:
    """Write <name>.csv: one line per row, the columns in the order the rows first use them."""
    path = os.path.join(out_dir, f"{name}.csv")
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def save_text(out_dir: str, filename: str, text: str) -> str:
    path = os.path.join(out_dir, filename)
    with open(path, "w") as f:
        f.write(text)
    return path


# ----------------------------------------------------------------------------- plots


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def log_ms_axis(axis) -> None:
    """A log-scale time axis labelled 1, 2, 5, 10, 20, ... without minor labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_unless(no_plot: bool, make) -> None:
    """Call ``make()`` (a plot function returning the PNG path, or None without matplotlib)
    unless --no-plot was given, and say what happened."""
    if no_plot:
        print("no plot (--no-plot)")
        return
    png = make()
    print(f"saved {png}" if png else "no plot: matplotlib is not installed")


def save_figure(fig, out_dir: str, name: str) -> str:
    """Write <name>.png into out_dir and free the figure; return the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- tables


def _cell(v, fmt: str | None) -> str:
    if v is None or v == "":
        return "-"
    if fmt and isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, fmt)
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown_table(rows: list[dict], columns: list, title: str | None = None) -> str:
    """rows -> markdown. ``columns``: keys, or (key, header) / (key, header, format spec)."""
    cols = [(c, c, None) if isinstance(c, str) else (tuple(c) + (None,))[:3] for c in columns]
    lines = []
    if title:
        lines += [f"### {title}", ""]
    lines.append("| " + " | ".join(h for _, h, _ in cols) + " |")
    lines.append("|" + "|".join("---" for _ in cols) + "|")
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(k), f) for k, _, f in cols) + " |")
    return "\n".join(lines) + "\n"


def median(xs) -> float:
    return float(statistics.median(xs))
