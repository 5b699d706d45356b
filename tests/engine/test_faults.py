"""Faults inside the engine are contained to the request that caused them (issue 18).

- A write whose result would not be finite (an fp16 overflow within the allowed scale range,
  an adversarial `affine` matrix, a user kernel that writes NaN) leaves the stream finite and
  is counted per app; the expected rows come from ``xmix.lang.reference`` (whose ``written`` keeps
  the old value of such an element) and hand-computed masks.
- An op that fails inside a site program (a user kernel that throws) fails the requests that
  used its app in that step; the other ops of the site still run, for every other request.
- The same on one offline CPU engine: the failing request ends with finish_reason "error"
  and a message, its batch-mates answer as without it, and freed KV blocks carry no Inf/NaN
  into later requests.
"""

from __future__ import annotations

import pytest
import torch

from harness import Harness, Req, build_user_kernels
from xmix.lang import reference as R
from xmix.lang.api import App
from xmix.lang.program_codec import program_of
from xmix.lang.sites import ModelShape

D = 64
SHAPE = ModelShape(n_layers=2, hidden_size=D, vocab_size=64)
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# a: 3 prompt tokens using the app; b: 2 tokens without it
STEP = {"a": Req(3, 0, 3, ("k",)), "b": Req(2, 0, 2, ())}
A_ROWS = torch.tensor([1, 1, 1, 0, 0], dtype=torch.bool)


def _counts(hs: Harness) -> dict[str, int]:
    return hs.cb.sites.nonfinite_writes()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_add_that_would_overflow_leaves_those_elements_as_they_were(backend, dtype):
    """scale x vector within the 1e30 bound still overflows fp16 (max 65504): those elements
    keep their value, the others are written, and the app's counter says how many."""
    v = torch.full((D,), 1e-3)
    v[:8] = 1e3
    app = App("k")
    app.write("add", vector=v, scale=100.0).layers([0]).at("residual.pre")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, D, generator=g).to(dtype).to(backend)
    h0 = h.clone()
    hs = Harness(SHAPE, [app], backend)
    hs.step(STEP)
    hs.run("residual.pre", 0, h, None)
    want = R.add(h0.cpu(), None, A_ROWS, v, 100.0)
    new = (h0.cpu().float() + 100.0 * v).to(dtype)
    refused = int((A_ROWS[:, None] & ~torch.isfinite(new)).sum())
    assert refused == (3 * 8 if dtype == torch.float16 else 0)
    assert torch.isfinite(h.float()).all()
    torch.testing.assert_close(h.cpu().float(), want.float(), rtol=0, atol=0)
    assert _counts(hs) == {"k": refused}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_adversarial_affine_matrix_cannot_make_the_stream_infinite(backend, dtype):
    """Artifacts are only checked to be finite at deploy: a matrix of 1e38 drives elements
    past the fp32 range. Those keep their value; rows of other requests are untouched."""
    g = torch.Generator().manual_seed(1)
    m = torch.eye(D) * 1e38
    app = App("k")
    app.write("affine", matrix=m, mu_s=torch.zeros(D), mu_t=torch.zeros(D)).layers([0]).at(
        "residual.pre"
    )
    h = (torch.randn(5, D, generator=g) * 4).to(dtype).to(backend)
    h0 = h.clone()
    hs = Harness(SHAPE, [app], backend)
    hs.step(STEP)
    hs.run("residual.pre", 0, h, None)
    want = R.affine(h0.cpu(), None, A_ROWS, m, torch.zeros(D), torch.zeros(D))
    new = (h0.cpu().float() @ m.T).to(dtype)
    refused = int((A_ROWS[:, None] & ~torch.isfinite(new)).sum())
    assert refused > 0 and refused < 3 * D or dtype == torch.float16
    assert torch.isfinite(h.float()).all()
    assert torch.equal(h[3:].cpu(), h0[3:].cpu())
    torch.testing.assert_close(h.cpu().float(), want.float(), rtol=1e-6, atol=0)
    assert _counts(hs) == {"k": refused}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_in_the_stream_is_not_spread_by_a_projection(backend, dtype):
    """One NaN element in a row makes that row's projection NaN, so every new value of the
    row is NaN: the whole row keeps its values (the NaN stays where it was, nothing spreads)
    and counts d refused elements; the request's other rows are ablated as usual."""
    g = torch.Generator().manual_seed(2)
    u = torch.randn(D, generator=g)
    app = App("k")
    app.write("ablate", direction=u).layers([0]).at("residual.pre")
    h = torch.randn(5, D, generator=g).to(dtype)
    r = torch.randn(5, D, generator=g).to(dtype)
    h[1, 7] = float("nan")
    h, r = h.to(backend), r.to(backend)
    h0 = h.clone()
    hs = Harness(SHAPE, [app], backend)
    hs.step(STEP)
    hs.run("residual.pre", 0, h, r)
    want = R.ablate(h0.cpu(), r.cpu(), A_ROWS, u)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(h[1].cpu().view(bits), h0[1].cpu().view(bits))  # the NaN row, as it was
    assert torch.equal(h[3:].cpu().view(bits), h0[3:].cpu().view(bits))  # the other request
    ok = torch.tensor([0, 2])
    torch.testing.assert_close(
        h[ok].cpu().float(),
        want[ok].float(),
        rtol=1e-5 if dtype == torch.float32 else 1e-2,
        atol=1e-5 if dtype == torch.float32 else 1e-2,
    )
    assert not torch.equal(h[ok].cpu(), h0[ok].cpu())
    assert _counts(hs) == {"k": D}


KERNELS_CPP = r"""
#include <stdexcept>
#include "xmix/custom.h"

// write: NaN into element 0 of every selected row, +1 into element 1
extern "C" void nan_first(const xmix_custom_args* a) {
  float* h = static_cast<float*>(a->h);
  for (int t = 0; t < a->n_rows; ++t) {
    if (!a->select[t]) continue;
    h[t * a->stride_h] = __builtin_nanf("");
    h[t * a->stride_h + 1] += 1.f;
  }
}

// a kernel that cannot do its work
extern "C" void always_throws(const xmix_custom_args* a) {
  if (a->n_rows > 0) throw std::runtime_error("user kernel: cannot open its lookup table");
}

// write: h[t][2] = position of the token
extern "C" void stamp_position(const xmix_custom_args* a) {
  float* h = static_cast<float*>(a->h);
  for (int t = 0; t < a->n_rows; ++t)
    if (a->select[t]) h[t * a->stride_h + 2] = static_cast<float>(a->tok_pos[t]);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_user_kernels(tmp_path_factory.mktemp("kernel"), KERNELS_CPP)


def test_a_user_kernel_that_writes_nan_gets_zeros_and_is_counted(lib):
    app = App("k")
    app.write("custom", cpu_library=lib, cpu_symbol="nan_first").layers([0]).at("residual.pre")
    h = torch.arange(5 * D, dtype=torch.float32).reshape(5, D) / 100
    h0 = h.clone()
    hs = Harness(SHAPE, [app])
    hs.step(STEP)
    hs.run("residual.pre", 0, h, None)
    assert torch.equal(h[:3, 0], torch.zeros(3))  # NaN -> 0
    assert torch.equal(h[:3, 1], h0[:3, 1] + 1)  # the rest of the write stays
    assert torch.equal(h[3:], h0[3:])  # b untouched
    assert _counts(hs) == {"k": 3}


def test_a_failing_op_fails_its_requests_and_the_site_goes_on(lib):
    """Two apps at one site: 'bad' (a user kernel that throws) and 'stamp'. Request a uses
    both, b only stamp, c neither. stamp still runs for a and b after bad failed; only a is
    recorded as failed, with the kernel's message; the next step runs normally."""
    bad = App("bad")
    bad.write("custom", cpu_library=lib, cpu_symbol="always_throws").layers([0]).at("residual.pre")
    stamp = App("stamp")
    stamp.write("custom", cpu_library=lib, cpu_symbol="stamp_position").layers([0]).at(
        "residual.pre"
    )
    hs = Harness(SHAPE, [bad, stamp])
    hs.step(
        {"a": Req(2, 0, 2, ("bad", "stamp")), "b": Req(2, 5, 7, ("stamp",)), "c": Req(1, 0, 1, ())}
    )
    h = torch.ones(5, D)
    hs.run("residual.pre", 0, h, None)
    assert h[:, 2].tolist() == [0.0, 1.0, 5.0, 6.0, 1.0]  # a: positions 0,1; b: 5,6; c untouched
    failed = hs.cb.take_failed()
    assert list(failed) == ["a"]
    assert "'bad'" in failed["a"] and "cannot open its lookup table" in failed["a"]
    assert hs.cb.sites.site_errors == {"bad": 1}
    hs.step({"b": Req(1, 7, 7, ("stamp",)), "c": Req(1, 1, 1, ())})
    h = torch.ones(2, D)
    hs.run("residual.pre", 0, h, None)
    assert h[:, 2].tolist() == [7.0, 1.0] and hs.cb.take_failed() == {}


@pytest.mark.parametrize("kernel", ["reference", "native"])
def test_an_exception_before_the_site_runs_fails_the_sites_requests(monkeypatch, kernel):
    """Anything that raises around the site program fails the requests of the step whose
    apps have ops at the site, instead of leaving the forward: _C itself for the Python
    reference kernel, rows that are not contiguous for both."""
    from xmix.runtime import ops

    steer = App("steer")
    steer.write("add", vector=torch.ones(D)).layers([0]).at("residual.pre")
    other = App("other")
    other.write("add", vector=torch.ones(D)).layers([1]).at("residual.pre")
    hs = Harness(SHAPE, [steer, other])
    hs.step({"a": Req(2, 0, 2, ("steer",)), "b": Req(1, 0, 1, ("other",)), "c": Req(1, 0, 1, ())})

    class Broken:
        def __getattr__(self, name):
            if name == "run_site_cpu":

                def fail(*a):
                    raise MemoryError("no room for scratch rows")

                return fail
            return getattr(ops._C, name)

    if kernel == "reference":
        monkeypatch.setattr(ops, "_C", Broken())
        hs.run_reference("residual.pre", 0, torch.zeros(4, D), None)
        failed = hs.cb.take_failed()
        assert list(failed) == ["a"] and "MemoryError: no room for scratch rows" in failed["a"]
    strided = torch.zeros(D, 4).t()  # 4 rows whose elements are 4 apart
    if kernel == "reference":
        hs.run_reference("residual.pre", 0, strided, None)
    else:
        hs.run("residual.pre", 0, strided, None)
    failed = hs.cb.take_failed()
    assert list(failed) == ["a"] and "rows of contiguous elements" in failed["a"]
    assert strided.eq(0).all()  # nothing of the site ran


# ------------------------------------------------------------------ one offline engine
@pytest.fixture(scope="module")
def llm():
    from engine_util import make_llm, shutdown
    from xmix.models.tiny import tiny_model_path

    engine = make_llm(str(tiny_model_path("tiny-llama")), max_num_seqs=4)
    yield engine
    shutdown(engine)


def _ghost_app(name: str, seed: int) -> App:
    app = App(name)
    app.write(
        "add", vector=torch.randn(256, generator=torch.Generator().manual_seed(seed)), scale=3.0
    ).layers([1]).at("residual.post")
    return app


def _answer(llm, apps) -> list[int]:
    from engine_util import greedy

    return list(greedy(llm, [[1, 17, 29, 41]], 8, [{"apps": apps}])[0].outputs[0].token_ids)


@pytest.mark.engine
def test_an_app_removed_behind_the_registrys_back_heals(llm):
    """vLLM's collective_rpc (what dev-mode /collective_rpc calls) took an app off the
    workers while the frontend's registry kept it: DELETE failed on the workers (500) and a
    new deploy of the name answered 409 forever. Now the undeploy completes where the app
    is gone, and a deploy of a name only a worker still holds takes that copy off first."""
    from engine_util import greedy

    ghost = _ghost_app("ghost", 1)
    info = llm.xmix.deploy(ghost)
    steered = _answer(llm, ["ghost"])
    out = greedy(
        llm, [[1, 17, 29, 41]], 4, [{"apps": ["ghost"], "params": {"ghost": {"scale": 2.0}}}]
    )[0]
    assert out.xmix_applied == {
        "apps": [
            {
                "name": "ghost",
                "version": info["version"],
                "mode": "request",
                "params": {"#0.scale": 2.0},
            }
        ],
        "changed": [],
    }  # offline provenance
    llm.collective_rpc("xmix_undeploy", args=("ghost",))
    llm.xmix.undeploy("ghost")  # before: RuntimeError from the worker
    assert "ghost" not in [a["name"] for a in llm.xmix.apps()]
    llm.xmix.deploy(ghost)
    assert _answer(llm, ["ghost"]) == steered
    llm.xmix.undeploy("ghost")
    # the other way round: a worker holds an app the registry never saw
    other = _ghost_app("hidden", 2)
    llm.collective_rpc(
        "xmix_deploy", args=(program_of(other, llm.xmix.registry.shape), "request", 77)
    )
    info = llm.xmix.deploy(other)  # before: "already deployed" forever
    assert info["version"] != 77
    workers = llm.xmix.status()[0]["apps"]
    assert [(a["name"], a["version"]) for a in workers if a["name"] == "hidden"] == [
        ("hidden", info["version"])
    ]
    assert _answer(llm, ["hidden"]) != _answer(llm, [])
    llm.xmix.undeploy("hidden")


@pytest.mark.engine
def test_a_forged_program_sent_to_the_workers_is_refused_and_the_engine_serves_on(llm):
    """Issue 30: a worker installs the frontend's lowered program without lowering it again
    and checks what it relies on (lang/program_codec.py). Forged programs sent to the workers'
    install path (an artifact shorter than the hidden size the kernel reads, a site the
    model does not have, bytes cut short, an app file instead of a program) are refused
    naming what is wrong; nothing is left installed or prepared, the engine answers as
    before, and a deploy through the control plane goes through."""
    from harness import program_from_parts, program_parts

    shape = llm.xmix.registry.shape
    app = _ghost_app("forged", 3)
    plain = _answer(llm, [])
    good = program_of(app, shape)
    prog, arrays = program_parts(good)
    arrays[prog["ops"][0]["artifacts"]["a0"]] = torch.ones(3)
    short = program_from_parts(prog, arrays)
    prog, arrays = program_parts(good)
    prog["ops"][0]["site_id"] = 10_000
    far = program_from_parts(prog, arrays)
    for data, fragment in [
        (short, r"deploy \(app 'forged'\), op #0 .*reads \[256\]"),
        (far, r"'site_id' must be an int in \[0, 25\)"),
        (good[: len(good) // 2], "header claims|lowered|deploy"),
        (app.to_bytes(), "no 'xmix.program'"),
    ]:
        with pytest.raises(Exception, match=fragment):
            llm.collective_rpc("xmix_deploy", args=(data, "request", 5))
    for status in llm.xmix.status():
        assert "forged" not in [a["name"] for a in status["apps"]]
    assert _answer(llm, []) == plain
    llm.xmix.deploy(app)
    assert _answer(llm, ["forged"]) != plain and _answer(llm, []) == plain
    llm.xmix.undeploy("forged")
