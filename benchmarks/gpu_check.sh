#!/usr/bin/env bash
# The device path on a real GPU, in one run of at most about 10 minutes (issue 17):
#   1. the KVG64 kernel cases (tests/unit/digest/kernel_cases.py) compiled for CUDA, bit for bit
#      against the numpy reference, and the check that seal/verify never make the host wait;
#   2. benchmarks/device_bench.py at the size of a real model (32 layers x 4096 blocks x 16
#      tokens x 8 KV heads x 128, bf16: 8 GiB of pages), with the BLOCK x num_warps sweep;
#   3. the same at fp16 and fp8 (no sweep);
#   4. one step's row digests, host time with the device idle and behind queued work: read back
#      to the host (as GPU workers did), kept on the device by torch, by the row kernel.
# Needs python3 with torch (CUDA), Triton, numpy, xxhash and pytest; not vLLM, structlog or
# prometheus-client (the kernel and benchmark modules import none of them). Run from the
# repository root:  bash benchmarks/gpu_check.sh [OUTDIR]   (default: $OUT, else /tmp/gpu_check)
# Every step's output goes to a file in OUTDIR; summary.txt says which steps passed.
set -u
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
summary="$out/summary.txt"
: >"$summary"

step() {  # step NAME TIMEOUT_S COMMAND...: run, keep its output, note its exit status
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$summary"
    return $rc
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    $py -c 'import sys, torch, triton, numpy, xxhash; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "numpy", numpy.__version__, "xxhash", xxhash.VERSION); print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, "SMs")'
} >"$out/machine.txt" 2>&1

step kernel_cases 150 env KVGUARD_KERNEL_DEVICE=cuda "$py" -m pytest -q -p no:cacheprovider -rA \
    tests/unit/digest/kernel_cases.py
step bench_bf16 180 "$py" benchmarks/device_bench.py --layers 32 --blocks 4096 --kv-heads 8 \
    --head-size 128 --dtype bfloat16 --repeats 15 --sweep --json "$out/bench_bf16.json"
# The guard's calls again with the sweep's fastest verify launch (what BLOCK_WORDS/NUM_WARPS
# would be set to), when the sweep ran.
best=$("$py" -c '
import json, sys
sweep = json.load(open(sys.argv[1]))["sweep"]
for case in ("verify", "seal"):
    b = max((x for x in sweep if x["case"] == case), key=lambda x: x["gbps"])
    print(b["block"], b["num_warps"], end=" ")' "$out/bench_bf16.json" 2>/dev/null)
if [ -n "$best" ]; then
    set -- $best
    step bench_bf16_best 60 "$py" benchmarks/device_bench.py --layers 32 --blocks 4096 --dtype bfloat16 \
        --repeats 9 --block "$1" --num-warps "$2" --seal-block "$3" --seal-num-warps "$4"
fi
step bench_fp16 50 "$py" benchmarks/device_bench.py --layers 32 --blocks 4096 --dtype float16 --repeats 5
step bench_fp8 50 "$py" benchmarks/device_bench.py --layers 32 --blocks 4096 --dtype float8_e4m3fn \
    --repeats 5
step step_rows 120 "$py" benchmarks/device_bench.py --layers 32 --blocks 4096 --dtype bfloat16 --repeats 3 \
    --step-rows 16,128,1024 --json "$out/step_rows.json"
grep -q "exit [^0]" "$summary" && exit 1
exit 0
