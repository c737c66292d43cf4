"""bench_diloco_chars.py wallclock without the network (which needs root): the cases it runs
(every strategy, its steps and its outer lr) and the summary of made-up curves (time to the
target, the first to reach it, each one's time relative to the first's)."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))
import bench_diloco_chars as bdc  # noqa: E402

from dlion_kernels import recipes as b  # noqa: E402
from dlion_kernels import strategies  # noqa: E402


def _args(*argv):
    """The parsed wallclock arguments, as main() would parse them."""
    seen = []
    real, bdc.wallclock = bdc.wallclock, seen.append  # parse only: nothing runs
    try:
        bdc.main(["wallclock", *argv])
    finally:
        bdc.wallclock = real
    return seen[0]


def test_defaults_and_cases():
    args = _args()
    assert args.rates == [0.01, 0.1, 1.0]
    cases = bdc._cases(args)
    assert [c["strategy"] for c in cases] == [
        "adamw-allreduce", "dlion-vote", "diloco-nesterov", "diloco-sparseloco", "diloco-dlion",
        "diloco-dlion-ef-decay"]
    assert all(strategies.get(c["strategy"]) for c in cases)
    assert cases[0]["iters"] == 320 and all(c["iters"] == 480 for c in cases[1:])
    assert all(c["sync_every"] == 8 for c in cases)
    assert not any(k.endswith("_lr") for c in cases for k in c)  # each strategy's default


def test_outer_lrs_reach_the_settings():
    args = _args("--h", "16", "--iters", "10", "--extra-iters", "6", "--eval-every", "16",
                 "--dlion-lr", "0.01", "--nesterov-lr", "0.5", "--sparseloco-lr", "0.9",
                 "--dlion-ef-decay-lr", "0.02")
    cases = {c["strategy"]: c for c in bdc._cases(args)}
    assert cases["diloco-dlion"]["dlion_lr"] == 0.01
    assert cases["diloco-dlion-ef-decay"]["dlion_lr"] == 0.02
    assert cases["diloco-nesterov"]["nesterov_lr"] == 0.5
    assert cases["diloco-sparseloco"]["sparseloco_lr"] == 0.9
    assert cases["diloco-sparseloco"]["iters"] == 16 and cases["diloco-dlion"]["sync_every"] == 16
    # the keys are the worker's: Settings fields of the same names with a diloco_ prefix
    for c in cases.values():
        lrs = {f"diloco_{k}": v for k, v in c.items() if k.endswith("_lr")}
        b.Settings(sync_every=c["sync_every"], **lrs)


def _curve(points):
    return [dict(step=s, wall_s=w, bytes=100 * s, val_loss=v) for s, w, v in points]


def test_summary_names_the_first_and_relative_times():
    args = _args("--rates", "0.01", "1")
    results = []
    for rate, slow in ((0.01, 3.0), (1.0, 1.0)):
        results += [
            dict(strategy="adamw-allreduce", sync_every=8, rate_gbps=rate,
                 curve=_curve([(0, 0, 4.0), (8, 4 * slow, 2.5), (16, 8 * slow, 2.0)])),
            dict(strategy="dlion-vote", sync_every=8, rate_gbps=rate,
                 curve=_curve([(0, 0, 4.0), (8, 2, 2.4), (16, 4, 1.9)])),
            dict(strategy="diloco-dlion-ef-decay", sync_every=8, rate_gbps=rate,
                 curve=_curve([(0, 0, 4.0), (8, 1, 2.0), (16, 2, 1.8)])),
            dict(strategy="diloco-sparseloco", sync_every=8, rate_gbps=rate,
                 curve=_curve([(0, 0, 4.0), (8, 1, 3.0), (16, 2, 2.9)]))]
    rows = bdc._reach(results)
    text = bdc._wallclock_md(rows, args)
    blocks = text.split("### ")[1:]
    assert [b.split(" ")[0] for b in blocks] == ["0.01", "1"]
    for block, slow in zip(blocks, (3.0, 1.0)):
        assert "First to the target: diloco-dlion-ef-decay (H = 8)." in block
        assert ("Time to the target relative to the first: diloco-dlion-ef-decay (H = 8) 1.00x, "
                f"dlion-vote 4.00x, adamw-allreduce {8 * slow:.2f}x, "
                "diloco-sparseloco (H = 8) not reached.") in block
        assert "| diloco-sparseloco (H = 8) | not reached |" in block


def test_summary_when_none_reaches_it():
    args = _args("--rates", "1")
    results = [dict(strategy="adamw-allreduce", sync_every=8, rate_gbps=1.0,
                    curve=_curve([(0, 0, 4.0), (8, 0, float("nan"))]))]
    text = bdc._wallclock_md(bdc._reach(results), args)
    assert "First to the target: none." in text and "relative to the first" not in text
