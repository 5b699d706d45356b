"""KL-then-steer: the probe-latched add at block outputs, on tiny-llama against the oracle in
tests/apps_oracle.py."""

from __future__ import annotations

import numpy as np
import pytest

from apps_oracle import RTOL, G, Req, check, effect, fired, lines, vanilla

pytestmark = pytest.mark.engine


def test_kts_latch(llama):
    env = llama
    spec = env.specs["kl_then_steer"]
    prompts = lines("refusal_pos")[6:10] + lines("refusal_neg")[6:10]
    ids = [env.ids(p) for p in prompts]
    means = []
    for x in ids:
        _, reads, _ = env.ref.generate(x, spec.ops({**spec.params, "threshold": 2.0}), 1)
        means.append(float(np.mean(reads["kl_then_steer"]["kts_probe"]["values"])))
    srt = sorted(means)
    gap, theta = max(
        (srt[i + 1] - srt[i], (srt[i] + srt[i + 1]) / 2) for i in range(1, len(srt) - 2)
    )
    assert gap > 1e-4
    reqs = [
        Req(x, ["pre", "kl_then_steer", "post"], {"kl_then_steer": {"threshold": theta}})
        for x in ids
    ]
    res = check(env, reqs)
    add = (
        spec.app.ops[1].artifacts["vector"][0].double().numpy() * spec.params["scale"]
    )  # c·s_1·û_1
    n_fire = 0
    for x, m, (toks, eng, _, _) in zip(ids, means, res):
        assert eng["kl_then_steer"]["kts_probe"]["positions"] == list(range(len(x)))
        latch = m >= theta
        assert fired(eng, "ro1") == [latch and p >= len(x) - 1 for p in range(len(x) + G - 1)]
        if latch:
            eff = effect(eng, "ro1")[len(x) - 1 :]
            np.testing.assert_allclose(eff, np.broadcast_to(add, eff.shape), rtol=RTOL, atol=1e-4)
            assert toks != vanilla(env, x)
        else:
            assert toks == vanilla(env, x)
        n_fire += latch
    assert 0 < n_fire < len(ids)
