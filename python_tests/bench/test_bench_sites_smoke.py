"""bench_sites.py --smoke runs to the end and writes its results (pytest -m bench): the whole
stack (dk: DiLoCo's default outer step on torchft's quorum, FSDP2 sites) and torchft's streaming
DiLoCo through the same kill and restart, on loopback."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torchft")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.bench


def test_bench_sites_smoke(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_sites.py"),
                           "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "sites.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"dk", "torchft"}
    for r in rows.values():
        assert r["syncs_lost"] == 1 and r["heal_s"] is not None and r["curve"]
    # the vote's bytes per rank per sync: 2 (n-1)/n d/8 of the rank's share of the fragment
    # (d_local, about a quarter of the model: half of it, sharded over 2 ranks), plus padding
    from dlion_kernels.demo import chars

    model = chars.make_model(type("A", (), dict(d_model=16, heads=2, layers=2, context=16)), 0)
    d_local = sum(p.numel() for p in model.parameters()) / 4
    sent = rows["dk"]["exchange_bytes_per_rank_per_sync"]
    assert 2 * 2 / 3 * d_local / 8 * 0.8 < sent < 2 * 2 / 3 * d_local / 8 * 1.5, sent
    assert (tmp_path / "summary.md").exists()
    # every rank's raw records are kept
    assert len([f for f in os.listdir(tmp_path / "runs" / "dk-0-0") if f.endswith(".jsonl")]) == 6
