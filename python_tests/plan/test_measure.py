"""--measure on real gloo processes: torchrun (the CLI) and the Python API with a step callable."""

import json
import os
import subprocess
import sys
import time

from workers import run_workers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_measure_cli_under_torchrun_two_emulated_nodes(tmp_path):
    # 4 gloo processes as 2 nodes of 2 (one host, so --ranks-per-node says where nodes end).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", "-m", "dlion_kernels.plan", "--measure", "--params", "124M",
           "--ranks-per-node", "2", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env,
                         check=False)
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)  # rank 0 prints the only JSON document
    m = result["measured"]
    # Calibration itself (links, collectives, compute) takes a few seconds, well under 30 s;
    # the rest of the wall time is starting 4 Python processes that import torch.
    assert m["seconds"] < 30, (m["seconds"], wall)
    assert m["ranks"] == 4 and m["ranks_per_node"] == 2
    for key in ("inter_gbps", "intra_gbps", "fwd_ms", "bwd_ms", "opt_ms"):
        assert m[key] > 0, key
    assert m["latency_us"] >= 0 and m["jitter_ms"] >= 0
    assert set(m["calibration"]["bw_scale"]) == {"all_reduce", "all_to_all", "all_gather",
                                                 "reduce_scatter"}
    names = {r["strategy"] for r in result["rows"]}
    assert {"lion-allreduce", "dlion-vote", "dlion-vote-hier",
            "decentralized-ring-accum-adamw"} <= names
    per_step = [r for r in result["rows"] if r["options"]["kind"] != "diloco"]
    assert result["best"] == per_step[0]["strategy"]
    assert result["inputs"]["ranks"] == 4 and result["inputs"]["fwd_ms"] == m["fwd_ms"]
    # What DistributedLion(hierarchy="auto") would do with this measurement.
    from dlion_kernels.plan import choose_hierarchy, inputs_from_json, predict

    path = tmp_path / "measured.json"
    path.write_text(out.stdout)
    inputs = inputs_from_json(str(path))
    again = predict("124M", 4, 2, **inputs)
    assert [r.as_dict() for r in again] == result["rows"]
    assert choose_hierarchy(4, 2, "124M", **inputs) in (1, 2)


def _measure_with_callable(rank, n):
    import time as _time

    from dlion_kernels.plan.measure import measure

    return measure("10M", step_fn=lambda: _time.sleep(0.03), reps=2)


def test_measure_python_api_with_step_callable():
    results = run_workers(2, _measure_with_callable, timeout=180)
    assert results[1] is None  # only rank 0 gets the inputs
    m = results[0]
    # The callable sleeps 30 ms: fwd + bwd (split 1:2) is at least that.
    assert 30 <= m["fwd_ms"] + m["bwd_ms"] < 300
    assert abs(m["bwd_ms"] - 2 * m["fwd_ms"]) < 1e-6 * m["bwd_ms"] + 1e-9
    assert m["ranks"] == 2 and m["ranks_per_node"] == 2  # one host
    from dlion_kernels.plan import predict

    inputs = {k: m[k] for k in ("ranks", "ranks_per_node", "inter_gbps", "intra_gbps",
                                "latency_us", "intra_latency_us", "fwd_ms", "bwd_ms",
                                "opt_ms", "jitter_ms", "jitter_dist", "algorithm")}
    rows = predict("10M", calibration=m["calibration"], **inputs)
    assert rows and all(r.step_ms >= r.compute_ms for r in rows)
