"""The runtime model's diloco rows against this run's measured inner steps.

    python bench/results/diloco-wallclock-20261128/plan_check.py

One number is fitted: the compute of an inner step (forward + backward + inner AdamW, split
1:2 between forward and backward), from diloco-dlion at 1 Gbit/s, where its wire is negligible.
Every other (strategy, rate) is then predicted by ``dlion_kernels.plan.predict`` (the same
model, the chars transformer's 116,834 parameters, 4 ranks, one per node, H = 8, the link rate
of the run) and compared with the measured mean inner step (wall time over inner steps, syncs
included). Writes plan_check.md next to this file.
"""
import json
import os

from dlion_kernels import plan

HERE = os.path.dirname(os.path.abspath(__file__))
PARAMS, RANKS, H = 116_834, 4, 8
NAMES = {"diloco-nesterov (H = 8)": "diloco-nesterov", "diloco-dlion (H = 8)": "diloco-dlion",
         "diloco-sparseloco (H = 8)": "diloco-sparseloco",
         "diloco-dlion-ef-decay (H = 8)": "diloco-dlion-ef-decay"}


def predicted(strategy, rate, compute_ms):
    rows = plan.predict(PARAMS, RANKS, 1, inter_gbps=rate, fwd_ms=compute_ms / 3,
                        bwd_ms=2 * compute_ms / 3, sync_every=H, strategies=[strategy])
    return rows[0].step_ms


def main():
    rows = json.load(open(os.path.join(HERE, "wallclock.json")))["rows"]
    measured = {(NAMES[r["strategy"]], r["rate_gbps"]): r["ms_per_step"] for r in rows
                if r["strategy"] in NAMES}
    base = predicted("diloco-dlion", 1.0, 0.0)  # the model's step without compute
    compute = measured[("diloco-dlion", 1.0)] - base
    lines = ["# The runtime model's diloco rows against the measured inner steps", "",
             f"Fitted: compute per inner step {compute:.1f} ms (diloco-dlion at 1 Gbit/s). "
             "Error: predicted / measured - 1.", "",
             "| strategy | Gbit/s | measured ms / inner step | predicted | error |",
             "|---|---|---|---|---|"]
    errors = []
    for (strategy, rate), ms in sorted(measured.items()):
        p = predicted(strategy, rate, compute)
        fitted = (strategy, rate) == ("diloco-dlion", 1.0)
        if not fitted:
            errors.append(abs(p / ms - 1))
        lines.append(f"| {strategy} | {rate:g} | {ms:.1f} | {p:.1f} | "
                     f"{'(fitted)' if fitted else f'{100 * (p / ms - 1):+.0f}%'} |")
    errors.sort()
    lines += ["", f"Over the {len(errors)} predicted rows: median |error| "
              f"{100 * errors[len(errors) // 2]:.0f}%, worst {100 * errors[-1]:.0f}%.", ""]
    text = "\n".join(lines)
    with open(os.path.join(HERE, "plan_check.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
