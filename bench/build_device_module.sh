#!/usr/bin/env bash
# Builds, on this machine, what bench/gpu_check.sh needs on the lent GPU machine, which may
# have neither CMake nor Python headers: xmix._C for CPython 3.12 and sm_90 (H100/H200),
# and the CUDA GoogleTest binary (CUDA twins vs CPU twins, also run under compute-sanitizer),
# through the project's CMakeLists.txt (the package's targets, nothing listed by hand).
#
# Output (ignored by git; carry it with the device call, see docs/cuda_graphs.md):
#   build/device/_C.cpython-312-x86_64-linux-gnu.so
#   build/device/xmix_cuda_tests
#   build/device/graph_node_cost  bench/graph_node_cost.cu (what an idle node costs by position)
#   build/device/STAMP       source hash (bench/source_stamp.sh) + toolchain, checked on use
#
# Needs: Python 3.12 with headers (PY312, else python3.12 on PATH or under pyenv), nvcc
# (CUDA_HOME, default /usr/local/cuda; 13.0 here and on the device), CMake >= 3.24, ninja,
# GoogleTest (libgtest-dev). pybind11 comes from pip into build/device-venv (network or pip
# cache needed the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUTDIR=${XMIX_DEVICE_OUT:-$ROOT/build/device}
WORK=$ROOT/build/device-cmake
VENV=$ROOT/build/device-venv
ARCH=${XMIX_ARCH:-90}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
log() { echo "[build_device_module] $*"; }
die() { echo "[build_device_module] FAILED: $*" >&2; exit 1; }

# The first candidate that runs and is 3.12 (a pyenv shim may exist and still fail).
is312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
cands=("${PY312:-}")
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -rV); do
    cands+=("$(pyenv root)/versions/$v/bin/python3.12")
  done
fi
for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do cands+=("$p"); done
cands+=("$(command -v python3.12 || true)")
PY312=
for c in "${cands[@]}"; do
  if is312 "$c"; then PY312=$c; break; fi
done
[ -n "$PY312" ] || die "no working Python 3.12 found (set PY312=/path/to/python3.12)"
INC=$("$PY312" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$INC/Python.h" ] || die "Python.h not found in $INC (a Python 3.12 with headers is needed)"

NVCC="$CUDA_HOME/bin/nvcc"
[ -x "$NVCC" ] || NVCC=$(command -v nvcc || true)
[ -n "$NVCC" ] && [ -x "$NVCC" ] || die "nvcc not found (set CUDA_HOME)"
CMAKE=$(command -v cmake || true)
[ -n "$CMAKE" ] || CMAKE="$ROOT/.venv/bin/cmake"
[ -x "$CMAKE" ] || die "cmake not found"
GEN=()
if command -v ninja >/dev/null 2>&1 || [ -x "$ROOT/.venv/bin/ninja" ]; then
  GEN=(-G Ninja)
  command -v ninja >/dev/null 2>&1 || GEN+=(-DCMAKE_MAKE_PROGRAM="$ROOT/.venv/bin/ninja")
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $PY312"
  "$PY312" -m venv "$VENV"
fi
"$VENV/bin/python" -c 'import pybind11' 2>/dev/null || \
  "$VENV/bin/python" -m pip install -q "pybind11>=2.12" 2>&1 | { grep -v "^WARNING: Location" || true; }
PYBIND_DIR=$("$VENV/bin/python" -m pybind11 --cmakedir)

T0=$SECONDS
log "configuring ($("$NVCC" --version | tail -1 | sed 's/^ *//'); sm_$ARCH; $("$PY312" -V))"
"$CMAKE" -S "$ROOT" -B "$WORK" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCH-real" \
  -DPython_EXECUTABLE="$VENV/bin/python" -Dpybind11_DIR="$PYBIND_DIR" \
  -DXMIX_BUILD_TESTS=ON >"$WORK.configure.log" 2>&1 \
  || { tail -40 "$WORK.configure.log"; die "CMake configure failed"; }
grep -q "building CPU and CUDA kernels" "$WORK.configure.log" || { tail -20 "$WORK.configure.log"; die "CMake did not find the CUDA toolkit"; }
log "building _C and xmix_cuda_tests"
"$CMAKE" --build "$WORK" --target _C xmix_cuda_tests -j "${JOBS:-2}" >"$WORK.build.log" 2>&1 \
  || { tail -60 "$WORK.build.log"; die "build failed"; }

SO=$(ls "$WORK"/_C.cpython-312-*.so)
bench/check_symbols.sh "$SO" || die "undefined xmix:: symbols in $SO (a source missing from a CMake target?)"

rm -rf "$OUTDIR" && mkdir -p "$OUTDIR"
cp "$SO" "$WORK/tests/cpp/xmix_cuda_tests" "$OUTDIR/"
# The graph-node cost benchmark (docs/cuda_graphs.md, Results): plain CUDA, no project code.
"$NVCC" -O2 -arch=sm_"$ARCH" bench/graph_node_cost.cu -o "$OUTDIR/graph_node_cost" \
  || die "bench/graph_node_cost.cu does not build"
strip --strip-debug "$OUTDIR"/* 2>/dev/null || true
glibc=$(objdump -T "$OUTDIR"/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
glibcxx=$(objdump -T "$OUTDIR"/* 2>/dev/null | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)
{
  echo "stamp $(bench/source_stamp.sh)"
  echo "python $("$PY312" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
  echo "arch sm_$ARCH"
  echo "nvcc $("$NVCC" --version | tail -1 | sed 's/^ *//')"
  echo "needs $glibc $glibcxx"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m) ($(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-unknown os}"))"
} >"$OUTDIR/STAMP"
# The module must import here too (CPU kernels; no GPU needed).
(cd "$OUTDIR" && "$VENV/bin/python" -c "import _C; print('[build_device_module] import ok:', _C.cuda_status())") \
  || die "the built module does not import with $PY312"
log "done in $((SECONDS - T0))s: $(du -sh "$OUTDIR" | cut -f1) in $OUTDIR"
cat "$OUTDIR/STAMP"
