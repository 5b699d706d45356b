"""The console's server-side parts without a server: condition decisions worked out from
results (against hand-computed rows), the per-app usage counters and the Live snapshot read
from them (against hand-computed means and rates), the static files and their headers."""

from __future__ import annotations

import math
import struct
import threading
from types import SimpleNamespace

import pytest
import torch

import xmix
from xmix.integrations.vllm.http.console import console_url, live
from xmix.integrations.vllm.http.console import decisions as D
from xmix.lang import conditions as C
from xmix.lang.lowering import lower
from xmix.lang.sites import ModelShape

SHAPE = ModelShape(n_layers=4, hidden_size=8, vocab_size=50, model_name="m")
F32_TENTH = struct.unpack("f", struct.pack("f", 0.1))[0]  # 0.10000000149011612


def _app():
    a = xmix.App("a")
    a.param("theta", 0.5)
    a.token_set("trig", ids=[7])
    a.token_set("open", ids=[3])
    a.token_set("close", ids=[4])
    w = torch.ones(8)
    a.read("probe", weight=w, bias=0.0).layers([1]).at("residual.post").named("g")
    a.read("capture", dims=(0, 2)).layers([1]).at("residual.post").named("cap")
    a.write("add", vector=w, scale=1.0).layers([3]).at("residual.post").named("gate").cond(
        gate="g >= theta"
    )
    a.write("add", vector=w, scale=1.0).layers([3]).at("residual.post").named("tok").cond(
        "token_in(trig) and generated"
    )
    a.write("add", vector=w, scale=1.0).layers([3]).at("residual.post").named("span").cond(
        "in_span(open, close)"
    )
    a.write("add", vector=w, scale=1.0).layers([3]).at("residual.post").named("late").cond(
        "prompt_mean(g) >= 0.5"
    )
    a.write("add", vector=w, scale=1.0).layers([0]).at("residual.post").named("early").cond(
        "prompt_last(g) > 0.6"
    )
    a.write("add", vector=w, scale=1.0).layers([3]).at("residual.post").named("capg").cond(
        "cap > 0"
    )
    a.write("add", vector=w, scale=1.0).layers([3]).at("residual.post").named("mixed").cond(
        "(cap > 0 and prompt) or last_token"
    )
    a.write("add", vector=w, scale=1.0).layers([3]).at("residual.post").named("tenth").cond(
        "g <= 0.1"
    )
    return a


IDS = [1, 3, 5, 4, 7, 7, 9]  # prompt: 4 tokens; generated 7, 7, 9 (9 never fed back)
P = 4
G = [0.2, 0.9, 0.5, 0.7, F32_TENTH, 0.55]  # g at positions 0..5
RESULTS = {
    "g": {"positions": list(range(6)), "values": G},
    "cap": {"positions": list(range(6)), "values": [[1.0, 2.0]] * 6},
}


def _fired(ops, name):
    return next(o["fired"] for o in ops if o["op"] == f"'{name}'")


def test_decisions_from_results_match_hand_computed_rows():
    lw = lower(_app(), SHAPE)
    ops = D.decisions(lw, IDS, P, RESULTS)
    assert {o["op"] for o in ops} == {
        f"'{n}'" for n in ("gate", "tok", "span", "late", "early", "capg", "mixed", "tenth")
    }
    # per-token gate against the app's default theta = 0.5
    assert _fired(ops, "gate") == [False, True, True, True, False, True]
    # token_in(trig) and generated: ids 7 at positions 4 and 5
    assert _fired(ops, "tok") == [False, False, False, False, True, True]
    # in_span(open=3, close=4): the opener is inside, the closer is not
    assert _fired(ops, "span") == [False, True, True, False, False, False]
    # prompt_mean(g) = (0.2 + 0.9 + 0.5 + 0.7) / 4 = 0.575 >= 0.5; the op (layer 3) is after
    # the read (layer 1): decided from the last prompt token (position 3) on
    assert _fired(ops, "late") == [False, False, False, True, True, True]
    # prompt_last(g) = 0.7 > 0.6; the op (layer 0) is before the read: from the first
    # generated token (position 4) on
    assert _fired(ops, "early") == [False, False, False, False, True, True]
    # a gate on a capture read (vectors) is not determined by the results
    assert _fired(ops, "capg") == [None] * 6
    # unknown or true -> true; unknown and false -> false; last_token from position 3
    assert _fired(ops, "mixed") == [None, None, None, True, True, True]
    # thresholds are compared in fp32, as the kernels do: fp32(0.1) <= fp32(0.1)
    assert _fired(ops, "tenth") == [False, False, False, False, True, False]


def test_decisions_use_the_requests_parameters_and_missing_reads():
    lw = lower(_app(), SHAPE)
    ops = D.decisions(lw, IDS, P, RESULTS, {"theta": 0.6})
    assert _fired(ops, "gate") == [False, True, False, True, False, False]
    # the read did not run on positions 0 and 5 (its own condition): the gate is false there
    partial = {"g": {"positions": [1, 2, 3, 4], "values": G[1:5]}}
    ops = D.decisions(lw, IDS, P, partial)
    assert _fired(ops, "gate") == [False, True, True, True, False, False]
    # no results for the read at all: not determined
    ops = D.decisions(lw, IDS, P, {})
    assert _fired(ops, "gate") == [None] * 6
    assert _fired(ops, "tok") == [False, False, False, False, True, True]
    # non-finite values come as null and compare false
    ops = D.decisions(lw, IDS, P, {"g": {"positions": list(range(6)), "values": [None] * 6}})
    assert _fired(ops, "gate") == [False] * 6
    with pytest.raises(ValueError, match="prompt_len"):
        D.decisions(lw, IDS, 0, RESULTS)


def test_sae_reads_gate_on_their_first_channel_or_one_feature():
    assert C.read_scalar({"ids": [3, 9], "acts": [2.5, 0.5]}) == 2.5  # top-K: largest
    assert C.read_scalar({"ids": [], "acts": []}) == 0.0  # none active
    assert C.read_scalar({"ids": [40, 12], "acts": [0.0, 1.5]}) == 0.0  # features: first
    assert C.read_scalar({"ids": [40, 12], "acts": [0.0, 1.5]}, 1) == 1.5  # name.f12
    assert C.read_scalar([1.0, 2.0]) is None
    assert math.isnan(C.read_scalar(None))

    from xmix.lang.sae import SAE

    g = torch.Generator().manual_seed(0)
    sae = SAE(
        torch.randn(8, 16, generator=g),
        torch.zeros(16),
        torch.randn(16, 8, generator=g),
        torch.zeros(8),
        hook="layers.1.residual.post",
    )
    a = xmix.App("s")
    a.read("sae", sae=sae, features=[4, 11]).named("f")
    a.write("add", vector=torch.ones(8), scale=1.0).layers([3]).at("residual.post").named("w").cond(
        gate="f.f11 > 1.0"
    )
    a.write("add", vector=torch.ones(8), scale=1.0).layers([3]).at("residual.post").named("v").cond(
        gate="prompt_mean(f.f4) >= 0.5"
    )
    lw = lower(a, SHAPE)
    vals = [
        {"ids": [4, 11], "acts": [x, y]}
        for x, y in [(0.0, 2.0), (1.0, 0.5), (0.2, 1.0), (0.5, 3.0), (0.0, 0.0)]
    ]
    res = {"f": {"positions": list(range(5)), "values": vals}}
    ops = D.decisions(lw, [1, 2, 3, 4, 5, 6], 3, res)
    assert _fired(ops, "w") == [True, False, False, True, False]
    # mean of f4 over the prompt (0 + 1 + 0.2) / 3 = 0.4 < 0.5
    assert _fired(ops, "v") == [False] * 5


# ---------------------------------------------------------------------- usage and Live
class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _step(req_id: str, results, new_tokens: int, finished: bool) -> list:
    """One engine step's output for one request, as the output processor gets it: results
    ride kv_transfer_params under the carrier key."""
    from xmix.integrations.vllm.result_keys import CARRIER

    return [
        SimpleNamespace(
            request_id=req_id,
            kv_transfer_params={CARRIER: results} if results is not None else None,
            new_token_ids=list(range(new_tokens)),
            finish_reason="stop" if finished else None,
        )
    ]


def _registry(apps: dict):
    deployed = {}
    for name, (app, mode) in apps.items():
        lw = lower(app, SHAPE)
        defaults = dict(lw.app_params)
        deployed[name] = SimpleNamespace(mode=mode, lowered=lw, defaults=defaults)
    return SimpleNamespace(apps=deployed, lock=threading.RLock(), shape=SHAPE)


def test_usage_counts_gates_and_latency_per_app_and_live_reads_them_back():
    from prometheus_client import CollectorRegistry

    from xmix.integrations.vllm.frontend import metrics
    from xmix.integrations.vllm.frontend.usage import Usage

    m = metrics._make(CollectorRegistry())
    plain = xmix.App("plain")
    plain.write("add", vector=torch.ones(8), scale=1.0).layers([2]).at("residual.post")
    reg = _registry({"a": (_app(), "request"), "plain": (plain, "all")})
    clock = Clock()
    u = Usage(reg, m, clock)

    # request 1 names "a" with theta 0.8; "plain" (mode all) applies too
    u.admitted("r1", {"apps": ["a"], "params": {"a": {"theta": 0.8}}})
    clock.t = 100.5
    u.outputs(_step("r1", {"a": {"g": {"positions": [0, 1, 2, 3], "values": G[:4]}}}, 1, False))
    clock.t = 100.7
    u.outputs(_step("r1", {"a": {"g": {"positions": [4], "values": [0.95]}}}, 1, False))
    clock.t = 100.9
    u.outputs(_step("r1", {"a": {"g": {"positions": [5], "values": [None]}}}, 1, True))
    # request 2: no control; only "plain" (mode all) applies
    clock.t = 200.0
    u.admitted("r2", None)
    clock.t = 200.2
    u.outputs(_step("r2", None, 1, False))
    clock.t = 200.3
    u.outputs(_step("r2", None, 1, True))
    assert u.records == {}
    # reg without "all" apps: a request that uses no app is the baseline
    reg.apps["plain"].mode = "request"
    clock.t = 300.0
    u.admitted("r3", {})
    clock.t = 300.1
    u.outputs(_step("r3", None, 2, False))
    clock.t = 300.4
    u.outputs(_step("r3", None, 1, True))
    # an aborted request leaves no record behind
    u.admitted("r4", {"apps": ["a"]})
    u.dropped(["r4"])
    assert u.records == {}

    apps = [{"name": "a", "mode": "request"}, {"name": "plain", "mode": "request"}]
    snap = live.snapshot(m, "m", apps)
    a, p = snap["apps"]
    # gate g >= theta with theta 0.8: values 0.2 0.9 0.5 0.7 0.95 null ran, 2 fired (null, a
    # non-finite value, compares false); g <= 0.1 on none of them; the gate on the capture read
    # has no scalar to count
    assert a["gates"] == [
        {"gate": "g <= 0.1", "tokens": 6.0, "fired": 0.0, "rate": 0.0},
        {"gate": "g >= theta", "tokens": 6.0, "fired": 2.0, "rate": 1 / 3},
    ]
    # r1: TTFT 0.5 s, 3 tokens from 100.5 to 100.9: TPOT 0.2 s
    assert a["requests_finished"] == 1 and a["ttft_mean_s"] == pytest.approx(0.5)
    assert a["tpot_mean_s"] == pytest.approx(0.2)
    # plain: r1 and r2 -> TTFT (0.5 + 0.2) / 2, TPOT (0.2 + 0.1) / 2
    assert p["requests_finished"] == 2 and p["ttft_mean_s"] == pytest.approx(0.35)
    assert p["tpot_mean_s"] == pytest.approx(0.15)
    # baseline r3: TTFT 0.1, 3 tokens from 300.1 to 300.4: TPOT 0.15
    assert snap["no_app"]["requests_finished"] == 1
    assert snap["no_app"]["ttft_mean_s"] == pytest.approx(0.1)
    assert a["ttft_added_s"] == pytest.approx(0.4) and a["tpot_added_s"] == pytest.approx(0.05)
    assert p["tpot_added_s"] == pytest.approx(0.0)
    # admitted counts come from the admission counter (not touched here)
    assert a["requests_admitted"] == 0
    assert a["monitors"] == [] and p["monitors"] == []


def test_usage_counts_monitors_per_app_and_read_and_live_shows_them():
    """Requests a stop ended and requests whose since(...) started to hold, counted once per
    request (the engine reports each once) from the packed results the engine core sends."""
    from prometheus_client import CollectorRegistry

    from xmix.integrations.vllm.frontend import metrics
    from xmix.integrations.vllm.frontend.usage import Usage
    from xmix.lang.results_codec import STOPPED_KEY, SWITCHED_KEY

    m = metrics._make(CollectorRegistry())
    reg = _registry({"a": (_app(), "request")})
    u = Usage(reg, m, Clock())
    stop = {"app": "a", "read": "g", "position": 4, "value": 0.9}
    sw = {"app": "a", "read": "g", "position": 2, "condition": "since(g > 0.5)"}
    tok = {"app": "a", "read": None, "position": 0, "condition": "since(last_token)"}
    u.admitted("r1", {"apps": ["a"]})
    u.outputs(_step("r1", {SWITCHED_KEY: [sw]}, 1, False))
    u.outputs(_step("r1", {STOPPED_KEY: stop}, 0, True))
    u.admitted("r2", {"apps": ["a"]})
    u.outputs(_step("r2", {SWITCHED_KEY: [sw, tok]}, 1, False))
    u.outputs(_step("r2", None, 1, True))
    u.admitted("r3", {"apps": ["a"]})
    u.outputs(_step("r3", {STOPPED_KEY: {**stop, "read": None}}, 0, True))
    snap = live.snapshot(m, "m", [{"name": "a", "mode": "request"}])
    assert snap["apps"][0]["monitors"] == [
        {"action": "stopped", "read": "", "requests": 1.0},
        {"action": "stopped", "read": "g", "requests": 1.0},
        {"action": "switched", "read": "", "requests": 1.0},
        {"action": "switched", "read": "g", "requests": 2.0},
    ]


def test_app_names_hidden_on_metrics_and_named_again_for_those_who_may_see_them(monkeypatch):
    """Issue 33 item 5: the unauthenticated /metrics carried every app's name (and its
    gates' conditions). With XMIX_METRICS_APP_LABELS=hashed they are keyed hashes there; the
    console's Live view (authenticated) names them again, for the apps the caller may see
    only."""
    from prometheus_client import CollectorRegistry, generate_latest

    from xmix.integrations.vllm import keyed
    from xmix.integrations.vllm.frontend import metrics
    from xmix.integrations.vllm.frontend.usage import Usage, gates_of

    monkeypatch.setenv("XMIX_METRICS_APP_LABELS", "hashed")
    monkeypatch.setattr(metrics, "_label_keys", None)
    keys = keyed.Keys(b"metrics test secret")
    metrics.set_app_labels(keys)
    m = metrics._make(CollectorRegistry())
    from xmix.integrations.vllm.frontend.admission import admit
    from xmix.integrations.vllm.frontend.registry import Needs, Registry

    reg = Registry(SHAPE)  # the frontend's: it counts admissions under the app's label
    reg.metrics = m
    lw = lower(_app(), SHAPE)
    reg.add(_app(), lw, "request", 1, Needs.of(lw))
    u = Usage(reg, m, Clock())
    admit(reg, {"apps": ["a"]})
    u.admitted("r1", {"apps": ["a"], "params": {"a": {"theta": 0.8}}})
    u.outputs(_step("r1", {"a": {"g": {"positions": [0, 1, 2, 3], "values": G[:4]}}}, 1, False))
    u.outputs(
        _step("r1", {"!stopped": {"app": "a", "read": "g", "position": 3, "value": 0.9}}, 0, True)
    )
    text = generate_latest(m["app_requests"]).decode() + "".join(
        generate_latest(m[k]).decode() for k in ("gate_tokens", "gate_fired", "app_ttft", "stopped")
    )
    assert 'app="a"' not in text and "theta" not in text and "g >=" not in text
    assert 'read="g"' not in text and f'read="{keys.label("a/g")}"' in text
    assert f'app="{keys.label("a")}"' in text and keys.label("a") != keys.label("b")
    gates = {"a": [g.label for g in gates_of(reg.apps["a"].lowered, reg.apps["a"].defaults, {})]}
    apps = [{"name": "a", "mode": "request", "reads": ["c", "g"]}]
    row = live.snapshot(m, "m", apps, metrics.shown, gates)["apps"][0]
    assert row["name"] == "a" and row["requests_admitted"] == 1
    assert row["monitors"] == [{"action": "stopped", "read": "g", "requests": 1.0}]
    assert {g["gate"] for g in row["gates"]} == {"g <= 0.1", "g >= theta"}
    # a caller who may not see "a": the snapshot is given the apps it may see, nothing of a
    assert live.snapshot(m, "m", [], metrics.shown, {})["apps"] == []
    metrics.set_app_labels(None)
    monkeypatch.setenv("XMIX_METRICS_APP_LABELS", "names")
    metrics.set_app_labels(keys)
    assert metrics.app_label("a") == "a"
    monkeypatch.setenv("XMIX_METRICS_APP_LABELS", "hidden")
    with pytest.raises(ValueError, match="must be one of"):
        metrics.app_labels_mode()


def test_console_url_follows_the_server_arguments():
    ns = SimpleNamespace
    assert console_url(ns(host=None, port=8000)) == "http://localhost:8000/xmix/ui/"
    assert console_url(ns(host="0.0.0.0", port=9)) == "http://localhost:9/xmix/ui/"
    assert console_url(ns(host="::1", port=9, ssl_certfile="c.pem")) == "https://[::1]:9/xmix/ui/"
    assert (
        console_url(ns(host="10.0.0.2", port=9, root_path="/llm/"))
        == "http://10.0.0.2:9/llm/xmix/ui/"
    )


def test_static_files_ship_with_the_package_and_load_nothing_from_outside():
    import re

    from xmix.integrations.vllm.http.console.router import STATIC, static_file

    for name in STATIC:
        text = static_file(name).decode()
        assert "http://" not in text and "https://" not in text, name
    html = static_file("index.html").decode()
    assert re.findall(r'(?:src|href)="([^"]+)"', html) == ["console.css", "console.js"]
    assert "<script>" not in html and "style=" not in html  # CSP: no inline code
    js = static_file("console.js").decode()
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "eval(" not in js
