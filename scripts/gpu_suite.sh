#!/usr/bin/env bash
# One device call: install wheels, build the CUDA extension, run GPU tests and/or benchmarks.
#   bash scripts/gpu_suite.sh setup|tests|dist|bench|bench-quick|train [pytest/bench args...]
# Logs and CSVs go to $OUT (the device tool's output folder) or ./gpu_out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PRIMUS_TURBO_COMMIT=${PRIMUS_TURBO_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}

setup() {
  if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
  fi
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  # Run from the source tree without installing: expose integrations/ as primus_turbo.integrations
  # the way setup.py's package_dir does (this copy of the tree is throwaway).
  [ -e primus_turbo/integrations ] || ln -s ../integrations primus_turbo/integrations
  local t0=$SECONDS
  GPU_ARCHS=${GPU_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16} python3 setup.py -q build_ext --inplace \
    > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; echo "csrc build FAILED"; }
  echo "setup: csrc build $((SECONDS - t0)) s; $(python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), "GPU(s)")')"
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
}

# The device tool returns only a few files: pack everything under $OUT into one tarball at exit.
pack() { (cd "$OUT" && ls | grep -v '^results.tgz$' > /tmp/pack.list && tar czf /tmp/results.tgz -T /tmp/pack.list \
  && xargs rm -rf < /tmp/pack.list && mv /tmp/results.tgz results.tgz); }
[ "${PACK:-1}" = 1 ] && trap pack EXIT

mode=${1:-tests}; shift || true
setup
case "$mode" in
  setup) ;;
  tests)
    python3 -m pytest -n "${PYTEST_JOBS:-4}" -q --timeout=600 -p no:cacheprovider -m "not multigpu" \
      "${@:-tests}" 2>&1 | tee "$OUT/pytest_gpu.log" | grep -E "FAILED|ERROR|passed|failed" | tail -60 ;;
  dist)
    python3 -m pytest --dist-only -q --timeout=600 -p no:cacheprovider "${@:-tests}" 2>&1 \
      | tee "$OUT/pytest_dist.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40 ;;
  bench|bench-quick)
    q=""; [ "$mode" = bench-quick ] && q="--quick"
    for b in "$@"; do
      echo "=== $b"
      case "$b" in
        *dispatch*|*async_tp*) torchrun --nproc_per_node=2 "benchmark/ops/$b.py" $q --out "$OUT" ;;
        *) python3 "benchmark/ops/$b.py" $q --out "$OUT" ;;
      esac 2>&1 | tee "$OUT/$b.log" | tail -40
    done ;;
  train)
    torchrun --nproc_per_node="${NPROC:-1}" train.py "$@" 2>&1 | tee -a "$OUT/train.log" | tail -40 ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
