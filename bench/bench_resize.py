"""Resuming D-Lion on another number of ranks: does training go on without a loss spike?

    python bench/bench_resize.py [--smoke] [--out DIR]

Phase A trains the digits demo's MLP (dlion_kernels.demo.digits) with DistributedLion(vote) on
--old ranks, then saves the model weights (rank 0: parameters are identical on every rank) and
dk.save_state. Phase B resumes on each of --new rank counts and trains on, with the optimizer
state from:

- mean:  dk.load_state (the library's rule: every new rank takes the mean of the old momenta;
         on the same world size each rank gets its own back);
- rank0: every rank loads old rank 0's state (the habit from DDP, for comparison);
- zero:  no optimizer state (momentum restarts at 0).

It prints and writes (resize.json, resize.csv, resize.md, under bench/results/resize-<timestamp>/
or --out) the training loss (mean over ranks, per step) around the resume, and the test accuracy
at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import common
import torch
import torch.distributed as dist


def _train(rank, n, model, opt, data, steps, batch, seed):
    (x, y), _ = data
    losses = []
    gen_epoch = seed
    while len(losses) < steps:
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(gen_epoch))
        gen_epoch += 1
        mine = perm[rank::n]
        for i in range(0, len(mine) - batch + 1, batch):
            idx = mine[i:i + batch]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / n)
            if len(losses) == steps:
                break
    return losses


def _accuracy(model, data):
    _, (x, y) = data
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def _phase(rank, n, args, ckpt, phase, rules):
    """Phase A (train, save) or B (for each of ``rules`` in turn: a fresh model and optimizer,
    loaded by that rule, trained on); rank 0 returns losses and accuracy (a list in phase B)."""
    import dlion_kernels as dk
    from dlion_kernels.demo.digits import load_digits, make_model

    data = load_digits(0)
    if phase == "A":
        model = make_model(args.hidden, 0)
        opt = dk.DistributedLion(model.parameters(), lr=args.lr, weight_decay=1e-2)
        losses = _train(rank, n, model, opt, data, args.steps_before, args.batch, 0)
        if rank == 0:
            torch.save(model.state_dict(), os.path.join(ckpt, "model.pt"))
        dk.save_state(opt, ckpt)
        return dict(losses=losses, accuracy=_accuracy(model, data)) if rank == 0 else None
    out = []
    for rule in rules:  # one launch per rank count: the rules share its processes
        model = make_model(args.hidden, 0)
        opt = dk.DistributedLion(model.parameters(), lr=args.lr, weight_decay=1e-2)
        model.load_state_dict(torch.load(os.path.join(ckpt, "model.pt")))
        if rule == "mean":
            dk.load_state(opt, ckpt)
        elif rule == "rank0":
            manifest = dk.checkpoint.read_manifest(ckpt)
            opt.load_state_dict(torch.load(os.path.join(ckpt, manifest["files"][0]["file"])))
        losses = _train(rank, n, model, opt, data, args.steps_after, args.batch, 1000)
        out.append(dict(losses=losses, accuracy=_accuracy(model, data)))
    return out if rank == 0 else None


def _run(n, args, ckpt, phase, rules=None):
    return common.run_ranks(n, _phase, args, ckpt, phase, rules, timeout=3600)[0]


def _mean(xs):
    return sum(xs) / len(xs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=int, default=4)
    ap.add_argument("--new", type=int, nargs="+", default=[4, 2, 3, 8])
    ap.add_argument("--steps-before", type=int, default=300)
    ap.add_argument("--steps-after", type=int, default=100)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    common.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.old, args.new, args.steps_before, args.steps_after = 2, [3], 40, 20
    out = common.results_dir("resize", args.out)
    load_before = os.getloadavg()
    w = args.window
    rows = []
    with tempfile.TemporaryDirectory() as ckpt:
        before = _run(args.old, args, ckpt, "A", None)
        ref = _mean(before["losses"][-w:])
        for n_new in args.new:
            rules = [r for r in ("mean", "rank0", "zero") if not (n_new == args.old
                                                                 and r == "rank0")]
            for rule, res in zip(rules, _run(n_new, args, ckpt, "B", rules)):
                after = res["losses"]
                rows.append(dict(n_old=args.old, n_new=n_new, rule=rule,
                                 loss_before=ref, loss_first=_mean(after[:w]),
                                 loss_first_max=max(after[:w]),
                                 loss_last=_mean(after[-w:]), accuracy=res["accuracy"],
                                 losses=after))
                print(f"{args.old} -> {n_new} ranks, {rule}: loss {ref:.4f} before, "
                      f"{rows[-1]['loss_first']:.4f} (max {rows[-1]['loss_first_max']:.4f}) in "
                      f"the first {w} steps after, {rows[-1]['loss_last']:.4f} at the end; "
                      f"accuracy {res['accuracy']:.3f}", flush=True)
    meta = common.metadata(dict(benchmark="bench_resize", loadavg_before=load_before,
                                loadavg_after=os.getloadavg(),
                                **{k: v for k, v in vars(args).items() if k != "out"}))
    common.save(out, "resize", rows, meta, before=before)
    table = common.markdown_table(
        [dict(r, move=f"{r['n_old']} -> {r['n_new']}",
              first=f"{r['loss_first']:.4f} ({r['loss_first_max']:.4f})",
              percent=f"{100 * r['accuracy']:.1f}%") for r in rows],
        [("move", f"{args.old} -> n"), ("rule", "optimizer state"),
         ("loss_before", f"loss, last {w} before", ".4f"), ("first", f"first {w} after (max)"),
         ("loss_last", f"last {w}", ".4f"), ("percent", "test accuracy")])
    text = (f"Digits MLP, DistributedLion(vote, binary), lr {args.lr}, batch {args.batch}/rank: "
            f"{args.steps_before} steps on {args.old} ranks, then {args.steps_after} steps on "
            f"the new count. Losses: mean over ranks per step, averaged over {w} steps. Load "
            f"average {load_before[0]:.1f} on {os.cpu_count()} CPUs.\n\n{table}")
    common.save_text(out, "resize.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
