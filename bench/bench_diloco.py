"""dk.DiLoCo side by side with torchft's DiLoCo (``torchft.local_sgd.DiLoCo``, PyPI torchft 0.2.0).

    python bench/bench_diloco.py [--steps 96] [--sync-every 8] [--repeats 3] [--smoke] [--out DIR]

Two replicas (gloo CPU processes, one thread each) train the chars demo's transformer
(dlion_kernels.demo.chars: the same initial weights, each replica its half of the same global
batches) with AdamW inner steps and a sync every H = --sync-every inner steps:

- dk-nesterov:       dk.DiLoCo(outer="nesterov"), DiLoCo's outer step (lr 0.7, momentum 0.9)
- torchft-nesterov:  torchft's DiLoCo with outer torch.optim.SGD(lr=0.7, momentum=0.9,
                     nesterov=True), one Manager per replica group and a LighthouseServer in
                     this process (docs/diloco.md says how it is set up)
- dk-dlion-vote:     dk.DiLoCo(outer="dlion") with its default outer step (error feedback, the
                     default outer lr), mode="vote", votes="binary" (1 bit per parameter each
                     way)
- dk-dlion-average:  the same with mode="average" (2-bit aggregate for two replicas)

Every variant runs in its own launch, the variants alternate, and the whole round is repeated
--repeats times (the machine is shared: wall times are noisy). Per launch: the validation loss
at the end (after the last sync, on the synced weights), the mean training loss of the last H
steps, bytes per sync and rank, the wall time of an inner step (median over the steps without a
sync, the slower rank) and of a sync (median over the sync steps of the step time minus that).
The table gives the median over the launches and the spread (min-max). Bytes: dk's from its
SyncStats; torchft's are the ring all-reduce figure 2 (n-1)/n * bytes of the tensors it hands to
Manager.allreduce (its quorum and commit messages are not counted). The parameters after every
sync of dk-nesterov and torchft-nesterov are compared element by element (the same math on the
same data: they should agree bit for bit).

Writes diloco_torchft.json/.csv (one row per launch), summary.md and the summary table rows, under
bench/results/diloco-torchft-<timestamp>/ or --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import traceback

import common
import torch

VARIANTS = ("dk-nesterov", "torchft-nesterov", "dk-dlion-vote", "dk-dlion-average")
N = 2  # replicas


# ----------------------------------------------------------------------------- training


def _setup(args):
    from dlion_kernels.demo import chars

    torch.set_num_threads(1)
    data = chars.load_text()
    torch.manual_seed(args.seed)
    model = chars.CharTransformer(chars.VOCAB, args.d_model, args.heads, args.layers,
                                  args.context)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr, weight_decay=1e-2)
    return chars, data, model, inner


def _train(rank, args, chars, data, model, inner, after_step) -> dict:
    """``args.steps`` inner steps; ``after_step()`` after each ``inner.step()``. Times each whole
    iteration (batch, forward, backward, inner step, sync)."""
    train, val = data
    times, losses, snapshots = [], [], []
    for it in range(args.steps):
        starts = chars.train_starts(len(train), args.seed, it, rank, N, args.batch_size,
                                    args.context)
        x, y = chars.batch(train, starts, args.context)
        tic = time.perf_counter()
        inner.zero_grad()
        loss = chars._loss(model(x), y)
        loss.backward()
        inner.step()
        after_step()
        times.append(time.perf_counter() - tic)
        losses.append(loss.item())
        if (it + 1) % args.sync_every == 0:
            snapshots.append(torch.cat([p.detach().reshape(-1).clone()
                                        for p in model.parameters()]))
    evals = chars.val_starts(len(val), args.eval_windows, args.context)
    return dict(times=times, losses=losses, snapshots=snapshots,
                val_loss=chars.val_loss(model, val, evals, args.context, "cpu"))


def _dk_rank(rank, n, args, variant):
    """One replica of a dk variant (a rank of common.run_ranks' gloo group)."""
    import dlion_kernels as dk

    chars, data, model, inner = _setup(args)
    outer = "nesterov" if variant == "dk-nesterov" else "dlion"
    kwargs = dict(outer_lr=args.dlion_lr, mode=variant.rsplit("-", 1)[1], votes="binary") \
        if outer == "dlion" else dict(outer_lr=0.7, outer_momentum=0.9)
    diloco = dk.DiLoCo(model, inner, sync_every=args.sync_every, outer=outer, **kwargs)
    sent = []

    def after_step():
        stats = diloco.step()
        if stats is not None:
            sent.append(stats.bytes_sent)

    return dict(_train(rank, args, chars, data, model, inner, after_step), bytes_per_sync=sent)


def _torchft_rank(replica, args, lighthouse, out_dir):
    """One replica group of torchft's DiLoCo (its own process, not in any gloo group of ours)."""
    path = os.path.join(out_dir, f"replica{replica}.pt")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's quorum log: a few lines per sync
    try:
        from torchft.local_sgd import DiLoCo

        from dlion_kernels import launch
        from dlion_kernels.accounting import ring_all_reduce_bytes

        chars, data, model, inner = _setup(args)
        manager = launch.replica_manager(
            str(replica), lighthouse, min_replica_size=N, load_state_dict=model.load_state_dict,
            state_dict=model.state_dict, timeout=120.0, quorum_timeout=120.0,
            # the replicas start from the same seeded weights; init_sync=True (the default)
            # would heal one replica from the other at the first quorum, i.e. at DiLoCo's
            # first sync, after H local steps
            init_sync=False)
        handed = []  # bytes of the tensors handed to the all-reduce, per sync
        allreduce = manager.allreduce

        def counting_allreduce(tensor, *a, **kw):
            handed.append(tensor.numel() * tensor.element_size())
            return allreduce(tensor, *a, **kw)

        manager.allreduce = counting_allreduce
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every):
            res = _train(replica, args, chars, data, model, inner, lambda: None)
        syncs = args.steps // args.sync_every
        per_sync = sum(handed) / max(syncs, 1)
        res["bytes_per_sync"] = [round(ring_all_reduce_bytes(N, per_sync))] * syncs
        res["manager_step"] = manager.current_step()
        manager.shutdown(wait=False)
        result = ("ok", res)
    except BaseException:
        result = ("error", traceback.format_exc())
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)
    os._exit(0)


def _run_torchft(args) -> list:
    from dlion_kernels import launch

    lighthouse = launch.lighthouse(min_replicas=N)
    ctx = mp.get_context("spawn")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=_torchft_rank,
                                 args=(r, args, lighthouse.address(), tmp))
                     for r in range(N)]
            for p in procs:
                p.start()
            end = time.monotonic() + args.timeout
            for p in procs:
                p.join(max(0.0, end - time.monotonic()))
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            results = []
            for r in range(N):
                path = os.path.join(tmp, f"replica{r}.pt")
                if not os.path.exists(path):
                    raise RuntimeError(f"torchft replica {r} left no result"
                                       + (" (timed out)" if r in alive else ""))
                status, res = torch.load(path, weights_only=False)
                if status != "ok":
                    raise RuntimeError(f"torchft replica {r} failed:\n{res}")
                results.append(res)
            return results
    finally:
        lighthouse.shutdown()


def launch(variant, args) -> list:
    if variant == "torchft-nesterov":
        return _run_torchft(args)
    return common.run_ranks(N, _dk_rank, args, variant, timeout=args.timeout)


# ----------------------------------------------------------------------------- report


def summarize_launch(variant, repeat, ranks, args) -> dict:
    h = args.sync_every
    inner_ms, sync_ms = [], []
    for res in ranks:
        plain = [t for i, t in enumerate(res["times"]) if (i + 1) % h]
        syncs = [t for i, t in enumerate(res["times"]) if (i + 1) % h == 0]
        inner_ms.append(1e3 * statistics.median(plain))
        sync_ms.append(1e3 * (statistics.median(syncs) - statistics.median(plain)))
    tail = [statistics.fmean(res["losses"][-h:]) for res in ranks]
    return dict(variant=variant, repeat=repeat, val_loss=ranks[0]["val_loss"],
                train_loss_last_window=statistics.fmean(tail),
                ranks_agree=all(torch.equal(ranks[0]["snapshots"][-1], r["snapshots"][-1])
                                for r in ranks[1:]),
                bytes_per_sync=statistics.fmean(ranks[0]["bytes_per_sync"]),
                syncs=len(ranks[0]["bytes_per_sync"]),
                inner_step_ms=max(inner_ms), sync_ms=max(sync_ms))


def _spread(values, fmt) -> str:
    return f"{format(min(values), fmt)}-{format(max(values), fmt)}"


def summary_rows(rows) -> list[dict]:
    out = []
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        if not mine:
            continue
        row = dict(variant=variant, launches=len(mine))
        for key, fmt in (("val_loss", ".4f"), ("train_loss_last_window", ".4f"),
                         ("inner_step_ms", ".1f"), ("sync_ms", ".1f")):
            values = [r[key] for r in mine]
            row[key] = statistics.median(values)
            row[key + "_spread"] = _spread(values, fmt)
        row["bytes_per_sync"] = mine[0]["bytes_per_sync"]
        row["ranks_agree"] = all(r["ranks_agree"] for r in mine)
        out.append(row)
    return out


def compare_trajectories(a, b) -> dict:
    """Rank 0's parameters after each sync of two launches."""
    diffs = [float((x - y).abs().max()) for x, y in zip(a[0]["snapshots"], b[0]["snapshots"])]
    same = all(torch.equal(x, y) for x, y in zip(a[0]["snapshots"], b[0]["snapshots"]))
    return dict(syncs=len(diffs), bit_identical=same, max_abs_diff_per_sync=diffs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=96, help="inner steps per launch")
    ap.add_argument("--sync-every", type=int, default=8, help="H")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--inner-lr", type=float, default=3e-3, help="AdamW's")
    ap.add_argument("--dlion-lr", type=float, default=None,
                    help="dk-dlion's outer_lr (default: DiLoCo's default for D-Lion)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per replica per step")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    common.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.sync_every, args.repeats = 8, 4, 1
        args.d_model, args.layers, args.context, args.eval_windows = 16, 1, 16, 8
    if args.steps % args.sync_every:
        ap.error("--steps must be a multiple of --sync-every (the loss is read after a sync)")
    skipped = {}
    if "torchft-nesterov" in args.variants and importlib.util.find_spec("torchft") is None:
        skipped["torchft-nesterov"] = "torchft is not installed (pip install torchft==0.2.0)"
        args.variants.remove("torchft-nesterov")
        print(f"skipping torchft-nesterov: {skipped['torchft-nesterov']}", flush=True)
    out = common.results_dir("diloco-torchft", args.out)
    load_before = os.getloadavg()
    rows, first = [], {}
    for repeat in range(args.repeats):
        for variant in args.variants:
            ranks = launch(variant, args)
            first.setdefault(variant, ranks)
            rows.append(summarize_launch(variant, repeat, ranks, args))
            r = rows[-1]
            print(f"repeat {repeat} {variant}: val loss {r['val_loss']:.4f}, inner step "
                  f"{r['inner_step_ms']:.1f} ms, sync +{r['sync_ms']:.1f} ms, "
                  f"{r['bytes_per_sync']:,.0f} B/sync", flush=True)
    extra = {}
    if "dk-nesterov" in first and "torchft-nesterov" in first:
        extra["trajectory_dk_vs_torchft"] = compare_trajectories(first["dk-nesterov"],
                                                                 first["torchft-nesterov"])
        t = extra["trajectory_dk_vs_torchft"]
        print(f"dk-nesterov vs torchft-nesterov after each of {t['syncs']} syncs: bit-identical "
              f"{t['bit_identical']}, max |diff| {max(t['max_abs_diff_per_sync'], default=0):g}")
    table = summary_rows(rows)
    numel = first[args.variants[0]][0]["snapshots"][0].numel()
    text = common.markdown_table(table, [
        ("variant", "variant"), ("val_loss", "val loss", ".4f"),
        ("val_loss_spread", "spread"), ("train_loss_last_window", "train loss (last H)", ".4f"),
        ("bytes_per_sync", "bytes / sync / rank", ",.0f"),
        ("inner_step_ms", "inner step (ms)", ".1f"), ("inner_step_ms_spread", "spread"),
        ("sync_ms", "sync (ms, extra)", ".1f"), ("sync_ms_spread", "spread"),
        ("ranks_agree", "replicas agree")],
        title=f"{N} replicas, {numel:,} parameters, H = {args.sync_every}, {args.steps} inner "
              f"steps, median of {args.repeats} launches")
    print(text)
    meta = common.metadata(dict(benchmark="bench_diloco", loadavg_before=load_before,
                                loadavg_after=os.getloadavg(), numel=numel,
                                **{k: v for k, v in vars(args).items() if k != "out"}))
    common.save(out, "diloco_torchft", rows, meta, summary=table, skipped=skipped, **extra)
    common.save_text(out, "summary.md", text)
    print(f"saved {out}")
    return rows


if __name__ == "__main__":
    main()
