"""Hosts of our own on this machine: Linux network namespaces joined by veth pairs.

Each host is a network namespace with one interface (``eth0``) and one address on a private
/24, its own loopback, and, for every process started in it, its own hostname and its own
``/dev/shm`` (a UTS and a mount namespace: vLLM decides "same node" by opening a shared-memory
segment, ``in_the_same_node_as``, and a shared ``/dev/shm`` would let two "hosts" pass that
test). The hosts' veths meet on a bridge in a switch namespace of their own; one more veth
gives the namespace this process runs in (the test client) an address on the same /24, the
only route it gets there. No namespace has a default route: a process on a host can reach the
other hosts' addresses and nothing else, and the client reaches only those addresses.

Cutting a host's link (``cut``) sets its port on the bridge down: the host keeps its address
and route and its packets are dropped on the way, as with a pulled cable (TCP retransmits);
``restore`` sets it up again.

Everything made here carries one tag (``xm<pid>``): ``down()`` ends every process started on
a host (its process group, then any pid still in the namespace), deletes the namespaces and
the client's veth, and is safe to call twice or after a failed ``up()``. A run killed before
its ``down()`` leaves its hosts behind; ``up()`` first removes those of processes that no
longer exist (``sweep``). The fixture in
tests/server/test_multi_node.py and ``scripts/netns_hosts.py`` use this module.

Needs root, iproute2 (``ip netns``, veth, bridge) and util-linux's ``unshare``; ``reason()``
says why not where they are missing (the tests skip with it).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

SHM_SIZE = "4g"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def reason() -> str | None:
    """Why hosts cannot be made on this machine, or None when they can (checked by making
    and deleting one namespace)."""
    if not Path("/proc/self/ns/net").exists():
        return "no Linux network namespaces here (/proc/self/ns/net is missing)"
    if os.geteuid() != 0:
        return f"network namespaces need root (ip netns add); this runs as uid {os.geteuid()}"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (iproute2 / util-linux)"
    probe = f"xmprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"'ip netns add' fails here: {(r.stderr or r.stdout).strip()}"
    try:
        r = _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1", check=False)
        if r.returncode != 0:
            return f"veth pairs cannot be made here: {(r.stderr or r.stdout).strip()}"
        r = _ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"bridges cannot be made here: {(r.stderr or r.stdout).strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    r = subprocess.run(
        ["unshare", "--uts", "--mount", "true"], capture_output=True, text=True, timeout=30
    )
    if r.returncode != 0:
        return f"'unshare --uts --mount' fails here: {(r.stderr or r.stdout).strip()}"
    return None


def _taken_subnets() -> set[ipaddress.IPv4Network]:
    out = _ip("-4", "route", "show", "table", "all", check=False).stdout
    nets = set()
    for line in out.splitlines():
        word = line.split(" ", 1)[0]
        with contextlib.suppress(ValueError):
            if "/" in word:
                nets.add(ipaddress.ip_network(word, strict=False))
    return nets


def _pick_subnet() -> ipaddress.IPv4Network:
    """A /24 under 10.231.0.0/16 that no route of this machine overlaps."""
    taken = _taken_subnets()
    rng = random.Random(os.getpid() ^ int(time.time()))
    for _ in range(256):
        net = ipaddress.ip_network(f"10.231.{rng.randrange(1, 255)}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("no free /24 under 10.231.0.0/16 for the test hosts")


_TAGGED = re.compile(r"^xm(\d+)(?:-sw|-h\d+|c)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Remove the namespaces and client veths a killed run of this module left behind (their
    tag's pid is gone), with every process still in them. Returns what it removed."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split(" ", 1)[0]
        m = _TAGGED.match(ns)
        if m and not _alive(int(m.group(1))):
            for pid in Hosts.pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
            gone.append(ns)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0] if ":" in line else ""
        m = _TAGGED.match(name)
        if m and name.endswith("c") and not _alive(int(m.group(1))):
            _ip("link", "del", name, check=False)
            gone.append(name)
    return gone


class Hosts:
    """``n`` hosts: ``addrs[i]`` is host i's address, ``client`` the address of this process
    on their network."""

    def __init__(self, n: int, tag: str | None = None):
        if not 1 <= n <= 8:
            raise ValueError("between 1 and 8 hosts")
        self.n = n
        self.tag = tag or f"xm{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-h{i}" for i in range(n)]
        self.client_if = f"{self.tag}c"[:15]
        self.net: ipaddress.IPv4Network | None = None
        self.addrs: list[str] = []
        self.client = ""
        self.procs: list[tuple[int, subprocess.Popen]] = []
        self._made: list[str] = []  # namespaces made, for down()

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> Hosts:
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        sweep()
        self.net = _pick_subnet()
        hosts = list(self.net.hosts())
        self.addrs = [str(hosts[i]) for i in range(self.n)]
        self.client = str(hosts[-1])
        plen = str(self.net.prefixlen)
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip(*f"-n {ns} link add eth0 type veth peer name p{i} netns {self.switch}".split())
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/{plen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        _ip(*f"link add {self.client_if} type veth peer name pc netns {self.switch}".split())
        _ip("-n", self.switch, "link", "set", "pc", "master", "br0")
        _ip("-n", self.switch, "link", "set", "pc", "up")
        _ip("addr", "add", f"{self.client}/{plen}", "dev", self.client_if)
        _ip("link", "set", self.client_if, "up")

    def down(self) -> None:
        """End every process started on the hosts, then delete what up() made."""
        for _, p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 30
        for _, p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(deadline - time.time(), 0.1))
        for _, p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        # anything still in a namespace (a process that left its group) is ours too
        for ns in self._made:
            for pid in self.pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        _ip("link", "del", self.client_if, check=False)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made = []
        self.procs = []

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    @staticmethod
    def pids(ns: str) -> list[int]:
        out = _ip("netns", "pids", ns, check=False).stdout
        return [int(x) for x in out.split() if x.isdigit()]

    # ------------------------------------------------------------------ processes
    def env(self, i: int, **extra: str) -> dict[str, str]:
        """The environment a vLLM process on host i needs: its own address for vLLM's
        sockets (``VLLM_HOST_IP``; vLLM's fallback asks the routing table for a route to
        8.8.8.8, which no host has), the interface gloo binds (``GLOO_SOCKET_IFNAME``; by
        default gloo resolves the hostname, which is the host's own and in no hosts file),
        and nothing that would make a process look for the internet."""
        env = {
            **os.environ,
            "VLLM_HOST_IP": self.addrs[i],
            "GLOO_SOCKET_IFNAME": "eth0",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            env.pop(k, None)
        env.update(extra)
        return env

    def popen(self, i: int, argv: list[str], log: Path, **env: str) -> subprocess.Popen:
        """``argv`` on host i in a session of its own (stopped with its process group by
        ``stop`` or ``down``), stdout and stderr to ``log``."""
        wrapped = [
            "ip",
            "netns",
            "exec",
            self.names[i],
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'mount -t tmpfs -o size={SHM_SIZE} xmix-shm /dev/shm && hostname "$0" && exec "$@"',
            f"{self.tag}-h{i}",
            *argv,
        ]
        with open(log, "ab") as out:
            p = subprocess.Popen(
                wrapped,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env(i, **env),
            )
        self.procs.append((i, p))
        return p

    def run(self, i: int, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """A short command on host i (no private /dev/shm or hostname), its output."""
        return subprocess.run(
            ["ip", "netns", "exec", self.names[i], *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(i),
        )

    def stop(self, p: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal a process started by ``popen`` (its whole group) and wait for it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            return p.wait(timeout=30)

    # ------------------------------------------------------------------ the link
    def cut(self, i: int) -> None:
        """Host i's link to the others goes down (its port on the bridge)."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{i}", "up")


def main(argv: list[str] | None = None) -> int:
    """``scripts/netns_hosts.py``: make hosts, print them, keep them until Enter or a signal."""
    import argparse

    ap = argparse.ArgumentParser(
        description="Hosts of our own (network namespaces joined by veth pairs) for trying "
        "multi-node vLLM on one machine. Prints how to run a command on each; removes "
        "everything on Enter, Ctrl-C or SIGTERM."
    )
    ap.add_argument("-n", "--hosts", type=int, default=2, help="how many hosts (default 2)")
    args = ap.parse_args(argv)
    why = reason()
    if why is not None:
        print(f"cannot make hosts here: {why}")
        return 2
    hosts = Hosts(args.hosts)

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with hosts:
        print(f"client (this namespace): {hosts.client} on {hosts.client_if}")
        for i, (ns, a) in enumerate(zip(hosts.names, hosts.addrs)):
            print(f"host {i}: {a}  namespace {ns}  run: ip netns exec {ns} COMMAND")
            print(f"        env: VLLM_HOST_IP={a} GLOO_SOCKET_IFNAME=eth0")
        print(f"cut host i's link: ip -n {hosts.switch} link set p<i> down (up to restore)")
        with contextlib.suppress(KeyboardInterrupt, EOFError):
            input("Enter removes the hosts ... ")
    print("removed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
