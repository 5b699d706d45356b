"""Every built-in kernel, CPU twin and CUDA twin, against xmix.lang.reference.

Each case runs a step of three requests: "a" (prefill of 5 prompt tokens) and "b" (one
decode token) use the app, "c" (prefill) does not. The op's condition selects a strict
subset of the tokens of "a" and "b"; every other row must come back bit-identical.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import Harness, Req
from xmix.lang import reference as R
from xmix.lang.api import App
from xmix.lang.sites import ModelShape

D = 64
SHAPE = ModelShape(n_layers=3, hidden_size=D, vocab_size=100, n_experts=8, moe_layers=(0, 1, 2))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
}
APPROX = {dt: dict(rel=t["rtol"], abs=t["atol"]) for dt, t in TOL.items()}

# Rows: a = 0..4 (positions 0..4, prompt), b = 5 (position 9, generated, sampled), c = 6..8.
STEP = {"a": Req(5, 0, 5, ("k",)), "b": Req(1, 9, 6, ("k",)), "c": Req(3, 0, 3, ())}
N = 9
APP_ROWS = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
PROMPT = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
LAST = torch.tensor([0, 0, 0, 0, 1, 1, 0, 0, 1], dtype=torch.bool)
# token ids; the token set {7} selects rows 1, 3 and 5 of the app's rows (and row 7 of "c")
IDS = torch.tensor([3, 7, 4, 7, 5, 7, 9, 7, 2], dtype=torch.int32)
IN_SET = IDS == 7


def make(device, dtype, residual=True, width=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, width, generator=g).to(dtype).to(device)
    r = torch.randn(N, width, generator=g).to(dtype).to(device) if residual else None
    return h, r


def run(app, device, submodule, layer, h, r):
    hs = Harness(SHAPE, [app], device)
    hs.step(STEP, IDS)
    hs.run(submodule, layer, h, r)
    return hs


def check_write(h_before, h_after, expected, mask, dtype):
    assert mask.any() and not mask.all(), "the case must select a strict subset"
    m = mask.to(h_after.device)
    # untouched rows: bit-identical
    assert torch.equal(
        h_after[~m].cpu().view(torch.int16 if dtype != torch.float32 else torch.int32),
        h_before[~m].cpu().view(torch.int16 if dtype != torch.float32 else torch.int32),
    )
    torch.testing.assert_close(h_after[m].float().cpu(), expected[m.cpu()].float(), **TOL[dtype])
    assert not torch.equal(h_after[m].cpu(), h_before[m].cpu()), "selected rows must change"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add(backend, dtype):
    v = torch.randn(D, generator=torch.Generator().manual_seed(1))
    app = App("k")
    app.token_set("trig", ids=[7])
    app.write("add", vector=v, scale=1.5).layers([1]).at("residual.pre").cond("token_in(trig)")
    h, r = make(backend, dtype)
    h0 = h.clone()
    run(app, backend, "residual.pre", 1, h, r)
    mask = APP_ROWS & IN_SET
    check_write(h0, h, R.add(h0.cpu(), r.cpu(), mask, v, 1.5), mask, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ablate(backend, dtype):
    d = torch.randn(D, generator=torch.Generator().manual_seed(2))
    app = App("k")
    app.write("ablate", direction=d).layers("all").at("residual.mid").cond("prompt")
    h, r = make(backend, dtype)
    h0 = h.clone()
    run(app, backend, "residual.mid", 2, h, r)
    mask = APP_ROWS & PROMPT
    exp = R.ablate(h0.cpu(), r.cpu(), mask, d)
    check_write(h0, h, exp, mask, dtype)
    # the stream has no component along d any more (up to the dtype's rounding)
    x = R.stream(h.cpu(), r.cpu())[mask]
    u = d / d.norm()
    assert (x @ u).abs().max() < (1e-4 if dtype == torch.float32 else 0.5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_clamp(backend, dtype):
    d = torch.randn(D, generator=torch.Generator().manual_seed(3))
    app = App("k")
    app.write("clamp", direction=d, min=-0.5, max=0.25).layers([0]).at("mlp.post").cond(
        "not last_token"
    )
    h, _ = make(backend, dtype, residual=False)
    h0 = h.clone()
    run(app, backend, "mlp.post", 0, h, None)
    mask = APP_ROWS & ~LAST
    check_write(h0, h, R.clamp(h0.cpu(), None, mask, d, -0.5, 0.25), mask, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_affine(backend, dtype):
    g = torch.Generator().manual_seed(4)
    A = torch.randn(D, D, generator=g) / math.sqrt(D)
    mus, mut = torch.randn(D, generator=g), torch.randn(D, generator=g)
    app = App("k")
    app.write("affine", matrix=A, mu_s=mus, mu_t=mut).layers([2]).at("residual.post").cond(
        "last_token"
    )
    h, r = make(backend, dtype)
    h0 = h.clone()
    run(app, backend, "residual.post", 2, h, r)
    mask = APP_ROWS & LAST
    check_write(h0, h, R.affine(h0.cpu(), r.cpu(), mask, A, mus, mut), mask, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_router(backend, dtype):
    mask_e = torch.tensor([1, 0, -1, 0, 0, -1, 0, 0], dtype=torch.float32)
    app = App("k")
    app.write("router", mask=mask_e, delta=0.05).layers("all").at("router.logits").cond(
        "generated or token_in(t)"
    )
    app.token_set("t", ids=[7])
    h, _ = make(backend, dtype, residual=False, width=8)
    h0 = h.clone()
    run(app, backend, "router.logits", 1, h, None)
    mask = APP_ROWS & (~PROMPT | IN_SET)
    exp = R.router(h0.cpu(), mask, mask_e, 0.05)
    check_write(h0, h, exp, mask, dtype)
    # forced-on expert 0 is now the (joint) top expert of every selected row
    sel = h[mask.to(h.device)].float().cpu()
    assert torch.all(sel[:, 0] >= sel.max(dim=1).values - 1e-6)


def _read_values(hs, key):
    res = hs.drain()
    out = {}
    for req, apps in res.items():
        entry = apps["k"][key]
        out[req] = dict(zip(entry["positions"], entry["values"]))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_probe(backend, dtype):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(D, generator=g) / 4
    app = App("k")
    app.read("probe", weight=w, bias=-0.25).layers([1]).at("residual.pre").named("p").cond(
        "not token_in(s)"
    )
    app.token_set("s", ids=[7])
    h, r = make(backend, dtype)
    h0 = h.clone()
    hs = run(app, backend, "residual.pre", 1, h, r)
    assert torch.equal(h.cpu(), h0.cpu()), "a read never changes the stream"
    vals = _read_values(hs, "p")
    exp = R.probe(R.stream(h0.cpu(), r.cpu()), w, -0.25)
    mask = APP_ROWS & ~IN_SET
    # a: rows 0, 2, 4 at positions 0, 2, 4; b: row 5 is in the set -> nothing
    assert set(vals) == {"a"} and sorted(vals["a"]) == [0, 2, 4]
    for pos, row in ((0, 0), (2, 2), (4, 4)):
        assert mask[row]
        assert vals["a"][pos] == pytest.approx(float(exp[row]), **APPROX[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_distance(backend, dtype):
    g = torch.Generator().manual_seed(6)
    mu = torch.randn(3, D, generator=g)
    app = App("k")
    app.read("distance", centroids=mu).layers([0]).at("attention.post").named("dist")
    h, _ = make(backend, dtype, residual=False)
    hs = run(app, backend, "attention.post", 0, h, None)
    vals = _read_values(hs, "dist")
    exp = R.distance(h.cpu().float(), mu)
    assert sorted(vals) == ["a", "b"]
    assert sorted(vals["a"]) == [0, 1, 2, 3, 4] and sorted(vals["b"]) == [9]
    for pos in range(5):
        assert vals["a"][pos] == pytest.approx(float(exp[pos]), **APPROX[dtype])
    assert vals["b"][9] == pytest.approx(float(exp[5]), **APPROX[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_capture(backend, dtype):
    app = App("k")
    app.read("capture", dims=(4, 12)).layers([2]).at("residual.post").named("cap").cond(
        "last_token"
    )
    h, r = make(backend, dtype)
    hs = run(app, backend, "residual.post", 2, h, r)
    vals = _read_values(hs, "cap")
    x = R.stream(h.cpu(), r.cpu())
    assert sorted(vals) == ["a", "b"] and list(vals["a"]) == [4] and list(vals["b"]) == [9]
    torch.testing.assert_close(torch.tensor(vals["a"][4]), x[4, 4:12], **TOL[dtype])
    torch.testing.assert_close(torch.tensor(vals["b"][9]), x[5, 4:12], **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cosine_over_prompt_chunks(backend, dtype):
    """CAST's score over a prompt split in two chunks equals the score of the whole prompt."""
    g = torch.Generator().manual_seed(7)
    v = torch.randn(D, generator=g)
    app = App("k")
    app.read("cosine", vector=v).layers([1]).at("residual.pre").named("cast")
    hs = Harness(SHAPE, [app], backend)
    x_all = []
    # chunk 1: 3 of 5 prompt tokens (no value yet); chunk 2: the last 2 (value at position 4)
    for chunk, (start, n) in enumerate(((0, 3), (3, 2))):
        h = torch.randn(n, D, generator=g).to(dtype).to(backend)
        r = torch.randn(n, D, generator=g).to(dtype).to(backend)
        x_all.append(R.stream(h.cpu(), r.cpu()))
        hs.step({"a": Req(n, start, 5, ("k",))})
        hs.run("residual.pre", 1, h, r)
        res = hs.drain()
        if chunk == 0:
            assert res == {}
    entry = res["a"]["k"]["cast"]
    assert entry["positions"] == [4]
    exp = R.cast_cosine(torch.cat(x_all).mean(0), v)
    assert entry["values"][0] == pytest.approx(float(exp), **APPROX[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_rows_are_inert(backend):
    """Rows past the step's tokens (CUDA-graph padding) are never touched."""
    v = torch.ones(D)
    app = App("k")
    app.write("add", vector=v, scale=3.0).layers([0]).at("residual.pre")
    hs = Harness(SHAPE, [app], backend)
    hs.step({"a": Req(2, 0, 2, ("k",))}, pad_to=8)
    h = torch.zeros(8, D, device=backend)
    hs.run("residual.pre", 0, h, None)
    assert torch.all(h[:2] == 3.0) and torch.all(h[2:] == 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mode_all_off_and_request_params(backend):
    v = torch.ones(D)
    app = App("k")
    app.write("add", vector=v, scale=1.0).layers([0]).at("residual.pre")
    hs = Harness(SHAPE, [app], backend)
    reqs = {"x": Req(1, 0, 1, ("k",), {"k": {"scale": 4.0}}), "y": Req(1, 0, 1, ())}
    hs.step(reqs)
    h = torch.zeros(2, D, device=backend)
    hs.run("residual.pre", 0, h, None)
    assert h[0, 0].item() == 4.0 and h[1, 0].item() == 0.0
    hs.cb.set_mode("k", "all")
    hs.step(reqs)
    h.zero_()
    hs.run("residual.pre", 0, h, None)
    assert h[0, 0].item() == 4.0 and h[1, 0].item() == 1.0  # y gets the default scale
    hs.cb.set_mode("k", "off")
    hs.step(reqs)
    h.zero_()
    hs.run("residual.pre", 0, h, None)
    assert torch.all(h == 0)


WIDE = ModelShape(n_layers=1, hidden_size=5120, vocab_size=100)


@pytest.mark.parametrize("backend", BACKENDS)
def test_affine_and_probe_at_hidden_size_5120(backend):
    """Hidden size 5 120 (Qwen2.5-14B/32B, Llama-2-13B, Phi-4): on a GPU the site kernel's static
    and dynamic shared memory pass 48 KB together there, so the launch needs the opt-in
    (xmix/smem.h); both twins against the reference, with the affine op that uses the two rows
    of dynamic shared memory."""
    d = WIDE.hidden_size
    g = torch.Generator().manual_seed(5)
    A = torch.eye(d) + torch.randn(d, d, generator=g) / (8 * math.sqrt(d))
    mus, mut = torch.randn(d, generator=g) * 0.1, torch.randn(d, generator=g) * 0.1
    w = torch.randn(d, generator=g) / math.sqrt(d)
    app = App("k")
    app.write("affine", matrix=A, mu_s=mus, mu_t=mut).layers([0]).at("residual.post").cond(
        "last_token"
    )
    app.read("probe", weight=w, bias=0.0).layers([0]).at("residual.post").named("p")
    hs = Harness(WIDE, [app], backend)
    hs.step(STEP, IDS)
    h, r = make(backend, torch.bfloat16, width=d)
    h0 = h.clone()
    hs.run("residual.post", 0, h, r)
    mask = APP_ROWS & LAST
    check_write(h0, h, R.affine(h0.cpu(), r.cpu(), mask, A, mus, mut), mask, torch.bfloat16)
    got = hs.drain()["a"]["k"]["p"]
    want = R.probe(R.stream(h.cpu(), r.cpu())[:5], w, 0.0)  # the read runs after the write
    assert got["positions"] == [0, 1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor(got["values"]), want, rtol=1e-3, atol=1e-3)
