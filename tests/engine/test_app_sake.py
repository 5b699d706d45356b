"""SAKE: the affine transport A(h - mu_s) + mu_t within distance t of mu_s, on tiny-llama
against the oracle in tests/apps_oracle.py."""

from __future__ import annotations

import numpy as np
import pytest

from apps_oracle import RTOL, G, Req, check, fired, lines, vanilla

pytestmark = pytest.mark.engine


def test_sake_edits_only_within_distance(llama):
    env = llama
    spec = env.specs["sake"]
    prompts = lines("truth_pos")[3:6] + lines("cast_neg")[:3]
    reqs = []
    for p in prompts:
        ids = env.ids(p)
        # t between distances the unedited run sees, such that the edited run (whose later
        # distances move) has steps on both sides and none within 0.1 % of t
        _, reads, _ = env.ref.generate(ids, spec.ops({"t": -1.0}), G)
        d = sorted(reads["sake"]["dist"]["values"])
        for _, t in sorted(
            ((d[i + 1] - d[i], (d[i] + d[i + 1]) / 2) for i in range(len(d) - 1)), reverse=True
        ):
            _, edited, _ = env.ref.generate(ids, spec.ops({"t": t}), G)
            de = edited["sake"]["dist"]["values"]
            if min(abs(x - t) for x in de) > 1e-3 * t and min(de) < t < max(de):
                break
        else:
            pytest.fail(f"no clear threshold for {p!r}")
        reqs.append(Req(ids, ["pre", "sake", "post"], {"sake": {"t": t}}))
    res = check(env, reqs)
    A, mu_s, mu_t = (
        spec.app.ops[1].artifacts[k].double().numpy() for k in ("matrix", "mu_s", "mu_t")
    )
    both = changed = 0
    for r, (toks, eng, _, _) in zip(reqs, res):
        t = r.params["sake"]["t"]
        dist = eng["sake"]["dist"]["values"]
        assert eng["sake"]["dist"]["positions"] == list(range(len(r.ids) - 1, len(r.ids) + G - 1))
        assert min(abs(x - t) for x in dist) > 1e-3 * t, "a distance at the threshold"
        want = [x <= t for x in dist]
        assert fired(eng, "fin") == want
        h = np.asarray(eng["pre"]["fin"]["values"], dtype=np.float64)
        edited = np.asarray(eng["post"]["fin"]["values"], dtype=np.float64)
        for k in np.nonzero(want)[0]:
            np.testing.assert_allclose(edited[k], (h[k] - mu_s) @ A.T + mu_t, rtol=RTOL, atol=1e-4)
        both += any(want) and not all(want)
        changed += toks != vanilla(env, r.ids)
    assert both >= 3 and changed >= 1
