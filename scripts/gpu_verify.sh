#!/usr/bin/env bash
# One ~9-minute device call: rebuild, re-run the GPU tests that a previous run flagged, time the
# Megatron recipes turbo on/off, and run the quick op benchmarks. Every step has its own timeout so
# a hang costs that step only. Outputs are packed into $OUT/results.tgz by gpu_suite.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
export PACK=0 PYTEST_JOBS=8
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
bash scripts/gpu_suite.sh setup > "$OUT/setup.log" 2>&1; tail -3 "$OUT/setup.log"
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
step() { local t=$1 name=$2; shift 2; local t0=$SECONDS; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? $((SECONDS - t0)) s"; }
TESTS=${TESTS:-tests/pytorch/ops/test_moe_permute.py tests/pytorch/ops/test_grouped_gemm.py tests/pytorch/modules/test_grouped_linear.py}
step "${TEST_TIMEOUT:-90}" tests python3 -m pytest -n 8 -q --timeout=80 -p no:cacheprovider -m "not multigpu" $TESTS
grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.log" | tail -30
if [ -n "${DIST_TESTS:-}" ]; then
  step "${DIST_TIMEOUT:-120}" dist python3 -m pytest --dist-only -q --timeout=100 -p no:cacheprovider $DIST_TESTS
  grep -E "FAILED|ERROR|passed|failed" "$OUT/dist.log" | tail -20
fi
CFGS=("bf16_on recipe=deepseek_moe_bf16" "bf16_off recipe=deepseek_moe_bf16 turbo.enabled=false")
for cfg in "${CFGS[@]}"; do
  set -- $cfg; name=$1; shift
  step 55 "train_$name" torchrun --nproc_per_node=1 train.py "$@" train.steps=8 "train.metrics_file=$OUT/$name.jsonl"
  grep -E "step [0-9]+/|Error"  "$OUT/train_$name.log" | tail -2
done
for b in ${BENCHES:-}; do
  step 60 "$b" python3 "benchmark/ops/$b.py" --quick --out "$OUT"; tail -12 "$OUT/$b.log"
done
cd "$OUT" && tar czf /tmp/r.tgz --exclude=results.tgz . && rm -rf ./* && mv /tmp/r.tgz results.tgz
