"""bench/step_host.py at tiny sizes: every configuration runs its per-step path hot and cold
and prints a row; the probe's step drains its reads (one value per request). No timing is
asserted (the benchmark is run as `python bench/step_host.py`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_step_host_prints_every_configuration_hot_and_cold():
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_host.py"), "--d", "64", "--layers", "2"]
        + ["--steps", "3", "--evict-mib", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [l for l in r.stdout.splitlines() if l.startswith("| ") and "---" not in l][1:]
    got = [tuple(c.strip() for c in l.strip("|").split("|")[:2]) for l in rows]
    assert got == [
        (c, t)
        for c in ("none", "unused", "steer", "ablate", "probe", "monitor")
        for t in ("hot", "cold")
    ]
    for l in rows:
        nums = [float(x) for x in re.findall(r"\d+\.\d", l)]
        assert len(nums) == 4 and nums[3] > 0, l


def test_step_host_refuses_unknown_configurations():
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_host.py"), "--configs", "steer,nope"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "unknown configuration(s) ['nope']" in r.stderr
