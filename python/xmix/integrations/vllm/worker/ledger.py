"""The engine side's record of control changes: the source of truth that every API server's
registry follows (several API servers, ``--api-server-count N``; data-parallel engines).

vLLM runs each API server in its own process with its own engine client
(``vllm/entrypoints/cli/serve.py: run_multi_api_server``), so a registry kept in API-server
memory is one per server. The engines are the only state every server reaches, and they
already hold the deployed apps: each worker keeps, next to its control block, this ordered
ledger of the changes made through any server (deploy with the app's lowered program, patch,
undeploy) and a lease that serialises changes across servers. A server reads the ledger from
the first worker of the first engine (``results[0]`` of a fan-out), so there is one order even
when engines see two servers' RPCs in different orders; every worker appends the same entries
so a ledger survives the loss of none of them in particular.

Memory: a deploy entry keeps the app's lowered program (lang/program_codec.py) until the app is
undeployed (then only its name stays), i.e. what the control block holds anyway, once more.

With a state directory (state_dir.py) the worker that holds the ledger everyone reads also
writes the changes to disk: ``save`` before the engines apply a change, under the same lease,
so there is one writer whatever the number of API servers and engines; ``state`` hands a
restarting server what the directory held (restore.py).

Acknowledgements: every ``since`` read is an API server saying "I have applied everything up to
``since``" (servers read in order and apply what they read before the next read). A change
returns only once every other server heard from in the last ``LIVE_S`` has said so for its
revision (``lagging``; controller.Controller._await_followers), and a server that has not read
for longer syncs before it admits a request (registry.Registry.stale): so a client that got a
change's answer never has a later request admitted against the state before it, through any
server.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xmix.integrations.vllm.state_dir import StateDir

LEASE_S = 60.0  # a server that died holding the lease blocks others at most this long
LIVE_S = 5.0  # a server not heard from for this long is not waited for (it syncs first)


class Ledger:
    def __init__(self, state: StateDir | None = None, replica: bool = False) -> None:
        # A copy on any worker but the first of the first engine: nobody reads its lease, so
        # it keeps none and takes every entry in the order it arrives (the first engine's
        # lease serialised them). Enforcing a lease here too failed appends when two API
        # servers' acquires reached the engines in different orders (seen at the start of a
        # two-server deployment across hosts, where both deploy the --app files).
        self.replica = replica
        self.entries: list[dict] = []
        self.holder: str | None = None
        self.until = 0.0
        self.state = state  # the state directory, on the one worker that writes it
        self.seen: dict[str, tuple[int, float]] = {}  # server -> (revision applied, when)

    def call(self, op: str, owner: str = "", since: int = 0, entry: dict | None = None) -> Any:
        now = time.monotonic()
        if self.holder is not None and now > self.until:
            self.holder = None  # the holder died or hung: its lease lapses
        if self.replica and op in ("acquire", "release"):
            return True
        if op == "acquire":
            if self.holder in (None, owner):
                self.holder, self.until = owner, now + LEASE_S
                return True
            return False
        if op == "release":
            if self.holder == owner:
                self.holder = None
            return True
        if op in ("append", "save") and self.holder != owner and not self.replica:
            raise RuntimeError(
                f"xmix ledger: {op} by {owner!r} without the lease (held by {self.holder!r})"
            )
        if op == "save":  # before the engines apply the change (controller.Controller._save)
            return self.state.save(dict(entry or {})) if self.state is not None else None
        if op == "state":
            return self.state.plan() if self.state is not None else None
        if op == "append":
            entry = dict(entry or {})
            entry["rev"] = len(self.entries) + 1
            if entry.get("kind") == "undeploy":
                for e in self.entries:  # the program of an app that is gone is not needed
                    if e.get("kind") == "deploy" and e.get("name") == entry.get("name"):
                        e["program"] = None
            self.entries.append(entry)
            if self.state is not None:  # every engine applied it; the answer is on its way
                self.state.point(str(entry.get("kind")), "applied")
            return entry["rev"]
        if op == "since":
            self.seen[owner] = (since, now)
            return {"rev": len(self.entries), "entries": self.entries[since:]}
        if op == "lagging":  # the servers (other than owner) still to apply revision `since`
            for o in [o for o, (_, t) in self.seen.items() if now - t > LIVE_S]:
                del self.seen[o]  # gone, or stuck: it syncs before it admits (Registry.stale)
            return sorted(o for o, (rev, _) in self.seen.items() if o != owner and rev < since)
        raise ValueError(f"xmix ledger: unknown op {op!r}")

    def summary(self) -> dict:
        """What a status shows of this copy of the ledger: its revision, the lease holder and
        a digest of the entries (the same on every worker that applied the same changes)."""
        h = hashlib.sha256()
        for e in self.entries:
            h.update(
                json.dumps(
                    {k: v for k, v in e.items() if k != "program"}, sort_keys=True, default=str
                ).encode()
            )
        return {"rev": len(self.entries), "holder": self.holder, "digest": h.hexdigest()[:16]}
