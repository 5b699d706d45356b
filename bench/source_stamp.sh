#!/usr/bin/env bash
# Prints a hash of everything xmix._C and the GoogleTest binaries are built from, so a module
# built elsewhere (bench/build_device_module.sh) is used only for the sources it was built
# from. Run from anywhere; needs sha256sum.
set -euo pipefail
cd "$(dirname "$0")/.."
find CMakeLists.txt csrc tests/cpp -type f \( -name '*.txt' -o -name '*.h' -o -name '*.cpp' -o -name '*.cu' \) \
  | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16
