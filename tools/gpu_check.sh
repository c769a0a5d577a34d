#!/usr/bin/env bash
# The prepared GPU check (docs/benchmarks.md, "The GPU check"): on one CUDA GPU, in under 8
# minutes, every step under its own `timeout`, every log in OUT_DIR:
#   1. the GPU tests (tests/test_gpu: FlexAttention against the dense reference in bf16, the
#      compiled model against eager, no host sync in a compiled step);
#   2. the throughput table: tools/bench/bench_gpu.py, 125m and 1b, compile off and on;
#   3. the real trainer (earlyfuse-train experiment=gpu_125m, compiled) for 10 steps, when the
#      demo's token shards are in runs/demo (tokens/ and tok/, from `make demo`; ~40 MiB);
#   4. OUT_DIR/table.md: the table of 2 and 3.
#     tools/gpu_check.sh OUT_DIR          # or: make gpu-check OUT=OUT_DIR
# A machine without the index: install the wheels of tools/gpu_wheels.sh first (its last line).
# Exit status 0 when every step passed; summary.txt lists each step's status and seconds.
set -u
out=${1:?usage: tools/gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
data=runs/demo  # configs/data/demo.yaml reads its token shards here
status=0
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: COMMAND under its own timeout, output in OUT/NAME.log
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "$name: rc $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$out/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}

: >"$out/summary.txt"
step env 20 bash -c "nvidia-smi; $py -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; echo commit \${COMMIT:-\$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
step gpu-tests 120 "$py" -m pytest tests/test_gpu -m gpu -q -rA -p no:cacheprovider \
  --confcutdir=tests/test_gpu
bench() {  # bench NAME SECONDS ARGS...
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" "$py" tools/bench/bench_gpu.py --seq-len 2048 --json "$out/$name.json" "$@"
}
bench bench-125m-eager 40 --preset 125m --micro-batch 16 --steps 30 --warmup 5
bench bench-125m-compiled 75 --preset 125m --micro-batch 16 --steps 30 --warmup 5 --compile
if grep -q "illegal memory access" "$out/bench-125m-compiled.log"; then  # name the kernel
  step bench-125m-compiled-blocking 45 env CUDA_LAUNCH_BLOCKING=1 "$py" tools/bench/bench_gpu.py \
    --preset 125m --micro-batch 16 --seq-len 2048 --steps 2 --warmup 1 --compile
fi
bench bench-1b-eager 45 --preset 1b --micro-batch 8 --steps 20 --warmup 3
bench bench-1b-compiled 75 --preset 1b --micro-batch 8 --steps 20 --warmup 3 --compile
if [ -d "$data/tokens" ]; then
  run=$(mktemp -d)/run  # its checkpoint (GBs) stays on the machine; its logs come to OUT
  # no validation: an evaluation would compile the blocks a second time (no_grad, eval mode)
  step trainer-125m 90 "$py" -m train.app experiment=gpu_125m run_dir="$run" \
    data.validation=[] data.num_workers=2 \
    train.steps=10 train.grad_accum=1 train.log_every=2 train.progress=false
  cp "$run/metrics.jsonl" "$run/final.json" "$out/" 2>/dev/null
else
  echo "trainer-125m: skipped, no token shards in $data/tokens (make demo)" | tee -a "$out/summary.txt"
fi
step table 10 "$py" tools/bench/gpu_table.py "$out"
cat "$out/table.md" 2>/dev/null
echo "gpu check: $( [ "$status" -eq 0 ] && echo passed || echo FAILED ) in $SECONDS s; logs in $out"
exit "$status"
