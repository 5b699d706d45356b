"""The SAE kernels (sae read, sae_steer, sae_clamp), CPU twin and CUDA twin, against
xmix.lang.reference (SAELens's conventions, written in plain PyTorch).

Each case runs one step of three requests as tests/unit/test_kernels.py does: "a" (5 prompt
tokens) and "b" (one decode token) use the app, "c" does not. Rows of "c" and rows the
condition leaves out must come back untouched and report nothing.
"""

from __future__ import annotations

import pytest
import torch

from harness import Harness, Req
from xmix.lang import reference as R
from xmix.lang.api import App, AppError
from xmix.lang.lowering import DeployError, lower
from xmix.lang.sae import SAE, SAEError
from xmix.lang.sites import ModelShape

D, F = 64, 300
SHAPE = ModelShape(n_layers=3, hidden_size=D, vocab_size=100)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
}

STEP = {"a": Req(5, 0, 5, ("k",)), "b": Req(1, 9, 6, ("k",)), "c": Req(3, 0, 3, ())}
N = 9
APP_ROWS = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
IDS = torch.tensor([3, 7, 4, 7, 5, 7, 9, 7, 2], dtype=torch.int32)
IN_SET = IDS == 7
ROW_POS = {0: ("a", 0), 1: ("a", 1), 2: ("a", 2), 3: ("a", 3), 4: ("a", 4), 5: ("b", 9)}


def make_sae(arch="relu", norm="none", b_dec_in=True, seed=0, k=12, width=F) -> SAE:
    g = torch.Generator().manual_seed(seed)
    W_enc = torch.randn(D, width, generator=g) / D**0.5
    thr = torch.rand(width, generator=g) * 0.5 if arch == "jumprelu" else None
    return SAE(
        W_enc,
        torch.randn(width, generator=g) * 0.2,
        torch.randn(width, D, generator=g),
        torch.randn(D, generator=g) * 0.3,
        architecture=arch,
        threshold=thr,
        k=k if arch == "topk" else None,
        apply_b_dec_to_input=b_dec_in,
        normalize_activations=norm,
    )


def make_rows(device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, D, generator=g) * 2).to(dtype).to(device)
    r = (torch.randn(N, D, generator=g) * 2).to(dtype).to(device)
    return h, r


def run(app, device, submodule, layer, h, r):
    hs = Harness(SHAPE, [app], device)
    hs.step(STEP, IDS)
    hs.run(submodule, layer, h, r)
    return hs


def by_row(res: dict, key: str) -> dict[int, dict]:
    out = {}
    for row, (req, pos) in ROW_POS.items():
        e = res.get(req, {}).get("k", {}).get(key)
        if e and pos in e["positions"]:
            out[row] = e["values"][e["positions"].index(pos)]
    return out


def assert_top_matches(got: dict, exp: tuple[list[int], list[float]], dtype) -> None:
    ids, acts = exp
    assert got["ids"] == ids, (got, exp)
    torch.testing.assert_close(torch.tensor(got["acts"]), torch.tensor(acts), **TOL[dtype])


CASES = [
    ("relu", "none", True),
    ("jumprelu", "none", False),
    ("topk", "none", True),
    ("relu", "constant_norm_rescale", False),
    ("jumprelu", "layer_norm", True),
    ("topk", "layer_norm", False),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch,norm,b_dec_in", CASES)
def test_top_k_read(backend, dtype, arch, norm, b_dec_in):
    sae = make_sae(arch, norm, b_dec_in)
    app = App("k")
    app.token_set("s", ids=[7])
    app.read("sae", sae=sae, top_k=8).layers([1]).at("residual.pre").named("s18").cond(
        "not token_in(s)"
    )
    h, r = make_rows(backend, dtype)
    h0 = h.clone()
    hs = run(app, backend, "residual.pre", 1, h, r)
    assert torch.equal(h.cpu(), h0.cpu()), "a read never changes the stream"
    got = by_row(hs.drain(), "s18")
    want = APP_ROWS & ~IN_SET
    assert sorted(got) == [i for i in range(N) if want[i]]
    exp = R.sae_top(R.sae_encode(R.stream(h0.cpu(), r.cpu()), sae), 8)
    for row, v in got.items():
        assert_top_matches(v, exp[row], dtype)
        assert 0 < len(v["ids"]) <= (min(8, sae.k) if arch == "topk" else 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_reports_only_active_features(backend):
    """A TopK SAE with k=3 and top_k=8: at most 3 features per token, all active."""
    sae = make_sae("topk", k=3)
    app = App("k")
    app.read("sae", sae=sae, top_k=8).layers([0]).at("mlp.post").named("s")
    h, _ = make_rows(backend, torch.float32)
    hs = run(app, backend, "mlp.post", 0, h, None)
    got = by_row(hs.drain(), "s")
    acts = R.sae_encode(h.cpu(), sae)
    assert sorted(got) == list(range(6))
    for row, v in got.items():
        assert v["ids"] == R.sae_top(acts, 8)[row][0]
        assert len(v["ids"]) == int((acts[row] > 0).sum()) <= 3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "arch,norm", [("relu", "none"), ("jumprelu", "layer_norm"), ("topk", "none")]
)
def test_features_read_and_gate(backend, dtype, arch, norm):
    """features=[...] reports those activations; a later op gates on one of them."""
    sae = make_sae(arch, norm)
    x_probe = R.sae_encode(R.stream(*[t.cpu() for t in make_rows("cpu", dtype)]), sae)
    feats = [int(i) for i in x_probe[:6].sum(0).argsort(descending=True)[:3]] + [5]
    thr = float(x_probe[:6, feats[0]].median())
    app = App("k")
    app.read("sae", sae=sae, features=feats).layers([2]).at("residual.post").named("sf")
    v = torch.zeros(D)
    v[0] = 1.0
    app.write("add", vector=v, scale=1.0).layers([2]).at("residual.post").cond(
        gate=f"sf.f{feats[0]} > {thr}"
    )
    h, r = make_rows(backend, dtype)
    h0 = h.clone()
    hs = run(app, backend, "residual.post", 2, h, r)
    acts = R.sae_encode(R.stream(h0.cpu(), r.cpu()), sae)[:, feats]
    got = by_row(hs.drain(), "sf")
    assert sorted(got) == list(range(6))
    for row, val in got.items():
        assert val["ids"] == feats
        torch.testing.assert_close(torch.tensor(val["acts"]), acts[row], **TOL[dtype])
    fired = torch.tensor([got[i]["acts"][0] > thr if i in got else False for i in range(N)])
    assert fired.any() and not fired[:6].all()
    changed = (h.cpu().float() - h0.cpu().float())[:, 0] != 0
    assert torch.equal(changed, fired)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_membership_at_the_boundary(backend):
    """TopK SAE, features read: the k-th largest pre-activation is active, the (k+1)-th is not."""
    sae = make_sae("topk", k=12)
    h, r = make_rows("cpu", torch.float32)
    pre = R.sae_pre(R.stream(h, r), sae)[0]
    order = torch.sort(pre, descending=True, stable=True).indices
    inside, outside = int(order[11]), int(order[12])
    assert pre[inside] > 0 and pre[outside] > 0, (
        "both candidates must have a positive pre-activation"
    )
    app = App("k")
    app.read("sae", sae=sae, features=[inside, outside]).layers([0]).at("residual.pre").named("b")
    hs = run(app, backend, "residual.pre", 0, h.to(backend), r.to(backend))
    got = by_row(hs.drain(), "b")[0]["acts"]
    assert got[0] == pytest.approx(float(pre[inside]), rel=1e-5) and got[1] == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "arch,norm", [("relu", "none"), ("jumprelu", "constant_norm_rescale"), ("topk", "layer_norm")]
)
def test_sae_clamp(backend, dtype, arch, norm):
    sae = make_sae(arch, norm)
    x = R.stream(*[t.cpu() for t in make_rows("cpu", dtype)])
    active = R.sae_encode(x, sae)[:6]
    # one feature active on some rows, one never active: both are set to the value
    feats = [int(active.sum(0).argmax()), int(active.sum(0).argmin())]
    app = App("k")
    app.write("sae_clamp", sae=sae, feature=feats, value=1.5).layers([1]).at("residual.mid").cond(
        "prompt or token_in(s)"
    )
    app.token_set("s", ids=[7])
    h, r = make_rows(backend, dtype)
    h0 = h.clone()
    run(app, backend, "residual.mid", 1, h, r)
    mask = APP_ROWS.clone()
    exp = R.sae_clamp(h0.cpu(), r.cpu(), mask, sae, feats, 1.5)
    m = mask.to(h.device)
    assert torch.equal(h[~m].cpu(), h0[~m].cpu())
    assert not torch.equal(h[m].cpu(), h0[m].cpu())
    torch.testing.assert_close(h[m].float().cpu(), exp[mask].float(), **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sae_clamp_keeps_the_error_term(backend):
    """Clamping to the current activation is a no-op (the error term and every other
    feature stay); clamping to c moves the reconstruction by (c - a) W_dec[f] exactly."""
    sae = make_sae("relu", b_dec_in=False)
    h, _ = make_rows(backend, torch.float32)
    acts = R.sae_encode(h.cpu(), sae)
    f = int(acts[:6].sum(0).argmax())
    app = App("k")
    app.write("sae_clamp", sae=sae, feature=f, value=0.0).layers([0]).at("residual.pre")
    h0 = h.clone()
    hs = Harness(SHAPE, [app], backend)
    hs.step(STEP, IDS)
    hs.run("residual.pre", 0, h, None)
    diff = (h - h0).cpu()[:6]
    torch.testing.assert_close(diff, -acts[:6, f : f + 1] * sae.W_dec[f], rtol=1e-5, atol=1e-5)
    # clamp to the activation the row has: nothing moves beyond rounding
    h1 = h0.clone()
    hs.step(STEP, IDS)
    cb_value = float(acts[0, f])
    hs.cb.set_params("k", {"value": cb_value})
    hs.run("residual.pre", 0, h1, None)
    assert (h1 - h0).cpu()[0].abs().max() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_sae_steer_is_add_of_decoder_rows(backend):
    sae = make_sae("jumprelu")
    app = App("k")
    app.write("sae_steer", sae=sae, feature=[4, 9], scale=2.5).layers([0]).at("residual.post").cond(
        "generated"
    )
    h, r = make_rows(backend, torch.float32)
    h0 = h.clone()
    run(app, backend, "residual.post", 0, h, r)
    mask = torch.tensor([0, 0, 0, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
    exp = R.add(h0.cpu(), r.cpu(), mask, sae.W_dec[4] + sae.W_dec[9], 2.5)
    torch.testing.assert_close(h.cpu(), exp, rtol=1e-6, atol=1e-6)
    assert torch.equal(h.cpu()[~mask], h0.cpu()[~mask])


@pytest.mark.parametrize("backend", BACKENDS)
def test_latch_on_sae_feature(backend):
    """prompt_mean over a feature read decides a write at a later site."""
    sae = make_sae("relu")
    h, r = make_rows("cpu", torch.float32)
    acts = R.sae_encode(R.stream(h, r), sae)
    f = int(acts[:5].sum(0).argmax())
    mean = float(acts[:5, f].mean())
    app = App("k")
    app.param("theta", mean - 0.01)
    app.read("sae", sae=sae, features=[f]).layers([0]).at("residual.post").named("q")
    app.write("add", vector=torch.ones(D), scale=1.0).layers([1]).at("residual.pre").cond(
        gate=f"prompt_mean(q.f{f}) >= theta"
    )
    for theta, expect in ((mean - 0.01, True), (mean + 0.01, False)):
        hs = Harness(SHAPE, [app], backend)
        hs.cb.set_params("k", {"theta": theta})
        hs.step({"a": Req(5, 0, 5, ("k",))})
        ha, ra = h[:5].clone().to(backend), r[:5].clone().to(backend)
        hs.run("residual.post", 0, ha, ra)
        x = torch.zeros(5, D, device=backend)
        hs.run("residual.pre", 1, x, None)
        # decided at the last prompt token (a later site than the read)
        assert bool(x[4, 0] == 1.0) == expect and torch.all(x[:4] == 0)


# ---------------------------------------------------------------- API, storage, errors
def test_sae_file_round_trip(tmp_path):
    sae = make_sae("jumprelu", "layer_norm")
    sae.hook = "layers.1.residual.post"
    sae.metadata = {"source": "test"}
    p = sae.save(tmp_path / "s.safetensors")
    back = SAE.load(p)
    for k, t in sae.tensors().items():
        assert torch.equal(back.tensors()[k], t)
    assert back.config() == sae.config()
    raw = p.read_bytes()
    assert b"pickle" not in raw and raw[8:9] == b"{"


def test_app_stores_a_shared_sae_once(tmp_path):
    sae = make_sae("topk")
    sae.hook = "layers.2.mlp.post"
    app = App("shared")
    app.read("sae", sae=sae, top_k=4).named("s")  # placed at the SAE's hook
    app.write("sae_clamp", sae=sae, feature=[1, 2], value=3.0).named("c")
    app.write("sae_steer", sae=sae, feature=7, scale=-1.0).layers([0]).at("residual.pre")
    assert app.ops[0].site == "mlp.post" and app.ops[0].layer_spec == [2]
    names = sorted(app.tensors())
    assert [n for n in names if n.startswith("sae")] == [
        "sae0.W_dec",
        "sae0.W_enc",
        "sae0.b_dec",
        "sae0.b_enc",
    ]
    back = App.load(app.save(tmp_path / "a.xmix"))
    assert back.ops[0].sae is back.ops[1].sae is back.ops[2].sae
    assert back.spec() == app.spec()
    lw = lower(back, SHAPE)
    read, clamp = lw.reads["s"], [o for o in lw.ops if o.kernel == "sae_clamp"][0]
    assert read.artifacts["a0"] is clamp.artifacts["a0"], "one fp32 copy per SAE"
    # over the network (allow_custom=False) an SAE app is plain data and loads
    App.from_bytes(app.to_bytes(), allow_custom=False)


@pytest.mark.parametrize(
    "build,msg",
    [
        (lambda a, s: a.read("sae", sae=s), "exactly one of top_k"),
        (lambda a, s: a.read("sae", sae=s, top_k=0), "top_k must be"),
        (lambda a, s: a.read("sae", sae=s, top_k=4, features=[1]), "exactly one of top_k"),
        (lambda a, s: a.read("sae", sae=s, features=[1, 1]), "names a feature twice"),
        (lambda a, s: a.read("sae", sae=s, features=[F]), "out of range"),
        (lambda a, s: a.read("sae", sae=s, features=list(range(65))), "at most 64"),
        (lambda a, s: a.write("sae_clamp", sae=s, value=1.0), "needs feature"),
        (lambda a, s: a.read("sae", sae=torch.zeros(3), top_k=2), "needs sae=<xmix.SAE>"),
    ],
)
def test_sae_op_errors(build, msg):
    with pytest.raises(AppError, match=msg):
        build(App("e"), make_sae())


def test_sae_deploy_errors():
    app = App("e")
    app.read("sae", sae=make_sae(), top_k=4).layers([0, 1]).at("residual.post")
    with pytest.raises(DeployError, match="give one layer"):
        lower(app, SHAPE)
    app = App("e")
    app.read("sae", sae=make_sae(), top_k=4).layers([0]).at("residual.post")
    with pytest.raises(DeployError, match="width 64, the model's hidden size is 32"):
        lower(app, ModelShape(n_layers=3, hidden_size=32, vocab_size=100))
    app = App("e")
    app.read("sae", sae=make_sae(), features=[1, 2]).layers([0]).at("residual.post").named("s")
    app.write("add", vector=torch.ones(D)).layers([1]).at("residual.pre").cond(gate="s > 1")
    with pytest.raises(DeployError, match="reads 2 SAE features; name one: s.f1, s.f2"):
        lower(app, SHAPE)
    with pytest.raises(AppError, match="no fixed direction"):
        App("e").write("sae_steer", sae=make_sae(norm="layer_norm"), feature=1)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(architecture="gated"), "not supported"),
        (dict(architecture="jumprelu"), "needs a per-feature 'threshold'"),
        (dict(architecture="topk", k=0), "needs k with"),
        (dict(normalize_activations="expected_average_only_in"), "fold a constant scaling factor"),
        (dict(b_dec=torch.zeros(D + 1)), "'b_dec' has shape"),
        (dict(b_enc=torch.full((F,), float("nan"))), "NaN or Inf"),
        (dict(hook="blocks.3.hook_resid_post"), "not an xmix site"),
    ],
)
def test_sae_construction_errors(kw, msg):
    g = torch.Generator().manual_seed(0)
    args = dict(
        W_enc=torch.randn(D, F, generator=g),
        b_enc=torch.zeros(F),
        W_dec=torch.randn(F, D, generator=g),
        b_dec=torch.zeros(D),
    )
    args.update(kw)
    with pytest.raises(SAEError, match=msg):
        SAE(args.pop("W_enc"), args.pop("b_enc"), args.pop("W_dec"), args.pop("b_dec"), **args)


def test_app_file_with_a_broken_sae_is_refused():
    import json

    from safetensors.torch import load, save

    sae = make_sae()
    app = App("b")
    app.read("sae", sae=sae, top_k=2).layers([0]).at("residual.post")
    data = app.to_bytes()
    tensors = load(data)
    spec = app.spec()
    spec_missing = dict(spec, ops=[dict(spec["ops"][0], sae="sae9")])
    with pytest.raises(AppError, match="names SAE 'sae9' that the file does not contain"):
        App.from_bytes(save(tensors, metadata={"xmix.spec": json.dumps(spec_missing)}))
    no_dec = {k: v for k, v in tensors.items() if k != "sae0.W_dec"}
    with pytest.raises(AppError, match=r"SAE tensors missing: \['W_dec'\]"):
        App.from_bytes(save(no_dec, metadata={"xmix.spec": json.dumps(spec)}))
    bad = dict(tensors, **{"sae0.b_enc": torch.zeros(F + 1)})
    with pytest.raises(AppError, match="'b_enc' has shape"):
        App.from_bytes(save(bad, metadata={"xmix.spec": json.dumps(spec)}))
