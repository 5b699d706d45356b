#!/usr/bin/env bash
# Fails (and lists them) when a built module leaves xmix:: symbols undefined: a source that
# a CMake target misses still links with -shared, and only `import` would fail, on the device.
# Usage: bench/check_symbols.sh MODULE.so
set -euo pipefail
so=${1:?usage: check_symbols.sh MODULE.so}
command -v nm >/dev/null 2>&1 || { echo "check_symbols: nm not found (binutils)" >&2; exit 2; }
bad=$(nm -DC --undefined-only "$so" | grep 'xmix::' || true)
if [ -n "$bad" ]; then
  echo "check_symbols: undefined xmix:: symbols in $so:" >&2
  echo "$bad" >&2
  exit 1
fi
echo "check_symbols: no undefined xmix:: symbol in $so"
