"""The control block's per-step path against a device that runs late (``fake_device.FakeDevice``),
on the CPU interpreter: what a GPU does with vLLM's async scheduling, where the host queues
step N+1 (two steps in flight, ``vllm/v1/engine/core.py:EngineCore.step_with_batch_queue``)
before the device has run step N's copies.

Every step's forward is queued on the fake stream as a graph replay runs it: the site programs
dispatch from the device control block (``_C.run_site_cpu`` on the device buffers, no host-side
skip), so a step sees exactly the header and maps the queued copies delivered by then. The
oracle is hand-computed: request A uses an "add 2 to every component" write at layer 0 and a
probe on component 0 at layer 1; B uses no app.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

import xmix
from fake_device import FakeDevice
from harness import SMALL
from xmix import _C
from xmix.integrations.vllm.result_keys import CARRIER
from xmix.integrations.vllm.worker.worker import (
    WorkerXmix,
    _attach_results,
    patch_model_runner,
)
from xmix.lang.lowering import lower
from xmix.lang.results_codec import unpack_results
from xmix.lang.sites import ModelShape, site_id
from xmix.runtime.control import Capacity, ControlBlock
from xmix.runtime.device_queue import StreamQueue

D = 8
SHAPE = ModelShape(n_layers=2, hidden_size=D, vocab_size=32)
SITE_W = site_id("residual.pre", 0, SHAPE.n_layers)
SITE_R = site_id("residual.pre", 1, SHAPE.n_layers)
F32 = _C.constants()["DT_F32"]


def write_app(scale: float = 2.0) -> xmix.App:
    app = xmix.App("w")
    app.write("add", vector=torch.ones(D), scale=scale).layers([0]).at("residual.pre")
    return app


def read_app() -> xmix.App:
    e0 = torch.zeros(D)
    e0[0] = 1.0
    app = xmix.App("r")
    app.read("probe", weight=e0, bias=0.0).layers([1]).at("residual.pre").named("p")
    return app


def make_rank(
    rank0: bool, capacity: Capacity = SMALL, order: str = "main"
) -> tuple[WorkerXmix, FakeDevice]:
    dev = FakeDevice(order)
    cb = ControlBlock(SHAPE, "cpu", capacity, queue=dev)
    for app in (write_app(), read_app()):
        cb.install(lower(app, SHAPE))
    dev.run()  # deployed before serving starts
    dev.host_waits = 0
    return WorkerXmix.for_control_block(cb, rank0=rank0), dev


def queue_forward(x: WorkerXmix, dev: FakeDevice, h: torch.Tensor) -> None:
    """The forward as a replayed graph runs it: both sites, in stream order."""
    cb = x.cb
    for site in (SITE_W, SITE_R):
        dev.launch(
            lambda site=site: _C.run_site_cpu(
                cb.ptr, site, h.data_ptr(), 0, h.shape[0], D, D, 0, F32
            )
        )


class AsyncOut:
    """Shaped like vLLM's AsyncModelRunnerOutput: results are read in get_output."""

    def __init__(self):
        self.mro = NS()

    def get_output(self):
        return self.mro


# Two steps: step 1 = [A prompt 0..2, B prompt 0..1]; step 2 = [B decode 2, A decode 3], padded
# to 4 rows. A's rows move between steps, so a step run with the other step's maps or header
# writes and reads the wrong rows.
STEPS = [
    dict(req_ids=["A", "B"], n_tok=[3, 2], start=[0, 0], plen=[3, 2], padded=5),
    dict(req_ids=["B", "A"], n_tok=[1, 1], start=[2, 3], plen=[2, 3], padded=4),
]


def h_in(step: int, n: int | None = None) -> torch.Tensor:
    n = STEPS[step]["padded"] if n is None else n
    return (torch.arange(n, dtype=torch.float32) + 1 + 10 * step)[:, None].repeat(1, D)


def expected(step: int) -> tuple[torch.Tensor, dict]:
    h = h_in(step)
    a_rows = [0, 1, 2] if step == 0 else [1]
    h[a_rows] += 2.0
    pos = [0, 1, 2] if step == 0 else [3]
    return h, {
        "A": {"r": {"p": {"positions": pos, "values": torch.sigmoid(h[a_rows, 0]).tolist()}}}
    }


def run_steps(x: WorkerXmix, dev: FakeDevice, catch_up: str, steps=STEPS):
    """Queue the steps as the worker does; the device runs only at the chosen points.

    catch_up: "end" (two steps in flight: the device starts after both are queued),
    "next_begin" (the device runs a step's work once the next step's maps are queued),
    "after_step" (the device runs everything queued at the end of each step),
    "eager" (the device runs everything as soon as it is queued: a synchronous device)."""
    cb = x.cb
    for rid, plen in (("A", 3), ("B", 2)):
        if rid not in cb.slots.slot_of:
            cb.admit(rid, ["w", "r"] if rid == "A" else [], {}, plen)
    hs, outs = [], []
    for k, st in enumerate(steps):
        h = h_in(k, st["padded"])
        ids = torch.zeros(st["padded"], dtype=torch.int32)
        x.begin(
            st["req_ids"],
            np.array(st["n_tok"]),
            np.array(st["start"]),
            np.array(st["plen"]),
            ids,
            st["padded"],
        )
        if catch_up == "eager" or (catch_up == "next_begin" and k > 0):
            dev.run()
        queue_forward(x, dev, h)
        if catch_up == "eager":
            dev.run()
        x.after_forward()
        out = _attach_results(NS(_xmix=x), AsyncOut())
        if catch_up in ("eager", "after_step"):
            dev.run()
        hs.append(h)
        outs.append(out)
    return hs, outs


def results_of(out) -> dict:
    """A step's results as the engine core receives them (packed per request), decoded."""
    return {
        rid: unpack_results(apps) for rid, apps in getattr(out.get_output(), CARRIER, {}).items()
    }


@pytest.mark.parametrize("order", ["main", "side"])
@pytest.mark.parametrize("catch_up", ["end", "next_begin", "after_step", "eager"])
def test_steps_in_flight_see_their_own_maps_on_every_rank(catch_up, order):
    """Issue 20.1 / 10.6: with two steps in flight every step sees its own header and maps,
    on every tensor-parallel rank (rank 0 drains reads, rank 1 does not), and the step path
    never makes the host wait for the device; whichever of the model's stream and the
    read-back stream the device runs first (``order``), each step's reads are its own."""
    ranks = [make_rank(True, order=order), make_rank(False, order=order)]
    runs = []
    for x, dev in ranks:
        hs, outs = run_steps(x, dev, catch_up)
        waits_in_steps = dev.host_waits
        dev.run()  # the device finishes
        runs.append((hs, outs, waits_in_steps))
    seen = [[hs[k][:, 0].tolist() for k in range(len(STEPS))] for hs, _, _ in runs]
    want = [expected(k)[0][:, 0].tolist() for k in range(len(STEPS))]
    assert seen == [want, want], (
        f"component 0 of each step's rows, per rank: {seen}; expected {want}"
    )
    for k in range(len(STEPS)):
        assert torch.equal(runs[0][0][k], expected(k)[0]) and torch.equal(
            runs[1][0][k], expected(k)[0]
        )
        assert results_of(runs[0][1][k]) == expected(k)[1], f"rank 0, step {k + 1}"
    waits = [w for _, _, w in runs]
    assert waits == [0, 0], f"host waits for the device in the step path, per rank: {waits}"


def _reads_of_each_step(x: WorkerXmix, dev: FakeDevice) -> list[dict]:
    _, outs = run_steps(x, dev, "end")
    dev.run()
    return [results_of(out) for out in outs]


def test_a_read_back_that_does_not_wait_for_the_forward_is_caught(monkeypatch):
    """The read-back stream must wait for the forward that writes the results
    (StreamQueue.side_copy: side.wait_stream(main)); without that wait, a device that runs the
    side stream first copies results the step has not written yet, and the test above fails."""
    want = [expected(k)[1] for k in range(len(STEPS))]
    assert _reads_of_each_step(*make_rank(True, order="side")) == want

    def side_copy_without_the_wait(self, pairs):
        if self._side is None:
            self._side = self.streams.new_stream()
        for dst, src in pairs:
            self.streams.copy(dst, src, self._side)
        ev = self.streams.event()
        ev.record(self._side)
        return ev

    monkeypatch.setattr(StreamQueue, "side_copy", side_copy_without_the_wait)
    assert _reads_of_each_step(*make_rank(True, order="side")) != want


def test_a_forward_that_does_not_wait_for_the_read_back_is_caught(monkeypatch):
    """The next step's forward rewrites the results buffer: it must wait for the previous
    step's read-back (runtime/control/stage.py: x.wait(after)). Without that wait, a device that runs
    the model's stream first overwrites step 1's results before they are copied."""
    want = [expected(k)[1] for k in range(len(STEPS))]
    x, dev = make_rank(True, order="main")
    assert _reads_of_each_step(x, dev) == want
    x, dev = make_rank(True, order="main")
    monkeypatch.setattr(dev, "wait", lambda event: None)
    assert _reads_of_each_step(x, dev) != want


def test_ring_waits_only_when_more_steps_are_queued_than_staging_sets():
    """Depth 3: three steps queue without the host waiting; a fourth reuses the first step's
    staging set and waits until the device has consumed it (and is then still correct)."""
    x, dev = make_rank(False)
    steps = [STEPS[0], STEPS[1], dict(STEPS[1], start=[3, 4]), dict(STEPS[1], start=[4, 5])]
    hs, _ = run_steps(x, dev, "end", steps)
    assert dev.host_waits == 1 and x.cb.mem.staging_stats()["staging_waits"] == 1
    dev.run()
    for k in range(4):
        h_exp = h_in(k, steps[k]["padded"])
        h_exp[[0, 1, 2] if k == 0 else [1]] += 2.0
        assert torch.equal(hs[k], h_exp), f"step {k + 1}"


def _admit_and_step(x, dev, rids, plen=4):
    cb = x.cb
    for rid in rids:
        if rid not in cb.slots.slot_of:
            cb.admit(rid, ["w"], {}, plen)
    n = len(rids)
    x.begin(
        rids,
        np.ones(n, np.int64),
        np.full(n, plen, np.int64),
        np.full(n, plen, np.int64),
        torch.zeros(n, dtype=torch.int32),
        n,
    )
    x.after_forward()


# What one step must send: 4 per-token maps (int32, padded rows), 6 per-request maps (int32),
# n_tokens and n_rows (8 bytes), and per slot row changed since the last step its index
# (int64), app mask (int64) and the used columns of its parameter row (float32).
def step_bytes(padded: int, n_req: int, changed_rows: int = 0, param_cols: int = 0) -> int:
    return 4 * 4 * padded + 6 * 4 * n_req + 8 + changed_rows * (8 + 8 + 4 * param_cols)


def test_step_copies_only_maps_and_changed_slot_rows():
    """Issue 20.5: slot_params ((max_num_seqs + 8) x max_params floats, 17 MB at vLLM's
    H100/H200 defaults) is not copied every step: only rows written at admission or by
    set_params, and only the parameter columns deployed apps use."""
    cap = Capacity(
        max_tokens=64,
        max_slots=1032,
        max_apps=8,
        max_params=4096,
        max_channels=16,
        max_ops=64,
        max_cond=128,
        capture_floats=64,
    )
    x, dev = make_rank(False, cap)
    cols = max(a.param_base + len(a.param_cols) for a in x.cb.apps.values())
    dev.take_bytes()
    _admit_and_step(x, dev, ["a", "b", "c"])  # three admissions
    assert dev.take_bytes()[0] == step_bytes(3, 3, changed_rows=3, param_cols=cols)
    _admit_and_step(x, dev, ["a", "b", "c"])  # steady decode
    assert dev.take_bytes()[0] == step_bytes(3, 3)
    x.cb.set_params("w", {"scale": 5.0})  # a control change: rows of running requests
    dev.run()
    dev.take_bytes()
    _admit_and_step(x, dev, ["a", "b", "c"])
    assert dev.take_bytes()[0] == step_bytes(3, 3, changed_rows=3, param_cols=cols)
    dev.run()
    P = cap.max_params
    for rid in ("a", "b", "c"):
        s = x.cb.slots.slot_of[rid]
        assert torch.equal(
            x.cb.dev["slot_params"][s * P : (s + 1) * P],
            torch.from_numpy(x.cb.host["slot_params"][s * P : (s + 1) * P]),
        )
        assert x.cb.dev["slot_apps"][s].item() == x.cb.host["slot_apps"][s]


def test_params_changed_between_steps_in_flight_reach_only_later_steps():
    """A set_params between two queued steps: the earlier step runs with the old scale, the
    later with the new one (the change takes effect at the step boundary, in stream order)."""
    x, dev = make_rank(False)
    cb = x.cb
    cb.admit("A", ["w"], {}, 3)
    hs = []
    for k, scale in enumerate((None, 5.0)):
        if scale is not None:
            cb.set_params("w", {"scale": scale})
        h = torch.zeros(1, D)
        x.begin(
            ["A"],
            np.array([1]),
            np.array([3 + k]),
            np.array([3]),
            torch.zeros(1, dtype=torch.int32),
            1,
        )
        queue_forward(x, dev, h)
        x.after_forward()
        hs.append(h)
    dev.run()
    assert hs[0][0, 0].item() == 2.0 and hs[1][0, 0].item() == 5.0


def test_changed_rows_beyond_a_staging_set_fall_back_to_one_full_copy():
    """More changed parameter floats than a staging set holds (a burst of admissions with
    wide rows): one blocking full copy of slot_params, and every row is right."""
    cap = Capacity(
        max_tokens=64,
        max_slots=8,
        max_apps=8,
        max_params=64,
        max_channels=16,
        max_ops=64,
        max_cond=128,
        capture_floats=64,
        staging_param_floats=2,
    )
    x, dev = make_rank(False, cap)
    cb = x.cb
    for i in range(3):
        cb.admit(f"q{i}", ["w"], {"w": {"scale": float(i + 1)}}, 4)
    hs = torch.zeros(3, D)
    x.begin(
        [f"q{i}" for i in range(3)],
        np.ones(3, np.int64),
        np.full(3, 4),
        np.full(3, 4),
        torch.zeros(3, dtype=torch.int32),
        3,
    )
    queue_forward(x, dev, hs)
    x.after_forward()
    assert cb.mem.stats["full_param_copies"] == 1
    dev.run()
    assert hs[:, 0].tolist() == [1.0, 2.0, 3.0]


class AsyncOutputV1(AsyncModelRunnerOutput):
    """V1's AsyncGPUModelRunnerOutput as the executor sees it (no req_ids until resolved)."""

    def __init__(self, req_ids):
        self._mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={})

    def get_output(self):
        return self._mro


class FakeRunnerV1:
    """V1's GPUModelRunner as patch_model_runner wraps it: execute_model calls _model_forward,
    sample_tokens returns an async output (async scheduling)."""

    __xmix_stands_for__ = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"  # its fence entries

    def __init__(self):
        self.h = self.ids = self.input_batch = self.dev = None

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._model_forward(self.ids, None)
        return None

    def _model_forward(
        self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kw
    ):
        queue_forward(self._xmix, self.dev, self.h)

    def sample_tokens(self, grammar_output=None):
        return AsyncOutputV1(self.input_batch.req_ids)


def test_v1_async_output_gets_reads_without_a_host_wait_in_the_step():
    """Issue 20.3 on model runner V1 with async scheduling: the same two steps in flight
    through execute_model / _model_forward / sample_tokens; the reads arrive with each step's
    AsyncGPUModelRunnerOutput.get_output, and the step path never waits for the device."""
    patch_model_runner(FakeRunnerV1)
    x, dev = make_rank(True)
    runner = FakeRunnerV1()
    runner._xmix, runner.dev = x, dev

    def new(rid, plen, apps):
        return NS(
            req_id=rid,
            prompt_len=plen,
            prompt_token_ids=None,
            prompt_embeds=None,
            sampling_params=NS(extra_args={"xmix": {"apps": apps}}),
        )

    outs, hs = [], []
    for k, st in enumerate(STEPS):
        sched = NS(
            finished_req_ids=set(),
            preempted_req_ids=None,
            scheduled_new_reqs=[new("A", 3, ["w", "r"]), new("B", 2, [])] if k == 0 else [],
            num_scheduled_tokens=dict(zip(st["req_ids"], st["n_tok"])),
        )
        runner.input_batch = NS(
            num_reqs=2,
            req_ids=st["req_ids"],
            num_computed_tokens_cpu=np.array(st["start"]),
            num_prompt_tokens=np.array(st["plen"]),
        )
        runner.h, runner.ids = h_in(k), torch.zeros(st["padded"], dtype=torch.int32)
        runner.execute_model(sched)
        outs.append(runner.sample_tokens(None))
        hs.append(runner.h)
    assert dev.host_waits == 0 and dev.queue, "the step path waited for the device"
    for k in range(len(STEPS)):
        h_exp, res_exp = expected(k)
        assert results_of(outs[k]) == res_exp, f"step {k + 1}"
        assert torch.equal(hs[k], h_exp)


def test_reads_through_the_capture_buffer_arrive_per_step():
    """Reads whose values live in the capture buffer (capture, top-K SAE) and an SAE features
    read, two steps in flight: each step's rows are copied out before the next forward
    rewrites the buffer, and land on the right request and positions. Oracle: the rows of h
    and xmix.lang.reference's SAE encoder."""
    from xmix.lang import reference as R
    from xmix.lang.sae import SAE

    g = torch.Generator().manual_seed(0)
    F_ = 20
    sae = SAE(
        torch.randn(D, F_, generator=g),
        torch.randn(F_, generator=g) * 0.2,
        torch.randn(F_, D, generator=g),
        torch.zeros(D),
        architecture="relu",
    )
    app = xmix.App("c")
    app.read("capture", dims=(2, 6)).layers([1]).at("residual.pre").named("cap")
    app.read("sae", sae=sae, top_k=3).layers([1]).at("residual.pre").named("top")
    app.read("sae", sae=sae, features=[0, 5]).layers([1]).at("residual.pre").named("f")
    dev = FakeDevice()
    cb = ControlBlock(SHAPE, "cpu", SMALL, queue=dev)
    cb.install(lower(app, SHAPE))
    x = WorkerXmix.for_control_block(cb)
    cb.admit("A", ["c"], {}, 3)
    cb.admit("B", [], {}, 2)
    dev.run()
    dev.host_waits = 0
    hs, outs = [], []
    for st in STEPS:
        h = torch.randn(st["padded"], D, generator=g)
        x.begin(
            st["req_ids"],
            np.array(st["n_tok"]),
            np.array(st["start"]),
            np.array(st["plen"]),
            torch.zeros(st["padded"], dtype=torch.int32),
            st["padded"],
        )
        dev.launch(
            lambda h=h: _C.run_site_cpu(cb.ptr, SITE_R, h.data_ptr(), 0, h.shape[0], D, D, 0, F32)
        )
        x.after_forward()
        outs.append(_attach_results(NS(_xmix=x), AsyncOut()))
        hs.append(h)
    assert dev.host_waits == 0
    for k, (h, out) in enumerate(zip(hs, outs)):
        rows, pos = ([0, 1, 2], [0, 1, 2]) if k == 0 else ([1], [3])
        got = results_of(out)
        assert list(got) == ["A"] and sorted(got["A"]["c"]) == ["cap", "f", "top"]
        r = got["A"]["c"]
        acts = R.sae_encode(h, sae)
        top = R.sae_top(acts, 3)
        assert (
            r["cap"]["positions"] == pos
            and r["top"]["positions"] == pos
            and r["f"]["positions"] == pos
        )
        torch.testing.assert_close(torch.tensor(r["cap"]["values"]), h[rows, 2:6])
        for j, row in enumerate(rows):
            assert r["top"]["values"][j]["ids"] == top[row][0]
            torch.testing.assert_close(
                torch.tensor(r["top"]["values"][j]["acts"]), torch.tensor(top[row][1])
            )
            assert r["f"]["values"][j]["ids"] == [0, 5]
            torch.testing.assert_close(torch.tensor(r["f"]["values"][j]["acts"]), acts[row, [0, 5]])
