"""Every Triton kernel compiles with the real compiler for sm_80 and sm_90, no GPU
needed, and the hot kernels do not spill. Registers and spills are printed (pytest -s shows them).

conftest.py sets TRITON_INTERPRET=1, under which triton.compile is not the real compiler, so the
compilation runs in a subprocess without it (compile_triton.py). The default run compiles the
``--quick`` set (every local-step variant, apply for fp32 and bf16 in every mode, aligned and
unaligned, the 16-plane tallies, AccumAdamW and AccumLion for fp32 and bf16 in every K / flush
variant, aligned); ``python python_tests/kernels/compile_triton.py`` compiles all.
"""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
HERE = os.path.dirname(os.path.abspath(__file__))


def test_triton_kernels_compile_for_sm80_and_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "compile_triton.py"), "--quick",
                           "--arch", "90,80"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {r["arch"] for r in rows} == {80, 90}
    assert {r["kernel"] for r in rows} == {"_local_step_kernel", "_apply_kernel", "_tally_kernel",
                                           "_adamw_kernel", "_lion_kernel"}
    for r in rows:
        print(f"sm_{r['arch']} {r['variant']}: {r['regs']} registers, "
              f"{r['spill_stores']}/{r['spill_loads']} bytes spilled (stores/loads)")
        assert r["regs"] is not None and 0 < r["regs"] <= 255
    # The hot paths: aligned local step, apply and accum steps, and every tally, must not spill.
    hot = [r for r in rows if "aligned=False" not in r["variant"]]
    spilled = [r for r in hot if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, spilled
