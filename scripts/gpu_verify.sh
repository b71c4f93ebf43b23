#!/usr/bin/env bash
# One device call (<= 10 min): rebuild, then the steps chosen by the environment, each with its own
# timeout so a hang costs that step only. Logs go to a work folder that is re-packed into
# $OUT/results.tgz after every step: a call cut off by the device's time limit still returns what ran.
#
#   TESTS="tests/..." [TEST_TIMEOUT=90]        pytest -m "not multigpu" on those paths (TEST_JOBS=8 workers)
#   SERIAL_TESTS="tests/..." [SERIAL_TIMEOUT=300]  the same, one test at a time (GPU training runs: in
#                                              parallel they run out of memory on one GPU)
#   TESTS_K / SERIAL_K="a or b"                a pytest -k expression for those steps (TESTS and SERIAL_TESTS are
#                                              word-split, so a -k with spaces cannot go inside them)
#   DIST_TESTS="tests/..." [DIST_TIMEOUT=120]  pytest --dist-only -v (2-GPU tests; DIST_TEST_TIMEOUT=240 per test: the CP test compiles for >90 s)
#   TRAIN="bf16_on bf16_off" (default)         Megatron deepseek_moe_bf16 8 steps turbo on / off; TRAIN=none skips
#   E2E="recipe=deepseek_moe_fp8 turbo=on"     benchmark/e2e/compare.py with these options (E2E_TIMEOUT=120 each);
#                                              "a=1 ...; b=2 ..." runs several, into e2e, e2e_2, ...; an upper-case
#                                              NAME=value in a set is an environment variable for that set
#   SYNCS="recipe=deepseek_moe_fp8 train.steps=6"  host-sync sites per step (benchmark/e2e/find_syncs.py), one
#                                              torchrun each; "a ...; b ..." runs several (SYNCS_TIMEOUT=150 each)
#   BENCHES="bench_gemm bench_rmsnorm"         benchmark/ops/<name>.py --quick (async_tp/dispatch under torchrun -n 2);
#                                              BENCH_QUICK=0: the full sweeps; DIST_BENCH_TIMEOUT=90 (2-GPU ones)
#   PARITY="recipe=deepseek_moe_fp8 steps=500" [PARITY_TIMEOUT=500]
#                                              compare.py parity=true: bf16 on GPU 0 and fp8 on GPU 1 at once, in
#                                              the background while the other steps run (loss only, so sharing the
#                                              GPUs with tests is fine; do not combine with BENCHES), then one report.
#                                              PARITY_RUNS="fp8:fp8.recipe=blockwise bf16:turbo=off,turbo.gemm=false
#                                              bf16:PRIMUS_TURBO_GEMM_BACKEND=TRITON": other runs (',' separates a
#                                              run's overrides; an upper-case NAME=value is an environment variable),
#                                              each in its own folder parity_<precision>_<overrides>, spread over
#                                              the GPUs round-robin (PARITY_GPUS=N: several runs share a GPU;
#                                              on one GPU, TESTS wait until the parity runs end)
# Pass PRIMUS_TURBO_COMMIT=<sha>: the device copy of the tree has no (or a stale) .git.
set -uo pipefail
cd "$(dirname "$0")/.."
export PACK=0 PYTEST_JOBS=8
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_verify.XXXX)
pack() { tar czf "$OUT/results.tgz.tmp" -C "$WORK" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"; }
T0=$SECONDS
gpu_stragglers() {  # after a timed-out step: processes still on a GPU that no background parity run started
  local pid up p keep
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2> /dev/null); do
    keep=0; up=$pid
    while [ -n "$up" ] && [ "$up" -gt 1 ]; do  # walk up: a parity run's trainer is a descendant of its pid
      for p in "${PARITY_PIDS[@]:-}"; do [ "$up" = "$p" ] && keep=1; done
      up=$(ps -o ppid= -p "$up" 2> /dev/null | tr -d ' ')
    done
    [ $keep = 0 ] && kill -9 "$pid" 2> /dev/null && echo "   killed straggler pid $pid"
  done
}
step() {
  local t=$1 name=$2; shift 2; local t0=$SECONDS rc
  timeout "$t" "$@" > "$WORK/$name.log" 2>&1; rc=$?
  echo "== $name rc=$rc $((SECONDS - t0)) s (call $((SECONDS - T0)) s)"
  # a timed-out pytest can leave xdist workers on the GPU (xdist restarts workers that die while its main
  # process lives), which can skew the next step's timing
  [ $rc = 124 ] && gpu_stragglers
  pack
}
OUT=$WORK bash scripts/gpu_suite.sh setup > "$WORK/setup.log" 2>&1; tail -3 "$WORK/setup.log"; pack
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PARITY_PIDS=(); PARITY_WAITED=0
wait_parity() {  # once: wait for the background parity runs, packing partial curves meanwhile
  [ ${#PARITY_PIDS[@]} -gt 0 ] && [ $PARITY_WAITED -eq 0 ] || return 0
  PARITY_WAITED=1
  while kill -0 "${PARITY_PIDS[@]}" 2> /dev/null; do sleep 20; pack; done  # partial curves survive a killed call
  for pid in "${PARITY_PIDS[@]}"; do wait "$pid"; echo "== parity pid $pid rc=$? (call $((SECONDS - T0)) s)"; done
}
if [ -n "${PARITY:-}" ]; then
  ngpu=${PARITY_GPUS:-$(nvidia-smi -L 2> /dev/null | grep -c GPU)}; [ "$ngpu" -ge 1 ] || ngpu=1
  idx=0
  for run in ${PARITY_RUNS:-bf16 fp8}; do  # precision[:override[,override...]]; own folder when overridden
    p=${run%%:*}; args=(); envs=(); dir=parity
    if [[ $run == *:* ]]; then
      extra=${run#*:}; dir=parity_${p}_${extra//[^a-zA-Z0-9]/_}
      IFS=',' read -ra items <<< "$extra"
      for item in "${items[@]}"; do  # NAME=value with an upper-case NAME: an environment variable
        if [[ $item =~ ^[A-Z][A-Z0-9_]*= ]]; then envs+=("$item"); else args+=("$item"); fi
      done
    fi
    env "${envs[@]}" CUDA_VISIBLE_DEVICES=$((idx % ngpu)) timeout "${PARITY_TIMEOUT:-500}" \
      python3 benchmark/e2e/compare.py parity=true $PARITY precisions=$p "${args[@]}" "out=$WORK/$dir" \
      > "$WORK/${dir}_$p.log" 2>&1 &
    PARITY_PIDS+=($!); idx=$((idx + 1))
  done
  echo "== parity started in the background (pids ${PARITY_PIDS[*]})"
fi
if [ -n "${TESTS:-}" ]; then
  if [ ${#PARITY_PIDS[@]} -gt 0 ] && [ "$ngpu" -le 1 ]; then  # a 23-48 GB run + test workers OOM one GPU
    echo "== one GPU: the tests wait for the parity runs"; wait_parity
  fi
  step "${TEST_TIMEOUT:-90}" tests python3 -m pytest -n "${TEST_JOBS:-8}" -q --timeout=600 -p no:cacheprovider -m "not multigpu" \
    $TESTS ${TESTS_K:+-k "$TESTS_K"}
  grep -E "FAILED|ERROR|passed|failed" "$WORK/tests.log" | tail -30
fi
if [ -n "${SERIAL_TESTS:-}" ]; then  # one at a time: training runs that each take a large share of the GPU
  step "${SERIAL_TIMEOUT:-300}" serial_tests python3 -m pytest -p no:xdist -q --timeout=600 -p no:cacheprovider \
    -m "not multigpu" $SERIAL_TESTS ${SERIAL_K:+-k "$SERIAL_K"}
  grep -E "FAILED|ERROR|passed|failed" "$WORK/serial_tests.log" | tail -20
fi
if [ -n "${DIST_TESTS:-}" ]; then
  # -v and a per-test timeout: a hung test fails with its stack and the rest still run and report
  step "${DIST_TIMEOUT:-120}" dist python3 -m pytest --dist-only -v -rfE --timeout="${DIST_TEST_TIMEOUT:-240}" \
    -p no:cacheprovider $DIST_TESTS
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$WORK/dist.log" | tail -24
fi
for name in ${TRAIN:-bf16_on bf16_off}; do
  case "$name" in
    none) continue ;;
    bf16_on) args=(recipe=deepseek_moe_bf16) ;;
    bf16_off) args=(recipe=deepseek_moe_bf16 turbo.enabled=false) ;;
    fp8_on) args=(recipe=deepseek_moe_fp8) ;;
    *) echo "TRAIN: unknown run $name (bf16_on, bf16_off, fp8_on, none)"; continue ;;
  esac
  step 75 "train_$name" torchrun --nproc_per_node=1 train.py "${args[@]}" train.steps=8 \
    "train.metrics_file=$WORK/$name.jsonl"
  grep -E "step [0-9]+/|Error" "$WORK/train_$name.log" | tail -2
done
if [ -n "${SYNCS:-}" ]; then  # host-sync sites per step (benchmark/e2e/find_syncs.py); ';' separates runs
  IFS=';' read -ra SYNC_SETS <<< "$SYNCS"; n=0
  for opts in "${SYNC_SETS[@]}"; do
    n=$((n + 1))
    SYNC_OUT=$WORK/syncs_$n.json step "${SYNCS_TIMEOUT:-150}" "syncs_$n" \
      torchrun --nproc_per_node=1 benchmark/e2e/find_syncs.py $opts
    grep -A12 "^host syncs" "$WORK/syncs_$n.log"
  done
fi
if [ -n "${E2E:-}" ]; then  # several comparisons: separate their option sets with ';' (folders e2e, e2e_2, ...)
  IFS=';' read -ra E2E_SETS <<< "$E2E"; n=0
  for opts in "${E2E_SETS[@]}"; do
    n=$((n + 1)); dir=e2e; [ $n -gt 1 ] && dir=e2e_$n
    envs=(); args=()
    for item in $opts; do  # NAME=value with an upper-case NAME: an environment variable for this set only
      if [[ $item =~ ^[A-Z][A-Z0-9_]*= ]]; then envs+=("$item"); else args+=("$item"); fi
    done
    step "${E2E_TIMEOUT:-120}" "$dir" env "${envs[@]}" python3 benchmark/e2e/compare.py "${args[@]}" "out=$WORK/$dir"
    sed -n '/| configuration/,/^$/p' "$WORK/$dir/report.md" 2>/dev/null
  done
fi
quick=--quick; [ "${BENCH_QUICK:-1}" = 0 ] && quick=
for b in ${BENCHES:-}; do
  case "$b" in
    *dispatch*|*async_tp*) step "${DIST_BENCH_TIMEOUT:-90}" "$b" torchrun --nproc_per_node=2 "benchmark/ops/$b.py" $quick --out "$WORK" ;;
    *) step "${BENCH_TIMEOUT:-75}" "$b" python3 "benchmark/ops/$b.py" $quick --out "$WORK" ;;
  esac
  grep -v "^ *$" "$WORK/$b.log" | tail -14
done
if [ ${#PARITY_PIDS[@]} -gt 0 ]; then
  wait_parity
  if [ -d "$WORK/parity/runs" ]; then  # runs without overrides share this folder: one report with the gap
    step 60 parity python3 benchmark/e2e/compare.py parity=true $PARITY reuse=true "out=$WORK/parity"
  fi
  for r in "$WORK"/parity*/report.md; do echo "-- $r"; sed -n '/| configuration/,/^$/p' "$r"; done
fi
