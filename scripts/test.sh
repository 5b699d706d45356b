#!/usr/bin/env bash
# Build, then run every test: the lint, format and type checks (scripts/lint.sh), GoogleTest
# through ctest, the part of the GPU check that needs no GPU (bench/gpu_check.sh --cpu-only),
# then pytest. Prints the counts; any failure fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "setup: done in ${SECONDS}s"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# Inductor compiles in the engine's own process: its default pool (one process per core, each
# importing torch) only adds work on a 2-core machine that already runs two test workers
# (a cold compiled tiny-llama engine start: 243 s with the pool, 210 s without, loaded, 2026-12-03)
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}

BUILD=build/xmix
set +e
echo "== lint (scripts/lint.sh) =="
scripts/lint.sh 2>&1 | tee /tmp/xmix-lint.log
LINT_RC=${PIPESTATUS[0]}
echo "lint: done at ${SECONDS}s"
echo "== GoogleTest (ctest) =="
.venv/bin/ctest --test-dir "$BUILD" --output-on-failure 2>&1 | tee /tmp/xmix-ctest.log
CTEST_RC=${PIPESTATUS[0]}
echo "== GPU check, the part that needs no GPU (bench/gpu_check.sh --cpu-only) =="
# The package's CMake tree (built by setup.sh) is only brought up to date, so this costs the
# symbol check, the import and gpu_check.py's CPU part.
GPU_CHECK_T0=$SECONDS
PYTHON=.venv/bin/python GPU_CHECK_BUILD_DIR=$BUILD OUT=build/gpu_check/ci bench/gpu_check.sh --cpu-only \
  2>&1 | tee /tmp/xmix-gpu-check.log
GPU_CHECK_RC=${PIPESTATUS[0]}
echo "gpu_check --cpu-only: rc=$GPU_CHECK_RC in $((SECONDS - GPU_CHECK_T0))s"
echo "== pytest =="
# -n 2: two pytest-xdist workers, each taking a test module whole (its engine
# starts once; tests/conftest.py groups the paper-app modules, which share session engines).
# An engine start keeps about one core busy, so two at a time use a 2-core machine.
# --durations: the slowest setups and tests, so a CI log shows where the time budget goes.
.venv/bin/python -m pytest tests -q -p no:cacheprovider -n "${XMIX_TEST_WORKERS:-2}" --durations=25 "$@" 2>&1 | tee /tmp/xmix-pytest.log
PYTEST_RC=${PIPESTATUS[0]}
set -e

CT=$(grep -E "tests passed|tests failed" /tmp/xmix-ctest.log | tail -1)
PT=$(grep -E "^(=+ )?[0-9]+ (passed|failed)" /tmp/xmix-pytest.log | tail -1 | sed 's/=//g')
echo
echo "GoogleTest: ${CT:-no result}"
echo "gpu_check:  $([ "$GPU_CHECK_RC" = 0 ] && echo "build, symbols, import and CPU part passed" || echo "FAILED (build/gpu_check/ci/summary.txt)")"
echo "pytest:     ${PT:-no result}"
echo "lint:       $(tail -1 /tmp/xmix-lint.log)"
[ "$LINT_RC" = 0 ] && [ "$CTEST_RC" = 0 ] && [ "$GPU_CHECK_RC" = 0 ] && [ "$PYTEST_RC" = 0 ] && { echo "ALL TESTS PASSED"; exit 0; }
echo "TESTS FAILED (lint rc=$LINT_RC, ctest rc=$CTEST_RC, gpu_check rc=$GPU_CHECK_RC, pytest rc=$PYTEST_RC)"
exit 1
