#!/usr/bin/env bash
# The GPU check of CUDA graph interposition, in one call that fits a short device lease
# (docs/cuda_graphs.md, "Running the GPU check", has the exact device command).
#
#   bench/gpu_check.sh             everything this machine allows
#   bench/gpu_check.sh --cpu-only  the part that needs no GPU (what CI runs, scripts/test.sh)
#
# Stages, each under its own `timeout`, each writing its result file as it finishes (a run
# killed at its limit still returns what it measured), none stopping the others:
#   build      xmix._C: the prebuilt module for this Python when its source stamp matches
#              (bench/build_device_module.sh, carried in build/device), else a CMake build of
#              the package's own targets; no undefined xmix:: symbol (nm); the staged module
#              imports                                                   -> build.log
#   cpu        (--cpu-only / no GPU) gpu_check.py's part that needs no GPU -> cpu.log
#   quick      gpu_check.py at 2 layers, d=5120, batches 8 and 256, 3 reps -> quick.log, table.md
#   tests      pytest -m gpu (kernel twins, graph patching, CAST stress) and the CUDA
#              GoogleTest binary                                         -> tests.log
#   full       gpu_check.py at 32 layers, d=4096, batches 1/8/64/256    -> full.log, table.md
#   sanitizer  compute-sanitizer memcheck and racecheck on the CUDA GoogleTests, if time is
#              left                                                      -> sanitizer.log
# and summary.txt: the machine, then one line per stage (status, seconds). At most 7 files.
#
# Environment: PYTHON (default python3), OUT (result folder; default build/gpu_check/out),
# GPU_CHECK_BUDGET (seconds for the whole run, default 300), XMIX_PREBUILT (default
# build/device), GPU_CHECK_BUILD_DIR (a CMake build tree to build in; default
# build/gpu_check/cmake; an already configured tree is only built, never reconfigured),
# CUDA_HOME (default /usr/local/cuda), XMIX_ARCH (default 90), GPU_CHECK_ARGS (extra
# arguments for the full gpu_check.py run), JOBS.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
CPU_ONLY=0
[ "${1:-}" = "--cpu-only" ] && CPU_ONLY=1
RESULTS=${OUT:-$ROOT/build/gpu_check/out}
WORK=$ROOT/build/gpu_check
BUDGET=${GPU_CHECK_BUDGET:-300}
PREBUILT=${XMIX_PREBUILT:-$ROOT/build/device}
BUILD_DIR=${GPU_CHECK_BUILD_DIR:-$WORK/cmake}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
ARCH=${XMIX_ARCH:-90}
mkdir -p "$RESULTS" "$WORK"
SUMMARY=$RESULTS/summary.txt
: >"$SUMMARY"
T0=$SECONDS
STATUS=0
log() { echo "[gpu_check +$((SECONDS - T0))s] $*"; }
note() { echo "$*" >>"$SUMMARY"; log "$*"; }
left() { echo $((BUDGET - (SECONDS - T0))); }

# stage NAME LIMIT_S LOGFILE CMD...: runs CMD under timeout (the stage limit or what is left
# of the budget), appends its output to LOGFILE and one status line to summary.txt.
stage() {
  local name=$1 limit=$2 logf=$3
  shift 3
  local avail
  avail=$(left)
  if [ "$avail" -lt 20 ]; then
    printf '%-10s %-34s\n' "$name" "skipped: ${avail}s of the budget left" >>"$SUMMARY"
    log "stage $name skipped (${avail}s left)"
    return 0
  fi
  [ "$limit" -gt "$avail" ] && limit=$avail
  log "stage $name (limit ${limit}s) -> $(basename "$logf")"
  local t=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" >>"$logf" 2>&1
  rc=$?
  local what="ok"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    what="TIMEOUT after ${limit}s"
  elif [ $rc -ne 0 ]; then
    what="FAILED (rc $rc)"
  fi
  [ $rc -ne 0 ] && STATUS=1
  printf '%-10s %-34s %5ss\n' "$name" "$what" "$((SECONDS - t))" >>"$SUMMARY"
  log "stage $name: $what"
  return 0
}

{
  echo "xmix gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET}s"
  echo "machine: $(uname -m), $(nproc) cores; $(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo 'no nvidia-smi')"
  echo "python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())' 2>&1 | tail -1)"
  echo "source stamp: $(bench/source_stamp.sh 2>/dev/null || echo unknown)"
} >>"$SUMMARY"
cat "$SUMMARY"

# ------------------------------------------------------------------ build (inline: its result
# is the environment of every later stage)
BLOG=$RESULTS/build.log
: >"$BLOG"
build_fail() {
  echo "FAILED: $*" >>"$BLOG"
  printf '%-10s %-34s %5ss\n' build "FAILED" "$((SECONDS - TB))" >>"$SUMMARY"
  note "build failed: $*"
  note "nothing else can run without xmix._C (build.log has the details)"
  exit 1
}
TB=$SECONDS
EXT=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))' 2>>"$BLOG") \
  || build_fail "$PY does not run"
STAMP=$(bench/source_stamp.sh)
MODULE=""
TESTBIN=""
why_no_prebuilt="no $PREBUILT/_C$EXT"
if [ -f "$PREBUILT/_C$EXT" ]; then
  built_from=$(awk '$1 == "stamp" {print $2}' "$PREBUILT/STAMP" 2>/dev/null)
  if [ "$built_from" = "$STAMP" ]; then
    MODULE=$PREBUILT/_C$EXT
    [ -x "$PREBUILT/xmix_cuda_tests" ] && TESTBIN=$PREBUILT/xmix_cuda_tests
    echo "using the prebuilt module $MODULE:" >>"$BLOG"
    cat "$PREBUILT/STAMP" >>"$BLOG"
  else
    why_no_prebuilt="$PREBUILT/_C$EXT was built from other sources (stamp ${built_from:-none}, these are $STAMP)"
  fi
fi
if [ -z "$MODULE" ]; then
  echo "$why_no_prebuilt: building with CMake in $BUILD_DIR" >>"$BLOG"
  CMAKE=$(command -v cmake || true)
  [ -n "$CMAKE" ] || build_fail "$why_no_prebuilt, and there is no cmake here: run bench/build_device_module.sh on a machine with CMake, nvcc and Python 3.12 headers and carry build/device"
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    NVCC="$CUDA_HOME/bin/nvcc"
    [ -x "$NVCC" ] || NVCC=$(command -v nvcc || true)
    [ -n "$NVCC" ] || build_fail "$why_no_prebuilt, and nvcc is not found (set CUDA_HOME)"
    PYBIND_DIR=$("$PY" -m pybind11 --cmakedir 2>>"$BLOG") \
      || build_fail "$why_no_prebuilt, and pybind11 is not importable with $PY"
    TESTS=OFF
    [ -f /usr/include/gtest/gtest.h ] && TESTS=ON
    GEN=()
    command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
    timeout 300 "$CMAKE" -S "$ROOT" -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCH-real" \
      -DPython_EXECUTABLE="$(command -v "$PY")" -Dpybind11_DIR="$PYBIND_DIR" \
      -DXMIX_BUILD_TESTS=$TESTS >>"$BLOG" 2>&1 \
      || build_fail "$why_no_prebuilt, and CMake could not configure (no Python headers? see build.log)"
  fi
  targets=(--target _C)
  grep -q '^XMIX_BUILD_TESTS:BOOL=ON' "$BUILD_DIR/CMakeCache.txt" && \
    grep -q '^CMAKE_CUDA_COMPILER:' "$BUILD_DIR/CMakeCache.txt" && targets+=(xmix_cuda_tests)
  timeout 900 "$CMAKE" --build "$BUILD_DIR" "${targets[@]}" -j "${JOBS:-$(nproc)}" >>"$BLOG" 2>&1 \
    || build_fail "the CMake build failed (build.log)"
  MODULE=$(ls "$BUILD_DIR"/_C"$EXT" 2>/dev/null | head -1)
  [ -n "$MODULE" ] || build_fail "the CMake build made no _C$EXT in $BUILD_DIR (configured for another Python?)"
  [ -x "$BUILD_DIR/tests/cpp/xmix_cuda_tests" ] && TESTBIN=$BUILD_DIR/tests/cpp/xmix_cuda_tests
fi
bench/check_symbols.sh "$MODULE" >>"$BLOG" 2>&1
case $? in
  0) ;;
  2) echo "undefined-symbol check skipped (the import below still fails on one)" >>"$BLOG" ;;
  *) build_fail "undefined xmix:: symbols in $MODULE (a source missing from a CMake target; build.log)" ;;
esac
# The package as the checks import it: python/xmix with the module just chosen, first on the
# path. An editable install (pip install -e) puts a finder on sys.meta_path that would win
# over PYTHONPATH: sitecustomize (imported after the .pth files ran) drops it.
rm -rf "$WORK/pkg" "$WORK/boot" && mkdir -p "$WORK/pkg" "$WORK/boot"
cp -r python/xmix "$WORK/pkg/xmix"
find "$WORK/pkg/xmix" -name '_C*.so' -delete
find "$WORK/pkg/xmix" -name '__pycache__' -prune -exec rm -rf {} +
cp "$MODULE" "$WORK/pkg/xmix/_C$EXT"
# the headers a wheel installs beside the package (CMakeLists.txt): user kernels include
# xmix/custom.h (the check's custom-kernel case compiles one)
mkdir -p "$WORK/pkg/xmix/include/xmix"
cp csrc/include/xmix/custom.h csrc/include/xmix/control.h "$WORK/pkg/xmix/include/xmix/"
cat >"$WORK/boot/sitecustomize.py" <<'EOF'
import sys

sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable_skbc_")]
EOF
export PYTHONPATH="$WORK/boot:$WORK/pkg:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
NEED_CUDA=0
{ [ -x "$CUDA_HOME/bin/nvcc" ] || command -v nvcc >/dev/null 2>&1; } && NEED_CUDA=1
"$PY" - "$WORK/pkg" "$NEED_CUDA" >>"$BLOG" 2>&1 <<'EOF' || build_fail "the staged module does not import, or lacks CUDA though nvcc is here (build.log)"
import sys
import xmix._C as C
assert C.__file__.startswith(sys.argv[1]), f"imported {C.__file__}, not the staged module"
assert C.built_with_cuda() or sys.argv[2] == "0", "built without CUDA although nvcc is here"
print("import ok:", C.__file__, "|", C.cuda_status(), "| built with CUDA:", C.built_with_cuda())
EOF
printf '%-10s %-34s %5ss\n' build "ok" "$((SECONDS - TB))" >>"$SUMMARY"
log "build ok: $(tail -1 "$BLOG")"

HAVE_GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$CPU_ONLY" = 1 ] || [ "$HAVE_GPU" != 1 ]; then
  why=$([ "$CPU_ONLY" = 1 ] && echo "--cpu-only" || echo "no GPU")
  stage cpu 300 "$RESULTS/cpu.log" "$PY" bench/gpu_check.py --cpu-only
  note "$why: stopped before the GPU stages"
  tail -3 "$RESULTS/cpu.log"
  exit $STATUS
fi

export PYTHONUNBUFFERED=1 XMIX_GRAPH_VERIFY=1
# the custom-kernel case compiles its CUDA source with nvcc at deploy (xmix/runtime/control/custom.py)
[ -x "$CUDA_HOME/bin/nvcc" ] && export PATH="$CUDA_HOME/bin:$PATH"
# quick runs at hidden size 5 120 (Qwen2.5-14B/32B, Llama-2-13B, Phi-4): the kernels' static
# plus dynamic shared memory passes 48 KB there and needs the opt-in; full runs at 4 096.
stage quick 60 "$RESULTS/quick.log" "$PY" bench/gpu_check.py --layers 2 --d 5120 --ffn 13824 \
  --heads 40 --batches 8,256 --reps 3 --rounds 3 --tag quick --table "$RESULTS/table.md"
run_tests() {
  local rc=0
  "$PY" -m pytest -q -m gpu -p no:cacheprovider --rootdir "$ROOT" tests/unit/test_kernels.py \
    tests/unit/test_graphs.py tests/gpu/test_gpu_check_kernels.py || rc=1
  if [ -n "$TESTBIN" ]; then
    "$TESTBIN" --gtest_filter='KernelTwins.*' || rc=1
  else
    echo "no CUDA GoogleTest binary (built without GoogleTest): skipped"
  fi
  return $rc
}
export -f run_tests
export PY ROOT TESTBIN
stage tests 75 "$RESULTS/tests.log" bash -c run_tests
# shellcheck disable=SC2086
stage full 150 "$RESULTS/full.log" "$PY" bench/gpu_check.py --reps 20 --rounds 5 --tag full \
  --table "$RESULTS/table.md" ${GPU_CHECK_ARGS:-}
if command -v compute-sanitizer >/dev/null 2>&1 && [ -n "$TESTBIN" ]; then
  sanitize() {
    local rc=0
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer --tool $tool"
      compute-sanitizer --tool "$tool" --error-exitcode 9 "$TESTBIN" --gtest_filter='KernelTwins.*' || rc=1
    done
    return $rc
  }
  export -f sanitize
  stage sanitizer 60 "$RESULTS/sanitizer.log" bash -c sanitize
else
  note "sanitizer  skipped: $(command -v compute-sanitizer >/dev/null 2>&1 && echo 'no CUDA GoogleTest binary' || echo 'no compute-sanitizer')"
fi
note "done in $((SECONDS - T0))s, status $STATUS"
cat "$SUMMARY"
[ -f "$RESULTS/table.md" ] && cat "$RESULTS/table.md"
exit $STATUS
