"""What the deploy path did in this process: app files parsed (``App.from_bytes``), apps
lowered (``lowering.lower``) and lowered programs decoded (``program_codec.decode``).

A deploy is parsed and lowered once, in the API server that received it; every engine and
every other API server decodes the lowered program (docs/architecture.md, "Deploy path").
The counts make that visible: the worker's status (``stats.deploy_work``) and the API
server's (``server.deploy_work`` of ``/xmix/v1/status``) report them, and
tests/server/test_scale_out.py holds a deploy to one parse and one lowering in all.
"""

from __future__ import annotations

COUNTS: dict[str, int] = {"app_parses": 0, "lowerings": 0, "program_decodes": 0}


def count(what: str) -> None:
    COUNTS[what] += 1


def snapshot() -> dict[str, int]:
    return dict(COUNTS)
