#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. Extra arguments go to pytest.
# Exits non-zero when any test fails, and also when no test ran (pytest's exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
JOBS=${PYTEST_JOBS:-2}
# A fresh inductor cache: a stale one can hide a changed fake kernel of a custom op.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
.venv/bin/python -m pytest tests -n "$JOBS" --timeout=900 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
