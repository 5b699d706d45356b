"""The errors of deploying an app (lowering it against a model) and of a request's xmix
controls."""

from __future__ import annotations

from xmix.lang.api import AppError


class DeployError(AppError):
    """An app that does not fit the model it is deployed on."""


class RequestError(ValueError):
    """A per-request xmix control that cannot be honoured (unknown app or parameter, bad value);
    the message says why. One class for the engine and the transformers path."""


def fail(app: str, what: str, msg: str) -> DeployError:
    return DeployError(f"app {app!r}, {what}: {msg}")
