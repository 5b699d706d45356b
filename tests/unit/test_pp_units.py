"""Pipeline-parallel bookkeeping without an engine (pp.py): which stage runs a site, which
conditions cross stages, which are refused, which channels a stage sends on. Layer ranges are
vLLM's own (get_pp_indices)."""

from __future__ import annotations

import pytest
import torch

import xmix
from xmix.lang.lowering import DeployError, lower
from xmix.lang.sites import ModelShape, site_id

pp = pytest.importorskip("xmix.integrations.vllm.worker.pp")

D, L = 16, 6
SHAPE = ModelShape(n_layers=L, hidden_size=D, vocab_size=64)


def test_stage_of_site_follows_vllm_split():
    st = pp.Stages.of(L, 0, 2)
    assert st.ranges == ((0, 3), (3, 6))
    assert st.of_site(site_id("mlp.post", 2, L)) == 0
    assert st.of_site(site_id("residual.pre", 3, L)) == 1
    assert st.of_site(site_id("final.post", None, L)) == 1
    three = pp.Stages.of(L, 1, 3)
    assert [three.of_site(site_id("residual.post", l, L)) for l in range(L)] == [0, 0, 1, 1, 2, 2]


def _app(read_layer: int, op_layer: int, cond: str):
    a = xmix.App("a")
    a.read("probe", weight=torch.ones(D)).layers([read_layer]).at("residual.post").named("p")
    a.write("add", vector=torch.ones(D)).layers([op_layer]).at("mlp.post").cond(cond)
    return lower(a, SHAPE)


def test_crossings_and_refusal():
    st = pp.Stages.of(L, 0, 2)
    fwd = _app(1, 4, "p >= 0.5")
    assert [(k, sr, so) for k, sr, so, _ in pp.crossings(fwd, st)] == [("p", 0, 1)]
    pp.check_deploy(fwd, st)
    pp.check_deploy(_app(3, 4, "prompt_mean(p) > 0.5"), st)  # same stage
    with pytest.raises(DeployError, match=r"'a'.*stage 0.*read 'p'.*later stage 1"):
        pp.check_deploy(_app(4, 1, "prompt_last(p) > 0.5"), st)


def test_forwarded_channels_per_stage():
    class Inst:
        def __init__(self, lw, ch):
            self.lowered, self.channels = lw, ch

    apps = {"a": Inst(_app(0, 5, "p >= 0.5"), {"p": 7})}
    assert pp.forwarded_channels(apps, pp.Stages.of(L, 0, 3)).tolist() == [7]
    assert pp.forwarded_channels(apps, pp.Stages.of(L, 1, 3)).tolist() == [7]  # passed on
    assert pp.forwarded_channels(apps, pp.Stages.of(L, 2, 3)).tolist() == []
