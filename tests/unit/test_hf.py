"""The transformers oracle (xmix.integrations.hf) against math done by hand on unhooked runs.

Expected values come from plain transformers forwards (``output_hidden_states=True`` or
forward hooks of the test's own) and hand-written formulas, never from xmix code paths.
hidden_states[l] of an unhooked run is the input of layer l; hidden_states[l + 1] the output
of layer l for l < n_layers - 1 (the last entry is after the final norm).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from xmix.integrations.hf import RequestError, attach
from xmix.lang.api import App
from xmix.lang.lowering import DeployError
from xmix.models.tiny import tiny_model_path

transformers = pytest.importorskip("transformers")

KINDS = ("tiny-llama", "tiny-qwen3", "tiny-mixtral")
D = 256
THINK, END_THINK = 510, 511


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(kind):
        if kind not in cache:
            path = tiny_model_path(kind)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32
            ).eval()
            tok = transformers.AutoTokenizer.from_pretrained(path)
            cache[kind] = (model, tok)
        return cache[kind]

    return get


def prompt(tok, text="the quick brown fox jumps over the lazy dog"):
    return tok.encode(text)


@torch.no_grad()
def plain_hidden(model, ids):
    out = model(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.logits[0]


@torch.no_grad()
def plain_greedy(model, ids, n):
    """Greedy decoding without any hook, recomputing the whole sequence each step."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def forcing_token(model):
    """A token k whose unembedding row w_k has w_k.w_k > w_k.w_j for every j != k, so adding a
    large multiple of w_k after the final norm makes k the argmax whatever the stream."""
    W = model.lm_head.weight.detach()
    for k in range(3, W.shape[0]):
        dots = W @ W[k]
        if dots[k] > torch.cat([dots[:k], dots[k + 1 :]]).max() + 1.0:
            return k, W[k].clone()
    raise AssertionError("no forcing token in this vocabulary")


def by_pos(res, app, key):
    entry = res[app][key]
    assert entry["positions"] == sorted(entry["positions"]), "values are reported in position order"
    return dict(zip(entry["positions"], entry["values"]))


# ------------------------------------------------------------------------------ writes
@pytest.mark.parametrize("kind", KINDS)
def test_add_at_final_post_steers_generation(models, kind):
    model, tok = models(kind)
    ids = prompt(tok)
    k, wk = forcing_token(model)
    natural = plain_greedy(model, ids, 4)
    assert natural[0] != k
    app = App("force")
    # Only generated tokens are pushed: the first sampled token comes from the last prompt
    # token (a prompt token), so it must be the model's own choice.
    app.write("add", vector=wk, scale=1000.0).at("final.post").cond("generated")
    with attach(model, [app], tokenizer=tok) as att:
        out, res = att.generate(ids, 4, apps=["force"])
        assert out == [natural[0], k, k, k]
        assert res == {}
        # the same app used on every sampled token
        out, _ = att.generate(ids, 3, apps=["force"], params={"force": {"scale": 1000.0}})
        assert out[1:] == [k, k]
        # a request that does not list the app is untouched
        out, _ = att.generate(ids, 4)
        assert out == natural


@pytest.mark.parametrize("kind", ["tiny-llama", "tiny-mixtral"])
def test_detach_restores_the_model_bit_identically(models, kind):
    model, tok = models(kind)
    ids = prompt(tok)
    x = torch.tensor([ids])
    with torch.no_grad():
        before = model(x).logits.clone()
    k, wk = forcing_token(model)
    app = App("every_site")
    u = torch.randn(D, generator=torch.Generator().manual_seed(0))
    app.write("ablate", direction=u).layers("all").at("residual.pre")
    app.write("add", vector=u, scale=0.5).layers([1]).at("attention.post")
    app.write("clamp", direction=u, min=-0.1, max=0.1).layers([2]).at("residual.mid")
    app.write("add", vector=u, scale=0.5).layers([0]).at("mlp.post")
    app.read("probe", weight=u).layers([3]).at("residual.post").named("p")
    app.write("add", vector=wk, scale=1000.0).at("final.post")
    if kind == "tiny-mixtral":
        app.write("router", mask=torch.tensor([1.0, -1.0, 0.0, 0.0])).layers("all").at(
            "router.logits"
        )
    att = attach(model, [app], tokenizer=tok)
    with torch.no_grad():
        inert = model(x).logits.clone()  # the model called outside the attachment
    _, res = att.forward(ids)  # a request without the app
    assert res == {}
    hooked, _ = att.forward(ids, apps=["every_site"])
    assert int(hooked.argmax()) == k
    att.detach()
    with torch.no_grad():
        after = model(x).logits
    assert torch.equal(inert, before)
    assert torch.equal(after, before)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert "forward" not in m.__dict__


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "sites,layers",
    [
        (("residual.pre", "attention.post", "mlp.post"), "all"),
        # residual.mid must be changed in place: HF adds the MLP output to that very tensor
        (("residual.mid", "mlp.post"), [3]),
    ],
)
def test_ablation_leaves_the_stream_orthogonal(models, kind, sites, layers):
    model, tok = models(kind)
    ids = prompt(tok)
    u = torch.randn(D, generator=torch.Generator().manual_seed(1))
    u = u / u.norm()
    app = App("abl")
    for s in sites:
        app.write("ablate", direction=u).layers(layers).at(s)
    app.read("capture").layers([3]).at("residual.post").named("out")
    app.read("capture").at("final.post").named("final")
    hs, _ = plain_hidden(model, ids)
    with attach(model, [app]) as att:
        _, res = att.forward(ids, apps=["abl"])
    out = torch.tensor(res["abl"]["out"]["values"])
    final = torch.tensor(res["abl"]["final"]["values"])
    assert res["abl"]["out"]["positions"] == list(range(len(ids)))
    # RMSNorm with unit weight (the tiny models') keeps orthogonality to u
    assert (out @ u).abs().max() < 1e-4 * out.norm(dim=1).max()
    assert (final @ u).abs().max() < 1e-4 * final.norm(dim=1).max()
    # the unablated stream does have a component along u
    assert (hs[-1] @ u).abs().max() > 1e-2


def test_affine_and_clamp_at_residual_post(models):
    model, tok = models("tiny-qwen3")
    ids = prompt(tok)
    hs, _ = plain_hidden(model, ids)
    g = torch.Generator().manual_seed(2)
    A = torch.randn(D, D, generator=g) / 16
    mus, mut = torch.randn(D, generator=g), torch.randn(D, generator=g)
    u = torch.randn(D, generator=g)
    un = u / u.norm()
    app = App("aff")
    app.write("affine", matrix=A, mu_s=mus, mu_t=mut).layers([1]).at("residual.post").cond("prompt")
    app.read("capture").layers([1]).at("residual.post").named("after_affine")
    app.write("clamp", direction=u, min=-0.5, max=0.25).layers([1]).at("residual.post")
    app.read("capture").layers([1]).at("residual.post").named("after_clamp")
    with attach(model, [app]) as att:
        _, res = att.forward(ids, apps=["aff"])
    x = hs[2]  # the output of layer 1, unhooked
    exp = (x - mus) @ A.T + mut
    got = torch.tensor(res["aff"]["after_affine"]["values"])
    torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)
    p = exp @ un
    exp2 = exp + (p.clamp(-0.5, 0.25) - p)[:, None] * un
    got2 = torch.tensor(res["aff"]["after_clamp"]["values"])
    torch.testing.assert_close(got2, exp2, rtol=1e-4, atol=1e-4)
    assert ((got2 @ un) <= 0.25 + 1e-4).all() and ((got2 @ un) >= -0.5 - 1e-4).all()


# ------------------------------------------------------------------------------ reads
@pytest.mark.parametrize("kind", KINDS)
def test_probe_equals_sigmoid_of_hidden_states(models, kind):
    model, tok = models(kind)
    ids = prompt(tok)
    hs, _ = plain_hidden(model, ids)
    w = torch.randn(D, generator=torch.Generator().manual_seed(3)) / 16
    app = App("pr")
    app.read("probe", weight=w, bias=-0.3).layers([0, 2]).at("residual.post").named("p")
    app.read("probe", weight=w, bias=0.7).layers([1]).at("residual.pre").named("q")
    app.read("distance", centroids=torch.stack([w, -w])).layers([1]).at("residual.pre").named(
        "dist"
    ).cond("not prompt or last_token")
    with attach(model, [app]) as att:
        _, res = att.forward(ids, apps=["pr"], params={"pr": {"q.bias": 0.1}})
    assert set(res["pr"]) == {"p.0", "p.2", "q", "dist"}
    for key, x, b in (("p.0", hs[1], -0.3), ("p.2", hs[3], -0.3), ("q", hs[1], 0.1)):
        vals = by_pos(res, "pr", key)
        assert sorted(vals) == list(range(len(ids)))
        exp = 1.0 / (1.0 + torch.exp(-(x.double() @ w.double() + b)))
        for t in range(len(ids)):
            assert vals[t] == pytest.approx(float(exp[t]), rel=1e-5, abs=1e-6)
    # distance runs only on the last prompt token
    dist = by_pos(res, "pr", "dist")
    t = len(ids) - 1
    assert list(dist) == [t]
    x = hs[1][t].double()
    assert dist[t] == pytest.approx(min(float((x - w).norm()), float((x + w).norm())), rel=1e-5)


def test_capture_residual_mid_and_attention_post(models):
    model, tok = models("tiny-llama")
    ids = prompt(tok)
    seen = {}
    layer = model.model.layers[2]
    h1 = layer.post_attention_layernorm.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("mid", a[0][0].clone())
    )
    h2 = layer.self_attn.register_forward_hook(
        lambda m, a, o: seen.__setitem__("attn", o[0][0].clone())
    )
    with torch.no_grad():
        model(torch.tensor([ids]))
    h1.remove()
    h2.remove()
    app = App("cap")
    app.read("capture", dims=(10, 20)).layers([2]).at("residual.mid").named("mid").cond(
        "last_token"
    )
    app.read("capture").layers([2]).at("attention.post").named("attn")
    with attach(model, [app]) as att:
        _, res = att.forward(ids, apps=["cap"])
    t = len(ids) - 1
    mid = by_pos(res, "cap", "mid")
    assert list(mid) == [t]
    torch.testing.assert_close(torch.tensor(mid[t]), seen["mid"][t, 10:20])
    torch.testing.assert_close(torch.tensor(res["cap"]["attn"]["values"]), seen["attn"])


def _cast(mean: torch.Tensor, v: torch.Tensor) -> float:
    m, v = mean.double(), v.double()
    u = torch.tanh(v * (v @ m) / (v @ v))
    return float((m @ u) / (m.norm() * u.norm()))


@pytest.mark.parametrize("chunk", [None, 3])
def test_cosine_over_the_prompt(models, chunk):
    model, tok = models("tiny-llama")
    ids = prompt(tok)
    hs, _ = plain_hidden(model, ids)
    v = torch.randn(D, generator=torch.Generator().manual_seed(4))
    the = tok.encode(" the", add_special_tokens=False)
    assert len(the) == 1 and the[0] in ids
    app = App("cast")
    app.token_set("the", ids=the)
    app.read("cosine", vector=v).layers([2]).at("residual.pre").named("all_tokens")
    app.read("cosine", vector=v).layers([2]).at("residual.pre").named("the_tokens").cond(
        "token_in(the)"
    )
    with attach(model, [app]) as att:
        gen, res = att.generate(ids, 3, apps=["cast"], chunk=chunk)
    t = len(ids) - 1
    a = by_pos(res, "cast", "all_tokens")
    b = by_pos(res, "cast", "the_tokens")
    assert list(a) == [t] and list(b) == [t]  # one value per request, none for generated tokens
    rows = [i for i, x in enumerate(ids) if x == the[0]]
    assert a[t] == pytest.approx(_cast(hs[2].mean(0), v), abs=1e-5)
    assert b[t] == pytest.approx(_cast(hs[2][rows].mean(0), v), abs=1e-5)


# ------------------------------------------------------------------------------ conditions
def test_gate_fires_on_exactly_the_tokens_whose_read_passes(models):
    model, tok = models("tiny-llama")
    ids = prompt(tok)
    hs, _ = plain_hidden(model, ids)
    w = torch.randn(D, generator=torch.Generator().manual_seed(5)) / 16
    v = torch.randn(D, generator=torch.Generator().manual_seed(6))
    probe = torch.sigmoid(hs[1].double() @ w.double())  # residual.pre of layer 1
    theta = float(probe.median())
    app = App("gated")
    app.param("theta", theta)
    app.read("probe", weight=w).layers([1]).at("residual.pre").named("p")
    app.write("add", vector=v, scale=2.0).layers([2]).at("residual.post").cond(gate="p >= theta")
    app.read("capture").layers([2]).at("residual.post").named("x")
    with attach(model, [app]) as att:
        for th in (theta, float(probe.min()) - 1e-3, 2.0):
            _, res = att.forward(ids, apps=["gated"], params={"gated": {"theta": th}})
            fired = {t for t in range(len(ids)) if probe[t] >= th + 1e-6}
            unsure = {t for t in range(len(ids)) if abs(float(probe[t]) - th) <= 1e-6}
            delta = torch.tensor(res["gated"]["x"]["values"]) - hs[3]
            for t in set(range(len(ids))) - unsure:
                exp = 2.0 * v if t in fired else torch.zeros(D)
                torch.testing.assert_close(delta[t], exp, rtol=1e-4, atol=1e-4)
            if th == 2.0:
                assert fired == set()
            elif th < 0.5 and th < float(probe.min()):
                assert fired == set(range(len(ids)))


def test_gate_on_a_read_that_did_not_run_is_false(models):
    model, tok = models("tiny-llama")
    ids = prompt(tok)
    hs, _ = plain_hidden(model, ids)
    the = tok.encode(" the", add_special_tokens=False)[0]
    v = torch.ones(D)
    app = App("g")
    app.token_set("the", ids=[the])
    app.read("probe", weight=torch.zeros(D)).layers([0]).at("residual.pre").named("p").cond(
        "token_in(the)"
    )
    # sigmoid(0) = 0.5 wherever p ran; "!=" and ">=" must both be false where it did not
    app.write("add", vector=v, scale=1.0).layers([0]).at("residual.post").cond(gate="p >= 0")
    app.write("add", vector=v, scale=10.0).layers([0]).at("residual.post").cond(gate="p != 7")
    app.read("capture", dims=(0, 1)).layers([0]).at("residual.post").named("x")
    with attach(model, [app]) as att:
        _, res = att.forward(ids, apps=["g"])
    p = by_pos(res, "g", "p")
    rows = [t for t, x in enumerate(ids) if x == the]
    assert sorted(p) == rows and all(val == 0.5 for val in p.values())
    x = [val[0] for val in res["g"]["x"]["values"]]
    for t in range(len(ids)):
        exp = float(hs[1][t, 0]) + (11.0 if t in rows else 0.0)
        assert x[t] == pytest.approx(exp, abs=1e-4)


@pytest.mark.parametrize("reduce", ["prompt_mean", "prompt_last"])
def test_latch_is_decided_at_the_last_prompt_token(models, reduce):
    model, tok = models("tiny-qwen3")
    ids = prompt(tok)
    hs, _ = plain_hidden(model, ids)
    w = torch.randn(D, generator=torch.Generator().manual_seed(7)) / 16
    probe = torch.sigmoid(hs[0].double() @ w.double())  # residual.pre of layer 0
    stat = float(probe.mean()) if reduce == "prompt_mean" else float(probe[-1])
    k, wk = forcing_token(model)
    natural = plain_greedy(model, ids, 3)
    P = len(ids)
    for theta, holds in ((stat - 1e-3, True), (stat + 1e-3, False)):
        app = App("latch")
        app.param("theta", theta)
        app.read("probe", weight=w).layers([0]).at("residual.pre").named("p")
        cond = f"{reduce}(p) > theta"
        app.read("capture", dims=(0, 2)).layers([1]).at("residual.mid").named("where").cond(cond)
        app.write("add", vector=wk, scale=1000.0).at("final.post").cond(cond)
        with attach(model, [app]) as att:
            out, res = att.generate(ids, 3, apps=["latch"])
        if holds:
            # false on every prompt token but the last, then held for every generated token
            assert res["latch"]["where"]["positions"] == [P - 1, P, P + 1]
            assert out == [k, k, k]
        else:
            assert "where" not in res["latch"]
            assert out == natural
        assert res["latch"]["p"]["positions"] == list(range(P + 2))


def test_spans_carry_across_forward_passes_and_reset_per_request(models):
    model, tok = models("tiny-llama")
    a, b, c = tok.encode(" the", add_special_tokens=False)[0], 300, 301
    ids = [0, a, b, THINK, c, b, a]  # the span opens at position 3
    P = len(ids)
    W = model.lm_head.weight.detach()
    app = App("span")
    app.token_set("open", ids=[THINK])
    app.token_set("close", ids=[END_THINK])
    app.read("capture", dims=(0, 1)).layers([0]).at("residual.pre").named("inside").cond(
        "in_span(open, close)"
    )
    # push the closer as the second generated token: the first generated token is still
    # inside (state carried from the prompt), the closer and what follows are not
    app.write("add", vector=W[END_THINK], scale=1000.0).at("final.post").cond("generated")
    with attach(model, [app]) as att:
        out, res = att.generate(ids, 4, apps=["span"], chunk=2)
        assert out[0] not in (THINK, END_THINK)
        assert out[1:] == [END_THINK] * 3
        assert res["span"]["inside"]["positions"] == [3, 4, 5, 6, P]
        # a new request starts outside every span
        _, res2 = att.forward([0, a, b, c])
        assert res2 == {}
        _, res3 = att.forward([0, a, END_THINK, b], apps=["span"])
        assert res3 == {}


def test_span_state_is_followed_while_the_app_is_off(models):
    model, tok = models("tiny-qwen3")
    ids = [0, 300, THINK, 301]
    app = App("late")
    app.token_set("open", ids=[THINK])
    app.token_set("close", ids=[END_THINK])
    app.read("capture", dims=(0, 1)).layers([2]).at("mlp.post").named("inside").cond(
        "in_span(open, close)"
    )
    with attach(model, [app], enabled={"late": "off"}) as att:
        req = att.request(ids, apps=["late"])
        logits = req.prefill()
        assert req.results == {}
        att.set_mode("late", "all")  # switched on between steps of a running request
        first = int(logits.argmax())
        assert first not in (THINK, END_THINK)
        for tok_id in (first, 302, END_THINK, 303):  # positions 4, 5, 6, 7
            req.decode(tok_id)
    assert req.results["late"]["inside"]["positions"] == [4, 5]
    with pytest.raises(RuntimeError, match="detached"):
        att.generate(ids, 1)


def test_last_token_and_token_in_flags_over_decode_steps(models):
    model, tok = models("tiny-mixtral")
    ids = prompt(tok)
    P = len(ids)
    k, wk = forcing_token(model)
    app = App("flags")
    app.token_set("k", ids=[k])
    app.read("capture", dims=(0, 1)).layers([0]).at("residual.pre").named("last").cond("last_token")
    app.read("capture", dims=(0, 1)).layers([0]).at("residual.pre").named("gen").cond("generated")
    app.read("capture", dims=(0, 1)).layers([3]).at("mlp.post").named("k_in").cond("token_in(k)")
    app.write("add", vector=wk, scale=1000.0).at("final.post").cond("prompt")
    with attach(model, [app]) as att:
        out, res = att.generate(ids, 4, apps=["flags"])
    assert out[0] == k
    assert res["flags"]["last"]["positions"] == [P - 1, P, P + 1, P + 2]
    assert res["flags"]["gen"]["positions"] == [P, P + 1, P + 2]
    exp_k = [t for t, x in enumerate(ids + out[:-1]) if x == k]
    assert res["flags"]["k_in"]["positions"] == exp_k and P in exp_k


# ------------------------------------------------------------------------------ MoE router
def test_router_mask_forces_and_suppresses_experts(models):
    model, tok = models("tiny-mixtral")
    ids = prompt(tok)
    gate = model.model.layers[1].mlp.gate
    seen = []
    handle = gate.register_forward_hook(lambda m, a, o: seen.append((o[0].clone(), o[2].clone())))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
        plain_logits, plain_idx = seen.pop()
        assert not (plain_idx == 0).any(dim=1).all(), "expert 0 is not already always chosen"
        assert (plain_idx == 3).any()
        the = tok.encode(" the", add_special_tokens=False)[0]
        mask = torch.tensor([1.0, 0.0, 0.0, -1.0])
        app = App("moe")
        app.token_set("the", ids=[the])
        app.write("router", mask=mask, delta=0.05).layers([1]).at("router.logits").cond(
            "not token_in(the)"
        )
        with attach(model, [app]) as att:
            att.forward(ids, apps=["moe"])
            logits, idx = seen.pop()
            # a request without the app goes through the patched router unchanged
            att.forward(ids)
            same_logits, same_idx = seen.pop()
    finally:
        handle.remove()
    assert torch.equal(same_logits, plain_logits) and torch.equal(same_idx, plain_idx)
    sel = torch.tensor([x != the for x in ids])
    assert (~sel).any()
    ls = torch.log_softmax(plain_logits.double(), dim=-1)
    exp = ls.clone()
    exp[:, 0] = ls.max(dim=-1).values + 0.05
    exp[:, 3] = ls.min(dim=-1).values - 0.05
    torch.testing.assert_close(logits[sel].double(), exp[sel], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[~sel], plain_logits[~sel])
    assert torch.equal(idx[~sel], plain_idx[~sel])
    assert (idx[sel] == 0).any(dim=1).all() and not (idx[sel] == 3).any()


def test_router_site_needs_a_known_router(models):
    model, tok = models("tiny-llama")
    app = App("moe")
    app.write("router", mask=torch.ones(4)).layers([0]).at("router.logits")
    with pytest.raises(DeployError, match="mixture-of-experts"):
        attach(model, [app])


# ------------------------------------------------------------------------------ control
def test_modes_params_and_app_order(models):
    model, tok = models("tiny-llama")
    ids = prompt(tok)
    hs, _ = plain_hidden(model, ids)
    e = torch.zeros(D)
    e[0] = 1.0
    first = App("first")
    first.write("add", vector=e, scale=1.0).layers([0]).at("residual.post").named("one")
    first.write("add", vector=e, scale=1.0).layers([0]).at("residual.post").named("two")
    second = App("second")
    # runs after both writes of "first" (apps in attachment order) and doubles the stream
    second.write(
        "affine", matrix=2 * torch.eye(D), mu_s=torch.zeros(D), mu_t=torch.zeros(D)
    ).layers([0]).at("residual.post")
    second.read("capture", dims=(0, 1)).layers([0]).at("residual.post").named("x")
    x0 = float(hs[1][0, 0])

    def x_of(res):
        return res["second"]["x"]["values"][0][0]

    with attach(model, [first, second], enabled={"second": "all"}) as att:
        _, res = att.forward(ids)
        assert x_of(res) == pytest.approx(2 * x0, abs=1e-4)
        _, res = att.forward(ids, apps=["first"])
        assert x_of(res) == pytest.approx(2 * (x0 + 2.0), abs=1e-4)
        _, res = att.forward(ids, apps=["first"], params={"first": {"scale": 3.0}})
        assert x_of(res) == pytest.approx(2 * (x0 + 6.0), abs=1e-4)
        _, res = att.forward(ids, apps=["first"], params={"first": {"two.scale": -1.0}})
        assert x_of(res) == pytest.approx(2 * x0, abs=1e-4)
        att.set_mode("first", "off")
        _, res = att.forward(ids, apps=["first"])
        assert x_of(res) == pytest.approx(2 * x0, abs=1e-4)
        with pytest.raises(RequestError, match="unknown parameter"):
            att.forward(ids, apps=["first"], params={"first": {"bias": 1.0}})
        with pytest.raises(RequestError, match="unknown app"):
            att.forward(ids, apps=["third"])
        with pytest.raises(RequestError, match="finite"):
            att.forward(ids, params={"first": {"scale": float("inf")}})
    with pytest.raises(DeployError, match="attached twice"):
        attach(model, [first, first])
    with pytest.raises(DeployError, match="mode"):
        attach(model, [first], enabled={"first": "sometimes"})


_CUSTOM_C = r"""
#include <stdint.h>
typedef struct {
  void* h; const void* r; int64_t stride_h, stride_r; int32_t n_rows, d, dtype, n_params;
  const uint8_t* select; const int32_t* tok_slot; const int32_t* tok_pos;
  const float* slot_params; int32_t param_base, artifact_numel; const float* artifact; float* out;
} args_t;
/* read: k * h[t][0] + artifact[0]; write: h[t][1] = position */
void read0(const args_t* a) {
  for (int t = 0; t < a->n_rows; ++t) if (a->select[t]) {
    const float* row = (const float*)a->h + t * a->stride_h;
    a->out[t] = a->slot_params[a->param_base] * row[0] + a->artifact[0];
  }
}
void write_pos(const args_t* a) {
  for (int t = 0; t < a->n_rows; ++t) if (a->select[t])
    ((float*)a->h + t * a->stride_h)[1] = (float)a->tok_pos[t];
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build a user kernel")
def test_custom_cpu_kernels(models, tmp_path):
    model, tok = models("tiny-llama")
    ids = prompt(tok)
    hs, _ = plain_hidden(model, ids)
    src = tmp_path / "k.c"
    src.write_text(_CUSTOM_C)
    lib = tmp_path / "libk.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    app = App("cu")
    app.read(
        "custom",
        cpu_library=str(lib),
        cpu_symbol="read0",
        artifact=torch.tensor([0.25]),
        params={"k": 2.0},
    ).layers([0]).at("residual.pre").named("c")
    app.write("custom", cpu_library=str(lib), cpu_symbol="write_pos").layers([0]).at(
        "residual.post"
    ).named("w").cond("not last_token")
    app.read("capture", dims=(1, 2)).layers([0]).at("residual.post").named("x")
    app.read("capture", dims=(1, 2)).layers([1]).at("residual.pre").named("y")
    with attach(model, [app]) as att:
        _, res = att.forward(ids, apps=["cu"], params={"cu": {"c.k": 3.0}})
    c = by_pos(res, "cu", "c")
    for t in range(len(ids)):
        assert c[t] == pytest.approx(3.0 * float(hs[0][t, 0]) + 0.25, rel=1e-6)
    # user kernels of a site run after its built-in ops: the capture sees the old stream
    x = [v[0] for v in res["cu"]["x"]["values"]]
    torch.testing.assert_close(torch.tensor(x), hs[1][:, 1])
    y = [v[0] for v in res["cu"]["y"]["values"]]
    P = len(ids)
    assert y[: P - 1] == [float(t) for t in range(P - 1)]
    assert y[P - 1] == pytest.approx(float(hs[1][P - 1, 1]), abs=1e-6)


# ------------------------------------------------------------------------------ sessions
def _session_apps(tok, d=D):
    g = torch.Generator().manual_seed(7)

    def unit():
        v = torch.randn(d, generator=g)
        return v / v.norm()

    steer = App("steer")
    steer.write("add", vector=unit() * 6.0, scale=1.0).layers([1]).at("residual.post")
    probe = App("probe")
    probe.read("probe", weight=unit() * 0.5, bias=0.1).layers([2]).at("residual.post").named("p2")
    guarded = App("guarded")
    guarded.token_set("trig", ids=sorted(set(tok.encode(" the a e", add_special_tokens=False))))
    guarded.read("probe", weight=unit() * 0.5).layers([1]).at("residual.mid").named("g")
    guarded.write("add", vector=unit() * 8.0, scale=1.0).layers([2]).at("attention.post").cond(
        when="token_in(trig) or generated", gate="g >= 0.5"
    )
    latch = App("latch")
    latch.read("probe", weight=unit() * 0.5).layers([0]).at("residual.post").named("q")
    latch.write("add", vector=unit() * 8.0, scale=1.0).layers([2, 3]).at("residual.pre").cond(
        gate="prompt_mean(q) >= 0.0"
    )
    return [steer, probe, guarded, latch]


SESSION_PROMPTS = [
    "the quick brown fox jumps over the lazy dog and then",
    "She opened the letter",
    "Rivers carry water from the mountains to the sea, where",
]


def _assert_reads_close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for app, reads in want.items():
        assert set(got[app]) == set(reads), what
        for key, o in reads.items():
            assert got[app][key]["positions"] == o["positions"], f"{what}: {app}.{key}"
            torch.testing.assert_close(
                torch.tensor(got[app][key]["values"], dtype=torch.float64),
                torch.tensor(o["values"], dtype=torch.float64),
                rtol=1e-4,
                atol=1e-5,
                msg=f"{what}: {app}.{key}",
            )


@pytest.mark.parametrize("kind", ["tiny-llama", "tiny-gemma2"])
def test_session_generate_of_a_padded_batch_equals_one_request_each(models, kind):
    """transformers' own generate() on 3 left-padded prompts inside a session gives each row
    the tokens and reads Attachment.generate gives that prompt alone."""
    model, tok = models(kind)
    apps = _session_apps(tok)
    names = ["steer", "probe", "guarded", "latch"]
    n_new = 12
    with attach(model, apps, tokenizer=tok) as att:
        single = [att.generate(tok.encode(p), n_new, apps=names) for p in SESSION_PROMPTS]
        tok.padding_side = "left"
        batch = tok(SESSION_PROMPTS, return_tensors="pt", padding=True)
        assert (batch["attention_mask"] == 0).any(), (
            "the prompts differ in length: some rows are padded"
        )
        with att.session(apps=names) as s:
            out = model.generate(
                **batch,
                do_sample=False,
                max_new_tokens=n_new,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id,
            )
        T = batch["input_ids"].shape[1]
        for i, (toks, res) in enumerate(single):
            assert out[i, T:].tolist() == toks, f"row {i}"
            _assert_reads_close(s.results[i], res, f"row {i}")
        # the apps changed something: the same batch without a session differs
        with pytest.warns(UserWarning, match="outside attachment.session"):
            plain = model.generate(
                **batch,
                do_sample=False,
                max_new_tokens=n_new,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id,
            )
        assert not torch.equal(plain, out)


def test_session_plain_forward_with_right_padding(models):
    model, tok = models("tiny-llama")
    apps = _session_apps(tok)
    with attach(model, apps, tokenizer=tok) as att:
        single = [att.forward(tok.encode(p), apps=["probe", "guarded"]) for p in SESSION_PROMPTS]
        tok.padding_side = "right"
        batch = tok(SESSION_PROMPTS, return_tensors="pt", padding=True)
        with att.session(apps=["probe", "guarded"]) as s:
            with torch.no_grad():
                logits = model(**batch).logits
        for i, (last, res) in enumerate(single):
            n = int(batch["attention_mask"][i].sum())
            torch.testing.assert_close(logits[i, n - 1], last, rtol=1e-4, atol=1e-4)
            _assert_reads_close(s.results[i], res, f"row {i}")


def test_outside_a_session_the_model_is_untouched_and_says_so_once(models):
    model, tok = models("tiny-llama")
    x = torch.tensor([tok.encode(SESSION_PROMPTS[0])])
    with torch.no_grad():
        before = model(x).logits.clone()
    att = attach(model, _session_apps(tok), tokenizer=tok, enabled={"steer": "all"})
    try:
        with pytest.warns(UserWarning, match="outside attachment.session") as rec:
            with torch.no_grad():
                after = model(x).logits.clone()
                model(x)
        assert len([w for w in rec if "outside attachment.session" in str(w.message)]) == 1
        assert torch.equal(before, after)
        with att.session(apps=[]):  # "all" mode: the steer runs for every row
            with torch.no_grad():
                steered = model(x).logits
        assert not torch.allclose(steered, before)
        with pytest.raises(RequestError, match="unknown app"):
            att.session(apps=["nope"])
        with pytest.raises(RequestError, match="unknown parameter"):
            att.session(apps=["steer"], params={"steer": {"nope": 1.0}})
    finally:
        att.detach()
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)


# ------------------------------------------------------------------------------ monitors
def _first(seq, ids):
    return next(j for j, x in enumerate(seq) if x in ids)


@pytest.mark.parametrize("where", ["prompt", "last_prompt", "first_generated", "later"])
@pytest.mark.parametrize("chunk", [None, 3])
def test_stop_ends_the_request_with_the_trigger_token(models, where, chunk):
    model, tok = models("tiny-llama")
    ids = prompt(tok)
    P = len(ids)
    natural = plain_greedy(model, ids, 6)
    seq = ids + natural
    hs, _ = plain_hidden(model, seq)
    w = torch.randn(D, generator=torch.Generator().manual_seed(11)) / 16
    probe = torch.sigmoid(hs[1].double() @ w.double())  # residual.pre of layer 1
    # the trigger: the first position holding the token at the chosen position
    at = {"prompt": 2, "last_prompt": P - 1, "first_generated": P, "later": P + 2}[where]
    q = _first(seq, {seq[at]})
    app = App("stopper")
    app.token_set("trig", ids=[seq[at]])
    app.read("probe", weight=w).layers([1]).at("residual.pre").named("p")
    app.stop(when="p >= 0 and token_in(trig)")  # a sigmoid is never below 0
    with attach(model, [app]) as att:
        out, res = att.generate(ids, 6, apps=["stopper"], chunk=chunk)
        free, free_res = att.generate(ids, 6, apps=[], chunk=chunk)
        req = att.request(ids, apps=["stopper"])
        req.prefill(chunk)
    # the request ends with the trigger token: what was sampled before it, nothing after
    assert out == natural[: max(q - P + 1, 0)]
    assert res["!stopped"]["app"] == "stopper" and res["!stopped"]["read"] == "p"
    assert res["!stopped"]["position"] == q
    assert res["!stopped"]["value"] == pytest.approx(float(probe[q]), abs=1e-5)
    # the read is reported to the end of the pass holding the trigger; no pass ran after it
    end = q + 1
    if q < P:
        end = P if chunk is None else min(P, (q // chunk + 1) * chunk)
        assert req.n_done == end and req.stopped["position"] == q
    assert res["stopper"]["p"]["positions"] == list(range(end))
    assert free == natural and "!stopped" not in free_res


@pytest.mark.parametrize("where", ["prompt", "first_generated"])
@pytest.mark.parametrize("chunk", [None, 4])
def test_since_holds_from_the_first_trigger_to_the_end(models, where, chunk):
    model, tok = models("tiny-llama")
    ids = prompt(tok)
    P = len(ids)
    natural = plain_greedy(model, ids, 5)
    seq = ids + natural
    hs, _ = plain_hidden(model, seq)
    k, wk = forcing_token(model)
    at = {"prompt": 3, "first_generated": P}[where]
    q = _first(seq, {seq[at]})
    app = App("switch")
    app.token_set("trig", ids=[seq[at]])
    app.read("probe", weight=torch.zeros(D)).layers([0]).at("residual.post").named("p")
    cond = "since(p >= 0.5 and token_in(trig))"  # sigmoid(0) = 0.5 wherever p runs
    app.read("capture", dims=(0, 2)).layers([1]).at("residual.pre").named("where").cond(cond)
    app.write("add", vector=wk, scale=1000.0).at("final.post").cond(when=cond)
    with attach(model, [app]) as att:
        out, res = att.generate(ids, 5, apps=["switch"], chunk=chunk)
    n_fed = P + 4  # the last generated token is not fed back
    assert res["switch"]["where"]["positions"] == list(range(q, n_fed))
    # the write holds from the trigger on: every token sampled at or after it is k
    first_forced = max(q - P + 1, 0)
    assert out == natural[:first_forced] + [k] * (5 - first_forced)
    assert res["!switched"] == [{"app": "switch", "read": "p", "position": q, "condition": cond}]
    # the stream before the trigger is untouched
    for t, v in zip(res["switch"]["where"]["positions"], res["switch"]["where"]["values"]):
        if t < P:
            torch.testing.assert_close(torch.tensor(v), hs[1][t, :2], rtol=1e-4, atol=1e-4)
