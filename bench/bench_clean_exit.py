"""Does a job end cleanly right after its last ``step()``? Launches short jobs under torchrun and
counts the ranks that die at exit.

    python bench/bench_clean_exit.py --launches 200
    python bench/bench_clean_exit.py --launches 50 --without-keep   # the library's keeping off

Each launch is ``torchrun --nproc-per-node N`` of a script that makes a gloo group, takes 3 steps
and ends (no barrier, no ``destroy_process_group``), cycling over the variants:

- ``dlion``: ``dk.DistributedLion`` (vote/binary, the ``cpu`` backend) on a small model;
- ``dlion-torch``: the same on the ``torch`` backend;
- ``fused``: ``dk.fused_dlion_step`` (vote and average, binary and ternary, one per step);
- ``plain``: a bare ``all_reduce`` loop on tensors the script keeps (the control);

with N = 2 and 3 in turn. A launch fails when a rank's exit code is not 0 (a rank that aborts
at exit is killed by the signal: -6, SIGABRT, "terminate called without an active exception").

``--without-keep``: the ranks turn off what the library does against it (it keeps the Work of
its latest collectives, so that gloo's threads never free tensors that Python made after the
interpreter began to exit: ``exchange/collectives.py``), to show the failure it prevents.

Results: ``--out`` (default ``bench/results/tmp/clean-exit-<time>``): ``launches.json`` (every
launch: variant, ranks, exit codes) and ``summary.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

VARIANTS = ("dlion", "dlion-torch", "fused", "plain")

SCRIPT = r'''
import os
import torch
import torch.distributed as dist

import dlion_kernels as dk
from dlion_kernels.exchange import collectives

if os.environ["KEEP"] == "0":  # what the library does against the abort, turned off
    collectives._recent = __import__("collections").deque(maxlen=0)
variant = os.environ["VARIANT"]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
if variant == "plain":
    t = torch.ones(1000)
    for _ in range(3):
        dist.all_reduce(t)
elif variant == "fused":
    params = [p.detach().clone() for p in model.parameters()]
    momenta = [torch.zeros_like(p) for p in params]
    for i, (mode, votes) in enumerate([("vote", "binary"), ("average", "ternary"),
                                       ("vote", "ternary")]):
        g = torch.Generator().manual_seed(100 * rank + i)
        grads = [torch.randn(p.shape, generator=g) for p in params]
        dk.fused_dlion_step(params, grads, momenta, lr=1e-3, mode=mode, votes=votes, step=i)
else:
    backend = "torch" if variant == "dlion-torch" else "cpu"
    opt = dk.DistributedLion(model.parameters(), lr=1e-3, backend=backend)
    for i in range(3):
        g = torch.Generator().manual_seed(100 * rank + i)
        x = torch.randn(16, 64, generator=g)  # each rank its own batch
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
print(f"rank {rank} done", flush=True)
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, variant: str, ranks: int, keep: bool, timeout: float) -> dict:
    """One torchrun launch; the ranks' exit codes from torchrun's report."""
    env = dict(os.environ, VARIANT=variant, KEEP="1" if keep else "0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(_port()), script]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    done = out.count(" done")
    aborts = out.count("terminate called without an active exception")
    return dict(variant=variant, ranks=ranks, keep=keep, returncode=proc.returncode,
                ranks_done=done, aborts=aborts, seconds=round(time.monotonic() - t0, 2),
                tail=out[-400:] if proc.returncode else "")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--without-keep", action="store_true",
                    help="turn off the library's keeping of its latest collectives' Work")
    ap.add_argument("--timeout", type=float, default=300.0, help="per launch, seconds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tmp",
                                   time.strftime("clean-exit-%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        for k in range(args.launches):
            variant = args.variants[k % len(args.variants)]
            ranks = args.ranks[(k // len(args.variants)) % len(args.ranks)]
            rec = launch(script, variant, ranks, not args.without_keep, args.timeout)
            records.append(rec)
            if rec["returncode"]:
                print(f"launch {k}: {variant}, {ranks} ranks: exit {rec['returncode']}, "
                      f"{rec['aborts']} abort(s)", flush=True)
    summary = collections.defaultdict(lambda: dict(launches=0, failed=0, aborts=0))
    for r in records:
        s = summary[f"{r['variant']} x{r['ranks']}"]
        s["launches"] += 1
        s["failed"] += r["returncode"] != 0
        s["aborts"] += r["aborts"]
    result = dict(launches=len(records), keep=not args.without_keep,
                  failed=sum(r["returncode"] != 0 for r in records), by_variant=dict(summary))
    with open(os.path.join(out, "launches.json"), "w") as f:
        json.dump(records, f, indent=1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    print(f"results in {out}")
    return result


if __name__ == "__main__":
    main()
