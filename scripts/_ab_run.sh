export PRIMUS_TURBO_COMMIT=aa29d6a+wip; PACK=0 bash scripts/gpu_suite.sh setup > $OUT/setup.log 2>&1; tail -2 $OUT/setup.log
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider -m "not multigpu" tests/pytorch/ops/test_grouped_gemm.py tests/pytorch/ops/test_grouped_gemm_fp8.py tests/pytorch/ops/test_rmsnorm.py > $OUT/t0.log 2>&1; grep -E "^FAILED|passed|failed" $OUT/t0.log | tail -25
timeout 60 python3 benchmark/ops/rmsnorm_variants.py > $OUT/variants.csv 2> $OUT/variants.err; cat $OUT/variants.csv; tail -3 $OUT/variants.err
for v in "1 2" "2 3" "1 4"; do set -- $v; PRIMUS_TURBO_RMSNORM_FWD_VARIANT=$1 PRIMUS_TURBO_RMSNORM_BWD_VARIANT=$2 timeout 90 python3 -m pytest -q -n 8 -p no:cacheprovider -m gpu tests/pytorch/ops/test_rmsnorm.py > $OUT/t_$1_$2.log 2>&1; echo "variant fwd $1 bwd $2"; grep -E "^FAILED|passed|failed" $OUT/t_$1_$2.log | tail -8; done
