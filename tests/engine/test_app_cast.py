"""CAST (Lee et al.): the latch on the prompt mean's cosine and the behaviour adds, on tiny-llama
against the oracle in tests/apps_oracle.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apps_oracle import (
    ATOL,
    RTOL,
    Env,
    G,
    Req,
    Spec,
    cast_score,
    check,
    effect,
    fired,
    lines,
    ref_add,
    vanilla,
)
from xmix.apps import cast

pytestmark = pytest.mark.engine


def test_cast_latch_on_prompt_mean(llama):
    env = llama
    spec = env.specs["cast"]
    v = spec.app.ops[0].artifacts["vector"]
    u = spec.app.ops[1].artifacts["vector"].double()
    prompts = lines("cast_pos")[:4] + lines("cast_neg")[:4]
    # one prompt longer than the engine's 64-token prefill chunk: the mean spans chunks
    prompts.append(" ".join(lines("cast_pos")[4:12]))
    ids = [env.ids(p) for p in prompts]
    assert len(ids[-1]) > 64
    scores = []
    for x in ids:
        grab = {}
        env.ref.set_plan(
            [("residual.pre", 1, lambda h, c, grab=grab: grab.__setitem__("x", h.clone()))]
        )
        env.ref.forward(x, len(x))
        scores.append(cast_score(grab["x"].double().mean(0), v))
    env.ref.set_plan([])
    # θ in the widest gap near the middle of the scores: prompts on both sides, no near-tie
    srt = sorted(scores)
    gaps = [(srt[i + 1] - srt[i], (srt[i] + srt[i + 1]) / 2) for i in range(2, len(srt) - 3)]
    gap, theta = max(gaps)
    assert gap > 1e-3
    reqs = [Req(x, ["pre", "cast", "post"], {"cast": {"theta": theta}}) for x in ids]
    res = check(env, reqs)
    n_fire = 0
    for x, s, (toks, eng, _, _) in zip(ids, scores, res):
        assert eng["cast"]["cast_sim"]["positions"] == [len(x) - 1]
        assert eng["cast"]["cast_sim"]["values"][0] == pytest.approx(s, rel=RTOL, abs=ATOL)
        latch = s > theta
        want = [latch and p >= len(x) - 1 for p in range(len(x) + G - 1)]
        assert fired(eng, "rp2") == want
        if latch:
            eff = effect(eng, "rp2")[len(x) - 1 :]
            np.testing.assert_allclose(
                eff, np.broadcast_to(8.0 * u[0].numpy(), eff.shape), rtol=RTOL, atol=1e-4
            )
            assert toks != vanilla(env, x)
        else:
            assert toks == vanilla(env, x)
        n_fire += latch
    assert 0 < n_fire < len(ids)


def test_cast_behaviour_layers_around_the_condition(llama):
    """CAST with behaviour layers before, at and after its condition layer (1, 2, 3; the
    condition at residual.pre of 2): after it, steering from the last prompt token; at or
    before it, from the first generated token, once the prompt mean is known (CAST's hooks
    steer layers before c from the first generated token)."""
    env = llama
    base = env.specs["cast"]
    v = base.app.ops[0].artifacts["vector"]
    u2 = base.app.ops[1].artifacts["vector"]
    U = torch.stack([u2[1], u2[0], u2[1]])  # behaviour vectors of layers 1, 2, 3
    layers, cl, alpha, name = [1, 2, 3], 2, 8.0, "cast_around"
    prompts = lines("cast_pos")[:4] + lines("cast_neg")[:4]
    ids = [env.ids(p) for p in prompts]
    scores = []
    for x in ids:  # the prompt mean at the condition site; writes on generated tokens cannot
        grab = {}  # reach prompt positions (causal attention), so a vanilla pass gives it
        env.ref.set_plan(
            [("residual.pre", cl, lambda h, c, grab=grab: grab.__setitem__("x", h.clone()))]
        )
        env.ref.forward(x, len(x))
        scores.append(cast_score(grab["x"].double().mean(0), v))
    env.ref.set_plan([])
    srt = sorted(scores)
    gap, theta = max(
        (srt[i + 1] - srt[i], (srt[i] + srt[i + 1]) / 2) for i in range(1, len(srt) - 2)
    )
    assert gap > 1e-3
    latch = {tuple(x): s > theta for x, s in zip(ids, scores)}

    def ops(p):
        def read(x, ctx):
            ctx.read(name, "cast_sim", [ctx.P - 1], [cast_score(x[: ctx.P].double().mean(0), v)])

        out = [("residual.pre", cl, read)]
        for i, l in enumerate(layers):
            start = 0 if l <= cl else 1  # from position P, or from P - 1
            out.append(
                (
                    "residual.pre",
                    l,
                    ref_add(
                        U[i],
                        p["scale"],
                        lambda c, q, s=start: latch[tuple(c.ids[: c.P])] and q >= c.P - s,
                    ),
                )
            )
        return out

    spec = Spec(
        cast(
            v,
            U,
            condition_layer=cl,
            behavior_layers=layers,
            threshold=theta,
            comparator=">",
            alpha=alpha,
            name=name,
        ),
        ops,
        {"theta": theta, "scale": alpha},
    )
    # deployed between the observers, so "post" sees its write at residual.pre of layer 2
    post = env.specs["post"]
    env.llm.xmix.undeploy("post")
    env.llm.xmix.deploy(spec.app)
    env.llm.xmix.deploy(post.app)
    specs = {k: v for k, v in env.specs.items() if k != "post"}
    env2 = Env(
        env.kind, env.llm, env.ref, env.tok, {**specs, name: spec, "post": post}, env.vanilla
    )
    try:
        res = check(env2, [Req(x, ["pre", name, "post"]) for x in ids])
    finally:
        env.llm.xmix.undeploy(name)
    n_fire = changed = 0
    for x, s, (toks, eng, _, _) in zip(ids, scores, res):
        P, on = len(x), latch[tuple(x)]
        assert eng[name]["cast_sim"]["positions"] == [P - 1]
        assert eng[name]["cast_sim"]["values"][0] == pytest.approx(s, rel=RTOL, abs=ATOL)
        # at the condition's own site the write starts at the first generated token
        assert fired(eng, "rp2") == [on and q >= P for q in range(P + G - 1)]
        if on:
            eff = effect(eng, "rp2")[P:]
            np.testing.assert_allclose(
                eff, np.broadcast_to(alpha * U[1].double().numpy(), eff.shape), rtol=RTOL, atol=1e-4
            )
            changed += toks != vanilla(env, x)
        else:
            assert toks == vanilla(env, x)
        n_fire += on
    assert 0 < n_fire < len(ids) and changed >= 1
