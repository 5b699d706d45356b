#!/usr/bin/env python3
"""Make two or three hosts of our own on this machine (Linux network namespaces joined by veth
pairs through a bridge), print their addresses and how to run a command on each, and remove
everything on Enter, Ctrl-C or SIGTERM. For trying vLLM's multi-node modes by hand; the tests
use the same code (tests/netns_hosts.py, tests/server/test_multi_node.py). Needs root.

    sudo scripts/netns_hosts.py -n 2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from netns_hosts import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
