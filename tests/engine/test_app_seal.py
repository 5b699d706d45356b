"""SEAL: the steering add on "\\n\\n" tokens inside <think>…</think>, on tiny-llama against the
oracle in tests/apps_oracle.py."""

from __future__ import annotations

import numpy as np
import pytest

from apps_oracle import RTOL, Req, check, effect, fired, think_spans, vanilla

pytestmark = pytest.mark.engine


def test_seal_fires_on_separators_inside_think(llama):
    env = llama
    tok = env.tok
    nl2 = tok.encode("\n\n", add_special_tokens=False)
    assert len(nl2) == 1
    nl2 = nl2[0]
    separators = {i for i in range(len(tok)) if "\n\n" in tok.decode([i])}  # SEAL's "\n\n" tokens
    think, unthink = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    words = [tok.encode(w, add_special_tokens=False)[0] for w in (" the", " so", " we")]
    cases = [
        # separators before, inside and after a closed thought in the prompt; a thought opened
        # at the end, closed by the first generated token, then separators outside it
        (
            "Question: what is two plus two?\n\n<think> Add them.\n\nThe sum is four.</think>\n\nSo"
            " the answer:\n\n<think> Check",
            [nl2, unthink, tok.encode(".", add_special_tokens=False)[0]],
        ),
        # a thought open at the end of the prompt: generated separators inside it (steered, so
        # the next steps differ), then </think> and separators after it
        ("<think> Let me think.\n\nOk", [nl2, unthink]),
        # no thought in the prompt; generation may open and close one
        ("One line.\n\nAnother line.\n\nThe end", [nl2, think, unthink] + words),
        ("Plan the trip.\n\n<think> First the train", None),
    ]
    reqs = [Req(env.ids(p), ["pre", "seal", "post"], allowed=a) for p, a in cases]
    res = check(env, reqs)
    S = env.specs["seal"].app.ops[0].artifacts["vector"].double().numpy()
    coeff = env.specs["seal"].params["scale"]
    seen = {"prompt_in": 0, "prompt_out": 0, "gen_in": 0, "gen_out": 0}
    for r, (toks, eng, _, _) in zip(reqs, res):
        seq = r.ids + toks[:-1]
        span = think_spans(seq, think, unthink)
        want = [t in separators and s for t, s in zip(seq, span)]
        assert fired(eng, "rp2") == want, f"SEAL fired on the wrong tokens of {tok.decode(seq)!r}"
        eff = effect(eng, "rp2")
        for p, w in enumerate(want):
            if w:
                np.testing.assert_allclose(eff[p], coeff * S, rtol=RTOL, atol=1e-4)
            if seq[p] in separators:
                seen[("gen_" if p >= len(r.ids) else "prompt_") + ("in" if span[p] else "out")] += 1
    # the batch covers separators in and out of a thought, in the prompt and generated
    assert all(n > 0 for n in seen.values()), seen
    assert any(toks != vanilla(env, r.ids, r.allowed) for r, (toks, *_) in zip(reqs, res))
