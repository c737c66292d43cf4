"""NCCL with one GPU (world_size = 1): DistributedLion on the GPU backends against the reference.

Under ``torchrun --nproc-per-node 1`` (or alone: it then forms a one-rank group itself), an NCCL
process group runs five DistributedLion steps on a small MLP for every GPU backend (cuda, triton),
with and without overlap, fp32 and bf16 parameters, and the same steps on the ``torch`` reference
backend: parameters and momenta must be bit-identical (every backend does the same fp32
operations). Writes one JSON line per case to ``--out`` (if given) and exits 1 on a mismatch.
Without a CUDA device it prints why and exits 0 (bench/gpu_run.sh records that as skipped).

    torchrun --nproc-per-node 1 bench/gpu_nccl_check.py --out nccl.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dlion_kernels as dk  # noqa: E402


def run(backend: str, overlap: bool, dtype: torch.dtype, device, steps: int = 5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 129), torch.nn.GELU(),
                                torch.nn.Linear(129, 10)).to(device=device, dtype=dtype)
    opt = dk.DistributedLion(model.parameters(), lr=1e-3, weight_decay=0.1, backend=backend,
                             overlap=overlap)
    gen = torch.Generator(device="cpu").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 37, generator=gen).to(device=device, dtype=dtype)
        y = torch.randint(0, 10, (64,), generator=gen).to(device)
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize(device)
    params = [p.detach().cpu() for p in model.parameters()]
    moms = [opt.state[p]["exp_avg"].detach().cpu() for p in model.parameters()]
    return params + moms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON lines file for the results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("skipped: no CUDA device is visible to torch")
        return 0
    if "RANK" not in os.environ:  # alone: a one-rank group on this machine
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rows, failed = [], False
    try:
        for dtype in (torch.float32, torch.bfloat16):
            expected = run("torch", False, dtype, device)
            for backend in dk.available_backends("cuda"):
                if backend == "torch":
                    continue
                for overlap in (False, True):
                    row = {"world_size": dist.get_world_size(), "backend": backend,
                           "overlap": overlap, "dtype": str(dtype).split(".")[-1]}
                    try:
                        got = run(backend, overlap, dtype, device)
                        row["identical"] = all(torch.equal(a, b) for a, b in zip(got, expected))
                    except Exception as e:  # noqa: BLE001  (reported, then the exit code says it)
                        row["identical"] = False
                        row["error"] = f"{type(e).__name__}: {e}"
                    failed |= not row["identical"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print("NCCL world_size=1:", "FAIL" if failed else "PASS", f"({len(rows)} cases)")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
