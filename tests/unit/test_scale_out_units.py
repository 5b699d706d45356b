"""Scale-out without an engine: the control plane of two API servers (two Controllers) over
two data-parallel engines (one worker each, real control blocks on the CPU), joined by a
fan-out that behaves as ``server.fan_out`` over vLLM's ``call_utility_all_async``: every
engine runs the call, a refusal on any of them raises after all ran. Checks the deploy
transaction across engines, the ledger every server follows, and the lease."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from transformers import LlamaConfig

import xmix
from harness import SMALL
from xmix.control import ControlBlock
from xmix.hooks import ModelShape
from xmix.integrations.vllm import worker as W
from xmix.integrations.vllm.frontend import Controller, EngineGone
from xmix.lowering import DeployError

D = 64
HF = LlamaConfig(
    hidden_size=D, num_hidden_layers=2, vocab_size=32, num_attention_heads=1, intermediate_size=128
)


class Engine:
    def __init__(self):
        shape = ModelShape.from_hf_config(HF, "tiny")
        x = W.WorkerXmix.for_control_block(ControlBlock(shape, "cpu", SMALL))
        x.placed = set(range(10_000))  # every site placed (no model here)
        self.worker = NS(model_runner=NS(_xmix=x))
        self.refuse: set[str] = set()  # worker methods this engine fails (a fault on it)

    @property
    def cb(self):
        return self.worker.model_runner._xmix.cb

    def call(self, method, args):
        # the frontend reaches xmix's worker methods through xmix_call (worker.py)
        assert method == "xmix_call", method
        if args[0] in self.refuse:  # the engine's RPC fails as a whole (vLLM raises)
            raise RuntimeError(f"DeployError: {args[0]} refused on this engine")
        return [W.WORKER_METHODS[method](self.worker, *args)]


def fan_out(engines):
    def rpc(method, args):
        out, err = [], None
        for e in engines:
            try:
                out += e.call(method, args)
            except Exception as ex:  # asyncio.gather: the others still run
                err = err or ex
        if err is not None:
            raise err
        return out

    return rpc


def server(engines):
    ip = NS(
        vllm_config=NS(
            model_config=NS(hf_config=HF, model="tiny"),
            parallel_config=NS(pipeline_parallel_size=1),
        ),
        tokenizer=None,
    )
    return Controller(ip, fan_out(engines))


def app(name, scale=1.0):
    a = xmix.App(name)
    a.write("add", vector=torch.ones(D), scale=scale).layers([1]).submodule("residual.post")
    return a


@pytest.fixture
def fleet():
    engines = [Engine(), Engine()]
    return engines, server(engines), server(engines)


def held(e: Engine) -> dict:
    return {a["name"]: (a["version"], a["mode"], a["params"]) for a in e.cb.describe()}


def test_deploy_refused_by_one_engine_is_rolled_back_on_all(fleet):
    engines, s1, _ = fleet
    engines[1].refuse = {"xmix_deploy_prepare"}
    with pytest.raises(DeployError, match="refused on this engine"):
        s1.deploy(app("a"))
    for e in engines:
        assert held(e) == {} and not e.cb._staged  # nothing live, nothing left prepared
    assert s1.apps() == []
    engines[1].refuse = {"xmix_deploy_commit"}  # one engine loses its prepared state
    with pytest.raises(DeployError):
        s1.deploy(app("a"))
    for e in engines:
        assert held(e) == {} and not e.cb._staged
    engines[1].refuse = set()
    info = s1.deploy(app("a"))
    assert [held(e) for e in engines] == [
        {"a": (info["version"], "request", {"#0.scale": 1.0})}
    ] * 2


def test_every_api_server_keys_cache_salts_with_the_first_engines_secret(fleet, monkeypatch):
    """Issue 33 item 1: cache salts are keyed with one secret per deployment. Each API server
    fetches it from the first worker of the first engine when it first follows the ledger
    (before a server serves), so both servers give a configuration the same salt (prefix
    caching across them keeps working) and neither gives a client's salt that value. An
    operator's XMIX_DEPLOYMENT_SECRET is used where set (the engines read it)."""
    engines, s1, s2 = fleet
    s1.deploy(app("a"))
    s2.sync()

    def salt(s, client=None):
        return s.registry.cache_salt(client, s.registry.admit({"apps": ["a"]}, 3, 4))

    assert salt(s1) == salt(s2) and salt(s1, "c") == salt(s2, "c") != salt(s1)
    assert salt(s1, salt(s1)) != salt(s1)
    held = [e.worker.model_runner._xmix.deployment_secret for e in engines]
    assert len(held[0]) == 32 and held[0] != held[1]  # random per engine; the first one's rules
    # a fresh deployment whose operator set a secret: its engines hold it, salts follow it
    monkeypatch.setenv("XMIX_DEPLOYMENT_SECRET", "operator-chosen secret 0123456789")
    fresh = [Engine(), Engine()]
    f1, f2 = server(fresh), server(fresh)
    f1.deploy(app("a"))
    f2.sync()
    for e in fresh:
        assert e.worker.model_runner._xmix.deployment_secret == (
            b"operator-chosen secret 0123456789"
        )
    assert salt(f1) == salt(f2) != salt(s1)
    monkeypatch.setenv("XMIX_DEPLOYMENT_SECRET", "short")
    with pytest.raises(Exception, match="needs at least 16"):
        server([Engine()]).sync()


def test_changes_through_one_server_are_seen_by_the_other(fleet):
    engines, s1, s2 = fleet
    a = s1.deploy(app("a"))
    b = s2.deploy(app("b", 2.0))  # s2 syncs first: a's version is taken
    assert b["version"] == a["version"] + 1
    s1.sync()
    assert s1.apps() == s2.apps()
    assert [x["name"] for x in s2.apps()] == ["a", "b"]
    s2.patch("a", mode="all", params={"scale": 3.0})
    s1.sync()
    d = s1.registry.get("a")
    assert d.mode == "all" and [c.default for c in d.cols] == [3.0]
    assert s1.registry.epoch == s2.registry.epoch  # the same cache salts on both
    with pytest.raises(DeployError, match="already deployed"):
        s1.deploy(app("b"))  # taken through s2: 409 on s1 too
    s1.undeploy("b")
    assert [x["name"] for x in s2.apps()] == ["a"]
    for e in engines:
        assert set(held(e)) == {"a"} and held(e)["a"][1:] == ("all", {"#0.scale": 3.0})
    # a request s2 admitted against "a" before s1 undeployed it carries the gone version
    adm = s2.registry.admit({"apps": ["a"]}, 3, 4)
    s1.undeploy("a")
    x = engines[0].worker.model_runner._xmix
    x.admit_new(
        [
            NS(
                req_id="r",
                prompt_token_ids=[1, 2, 3],
                prompt_embeds=None,
                sampling_params=NS(extra_args={"xmix": adm.control}),
            )
        ]
    )
    assert x.pending["r"][W.DROPPED_KEY] == ["a"] and x.stats["stale_apps"] == 1
    # the ledger keeps no bytes of apps that are gone
    led = x.ledger
    assert all(e.get("data") is None for e in led.entries if e["kind"] == "deploy")


def test_one_change_at_a_time_across_servers(fleet, monkeypatch):
    engines, s1, s2 = fleet
    monkeypatch.setenv("XMIX_LEASE_WAIT_S", "0.2")
    with s1._change():  # s1 is in the middle of a change
        with pytest.raises(EngineGone, match="another API server holds"):
            s2.deploy(app("a"))
    s2.deploy(app("a"))  # released
    led = engines[0].worker.model_runner._xmix.ledger
    with pytest.raises(RuntimeError, match="without the lease"):
        led.call("append", "intruder", entry={"kind": "undeploy", "name": "a"})


def test_a_request_finishing_while_a_change_is_on_its_way_names_it(fleet):
    """The engines apply a change at their next step, before the RPC that carried it has
    returned and the registry has followed the ledger. A request that finishes in that window
    ran with the change, so its provenance names it under ``changed``: an app switched to mode
    "all" or deployed in it (which read and wrote the request), a parameter change of its own
    app. The bounded soak (tests/server/test_soak.py) saw both as a leak and as a wrong
    answer before the registry knew changes as pending."""
    from xmix.integrations.vllm.frontend import provenance

    engines, s1, _ = fleet
    s1.deploy(app("own"))
    s1.deploy(app("other"))
    mine = s1.registry.admit({"apps": ["own"]}, 3, 4).control["applied"]
    plain = s1.registry.admit(None, 3, 4).control["applied"]
    assert provenance(mine)["changed"] == [] and provenance(plain)["changed"] == []

    seen: dict[str, tuple[list, list]] = {}
    real = engines[0].call

    def call(method, args):
        out = real(method, args)
        method, args = args  # xmix_call(method, args)
        if method in ("xmix_patch", "xmix_deploy_commit", "xmix_undeploy_if_present"):
            # the engine has applied it; both requests finish now, before the RPC returns
            seen.setdefault(
                f"{method}{args[:2]}", (provenance(mine)["changed"], provenance(plain)["changed"])
            )
        return out

    engines[0].call = call
    s1.patch("own", params={"scale": 2.0})  # the request's own app: changed for it only
    s1.patch("other", mode="all")  # reaches every request in flight
    s1.deploy(app("late"), mode="all")
    s1.undeploy("own")
    assert seen == {
        "xmix_patch('own', None)": (["own"], []),
        "xmix_patch('other', 'all')": (["other", "own"], ["other"]),
        "xmix_deploy_commit('late',)": (["late", "other", "own"], ["late", "other"]),
        "xmix_undeploy_if_present('own',)": (["late", "other", "own"], ["late", "other"]),
    }
    # a change refused by its checks announces nothing
    fresh = s1.registry.admit(None, 3, 4).control["applied"]
    with pytest.raises(DeployError):
        s1.patch("other", mode="x")
    assert provenance(fresh)["changed"] == []


@pytest.mark.parametrize("change", ["mode off", "undeploy"])
def test_an_admission_never_sees_a_change_without_its_revision(fleet, change):
    """A streamed request is checked before its HTTP 200 (``_precheck``) and admitted after
    it; an app switched off or undeployed in between is left out, because the registry's
    revision moved (``admit``'s ``gone_ok``). The registry applied a change and moved its
    revision in two holds of its lock: an admission in between saw the app off (or gone) at
    the revision of its check and refused it inside a stream that had answered 200. Found by
    bench/soak.py's restart phase (2 of 900 streams: an error event after HTTP 200)."""
    import contextvars
    import threading

    from xmix.integrations.vllm import frontend

    _, s1, _ = fleet
    s1.deploy(app("c0"))
    reg = s1.registry
    raw = {"apps": ["c0"]}
    got: dict = {}
    real_patch, real_remove, real_changed = reg.patch, reg.remove, reg.changed

    def check_first(fn):
        def wrapped(*a, **kw):
            # the pre-stream check, while the change is on its way (announced, not applied)
            got["since"] = reg.admit(raw, 3, 4, count=False).control["applied"]["_rev"]
            return fn(*a, **kw)

        return wrapped

    def admission():
        def run():
            frontend.mark_prechecked(got["since"])
            try:
                got["applied"] = reg.admit(raw, 3, 4).control["applied"]
            except ValueError as e:
                got["refused"] = str(e)

        contextvars.copy_context().run(run)

    def changed(kind, name=None):
        if "since" in got and "thread" not in got:
            # the admission comes now, from the server's event loop (another thread)
            got["thread"] = t = threading.Thread(target=admission)
            t.start()
            t.join(timeout=0.5)  # with the fix it waits for the lock this change holds
        return real_changed(kind, name)

    reg.patch, reg.remove, reg.changed = check_first(real_patch), check_first(real_remove), changed
    if change == "mode off":
        s1.patch("c0", mode="off")
    else:
        s1.undeploy("c0")
    got["thread"].join(timeout=10)
    assert "refused" not in got, got["refused"]
    assert got["applied"]["apps"] == [] and got["applied"]["_dropped"] == ["c0"]
