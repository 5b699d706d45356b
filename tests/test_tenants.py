"""A control plane fit for many tenants (issue 18): an admin key apart from inference keys,
the control plane off without one, locked parameters, a per-key policy (apps a key may name,
apps in mode "all" that apply to it), provenance of every response (``xmix_applied``), one
audit line per change, and limits per request and per server.

The first half checks the pieces alone (policy file, credentials, the registry's admission
under a policy, the control block's per-request opt-out of a mode-"all" app on both kernel
twins); the second half one ``xmix serve`` over HTTP with two tenants."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

import xmix
from xmix.hooks import ModelShape
from xmix.integrations.vllm import tenants
from xmix.integrations.vllm.frontend import Needs, Registry, provenance
from xmix.lowering import lower

from harness import SMALL

D = 64
SHAPE = ModelShape(n_layers=2, hidden_size=D, vocab_size=64)
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# ------------------------------------------------------------------ policy file and keys
def test_policy_file_is_checked_and_maps_keys_to_tenants(tmp_path):
    doc = {"tenants": {"research": {"keys_sha256": [sha("r-key")], "apps": "*", "forced": []},
                       "product": {"keys_sha256": [sha("p-key").upper()], "apps": ["steer"]}},
           "default": {"apps": []}}
    p = tmp_path / "policy.json"
    p.write_text(json.dumps(doc))
    pol = tenants.Policy.load(str(p))
    r, prod, other = pol.tenant("r-key"), pol.tenant("p-key"), pol.tenant("someone")
    assert (r.name, r.apps, r.forced) == ("research", None, frozenset())
    assert (prod.name, prod.apps, prod.forced) == ("product", frozenset({"steer"}), None)
    assert other is pol.default and pol.tenant(None) is pol.default
    assert not other.may_name("steer") and other.may_force("safety")
    bad = [
        ({"tenants": {"x": {"keys_sha256": ["not-hex"]}}}, "SHA-256 digests"),
        ({"tenants": {"x": {"keys_sha256": [sha("k")], "apps": "steer"}}}, '"apps" must be'),
        ({"tenants": {"x": {"keys_sha256": [sha("k")], "colour": 1}}}, "rules are an object"),
        ({"tenants": {"x": {"keys_sha256": [sha("k")]}, "y": {"keys_sha256": [sha("k")]}}}, "listed for tenant"),
        ({"tenant": {}}, "must be an object"),
        ([], "must be an object"),
    ]
    for d, msg in bad:
        with pytest.raises(tenants.PolicyError, match=msg):
            tenants.Policy.parse(d)
    p.write_text("{")
    with pytest.raises(tenants.PolicyError, match="not valid JSON"):
        tenants.Policy.load(str(p))


def test_admin_key_is_apart_from_inference_keys():
    auth = tenants.Auth(api_keys=["gen"], admin_keys=["adm"])
    assert auth.check_change("Bearer adm") is None
    assert auth.check_change("Bearer gen")[0] == 403            # may generate, may not deploy
    assert auth.check_change("Bearer nope")[0] == 401
    assert auth.check_change(None)[0] == 401
    assert auth.check_read("Bearer gen") is None and auth.check_read("Bearer adm") is None
    assert auth.check_read("Bearer nope")[0] == 401
    assert not auth.may_generate("adm")                          # the admin key is not an inference key
    # no admin key: off, whatever key is sent, unless opened explicitly
    off = tenants.Auth(api_keys=["gen"], admin_keys=[])
    status, msg = off.check_change("Bearer gen")
    assert status == 403 and "control plane is off" in msg and "--xmix-admin-key" in msg
    assert "control plane off" in off.start_lines()[0]
    opened = tenants.Auth(api_keys=["gen"], admin_keys=[], open_control=True)
    assert opened.check_change("Bearer gen") is None and opened.check_change("Bearer x")[0] == 401
    assert "OPEN" in opened.start_lines()[0]
    anyone = tenants.Auth(api_keys=[], admin_keys=[], open_control=True)
    assert anyone.check_change(None) is None and "ANYONE" in anyone.start_lines()[0]
    assert tenants.Auth([], []).check_change(None)[0] == 403


def test_audit_lines_carry_a_fingerprint_never_the_key(tmp_path, caplog):
    path = tmp_path / "audit.jsonl"
    audit = tenants.Audit(str(path))
    with caplog.at_level("INFO", logger="vllm.xmix.audit"):
        audit.record(tenants.fingerprint("secret-admin-key"), "deploy", "steer", 201, "deployed", mode="all")
        audit.record(tenants.fingerprint(None), "patch", "steer", 401, "refused")
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    assert [l["action"] for l in lines] == ["deploy", "patch"]
    assert lines[0]["key"] == sha("secret-admin-key")[:12] and lines[1]["key"] == "none"
    assert lines[0]["mode"] == "all" and lines[0]["status"] == 201 and lines[0]["time"].endswith("Z")
    assert "secret-admin-key" not in path.read_text() + caplog.text
    assert caplog.text.count("xmix audit") == 2


# ------------------------------------------------------------------ admission under a policy
def _registry() -> Registry:
    reg = Registry(SHAPE)
    g = torch.Generator().manual_seed(3)
    for name, mode in (("steer", "request"), ("probe", "request"), ("safety", "all")):
        app = xmix.App(name)
        if name == "probe":
            app.read("probe", weight=torch.randn(D, generator=g)).layers([1]).submodule("residual.post").named("p")
        else:
            app.write("add", vector=torch.randn(D, generator=g), scale=1.0).layers([0]) \
               .submodule("residual.post").named("push")
        lw = lower(app, SHAPE)
        reg.add(app, lw, mode, reg.next_version(), Needs.of(lw))
        reg.changed("deploy", name)
    return reg


def _as(tenant):
    return tenants.set_caller(tenants.Caller("fp", tenant))


def test_admission_follows_the_callers_policy():
    reg = _registry()
    product = tenants.Tenant("product", frozenset({"steer"}), frozenset())
    tok = _as(product)
    try:
        adm = reg.admit({"apps": ["steer"], "params": {"steer": {"scale": 2.0}}})
        # the mode-"all" app does not apply to it: opted out by name, not in its provenance
        assert adm.control["forced"] == []
        applied = adm.control["applied"]
        assert [(a["name"], a["mode"], a["params"]) for a in applied["apps"]] == \
            [("steer", "request", {"push.scale": 2.0})]
        assert applied["tenant"] == "product"
        for ctl, msg in (({"apps": ["probe"]}, "app 'probe' is not allowed for this key"),
                         ({"apps": ["steer"], "params": {"probe": {"bias": 1.0}}}, "params for app 'probe'")):
            with pytest.raises(ValueError, match=msg) as e:
                reg.admit(ctl)
            assert tenants.is_forbidden(e.value) and getattr(e.value, "http_status", 403) == 403
    finally:
        tenants.reset_caller(tok)
    # a name the key may use but nobody deployed: a 400 that lists only what it may name
    tok = _as(tenants.Tenant("product", frozenset({"steer", "nope"}), None))
    try:
        with pytest.raises(ValueError, match=r"deployed: \['steer'\]") as e:
            reg.admit({"apps": ["nope"]})
        assert not tenants.is_forbidden(e.value)
    finally:
        tenants.reset_caller(tok)
    # no caller (offline): every mode-all app applies, nothing is forbidden
    adm = reg.admit({"apps": ["probe"]})
    assert "forced" not in adm.control
    assert sorted(a["name"] for a in adm.control["applied"]["apps"]) == ["probe", "safety"]
    # a server's policy and no caller in context: the policy's default (fail closed)
    reg.policy = tenants.Policy({}, tenants.Tenant("default", frozenset(), None))
    with pytest.raises(ValueError, match="not allowed"):
        reg.admit({"apps": ["probe"]})


def test_locked_parameters_cannot_be_overridden_by_requests():
    """An operator's mode-"all" safety app: a request's "scale": 0 would neutralise it. With
    its parameters locked that request is refused (403 naming them); unlocking restores it."""
    reg = _registry()
    _, lock = reg.check_patch("safety", None, None, True)
    reg.patch("safety", None, {}, lock)
    assert reg.get("safety").describe()["locked"] == ["push.scale"]
    with pytest.raises(ValueError, match=r"\['push.scale'\] are locked by the operator") as e:
        reg.admit({"params": {"safety": {"scale": 0.0}}})
    assert tenants.is_forbidden(e.value)
    reg.admit({"apps": ["steer"], "params": {"steer": {"scale": 0.0}}})  # other apps: as before
    _, lock = reg.check_patch("safety", None, None, ["push.scale"])
    assert lock == {0}
    with pytest.raises(xmix.lowering.DeployError, match="cannot lock unknown parameter"):
        reg.check_patch("safety", None, None, ["volume"])
    _, lock = reg.check_patch("safety", None, None, False)
    reg.patch("safety", None, {}, lock)
    assert reg.admit({"params": {"safety": {"scale": 0.0}}}).control["applied"]["apps"][0]["params"] == \
        {"push.scale": 0.0}


def test_request_limits(monkeypatch):
    reg = _registry()
    monkeypatch.setenv("XMIX_MAX_REQUEST_APPS", "1")
    with pytest.raises(ValueError, match="names 2 apps; at most 1 .XMIX_MAX_REQUEST_APPS"):
        reg.admit({"apps": ["steer", "probe"]})
    monkeypatch.setenv("XMIX_MAX_REQUEST_PARAMS", "1")
    with pytest.raises(ValueError, match="sets 2 parameters; at most 1 .XMIX_MAX_REQUEST_PARAMS"):
        reg.admit({"apps": ["steer"], "params": {"steer": {"scale": 1.0, "push.scale": 2.0}}})
    monkeypatch.setenv("XMIX_MAX_APPS", "3")
    extra = xmix.App("extra")
    extra.read("probe", weight=torch.ones(D)).layers([0]).submodule("residual.pre")
    from xmix.integrations.vllm.frontend import CapacityError

    with pytest.raises(CapacityError, match="3 apps are deployed; the server allows 3 .XMIX_MAX_APPS"):
        reg.prepare(extra)


def test_provenance_lists_the_changes_a_request_lived_through():
    reg = _registry()
    plain = reg.admit({"apps": ["probe"]}).control["applied"]
    steered = reg.admit({"apps": ["steer"]}).control["applied"]
    assert provenance(plain)["changed"] == [] and "_rev" not in provenance(plain)
    reg.patch("steer", None, {0: 3.0})
    reg.changed("params", "steer")
    assert provenance(plain)["changed"] == [] and provenance(steered)["changed"] == ["steer"]
    late = xmix.App("late")
    late.read("probe", weight=torch.ones(D)).layers([0]).submodule("residual.pre")
    lw = lower(late, SHAPE)
    reg.add(late, lw, "all", reg.next_version(), Needs.of(lw))
    reg.changed("deploy", "late")  # a mode-"all" deploy reaches every running request
    assert provenance(plain)["changed"] == ["late"]
    opted_out = dict(plain, _forced=["safety"])
    assert provenance(opted_out)["changed"] == []


# ------------------------------------------------------------------ kernels: opt-out of mode all
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_opted_out_of_a_mode_all_app_is_left_alone(backend):
    """control.h app_active: in mode "all" a request's bit opts it out. a: every mode-all
    app applies; b: none (forced=[]); c: only 'safety'. Mode switches and a later mode-all
    deploy keep each request's choice."""
    from xmix.control import ControlBlock

    v = torch.arange(D, dtype=torch.float32) / D
    safety = xmix.App("safety")
    safety.write("add", vector=v, scale=1.0).layers([0]).submodule("residual.pre")
    cb = ControlBlock(SHAPE, backend, SMALL)
    cb.install(lower(safety, SHAPE), "all", 1)
    slots = [cb.admit_pinned("a", [], {}, 2)[0], cb.admit_pinned("b", [], {}, 2, forced=[])[0],
             cb.admit_pinned("c", [], {}, 2, forced=["safety"])[0]]
    from xmix import ops

    def step(site_layer: int = 0) -> torch.Tensor:
        cb.begin_step(np.array(slots, dtype=np.int32), np.array([2, 2, 2]), np.array([0, 0, 0]),
                      np.array([2, 2, 2]))
        cb.prologue(torch.zeros(6, dtype=torch.int32, device=backend))
        ops.set_control(cb)
        h = torch.zeros(6, D, device=backend)
        torch.ops.xmix.site(h, None, site_layer * 6)
        cb.end_step()
        return h.cpu()

    def applied(h, add):
        return [bool(torch.allclose(h[2 * i], add)) for i in range(3)]

    assert applied(step(), v) == [True, False, True]
    cb.patch("safety", mode="request")       # nobody named it
    assert applied(step(), v) == [False, False, False]
    cb.patch("safety", mode="all")
    assert applied(step(), v) == [True, False, True]
    second = xmix.App("second")
    second.write("add", vector=torch.ones(D), scale=1.0).layers([0]).submodule("residual.pre")
    cb.install(lower(second, SHAPE), "all", 2)
    h = step()
    assert applied(h, v + 1) == [True, False, False] and torch.allclose(h[4], v)
