#!/usr/bin/env bash
# Everything that needs the GPU, in one call (device time is scarce): the whole test suite (GPU
# tests run, not skip), compute-sanitizer memcheck/racecheck/initcheck over a small workload, the
# soak (one million mixed eager and graph-replayed calls, sampled against the reference) and the
# benchmark. Runs from the source tree with the machine's python3 (torch + CuPy installed);
# full logs under $OUT (default ./gpu-logs); a short summary table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
export NVFP4_MLA_CACHE_DIR=${NVFP4_MLA_CACHE_DIR:-$(mktemp -d)}
summary=()

step() {  # step NAME LOG COMMAND...: runs, logs, records pass/fail and the log's last line
    local name=$1 log=$2; shift 2
    local start=$SECONDS
    "$@" >>"$log" 2>&1
    local rc=$?
    summary+=("$(printf '%-10s %-4s %4ss  %s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - start)) "$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-90)")")
    return $rc
}

python3 -c 'import torch, cupy; print(torch.cuda.get_device_name(), "torch", torch.__version__, "cupy", cupy.__version__, "nvrtc", cupy.cuda.nvrtc.getVersion())'
step pytest "$OUT/pytest.log" python3 -m pytest -q -rs -p no:cacheprovider tests ${PYTEST_ARGS:-}
for tool in ${SANITIZERS-memcheck racecheck initcheck}; do
    step "$tool" "$OUT/sanitizers.log" compute-sanitizer --tool "$tool" --error-exitcode 9 python3 benchmarks/sanitizer_workload.py
done
step soak "$OUT/soak.log" python3 benchmarks/soak.py ${SOAK_ARGS:-}
[ "${SKIP_BENCH:-0}" = 1 ] || step bench "$OUT/bench.log" python3 -m nvfp4_mla.bench --out "$OUT/bench" ${BENCH_ARGS:-}

grep -E "passed|failed" "$OUT/pytest.log" | tail -n 1
printf "%s\n" "${summary[@]}"
