#!/usr/bin/env bash
# The checks cpref runs when a CUDA GPU is at hand (none needs one; CI never has one):
#   1. `make demo` with part 2 on the GPU: every mode and layout, FP64 on the simulated cluster,
#      against the oracle (parts 1 and 3 as on any machine);
#   2. `python -m sim verify` over NCCL on one GPU: every mode, layout and dtype at CP = 1, the
#      default CUDA kernel (CudaKernel: flash in bf16/fp16, the explicit path in fp32) checked
#      against the simulated cluster's FP64 ground truth;
#   3. `bench.kernel` on the GPU in float32, bfloat16 and float16: the default kernel (CudaKernel)
#      and TorchKernel's explicit path against SDPA per document, with the fraction of the
#      device's matmul peak;
#   4. `bench.determinism` on the GPU in bf16 and fp16: every mode and layout on the simulated
#      cluster at CP = 2 and 4 (the ranks share the GPU, flash per rank) against the FP64 oracle,
#      two steps with deterministic=True bitwise equal, and what the flag costs;
#   5. the planner's H100 profile against this GPU: `python -m sim plan --check-kernel h100-sxm` times CudaKernel
#      in bf16 on single causal documents (32 heads of 128, 1k to 16k tokens), each call beside the profile's
#      prediction, and the fitted curve beside the profile's (sim.plan.calibrate);
#   6. last, on the machine's CPU cores (not the GPU): `bench.scaling` at CP = 4 over gloo, four
#      processes of one thread, one 8k document and a packed mix, full causal: the performance
#      goals that two cores cannot judge (efficiency against the machine, comm wait, each ring
#      shift with a call to hide behind, the hierarchy in head groups). Skipped below 8 cores.
# Usage: PY=python3 bench/gpu_check.sh [LOGDIR]   (each step's output also goes to LOGDIR/<step>.log)
set -u
PY=${PY:-python3}
LOG=${1:-.}
mkdir -p "$LOG"
status=0
step() {
  local name=$1; shift
  echo "== $name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee "$LOG/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc in $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || status=1
}
step demo "$PY" -m sim.tools.demo --device cuda
step verify "$PY" -m sim verify --backend nccl --nproc 1 --mode all --layout all --dtype all --no-progress
step kernel-fp32 "$PY" -m bench.kernel --device cuda --dtype fp32
step kernel-bf16 "$PY" -m bench.kernel --device cuda --dtype bf16
step kernel-fp16 "$PY" -m bench.kernel --device cuda --dtype fp16
step determinism-bf16 "$PY" -m bench.determinism --device cuda --dtype bf16
step determinism-fp16 "$PY" -m bench.determinism --device cuda --dtype fp16
step plan-kernel "$PY" -m sim plan --check-kernel h100-sxm --device cuda --dtype bf16
if [ "$(nproc)" -ge 8 ]; then
  step scaling-cp4 "$PY" -m bench.scaling --cp 4 --heads 8 --tokens 8192 --window none
else
  echo "== scaling-cp4: skipped, $(nproc) cores (four processes need four free cores, eight to spare the host)"
fi
exit $status
