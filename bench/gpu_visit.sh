#!/usr/bin/env bash
# One command for a GPU visit (issue 12). On a machine with a CUDA device it
#   build    installs the package with the CUDA kernels compiled (pip -e, no build isolation)
#   tests    runs the test suite there, without the benchmarks' smoke runs (junit XML kept)
#   compile  compiles every Triton kernel ahead of time for that device, registers and spills
#   bench    runs the kernel benchmarks on the GPU (bench/bench_kernels.py --device cuda:
#            triton.testing.do_bench against a device copy and lion-pytorch's Triton Lion, the
#            flat tensors and the GPT-2 124M list)
#   nccl     DistributedLion over NCCL with one GPU (world_size=1, torchrun), bit-identical to
#            the reference backend (bench/gpu_nccl_check.py)
#   demo     the digits demo under torchrun --nproc-per-node 1 (NCCL)
# and writes everything to the results folder: info.txt (date, command, git commit, host,
# device name, driver, versions of Python, torch, CUDA, triton, nvcc, lion-pytorch), steps.tsv
# (step, status, exit code, seconds, log) and one log per step (plus the benchmark's files).
#
#   bash bench/gpu_visit.sh [--steps build,tests,compile,bench,nccl,demo] [--tar FILE]
#                           [--tests "PYTEST ARGS"] [--bench-args "ARGS"] [--step-seconds N]
#
# The results folder is $OUT when set, else bench/results/gpu-<UTC date>/. --tar FILE also packs
# it into one .tar.gz (the device tool brings back at most 8 files from its $OUT: run with
# OUT=/tmp/visit ... --tar "$OUT/gpu-visit.tar.gz"). --steps runs a subset (one device command
# may last 10 minutes: split a visit into calls, each with its own folder). --tests replaces the
# suite with the given pytest arguments (paths, -k ...), --bench-args adds arguments to
# bench_kernels.py (--sizes 16M,64M ...), and --step-seconds stops a step that runs longer (SIGINT,
# so pytest still writes its summary and XML; recorded with exit code 124 or 130).
#
# Without a visible CUDA device (or with GPU_VISIT_DRY=1) every GPU step is recorded as skipped
# with the reason and the script still exits 0; the build runs unless --steps leaves it out. The
# exit code is 1 when a step that ran failed. The device machines have no network: the build
# uses what is installed there (pip install --no-build-isolation --no-deps -e .).
set -uo pipefail
cd "$(dirname "$0")/.."

STEPS="build,tests,compile,bench,nccl,demo"
TAR=""
TESTS=""
BENCH_ARGS=""
STEP_SECONDS=""
COMMAND="$0 $*"
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS="$2"; shift 2 ;;
    --tar) TAR="$2"; shift 2 ;;
    --tests) TESTS="$2"; shift 2 ;;
    --bench-args) BENCH_ARGS="$2"; shift 2 ;;
    --step-seconds) STEP_SECONDS="$2"; shift 2 ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    *) echo "gpu_visit.sh: unknown argument $1 (--steps LIST, --tar FILE, --tests ARGS," \
         "--bench-args ARGS, --step-seconds N)" >&2; exit 2 ;;
  esac
done
for s in ${STEPS//,/ }; do
  case ",build,tests,compile,bench,nccl,demo," in
    *",$s,"*) ;;
    *) echo "gpu_visit.sh: unknown step '$s' (build,tests,compile,bench,nccl,demo)" >&2; exit 2 ;;
  esac
done

PY="${PYTHON:-python3}"
DATE="$(date -u +%Y%m%d-%H%M%S)"
RESULTS="${OUT:-bench/results/gpu-$DATE}"
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
export PYTHONUNBUFFERED=1

# ----------------------------------------------------------------------------- the device
GPU_PROBLEM="$("$PY" - <<'EOF' 2>&1
import os
try:
    import torch
except Exception as e:  # torch missing is a reason too
    print(f"torch cannot be imported ({type(e).__name__}: {e})")
else:
    if os.environ.get("GPU_VISIT_DRY") == "1":
        print("dry run (GPU_VISIT_DRY=1)")
    elif not torch.cuda.is_available():
        print("no CUDA device is visible to torch")
EOF
)"
GPU_PROBLEM="${GPU_PROBLEM//$'\n'/ }"

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "command: $COMMAND"
  echo "steps: $STEPS"
  echo "results: $RESULTS"
  echo "git commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "git status: $(git status --short 2>/dev/null | wc -l) changed paths"
  echo "host: $(uname -n) $(uname -srm)"
  echo "gpu: ${GPU_PROBLEM:-available}"
  "$PY" - <<'EOF' 2>&1
import platform
print(f"python: {platform.python_version()} ({platform.python_implementation()})")
try:
    import torch
    print(f"torch: {torch.__version__} (CUDA {torch.version.cuda})")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"device {i}: {p.name}, compute capability {p.major}.{p.minor}, "
                  f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
except Exception as e:
    print(f"torch: not importable ({e})")
for name in ("triton", "lion_pytorch", "numpy"):
    try:
        from importlib.metadata import version
        print(f"{name}: {version(name.replace('_', '-'))}")
    except Exception:
        print(f"{name}: not installed")
try:
    from dlion_kernels.kernels import native
    print(f"dlion_kernels native: {native.build_info()}")
except Exception as e:
    print(f"dlion_kernels native: not importable ({e})")
EOF
  if command -v nvcc >/dev/null; then echo "nvcc: $(nvcc --version | tail -n 2 | tr '\n' ' ')"
  else echo "nvcc: not found"; fi
  if command -v nvidia-smi >/dev/null; then
    echo "nvidia-smi:"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
      --format=csv 2>&1 | sed 's/^/  /'
  else
    echo "nvidia-smi: not found"
  fi
} > "$RESULTS/info.txt"

# ----------------------------------------------------------------------------- the steps
printf 'step\tstatus\texit_code\tseconds\tlog\n' > "$RESULTS/steps.tsv"
FAILED=0

# step NAME GPU(0|1) COMMAND...: runs COMMAND with its output in NAME.log, or records the skip.
step() {
  local name="$1" needs_gpu="$2"
  shift 2
  case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
  if [ "$needs_gpu" = 1 ] && [ -n "$GPU_PROBLEM" ]; then
    printf '%s\tskipped\t-\t-\t%s\n' "$name" "$GPU_PROBLEM" >> "$RESULTS/steps.tsv"
    echo "== $name: skipped ($GPU_PROBLEM)"
    return 0
  fi
  echo "== $name: $*"
  local start end rc
  start=$(date +%s)
  local limit=()
  if [ -n "$STEP_SECONDS" ]; then limit=(timeout -s INT -k 20 "$STEP_SECONDS"); fi
  { echo "\$ $*"; "${limit[@]}" "$@"; } > "$RESULTS/$name.log" 2>&1
  rc=$?
  end=$(date +%s)
  local status=ok
  if [ $rc -ne 0 ]; then status=failed; FAILED=1; fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((end - start))" "$name.log" \
    >> "$RESULTS/steps.tsv"
  echo "   $status (exit $rc), log: $RESULTS/$name.log"
  tail -n 5 "$RESULTS/$name.log" | sed 's/^/   | /'
}

BUILD_CUDA=0
if command -v nvcc >/dev/null || [ -n "${CUDACXX:-}" ]; then BUILD_CUDA=1; fi
step build 0 env DLION_BUILD_CUDA="$BUILD_CUDA" "$PY" -m pip install --no-build-isolation \
  --no-deps -e .
# the suite without the benchmark scripts' smoke runs (their own steps below time the GPU)
# shellcheck disable=SC2086  # --tests and --bench-args are word lists on purpose
step tests 1 "$PY" -m pytest -ra -q -m "not bench and not timing" --junitxml="$RESULTS/pytest.xml" \
  $TESTS
step compile 1 env -u TRITON_INTERPRET "$PY" python_tests/kernels/compile_triton.py \
  --arch "$("$PY" -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())' \
  2>/dev/null || echo 90)"
# shellcheck disable=SC2086
step bench 1 "$PY" bench/bench_kernels.py --device cuda --out "$RESULTS/bench_kernels" $BENCH_ARGS
step nccl 1 "$PY" -m torch.distributed.run --nproc-per-node 1 bench/gpu_nccl_check.py \
  --out "$RESULTS/nccl.jsonl"
step demo 1 "$PY" -m torch.distributed.run --nproc-per-node 1 -m dlion_kernels.demo --epochs 10

echo "results: $RESULTS"
column -t -s $'\t' "$RESULTS/steps.tsv" 2>/dev/null || cat "$RESULTS/steps.tsv"
if [ -n "$TAR" ]; then
  tar -czf "$TAR" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" && echo "packed: $TAR"
fi
exit $FAILED
