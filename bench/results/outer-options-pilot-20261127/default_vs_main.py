"""DiLoCo's default outer steps on 2 gloo ranks with whichever dlion_kernels is on PYTHONPATH:
saves theta_bar, the outer momenta, the parameters and the bytes of each sync after 9 inner
steps, per configuration, to <prefix>-rank<r>.pt. Run once per checkout and compare the files:

    PYTHONPATH=<main checkout> python default_vs_main.py /tmp/cmp/main
    PYTHONPATH=<this branch> python default_vs_main.py /tmp/cmp/branch
"""
import sys

import torch

from dlion_kernels.launch import spawn

CONFIGS = [("dlion", "vote", "binary", 0), ("dlion", "average", "ternary", 0),
           ("dlion", "vote", "binary", 1), ("nesterov", "vote", "binary", 0)]


def work(rank, n, out):
    from dlion_kernels.local.diloco import DiLoCo

    res = {}
    for outer, mode, votes, tau in CONFIGS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(),
                                    torch.nn.Linear(33, 3))
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        d = DiLoCo(model, inner, 3 if tau == 0 else 4, outer, mode=mode, votes=votes,
                   overlap_steps=tau, outer_weight_decay=0.1 if outer == "dlion" else 0.0)
        sent = []
        for t in range(1, 10):
            g = torch.Generator().manual_seed(1000 * rank + t)
            x, y = torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)
            inner.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            inner.step()
            st = d.step()
            sent.append(None if st is None else st.bytes_sent)
        res[(outer, mode, votes, tau)] = (
            [t.clone() for t in d.theta_bar], [m.clone() for m in d.outer_momenta],
            [p.detach().clone() for p in model.parameters()], sent)
    torch.save(res, f"{out}-rank{rank}.pt")


if __name__ == "__main__":
    spawn(2, work, sys.argv[1])
