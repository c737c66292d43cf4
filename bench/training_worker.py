"""One rank of ``bench_training.py`` (the driver starts it inside its node's namespace):

    python bench/training_worker.py CFG.json

runs every case of the configuration file (variant, batch, bucket size) on the same process and
rank 0 writes the per-rank timings and stats to the file the configuration names.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

TOPOLOGY = {"dec_ring": "ring", "dec_one_peer_exp": "one-peer-exp",
            "dec_alt_exp_ring": "alternating-exp-ring"}


def engine_buckets(obj, depth=2):
    """Number of buckets of a bucket engine reachable from ``obj`` (TEAM.md's Bucket: index,
    params, offsets, blocks), or None."""
    seen = set()

    def walk(o, d):
        if id(o) in seen or d < 0:
            return None
        seen.add(id(o))
        for v in list(getattr(o, "__dict__", {}).values()):
            if isinstance(v, (list, tuple)) and v and all(
                    hasattr(b, "blocks") and hasattr(b, "offsets") for b in v):
                return len(v)
            if hasattr(v, "__dict__") and not isinstance(v, type) and d > 0:
                got = walk(v, d - 1)
                if got:
                    return got
        return None

    return walk(obj, depth)


def worker(cfg_path: str) -> None:
    """One rank, inside its node's namespace (RANK etc. from the environment)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dlion_kernels as dk

    with open(cfg_path) as f:
        cfg = json.load(f)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    L = int(os.environ["LOCAL_WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['master']}:{cfg['port']}",
                            rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    solo = [dist.new_group([r]) for r in range(n)][rank]  # every rank creates every group
    if L > 1:
        intra = [dist.new_group(list(range(s, s + L))) for s in range(0, n, L)][rank // L]
        inter = [dist.new_group(list(range(j, n, L))) for j in range(L)][rank % L]
    width, depth, lr = cfg["width"], cfg["depth"], 1e-4

    def tx_bytes() -> int:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())

    def bf16_hook(state, bucket):
        buf = bucket.buffer()
        low = buf.to(torch.bfloat16).div_(n)

        def back(fut):
            buf.copy_(fut.value()[0])
            return buf

        return dist.all_reduce(low, async_op=True).get_future().then(back)

    # gloo's reduce-scatter Work has no future to chain on: run each bucket's three
    # collectives on one thread (one, so buckets keep the same order on every rank)
    hier_pool = ThreadPoolExecutor(max_workers=1) if L > 1 else None
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def hier_hook(state, bucket):
        buf = bucket.buffer()
        fut = torch.futures.Future()

        def run():
            try:
                numel, pad = buf.numel(), (-buf.numel()) % L
                flat = torch.cat([buf, buf.new_zeros(pad)]) if pad else buf
                shard = flat.new_empty(flat.numel() // L)
                scatter(shard, flat, group=intra)
                dist.all_reduce(shard, group=inter)
                shard.div_(n)
                gather(flat, shard, group=intra)
                if pad:
                    buf.copy_(flat[:numel])
                fut.set_result(buf)
            except Exception as e:  # noqa: BLE001 - handed to DDP through the future
                fut.set_exception(e)

        hier_pool.submit(run)
        return fut

    def build(case):
        """(model to call, optimizer or None, object holding stats, finish())."""
        key, bucket_mb = case["variant"], case["bucket_mb"]
        torch.manual_seed(0)  # identical initial parameters on every rank
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers)
        params = list(model.parameters())
        lion = lambda ps: dk.DistributedLion(ps, lr=lr, votes="ternary", group=solo)  # noqa: E731
        if key == "no_comm":
            return model, dk.DistributedLion(params, lr=lr, group=solo), None
        if key.startswith("ddp_") or key == "hier_fp32":
            ddp = DDP(model, bucket_cap_mb=bucket_mb)
            if key == "ddp_fp16":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif key == "ddp_bf16":
                ddp.register_comm_hook(None, bf16_hook)
            elif key == "hier_fp32":
                ddp.register_comm_hook(None, hier_hook)
            return ddp, lion(params), ddp
        if key == "dlion":
            return model, dk.DistributedLion(params, lr=lr), None
        if key == "dlion_overlap":
            opt = dk.DistributedLion(params, lr=lr, overlap=True, bucket_mb=bucket_mb)
            return model, opt, opt
        if key == "dlion_ddp_hook":
            ddp = DDP(model, bucket_cap_mb=bucket_mb)
            opt = dk.DistributedLion(ddp.parameters(), lr=lr)
            dk.register_ddp_comm_hook(ddp, opt)
            return ddp, opt, ddp
        if key.startswith("dlion_hier"):
            kw = {"overlap": True, "bucket_mb": bucket_mb} if key.endswith("overlap") else {}
            opt = dk.DistributedLion(params, lr=lr, hierarchy=L, **kw)
            return model, opt, opt
        if key.startswith("dec_"):
            ddp = dk.DecentralizedDataParallel(
                model, optimizer_fn=lambda ps: dk.AccumAdamW(ps, lr=lr, accum_steps=4),
                topology=TOPOLOGY[key], bucket_mb=bucket_mb)
            return ddp, None, ddp
        raise ValueError(f"unknown variant {key!r}")

    # The first case of a launch runs twice and its first run is dropped. In a fresh process
    # some steps of the first case ran 3-6x slower, on every rank at once (backward 500-2500 ms
    # instead of 80-400), even after ~3 s of warm-up steps; later cases of the same launch,
    # no_comm included, were steady.
    results = []
    for pos, case in enumerate(cfg["cases"][:1] + cfg["cases"]):
        res = {"index": case["index"]}
        if pos == 1:
            results.clear()
        try:
            model, opt, holder = build(case)
        except (ValueError, TypeError, NotImplementedError) as e:
            # raised alike on every rank before any collective of the variant
            res["skip_reason"] = f"{type(e).__name__}: {e}"
            results.append(res)
            continue
        gen = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(case["batch"], width, generator=gen)
        y = torch.randn(case["batch"], width, generator=gen)
        jit = random.Random(7919 * rank + case["index"])
        reps, warmup = cfg["reps"], cfg["warmup"]
        times = []  # per rep: start, fwd, bwd, opt (s); the start becomes the cycle below
        wire0 = 0
        for i in range(warmup + reps):
            if i == warmup:
                dist.barrier()
                wire0 = tx_bytes() if local_rank == 0 else 0
            if i <= warmup:
                dist.barrier()  # warm-up steps and the first timed one start together
            t0 = time.perf_counter()
            if case["jitter_ms"] > 0:
                time.sleep(jit.uniform(0, case["jitter_ms"]) / 1e3)
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if opt is not None:
                opt.step()
            t3 = time.perf_counter()
            if i >= warmup:
                times.append([t0, t1 - t0, t2 - t1, t3 - t2])
        # The timed steps run back to back: a step's time is from its start to the next one's
        # (the last one's: to the end of the outstanding gossip and a barrier). Per-step
        # barriers would hide traffic that crosses the step boundary (decentralized gossip
        # drains on the link while a barrier waits behind it).
        if hasattr(holder, "synchronize"):
            holder.synchronize()  # decentralized: finish the outstanding gossip
        dist.barrier()
        t_end = time.perf_counter()
        starts = [t[0] for t in times] + [t_end]
        for k, t in enumerate(times):
            t[0] = starts[k + 1] - starts[k]
        wire = (tx_bytes() - wire0) if local_rank == 0 else 0
        # DDP variants step a local Lion on a one-rank group: its stats say 0 bytes, not DDP's
        stats = (None if case["variant"].startswith("ddp_") or case["variant"] == "hier_fp32"
                 else getattr(opt, "last_stats", None) or getattr(holder, "last_stats", None))
        everyone = torch.empty(n * (reps * 4 + 1), dtype=torch.float64)
        gather(everyone, torch.tensor(sum(times, []) + [float(wire)], dtype=torch.float64))
        per_rank = everyone.view(n, reps * 4 + 1)
        res["times"] = per_rank[:, :-1].reshape(n, reps, 4).tolist()
        res["wire_bytes_total"] = float(per_rank[:, -1].sum())
        if stats is not None:
            import dataclasses

            res["stats"] = (dataclasses.asdict(stats) if dataclasses.is_dataclass(stats)
                            else dict(vars(stats)))
        counted = engine_buckets(holder) if holder is not None else None
        if counted is None and isinstance(holder, DDP):
            try:
                counted = int(holder._get_ddp_logging_data().get("num_buckets_reduced") or 0) \
                    or None
            except Exception:  # noqa: BLE001 - private API; the estimate is used instead
                counted = None
        res["buckets_counted"] = counted
        res["params"] = sum(p.numel() for p in model.parameters())
        results.append(res)
        del model, opt, holder
        gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    worker(sys.argv[1])
