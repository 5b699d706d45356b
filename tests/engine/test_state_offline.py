"""The offline control plane with a state directory (``xmix.LLM(xmix_state_dir=DIR)``;
docs/serving.md, "State directory"): one engine started on a directory an earlier run left
(written here by the state directory's writer, as that run's worker would have), which it
restores before ``xmix.LLM`` returns; ``apps=`` names the state already holds are not
deployed again; changes made afterwards are written.

Oracle for the restored parameter: the same request through a copy of the app deployed
afresh with that value as its default (tokens exact)."""

from __future__ import annotations

import os

import pytest
import torch

import xmix
from xmix.integrations.vllm.state_dir import StateDir
from xmix.models.tiny import tiny_model_path

pytestmark = pytest.mark.engine

D = 256  # the tiny Llama


def steer(name: str, scale: float) -> xmix.App:
    v = torch.randn(D, generator=torch.Generator().manual_seed(21))
    a = xmix.App(name)
    a.write("add", vector=v / v.norm() * 6.0, scale=scale).layers([1]).at("residual.post").named(
        "push"
    )
    return a


def probe() -> xmix.App:
    w = torch.randn(D, generator=torch.Generator().manual_seed(22))
    a = xmix.App("probe")
    a.read("probe", weight=w / w.norm(), bias=0.0).layers([2]).at("residual.post").named("p")
    return a


def test_xmix_llm_restores_its_state_directory(tmp_path):
    from vllm import SamplingParams

    from engine_util import ENGINE_KW, shutdown

    d = tmp_path / "state"
    st = StateDir.open(d)  # what an earlier run's writer left
    st.save(
        {
            "kind": "deploy",
            "name": "steer",
            "data": steer("steer", 1.0).to_bytes(),
            "mode": "request",
            "version": 3,
            "locked": [],
        }
    )
    st.save({"kind": "patch", "name": "steer", "params": {"push.scale": 2.0}})
    gone = steer("gone", 1.0).to_bytes()
    st.save({"kind": "deploy", "name": "gone", "data": gone, "mode": "all", "version": 4})
    st.save({"kind": "undeploy", "name": "gone"})
    st.save(
        {"kind": "deploy", "name": "probe", "data": probe().to_bytes(), "mode": "off", "version": 5}
    )
    st.save({"kind": "patch", "name": "probe", "locked": ["p.bias"]})
    st.close()

    llm = xmix.LLM(
        str(tiny_model_path("tiny-llama")),
        apps=[steer("steer", 1.0), steer("fresh", 2.0)],
        xmix_state_dir=d,
        **ENGINE_KW,
    )
    try:
        assert os.environ.get("XMIX_STATE_DIR") is None  # set only while the engine started
        apps = {a["name"]: a for a in llm.xmix.apps()}
        assert list(apps) == ["steer", "probe", "fresh"]  # deployment order kept
        assert (apps["steer"]["version"], apps["steer"]["mode"]) == (3, "request")
        assert apps["steer"]["params"] == {"push.scale": 2.0}  # not the file's 1.0: kept
        assert (apps["probe"]["version"], apps["probe"]["mode"]) == (5, "off")
        assert apps["probe"]["locked"] == ["p.bias"]
        assert apps["fresh"]["version"] > 5  # above every version the directory used
        # the workers hold the same
        held = {a["name"]: (a["mode"], a["params"]) for a in llm.xmix.status()[0]["apps"]}
        assert held["steer"] == ("request", {"push.scale": 2.0})

        def tokens(app: str):
            sp = SamplingParams(
                temperature=0.0,
                max_tokens=16,
                ignore_eos=True,
                extra_args={"xmix": {"apps": [app]}},
            )
            out = llm.generate(["The old lighthouse keeper"], sp, use_tqdm=False)[0]
            assert out.xmix_applied["apps"][0]["params"]["push.scale"] == 2.0
            return list(out.outputs[0].token_ids)

        assert tokens("steer") == tokens("fresh")  # restored 2.0 == a fresh app's 2.0
        # a change now is written
        llm.xmix.patch("probe", mode="request")
        now = StateDir(d)
        now._load()  # read while the engine's writer holds the directory
        assert now.apps["probe"].mode == "request" and list(now.apps) == ["steer", "probe", "fresh"]
    finally:
        shutdown(llm)
