#!/usr/bin/env bash
# GPU check of CUDA graph interposition, in one go (< 8 min on one H100/H200):
#   1. build xmix._C for sm_90 with nvcc/g++ directly (no CMake, pip or network needed: only
#      nvcc, a C++ compiler, Python headers and pybind11 headers, which torch ships),
#   2. run the pytest tests marked gpu (every CUDA kernel twin against xmix.reference, and
#      capture/patch/toggle/re-splice of a small decoder),
#   3. run bench/gpu_check.py: a Llama-shaped decoder (32 layers, d=4096, bf16) captured at
#      batch 1, 8, 64, 256, patched, checked against eager per primitive and condition, timed.
# Without a GPU it builds, runs what needs none and stops with "no GPU: stopped before ...".
#
# Environment: PYTHON (default python3), CUDA_HOME (default /usr/local/cuda), XMIX_ARCH
# (default 90), GPU_CHECK_ARGS (extra arguments for gpu_check.py), JOBS.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
ARCH=${XMIX_ARCH:-90}
OUT=$ROOT/build/gpu_check
T0=$SECONDS
log() { echo "[gpu_check +$((SECONDS - T0))s] $*"; }
die() { log "FAILED: $*"; exit 1; }

NVCC=$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")
[ -x "$NVCC" ] || die "nvcc not found (set CUDA_HOME)"
CXX=${CXX:-$(command -v g++ || command -v c++)}
[ -n "$CXX" ] || die "no C++ compiler"

# ------------------------------------------------------------------ 1. build
log "building xmix._C for sm_$ARCH with $NVCC"
read -r PYINC PYBIND EXT < <("$PY" - <<'EOF'
import sysconfig, os
inc = sysconfig.get_paths()["include"]
try:
    import pybind11
    pb = pybind11.get_include()
except ImportError:
    import torch
    pb = os.path.join(os.path.dirname(torch.__file__), "include")  # torch bundles pybind11
print(inc, pb, sysconfig.get_config_var("EXT_SUFFIX"))
EOF
) || die "python/torch not importable with $PY"
[ -f "$PYINC/Python.h" ] || die "Python.h not found in $PYINC (install the python dev headers)"
[ -f "$PYBIND/pybind11/pybind11.h" ] || die "pybind11 headers not found in $PYBIND"

rm -rf "$OUT" && mkdir -p "$OUT/obj" "$OUT/pkg"
INC=(-I"$ROOT/csrc/include" -I"$CUDA_HOME/include")
DEFS=(-DXMIX_WITH_CUDA=1 -DNDEBUG)
pids=()
for f in csrc/kernels/ops.cu csrc/graph/applier.cu; do
  "$NVCC" -O3 -std=c++17 -gencode "arch=compute_$ARCH,code=sm_$ARCH" --expt-relaxed-constexpr -lineinfo \
    -Xcompiler -fPIC "${INC[@]}" "${DEFS[@]}" -c "$f" -o "$OUT/obj/$(basename "$f").o" \
    >"$OUT/obj/$(basename "$f").log" 2>&1 &
  pids+=($!)
done
for f in csrc/kernels/ops_cpu.cpp csrc/site/interpreter_cpu.cpp csrc/site/custom_cpu.cpp \
         csrc/graph/planner.cpp csrc/bindings.cpp csrc/graph/graph_bindings.cpp; do
  "$CXX" -O2 -std=c++17 -fPIC -fvisibility=hidden "${INC[@]}" -I"$PYINC" -I"$PYBIND" "${DEFS[@]}" \
    -c "$f" -o "$OUT/obj/$(basename "$f").o" >"$OUT/obj/$(basename "$f").log" 2>&1 &
  pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
if [ $fail -ne 0 ]; then
  cat "$OUT"/obj/*.log | tail -60
  die "compilation failed"
fi
"$NVCC" -shared -cudart static -Xcompiler -fPIC "$OUT"/obj/*.o -o "$OUT/_C$EXT" -ldl -lrt -lpthread \
  >"$OUT/link.log" 2>&1 || { cat "$OUT/link.log"; die "link failed"; }
cp -r python/xmix "$OUT/pkg/xmix"
find "$OUT/pkg/xmix" -name '_C*.so' -delete
cp "$OUT/_C$EXT" "$OUT/pkg/xmix/"
export PYTHONPATH="$OUT/pkg:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
# An editable install of xmix (pip install -e) puts its own finder first on sys.meta_path:
# check the staged module without it, then say which one the tests will import.
"$PY" - "$OUT/pkg" <<'EOF' || die "the built module does not import"
import sys
sys.meta_path = [f for f in sys.meta_path if "Scikit" not in type(f).__name__]
import xmix._C as C
assert C.__file__.startswith(sys.argv[1]), C.__file__
print("built:", C.__file__, "|", C.cuda_status())
EOF
"$PY" -c "import xmix._C as C; print('the tests import xmix._C from', C.__file__)"
log "built"

HAVE_GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

# ------------------------------------------------------------------ 2. gpu tests
status=0
if [ "$HAVE_GPU" != "1" ]; then
  log "no GPU: skipping the gpu pytest tests"
elif ! "$PY" -c "import pytest" 2>/dev/null; then
  log "pytest is not installed: the gpu pytest tests cannot run (continuing with gpu_check.py)"
  status=1
else
  log "pytest -m gpu: tests/test_kernels.py tests/test_graphs.py"
  (cd "$ROOT" && "$PY" -m pytest -q -m gpu -p no:cacheprovider --rootdir "$ROOT" \
     tests/test_kernels.py tests/test_graphs.py) || status=1
fi

# ------------------------------------------------------------------ 3. decoder check + timings
log "bench/gpu_check.py ${GPU_CHECK_ARGS:-}"
# shellcheck disable=SC2086
"$PY" "$ROOT/bench/gpu_check.py" ${GPU_CHECK_ARGS:-} || status=1

if [ "$HAVE_GPU" != "1" ]; then
  log "no GPU: stopped before the gpu pytest tests and the CUDA graph capture (build and CPU part ok)"
  exit $status
fi
log "done, status $status"
exit $status
