"""xmix::site on the CPU: the native kernel the dispatcher calls (xmix/_site_op.so) and its
Python reference (xmix.runtime.ops._site_cpu) give the hand-computed result, the same bits, and the
same failures; the dispatcher never reaches Python; torch.compile traces a site without a
graph break."""

from __future__ import annotations

import pytest
import torch

import xmix
from harness import Harness, Req
from xmix.lang.sites import ModelShape
from xmix.runtime import ops

D = 16
SHAPE = ModelShape(n_layers=2, hidden_size=D, vocab_size=64)
V = torch.linspace(-0.5, 0.25, D)
W = torch.linspace(1.0, -1.0, D)


def apps():
    steer = xmix.App("steer")
    steer.write("add", vector=V, scale=2.0).layers([0]).at("residual.pre")
    probe = xmix.App("k")
    probe.read("probe", weight=W, bias=0.25).layers([1]).at("residual.pre").named("p")
    return [steer, probe]


# rows 0-1: a (steer), row 2: b (no app), rows 3-5: c (steer and the probe)
STEP = {"a": Req(2, 0, 2, ("steer",)), "b": Req(1, 0, 1, ()), "c": Req(3, 0, 3, ("steer", "k"))}
STEERED = [0, 1, 3, 4, 5]


def run_step(kernel: str, h: torch.Tensor, r: torch.Tensor):
    hs = Harness(SHAPE, apps())
    hs.step(STEP)
    run = hs.run_reference if kernel == "reference" else hs.run
    run("residual.pre", 0, h, r)
    run("residual.pre", 1, h, r)
    return hs


def test_the_native_kernel_is_what_the_dispatcher_runs():
    """Built and loaded, with the layout Python spells (the loader checks its size)."""
    assert ops.NATIVE is not None, "xmix/_site_op.so was not built or does not load"
    h = torch.zeros(6, D)
    before = ops.python_site_calls[0]
    hs = run_step("native", h, torch.zeros(6, D))
    assert ops.python_site_calls[0] == before  # no Python kernel call
    assert hs.cb.sites.seconds > 0 and hs.cb.sites.py_seconds == 0
    assert h[0].tolist() == (2.0 * V).tolist()  # it ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_kernels_give_the_hand_computed_result_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    # small enough that the probe's sigmoid is not saturated
    h0 = (torch.randn(6, D, generator=g) / 8).to(dtype)
    r = (torch.randn(6, D, generator=g) / 8).to(dtype)
    got = {}
    for kernel in ("reference", "native"):
        h = h0.clone()
        hs = run_step(kernel, h, r)
        got[kernel] = (h, hs.drain(), hs.cb.take_failed())
    # hand math: h + 2 v on the steered rows, computed in float32 and rounded once
    want = h0.clone()
    want[STEERED] = (h0[STEERED].float() + 2.0 * V).to(dtype)
    h_ref, res_ref, failed_ref = got["reference"]
    h_nat, res_nat, failed_nat = got["native"]
    assert torch.equal(h_ref, want) and torch.equal(h_nat, want)
    # the probe on c's rows reads the stream h + r after the steer: sigmoid(w . (h + r) + b)
    x = h_ref[3:6].float() + r[3:6].float()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for res in (res_ref, res_nat):
        assert list(res) == ["c"] and res["c"]["k"]["p"]["positions"] == [0, 1, 2]
        torch.testing.assert_close(
            torch.tensor(res["c"]["k"]["p"]["values"]), torch.sigmoid(x @ W + 0.25), **tol
        )
    assert res_ref["c"]["k"]["p"]["values"] == res_nat["c"]["k"]["p"]["values"]
    assert failed_ref == failed_nat == {}


@pytest.mark.parametrize("kernel", ["reference", "native"])
def test_an_unsupported_dtype_fails_the_sites_requests_only(kernel):
    """float64 rows: nothing of the site runs; the requests whose apps have an op there fail
    with a message naming the dtypes that are supported; b (no app) does not."""
    h = torch.ones(6, D, dtype=torch.float64)
    hs = Harness(SHAPE, apps())
    hs.step(STEP)
    (hs.run_reference if kernel == "reference" else hs.run)("residual.pre", 0, h, None)
    failed = hs.cb.take_failed()
    assert sorted(failed) == ["a", "c"], failed
    assert all("fp32, bf16, fp16" in m and "'steer'" in m for m in failed.values()), failed
    assert h.eq(1).all()
    assert hs.cb.take_failed() == {}  # collected once


def test_torch_compile_traces_a_site_without_a_graph_break():
    """The site is one opaque in-place op to dynamo (fullgraph: a break would raise) and the
    compiled function runs the native kernel."""
    hs = Harness(SHAPE, apps())
    hs.step(STEP)

    def f(h):
        h = h * 1.0
        torch.ops.xmix.site(h, None, 0)
        return h + 0.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    before = ops.python_site_calls[0]
    out = compiled(torch.zeros(6, D))
    assert ops.python_site_calls[0] == before
    want = torch.zeros(6, D)
    want[STEERED] = 2.0 * V
    assert torch.equal(out, want)
