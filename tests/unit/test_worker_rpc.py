"""xmix's control RPCs under vLLM's multiprocess executor with more than one worker.

vLLM 0.32's ``MultiprocExecutor.collective_rpc`` (``v1/executor/multiproc_executor.py``)
broadcasts the call; every worker runs it and queues its reply, a FAILURE carrying
``str(e)`` when the method raised (``WorkerProc._execute_worker_rpc``). The caller reads the
replies in rank order and raises at the first FAILURE (``get_response``), so the replies of
the ranks after it stay queued and the next call reads them as its own. ``Executor`` below
keeps exactly that reading order with one FIFO per rank; the engine tests run the real one
(``tests/engine/test_engine_graph_tp.py``, tensor_parallel_size=2).

A deploy refused on every rank (here: a ghost app of the same name on the workers, which
the frontend takes off and deploys again) used to shift every later answer by one call: the
retry's abort read rank 1's stale refusal, and status() then returned rank 1's reply to the
commit (None) as its describe. Through ``xmix_call`` a refusal is an answer and the queues
stay in step."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace as NS

import pytest
import torch
from transformers import LlamaConfig

import xmix
from harness import SMALL
from xmix.integrations.vllm.errors import WorkerError
from xmix.integrations.vllm.frontend.controller import Controller
from xmix.integrations.vllm.worker import worker as W
from xmix.lang.lowering import DeployError
from xmix.lang.program_codec import program_of
from xmix.lang.sites import ModelShape
from xmix.runtime.control import ControlBlock

D = 64
HF = LlamaConfig(
    hidden_size=D, num_hidden_layers=2, vocab_size=32, num_attention_heads=1, intermediate_size=128
)


class Executor:
    """The reply handling of vLLM's MultiprocExecutor.collective_rpc for n workers."""

    def __init__(self, n: int):
        shape = ModelShape.from_hf_config(HF, "tiny")
        self.workers = []
        for _ in range(n):
            x = W.WorkerXmix.for_control_block(ControlBlock(shape, "cpu", SMALL))
            x.placed = set(range(10_000))  # every site placed (no model here)
            self.workers.append(NS(model_runner=NS(_xmix=x)))
        self.queues: list[deque] = [deque() for _ in range(n)]

    def collective_rpc(self, method: str, args: tuple = ()):
        for w, q in zip(self.workers, self.queues):  # WorkerProc._execute_worker_rpc
            try:
                q.append(("SUCCESS", W.WORKER_METHODS[method](w, *args)))
            except Exception as e:
                q.append(("FAILURE", str(e)))
        replies = []
        for q in self.queues:  # get_response: rank order, raise at the first failure
            status, result = q.popleft()
            if status != "SUCCESS":
                raise RuntimeError(
                    f"Worker failed with error '{result}', please check the stack trace above "
                    "for the root cause"
                )
            replies.append(result)
        return replies

    def held(self) -> list[list[tuple[str, int]]]:
        return [
            sorted((a["name"], a["version"]) for a in w.model_runner._xmix.cb.deploy.describe())
            for w in self.workers
        ]


def app(name: str, scale: float = 1.0) -> xmix.App:
    a = xmix.App(name)
    a.write("add", vector=torch.ones(D), scale=scale).layers([1]).at("residual.post")
    return a


def controller(ex: Executor) -> Controller:
    ip = NS(
        vllm_config=NS(
            model_config=NS(hf_config=HF, model="tiny"),
            parallel_config=NS(pipeline_parallel_size=1),
        ),
        tokenizer=None,
    )
    return Controller(ip, ex.collective_rpc)


def test_a_deploy_refused_on_every_rank_leaves_the_replies_in_step():
    ex = Executor(2)
    ctl = controller(ex)
    first = ctl.deploy(app("a"))
    # a ghost: both workers hold "hidden" (version 77), the frontend's registry does not
    ex.collective_rpc(
        "xmix_deploy", (program_of(app("hidden", 2.0), ctl.registry.shape), "request", 77)
    )
    info = ctl.deploy(app("hidden", 3.0))  # refused on both ranks, taken off, deployed again
    assert not any(ex.queues), "a reply was left for the next call to read"
    assert ex.held() == [sorted([("a", first["version"]), ("hidden", info["version"])])] * 2
    status = ctl.status()
    assert len(status) == 2
    for s in status:  # each rank's own describe, not another call's reply
        assert isinstance(s, dict)
        assert sorted(a["name"] for a in s["apps"]) == ["a", "hidden"]
    ctl.patch("hidden", params={"scale": 5.0})
    assert [[a["params"] for a in s["apps"] if a["name"] == "hidden"] for s in ctl.status()] == [
        [{"#0.scale": 5.0}]
    ] * 2
    assert not any(ex.queues)


def test_a_refusal_on_one_rank_is_the_callers_error_and_changes_nothing():
    ex = Executor(2)
    ctl = controller(ex)
    ctl.deploy(app("a"))
    # rank 0 alone cannot take the app (its control block is full of other apps' ops); rank
    # 1 prepared it, and its reply is read in the same call
    x0 = ex.workers[0].model_runner._xmix
    real = x0.deploy

    def full(*args, **kwargs):
        raise DeployError("not enough room in the control block: ops")

    x0.deploy = full
    with pytest.raises(DeployError, match="failed on a worker: not enough room"):
        ctl.deploy(app("b"))
    x0.deploy = real
    assert not any(ex.queues)
    assert [sorted(n for n, _ in h) for h in ex.held()] == [["a"], ["a"]]
    assert not any(w.model_runner._xmix.cb.deploy.staged for w in ex.workers)  # nothing prepared
    ctl.deploy(app("b"))
    assert [sorted(n for n, _ in h) for h in ex.held()] == [["a", "b"], ["a", "b"]]


def test_xmix_call_answers_instead_of_raising():
    w = Executor(1).workers[0]
    ok = W.xmix_call(w, "xmix_capacity", [])
    assert ok[0] == "ok" and ok[1]["max_apps"] == SMALL.max_apps
    assert W.xmix_call(w, "xmix_undeploy", ["nope"])[0] == "error"
    assert W.xmix_call(w, "no_such_method") == (
        "error",
        "RuntimeError: no xmix worker method 'no_such_method'",
    )
    assert W.xmix_call(w, "xmix_call", ["xmix_capacity", []])[0] == "error"  # no recursion
    with pytest.raises(WorkerError, match="no xmix worker method"):
        controller(Executor(2))._rpc("no_such_method", ())
