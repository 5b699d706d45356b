#!/usr/bin/env bash
# The main job: serve the embedded tiny model with demo apps and show their effect.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m xmix.demo "$@"
