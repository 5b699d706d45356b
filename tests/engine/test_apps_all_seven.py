"""All seven paper apps on one engine (tiny-mixtral), every request a different subset, against
the oracle in tests/apps_oracle.py composing its apps in deployment order."""

from __future__ import annotations

import pytest

from apps_oracle import Req, check, lines, release, vanilla

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", autouse=True)
def release_mixtral():
    """The last module on tiny-mixtral (files run in name order): its engine is freed after
    it; a module that needs it later starts a new one."""
    yield
    release("tiny-mixtral")


def test_all_seven_on_one_engine(mixtral):
    """tiny-mixtral hosts the seven apps; one batch, every request a different subset, each
    matching the oracle that composes its apps in deployment order."""
    env = mixtral
    p_think = env.ids("Think first.\n\n<think> The numbers are two and three.\n\nAdd them")
    base = [
        env.ids(p)
        for p in lines("cast_pos")[:4] + lines("refusal_pos")[:4] + lines("truth_neg")[:4]
    ]
    subsets = [
        [],
        ["refusal"],
        ["seal"],
        ["cast"],
        ["truth_probe"],
        ["sake"],
        ["kl_then_steer"],
        ["steer_moe"],
        ["refusal", "truth_probe"],
        ["seal", "cast", "sake"],
        ["kl_then_steer", "steer_moe", "truth_probe"],
        ["refusal", "seal", "cast", "truth_probe", "sake", "kl_then_steer", "steer_moe"],
        ["steer_moe", "refusal", "post"],
    ]
    # the request with all seven makes every conditional write fire (latches on, SAKE in scope)
    everything = {"cast": {"theta": -1.0}, "sake": {"t": 1e3}, "kl_then_steer": {"threshold": 0.0}}
    reqs = []
    for i, apps in enumerate(subsets):
        ids = p_think if "seal" in apps else base[i % len(base)]
        reqs.append(Req(ids, apps, everything if len(apps) == 7 else None))
    res = check(env, reqs)
    assert sum(toks != vanilla(env, r.ids) for r, (toks, *_) in zip(reqs, res)) >= 5
    assert res[0][1] == {}
    states = [ctx.state for *_, ctx in res]
    assert {s["cast"] for s in states if "cast" in s} == {True, False}
    assert {s["kts"] for s in states if "kts" in s} == {True, False}
    assert {any(s["sake_fire"]) for s in states if "sake_fire" in s} == {True, False}
    full = states[subsets.index(max(subsets, key=len))]
    assert full["cast"] and full["kts"] and any(full["sake_fire"])
