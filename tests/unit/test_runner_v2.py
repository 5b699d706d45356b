"""The model runner V2 adapter, driven with stand-ins for vLLM's V2 objects (the CPU engine
runs V1, so V2 cannot run here). It checks what the adapter derives from V2's own fields —
slots from add/finish (preempted requests re-added), per-token positions and flags from the
InputBatch, padding rows — against hand-computed values, and that a site then acts on the
right rows and the reads reach the runner's output.

V2's ``sample_tokens`` returns an ``AsyncOutput`` (``v1/worker/gpu/async_utils.py``) that the
executor resolves later, in its output thread (``get_output``); the second test drives that
path with a late-running fake device (``fake_device.FakeDevice``), two steps in flight."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import torch
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

import xmix
from fake_device import FakeDevice
from harness import SMALL
from xmix import _C
from xmix.integrations.vllm.result_keys import CARRIER
from xmix.integrations.vllm.worker.worker import WorkerXmix, patch_model_runner_v2
from xmix.lang.lowering import lower
from xmix.lang.results_codec import unpack_results
from xmix.lang.sites import ModelShape, site_id
from xmix.runtime.control import ControlBlock

D = 8
F32 = _C.constants()["DT_F32"]
SHAPE = ModelShape(n_layers=2, hidden_size=D, vocab_size=32)


def carried(out) -> dict:
    """The step's results as the worker hands them to the engine core (packed), decoded."""
    return {rid: unpack_results(apps) for rid, apps in getattr(out, CARRIER).items()}


class FakeRunnerV2:
    """Just the methods the adapter wraps, with V2's signatures (checked against
    fence.PATCHES by test_v2_stand_ins_match_the_fence_table)."""

    __xmix_stands_for__ = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"

    def __init__(self):
        self.calls = []
        self.forward = None  # what the forward queues (tests with a fake device)
        self.outputs = []  # what sample_tokens returns, in turn; NS(req_ids) when empty

    def finish_requests(self, scheduler_output):
        self.calls.append("finish")

    def add_requests(self, scheduler_output):
        self.calls.append("add")

    def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc, num_active_loras):
        return batch_req_state  # the test passes the InputBatch it wants returned

    def execute_model(
        self,
        scheduler_output,
        intermediate_tensors=None,
        dummy_run=False,
        skip_attn_for_dummy_run=False,
        is_profile=False,
        context_len=None,
        valid_dummy_state_slots=None,
        randomize_inputs=False,
    ):
        if self.forward is not None and not dummy_run:
            self.forward()
        return None

    def sample_tokens(self, grammar_output=None):
        return self.outputs.pop(0) if self.outputs else NS(req_ids=["a", "b"])


def test_v2_stand_ins_match_the_fence_table():
    """The stand-in has exactly the parameters the fence expects of vLLM's runner V2, and
    every V2 method the fence wraps exists on it: neither can drift silently."""
    from xmix.integrations.vllm import fence

    target = FakeRunnerV2.__xmix_stands_for__
    wrapped = [p for p in fence.PATCHES if p.target == target and p.method != "load_model"]
    assert wrapped, "the fence table has no runner V2 entries"
    for p in wrapped:
        orig = fence.original(FakeRunnerV2, p.method)
        assert orig is not None, f"stand-in lacks {p.method}"
        assert fence.params_of(orig) == p.params, p.method


def _worker(apps, queue=None) -> WorkerXmix:
    cb = ControlBlock(SHAPE, "cpu", SMALL, queue=queue)
    for a in apps:
        cb.install(lower(a, SHAPE))
    return WorkerXmix.for_control_block(cb, rank0=True)


def _new_req(rid, prompt_len, apps):
    return NS(
        req_id=rid,
        prompt_len=prompt_len,
        prompt_token_ids=None,
        prompt_embeds=None,
        sampling_params=NS(extra_args={"xmix": {"apps": apps, "params": {}}} if apps else None),
    )


def test_v2_adapter_maps_and_results():
    patch_model_runner_v2(FakeRunnerV2)
    app = xmix.App("k")
    app.write("add", vector=torch.ones(D), scale=2.0).layers([0]).at("residual.pre").cond("prompt")
    app.read("probe", weight=torch.zeros(D), bias=0.0).layers([1]).at("residual.pre").named(
        "p"
    ).cond("last_token")
    runner = FakeRunnerV2()
    runner._xmix = _worker([app])
    sched = NS(
        finished_req_ids=set(),
        preempted_req_ids=None,
        scheduled_new_reqs=[_new_req("a", 3, ["k"]), _new_req("b", 2, None)],
    )
    runner.finish_requests(sched)
    runner.add_requests(sched)
    assert runner.calls == ["finish", "add"]
    # step: a = prompt positions 0..2 (whole prompt), b = positions 0..1; padded to 8 rows
    ib = NS(
        num_reqs=2,
        req_ids=["a", "b"],
        num_scheduled_tokens=np.array([3, 2], np.int32),
        num_computed_tokens_np=np.array([0, 0], np.int32),
        input_ids=torch.tensor([1, 2, 3, 4, 5, 0, 0, 0], dtype=torch.int32),
        num_tokens_after_padding=8,
    )
    assert runner.prepare_inputs(sched, ib, None, 0) is ib
    cb = runner._xmix.cb
    assert cb.host["tok_pos"][:5].tolist() == [0, 1, 2, 0, 1]
    assert cb.host["tok_slot"][5:8].tolist() == [-1, -1, -1]  # padding rows inert
    last = [bool(f & 8) for f in cb.host["tok_flags"][:5].tolist()]
    assert last == [False, False, True, False, True]
    h = torch.zeros(8, D)
    torch.ops.xmix.site(h, None, site_id("residual.pre", 0, SHAPE.n_layers))
    torch.ops.xmix.site(h, None, site_id("residual.pre", 1, SHAPE.n_layers))
    assert torch.all(h[:3] == 2.0) and torch.all(h[3:] == 0.0)  # only a's prompt rows
    runner.execute_model(sched)
    out = runner.sample_tokens()
    res = carried(out)
    assert res == {"a": {"k": {"p": {"positions": [2], "values": [0.5]}}}}
    # preemption in V2: the request is dropped (its slot freed, its record kept) and added
    # again when it resumes; positions it reported are not reported twice
    sched2 = NS(finished_req_ids=set(), preempted_req_ids={"a"}, scheduled_new_reqs=[])
    runner.finish_requests(sched2)
    assert "a" not in cb.slots.slot_of
    sched3 = NS(
        finished_req_ids={"b"}, preempted_req_ids=None, scheduled_new_reqs=[_new_req("a", 3, ["k"])]
    )
    runner.finish_requests(sched3)
    runner.add_requests(sched3)
    assert "a" in cb.slots.slot_of and "b" not in cb.slots.slot_of
    assert runner._xmix.stats["restarts"] == 1
    ib2 = NS(
        num_reqs=1,
        req_ids=["a"],
        num_scheduled_tokens=np.array([3], np.int32),
        num_computed_tokens_np=np.array([0], np.int32),
        input_ids=torch.tensor([1, 2, 3, 0], dtype=torch.int32),
        num_tokens_after_padding=4,
    )
    runner.prepare_inputs(sched3, ib2, None, 0)
    torch.ops.xmix.site(torch.zeros(4, D), None, site_id("residual.pre", 1, SHAPE.n_layers))
    runner.execute_model(sched3)
    assert runner._xmix.pending == {}  # position 2 was reported before the preemption
    # a dummy run (graph capture, profiling) drains nothing and leaves every row inert
    runner.execute_model(sched3, dummy_run=True)
    assert runner._xmix.pending == {}


class AsyncOutputV2(AsyncModelRunnerOutput):
    """V2's AsyncOutput as the executor sees it: its own copy is resolved in get_output."""

    def __init__(self, req_ids):
        self.model_runner_output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={})
        self.resolved = False

    def get_output(self):
        self.resolved = True
        return self.model_runner_output


def test_v2_async_output_gets_reads_without_a_host_wait_in_the_step():
    """Issue 20.3: no host wait between prepare_inputs and sample_tokens (the drain used to
    block there on .cpu()); the reads are copied to pinned memory on a side stream and
    resolved in the AsyncOutput's get_output, in step order, with two steps in flight."""
    patch_model_runner_v2(FakeRunnerV2)
    app = xmix.App("k")
    e0 = torch.zeros(D)
    e0[0] = 1.0
    app.read("probe", weight=e0, bias=0.0).layers([1]).at("residual.pre").named("p")
    dev = FakeDevice()
    runner = FakeRunnerV2()
    runner._xmix = x = _worker([app], queue=dev)
    dev.run()
    dev.host_waits = 0
    cb = x.cb
    sched = NS(
        finished_req_ids=set(),
        preempted_req_ids=None,
        scheduled_new_reqs=[_new_req("a", 2, ["k"]), _new_req("b", 1, None)],
    )
    steps = [  # (InputBatch, hidden states of the step)
        NS(
            num_reqs=2,
            req_ids=["a", "b"],
            num_scheduled_tokens=np.array([2, 1], np.int32),
            num_computed_tokens_np=np.array([0, 0], np.int32),
            input_ids=torch.zeros(4, dtype=torch.int32),
            num_tokens_after_padding=4,
        ),
        NS(
            num_reqs=2,
            req_ids=["b", "a"],
            num_scheduled_tokens=np.array([1, 1], np.int32),
            num_computed_tokens_np=np.array([1, 2], np.int32),
            input_ids=torch.zeros(2, dtype=torch.int32),
            num_tokens_after_padding=2,
        ),
    ]
    hs = [
        torch.tensor([[1.0], [2.0], [3.0], [4.0]]).repeat(1, D),
        torch.tensor([[5.0], [6.0]]).repeat(1, D),
    ]
    site = site_id("residual.pre", 1, SHAPE.n_layers)
    outs = []
    for k, (ib, h) in enumerate(zip(steps, hs)):
        if k == 0:
            runner.finish_requests(sched)
            runner.add_requests(sched)
        runner.prepare_inputs(sched, ib, None, 0)
        runner.forward = lambda h=h: dev.launch(
            lambda: _C.run_site_cpu(cb.ptr, site, h.data_ptr(), 0, h.shape[0], D, D, 0, F32)
        )
        runner.execute_model(sched)
        runner.outputs.append(AsyncOutputV2(ib.req_ids))
        out = runner.sample_tokens()
        assert isinstance(out, AsyncOutputV2) and not out.resolved
        outs.append(out)
    assert dev.host_waits == 0 and dev.queue, "the step path waited for the device"
    sig = torch.sigmoid
    mro = outs[0].get_output()
    assert dev.host_waits == 1  # get_output waited, as vLLM's own copy event does
    assert carried(mro) == {
        "a": {"k": {"p": {"positions": [0, 1], "values": sig(torch.tensor([1.0, 2.0])).tolist()}}}
    }
    mro = outs[1].get_output()
    assert carried(mro) == {
        "a": {"k": {"p": {"positions": [2], "values": [sig(torch.tensor(6.0)).item()]}}}
    }
