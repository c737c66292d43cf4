#!/usr/bin/env bash
# One command for a run on a GPU machine. On a machine with a CUDA device it
#   build    installs the package with the CUDA kernels compiled (pip -e, no build isolation)
#   tests    runs the test suite there, without the benchmarks' smoke runs (junit XML kept)
#   compile  compiles every Triton kernel ahead of time for that device, registers and spills
#   bench    runs the kernel benchmarks on the GPU (bench/bench_kernels.py --device cuda:
#            triton.testing.do_bench against a device copy and lion-pytorch's Triton Lion, the
#            flat tensors and the GPT-2 124M list, the step replayed from a CUDA graph)
#   accum    AccumAdamW / AccumLion on the GPU against a device copy and torch's fused AdamW
#            (bench/bench_accum.py --device cuda)
#   nccl     DistributedLion over NCCL with one GPU (world_size=1, torchrun), bit-identical to
#            the reference backend (bench/gpu_nccl_check.py)
#   demo     the digits demo under torchrun --nproc-per-node 1 (NCCL)
#   sim      the per-step study on 16 simulated workers with the 31.8M-parameter byte GPT
#            (bench/bench_sim_study.py per-step --tasks stdlib-30m --device cuda): the vote and
#            average against Lion and AdamW on the all-reduced gradient, lrs tuned, 3 seeds
# and writes everything to the results folder: info.txt (date, command, git commit, host,
# device name, driver, versions of Python, torch, CUDA, triton, nvcc, lion-pytorch), steps.tsv
# (step, status, exit code, seconds, log) and one log per step (plus the benchmarks' files).
#
#   bash bench/gpu_run.sh [--steps build,bench,accum,tests,compile,nccl,demo,sim] [--tar FILE]
#                         [--tests "PYTEST ARGS"] [--bench-args "ARGS"] [--accum-args "ARGS"]
#                         [--step-seconds N] [--budget-seconds N]
#   bash bench/gpu_run.sh --short
#
# --short is the plan for 15 minutes of device time, a machine start of a few minutes included:
# one command of at most 9 minutes (--budget-seconds 500 for its steps) that runs build, bench
# (1M, 64M, 256M flat, fp32 and bf16, cuda and triton, the 1M step replayed from a CUDA graph
# against the same step launched from Python), accum (256M elements, fp32 and bf16, cuda and
# triton, against torch's fused AdamW) and then the GPU tests (the kernels of both backends, the
# Accum kernels, the captured step, the host-sync check) in the time left. Its results folder is
# a temporary one; what comes back from the device machine ($OUT, at most 8 files) is
# gpu-run.tar.gz (everything), steps.tsv, info.txt, bench_kernels.md, bench_accum.md and
# tests.log.
#
# The results folder is $OUT when set, else bench/results/gpu-<UTC date>/. --tar FILE also packs
# it into one .tar.gz. --steps runs a subset (one device command may last 10 minutes: split a
# run into calls, each with its own folder). --tests replaces the suite with the given pytest
# arguments (paths, -k ...), --bench-args and --accum-args add arguments to bench_kernels.py and
# bench_accum.py (--sizes 16M,64M ...), --step-seconds stops a step that runs longer (SIGINT, so
# pytest still writes its summary and XML; recorded with exit code 124 or 130), and
# --budget-seconds bounds all steps together (each gets at most what is left).
#
# Without a visible CUDA device (or with GPU_RUN_DRY=1) every GPU step is recorded as skipped
# with the reason and the script still exits 0; the build runs unless --steps leaves it out. The
# exit code is 1 when a step that ran failed. The device machines have no network: the build
# uses what is installed there (pip install --no-build-isolation --no-deps -e .).
set -uo pipefail
cd "$(dirname "$0")/.."

ALL_STEPS="build,bench,accum,tests,compile,nccl,demo,sim"  # in the order they run
STEPS="$ALL_STEPS"
TAR=""
TESTS=""
BENCH_ARGS=""
ACCUM_ARGS=""
STEP_SECONDS=""
BUDGET_SECONDS=""
SHORT=0
COMMAND="$0 $*"
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS="$2"; shift 2 ;;
    --tar) TAR="$2"; shift 2 ;;
    --tests) TESTS="$2"; shift 2 ;;
    --bench-args) BENCH_ARGS="$2"; shift 2 ;;
    --accum-args) ACCUM_ARGS="$2"; shift 2 ;;
    --step-seconds) STEP_SECONDS="$2"; shift 2 ;;
    --budget-seconds) BUDGET_SECONDS="$2"; shift 2 ;;
    --short) SHORT=1; shift ;;
    -h|--help) sed -n '2,46p' "$0"; exit 0 ;;
    *) echo "gpu_run.sh: unknown argument $1 (--steps LIST, --tar FILE, --tests ARGS," \
         "--bench-args ARGS, --accum-args ARGS, --step-seconds N, --budget-seconds N," \
         "--short)" >&2; exit 2 ;;
  esac
done

# The pytest arguments, one word each (--tests is split at spaces; --short passes a -k
# expression, which holds spaces, as one word).
read -r -a TEST_ARGS <<< "$TESTS"
# Seconds each step of --short may take at most (the tests take what is left of the budget).
declare -A CAP=()
if [ "$SHORT" = 1 ]; then
  STEPS="build,bench,accum,tests"
  BUDGET_SECONDS="${BUDGET_SECONDS:-500}"
  CAP=([build]=150 [bench]=170 [accum]=90)
  BENCH_ARGS="--sizes 1M,64M,256M --dtypes fp32,bf16 --backends cuda,triton --shapes flat \
--peers none --graph-sizes 1M --rep-seconds 0.2 --no-plot $BENCH_ARGS"
  ACCUM_ARGS="--numel 256M $ACCUM_ARGS"
  if [ -z "$TESTS" ]; then
    TEST_ARGS=(python_tests/kernels/test_backends.py python_tests/kernels/test_accum_kernels.py
               python_tests/kernels/test_native.py python_tests/exchange/test_capture.py
               python_tests/optim/test_dlion_deferred_verdict.py
               -k "cuda or triton" -n 8 --dist load)
  fi
fi
for s in ${STEPS//,/ }; do
  case ",$ALL_STEPS," in
    *",$s,"*) ;;
    *) echo "gpu_run.sh: unknown step '$s' ($ALL_STEPS)" >&2; exit 2 ;;
  esac
done

PY="${PYTHON:-python3}"
DATE="$(date -u +%Y%m%d-%H%M%S)"
BACK=""  # --short: the folder that comes back from the device machine ($OUT)
if [ "$SHORT" = 1 ] && [ -n "${OUT:-}" ]; then
  BACK="$OUT"
  RESULTS="${TMPDIR:-/tmp}/gpu-run-$DATE"
else
  RESULTS="${OUT:-bench/results/gpu-$DATE}"
fi
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
export PYTHONUNBUFFERED=1
START_TIME=$(date +%s)

# ----------------------------------------------------------------------------- the device
# Why the GPU steps cannot run ("" if they can) and the device's architecture (90 without a
# device), from one start of Python.
DEVICE="$("$PY" - <<'EOF' 2>&1
import os
problem, arch = "", "90"
try:
    import torch
except Exception as e:  # torch missing is a reason too
    problem = f"torch cannot be imported ({type(e).__name__}: {e})"
else:
    if torch.cuda.is_available():
        arch = "%d%d" % torch.cuda.get_device_capability()
    if os.environ.get("GPU_RUN_DRY") == "1":
        problem = "dry run (GPU_RUN_DRY=1)"
    elif not torch.cuda.is_available():
        problem = "no CUDA device is visible to torch"
print("gpu-problem:" + problem.replace("\n", " "))
print("gpu-arch:" + arch)
EOF
)"
if grep -q '^gpu-problem:' <<< "$DEVICE"; then
  GPU_PROBLEM="$(sed -n 's/^gpu-problem://p' <<< "$DEVICE")"
  ARCH="$(sed -n 's/^gpu-arch://p' <<< "$DEVICE")"
else
  GPU_PROBLEM="Python could not tell about the device: ${DEVICE//$'\n'/ }"
  ARCH=90
fi

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
# Its time limit: --step-seconds, the step's cap (--short) and what is left of --budget-seconds,
# whichever is smallest.
step() {
  local name="$1" needs_gpu="$2"
  shift 2
  case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
  if [ "$needs_gpu" = 1 ] && [ -n "$GPU_PROBLEM" ]; then
    printf '%s\tskipped\t-\t-\t%s\n' "$name" "$GPU_PROBLEM" >> "$RESULTS/steps.tsv"
    echo "== $name: skipped ($GPU_PROBLEM)"
    return 0
  fi
  local seconds="$STEP_SECONDS"
  if [ -n "${CAP[$name]:-}" ] && { [ -z "$seconds" ] || [ "${CAP[$name]}" -lt "$seconds" ]; }
  then seconds="${CAP[$name]}"; fi
  if [ -n "$BUDGET_SECONDS" ]; then
    local left=$((BUDGET_SECONDS - ($(date +%s) - START_TIME)))
    if [ "$left" -lt 10 ]; then
      printf '%s\tskipped\t-\t-\t%s\n' "$name" "no time left of --budget-seconds" \
        >> "$RESULTS/steps.tsv"
      echo "== $name: skipped (no time left of --budget-seconds $BUDGET_SECONDS)"
      return 0
    fi
    if [ -z "$seconds" ] || [ "$left" -lt "$seconds" ]; then seconds="$left"; fi
  fi
  echo "== $name: $*${seconds:+ (at most $seconds s)}"
  local start end rc
  start=$(date +%s)
  local limit=()
  if [ -n "$seconds" ]; then limit=(timeout -s INT -k 20 "$seconds"); fi
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
BUILD_ENV=(DLION_BUILD_CUDA="$BUILD_CUDA")
# --short builds for this device's architecture only (CI compiles sm_80 and sm_90 every time)
if [ "$SHORT" = 1 ] && [ -z "$GPU_PROBLEM" ]; then BUILD_ENV+=(DLION_CUDA_ARCHS="$ARCH"); fi
step build 0 env "${BUILD_ENV[@]}" "$PY" -m pip install --no-build-isolation --no-deps -e .
# shellcheck disable=SC2086  # --bench-args and --accum-args are word lists on purpose
step bench 1 "$PY" bench/bench_kernels.py --device cuda --out "$RESULTS/bench_kernels" $BENCH_ARGS
# shellcheck disable=SC2086
step accum 1 "$PY" bench/bench_accum.py --device cuda --out "$RESULTS/bench_accum" $ACCUM_ARGS
# the suite without the benchmark scripts' smoke runs (their own steps time the GPU)
step tests 1 "$PY" -m pytest -ra -q -m "not bench and not timing" \
  --junitxml="$RESULTS/pytest.xml" "${TEST_ARGS[@]}"
step compile 1 env -u TRITON_INTERPRET "$PY" python_tests/kernels/compile_triton.py \
  --arch "$ARCH"
step nccl 1 "$PY" -m torch.distributed.run --nproc-per-node 1 bench/gpu_nccl_check.py \
  --out "$RESULTS/nccl.jsonl"
step demo 1 "$PY" -m torch.distributed.run --nproc-per-node 1 -m dlion_kernels.demo --epochs 10
step sim 1 "$PY" bench/bench_sim_study.py per-step --tasks stdlib-30m --workers 16 \
  --methods dlion-vote-binary dlion-average-binary --device cuda --out "$RESULTS/sim_study"

echo "results: $RESULTS"
column -t -s $'\t' "$RESULTS/steps.tsv" 2>/dev/null || cat "$RESULTS/steps.tsv"
if [ -n "$BACK" ]; then
  mkdir -p "$BACK"
  tar -czf "$BACK/gpu-run.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
  for f in steps.tsv info.txt bench_kernels/bench_kernels.md bench_accum/bench_accum.md \
           tests.log; do
    if [ -f "$RESULTS/$f" ]; then cp "$RESULTS/$f" "$BACK/"; fi
  done
  echo "back from the device machine: $BACK ($(ls "$BACK" | tr '\n' ' '))"
fi
if [ -n "$TAR" ]; then
  tar -czf "$TAR" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" && echo "packed: $TAR"
fi
exit $FAILED
