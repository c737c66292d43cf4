"""The benchmarks' --smoke modes run to the end and write their results (pytest -m bench)."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.bench


def _run(script, out, timeout=180):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_run_all_smoke(tmp_path):
    """The one command: every part into one folder, an index, pytest-benchmark's JSON."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run_all.py"), "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "run_all.py --smoke" in summary
    for key in ("date", "command", "cpu_model", "device", "gpu", "torch", "git_commit"):
        assert f"| {key} |" in summary
    parts = {p["part"]: p for p in json.loads((tmp_path / "summary.json").read_text())["parts"]}
    assert list(parts) == ["kernels", "pytest", "comm", "network"]
    expected = {"kernels": "bench_kernels/bench_kernels.json", "comm": "bench_comm/bench_comm.json",
                "network": "bench_network/bench_network.json",
                "pytest": "cpu_stages/pytest_benchmark.json"}
    for part, path in expected.items():
        status = parts[part]["status"]
        assert status == "ok" or status.startswith("skipped"), (part, status)
        # bench_network skips without root, the CPU stages without pytest-benchmark
        assert (tmp_path / path).exists() == (status == "ok"), (part, status)
        assert f"## {part} ({status})" in summary
    _check_kernels(tmp_path / "bench_kernels")
    _check_comm(tmp_path / "bench_comm")
    if parts["network"]["status"] == "ok":
        data = json.loads((tmp_path / "bench_network" / "bench_network.json").read_text())
        assert data["links"] and data["links"][0]["measured_gbit"] > 0
        assert {r["key"] for r in data["rows"]} >= {"lion_allreduce_fp32", "dlion_vote_binary"}
    if parts["pytest"]["status"] == "ok":
        bench = json.loads((tmp_path / "cpu_stages" / "pytest_benchmark.json").read_text())
        infos = {(b["extra_info"]["backend"], b["extra_info"]["stage"]): b["extra_info"]
                 for b in bench["benchmarks"]}
        assert {stage for _, stage in infos} == {"local_step", "tally_n8", "apply_vote",
                                                 "fused_dlion_step", "copy"}
        bytes_per_elt = {"local_step": 8.125, "tally_n8": 1.125, "apply_vote": 20.125,
                         "fused_dlion_step": 28.5, "copy": 8.0}
        for (_, stage), info in infos.items():
            assert info["bytes_per_elt"] == bytes_per_elt[stage]
            assert info["bytes"] == info["bytes_per_elt"] * info["numel"] and info["gbps"] > 0
        assert (tmp_path / "cpu_stages" / "cpu_stages.md").exists()


def _check_kernels(out):
    """bench_kernels.py's results (run by run_all.py): both shapes, the bytes each stage moves."""
    data = json.loads((out / "bench_kernels.json").read_text())
    assert (out / "bench_kernels.csv").exists() and (out / "bench_kernels.md").exists()
    assert data["metadata"]["command"] and data["metadata"]["gpu"]
    timed = [r for r in data["rows"] if r.get("ms")]
    assert {r["op"] for r in timed} >= {"local_step", "apply vote", "step"}
    assert {r["shape"] for r in timed} == {"flat", "gpt2"}
    assert all(r["gbps"] > 0 and r["of_copy"] > 0 for r in timed)
    gpt2 = [r for r in timed if r["shape"] == "gpt2"]
    assert gpt2 and all(r["tensors"] == 148 for r in gpt2)
    for r in timed:  # the bytes the docstring spells out
        if r["op"] == "local_step" and r["dtype"] == "fp32":
            assert r["bytes_per_elt"] == 8.125  # reads g and m, writes 1 bit (stages v2)
        if r["op"] == "step" and r["dtype"] == "fp32":
            assert r["bytes_per_elt"] == 28.5  # apply also reads g and m and writes m
    stdout = (out / "output.txt").read_text()
    assert "### Targets" in stdout
    assert "PASS" in stdout or "FAIL" in stdout or "not measured" in stdout


def _check_comm(out):
    """bench_comm.py's results (run by run_all.py): the vote's bytes against the formula."""
    data = json.loads((out / "bench_comm.json").read_text())
    assert (out / "bench_comm.csv").exists()
    assert data["metadata"]["command"] and data["metadata"]["gpu"]
    rows = data["rows"]
    assert {r["variant"] for r in rows} >= {"dlion vote/binary", "all_reduce fp32"}
    for r in rows:
        if r["variant"] == "dlion vote/binary":
            # the wire-format bound: 2 (n-1)/n * d/8 plus a few words of padding
            assert 0 <= r["bytes_sent"] - r["bytes_formula"] <= 16 * r["n"]
    assert "| n |" in (out / "output.txt").read_text()


def test_run_all_reports_a_failed_part(tmp_path):
    """A part that fails is reported and makes the exit status 1; the next part still runs."""
    pytest.importorskip("pytest_benchmark")
    env = dict(os.environ, DLION_BENCH_NUMEL="not-a-size")  # the CPU stages fail to collect
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run_all.py"), "--smoke",
                           "--no-plot", "--only", "pytest,kernels", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "## pytest (FAILED)" in summary and "## kernels (ok)" in summary
    assert (tmp_path / "bench_kernels" / "bench_kernels.json").exists()


def test_bench_resize_smoke(tmp_path):
    """Trained on 2 ranks, resumed on 3 with every rule; results in the common format."""
    _run("bench_resize.py", tmp_path, timeout=900)
    data = json.loads((tmp_path / "resize.json").read_text())
    assert data["metadata"]["old"] == 2 and data["metadata"]["command"]
    assert len(data["before"]["losses"]) == 40  # --steps-before of --smoke
    rows = data["rows"]
    assert [(r["n_old"], r["n_new"], r["rule"]) for r in rows] == [
        (2, 3, "mean"), (2, 3, "rank0"), (2, 3, "zero")]
    for r in rows:
        assert len(r["losses"]) == 20 and all(math.isfinite(x) for x in r["losses"])
        assert 0.0 <= r["accuracy"] <= 1.0
    assert (tmp_path / "resize.csv").read_text().startswith("n_old,n_new,rule,")
    assert "| 2 -> n | optimizer state |" in (tmp_path / "resize.md").read_text()


def test_bench_accum_smoke(tmp_path):
    _run("bench_accum.py", tmp_path, timeout=300)
    data = json.loads((tmp_path / "bench_accum.json").read_text())
    variants = {r["variant"] for r in data["rows"]}
    assert "copy fp32" in variants
    assert any(v.startswith("AccumAdamW fused") for v in variants)
    assert any(v.startswith("AccumLion fused") for v in variants)
    assert all(r["gb_s"] > 0 for r in data["rows"])
    assert (tmp_path / "bench_accum.md").exists()


def test_bench_hierarchy_gather_smoke(tmp_path):
    stdout = _run("bench_hierarchy_gather.py", tmp_path, timeout=300)
    rows = json.loads((tmp_path / "hierarchy_gather.json").read_text())["rows"]
    assert {r["variant"] for r in rows} == {"aggregate", "params"}
    for r in rows:
        assert r["ms"] > 0
        if r["variant"] == "aggregate":  # 1 bit per element against 32 or 16 in the params
            other = next(x for x in rows if x["variant"] == "params" and x["d"] == r["d"]
                         and x["dtype"] == r["dtype"])
            assert r["intra_bytes_sent"] * 15 < other["intra_bytes_sent"]
    assert "gather aggregate vs gather parameters" in stdout


def test_soak_smoke(tmp_path):
    """Both phases (DistributedLion, decentralized) run to the end within the leak limits (the
    script exits 1 past them)."""
    _run("bench_soak.py", tmp_path, timeout=1800)
    data = json.loads((tmp_path / "soak.json").read_text())
    assert data["metadata"]["ok"] and data["metadata"]["ranks"] == 2
    assert [(row["strategy"], row["rank"]) for row in data["rows"]] == [
        ("dlion", 0), ("dlion", 1), ("decentralized", 0), ("decentralized", 1)]
    for row in data["rows"]:
        assert row["fds_growth_pct"] <= 1.0 and row["threads_growth_pct"] <= 1.0
        assert row["rss_kb_growth_pct"] <= 1.0
        assert row["ckpt_files"] == 3  # two rank files and the manifest: old saves removed
    assert (tmp_path / "soak.csv").read_text().startswith("strategy,rank,wall_s,")
    samples = (tmp_path / "soak_samples.csv").read_text().splitlines()
    assert samples[0] == "strategy,rank,step,rss_kb,fds,threads"
    assert len(samples) == 1 + 2 * 2 * (1 + 120 // 10)  # header; phases x ranks x samples
    assert "| rank |" in (tmp_path / "soak.md").read_text()
