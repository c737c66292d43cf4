"""What the momentum policy on heal does to the loss after a replica restarts (docs/elastic.md).

3 ranks train a small MLP on a teacher's regression task with ``DistributedLion`` (vote/binary),
each rank on its own batches. At step ``--restart`` replica 2 "restarts": it keeps the parameters
(healing copies them from a live replica) and its momentum becomes, per policy:

    none   no failure (the reference)
    zero   zero: a fresh process with heal_momentum="own" or "zero"
    peer   a copy of replica 0's momentum (heal_momentum="peer")
    own    its own momentum from a checkpoint taken ``--stale`` steps earlier (heal_momentum="own"
           after dk.load_state of a local checkpoint)

The restart is immediate (no steps with 2 replicas), so only the momentum differs. Reported: the
mean test loss over the ``--window`` steps after the restart and at its end, relative to "none",
averaged over seeds. The elastic machinery itself (torchft's quorum, healing) is not run here:
its tests are python_tests/test_elastic.py.

    python bench/bench_heal_momentum.py --seeds 3
"""

from __future__ import annotations

import argparse
import json
import os
import time

POLICIES = ("none", "zero", "peer", "own")


def _worker(rank, n, args):
    import torch
    import torch.distributed as dist

    import dlion_kernels as dk

    torch.set_num_threads(1)
    out = {}
    for seed in range(args["seeds"]):
        teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                      torch.nn.Linear(64, 1))
        torch.manual_seed(100 + seed)
        for p in teacher.parameters():
            p.data.normal_(0, 1)
        test_x = torch.randn(512, 32, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            test_y = teacher(test_x)
        for policy in POLICIES:
            torch.manual_seed(seed)  # the same initial weights on every rank
            model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 1))
            opt = dk.DistributedLion(model.parameters(), lr=args["lr"])
            gen = torch.Generator().manual_seed(1000 * seed + rank)
            params = list(model.parameters())
            snapshot = None
            losses = []
            for step in range(args["restart"] + args["window"]):
                if step == args["restart"] - args["stale"]:
                    snapshot = [opt.state[p]["exp_avg"].clone() for p in params]
                if step == args["restart"] and policy != "none":
                    peer = [opt.state[p]["exp_avg"].clone() for p in params]
                    for m in peer:  # replica 0's momentum, sent to every rank
                        dist.broadcast(m, src=0)
                    if rank == 2:
                        new = {"zero": [torch.zeros_like(m) for m in peer], "peer": peer,
                               "own": snapshot}[policy]
                        for p, m in zip(params, new):
                            opt.state[p]["exp_avg"].copy_(m)
                x = torch.randn(32, 32, generator=gen)
                with torch.no_grad():
                    y = teacher(x)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if step >= args["restart"]:
                    with torch.no_grad():
                        losses.append(torch.nn.functional.mse_loss(model(test_x), test_y).item())
            out[(seed, policy)] = losses
    return out if rank == 0 else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--restart", type=int, default=150)
    parser.add_argument("--window", type=int, default=60)
    parser.add_argument("--stale", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    from dlion_kernels.launch import spawn

    args = dict(seeds=a.seeds, restart=a.restart, window=a.window, stale=a.stale, lr=a.lr)
    results = spawn(3, _worker, args, timeout=1800)[0]
    rows = {}
    for policy in POLICIES:
        mean, end = [], []
        for seed in range(a.seeds):
            ref = results[(seed, "none")]
            cur = results[(seed, policy)]
            mean.append(sum(cur) / sum(ref))
            end.append(sum(cur[-10:]) / sum(ref[-10:]))
        rows[policy] = dict(mean_loss_vs_none=sum(mean) / len(mean),
                            end_loss_vs_none=sum(end) / len(end))
        print(f"{policy:5s}  window mean loss x{rows[policy]['mean_loss_vs_none']:.4f}  "
              f"last 10 steps x{rows[policy]['end_loss_vs_none']:.4f}")
    out = a.out or os.path.join(os.path.dirname(__file__), "results",
                                time.strftime("heal-momentum-%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(args=args, relative=rows,
                       losses={f"{s}/{p}": v for (s, p), v in results.items()}), f, indent=1)
    print("written", out)


if __name__ == "__main__":
    main()
