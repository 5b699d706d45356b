"""SteerMoE: the router rewrite before top-k on tiny-mixtral, and ``xmix derive steer_moe`` on
the same engine, against the oracle in tests/apps_oracle.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xmix
from apps_oracle import PROMPTS_DIR, Req, check, lines

pytestmark = pytest.mark.engine


def test_steer_moe_changes_routing(mixtral):
    env = mixtral
    spec = env.specs["steer_moe"]
    mask = spec.app.ops[0].artifacts["mask"]
    prompts = lines("cast_pos")[:3] + lines("cast_neg")[:3]
    reqs = []
    for p in prompts:
        ids = env.ids(p)
        reqs += [Req(ids, ["steer_moe", "post"]), Req(ids, ["post"])]
    res = check(env, reqs)
    changed = 0
    for i in range(0, len(reqs), 2):
        (t_s, e_s, _, ctx_s), (t_v, e_v, _, ctx_v) = res[i], res[i + 1]
        for l in range(mask.shape[0]):
            on = [int(e) for e in (mask[l] > 0).nonzero().flatten()]
            off = [int(e) for e in (mask[l] < 0).nonzero().flatten()]
            sel = ctx_s.routing[l]
            assert all(bool((sel == e).any(-1).all()) for e in on)
            assert not any(bool((sel == e).any()) for e in off)
        moved = sum(
            not torch.equal(ctx_s.routing[l].sort(-1).values, ctx_v.routing[l].sort(-1).values)
            for l in range(mask.shape[0])
        )
        assert moved > 0
        # the served stream follows the steered routing, not the vanilla one
        x_s = np.asarray(e_s["post"]["ro.3"]["values"])
        x_v = np.asarray(e_v["post"]["ro.3"]["values"])
        assert np.abs(x_s - x_v).max() > 1e-2
        changed += t_s != t_v
    assert changed >= 1


def test_derive_steer_moe_matches_the_routing(mixtral, tmp_path):
    """``xmix derive steer_moe`` on this engine: routing recomputed from the captured router
    input gives the same expert counts as the transformers router, hence the same mask."""
    from xmix.apps import derive_cli as DC

    out = tmp_path / "moe.xmix"
    rc = DC.main(
        [
            "steer_moe",
            "--model",
            "tiny-mixtral",
            "--positive",
            str(PROMPTS_DIR / "cast_pos.txt"),
            "--negative",
            str(PROMPTS_DIR / "cast_neg.txt"),
            "--n-activate",
            "1",
            "--n-deactivate",
            "1",
            "--per-layer",
            "--out",
            str(out),
            "--quiet",
        ],
        llm=mixtral.llm,
    )
    assert rc == 0
    app = xmix.App.load(out)
    want = mixtral.specs["steer_moe"].app.ops[0].artifacts["mask"]
    torch.testing.assert_close(app.ops[0].artifacts["mask"], want)
    meta = app.metadata
    assert meta["top_k"] == 2 and meta["moe_layers"] == [0, 1, 2, 3]
    n_tok = sum(len(mixtral.tok.encode(p)) for p in lines("cast_pos"))
    assert meta["counts"]["positive_tokens"] == n_tok
