"""Compile every Triton kernel of dlion_kernels/kernels/triton.py and accum_triton.py ahead of time
with the real compiler (no GPU needed) and report registers and spills from ptxas.

Run in a process WITHOUT TRITON_INTERPRET (test_triton_compile.py does that). Prints one JSON line
per variant: kernel, arch, variant, regs, spill_stores, spill_loads, seconds.

    python python_tests/kernels/compile_triton.py [--arch 80,90] [--quick] [--match accum_lion]

The variants are those the launchers produce (triton.py): BLOCK 4096 and 8 warps for the local
step and apply, BW 512 and 4 warps for the tally; every dtype, vote kind and mode; the aligned
launch (16-byte base pointers, ALIGN hints) and the unaligned one (no hints). AccumAdamW and
AccumLion (accum_triton.py): BLOCK 1024 and 4 warps, every dtype, K = 1 and K > 1, flush or not,
with and without 16-byte base pointers (the launcher's alignment groups; --quick: with).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

assert os.environ.get("TRITON_INTERPRET") != "1", "compile with the real compiler: unset it"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from dlion_kernels.kernels import accum_triton as ak  # noqa: E402
from dlion_kernels.kernels import triton as tk  # noqa: E402

T = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _ptxas(arch: int) -> str:
    """The ptxas that triton bundles (and would use itself)."""
    from triton.backends.nvidia import compiler as nv

    return nv.get_ptxas(arch).path


def _div16(names, fn):
    """Attributes that tell the compiler these pointer arguments are 16-byte aligned, as the
    launcher's specialization does for 16-byte aligned tensors."""
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def variants(quick: bool):
    """(kernel fn, name, signature, constexprs, aligned pointer args, num_warps)."""
    out = []
    for g in ("fp32", "bf16", "fp16"):
        for ternary in (False, True):
            for aligned in (True, False):
                sig = {"meta_ptr": "*i64", "prog_ptr": "*i32", "g_base": f"*{T[g]}",
                       "m_base": "*fp32", "votes_ptr": "*i32", "b1": "fp32", "omb1": "fp32"}
                const = {"TERNARY": ternary, "G_ALIGN": 4 if aligned else 1,
                         "M_ALIGN": 4 if aligned else 1, "BLOCK": 4096, "SOFT_BF16": False}
                ptrs = ["meta_ptr", "prog_ptr", "votes_ptr"] + (["g_base", "m_base"] if aligned
                                                                 else [])
                out.append((tk._local_step_kernel, f"local_step g={g} ternary={ternary} "
                            f"aligned={aligned}", sig, const, ptrs, 8))
    pairs = [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"),
             ("fp16", "fp32")]
    kinds = [("vote", False, 1), ("vote", True, 2), ("average", False, 4), ("average", True, 5),
             ("average", False, 16)]  # n = 8 (4, 5 planes) and n = 32767 binary (16 planes)
    for x, g in pairs[:2] if quick else pairs:
        for mode, ternary, planes in kinds:
            for aligned in (True, False):
                sig = {"meta_ptr": "*i64", "prog_ptr": "*i32", "x_base": f"*{T[x]}",
                       "g_base": f"*{T[g]}", "m_base": "*fp32", "agg_ptr": "*i32",
                       "lut_ptr": "*fp32", "skip_ptr": "*i32", "lr": "fp32", "wd": "fp32",
                       "b2": "fp32", "omb2": "fp32", "n": "i32", "n_f": "fp32"}
                const = {"MODE_AVG": mode == "average", "TERNARY": ternary, "P": planes,
                         "X_ALIGN": 4 if aligned else 1, "G_ALIGN": 4 if aligned else 1,
                         "M_ALIGN": 4 if aligned else 1, "HAS_SKIP": True,
                         "LUT_PLANES": tk.LUT_PLANES, "BLOCK": 4096,
                         "SOFT_BF16_X": False, "SOFT_BF16_G": False}
                ptrs = ["meta_ptr", "prog_ptr", "agg_ptr", "lut_ptr", "skip_ptr"] + (
                    ["x_base", "g_base", "m_base"] if aligned else [])
                out.append((tk._apply_kernel, f"apply x={x} g={g} {mode} ternary={ternary} "
                            f"P={planes} aligned={aligned}", sig, const, ptrs, 8))
    for avg in (False, True):
        for ternary in (False, True):
            for np_ in (2, 5, 16) if not quick else (16,):
                sig = {"stacked_ptr": "*i32", "out_ptr": "*i32", "n": "i32", "row_stride": "i64",
                       "blocks": "i64", "h": "i32", "tie": "i32", "step_ptr": "*i64"}
                const = {"MODE_AVG": avg, "TERNARY": ternary, "STEP_ON_DEVICE": not avg,
                         "NP": np_,
                         "NPP": triton.next_power_of_2(np_), "BW": 512}
                out.append((tk._tally_kernel, f"tally avg={avg} ternary={ternary} NP={np_}", sig,
                            const, ["stacked_ptr", "out_ptr"], 4))
    for kernel, scalars, lists in (
        # y: where x is read from (x itself, or a gossip buffer when the mixing is fused)
        (ak._adamw_kernel, ak.ADAMW_SCALARS, ("x", "g", "a", "m", "v", "y")),
        (ak._lion_kernel, ak.LION_SCALARS, ("x", "g", "a", "m", "y")),
    ):
        kind = kernel.__name__.strip("_").replace("_kernel", "")
        for x in ("fp32", "bf16", "fp16") if not quick else ("fp32", "bf16"):
            for k1, flush in ((True, True), (False, False), (False, True)):
                for aligned in (True, False) if not quick else (True,):
                    sig = {"meta_ptr": "*i64", "prog_ptr": "*i32"}
                    for name in lists:
                        sig[f"{name}_base"] = f"*{T[x]}" if name in ("x", "g", "y") else "*fp32"
                    sig.update({name: "fp32" for name in scalars})
                    const = {"K1": k1, "FLUSH": flush, "ALIGN": 4 if aligned else 1,
                             "BLOCK": 1024, "SOFT_BF16": False}
                    ptrs = ["meta_ptr", "prog_ptr"] + (
                        [f"{name}_base" for name in lists] if aligned else [])
                    out.append((kernel, f"accum_{kind} x={x} K1={k1} flush={flush} "
                                f"aligned={aligned}", sig, const, ptrs, 4))
    return out


def ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spill bytes of the (single) kernel in ``ptx`` from ``ptxas -v``."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        flag = f"-arch=sm_{arch}a" if arch == 90 else f"-arch=sm_{arch}"
        proc = subprocess.run([_ptxas(arch), flag,
                               "-v", src, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed: {text[-2000:]}")
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"regs": int(regs.group(1)) if regs else None,
            "spill_stores": int(spills.group(1)) if spills else 0,
            "spill_loads": int(spills.group(2)) if spills else 0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="80,90")
    ap.add_argument("--quick", action="store_true", help="fewer dtype pairs and tally planes")
    ap.add_argument("--match", default="", help="only variants whose name contains this")
    args = ap.parse_args()
    for arch in (int(a) for a in args.arch.split(",")):
        target = GPUTarget("cuda", arch, 32)
        for fn, name, sig, const, ptrs, warps in variants(args.quick):
            if args.match not in name:
                continue
            t0 = time.perf_counter()
            for k in const:
                sig[k] = "constexpr"
            src = triton.compiler.ASTSource(fn, sig, const, _div16(ptrs, fn))
            kernel = triton.compile(src, target=target,
                                    options={"num_warps": warps, "enable_fp_fusion": False})
            usage = ptxas_usage(kernel.asm["ptx"], arch)
            print(json.dumps({"kernel": fn.__name__, "arch": arch, "variant": name, **usage,
                              "seconds": round(time.perf_counter() - t0, 2)}), flush=True)


if __name__ == "__main__":
    main()
