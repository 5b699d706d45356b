"""Monitors in the kernels and the control block, without an engine: a stop records the
earliest token of a request where its condition holds (with the reported read's value), a
since(...) term holds from the first position its condition held, across prefill chunks
and a recompute after preemption, on the CPU twin, the CUDA twin (gpu) and through the staged
read-back. A request whose monitor never fires is written exactly as without it.

Oracles: xmix.lang.reference (probe, stream, add) and positions counted by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xmix
from fake_device import FakeDevice
from harness import SMALL, Harness, Req
from xmix import _C
from xmix.lang import reference as R
from xmix.lang.lowering import lower
from xmix.lang.results_codec import STOPPED_KEY, SWITCHED_KEY
from xmix.lang.sites import ModelShape, site_id
from xmix.runtime.control import ControlBlock

D = 16
SHAPE = ModelShape(n_layers=2, hidden_size=D, vocab_size=64)
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
W = torch.linspace(-1, 1, D)
V = torch.linspace(1, 2, D)


def monitor_app(theta=0.5, stop_theta=2.0):
    app = xmix.App("mon")
    app.param("theta", theta).param("stop_at", stop_theta)
    app.read("probe", weight=W).layers([0]).at("residual.pre").named("p")
    app.write("add", vector=V, scale=3.0).layers([1]).at("residual.pre").cond(
        when="since(p > theta)"
    )
    app.stop(when="p > stop_at")
    return app


def stream(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def logits(cs, seed=0):
    """(h, r) whose stream h + r puts w . x = c at each row: the probe is sigmoid(c)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(len(cs), D, generator=g)
    x = torch.tensor(cs)[:, None] * W / (W @ W)
    return x - r, r


def run_step(hs, reqs, h0, r0, h1, dev):
    hs.step(reqs)
    hs.run("residual.pre", 0, h0.to(dev), r0.to(dev))
    h1d = h1.clone().to(dev)
    hs.run("residual.pre", 1, h1d)
    hs.run("final.post", None, torch.zeros(h0.shape[0], D, device=dev))
    out = hs.drain()
    hs.cb.end_step()
    return out, h1d.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
def test_since_and_stop_over_chunks(backend):
    hs = Harness(SHAPE, [monitor_app()], backend)
    # a: 7 prompt tokens in chunks of 4 and 3; b: same app, never fires (high thresholds);
    # c: no app
    h0, r0 = logits([-2.0, -1.0, 1.0, -3.0, 0.5, 2.0, 3.0, 0.0, 1.0, 2.0])
    # a's first chunk holds rows 0..3: the first trigger is row 2 (sigmoid(1) > 0.6)
    theta = 0.6
    params = {"mon": {"theta": theta}}
    reqs = {
        "a": Req(4, 0, 7, ("mon",), params),
        "b": Req(3, 0, 3, ("mon",), {"mon": {"theta": 5.0}}),  # a sigmoid never exceeds 1
        "c": Req(3, 0, 3, ()),
    }
    h1 = torch.randn(10, D, generator=torch.Generator().manual_seed(2))
    out, got = run_step(hs, reqs, h0[:10], r0[:10], h1, backend)
    assert out["a"][SWITCHED_KEY] == [
        {"app": "mon", "read": "p", "position": 2, "condition": "since(p > theta)"}
    ]
    assert STOPPED_KEY not in out["a"] and SWITCHED_KEY not in out.get("b", {})
    # b's row 4 (0.62) and c's rows would pass a's theta: each request has its own
    mask = torch.tensor([False, False, True, True] + [False] * 6)
    want = R.add(h1, None, mask, V, 3.0)
    assert torch.equal(got, want)  # b and c (and a before its trigger) bit-identical
    assert torch.equal(got[4:], h1[4:])
    # second chunk of a: the term holds on every token, reported once; a stop fires at its
    # second token
    h0b, r0b = logits([-1.0, 2.0, 3.0], seed=3)
    pb = R.probe(R.stream(h0b, r0b), W, 0.0)
    hs.cb.patch("mon", params={"stop_at": 0.8})  # sigmoid(2) = 0.88: the second token
    h1b = torch.randn(3, D, generator=torch.Generator().manual_seed(4))
    out, got = run_step(hs, {"a": Req(3, 4, 7, ("mon",))}, h0b, r0b, h1b, backend)
    assert SWITCHED_KEY not in out["a"]
    assert torch.equal(got, R.add(h1b, None, torch.ones(3, dtype=torch.bool), V, 3.0))
    stopped = out["a"][STOPPED_KEY]
    assert stopped == {
        "app": "mon",
        "read": "p",
        "position": 5,
        "value": pytest.approx(float(pb[1])),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_recompute_keeps_what_monitors_decided(backend):
    """After preemption a request recomputes from position 0 in another slot; positions its
    monitors decided before are not decided again, even where the recomputed read differs
    (here it is driven above every threshold), and the since term holds from where it did."""
    hs = Harness(SHAPE, [monitor_app(stop_theta=5.0)], backend)
    cb = hs.cb
    h0, r0 = logits([-2.0, -1.0, 1.0, -3.0])
    params = {"mon": {"theta": 0.6}}
    h1 = torch.randn(4, D, generator=torch.Generator().manual_seed(5))
    out, _ = run_step(hs, {"a": Req(4, 0, 4, ("mon",), params)}, h0, r0, h1, backend)
    assert out["a"][SWITCHED_KEY][0]["position"] == 2
    cb.slots.suspend("a")
    hs.slots.pop("a")
    # an unrelated request takes the slot meanwhile
    run_step(hs, {"z": Req(2, 0, 2, ("mon",))}, h0[:2], r0[:2], h1[:2], backend)
    slot = cb.slots.resume("a")
    hs.slots["a"] = slot
    cb.patch("mon", params={"stop_at": 0.0})  # every position a recompute decides would stop
    big = torch.full((5, D), 4.0) * torch.sign(W)  # p ~ 1 everywhere
    h1r = torch.randn(5, D, generator=torch.Generator().manual_seed(6))
    out, got = run_step(
        hs, {"a": Req(5, 0, 4, ("mon",), params)}, big, torch.zeros(5, D), h1r, backend
    )
    # only position 4, new since the preemption, is decided; the term still starts at 2
    assert SWITCHED_KEY not in out["a"]
    assert out["a"][STOPPED_KEY]["position"] == 4
    mask = torch.tensor([False, False, True, True, True])
    assert torch.equal(got, R.add(h1r, None, mask, V, 3.0))


def test_monitors_through_the_staged_read_back():
    app = monitor_app(theta=-1.0, stop_theta=-1.0)  # both fire at the first token
    dev = FakeDevice()
    cb = ControlBlock(SHAPE, "cpu", SMALL, queue=dev)
    cb.install(lower(app, SHAPE))
    dev.run()
    cb.admit("a", ["mon"], {}, 3)
    cb.admit("b", [], {}, 2)
    h, r = stream(5, seed=7)
    slots = np.array([cb.slots.slot_of["b"], cb.slots.slot_of["a"]], np.int32)
    cb.begin_step(slots, np.array([2, 3]), np.array([0, 5]), np.array([2, 3]), 5)
    cb.prologue(torch.zeros(5, dtype=torch.int32))
    F32 = _C.constants()["DT_F32"]
    for sid in (site_id("residual.pre", 0, 2), site_id("final.post", None, 2)):
        dev.launch(
            lambda sid=sid: _C.run_site_cpu(
                cb.ptr, sid, h.data_ptr(), r.data_ptr(), 5, D, D, D, F32
            )
        )
    pend = cb.reads.drain_async()
    cb.end_step()
    res = pend.result()
    want = float(R.probe(R.stream(h, r), W, 0.0)[2])
    assert set(res) == {"a"}
    assert res["a"][STOPPED_KEY] == {
        "app": "mon",
        "read": "p",
        "position": 5,
        "value": pytest.approx(want),
    }
    assert [x["position"] for x in res["a"][SWITCHED_KEY]] == [5]


def test_a_since_column_handed_to_a_new_app_starts_unset():
    first = monitor_app(theta=-1.0)
    hs = Harness(SHAPE, [first])
    h0, r0 = stream(3, seed=1)
    out, _ = run_step(hs, {"a": Req(3, 0, 3, ("mon",))}, h0, r0, torch.zeros(3, D), "cpu")
    assert out["a"][SWITCHED_KEY][0]["position"] == 0
    hs.cb.remove("mon")
    second = monitor_app(theta=5.0)  # never fires
    hs.cb.install(lower(second, SHAPE))
    h1 = torch.randn(3, D)
    hs.slots["a2"] = hs.cb.admit("a2", ["mon"], None, 3)
    out, got = run_step(hs, {"a": Req(1, 3, 3, ("mon",))}, h0[:1], r0[:1], h1[:1], "cpu")
    assert torch.equal(got, h1[:1]) and not out
