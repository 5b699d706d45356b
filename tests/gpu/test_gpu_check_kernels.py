"""GPU-only stress of the CUDA kernels' cross-block reductions (skipped without a GPU).

OP_COSINE (CAST) accumulates a request's prompt rows with atomics from one block per token
and lets the last block to arrive compute the score: a block that counted its arrival
before all of its threads' adds were visible made that score from partial sums, now and
then. Many blocks, wide rows and repetitions make such a race show.
"""

from __future__ import annotations

import pytest
import torch

from harness import Harness, Req
from xmix.lang import reference as R
from xmix.lang.api import App
from xmix.lang.sites import ModelShape
from xmix.runtime.control import Capacity


@pytest.mark.gpu
def test_cast_score_over_many_blocks_is_the_reference_every_time():
    d, t, reps = 4096, 1024, 30
    shape = ModelShape(n_layers=2, hidden_size=d, vocab_size=64)
    cap = Capacity(
        max_tokens=t,
        max_slots=4,
        max_apps=4,
        max_params=16,
        max_channels=4,
        max_ops=8,
        max_cond=8,
        capture_floats=1,
    )
    g = torch.Generator().manual_seed(11)
    v = torch.randn(d, generator=g)
    app = App("k")
    app.read("cosine", vector=v).layers([0]).at("residual.pre").named("cast")
    hs = Harness(shape, [app], "cuda", capacity=cap)
    h = torch.randn(t, d, generator=g)
    r = torch.randn(t, d, generator=g)
    want = float(R.cast_cosine(R.stream(h.double(), r.double()).mean(0), v.double()))
    h, r = h.cuda(), r.cuda()
    got = []
    for i in range(reps):
        name = f"a{i}"
        hs.step({name: Req(t, 0, t, ("k",))})
        hs.run("residual.pre", 0, h.clone(), r)
        got.append(hs.drain()[name]["k"]["cast"]["values"][0])
        hs.finish(name)
    assert got == [pytest.approx(want, rel=1e-4, abs=1e-5)] * reps
