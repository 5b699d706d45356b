"""Control RPCs from an API server to every engine: ``fan_out`` on the server's event loop,
with a deadline per engine, and the blocking calls the control plane makes from a worker
thread (``blocking_rpc``, ``blocking_status``)."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable

from xmix import settings
from xmix.integrations.vllm.errors import EngineGone, EngineUnreachable

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply


def rpc_timeout() -> float:
    """How long a control RPC waits for each engine (``XMIX_RPC_TIMEOUT_S``, default 30 s).
    vLLM does not notice an engine on another host that died or cannot be reached: its
    requests wait, and so would a change; past this the change fails, naming the engine."""
    return float(settings.get("XMIX_RPC_TIMEOUT_S"))


# An engine that already missed a deadline is waited for this long at most, until it answers
# again: its messages still queue in order, so a rollback sent after a change reaches it after
# the change, and a change does not wait the full timeout once per RPC.
SLOW_RPC_S = 2.0
_SLOW: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine client -> {index}

# The ledger's truth is on the first engine (ledger.py): its reads go there alone, so a server
# follows the ledger while another engine's host is out of reach, and its writes go to every
# engine (each keeps a copy, in order) but wait for the first only.
LEDGER_READS = ("since", "lagging")


class _Late:
    def __init__(self, index: int, limit: float):
        self.index, self.limit = index, limit


def _ledger_op(method: str, args: tuple) -> str | None:
    if method == "xmix_call" and args and args[0] == "xmix_ledger":
        inner = args[1] if len(args) > 1 else ()
        return str(inner[0]) if inner else ""
    return None


def _late_message(late: list[_Late], method: str, args: tuple) -> str:
    what = args[0] if method == "xmix_call" and args else method
    ranks = ", ".join(str(x.index) for x in late)
    limit = max(x.limit for x in late)
    return (
        f"the engine{'s' if len(late) > 1 else ''} of data-parallel rank{'s' if len(late) > 1 else ''} "
        f"{ranks} did not answer {what} within {limit:g} s (XMIX_RPC_TIMEOUT_S): its host may be "
        "unreachable or the engine dead (vLLM keeps the other engines serving and does not "
        "notice it)"
    )


async def fan_out(engine_client, method: str, args: tuple, late_ok: bool = False) -> list:
    """A worker method on every worker of every engine, one result per worker.

    vLLM's ``AsyncLLM.collective_rpc`` is ``call_utility_async("collective_rpc", ...)``: with
    data parallelism and vLLM's load balancer (``DPLBAsyncMPClient``) it runs on every engine
    but returns only the first engine's results, and without it (``DPAsyncMPClient``,
    external load balancing) it reaches only the first engine the client manages
    (``v1/engine/core_client.py``). Here the call goes to every engine the client manages
    (``core_engines``, one utility call each, as ``call_utility_all_async`` does) and returns
    each one's workers' answers in engine order: a refusal on any engine raises here (so a
    deploy is rolled back on all), and answers such as "was it there" count every engine's
    workers. Each engine is waited for at most ``rpc_timeout()`` (``SLOW_RPC_S`` once it
    missed one): an engine that does not answer raises EngineUnreachable, or with
    ``late_ok`` stands in the answer as ``{"engine": rank, "error": ...}``."""
    core = getattr(engine_client, "engine_core", None)
    engines = list(getattr(core, "core_engines", None) or ())
    one = getattr(core, "_call_utility_async", None)
    if not engines or one is None:  # another client layout: every engine, one deadline
        call_all = getattr(core, "call_utility_all_async", None)
        if call_all is None:
            return await asyncio.wait_for(
                engine_client.collective_rpc(method, args=args), rpc_timeout()
            )
        per_engine = await asyncio.wait_for(
            call_all("collective_rpc", method, None, args, None), rpc_timeout()
        )
        return [r for workers in per_engine for r in workers]
    op = _ledger_op(method, args)
    if op in LEDGER_READS:
        engines = engines[:1]
    slow = _SLOW.setdefault(core, set())
    tasks = [
        asyncio.ensure_future(one("collective_rpc", method, None, args, None, engine=e))
        for e in engines
    ]

    async def answer(i: int, task):
        limit = SLOW_RPC_S if i in slow else rpc_timeout()
        try:
            got = await asyncio.wait_for(task, limit)
        except (asyncio.TimeoutError, TimeoutError):
            slow.add(i)
            return _Late(i, limit)
        slow.discard(i)
        return got

    if op is not None:  # a ledger write: the first engine's answer decides
        for i, t in enumerate(tasks[1:], 1):
            t.add_done_callback(lambda t, i=i: _replica_answered(t, i, op))
        tasks = tasks[:1]
    got = await asyncio.gather(*(answer(i, t) for i, t in enumerate(tasks)), return_exceptions=True)
    late = [g for g in got if isinstance(g, _Late)]
    for g in got:
        if isinstance(g, BaseException):
            raise g
    if late and not late_ok:
        raise EngineUnreachable(_late_message(late, method, args))
    out: list = []
    for g in got:
        if isinstance(g, _Late):
            out.append({"engine": g.index, "error": _late_message([g], method, args)})
        elif not isinstance(g, BaseException):  # every exception was raised above
            out.extend(g)
    return out


def _replica_answered(task, index: int, op: str) -> None:
    """A ledger write on an engine other than the first: its copy follows in order; a
    failure is logged (nothing reads that copy but the status)."""
    if task.cancelled():
        return
    e = task.exception()
    if e is None:
        bad = [r for r in task.result() if isinstance(r, (list, tuple)) and r and r[0] == "error"]
        if bad:
            logger.warning(
                "xmix: the ledger copy on engine %d refused %s: %s", index, op, bad[0][1]
            )
        return
    logger.warning("xmix: the ledger copy on engine %d did not take %s: %s", index, op, e)


_AFTER_LATE = {
    "deploy": "nothing was deployed: the app was taken back off every engine that answered, "
    "and the engine that did not drops it when it answers (its messages arrive in order)",
    "patch": "the previous mode and parameters were set back on every engine that answered, "
    "and reach the engine that did not after the change, when it answers",
    "undeploy": "the app is off every engine that answered and recorded as undeployed; the "
    "engine that did not takes it off when it answers",
}


def after_late(e: Exception, kind: str) -> str:
    """What a change that an engine did not answer left behind (controller.Controller)."""
    return f"; {_AFTER_LATE[kind]}" if isinstance(e, EngineUnreachable) else ""


def engine_gone(engine_client, loop) -> Callable[[], bool]:
    """Whether the engine has stopped (the server's loop closed, or vLLM marked it errored)."""

    def gone() -> bool:
        return loop.is_closed() or bool(getattr(engine_client, "errored", False))

    return gone


def blocking_rpc(engine_client, loop, gone: Callable[[], bool]) -> Callable[[str, tuple], list]:
    """The Controller's RPC: ``fan_out`` on ``loop``, called from a worker thread."""

    def rpc(method: str, rpc_args: tuple):
        # Runs in a worker thread (changes go through asyncio.to_thread). It waits for
        # the engine in short slices, so a change racing a shutdown ends as EngineGone
        # (HTTP 503) instead of holding the thread, and the interpreter's exit, forever.
        if gone():
            raise EngineGone("the engine has stopped (the server is shutting down)")
        if _on_loop(loop):
            # the future below would wait for the loop this call is blocking: a freeze
            # of every request, so a bug in a caller fails its own request instead
            raise RuntimeError(
                f"xmix: control RPC {method} called on the server's event loop; "
                "run it in a thread (asyncio.to_thread)"
            )
        fut = asyncio.run_coroutine_threadsafe(fan_out(engine_client, method, rpc_args), loop)
        while True:
            try:
                return fut.result(timeout=0.5)
            except TimeoutError:
                if gone():
                    fut.cancel()
                    raise EngineGone(
                        "the engine stopped while the change waited for it "
                        "(the server is shutting down)"
                    ) from None
            except Exception as e:
                if gone() or type(e).__name__ == "EngineDeadError":
                    raise EngineGone(
                        "the engine stopped while the change waited for it "
                        "(the server is shutting down)"
                    ) from None
                raise

    return rpc


def blocking_status(engine_client, loop, gone: Callable[[], bool]) -> Callable[[], list[dict]]:
    """The server's status: every worker that answers in time, from a worker thread."""

    def status() -> list[dict]:
        # every worker that answers in time; an engine that does not is named instead
        # of failing the whole status (an operator looks here to find it)
        if gone():
            raise EngineGone("the engine has stopped (the server is shutting down)")
        fut = asyncio.run_coroutine_threadsafe(
            fan_out(engine_client, "xmix_call", ("xmix_describe", ()), late_ok=True), loop
        )
        out = []
        for r in fut.result(timeout=rpc_timeout() + 30):
            if isinstance(r, (list, tuple)) and len(r) == 2 and r[0] in ("ok", "error"):
                out.append(r[1] if r[0] == "ok" else {"error": str(r[1])})
            else:
                out.append(r)
        return out

    return status


def _on_loop(loop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs in this thread
        return False
