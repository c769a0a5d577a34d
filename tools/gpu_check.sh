#!/usr/bin/env bash
# The prepared GPU check (docs/benchmarks.md, "The GPU check"), in two parts, each one run of
# under 8 minutes on one CUDA GPU, every step under its own `timeout`, every log in OUT_DIR.
# Part `throughput` (the default):
#   1. the GPU tests (tests/test_gpu: FlexAttention against the dense reference in bf16, the
#      compiled model against eager, no host sync in a compiled step);
#   2. the throughput table: tools/bench/bench_gpu.py, 125m and 1b, compile off and on;
#   3. the real trainer (earlyfuse-train experiment=gpu_125m, compiled) for 10 steps, when the
#      demo's token shards are in runs/demo (tokens/ and tok/, from `make demo`; ~40 MiB);
#   4. OUT_DIR/table.md: the table of 2 and 3.
# Part `long` (long context, docs/long_context.md):
#   1. BlockMask build time and memory at 128k and 1M tokens (tools/bench/bench_block_mask.py);
#   2. tokens/s and peak memory at 8k, 32k and 128k tokens per row, 125m and 1b, activation
#      checkpointing on, compiled, document attention against local/global (bench_gpu.py);
#   3. OUT_DIR/long_table.md: the tables of 1 and 2, the peaks beside train.memory's estimates.
# Each part fits one run; with one session's device time, run `long` first, then `throughput`,
# each into its own OUT_DIR (docs/benchmarks.md says why).
#     tools/gpu_check.sh OUT_DIR [throughput|long]   # or: make gpu-check OUT=OUT_DIR PART=long
#     tools/gpu_check.sh --list [throughput|long]    # the steps and their limits; runs nothing
# A machine without the index: install the wheels of tools/gpu_wheels.sh first (its last line).
# Exit status 0 when every step passed; summary.txt lists each step's status and seconds.
set -u
list=
if [ "${1:-}" = "--list" ]; then
  list=1
  out=OUT_DIR
else
  out=${1:?usage: tools/gpu_check.sh OUT_DIR [throughput|long] (or --list [PART])}
fi
part=${2:-throughput}
case "$part" in
  throughput | long) ;;
  *) echo "tools/gpu_check.sh: unknown part '$part' (throughput or long)" >&2; exit 2 ;;
esac
if [ -z "$list" ]; then
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
fi
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
data=runs/demo  # configs/data/demo.yaml reads its token shards here
status=0
total=0
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: COMMAND under its own timeout, output in OUT/NAME.log
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  total=$((total + limit))
  if [ -n "$list" ]; then
    echo "$name $limit $*"
    return
  fi
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "$name: rc $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$out/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}

[ -n "$list" ] || : >"$out/summary.txt"

env_step() {  # env SECONDS
  step env "$1" bash -c "nvidia-smi; $py -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; echo commit \${COMMIT:-\$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
}

throughput() {
  env_step 20
  step gpu-tests 100 "$py" -m pytest tests/test_gpu -m gpu -q -rA -p no:cacheprovider \
    --confcutdir=tests/test_gpu
  bench() {  # bench NAME SECONDS ARGS...
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" "$py" tools/bench/bench_gpu.py --seq-len 2048 --json "$out/$name.json" "$@"
  }
  bench bench-125m-eager 40 --preset 125m --micro-batch 16 --steps 30 --warmup 5
  bench bench-125m-compiled 70 --preset 125m --micro-batch 16 --steps 30 --warmup 5 --compile
  # only after the crash it names the kernel of (listed, but not counted in the total)
  if [ -n "$list" ]; then
    echo "(only after an illegal memory access) bench-125m-compiled-blocking 45"
  elif grep -q "illegal memory access" "$out/bench-125m-compiled.log"; then
    step bench-125m-compiled-blocking 35 env CUDA_LAUNCH_BLOCKING=1 "$py" tools/bench/bench_gpu.py \
      --preset 125m --micro-batch 16 --seq-len 2048 --steps 2 --warmup 1 --compile
  fi
  bench bench-1b-eager 45 --preset 1b --micro-batch 8 --steps 20 --warmup 3
  bench bench-1b-compiled 70 --preset 1b --micro-batch 8 --steps 20 --warmup 3 --compile
  if [ -n "$list" ] || [ -d "$data/tokens" ]; then
    # its checkpoint (GBs) stays on the machine; its logs come to OUT
    if [ -n "$list" ]; then run=TMP/run; else run=$(mktemp -d)/run; fi
    # no validation: an evaluation would compile the blocks a second time (no_grad, eval mode)
    step trainer-125m 80 "$py" -m train.app experiment=gpu_125m run_dir="$run" \
      data.validation=[] data.num_workers=2 \
      train.steps=10 train.grad_accum=1 train.log_every=2 train.progress=false
    [ -n "$list" ] || cp "$run/metrics.jsonl" "$run/final.json" "$out/" 2>/dev/null
  else
    echo "trainer-125m: skipped, no token shards in $data/tokens (make demo)" | tee -a "$out/summary.txt"
  fi
}

long() {
  env_step 15
  # compiled builder, one warm-up build (the compile) and 3 timed builds per mask and length
  step block-mask 75 "$py" tools/bench/bench_block_mask.py --lengths 131072,1048576 \
    --window 1024 --json "$out/blockmask.json"
  rows() {  # rows NAME SECONDS PRESET ATTENTION WARMUP STEPS: 8k, 32k, 128k in one process
    local name=$1 limit=$2 preset=$3 attention=$4 warmup=$5 steps=$6
    step "$name" "$limit" "$py" tools/bench/bench_gpu.py --preset "$preset" --micro-batch 1 \
      --seq-len 8192,32768,131072 --docs 4 --activation-checkpoint --compile \
      --attention "$attention" --local-window 1024 --global-every 6 --local-theta 10000 \
      --warmup "$warmup" --steps "$steps" --json "$out/$name.json"
  }
  rows long-125m-doc 75 125m doc 2 4
  rows long-125m-lg 75 125m local-global 2 4
  rows long-1b-doc 100 1b doc 1 2
  rows long-1b-lg 100 1b local-global 1 2
}

"$part"
step table 10 "$py" tools/bench/gpu_table.py "$out"
if [ -n "$list" ]; then
  echo "total of the limits: $total s"
  exit 0
fi
cat "$out/table.md" "$out/long_table.md" 2>/dev/null
echo "gpu check ($part): $( [ "$status" -eq 0 ] && echo passed || echo FAILED ) in $SECONDS s; logs in $out"
exit "$status"
