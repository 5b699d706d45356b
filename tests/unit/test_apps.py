"""The seven paper apps (xmix.apps) and the math that derives their artifacts.

(a) every app built from random artifacts of the right shapes, saved, loaded and lowered on
the tiny models; (b) the derivation math against hand-computed results; (c) clear errors for
arguments that cannot work; (d) artifacts derived from examples/prompts on the tiny model,
run through the transformers integration, checked against the intervention's definition.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from xmix.apps import (
    APPS,
    MONITORS,
    SCHEMAS,
    cast,
    kl_then_steer,
    refusal,
    sake,
    seal,
    steer_moe,
    truth_probe,
)
from xmix.apps import artifacts as ART
from xmix.apps import derive as D
from xmix.lang import conditions as C
from xmix.lang.api import App, AppError
from xmix.lang.lowering import DeployError, latch_from_generated, lower
from xmix.lang.sites import ModelShape, site_id
from xmix.models.tiny import tiny_model_path

F64 = torch.float64


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-mixtral"])
def model(request):
    path = tiny_model_path(request.param)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
    return request.param, shape, AutoTokenizer.from_pretrained(path)


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    return t / t.norm(dim=-1, keepdim=True)


def _random_apps(d: int, seed: int = 0) -> dict[str, tuple[App, dict]]:
    """Each app with the artifacts it was built from."""
    g = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=g)

    m = rn(d, d)
    art = {
        "refusal": {"direction": rn(d)},
        "refusal_add": {"direction": rn(d)},
        "seal": {"vector": rn(d)},
        "cast": {"v": rn(d), "u": rn(2, d)},
        "truth_probe": {"w": rn(d), "b": 0.25},
        "sake": {"A": m @ m.T / d, "mu_s": rn(d), "mu_t": rn(d)},
        "kl_then_steer": {
            "u": _unit_rows(rn(3, d)),
            "s": torch.tensor([0.5, 1.0, 2.0]),
            "w": rn(d),
        },
    }
    apps = {
        "refusal": refusal(art["refusal"]["direction"]),
        "refusal_add": refusal(
            art["refusal_add"]["direction"], variant="add", layer=2, coeff=-1.0, name="refusal_add"
        ),
        "seal": seal(art["seal"]["vector"], 2),
        "cast": cast(
            art["cast"]["v"],
            art["cast"]["u"],
            condition_layer=1,
            behavior_layers=[2, 3],
            threshold=0.04,
            comparator=">",
        ),
        "truth_probe": truth_probe(art["truth_probe"]["w"], art["truth_probe"]["b"], 2),
        "sake": sake(art["sake"]["A"], art["sake"]["mu_s"], art["sake"]["mu_t"], 3.0),
        "kl_then_steer": kl_then_steer(
            art["kl_then_steer"]["u"],
            art["kl_then_steer"]["s"],
            art["kl_then_steer"]["w"],
            -0.5,
            probe_layer=0,
            layers=[1, 2, 3],
            coeff=2.0,
            threshold=0.7,
        ),
    }
    return {k: (apps[k], art[k]) for k in apps}


# ============================================================================ (a) build, save, lower
def test_registry_has_the_seven_apps_with_schemas():
    assert list(APPS) == [
        "refusal",
        "seal",
        "cast",
        "truth_probe",
        "sake",
        "kl_then_steer",
        "steer_moe",
    ]
    assert set(SCHEMAS) == set(APPS) | set(MONITORS)
    for schema in SCHEMAS.values():
        assert schema.source["arxiv"] and schema.source["repo"].startswith("https://github.com/")
        assert schema.artifacts and schema.collect and schema.derive


def test_round_trip_and_lowering(model, tmp_path):
    kind, shape, tok = model
    d, L = shape.hidden_size, shape.n_layers
    for key, (app, art) in _random_apps(d).items():
        path = app.save(tmp_path / f"{key}.xmix")
        loaded = App.load(path)
        assert loaded.spec() == app.spec()
        assert loaded.tensors().keys() == app.tensors().keys()
        for k, t in app.tensors().items():
            assert torch.equal(loaded.tensors()[k], t)
        assert json.loads(json.dumps(loaded.metadata)) == app.metadata
        assert loaded.metadata["xmix_app"] == ("refusal" if key == "refusal_add" else key)
        assert loaded.metadata["hidden_size"] == d
        lw = lower(loaded, shape, tok)
        by_kernel = {}
        for op in lw.ops:
            by_kernel.setdefault(op.kernel, []).append(op)

        if key == "refusal":
            # 3 sites x every layer, the direction normalised for the projection
            assert sorted((o.site, o.layer) for o in lw.ops) == sorted(
                (s, l) for s in ("residual.pre", "attention.post", "mlp.post") for l in range(L)
            )
            r = art["direction"]
            for o in lw.ops:
                assert o.kernel == "ablate" and o.cond is None
                torch.testing.assert_close(o.artifacts["a0"], r / r.norm())
        elif key == "refusal_add":
            (o,) = lw.ops
            assert (o.kernel, o.site, o.layer, dict(o.params)["scale"]) == (
                "add",
                "residual.pre",
                2,
                -1.0,
            )
            torch.testing.assert_close(o.artifacts["a0"], art["direction"])
        elif key == "seal":
            (o,) = lw.ops
            assert (o.kernel, o.site, o.layer) == ("add", "residual.pre", 2)
            nl2 = tok.encode("\n\n", add_special_tokens=False)
            assert len(nl2) == 1 and nl2[0] in lw.token_sets["nl2"]
            assert all("\n\n" in tok.decode([i]) for i in lw.token_sets["nl2"])
            assert lw.token_sets["think_open"] == tok.encode("<think>", add_special_tokens=False)
            assert lw.token_sets["think_close"] == tok.encode("</think>", add_special_tokens=False)
            assert lw.spans == [("think_open", "think_close")]
            assert C.TokenIn("nl2") in set(C.walk(o.cond))
            assert lw.stateful  # the span flag must see every prompt token
        elif key == "cast":
            (rd,) = by_kernel["cosine"]
            assert (rd.site, rd.layer, rd.result_key) == ("residual.pre", 1, "cast_sim")
            adds = sorted(by_kernel["add"], key=lambda o: o.layer)
            assert [(o.site, o.layer) for o in adds] == [("residual.pre", 2), ("residual.pre", 3)]
            for i, o in enumerate(adds):
                torch.testing.assert_close(o.artifacts["a0"], art["u"][i])
                assert o.cond == C.Latch("prompt_last", "cast_sim", ">", "theta")
            assert lw.app_params == {"theta": 0.04}
        elif key == "truth_probe":
            (o,) = lw.ops
            assert (o.kernel, o.site, o.layer, o.result_key) == ("probe", "mlp.post", 2, "truth")
            assert o.cond == C.Flag("generated") and dict(o.params)["bias"] == 0.25
        elif key == "sake":
            dist, aff = lw.ops
            final = site_id("final.post", None, L)
            assert (dist.kernel, dist.site_id, dist.result_key, dist.n) == (
                "distance",
                final,
                "dist",
                1,
            )
            assert (aff.kernel, aff.site_id) == ("affine", final)
            torch.testing.assert_close(dist.artifacts["a0"], art["mu_s"])
            assert aff.cond == C.And(C.Flag("last_token"), C.Gate("dist", "<=", "t"))
            assert lw.app_params == {"t": 3.0}
        elif key == "kl_then_steer":
            (rd,) = by_kernel["probe"]
            assert (rd.site, rd.layer, rd.result_key) == ("residual.post", 0, "kts_probe")
            adds = sorted(by_kernel["add"], key=lambda o: o.layer)
            assert [o.layer for o in adds] == [1, 2, 3]
            for i, o in enumerate(adds):
                torch.testing.assert_close(o.artifacts["a0"], art["s"][i] * art["u"][i])
                assert dict(o.params)["scale"] == 2.0
                assert o.cond == C.Latch("prompt_mean", "kts_probe", ">=", "threshold")
            assert lw.app_params == {"threshold": 0.7}


def test_steer_moe_lowers_on_moe_only(model):
    kind, shape, tok = model
    g = torch.Generator().manual_seed(1)
    mask = torch.randint(-1, 2, (shape.n_layers, 4), generator=g).float()
    app = App.from_bytes(steer_moe(mask, delta=0.02).to_bytes())
    if not shape.n_experts:
        with pytest.raises(DeployError, match="mixture-of-experts"):
            lower(app, shape, tok)
        return
    lw = lower(app, shape, tok)
    assert [(o.kernel, o.site, o.layer) for o in lw.ops] == [
        ("router", "router.logits", l) for l in shape.moe_layers
    ]
    for o in lw.ops:
        torch.testing.assert_close(o.artifacts["a0"], mask[o.layer])
        assert dict(o.params)["delta"] == pytest.approx(0.02) and o.n == shape.n_experts


def test_paper_model_defaults_and_metadata():
    d = 4096
    g = torch.Generator().manual_seed(2)
    v = torch.randn(d, generator=g)
    app = seal(v, model="Qwen/Qwen3-8B")
    assert app.ops[0].layer_spec == [26]
    assert app.metadata["model"] == "Qwen/Qwen3-8B" and app.metadata["n_layers"] == 36
    assert app.metadata["source"]["arxiv"] == "2504.07986"
    app = refusal(v, variant="add", model="meta-llama/Llama-3.1-8B-Instruct")
    assert app.ops[0].layer_spec == [12]
    app = cast(v, v, threshold=0.03, model="mistralai/Mixtral-8x7B-Instruct-v0.1")
    assert app.ops[0].layer_spec == [7] and app.ops[1].layer_spec == list(range(15, 24))
    u = _unit_rows(torch.randn(19, d, generator=g))
    app = kl_then_steer(u, torch.ones(19), v, 0.0, model="llama-3.1-8b-instruct")
    assert app.ops[0].layer_spec == [2] and app.ops[1].layer_spec == list(range(3, 22))
    assert (
        steer_moe(torch.zeros(32, 8), model="mistralai/Mixtral-8x7B-Instruct-v0.1").metadata[
            "hidden_size"
        ]
        == 4096
    )
    with pytest.raises(AppError, match="hidden size 256 but Qwen/Qwen3-8B has 4096"):
        seal(torch.ones(256), model="Qwen/Qwen3-8B")


# ============================================================================ (b) derivation math
def test_mean_difference_known_vectors():
    pos = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    neg = torch.tensor([[0.0, 0.0], [2.0, 2.0], [4.0, -2.0]])
    assert D.mean_difference(pos, neg).tolist() == [0.0, 3.0]
    # [N, L, d]: one difference per layer
    pos3 = torch.stack([pos, 2 * pos], dim=1)
    neg3 = torch.stack([neg, -neg], dim=1)
    assert D.mean_difference(pos3, neg3).tolist() == [[0.0, 3.0], [6.0, 6.0]]


def test_seal_vector_pools_reflection_and_transition():
    execution = torch.tensor([[2.0, 0.0], [4.0, 0.0]])  # mean (3, 0)
    reflection = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    transition = torch.tensor([[0.0, 3.0]])  # pooled R ∪ T mean (0, 1)
    assert D.seal_vector(execution, reflection, transition).tolist() == [3.0, -1.0]
    assert D.seal_vector(execution, reflection).tolist() == [3.0, 0.0]


def test_select_refusal_direction_filters_like_arditi():
    P, L, d = 2, 5, 3
    cand = torch.arange(P * L * d, dtype=torch.float32).reshape(P, L, d)
    bypass = torch.tensor([[0.5, -2.0, 0.1, -1.0, -9.0], [-3.0, -1.5, float("nan"), -1.5, 0.0]])
    induce = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0], [-0.1, 1.0, 1.0, 1.0, 1.0]])
    kl = torch.tensor([[0.0, 0.2, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.05, 0.0]])
    # (0,4): last 20% of layers; (0,1): KL 0.2; (1,0): induce < 0; (1,2): NaN.
    # Left: (0,0) 0.5, (0,2) 0.1, (0,3) -1.0, (1,1) -1.5, (1,3) -1.5 -> tie, earlier layer wins.
    p, layer, direction = D.select_refusal_direction(cand, bypass, induce, kl)
    assert (p, layer) == (1, 1)
    assert torch.equal(direction, cand[1, 1])


def _planted_pairs(g, n, d, u, scale=3.0, noise=0.05):
    base = torch.randn(n, d, generator=g, dtype=F64) * scale
    a = torch.rand(n, generator=g, dtype=F64) + 1.0
    eps = lambda: torch.randn(n, d, generator=g, dtype=F64) * noise  # noqa: E731
    return base + 0.5 * a[:, None] * u + eps(), base - 0.5 * a[:, None] * u + eps()


def test_pca_recovers_planted_direction_with_cast_sign():
    g = torch.Generator().manual_seed(3)
    d, n = 24, 30
    u = torch.randn(d, generator=g, dtype=F64)
    u /= u.norm()
    pos, neg = _planted_pairs(g, n, d, u)
    v = D.pca_direction(pos, neg, method="pairwise").double()
    assert v.norm().item() == pytest.approx(1.0, abs=1e-6) and float(v @ u) > 0.99
    # "diff" removes the mean difference first; only the spread of the pair offsets along u
    # (a ~ U[1, 2]) is left to find it, so it is less exact on the same data
    assert float(D.pca_direction(pos, neg, method="diff").double() @ u) > 0.95
    assert float(D.pca_direction(neg, pos).double() @ u) < -0.98  # sign follows the positives
    # one PC per layer for [N, L, d]
    w = torch.randn(d, generator=g, dtype=F64)
    w /= w.norm()
    pos2, neg2 = _planted_pairs(g, n, d, w)
    v = D.pca_direction(torch.stack([pos, pos2], 1), torch.stack([neg, neg2], 1)).double()
    assert v.shape == (2, d) and float(v[0] @ u) > 0.98 and float(v[1] @ w) > 0.98


def test_pca_sign_is_cast_majority_vote_not_the_mean():
    # Every pair differs along e1 only: two pairs by +1, one by -5. CAST keeps the direction
    # along which most positives project higher (+e1) although the mean difference is -1.
    pos = torch.tensor([[1.0, 0.0], [1.0, 1.0], [-5.0, 2.0]])
    neg = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 2.0]])
    v = D.pca_direction(pos, neg, method="pairwise")
    torch.testing.assert_close(v, torch.tensor([1.0, 0.0]))


def test_cast_similarity_hand_values():
    e1 = torch.tensor([1.0, 0.0])
    # P m = (m1, 0); tanh(P m) = (tanh m1, 0); cos = m1 tanh(m1) / (|m| |tanh m1|) = |m1| / |m|
    scores = D.cast_similarity(torch.tensor([[3.0, 4.0], [-3.0, 4.0], [0.0, 5.0]]), e1)
    torch.testing.assert_close(scores, torch.tensor([0.6, 0.6, 0.0], dtype=F64))
    # m along v = (1, 1): tanh(P m) = tanh(1)(1, 1) is parallel to m
    assert float(
        D.cast_similarity(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]))
    ) == pytest.approx(1.0)


def test_cast_threshold_grid_search_by_hand():
    fit = D.cast_threshold([0.3, 0.4, 0.5], [0.05, 0.1, 0.15])
    # "fire when score > θ": every θ in [0.15, 0.3) separates; the grid's first is 0.15
    assert (fit.threshold, fit.comparator, fit.cast_direction, fit.f1) == (
        0.15,
        ">",
        "smaller",
        1.0,
    )
    fit = D.cast_threshold([0.05, 0.1], [0.3, 0.4])
    # "fire when score < θ": θ must exceed 0.1 (strict), first grid point 0.11
    assert (fit.threshold, fit.comparator, fit.cast_direction, fit.f1) == (0.11, "<", "larger", 1.0)
    # not separable: positives 0.05, 0.2 around the negative 0.1. Firing on everything
    # (θ = 0, "score > θ") gives tp 2, fp 1: F1 = 0.8; no θ does better (one positive alone
    # gives 2/3, a positive and the negative 1/2), and "larger" is tried first at θ = 0 but
    # fires on nothing there.
    fit = D.cast_threshold([0.2, 0.05], [0.1])
    assert (fit.threshold, fit.comparator) == (0.0, ">") and fit.f1 == pytest.approx(0.8)


def test_logistic_regression_recovers_planted_rule():
    g = torch.Generator().manual_seed(4)
    d, n = 12, 600
    w_true = torch.randn(d, generator=g, dtype=F64)
    b_true = 0.4
    x = torch.randn(n, d, generator=g, dtype=F64)
    y = (x @ w_true + b_true > 0).double()
    w, b = D.fit_logistic(x, y, C=10.0)
    acc = float(((x @ w.double() + b > 0).double() == y).double().mean())
    cos = float(w.double() @ w_true / (w.double().norm() * w_true.norm()))
    assert acc >= 0.98 and cos >= 0.97
    # the boundary's offset along the normal agrees with the planted one
    assert b / float(w.double().norm()) == pytest.approx(b_true / float(w_true.norm()), abs=0.1)
    # deterministic
    w2, b2 = D.fit_logistic(x, y, C=10.0)
    assert torch.equal(w, w2) and b == b2


@pytest.mark.parametrize("C_", [1.0, 0.5, 3.0])
def test_logistic_regression_matches_its_stationarity_condition(C_):
    # x = +1 (label 1), x = -1 (label 0). The objective C Σ log(1+exp(-s(wx+b))) + w²/2 is
    # symmetric, so b = 0 and dw: -2 C σ(-w) + w = 0, i.e. w = 2 C σ(-w); solved by bisection.
    lo, hi = 0.0, 2.0 * C_
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid - 2 * C_ / (1 + math.exp(mid)) > 0:
            hi = mid
        else:
            lo = mid
    w, b = D.fit_logistic(torch.tensor([[1.0], [-1.0]]), torch.tensor([1.0, 0.0]), C=C_)
    assert float(w[0]) == pytest.approx(lo, abs=1e-5) and b == pytest.approx(0.0, abs=1e-6)


def test_probe_from_sets_scores_positives_high():
    g = torch.Generator().manual_seed(5)
    d = 8
    mu = torch.zeros(d, dtype=F64)
    mu[0] = 2.0
    pos = torch.randn(50, d, generator=g, dtype=F64) + mu
    neg = torch.randn(50, d, generator=g, dtype=F64) - mu
    w, b = D.probe_from_sets(pos, neg)
    assert (
        float(torch.sigmoid(mu @ w.double() + b))
        > 0.9
        > 0.1
        > float(torch.sigmoid(-mu @ w.double() + b))
    )
    assert int(w.abs().argmax()) == 0


def test_kts_directions_from_mean_difference():
    pos = torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])  # [N=1, L=2, d=2]
    neg = torch.tensor([[[0.0, 0.0], [0.0, 0.0]]])
    u, s = D.kts_directions(pos, neg)
    torch.testing.assert_close(u, torch.tensor([[0.6, 0.8], [1.0, 0.0]]))
    torch.testing.assert_close(s, torch.tensor([5.0, 1.0]))
    u1, s1 = D.kts_directions(pos, neg, scale="unit")
    assert torch.equal(u1, u) and s1.tolist() == [1.0, 1.0]


def test_kts_directions_pca_planted():
    g = torch.Generator().manual_seed(6)
    d, n = 16, 40
    u0 = torch.zeros(d, dtype=F64)
    u0[3] = 1.0
    pos, neg = _planted_pairs(g, n, d, u0)
    u, s = D.kts_directions(pos[:, None], neg[:, None], method="pca", scale="unit")
    assert float(u[0].double() @ u0) > 0.99 and s.tolist() == [1.0]


def test_gaussian_transport_diagonal_closed_form():
    # 2d points ±sqrt(d s_i) e_i around mu have mean mu and covariance diag(s) exactly,
    # and the map between diagonal Gaussians is A = diag(sqrt(s_t / s_s)).
    d = 4
    s_s = torch.tensor([1.0, 4.0, 0.25, 9.0], dtype=F64)
    s_t = torch.tensor([4.0, 1.0, 1.0, 9.0], dtype=F64)
    mu_s = torch.tensor([1.0, -2.0, 0.0, 3.0], dtype=F64)
    mu_t = torch.tensor([0.0, 5.0, -1.0, 1.0], dtype=F64)

    def points(s, mu):
        e = torch.diag((d * s).sqrt())
        return torch.cat([e, -e]) + mu

    A, ms, mt = D.gaussian_transport(points(s_s, mu_s), points(s_t, mu_t), reg=0.0)
    torch.testing.assert_close(A.double(), torch.diag((s_t / s_s).sqrt()), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ms.double(), mu_s)
    torch.testing.assert_close(mt.double(), mu_t)


def test_gaussian_transport_maps_moments():
    g = torch.Generator().manual_seed(7)
    d, n = 5, 20000
    Ls = torch.randn(d, d, generator=g, dtype=F64)
    Lt = torch.randn(d, d, generator=g, dtype=F64)
    S_s, S_t = Ls @ Ls.T + 0.5 * torch.eye(d, dtype=F64), Lt @ Lt.T + 0.5 * torch.eye(d, dtype=F64)
    mu_s = torch.randn(d, generator=g, dtype=F64)
    mu_t = torch.randn(d, generator=g, dtype=F64) + 3.0
    xs = torch.randn(n, d, generator=g, dtype=F64) @ torch.linalg.cholesky(S_s).T + mu_s
    xt = torch.randn(n, d, generator=g, dtype=F64) @ torch.linalg.cholesky(S_t).T + mu_t
    A, ms, mt = D.gaussian_transport(xs, xt, reg=0.0)
    A = A.double()
    torch.testing.assert_close(A, A.T)
    assert float(torch.linalg.eigvalsh(A).min()) > 0
    mapped = (xs - ms.double()) @ A.T + mt.double()

    def cov(x):
        z = x - x.mean(0)
        return z.T @ z / x.shape[0]

    # The map sends the fitted source Gaussian exactly onto the fitted target one ...
    torch.testing.assert_close(mapped.mean(0), xt.mean(0), atol=1e-5, rtol=0)
    torch.testing.assert_close(cov(mapped), cov(xt), atol=1e-4, rtol=1e-4)
    # ... which is N(mu_t, S_t) up to sampling error.
    torch.testing.assert_close(mapped.mean(0), mu_t, atol=0.1, rtol=0)
    assert float((cov(mapped) - S_t).norm() / S_t.norm()) < 0.05


def test_gaussian_transport_needs_regularisation_when_rank_deficient():
    g = torch.Generator().manual_seed(8)
    xs, xt = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    with pytest.raises(ART.ArtifactError, match="singular"):
        D.gaussian_transport(xs, xt, reg=0.0)
    A, _, _ = D.gaussian_transport(xs, xt, reg=0.0, shrinkage=0.5)
    assert torch.isfinite(A).all() and torch.equal(A, A.T)


def test_distances_and_threshold():
    cen = torch.tensor([[0.0, 0.0], [10.0, 0.0]])
    x = torch.tensor([[3.0, 4.0], [10.0, 1.0], [5.0, 0.0]])
    assert D.min_distance(x, cen).tolist() == [5.0, 1.0, 5.0]
    assert D.distance_threshold(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), quantile=0.5) == 3.0
    # t = 2: TPR 2/3, FPR 0; t = 3: TPR 1, FPR 1/3 -> same J, the smaller t wins
    assert D.distance_threshold(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.5, 4.0, 5.0])) == 2.0
    assert D.distance_threshold(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.5, 4.0])) == 3.0


def test_steer_moe_counts_difference_and_mask():
    # 2 tokens, 2 layers, top-2 of 4 experts
    sel = torch.tensor([[[0, 1], [2, 3]], [[0, 2], [2, 1]]])
    assert D.expert_counts(sel, 4).tolist() == [[2, 1, 1, 0], [0, 1, 2, 1]]
    pos = torch.tensor([[8, 4, 0, 4], [2, 2, 6, 6]])  # 8 tokens
    neg = torch.tensor([[2, 2, 2, 2], [1, 1, 1, 1]])  # 4 tokens
    delta = D.routing_difference(pos, 8, neg, 4)
    expected = [[0.5, 0.0, -0.5, 0.0], [0.0, 0.0, 0.5, 0.5]]
    assert delta.tolist() == expected
    # global ranking: +1 for the 2 largest Δ > 0 (ties -> lower index: (0,0), (1,2));
    # -1 for the single negative
    m = D.steer_moe_mask(delta, n_activate=2, n_deactivate=5)
    assert m.tolist() == [[1, 0, -1, 0], [0, 0, 1, 0]]
    # per layer: one each
    m = D.steer_moe_mask(delta, n_activate=1, n_deactivate=1, per_layer=True)
    assert m.tolist() == [[1, 0, -1, 0], [0, 0, 1, 0]]
    # top_k = 1 caps forced-on experts per layer at 1: (1,3) is skipped, nothing else positive
    m = D.steer_moe_mask(delta, n_activate=3, n_deactivate=0, top_k=1)
    assert m.tolist() == [[1, 0, 0, 0], [0, 0, 1, 0]]
    m = D.steer_moe_mask(delta, n_activate=3, n_deactivate=0)
    assert m.tolist() == [[1, 0, 0, 0], [0, 0, 1, 1]]


def test_validate_artifacts_messages():
    ok = ART.validate_artifacts(
        "cast",
        {"condition_vector": torch.ones(8), "behavior_vectors": torch.ones(3, 8), "threshold": 0.1},
        {"L_sel": 3},
    )
    assert ok["d"] == 8
    with pytest.raises(
        ART.ArtifactError,
        match=r"behavior_vectors' has shape \[2, 8\]; expected \[d=8\] or "
        r"\[L_sel=3, d=8\] or \[n_layers=4, d=8\]",
    ):
        ART.validate_artifacts(
            "cast",
            {
                "condition_vector": torch.ones(8),
                "behavior_vectors": torch.ones(2, 8),
                "threshold": 0.1,
            },
            {"L_sel": 3, "n_layers": 4},
        )
    with pytest.raises(ART.ArtifactError, match="only -1, 0 and 1"):
        ART.validate_artifacts("steer_moe", {"mask": torch.tensor([[0.0, 2.0]])})
    with pytest.raises(ART.ArtifactError, match="row 1 has norm 2"):
        ART.validate_artifacts(
            "kl_then_steer",
            {
                "directions": torch.tensor([[1.0, 0.0], [2.0, 0.0]]),
                "scales": torch.ones(2),
                "probe_weight": torch.ones(2),
                "probe_bias": 0.0,
                "threshold": 0.5,
            },
        )
    with pytest.raises(ART.ArtifactError, match="missing artifact 'bias'"):
        ART.validate_artifacts("truth_probe", {"weight": torch.ones(4)})
    with pytest.raises(ART.ArtifactError, match="NaN"):
        ART.validate_artifacts("seal", {"vector": torch.tensor([1.0, float("nan")])})


# ============================================================================ (c) errors
def test_cast_behaviour_layers_around_the_condition(model):
    """Behaviour layers before, at and after the condition layer all lower; only those after
    it see the latch from the last prompt token (CAST's hooks steer layers before c from the
    first generated token)."""
    kind, shape, tok = model
    d = shape.hidden_size
    v = torch.ones(d)
    app = cast(v, v, condition_layer=2, behavior_layers=[1, 2, 3], threshold=0.1)
    lw = lower(app, shape, tok)
    writes = {op.layer: op for op in lw.ops if op.kernel == "add"}
    latch = writes[1].cond
    assert latch == C.Latch("prompt_last", "cast_sim", ">=", "theta")
    assert {l: latch_from_generated(lw, op, latch) for l, op in writes.items()} == {
        1: True,
        2: True,
        3: False,
    }


def test_cast_factory_errors():
    v = torch.ones(16)
    with pytest.raises(AppError, match="comparator must be one of"):
        cast(v, v, condition_layer=1, behavior_layers=[2], threshold=0.1, comparator="==")
    # CAST's words: "larger" means the score is below the threshold
    app = cast(v, v, condition_layer=1, behavior_layers=[2], threshold=0.1, comparator="larger")
    assert app.ops[1].condition() == C.Latch("prompt_last", "cast_sim", "<", "theta")
    with pytest.raises(AppError, match="give condition_layer= and behavior_layers="):
        cast(v, v, threshold=0.1)
    with pytest.raises(AppError, match="give behavior_layers=; defaults exist only"):
        cast(v, v, condition_layer=1, threshold=0.1)
    # [3, 8] would be a valid [n_layers, d] for a 3-layer model, which only deploy can check;
    # a width that differs from the condition vector's is wrong for any model
    with pytest.raises(AppError, match=r"'behavior_vectors' has shape \[2, 6\]"):
        cast(
            torch.ones(8),
            torch.ones(2, 6),
            condition_layer=0,
            behavior_layers=[1, 2],
            threshold=0.1,
        )


def test_factory_argument_errors():
    v = torch.ones(16)
    with pytest.raises(AppError, match="variant 'add' needs layer="):
        refusal(v, variant="add")
    with pytest.raises(AppError, match="'layer' only applies to variant 'add'"):
        refusal(v, layer=3)
    with pytest.raises(AppError, match="variant must be"):
        refusal(v, variant="subtract")
    with pytest.raises(AppError, match="zero norm"):
        refusal(torch.zeros(16))
    with pytest.raises(AppError, match="NaN"):
        seal(torch.tensor([1.0, float("nan")]), 1)
    with pytest.raises(AppError, match="give layer="):
        seal(v)
    with pytest.raises(AppError, match="tokens must be one of"):
        truth_probe(v, 0.0, 1, tokens="prompt_only")
    with pytest.raises(AppError, match="bias must be a finite number"):
        truth_probe(v, float("inf"), 1)
    m = torch.eye(16)
    m[0, 1] = 1.0
    with pytest.raises(AppError, match="not symmetric"):
        sake(m, v, v, 1.0)
    with pytest.raises(AppError, match=r"'A' has shape \[16, 8\]"):
        sake(torch.ones(16, 8), v, v, 1.0)
    with pytest.raises(AppError, match="threshold must be >= 0"):
        sake(torch.eye(16), v, v, -1.0)
    u = _unit_rows(torch.ones(3, 16))
    # a probe at or after steered layers is allowed: those layers steer from the first
    # generated token (test_cast_behaviour_layers_around_the_condition checks the rule)
    kts = kl_then_steer(u, torch.ones(3), v, 0.0, probe_layer=2, layers=[2, 3, 4])
    assert kts.ops[1].condition() == C.Latch("prompt_mean", "kts_probe", ">=", "threshold")
    with pytest.raises(AppError, match="rows must be unit"):
        kl_then_steer(2 * u, torch.ones(3), v, 0.0, probe_layer=1, layers=[2, 3, 4])
    with pytest.raises(
        AppError, match=r"'directions' has shape \[3, 16\]; expected \[L_sel=2, d=16\]"
    ):
        kl_then_steer(u, torch.ones(3), v, 0.0, probe_layer=1, layers=[2, 3])
    with pytest.raises(AppError, match="reduce must be one of"):
        kl_then_steer(u, torch.ones(3), v, 0.0, probe_layer=1, layers=[2, 3, 4], reduce="mean")
    with pytest.raises(AppError, match="only -1, 0 and 1"):
        steer_moe(torch.tensor([[0.0, 0.5]]))
    with pytest.raises(AppError, match="not a mixture-of-experts model"):
        steer_moe(torch.zeros(32, 8), model="Qwen/Qwen3-8B")
    with pytest.raises(AppError, match=r"behavior_layers lists a layer twice: \[1, 1\]"):
        cast(v, v, condition_layer=0, behavior_layers=[1, 1], threshold=0.1)


# ============================================================================ (d) end to end, tiny model
PROMPTS = __import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "prompts"


def _lines(name: str) -> list[str]:
    lines = [l.strip() for l in (PROMPTS / f"{name}.txt").read_text(encoding="utf-8").splitlines()]
    return [l for l in lines if l]


def test_example_prompt_files():
    for name in ("refusal", "cast", "truth"):
        pos, neg = _lines(f"{name}_pos"), _lines(f"{name}_neg")
        assert len(pos) == len(neg) == 24 and not set(pos) & set(neg)


def test_derived_apps_on_the_tiny_model():
    """Derive from the example prompts, deploy through the transformers integration and check
    the defining property of each intervention."""
    hf = pytest.importorskip("xmix.integrations.hf")
    from transformers import AutoModelForCausalLM

    path = tiny_model_path("tiny-llama")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()

    def last_hidden(prompts, index):
        rows = []
        for q in prompts:
            with torch.no_grad():
                out = model(tok(q, return_tensors="pt").input_ids, output_hidden_states=True)
            rows.append(out.hidden_states[index][0, -1])  # index l < L: residual.pre of layer l
        return torch.stack(rows)

    ids = tok("Tell me a story about a dog.").input_ids

    # refusal, ablation: no later activation of the stream has a component along r̂
    # a few prompts per set keep it fast; the checks below hold for any direction
    r = D.mean_difference(
        last_hidden(_lines("refusal_pos")[:8], 2), last_hidden(_lines("refusal_neg")[:8], 2)
    )
    r_hat = r / r.norm()
    seen = {}
    hook = model.model.layers[3].register_forward_hook(
        lambda m, a, o: seen.__setitem__("out", (o[0] if isinstance(o, tuple) else o).detach())
    )
    try:
        with hf.attach(model, [refusal(r)], tokenizer=tok) as att:
            att.forward(ids, apps=["refusal"])
            ablated = float((seen["out"][0] @ r_hat).abs().max())
            att.forward(ids, apps=[])
            plain = float((seen["out"][0] @ r_hat).abs().max())
    finally:
        hook.remove()
    assert ablated < 1e-4 * plain and plain > 0.1

    # SAKE: logits become lm_head(A (h - mu_s) + mu_t) exactly when dist <= t
    A, mu_s, mu_t = D.gaussian_transport(
        last_hidden(_lines("truth_pos")[:8], -1),
        last_hidden(_lines("truth_neg")[:8], -1),
        shrinkage=0.5,
    )
    with torch.no_grad():
        h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1].double()
    dist = float((h - mu_s.double()).norm())
    edited = model.lm_head.weight.double() @ ((h - mu_s.double()) @ A.double().T + mu_t.double())
    for t, expect_edit in ((dist * 1.01, True), (dist * 0.99, False)):
        with hf.attach(model, [sake(A, mu_s, mu_t, t)], tokenizer=tok) as att:
            logits, reads = att.forward(ids, apps=["sake"])
            base, _ = att.forward(ids, apps=[])
        assert reads["sake"]["dist"]["values"][0] == pytest.approx(dist, rel=1e-4)
        if expect_edit:
            torch.testing.assert_close(logits.double(), edited, atol=2e-3, rtol=1e-4)
        else:
            assert torch.equal(logits, base)
