"""One rank of ``bench_training.py`` (the driver starts it inside its node's namespace):

    python bench/training_worker.py CFG.json

runs every case of the configuration file (a strategy slug as the variant, batch, bucket size)
on the same process, each built by ``dlion_kernels/recipes/``, and rank 0 writes the per-rank
timings, bytes and stats to the file the configuration names.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import random
import sys
import time


def engine_buckets(obj, depth=2):
    """Number of buckets of a bucket engine reachable from ``obj`` (lists of
    ``exchange/buckets.py``'s Bucket: index, params, offsets, blocks), or None."""
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


def reset_peak_rss() -> None:
    """Start this process's peak RSS (VmHWM) again from its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the peak is the process's since its start (read_peak_rss says which)


def read_peak_rss() -> float:
    """VmHWM of this process, bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    return float("nan")


def worker(cfg_path: str) -> None:
    """One rank, inside its node's namespace (RANK etc. from the environment)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dlion_kernels import strategies
    from dlion_kernels.recipes import Settings, build

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
    width, depth = cfg["width"], cfg["depth"]

    def tx_bytes() -> int:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())

    def make(case):
        """The case's strategy around a fresh model (the same initial parameters everywhere)."""
        torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        settings = Settings(lion_lr=1e-4, adamw_lr=1e-4, accum_steps=4,
                            bucket_mb=case["bucket_mb"], ranks_per_node=L)
        return build(case["variant"], torch.nn.Sequential(*layers), settings)

    # The first case of a launch runs twice and its first run is dropped. In a fresh process
    # some steps of the first case ran 3-6x slower, on every rank at once (backward 500-2500 ms
    # instead of 80-400), even after ~3 s of warm-up steps; later cases of the same launch,
    # the no-communication one included, were steady.
    results = []
    for pos, case in enumerate(cfg["cases"][:1] + cfg["cases"]):
        res = {"index": case["index"]}
        if pos == 1:
            results.clear()
        gc.collect()
        reset_peak_rss()
        try:
            built = make(case)
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
        wire0, sent = 0, 0
        for i in range(warmup + reps):
            if i == warmup:
                dist.barrier()
                wire0 = tx_bytes() if local_rank == 0 else 0
            if i <= warmup:
                dist.barrier()  # warm-up steps and the first timed one start together
            t0 = time.perf_counter()
            if case["jitter_ms"] > 0:
                time.sleep(jit.uniform(0, case["jitter_ms"]) / 1e3)
            built.zero_grad()
            loss = torch.nn.functional.mse_loss(built(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            step_bytes = built.step()
            t3 = time.perf_counter()
            if i >= warmup:
                times.append([t0, t1 - t0, t2 - t1, t3 - t2])
                sent += step_bytes
        # The timed steps run back to back: a step's time is from its start to the next one's
        # (the last one's: to the end of the outstanding gossip and a barrier). Per-step
        # barriers would hide traffic that crosses the step boundary (decentralized gossip
        # drains on the link while a barrier waits behind it).
        built.finish()
        dist.barrier()
        t_end = time.perf_counter()
        # counted from the tensors after the last step (its gradients still held), and the
        # process's peak RSS since this case started
        memory = built.memory()
        memory = [memory["params"], memory["grads"], memory["optimizer_state"],
                  read_peak_rss()]
        starts = [t[0] for t in times] + [t_end]
        for k, t in enumerate(times):
            t[0] = starts[k + 1] - starts[k]
        wire = (tx_bytes() - wire0) if local_rank == 0 else 0
        cols = reps * 4 + 1 + len(memory)
        everyone = torch.empty(n * cols, dtype=torch.float64)
        gather(everyone, torch.tensor(sum(times, []) + [float(wire)] + memory,
                                      dtype=torch.float64))
        per_rank = everyone.view(n, cols)
        res["times"] = per_rank[:, :reps * 4].reshape(n, reps, 4).tolist()
        res["wire_bytes_total"] = float(per_rank[:, reps * 4].sum())
        res["memory"] = per_rank[:, reps * 4 + 1:].tolist()  # [rank][params, grads, state, rss]
        res["bytes"], res["bytes_source"] = round(sent / reps), built.bytes_source
        res["inter_node_bytes"] = built.inter_node_bytes
        if built.stats is not None:
            res["stats"] = dataclasses.asdict(built.stats)
        counted = None
        if strategies.get(case["variant"]).bucketed:
            holder = built.module if built.module is not built.model else built.optimizer
            counted = engine_buckets(holder)
            if counted is None and isinstance(holder, DDP):
                try:
                    counted = int(holder._get_ddp_logging_data().get("num_buckets_reduced")
                                  or 0) or None
                except Exception:  # noqa: BLE001 - private API; the estimate is used instead
                    counted = None
        res["buckets_counted"] = counted
        res["params"] = sum(p.numel() for p in built.model.parameters())
        results.append(res)
        del built
        gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    worker(sys.argv[1])
