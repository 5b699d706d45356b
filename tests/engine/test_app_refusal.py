"""Refusal (Arditi et al.): directional ablation at every layer, and the additive variant, on
tiny-llama against the oracle in tests/apps_oracle.py."""

from __future__ import annotations

import numpy as np
import pytest

from apps_oracle import RTOL, Req, check, effect, lines, vanilla

pytestmark = pytest.mark.engine


def test_refusal_ablation_and_addition(llama):
    """Arditi et al.: with r̂ projected out at every block input, attention output and MLP
    output, no block output keeps a component along r̂; adding r at one layer shifts every
    token by exactly coeff·r there."""
    env = llama
    r = env.specs["refusal"].app.ops[0].artifacts["direction"].double()
    u = r / r.norm()
    prompts = lines("refusal_pos")[:3] + lines("refusal_neg")[:3]
    reqs = []
    for p in prompts:
        ids = env.ids(p)
        reqs += [
            Req(ids, ["pre", "refusal", "post"]),
            Req(ids, ["pre", "refusal_add", "post"]),
            Req(ids, ["pre", "post"]),
        ]
    res = check(env, reqs)
    changed = 0
    for i in range(0, len(reqs), 3):
        (t_abl, e_abl, _, _), (t_add, e_add, _, _), (t_van, e_van, _, _) = res[i : i + 3]
        assert t_van == vanilla(env, reqs[i].ids)
        for l in range(4):
            x = np.asarray(e_abl["post"][f"ro.{l}"]["values"])
            xv = np.asarray(e_van["post"][f"ro.{l}"]["values"])
            proj, proj_v = np.abs(x @ u.numpy()), np.abs(xv @ u.numpy())
            assert proj.max() < 1e-4 * np.linalg.norm(x, axis=1).max(), f"layer {l}: {proj.max()}"
            assert proj_v.max() > 0.1
        eff = effect(e_add, "rp2")
        np.testing.assert_allclose(
            eff, np.broadcast_to(4.0 * r.numpy(), eff.shape), rtol=RTOL, atol=1e-4
        )
        changed += (t_abl != t_van) + (t_add != t_van)
    assert changed >= 3, "the refusal writes should change some answers"
