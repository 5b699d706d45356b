"""The truth probe (Orgad et al.): a logistic probe on mlp.post, on tiny-llama against the oracle
in tests/apps_oracle.py."""

from __future__ import annotations

import pytest

from apps_oracle import G, Req, check, lines, vanilla

pytestmark = pytest.mark.engine


def test_truth_probe_scores(llama):
    env = llama
    prompts = lines("truth_pos")[:3] + lines("truth_neg")[:3]
    reqs = []
    for p in prompts:
        ids = env.ids(p)
        reqs += [Req(ids, ["truth_probe"]), Req(ids, ["truth_last", "refusal"])]
    res = check(env, reqs)
    for r, (toks, eng, _, _) in zip(reqs, res):
        P = len(r.ids)
        if "truth_probe" in r.apps:
            assert eng["truth_probe"]["truth"]["positions"] == list(range(P, P + G - 1))
            assert toks == vanilla(env, r.ids)  # a read does not change the answer
        else:
            assert eng["truth_last"]["truth"]["positions"] == list(range(P - 1, P + G - 1))
