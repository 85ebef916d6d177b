#!/usr/bin/env bash
# The GPU check, in one run on a machine with one CUDA GPU, in under 8 minutes: install tensorplay
# from this checkout, record the machine, run the CUDA tests, benchmark the hooks on CUDA.
#
#   OUT=/folder/for/results bash bench/gpu_check.sh
#
# Written under $OUT:
#   environment.json  GPU, driver, torch, CUDA, NCCL, gloo (bench/gpu_environment.py)
#   junit_cuda.xml    tests/test_cuda_path.py, one testcase per test
#   bench_cuda.json   bench/hooks_vs_torch.py, one entry per configuration below
#   gpu_check.log     everything printed, each step with its exit status and duration
#
# Configurations on one GPU, for the tests and the benchmark alike:
# * NCCL at world size 1. NCCL refuses two ranks on one device, and with one rank it reduces
#   nothing: this covers the hooks' arithmetic on CUDA and the telemetry's CUDA path (events,
#   figures on the device, synchronization, memory), not communication.
# * gloo at world size 2, both ranks on cuda:0. torch's gloo backend reduces CUDA tensors: it has
#   CUDA work for all_reduce, broadcast and all_gather, all that DDP needs (torch.distributed's
#   backend table; ProcessGroupGloo's CUDA work classes), staging them through pinned host memory.
#   Communication is then real (loopback TCP) and can overlap the backward compute; the two ranks
#   share the GPU's compute.
# Benchmark models: NCCL, 8 x Linear(4096, 4096), batch 512 (512 MB of gradients in 25 MB buckets):
# a step long enough (milliseconds of compute) that the hooks' and telemetry's host work can hide
# behind the device. gloo, 4 x Linear(2048, 2048), batch 16384 (64 MB of gradients): sized so that
# the two ranks' backward compute and their communication should take comparable time (an estimate
# made without a GPU; the benchmark's overlap table says how it came out).
#
# torch is used as installed (a GPU machine brings its CUDA build); only where it is missing is it
# installed, as the package index's default build, never the CPU build CI pins. tensorplay and its
# test extra are installed with pip from this checkout; a machine without network installs them
# from the wheels in $WHEELS (default .whl: make them with bench/gpu_wheels.sh where PyPI is
# reachable, and bring them along).
#
# Every step has its own time limit (they add up to 8 minutes); a step that fails or runs out is
# reported and the next one runs. The exit status is that of the first step that failed (the tests
# failing: 1; no GPU seen: 3), 0 when all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder that receives the results}
mkdir -p "$OUT"
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# cuBLAS picks the same algorithms on every stream (hook callbacks run on pool streams): bit-for-bit parity.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}

status=0
failed=()

run_step() {  # run_step NAME SECONDS COMMAND...: run it within SECONDS, say how it ended, note a failure
    local name=$1 limit=$2 started=$SECONDS rc=0
    shift 2
    echo "=== $name (at most ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" || rc=$?  # on time out, the whole process group: ranks too
    echo "=== $name: exit status $rc after $((SECONDS - started))s"
    if [ "$rc" -ne 0 ]; then
        failed+=("$name")
        [ "$status" -ne 0 ] || status=$rc
    fi
    return "$rc"
}

bench() {  # bench LIMIT ARGUMENTS...: one configuration of the hooks benchmark, into bench_cuda.json
    local limit=$1
    shift
    run_step "bench $*" "$limit" "$PYTHON" bench/hooks_vs_torch.py --device cuda "$@" --json "$OUT/bench_cuda.json"
}

main() {
    echo "gpu_check in $PWD with $PYTHON, results in $OUT"
    if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
        run_step "install torch (none was installed)" 240 "$PYTHON" -m pip install -q torch
    fi
    local cuda
    cuda=$("$PYTHON" -c 'import torch; print(torch.cuda.is_available())' 2>/dev/null || echo False)
    echo "torch sees a CUDA GPU: $cuda"

    local offline=()
    if [ -d "$WHEELS" ]; then
        offline=(--no-index --find-links "$WHEELS")
        echo "installing from the wheels in $WHEELS, without an index"
    fi
    if ! run_step "install tensorplay" 90 "$PYTHON" -m pip install -q ${offline[@]+"${offline[@]}"} -e '.[test]' &&
        [ ${#offline[@]} -eq 0 ]; then
        echo "no network here? fetch the wheels with bench/gpu_wheels.sh where PyPI is reachable, bring $WHEELS along"
    fi
    run_step "environment" 45 "$PYTHON" bench/gpu_environment.py "$OUT/environment.json"
    if [ "$cuda" = True ]; then
        run_step "CUDA tests" 180 "$PYTHON" -m pytest tests/test_cuda_path.py -v -rs -p no:cacheprovider \
            --timeout 150 --junitxml="$OUT/junit_cuda.xml"
        bench 75 --backend nccl --world-size 1 --width 4096 --layers 8 --batch 512 --rounds 15 --steps 4 --budget-s 30
        bench 90 --backend gloo --world-size 2 --width 2048 --layers 4 --batch 16384 --rounds 9 --steps 2 --budget-s 40
    else
        echo "no CUDA GPU visible to torch: the CUDA tests would only be skipped, nothing is checked"
        failed+=("no GPU")
        [ "$status" -ne 0 ] || status=3
    fi
    echo "results in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
    if [ ${#failed[@]} -eq 0 ]; then
        echo "gpu_check: every step passed"
    else
        printf 'gpu_check: failed: %s\n' "${failed[@]}"
    fi
    return "$status"
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
