"""What a control change or a request's control can end with, as the clients and the server
see it: the errors of the control plane (the engine gone or out of reach, the state directory
not written, a worker's refusal, a full engine), the validation error of a bad per-request
control, and ``answered``, which turns the workers' replies to xmix's RPCs into results or a
WorkerError."""

from __future__ import annotations

import reprlib
from typing import Any

from xmix.lang.lowering import DeployError

_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother, _short.maxlist, _short.maxdict = 2, 60, 60, 6, 6


def shown(v: Any) -> str:
    """A bounded repr of something a client sent (never recursing into deep nesting)."""
    return _short.repr(v)


_ERROR_CLASS = None


def _validation_error(msg: str, value: Any = None) -> Exception:
    """A bad per-request control: vLLM's validation error (HTTP 400 on the server), and a
    ValueError for offline callers."""
    global _ERROR_CLASS
    if _ERROR_CLASS is None:
        try:
            from vllm.exceptions import VLLMValidationError

            class XmixValidationError(VLLMValidationError, ValueError):
                pass
        except ImportError:  # pragma: no cover - older vLLM

            class XmixValidationError(ValueError):  # type: ignore[no-redef]
                def __init__(self, message, parameter=None, value=None):
                    super().__init__(message)

        _ERROR_CLASS = XmixValidationError
    return _ERROR_CLASS(
        f"xmix: {msg}", parameter="vllm_xargs.xmix", value=None if value is None else shown(value)
    )


class EngineGone(RuntimeError):
    """The engine stopped (a shutdown, or it died) while a control change waited for it."""


class EngineUnreachable(EngineGone):
    """An engine did not answer a control RPC in time (``XMIX_RPC_TIMEOUT_S``): its host
    unreachable, or the engine dead without vLLM noticing (a killed remote data-parallel
    engine leaves the others serving and its requests waiting). Messages to an engine are
    delivered in order, so what the change sends after it (its rollback) reaches that engine
    after the change itself, if it ever answers again."""


class NotSaved(EngineGone):
    """A change refused because the state directory could not record it (state_dir.py): it
    is written before any engine applies it, so nothing changed. Answered as a change the
    server could not complete (HTTP 503)."""


class WorkerError(RuntimeError):
    """An xmix worker method failed on a worker; the message is the worker's own
    (``"<Type>: <message>"``, worker.py ``xmix_call``)."""


def answered(rpc):
    """``rpc`` (run a worker method on every worker, return their replies) through the
    workers' ``xmix_call``: each worker answers ``("ok", result)`` or ``("error", message)``
    and never raises inside vLLM's collective RPC (why: worker.py ``xmix_call``). Returns the
    results, or raises WorkerError with the first failure once every reply is read."""

    def call(method: str, args: tuple) -> list:
        out, failed = [], None
        for r in rpc("xmix_call", (method, tuple(args))):
            if not (isinstance(r, (list, tuple)) and len(r) == 2 and r[0] in ("ok", "error")):
                raise WorkerError(f"{method}: a worker sent {type(r).__name__}, not an answer")
            if r[0] == "error" and failed is None:
                failed = str(r[1])
            out.append(r[1])
        if failed is not None:
            raise WorkerError(failed)
        return out

    return call


class CapacityError(DeployError):
    """A deploy that would fit the engine but finds it full of other apps (its control
    block, or the server's limits): HTTP 507 on the server. The message names the limit."""
