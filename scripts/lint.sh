#!/usr/bin/env bash
# Lint, format and type checks (configured in pyproject.toml and .clang-format; the tools are
# pinned in the test extra that scripts/setup.sh installs).
#   scripts/lint.sh         check: ruff check, ruff format --check, mypy, clang-format on csrc/;
#                           exits non-zero on any finding
#   scripts/lint.sh --fix   apply what the tools fix themselves (ruff check --fix, ruff format,
#                           clang-format -i), then check again
set -uo pipefail
cd "$(dirname "$0")/.."

FIX=0
case "${1:-}" in
  "") ;;
  --fix) FIX=1 ;;
  *) echo "usage: scripts/lint.sh [--fix]" >&2; exit 2 ;;
esac

BIN=${XMIX_LINT_BIN:-.venv/bin}
for t in ruff mypy clang-format; do
  if [ ! -x "$BIN/$t" ]; then
    echo "[lint] $BIN/$t is missing: run scripts/setup.sh (it installs the pinned tools)" >&2
    exit 2
  fi
done

# csrc/ is the project's own C++/CUDA; build outputs never live there.
mapfile -t CSRC < <(find csrc -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) | sort)

if [ "$FIX" = 1 ]; then
  "$BIN/ruff" check --fix --quiet . || true  # what it cannot fix is reported by the check below
  "$BIN/ruff" format --quiet .
  "$BIN/clang-format" -i --style=file "${CSRC[@]}"
fi

FAILED=()
step() {  # step NAME CMD...: run, keep going, remember a failure
  local name=$1; shift
  echo "== lint: $name =="
  if "$@"; then echo "$name: ok"; else FAILED+=("$name"); fi
}
step "ruff check" "$BIN/ruff" check .
step "ruff format" "$BIN/ruff" format --check .
step "mypy" "$BIN/mypy"
step "clang-format" "$BIN/clang-format" --dry-run -Werror --style=file "${CSRC[@]}"

if [ ${#FAILED[@]} -eq 0 ]; then
  echo "lint: all checks passed (ruff check, ruff format, mypy, clang-format)"
  exit 0
fi
echo "lint: FAILED: ${FAILED[*]}$([ "$FIX" = 0 ] && echo " (scripts/lint.sh --fix applies the mechanical fixes)")"
exit 1
