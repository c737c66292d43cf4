"""The decay sweep of the outer study, kept as it ran: held-out-seed runs of the D-Lion outer
step with other options and outer betas (the study's run_one, model, data and rules).

    PROBE_CFGS='[["d0.5", 32, 0.017, {"error_feedback": true, "ef_decay": 0.5}, [0.9, 0.99]]]' \
    PROBE_OUT=runs.jsonl python bench/results/outer-study-20261127/decay-probe/probe.py
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 3))
import bench_outer_study as S  # noqa: E402
import common  # noqa: E402

CFGS = json.loads(os.environ["PROBE_CFGS"])  # [[label, H, lr, options, outer betas], ...]
OUT = os.environ["PROBE_OUT"]


def worker(rank, n):
    import dlion_kernels as dk
    from dlion_kernels.demo import chars

    data = chars.load_text()
    for label, H, lr, opts, betas in CFGS:
        def build(method, model, H_, lr_, n_, opts=opts, betas=betas):
            inner = S.torch.optim.AdamW(list(model.parameters()), lr=S.INNER_LR,
                                        weight_decay=S.WEIGHT_DECAY)
            d = dk.DiLoCo(model, inner, H_, "dlion", outer_lr=lr_, mode="vote", votes="binary",
                          outer_options=opts, outer_betas=tuple(betas))
            return inner, lambda: None, d.step, lambda: d.bytes_sent, d
        S._build = build
        cfg = dict(phase="tune", method="probe", H=H, lr=lr, seed=100, label=label)
        r = S.run_one(rank, n, cfg, data, 2048, 64)
        if rank == 0:
            with open(OUT, "a") as f:
                f.write(json.dumps({k: v for k, v in r.items() if k != "curve"}) + "\n")
            print(f"[{time.strftime('%H:%M:%S')}] {label} H={H} lr={lr}: {r['val_loss']:.4f} "
                  f"({r['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    common.run_ranks(4, worker, timeout=None, threads=1)
