"""Run every benchmark into one results folder and write an index, summary.md.

Parts, in this order, each in a subfolder of ``bench/results/all-<YYYYmmdd-HHMMSS>/`` (or
``--out DIR``), its console output kept there as ``output.txt``:

- ``kernels``  bench_kernels.py          -> bench_kernels/  (GPU: do_bench medians)
- ``pytest``   python_tests/bench/test_cpu_stages.py -> cpu_stages/ (pytest-benchmark, CPU)
- ``comm``     bench_comm.py             -> bench_comm/
- ``network``  bench_network.py          -> bench_network/  (needs root; else skipped)

summary.md holds the metadata (machine, device, versions, date, exact command), a status table,
the target lines (PASS/FAIL) the parts printed, and each part's tables. A part that fails is
reported there and makes the exit status 1; the other parts still run.

    python bench/run_all.py                      # everything, full sizes (many minutes)
    python bench/run_all.py --smoke              # tiny sizes, well under 2 minutes
    python bench/run_all.py --only kernels,pytest
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PARTS = {  # part -> (subfolder, markdown file the part writes)
    "kernels": ("bench_kernels", "bench_kernels.md"),
    "pytest": ("cpu_stages", "cpu_stages.md"),
    "comm": ("bench_comm", "bench_comm.md"),
    "network": ("bench_network", "bench_network.md"),
}
SMOKE_NUMEL = "256k"


def part_command(part: str, sub: str, args) -> list[str]:
    script = os.path.join(common.BENCH_DIR, f"bench_{part}.py")
    if part == "pytest":
        tests = os.path.join(common.REPO_ROOT, "python_tests", "bench", "test_cpu_stages.py")
        # -n 0: pyproject's addopts run files in parallel, which disables pytest-benchmark
        cmd = [sys.executable, "-m", "pytest", tests, "-n", "0",
               "-m", "timing", "-p", "no:cacheprovider", "--benchmark-sort=name",
               "--benchmark-columns=min,median,mean,stddev,rounds",
               f"--benchmark-json={os.path.join(sub, 'pytest_benchmark.json')}"]
        if args.smoke:
            cmd += ["--benchmark-max-time=0.05", "--benchmark-min-rounds=3"]
        return cmd
    cmd = [sys.executable, script, "--out", sub]
    if args.smoke:
        cmd.append("--smoke")
    if args.no_plot:
        cmd.append("--no-plot")
    return cmd


def run_part(cmd: list[str], log_path: str, env: dict, timeout: float) -> tuple[int, str]:
    """Run ``cmd``, echoing its output and keeping it in ``log_path``; (exit code, output)."""
    lines = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=common.REPO_ROOT, env=env)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)
                lines.append(line)
            rc = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if rc < 0:
            note = f"\n[run_all: killed by signal {-rc}; the limit was {timeout:.0f} s]\n"
            log.write(note)
            lines.append(note)
    return rc, "".join(lines)


def target_lines(text: str) -> list[str]:
    """Bullet lines under a 'Targets' heading, and any bullet saying PASS, FAIL or target."""
    found, in_targets = [], False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#") or (s and not s.startswith("- ")):
            in_targets = s.startswith("#") and "target" in s.lower()
        elif s.startswith("- ") and (in_targets or re.search(r"\b(PASS|FAIL)\b|\btarget\b", s,
                                                             re.IGNORECASE)):
            if s not in found:
                found.append(s)
    return found


def pytest_table(sub: str, meta: dict) -> str | None:
    """cpu_stages.md/.csv/.json from pytest-benchmark's JSON: name, median ms, GB/s."""
    path = os.path.join(sub, "pytest_benchmark.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        data = json.load(f)
    rows = []
    for b in data.get("benchmarks", []):
        info, med = b.get("extra_info", {}), b["stats"]["median"]
        rows.append({"name": b["name"], "backend": info.get("backend"),
                     "stage": info.get("stage"), "numel": info.get("numel"),
                     "bytes_per_elt": info.get("bytes_per_elt"), "median_ms": med * 1e3,
                     "gbps": info["bytes"] / med / 1e9 if info.get("bytes") else None,
                     "rounds": b["stats"]["rounds"]})
    common.save(sub, "cpu_stages", rows, meta)
    numel = common.human_count(rows[0]["numel"]) if rows and rows[0]["numel"] else "?"
    text = common.markdown_table(rows, [
        ("name", "name"), ("bytes_per_elt", "B/elt", ".4g"), ("median_ms", "median ms", ".3f"),
        ("gbps", "GB/s", ".2f"), ("rounds", "rounds")],
        title=f"CPU stages (pytest-benchmark), flat fp32, {numel} elements")
    common.save_text(sub, "cpu_stages.md", text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="pass --smoke to every part")
    ap.add_argument("--out", default=None,
                    help="results folder (default bench/results/all-<timestamp>/)")
    ap.add_argument("--only", default=",".join(PARTS),
                    help=f"comma-separated parts to run (default: {','.join(PARTS)})")
    ap.add_argument("--no-plot", action="store_true", help="pass --no-plot to the parts")
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="limit per part (default 300 s with --smoke, else 3600 s)")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"--only: unknown {unknown}; choose from {list(PARTS)}")
    timeout = args.timeout_s or (300.0 if args.smoke else 3600.0)

    out = common.results_dir("all", args.out)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    meta = common.metadata({"benchmark": "run_all", "device": device, "parts": parts,
                            "smoke": args.smoke})
    # Not an xdist worker's variables (when a test runs this script): pytest-benchmark would take
    # the parts' own pytest for a distributed run and switch itself off.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    if args.smoke:
        env.setdefault("DLION_BENCH_NUMEL", SMOKE_NUMEL)
    print(f"run_all: {parts} -> {out}", flush=True)

    results = []
    for part in parts:
        folder, md_name = PARTS[part]
        sub = os.path.join(out, folder)
        os.makedirs(sub, exist_ok=True)
        cmd = part_command(part, sub, args)
        res = {"part": part, "folder": folder, "command": common.shown_command(cmd)}
        print(f"\n===== {part}: {res['command']}", flush=True)
        t0 = time.time()
        if part == "pytest" and importlib.util.find_spec("pytest_benchmark") is None:
            rc, text = 0, "skipped: pytest-benchmark is not installed (pip install -e '.[bench]')"
            print(text)
            common.save_text(sub, "output.txt", text + "\n")
        else:
            rc, text = run_part(cmd, os.path.join(sub, "output.txt"), env, timeout)
        res["seconds"] = round(time.time() - t0, 1)
        res["rc"] = rc
        skip = re.search(r"^(bench_network )?skipped: (.*)$", text, re.MULTILINE)
        if rc != 0:
            res["status"] = "FAILED"
        elif skip:
            res["status"] = "skipped: " + skip.group(2).strip()
        else:
            res["status"] = "ok"
        md = None
        if part == "pytest" and not skip:
            try:
                md = pytest_table(sub, meta)
            except (OSError, ValueError, KeyError, TypeError) as e:  # a truncated or odd JSON
                md = f"could not read pytest_benchmark.json: {type(e).__name__}: {e}\n"
        md_path = os.path.join(sub, md_name)
        if md is None and os.path.exists(md_path):
            with open(md_path) as f:
                md = f.read()
        res["markdown"] = md
        res["targets"] = target_lines(text)
        res["tail"] = text[-3000:] if rc != 0 else ""
        res["files"] = sorted(f for f in os.listdir(sub))
        results.append(res)
        print(f"===== {part}: {res['status']} ({res['seconds']:.0f} s)", flush=True)

    meta["elapsed_s"] = round(sum(r["seconds"] for r in results), 1)
    summary = write_summary(out, meta, results)
    failed = [r["part"] for r in results if r["status"] == "FAILED"]
    print(f"\nrun_all: wrote {summary}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


def write_summary(out: str, meta: dict, results: list[dict]) -> str:
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"metadata": meta,
                   "parts": [{k: v for k, v in r.items() if k != "markdown"} for r in results]},
                  f, indent=2, default=str)
        f.write("\n")
    keys = ["date", "command", "hostname", "cpu_model", "cpu_count", "cpu_affinity",
            "mem_total_gib", "device", "gpu", "kernel", "python", "torch", "triton", "numpy",
            "dlion_kernels", "git_commit", "available_backends_cpu", "elapsed_s"]
    lines = ["# Benchmarks (run_all)", "",
             common.markdown_table([{"key": k, "value": f"`{meta[k]}`" if k == "command"
                                     else meta.get(k)} for k in keys], ["key", "value"]),
             common.markdown_table([{
                 "part": r["part"], "status": r["status"], "seconds": r["seconds"],
                 "results": f"[{r['folder']}/]({r['folder']}/) "
                            + " ".join(f"[{f}]({r['folder']}/{f})" for f in r["files"]),
             } for r in results], ["part", "status", ("seconds", "s", ".0f"), "results"],
                 title="Parts"),
             "### Targets", ""]
    targets = [f"- {r['part']}: {t[2:]}" for r in results for t in r["targets"]]
    lines += (targets or ["- none printed"]) + [""]
    for r in results:
        lines += [f"## {r['part']} ({r['status']})", "", f"`{r['command']}`", ""]
        if r["status"] == "FAILED":
            lines += [f"Exit code {r['rc']}; the end of its output (all of it in "
                      f"{r['folder']}/output.txt):", "", "```", r["tail"].rstrip(), "```", ""]
        if r["markdown"]:
            # two heading levels down: a part's '#' title nests under its '##' section here
            lines += [re.sub(r"^(#+) ", r"##\1 ", r["markdown"], flags=re.MULTILINE).rstrip(), ""]
    path = os.path.join(out, "summary.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
