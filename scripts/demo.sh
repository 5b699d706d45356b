#!/usr/bin/env bash
# The main job: serve the embedded tiny model with demo apps and show their effect.
#   scripts/demo.sh          run the demo, then stop the server
#   scripts/demo.sh --keep   leave the server up afterwards to open the console (URL printed)
#   scripts/demo.sh --stop   stop a server that --keep left up
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--stop" ] && [ -x .venv/bin/python ]; then
  exec .venv/bin/python -m xmix.demo --stop
fi
scripts/setup.sh
exec .venv/bin/python -m xmix.demo "$@"
