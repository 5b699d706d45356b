"""What the endpoint plugin keeps on ``app.state.xmix``: the control-plane Controller, the
keys, the audit log and the lock that serialises changes on this API server."""

from __future__ import annotations

import asyncio

from xmix.integrations.vllm import tenants
from xmix.integrations.vllm.frontend.controller import Controller


class ServerState:
    def __init__(self, ctl: Controller, auth: tenants.Auth, gone=None):
        self.ctl = ctl
        self.auth = auth
        self.audit = tenants.Audit()
        self.lock = asyncio.Lock()  # one control change at a time
        self.gone = gone or (lambda: False)  # whether the engine has stopped
        self.status = ctl.status  # the server's: every engine that answers, the others named

    @property
    def keyed(self) -> bool:
        return self.auth.keyed

    def authorized(self, header: str | None) -> bool:
        """Whether this caller may generate (use apps in its requests)."""
        return self.auth.may_generate(tenants.bearer(header))
