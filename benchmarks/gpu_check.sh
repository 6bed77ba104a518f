#!/usr/bin/env bash
# Everything that needs the GPU, in one call (device time is scarce): the GPU tests, the
# sanitizers (caching allocator off, so an out-of-bounds write cannot hide inside torch's pool),
# proof that memcheck sees a seeded out-of-bounds write, the soak and the benchmarks. Runs from
# the source tree with $GPU_PYTHON (default python3, which must have torch and CuPy); full logs
# under $OUT (default ./gpu-logs); a short table last. Exits non-zero when any step fails.
#   STEPS="pytest cache sanitizers oob soak bench host reader decode profile"  (default: all but profile); TESTS: test
#   paths (default tests); STEP_TIMEOUT: seconds a step may take (default 900); PROFILES: ';'-separated
#   benchmarks/ncu_driver.py shapes that the profile step runs under ncu (log: $OUT/ncu.log)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
OUT=${OUT:-gpu-logs}
STEPS=${STEPS:-pytest cache sanitizers oob soak bench host reader decode}  # profile: on request
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
export NVFP4_MLA_CACHE_DIR=${NVFP4_MLA_CACHE_DIR:-$(mktemp -d)}
summary=()
failed=0

step() {  # step NAME LOG EXPECTED_RC COMMAND...: runs, logs, records pass/fail and the log's last line
    local name=$1 log=$2 expected=$3; shift 3
    local start=$SECONDS
    timeout "${STEP_TIMEOUT:-900}" "$@" >>"$log" 2>&1
    local rc=$?
    local verdict=ok
    [ "$rc" = "$expected" ] || { verdict=FAIL; failed=1; }
    summary+=("$(printf '%-11s %-4s rc=%-3s %4ss  %s' "$name" "$verdict" "$rc" $((SECONDS - start)) "$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-90)")")
}

wants() { [[ " $STEPS " == *" $1 "* ]]; }

$PY -c 'import torch, cupy; print(torch.cuda.get_device_name(), "torch", torch.__version__, "cupy", cupy.__version__, "nvrtc", cupy.cuda.nvrtc.getVersion())'
wants pytest && step pytest "$OUT/pytest.log" 0 $PY -m pytest -q -rs -m gpu -p no:cacheprovider ${TESTS:-tests} ${PYTEST_ARGS:-}
# The kernel cache's CPU tests with this machine's NVRTC (its cubins' ELF layout), other users included.
wants cache && step cache "$OUT/cache.log" 0 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cache.py \
    tests/test_cache_files.py
if wants sanitizers; then
    for tool in memcheck racecheck initcheck; do
        step "$tool" "$OUT/sanitizers.log" 0 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
            compute-sanitizer --tool "$tool" --error-exitcode 9 $PY benchmarks/sanitizer_workload.py
    done
fi
if wants sanitizers; then  # the reader and the attention kernel: invalid slots, masks, lonely rows, NaN records
    step memcheck-rd "$OUT/sanitizers.log" 0 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        --error-exitcode 9 $PY -m pytest -q -p no:cacheprovider tests/test_reader_gpu.py tests/test_decode_gpu.py \
        -k "invalid or lonely or nan or two_pools or random or split or long_selection"
    for tool in memcheck racecheck synccheck; do  # the decode scheduling: its shared marks, ballots and barriers, in the
        # scheduler and in the attention kernels' blocks
        step "$tool-s" "$OUT/sanitizers.log" 0 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" \
            --error-exitcode 9 $PY -m pytest -q -p no:cacheprovider tests/test_decode_scheduler.py \
            tests/test_decode_plan.py -k "device_list or (models_list and not 2000) or (written_late and not 2000 and not 16384)"
    done
    for tool in racecheck synccheck; do  # the Hopper kernel's mbarriers and named barriers, and the combine
        step "$tool-d" "$OUT/sanitizers.log" 0 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" \
            --error-exitcode 9 $PY -m pytest -q -p no:cacheprovider tests/test_decode_gpu.py \
            -k "lonely or two_pools or (long_selection and default)"
    done
fi
# The seeded out-of-bounds write must be reported (exit 9), else the sanitizer step proves nothing.
wants oob && step seeded-oob "$OUT/seeded_oob.log" 9 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    compute-sanitizer --tool memcheck --error-exitcode 9 $PY benchmarks/seeded_oob.py
wants soak && step soak "$OUT/soak.log" 0 $PY benchmarks/soak.py ${SOAK_ARGS:-}
wants bench && step bench "$OUT/bench.log" 0 $PY -m nvfp4_mla.bench --out "$OUT/bench" ${BENCH_ARGS:-}
wants host && step host "$OUT/bench_host.log" 0 $PY -m nvfp4_mla.bench host --out "$OUT/host"
wants reader && step reader "$OUT/bench_reader.log" 0 $PY -m nvfp4_mla.bench reader --out "$OUT/reader"
wants decode && step decode "$OUT/bench_decode.log" 0 $PY -m nvfp4_mla.bench decode --out "$OUT/decode" ${DECODE_ARGS:-}
if wants profile; then  # ncu of single benchmark shapes: the evidence docs/performance.md cites
    IFS=';' read -ra profiles <<<"${PROFILES:-decode 64 1 128 1024;decode 1 1 128 512;write kv 65536}"
    for shape in "${profiles[@]}"; do
        kernel='regex:^nvfp4_mla_write$' count=1
        [[ $shape == decode* ]] && kernel='regex:^nvfp4_mla_decode' count=2  # attention and combine
        echo "=== ncu $shape" >>"$OUT/ncu.log"
        step "ncu" "$OUT/ncu.log" 0 ncu --clock-control none -k "$kernel" -c $count \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
            --section Occupancy --section LaunchStats --section InstructionStats ${NCU_ARGS:-} \
            $PY benchmarks/ncu_driver.py --calls 1 $shape
    done
fi

grep -E "passed|failed" "$OUT/pytest.log" 2>/dev/null | tail -n 1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizers.log" "$OUT/seeded_oob.log" 2>/dev/null
printf "%s\n" "${summary[@]}"
exit $failed
