"""The hosts of tests/netns_hosts.py, without an engine: three namespaces reach each other's
addresses and nothing else, each process started on one has its own hostname and /dev/shm,
a cut link drops the host's traffic until it is restored, and nothing is left once they are
removed (nor after a run killed before removing them). Skips, saying why, where namespaces
cannot be made."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns_hosts

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000)); s.listen(8)
while True:
    c, _ = s.accept(); c.sendall(socket.gethostname().encode()); c.close()
"""

CLIENT = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
    print(c.recv(100).decode())
except OSError as e:
    print("failed:", type(e).__name__)
"""


@pytest.fixture(scope="module")
def reason():
    why = netns_hosts.reason()
    if why is not None:
        pytest.skip(f"cannot make hosts of our own on this machine: {why}")


def _ask(hosts, i: int, addr: str, timeout: float = 3.0) -> str:
    return hosts.run(i, [sys.executable, "-c", CLIENT, addr, str(timeout)]).stdout.strip()


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split(" ", 1)[0] for line in out.splitlines()}


def test_three_hosts_reach_each_other_and_nothing_else(reason, tmp_path):
    hosts = netns_hosts.Hosts(3)
    try:
        hosts.up()
        assert len(set(hosts.addrs + [hosts.client])) == 4
        for i in range(3):
            routes = hosts.run(i, ["ip", "-4", "route", "show", "table", "all"]).stdout
            v4 = [
                r.strip()
                for r in routes.splitlines()
                if r.strip() and not r.startswith(("local", "broadcast"))
            ]
            assert v4 == [f"{hosts.net} dev eth0 proto kernel scope link src {hosts.addrs[i]}"]
        servers = [
            hosts.popen(i, [sys.executable, "-c", SERVER, hosts.addrs[i]], tmp_path / f"s{i}.log")
            for i in range(3)
        ]
        time.sleep(2.0)
        names = {}
        for i in range(3):
            for j in range(3):
                names[(i, j)] = _ask(hosts, i, hosts.addrs[j])
        assert {names[(0, j)] for j in range(3)} == {f"{hosts.tag}-h{j}" for j in range(3)}
        assert all(names[(i, j)] == names[(0, j)] for i in range(3) for j in range(3))
        # this process reaches them too (the client's veth)
        import socket

        with socket.create_connection((hosts.addrs[2], 7000), timeout=3) as c:
            assert c.recv(100).decode() == f"{hosts.tag}-h2"
        # a process on a host has its own /dev/shm
        marker = f"xmix-netns-test-{hosts.tag}"
        p = hosts.popen(
            1, ["sh", "-c", f"touch /dev/shm/{marker} && ls /dev/shm"], tmp_path / "shm.log"
        )
        p.wait(timeout=30)
        assert (tmp_path / "shm.log").read_text().split() == [marker]
        assert not Path(f"/dev/shm/{marker}").exists()
        # a cut link drops host 2's traffic; restored, it flows again
        hosts.cut(2)
        assert _ask(hosts, 0, hosts.addrs[2], timeout=1.5).startswith("failed")
        assert _ask(hosts, 0, hosts.addrs[1]) == f"{hosts.tag}-h1"
        hosts.restore(2)
        time.sleep(0.5)
        assert _ask(hosts, 0, hosts.addrs[2]) == f"{hosts.tag}-h2"
    finally:
        hosts.down()
    assert not (_namespaces() & {hosts.switch, *hosts.names})
    assert all(p.poll() is not None for p in servers)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert hosts.client_if not in links


def test_hosts_left_by_a_killed_run_are_swept(reason):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer exists: a run killed before its down()
    left = netns_hosts.Hosts(1, tag=f"xm{dead.pid}")
    left.up()
    try:
        assert set(left.names) <= _namespaces()
        gone = netns_hosts.sweep()
        assert {left.switch, *left.names, left.client_if} <= set(gone)
        assert not (_namespaces() & {left.switch, *left.names})
    finally:
        left.down()
