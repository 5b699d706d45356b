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


def test_the_instruction_count_child_runs_every_stretch():
    """--instructions runs this child under callgrind (minutes: torch imports under valgrind,
    so the benchmark, not the tests, runs valgrind): here it runs plain, each configuration
    with both site kernels between the client requests (no-ops outside valgrind)."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_host.py"), "--instructions-child"]
        + ["--configs", "unused,steer", "--d", "64", "--layers", "2", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]


def test_part_costs_reads_callgrinds_labelled_dumps():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import step_host
    finally:
        sys.path.pop(0)
    head = "# callgrind format\nversion: 1\ncreator: callgrind-3.19.0\npid: 7\ncmd: python\npart: {n}\n"
    parts = [
        head.format(n=1)
        + "desc: Trigger: Client Request: steer/native\nevents: Ir\nsummary: 3345678\ntotals: 3345678\n",
        head.format(n=2)
        + "desc: Trigger: Client Request: steer/python\nevents: Ir\nsummary: 9000000\ntotals: 9000000\n",
        head.format(n=0) + "desc: Trigger: Program termination\nevents: Ir\nsummary: 0\n",
    ]
    assert step_host.part_costs(parts) == {
        ("steer", "native"): 3_345_678,
        ("steer", "python"): 9_000_000,
    }
