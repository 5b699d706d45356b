#!/usr/bin/env bash
# Build, then run every test: GoogleTest through ctest, then pytest. Prints both counts.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

BUILD=build/xmix
echo "== GoogleTest (ctest) =="
set +e
.venv/bin/ctest --test-dir "$BUILD" --output-on-failure 2>&1 | tee /tmp/xmix-ctest.log
CTEST_RC=${PIPESTATUS[0]}
echo "== pytest =="
.venv/bin/python -m pytest tests -q -p no:cacheprovider "$@" 2>&1 | tee /tmp/xmix-pytest.log
PYTEST_RC=${PIPESTATUS[0]}
set -e

CT=$(grep -E "tests passed|tests failed" /tmp/xmix-ctest.log | tail -1)
PT=$(grep -E "^(=+ )?[0-9]+ (passed|failed)" /tmp/xmix-pytest.log | tail -1 | sed 's/=//g')
echo
echo "GoogleTest: ${CT:-no result}"
echo "pytest:     ${PT:-no result}"
[ "$CTEST_RC" = 0 ] && [ "$PYTEST_RC" = 0 ] && { echo "ALL TESTS PASSED"; exit 0; }
echo "TESTS FAILED (ctest rc=$CTEST_RC, pytest rc=$PYTEST_RC)"
exit 1
