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
from harness import SMALL
from xmix.integrations.vllm import keyed, tenants
from xmix.integrations.vllm.frontend.admission import admit, cache_salt
from xmix.integrations.vllm.frontend.processor_patches import provenance
from xmix.integrations.vllm.frontend.registry import Needs, Registry
from xmix.lang.lowering import lower
from xmix.lang.sites import ModelShape

D = 64
SHAPE = ModelShape(n_layers=2, hidden_size=D, vocab_size=64)
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# ------------------------------------------------------------------ policy file and keys
def test_policy_file_is_checked_and_maps_keys_to_tenants(tmp_path):
    doc = {
        "tenants": {
            "research": {"keys_sha256": [sha("r-key")], "apps": "*", "forced": []},
            "product": {"keys_sha256": [sha("p-key").upper()], "apps": ["steer"]},
        },
        "default": {"apps": []},
    }
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
        (
            {"tenants": {"x": {"keys_sha256": [sha("k")]}, "y": {"keys_sha256": [sha("k")]}}},
            "listed for tenant",
        ),
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
    assert auth.check_change("Bearer gen")[0] == 403  # may generate, may not deploy
    assert auth.check_change("Bearer nope")[0] == 401
    assert auth.check_change(None)[0] == 401
    assert auth.check_read("Bearer gen") is None and auth.check_read("Bearer adm") is None
    assert auth.check_read("Bearer nope")[0] == 401
    assert not auth.may_generate("adm")  # the admin key is not an inference key
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


def test_audit_lines_carry_a_keyed_fingerprint_never_the_key(tmp_path, caplog):
    """Issue 33 item 6: the fingerprint was the first 12 hex digits of the key's SHA-256, so
    anyone with the log could test guesses of a weak key offline (and match the policy file's
    digests). Now a MAC keyed with the deployment's secret: the same key gives the same
    fingerprint under one secret, another under another, and no SHA-256 of the key shows.
    The log file is created 0600."""
    path = tmp_path / "audit.jsonl"
    audit = tenants.Audit(str(path))
    auth = tenants.Auth(["weak"], ["secret-admin-key"])
    auth.keys = keyed.Keys(b"deployment secret one")
    with caplog.at_level("INFO", logger="vllm.xmix.audit"):
        audit.record(
            auth.fingerprint("Bearer secret-admin-key"),
            "deploy",
            "steer",
            201,
            "deployed",
            mode="all",
        )
        audit.record(auth.fingerprint(None), "patch", "steer", 401, "refused")
        audit.record(auth.caller("Bearer weak").key, "patch", "steer", 403, "refused")
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    assert [l["action"] for l in lines] == ["deploy", "patch", "patch"]
    fp, weak = lines[0]["key"], lines[2]["key"]
    assert lines[1]["key"] == "none" and len(fp) == len(weak) == 16 and fp != weak
    for key, shown in (("secret-admin-key", fp), ("weak", weak)):
        digest = sha(key)
        assert shown not in digest and digest[:12] not in path.read_text()
    assert auth.fingerprint("Bearer weak") == weak  # stable under one secret
    other = tenants.Auth(["weak"], [])
    other.keys = keyed.Keys(b"deployment secret two")
    assert other.fingerprint("Bearer weak") != weak
    assert (
        lines[0]["mode"] == "all" and lines[0]["status"] == 201 and lines[0]["time"].endswith("Z")
    )
    assert "secret-admin-key" not in path.read_text() + caplog.text
    assert caplog.text.count("xmix audit") == 3
    assert path.stat().st_mode & 0o777 == 0o600


def test_an_audit_log_others_can_read_is_named_at_start(tmp_path, caplog):
    path = tmp_path / "audit.jsonl"
    path.write_text("")
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="vllm.xmix"):
        tenants.Audit(str(path))
    assert "can be read by other users (mode 644)" in caplog.text


# ------------------------------------------------------------------ response cap (issue 33 item 2)
def test_one_response_shares_one_byte_budget(monkeypatch):
    """The 16 MiB cap was per prompt: 24 prompts in one request returned 240 MB. A response's
    budget (XMIX_MAX_RESPONSE_BYTES, default 64 MiB, or the key's policy) is shared by its
    prompts and choices: each sequence gets its reads over its prompt (known in advance,
    refused by the server above the cap) plus an even share of what is left, taken from one
    budget, so the sequences' caps never add up to more than it."""
    import contextvars

    from xmix.integrations.vllm.frontend import admission
    from xmix.lang.results_codec import max_response_bytes

    monkeypatch.delenv("XMIX_MAX_RESPONSE_BYTES", raising=False)
    assert max_response_bytes() == 64 << 20
    monkeypatch.setenv("XMIX_MAX_RESPONSE_BYTES", "5000")
    assert max_response_bytes() == 5000
    reg = _registry()
    per_pos = 2 * 26  # one scalar per position as JSON (results_codec.position_bytes)
    known = 4 * per_pos  # a 4-token prompt
    # 3 prompts x 2 choices: 6 sequences share 3000 bytes
    budget = admission.ResponseBudget(3000, (3000 - 6 * known) // 6, "test")

    def served():
        admission.set_response_budget(budget)
        return [admit(reg, {"apps": ["probe"]}, 4, 16, n=2) for _ in range(4)]

    adms = contextvars.copy_context().run(served)
    caps = [a.control["results"]["max_bytes"] for a in adms]
    assert adms[0].prompt_bytes == 2 * known
    assert caps[:3] == [known + (3000 - 6 * known) // 6] * 3  # 500 each
    assert caps[3] == 0 and sum(c * 2 for c in caps) <= 3000  # a 4th finds nothing left
    # outside a served request (offline) there is no response budget
    assert (
        admit(reg, {"apps": ["probe"]}, 4, 16, n=2).control["results"]["max_bytes"]
        == (16 << 20) // 2
    )
    # the policy's per-key override
    pol = tenants.Policy.parse(
        {
            "tenants": {"big": {"keys_sha256": [sha("k")], "max_response_bytes": 1 << 30}},
            "default": {"max_response_bytes": 1000},
        }
    )
    assert pol.tenant("k").max_response_bytes == 1 << 30
    assert pol.default.max_response_bytes == 1000
    for bad in (0, -1, "1000", True, 1.5):
        with pytest.raises(tenants.PolicyError, match="max_response_bytes"):
            tenants.Policy.parse({"default": {"max_response_bytes": bad}})


# ------------------------------------------------------------------ cache salts (issue 33 item 1)
def _steered(reg: Registry, client_salt=None, **kw) -> str | None:
    """The cache_salt a request naming 'steer' runs with (processor_patches.patch_input_processor)."""
    adm = admit(reg, {"apps": ["steer"], **kw})
    return cache_salt(reg, client_salt, adm)


def test_no_client_salt_equals_a_salt_xmix_derives():
    """Before: a request whose apps write got ``"xmix:" + sha256(epoch, apps, versions,
    parameters)[:32]``, computable from public facts, and a client's own ``cache_salt`` was
    used as given. A key that may not use 'steer' set that value itself and read (or filled
    with unsteered KV) the blocks of requests steered by it. Now every salt is a MAC keyed
    with the deployment's secret over (client salt, configuration), so no value a client
    sends, the derived salt itself included, ends up equal to a derived salt."""
    reg = _registry(safety=False)  # control epoch 0, as on a server with --app files only
    reg.keys = keyed.Keys(b"a deployment secret of 32 bytes.")
    derived = _steered(reg)
    assert derived is not None and derived.startswith("xmix:")
    # the old, public formula no longer gives it
    d = reg.get("steer")
    public = json.dumps([0, [["steer", d.version, [c.default for c in d.cols]]]])
    assert derived != "xmix:" + hashlib.sha256(public.encode()).hexdigest()[:32]
    # a request without apps that sends the derived salt (attack a) or a request naming
    # another app's configuration with it: neither runs with it
    plain = admit(reg, None)
    assert cache_salt(reg, derived, plain) != derived
    assert _steered(reg, derived) != derived
    for client in ("", "x", derived, derived + "|x"):
        assert cache_salt(reg, client, plain) not in (derived, None)
    # the client's own salt is mixed in, not replaced: clients that share a salt share
    # blocks, others do not; a request without a salt and without writes stays unsalted
    assert _steered(reg, "team-a") == _steered(reg, "team-a") != _steered(reg, "team-b")
    assert _steered(reg, "team-a") != derived
    assert cache_salt(reg, None, plain) is None
    assert cache_salt(reg, "team-a", plain) == cache_salt(reg, "team-a", admit(reg, {}))
    # every parameter value is part of it
    assert _steered(reg, params={"steer": {"scale": 2.0}}) != derived
    # the same configuration under the same secret gives the same salt (another API server
    # of the deployment); under another secret another one
    twin = _registry(safety=False)
    twin.keys = keyed.Keys(b"a deployment secret of 32 bytes.")
    assert _steered(twin) == derived
    twin.keys = keyed.Keys(b"another deployment's secret, 32b")
    assert _steered(twin) != derived


# ------------------------------------------------------------------ admission under a policy
def _registry(safety: bool = True) -> Registry:
    reg = Registry(SHAPE)
    g = torch.Generator().manual_seed(3)
    apps = (("steer", "request"), ("probe", "request"), ("safety", "all"))
    for name, mode in apps if safety else apps[:2]:
        app = xmix.App(name)
        if name == "probe":
            app.read("probe", weight=torch.randn(D, generator=g)).layers([1]).at(
                "residual.post"
            ).named("p")
        else:
            app.write("add", vector=torch.randn(D, generator=g), scale=1.0).layers([0]).at(
                "residual.post"
            ).named("push")
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
        adm = admit(reg, {"apps": ["steer"], "params": {"steer": {"scale": 2.0}}})
        # the mode-"all" app does not apply to it: opted out by name, not in its provenance
        assert adm.control["forced"] == []
        applied = adm.control["applied"]
        assert [(a["name"], a["mode"], a["params"]) for a in applied["apps"]] == [
            ("steer", "request", {"push.scale": 2.0})
        ]
        assert applied["tenant"] == "product"
        for ctl, msg in (
            ({"apps": ["probe"]}, "app 'probe' is not allowed for this key"),
            ({"apps": ["steer"], "params": {"probe": {"bias": 1.0}}}, "params for app 'probe'"),
        ):
            with pytest.raises(ValueError, match=msg) as e:
                admit(reg, ctl)
            assert tenants.is_forbidden(e.value) and getattr(e.value, "http_status", 403) == 403
    finally:
        tenants.reset_caller(tok)
    # a name the key may use but nobody deployed: a 400 that lists only what it may name
    tok = _as(tenants.Tenant("product", frozenset({"steer", "nope"}), None))
    try:
        with pytest.raises(ValueError, match=r"deployed: \['steer'\]") as e:
            admit(reg, {"apps": ["nope"]})
        assert not tenants.is_forbidden(e.value)
    finally:
        tenants.reset_caller(tok)
    # no caller (offline): every mode-all app applies, nothing is forbidden
    adm = admit(reg, {"apps": ["probe"]})
    assert "forced" not in adm.control
    assert sorted(a["name"] for a in adm.control["applied"]["apps"]) == ["probe", "safety"]
    # a server's policy and no caller in context: the policy's default (fail closed)
    reg.policy = tenants.Policy({}, tenants.Tenant("default", frozenset(), None))
    with pytest.raises(ValueError, match="not allowed"):
        admit(reg, {"apps": ["probe"]})


def test_locked_parameters_cannot_be_overridden_by_requests():
    """An operator's mode-"all" safety app: a request's "scale": 0 would neutralise it. With
    its parameters locked that request is refused (403 naming them); unlocking restores it."""
    reg = _registry()
    _, lock = reg.check_patch("safety", None, None, True)
    reg.patch("safety", None, {}, lock)
    assert reg.get("safety").describe()["locked"] == ["push.scale"]
    with pytest.raises(ValueError, match=r"\['push.scale'\] are locked by the operator") as e:
        admit(reg, {"params": {"safety": {"scale": 0.0}}})
    assert tenants.is_forbidden(e.value)
    admit(reg, {"apps": ["steer"], "params": {"steer": {"scale": 0.0}}})  # other apps: as before
    _, lock = reg.check_patch("safety", None, None, ["push.scale"])
    assert lock == {0}
    with pytest.raises(xmix.lang.lowering.DeployError, match="cannot lock unknown parameter"):
        reg.check_patch("safety", None, None, ["volume"])
    _, lock = reg.check_patch("safety", None, None, False)
    reg.patch("safety", None, {}, lock)
    assert admit(reg, {"params": {"safety": {"scale": 0.0}}}).control["applied"]["apps"][0][
        "params"
    ] == {"push.scale": 0.0}


def test_request_limits(monkeypatch):
    reg = _registry()
    monkeypatch.setenv("XMIX_MAX_REQUEST_APPS", "1")
    with pytest.raises(ValueError, match="names 2 apps; at most 1 .XMIX_MAX_REQUEST_APPS"):
        admit(reg, {"apps": ["steer", "probe"]})
    monkeypatch.setenv("XMIX_MAX_REQUEST_PARAMS", "1")
    with pytest.raises(ValueError, match="sets 2 parameters; at most 1 .XMIX_MAX_REQUEST_PARAMS"):
        admit(reg, {"apps": ["steer"], "params": {"steer": {"scale": 1.0, "push.scale": 2.0}}})
    monkeypatch.setenv("XMIX_MAX_APPS", "3")
    extra = xmix.App("extra")
    extra.read("probe", weight=torch.ones(D)).layers([0]).at("residual.pre")
    from xmix.integrations.vllm.errors import CapacityError

    with pytest.raises(
        CapacityError, match="3 apps are deployed; the server allows 3 .XMIX_MAX_APPS"
    ):
        reg.prepare(extra)


def test_provenance_lists_the_changes_a_request_lived_through():
    reg = _registry()
    plain = admit(reg, {"apps": ["probe"]}).control["applied"]
    steered = admit(reg, {"apps": ["steer"]}).control["applied"]
    assert provenance(plain)["changed"] == [] and "_rev" not in provenance(plain)
    reg.patch("steer", None, {0: 3.0})
    reg.changed("params", "steer")
    assert provenance(plain)["changed"] == [] and provenance(steered)["changed"] == ["steer"]
    late = xmix.App("late")
    late.read("probe", weight=torch.ones(D)).layers([0]).at("residual.pre")
    lw = lower(late, SHAPE)
    reg.add(late, lw, "all", reg.next_version(), Needs.of(lw))
    reg.changed("deploy", "late")  # a mode-"all" deploy reaches every running request
    assert provenance(plain)["changed"] == ["late"]
    opted_out = dict(plain, _forced=["safety"])
    assert provenance(opted_out)["changed"] == []


def test_an_app_gone_after_the_pre_stream_check_is_a_change_not_a_refusal():
    """bench/soak.py at 2 000 requests found it: a streamed completion passed the server's
    pre-stream admission, its app was switched off before vLLM's lazy generator reached the
    real admission, and the refusal became an error event inside an HTTP 200 stream. After a
    passed pre-stream check (a context variable clients cannot set), such apps are left out
    and named in provenance "changed"; without one, the same control is still refused."""
    import contextvars

    from xmix.integrations.vllm.frontend import admission

    def in_request(fn):
        return contextvars.copy_context().run(fn)  # one request's context, as the server has

    reg = _registry()
    control = {"apps": ["steer", "probe"], "params": {"steer": {"push.scale": 2.0}}}

    def served():
        pre = admit(reg, control, 4, 4, count=False)  # the pre-stream check passes
        admission.mark_prechecked(pre.control["applied"]["_rev"])
        reg.patch("steer", "off", {})  # a change lands before the generator runs
        reg.changed("mode", "steer")
        return admit(reg, control, 4, 4)

    adm = in_request(served)
    assert adm.control["apps"] == ["probe"] and "steer" not in adm.control["pin"]
    applied = provenance(adm.control["applied"])
    assert [a["name"] for a in applied["apps"]] == ["probe", "safety"]
    assert applied["changed"] == ["steer"]
    # no pre-stream check in this context: the switched-off app is refused, naming it
    with pytest.raises(ValueError, match="'steer' is deployed but switched off"):
        in_request(lambda: admit(reg, control, 4, 4))

    # a check made after the change (same revision) stays strict too
    def checked_after():
        admission.mark_prechecked(reg.revision)
        return admit(reg, control, 4, 4)

    with pytest.raises(ValueError, match="switched off"):
        in_request(checked_after)


# ------------------------------------------------------------------ kernels: opt-out of mode all
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_opted_out_of_a_mode_all_app_is_left_alone(backend):
    """control.h app_active: in mode "all" a request's bit opts it out. a: every mode-all
    app applies; b: none (forced=[]); c: only 'safety'. Mode switches and a later mode-all
    deploy keep each request's choice."""
    from xmix.runtime.control import ControlBlock

    v = torch.arange(D, dtype=torch.float32) / D
    safety = xmix.App("safety")
    safety.write("add", vector=v, scale=1.0).layers([0]).at("residual.pre")
    cb = ControlBlock(SHAPE, backend, SMALL)
    cb.install(lower(safety, SHAPE), "all", 1)
    slots = [
        cb.slots.admit_pinned("a", [], {}, 2)[0],
        cb.slots.admit_pinned("b", [], {}, 2, forced=[])[0],
        cb.slots.admit_pinned("c", [], {}, 2, forced=["safety"])[0],
    ]
    from xmix.runtime import ops

    def step(site_layer: int = 0) -> torch.Tensor:
        cb.begin_step(
            np.array(slots, dtype=np.int32),
            np.array([2, 2, 2]),
            np.array([0, 0, 0]),
            np.array([2, 2, 2]),
        )
        cb.prologue(torch.zeros(6, dtype=torch.int32, device=backend))
        ops.set_control(cb)
        h = torch.zeros(6, D, device=backend)
        torch.ops.xmix.site(h, None, site_layer * 6)
        cb.end_step()
        return h.cpu()

    def applied(h, add):
        return [bool(torch.allclose(h[2 * i], add)) for i in range(3)]

    assert applied(step(), v) == [True, False, True]
    cb.patch("safety", mode="request")  # nobody named it
    assert applied(step(), v) == [False, False, False]
    cb.patch("safety", mode="all")
    assert applied(step(), v) == [True, False, True]
    second = xmix.App("second")
    second.write("add", vector=torch.ones(D), scale=1.0).layers([0]).at("residual.pre")
    cb.install(lower(second, SHAPE), "all", 2)
    h = step()
    assert applied(h, v + 1) == [True, False, False] and torch.allclose(h[4], v)


# ------------------------------------------------------------------ over HTTP: two tenants
ADMIN, RESEARCH, PRODUCT, OTHER = "admin-key-1", "research-key-2", "product-key-3", "other-key-4"
DS = 256  # the tiny Llama's hidden size
SECRET = "tenants-test deployment secret 4f0c"  # XMIX_DEPLOYMENT_SECRET of the server
RESPONSE_CAP = 3000  # the policy's max_response_bytes for keys in no tenant (OTHER)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from serve_util import xmix_serve

    tmp = tmp_path_factory.mktemp("tenants")
    g = torch.Generator().manual_seed(5)
    steer = xmix.App("steer")
    steer.write("add", vector=torch.randn(DS, generator=g), scale=4.0).layers([1]).at(
        "residual.post"
    )
    probe = xmix.App("probe")
    probe.read("probe", weight=torch.randn(DS, generator=g) / 16).layers([2]).at(
        "residual.post"
    ).named("p")
    safety = xmix.App("safety")
    safety.write("add", vector=torch.randn(DS, generator=g), scale=6.0).layers([0]).at(
        "residual.post"
    ).named("push")
    policy = {
        "tenants": {
            "research": {"keys_sha256": [sha(RESEARCH)], "apps": "*", "forced": []},
            "product": {"keys_sha256": [sha(PRODUCT)], "apps": ["steer"], "forced": "*"},
        },
        "default": {"apps": ["probe"], "forced": "*", "max_response_bytes": RESPONSE_CAP},
    }
    (tmp / "policy.json").write_text(json.dumps(policy))
    args = [
        "--api-key",
        RESEARCH,
        PRODUCT,
        OTHER,
        "--xmix-admin-key",
        ADMIN,
        "--xmix-policy",
        str(tmp / "policy.json"),
        "--xmix-audit-log",
        str(tmp / "audit.jsonl"),
        "--app",
        str(steer.save(tmp / "steer.xmix")),
        "--app",
        str(probe.save(tmp / "probe.xmix")),
        "--xmix-metrics-app-labels",
        "hashed",
        "--enable-prompt-tokens-details",  # cached_tokens in usage (the cache-salt attacks)
        "--enable-scale-out",  # /inference/v1/generate: a route that takes a control
    ]
    env = {"VLLM_SERVER_DEV_MODE": "1", "XMIX_DEPLOYMENT_SECRET": SECRET}
    with xmix_serve(tmp, *args, env=env) as s:
        clients = {k: s.client(k) for k in (ADMIN, RESEARCH, PRODUCT, OTHER)}
        yield dict(server=s, c=clients, safety=safety, audit=tmp / "audit.jsonl", tmp=tmp)
        for c in clients.values():
            c.close()


def _complete(client, control=None, stream=False, **kw):
    body = {
        "model": "tiny",
        "prompt": "The river runs",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }
    if control is not None:
        body["vllm_xargs"] = {"xmix": json.dumps(control)}
    if not stream:
        return client.post("/v1/completions", json=body)
    chunks, status = [], None
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        status = r.status_code
        if status != 200:
            r.read()
            return r
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return status, chunks


def _tokens(resp) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


@pytest.mark.engine
def test_a_key_that_may_generate_may_not_change_apps(srv):
    c, log = srv["c"], srv["server"].log_text()
    assert "control plane on, authenticated by 1 admin key" in log
    data = srv["safety"].to_bytes()
    for key in (RESEARCH, PRODUCT):
        r = c[key].post("/xmix/v1/apps", content=data)
        assert (
            r.status_code == 403
            and "may generate but not change apps" in r.json()["error"]["message"]
        )
        assert c[key].patch("/xmix/v1/apps/steer", json={"mode": "off"}).status_code == 403
        assert c[key].delete("/xmix/v1/apps/steer").status_code == 403
        assert c[key].get("/xmix/v1/status").status_code == 403
    import httpx

    assert httpx.post(srv["server"].base + "/xmix/v1/apps", content=data).status_code == 401
    assert c[ADMIN].get("/xmix/v1/status").status_code == 200
    # listings: what each key may use
    names = {
        k: [a["name"] for a in c[k].get("/xmix/v1/apps").json()["apps"]]
        for k in (ADMIN, RESEARCH, PRODUCT, OTHER)
    }
    assert names == {
        ADMIN: ["steer", "probe"],
        RESEARCH: ["steer", "probe"],
        PRODUCT: ["steer"],
        OTHER: ["probe"],
    }
    # the admin key is not an inference key
    assert _complete(c[ADMIN]).status_code == 401


def _cached(resp) -> int:
    assert resp.status_code == 200, resp.text
    return (resp.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _long_prompt(tag: str) -> str:
    words = "river stone cloud lamp field winter harbor glass copper meadow".split()
    return f"{tag}: " + " ".join(words[(i * 7) % 10] + str(i % 13) for i in range(90))


@pytest.mark.engine
def test_a_key_cannot_read_or_poison_another_configurations_cache(srv):
    """Issue 33 item 1, the issue's two attacks (the control epoch is 0 here: apps from
    --app files only). The salt of a request steered by 'steer' was
    "xmix:" + sha256([epoch, [[app, version, parameter values]]])[:32], public facts; the
    key OTHER may not name 'steer'.
    (a) OTHER sends no app and that salt as its own cache_salt after PRODUCT's steered
        request: it got PRODUCT's steered KV (cached tokens). Now: none.
    (b) OTHER first fills that salt with unsteered KV; PRODUCT's steered request then reused
        it and answered wrong. Now: it computes its prompt and answers as a request steered
        from scratch."""
    c = srv["c"]
    steer = next(a for a in c[ADMIN].get("/xmix/v1/apps").json()["apps"] if a["name"] == "steer")
    params = list(steer["params"].values())
    public = [  # the epoch is a small counter: an attacker tries a few
        "xmix:"
        + hashlib.sha256(
            json.dumps([e, [["steer", steer["version"], params]]]).encode()
        ).hexdigest()[:32]
        for e in range(3)
    ]
    # (a)
    prompt = _long_prompt("victim a")
    first = _complete(c[PRODUCT], {"apps": ["steer"]}, prompt=prompt, max_tokens=2)
    assert first.json()["usage"]["prompt_tokens"] >= 256
    again = _complete(c[PRODUCT], {"apps": ["steer"]}, prompt=prompt, max_tokens=2)
    assert _cached(again) >= 256  # the same configuration shares its blocks
    stolen = [
        _cached(_complete(c[OTHER], prompt=prompt, max_tokens=2, cache_salt=salt))
        for salt in public
    ]
    # (b)
    prompt = _long_prompt("victim b")
    reference = _complete(
        c[PRODUCT], {"apps": ["steer"]}, prompt=prompt, cache_salt="own-b", max_tokens=8, logprobs=1
    )
    assert _cached(reference) == 0
    for salt in public:
        _complete(c[OTHER], prompt=prompt, max_tokens=1, cache_salt=salt)
    victim = _complete(c[PRODUCT], {"apps": ["steer"]}, prompt=prompt, max_tokens=8, logprobs=1)

    def answer(r):  # tokens and their logprobs (one request at a time: the same arithmetic)
        return _tokens(r), r.json()["choices"][0]["logprobs"]["token_logprobs"]

    poisoned = (_cached(victim), answer(victim) != answer(reference))
    assert (stolen, poisoned) == ([0] * len(public), (0, False))


def _route_bodies(xargs: dict, stream: bool) -> dict[str, dict]:
    """A small request to every route of vLLM 0.32 that takes an xmix control (found by
    reading vLLM's entrypoints for vllm_xargs / extra_args), carrying ``xargs``."""
    user = [{"role": "user", "content": "hi"}]
    out = {
        "/v1/completions": {"prompt": "hi", "max_tokens": 4},
        "/v1/chat/completions": {"messages": user, "max_tokens": 4},
        "/v1/responses": {"input": "hi", "max_output_tokens": 4},
        "/v1/messages": {"messages": user, "max_tokens": 4},
        "/invocations": {"prompt": "hi", "max_tokens": 4},  # SageMaker: completions or chat
    }
    out = {k: {"model": "tiny", **v, "stream": stream, "vllm_xargs": xargs} for k, v in out.items()}
    out["/inference/v1/generate"] = {
        "model": "tiny",
        "token_ids": [1, 2, 3],
        "stream": stream,
        "sampling_params": {"max_tokens": 4, "extra_args": xargs},
    }
    if not stream:  # vLLM's batch chat does not stream
        out["/v1/chat/completions/batch"] = {
            "model": "tiny",
            "messages": [user, user],
            "max_tokens": 4,
            "vllm_xargs": xargs,
        }
    return out


def _answer(client, path: str, body: dict) -> tuple[int, str, str]:
    """Status, the error message (if any) and the body, read as a stream: a refusal must be
    the status itself, before any event."""
    with client.stream("POST", path, json=body) as r:
        text = r.read().decode()
    msg = ""
    if r.status_code != 200:
        err = json.loads(text).get("error")
        msg = err.get("message", "") if isinstance(err, dict) else str(err)
    return r.status_code, msg, text


NO_RESULTS = (
    "/v1/responses",
    "/v1/messages",
    "/inference/v1/generate",
    "/v1/chat/completions/batch",
)


@pytest.mark.engine
def test_every_route_that_takes_a_control_refuses_before_its_stream(srv):
    """Issue 33 items 3-5. /v1/responses streamed a refusal as HTTP 200, then dropped the
    connection with two tracebacks; /inference/v1/generate streamed it as an error event.
    Every route vLLM 0.32 has that takes an xmix control (completions, chat, responses,
    messages, batch chat, tokens in/out, /invocations; vLLM's transcription routes exist only
    for speech models, which xmix refuses at start) now refuses before its stream: a
    forbidden app (403), a misspelt key (400 naming the right spelling; was ignored), an
    unknown key in the control (400). Routes whose responses have no place for reads refuse apps that read
    (they were computed and dropped); beam search with apps is refused (it dropped them)."""
    c = srv["c"]
    tracebacks = srv["server"].tracebacks()
    cases = [
        ({"xmix": json.dumps({"apps": ["steer"]})}, 403, "'steer' is not allowed for this key"),
        ({"XMIX_APPS": "probe"}, 400, "did you mean 'xmix_apps'?"),
        ({"Xmix_apps": "probe"}, 400, "did you mean 'xmix_apps'?"),
        ({"xmix": json.dumps({"apps": ["probe"], "bogus": 1})}, 400, "unknown key(s) ['bogus']"),
    ]
    seen = set()
    for stream in (False, True):
        for xargs, status, words in cases:
            for path, body in _route_bodies(xargs, stream).items():
                got = _answer(c[OTHER], path, body)
                assert got[0] == status and words in got[1], (path, stream, got)
                seen.add(path)
        for path, body in _route_bodies({"xmix_apps": "probe"}, stream).items():
            got = _answer(c[OTHER], path, body)
            if path in NO_RESULTS:
                assert got[0] == 400 and "do not carry xmix read results" in got[1], (path, got)
            else:
                assert got[0] == 200 and '"xmix"' in got[2], (path, stream, got)
    assert len(seen) == 7
    # a writing app on those routes runs as asked (streamed too)
    for stream in (False, True):
        for path in NO_RESULTS:
            body = _route_bodies({"xmix_apps": "steer"}, stream).get(path)
            if body is not None:
                got = _answer(c[PRODUCT], path, body)
                assert got[0] == 200 and '"error"' not in got[2], (path, stream, got)
    # beam search ran as if the request named no app; refused now (research: no app forced)
    beam = {"use_beam_search": True, "n": 2, "max_tokens": 3}
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        body = {"model": "tiny", **body, **beam}
        r = c[RESEARCH].post(path, json={**body, "vllm_xargs": {"xmix_apps": "steer"}})
        assert r.status_code == 400 and "beam search" in r.json()["error"]["message"], r.text
        assert "steer" in r.json()["error"]["message"]
        assert c[RESEARCH].post(path, json=body).status_code == 200  # without apps: vLLM's
    assert srv["server"].tracebacks() == tracebacks


@pytest.mark.engine
def test_one_response_has_one_byte_cap_for_all_its_prompts(srv):
    """Issue 33 item 2: the result cap applied per prompt, so 24 prompts returned 24 caps. The
    policy gives keys in no tenant (OTHER) max_response_bytes=3000 for a whole response:
    prompts whose reads alone exceed it are refused before anything is scheduled (the
    server default, 64 MiB, lets the same request through for RESEARCH); reads of generated
    tokens are cut with the truncation marker where each sequence's share ends (its prompt
    reads plus an even share of the rest), all within 3000 bytes."""
    c = srv["c"]
    per_pos = 2 * 26  # one probe scalar per position, as JSON (results_codec.position_bytes)
    prompts = ["The river runs", "A stone lies in the field", "Clouds over the harbor glass"]
    r = _complete(c[OTHER], {"apps": ["probe"]}, prompt=prompts, max_tokens=24)
    assert r.status_code == 200, r.text
    choices, res = r.json()["choices"], r.json()["xmix"]
    lens = [len(ch["prompt_token_ids"]) for ch in choices]
    known = sum(lens) * per_pos
    spare = (RESPONSE_CAP - known) // len(prompts)
    total = 0
    for n_prompt, got in zip(lens, res):
        positions = got["probe"]["p"]["positions"]
        assert positions[:n_prompt] == list(range(n_prompt))  # the prompt's reads are all there
        assert got["!truncated"].startswith(f"truncated at {n_prompt * per_pos + spare} bytes")
        total += len(positions) * per_pos
    assert total <= RESPONSE_CAP
    many = [prompts[1]] * (RESPONSE_CAP // (lens[1] * per_pos) + 1)
    r = _complete(c[OTHER], {"apps": ["probe"]}, prompt=many, max_tokens=2)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert f"may carry {RESPONSE_CAP} bytes (max_response_bytes of tenant 'default'" in msg
    r = _complete(c[RESEARCH], {"apps": ["probe"]}, prompt=many, max_tokens=2)
    assert r.status_code == 200 and "!truncated" not in json.dumps(r.json()["xmix"])


@pytest.mark.engine
def test_apps_a_key_may_not_see_do_not_leak(srv):
    """Issue 33 item 5: a key limited to 'steer' saw every app in integrations/vllm/http/console/live, integrations/vllm/http/console/
    decisions answered for apps it may not name, and the unauthenticated /metrics carried
    app names. Now the console answers within the caller's policy (another app is "not
    deployed") and /metrics shows keyed hashes (--xmix-metrics-app-labels hashed); the
    admin's listing gives each app's label."""
    c = srv["c"]
    _complete(c[PRODUCT], {"apps": ["steer"]}, cache_salt="leak")
    _complete(c[OTHER], {"apps": ["probe"]}, cache_salt="leak")
    live = {k: [a["name"] for a in c[k].get("/xmix/v1/console/live").json()["apps"]] for k in c}
    assert live == {
        ADMIN: ["steer", "probe"],
        RESEARCH: ["steer", "probe"],
        PRODUCT: ["steer"],
        OTHER: ["probe"],
    }
    ask = {"ids": [1, 2, 3], "prompt_len": 2}
    r = c[PRODUCT].post("/xmix/v1/console/decisions", json={**ask, "app": "probe"})
    assert r.status_code == 404 and "is not deployed" in r.json()["error"]["message"]
    assert (
        c[PRODUCT].post("/xmix/v1/console/decisions", json={**ask, "app": "steer"}).status_code
        == 200
    )
    assert (
        c[OTHER].post("/xmix/v1/console/decisions", json={**ask, "app": "steer"}).status_code == 404
    )
    import httpx

    text = httpx.get(srv["server"].base + "/metrics", timeout=30).text
    labels = {a["name"]: a["metrics_label"] for a in c[ADMIN].get("/xmix/v1/apps").json()["apps"]}
    for name, label in labels.items():
        assert f'app="{name}"' not in text and f'app="{label}"' in text
    assert labels == {n: keyed.Keys(SECRET.encode()).label(n) for n in ("steer", "probe")}


@pytest.mark.engine
def test_policy_decides_which_apps_a_key_names_and_which_are_forced_on_it(srv):
    """product may name steer only; other only probe; research anything. The operator's
    'safety' app in mode "all" applies to product and other, not to research (forced: [])."""
    c = srv["c"]
    vanilla = {k: _tokens(_complete(c[k], cache_salt="v")) for k in (RESEARCH, PRODUCT)}
    assert vanilla[RESEARCH] == vanilla[PRODUCT]
    for key, app in ((PRODUCT, "probe"), (OTHER, "steer")):
        r = _complete(c[key], {"apps": [app]})
        assert (
            r.status_code == 403
            and f"app '{app}' is not allowed for this key" in r.json()["error"]["message"]
        )
        r = _complete(c[key], {"apps": [app]}, stream=True)  # refused before the stream starts
        assert r.status_code == 403, r
    r = c[ADMIN].post("/xmix/v1/apps?mode=all&locked=true", content=srv["safety"].to_bytes())
    assert r.status_code == 201 and r.json()["locked"] == ["push.scale"]
    try:
        research = _complete(c[RESEARCH], cache_salt="s")
        product = _complete(c[PRODUCT], cache_salt="s")
        assert _tokens(research) == vanilla[RESEARCH]  # not forced on research
        assert _tokens(product) != vanilla[PRODUCT]  # forced on product
        # research may still name it: then it applies, exactly as for product
        named = _complete(c[RESEARCH], {"apps": ["safety"]}, cache_salt="s")
        assert _tokens(named) == _tokens(product)
        assert research.json()["xmix_applied"] == {"apps": [], "tenant": "research", "changed": []}
        assert product.json()["xmix_applied"] == {
            "apps": [
                {
                    "name": "safety",
                    "version": r.json()["version"],
                    "mode": "all",
                    "params": {"push.scale": 6.0},
                }
            ],
            "tenant": "product",
            "changed": [],
        }
        # product may not set its parameters at all (it may name steer only) ...
        r0 = _complete(c[PRODUCT], {"params": {"safety": {"scale": 0.0}}})
        assert r0.status_code == 403 and "may not use" in r0.json()["error"]["message"], r0.text
        # ... and with its parameters locked, nobody can neutralise it with scale 0
        r0 = _complete(c[RESEARCH], {"apps": ["safety"], "params": {"safety": {"scale": 0.0}}})
        assert (
            r0.status_code == 403 and "locked by the operator" in r0.json()["error"]["message"]
        ), r0.text
        # unlocked: the same request goes through (and neutralises it)
        assert c[ADMIN].patch("/xmix/v1/apps/safety", json={"locked": False}).json()["locked"] == []
        off = _complete(
            c[RESEARCH], {"apps": ["safety"], "params": {"safety": {"scale": 0.0}}}, cache_salt="s"
        )
        assert _tokens(off) == vanilla[RESEARCH]
    finally:
        assert c[ADMIN].delete("/xmix/v1/apps/safety").status_code == 200


@pytest.mark.engine
def test_provenance_in_streams_and_per_prompt(srv):
    c = srv["c"]
    status, chunks = _complete(
        c[RESEARCH],
        {"apps": ["steer", "probe"], "params": {"steer": {"scale": 2.0}}},
        stream=True,
        n=2,
        temperature=1.0,
        seed=1,
    )
    assert status == 200
    finished = [ch for ch in chunks if any(x.get("finish_reason") for x in ch.get("choices") or [])]
    assert len(finished) == 2 and all("xmix_applied" in ch for ch in finished)
    assert [ch for ch in chunks if "xmix_applied" in ch] == finished
    applied = finished[0]["xmix_applied"]
    assert [(a["name"], a["params"]) for a in applied["apps"]] == [
        ("steer", {"#0.scale": 2.0}),
        ("probe", {"p.bias": 0.0}),
    ]
    two = _complete(c[OTHER], {"apps": ["probe"]}, prompt=["a b", "c d"])
    assert two.status_code == 200 and len(two.json()["xmix_applied"]) == 2
    chat = c[OTHER].post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert chat.json()["xmix_applied"] == {"apps": [], "tenant": "default", "changed": []}


@pytest.mark.engine
def test_every_change_is_one_audit_line_with_a_fingerprint(srv):
    """Fingerprints are keyed with the deployment's secret (here the operator's
    XMIX_DEPLOYMENT_SECRET, which the engine holds and the API server fetched): no SHA-256 of
    a key shows, and the secret itself is in no log. The file is created 0600."""
    lines = [json.loads(l) for l in srv["audit"].read_text().splitlines()]
    text = srv["audit"].read_text() + srv["server"].log_text()
    for k in (ADMIN, RESEARCH, PRODUCT, OTHER, SECRET):
        assert k not in text
    assert srv["audit"].stat().st_mode & 0o777 == 0o600
    import httpx  # dev mode's /server_info (on here) shows configuration and environment

    assert SECRET not in httpx.get(srv["server"].base + "/server_info", timeout=60).text
    keys = keyed.Keys(SECRET.encode())
    admin_fp = keys.fingerprint(ADMIN)
    for k in (ADMIN, PRODUCT):
        assert sha(k)[:12] not in text
    ours = [(l["action"], l["app"], l["status"]) for l in lines if l["key"] == admin_fp]
    assert ("deploy", "safety", 201) in ours and ("patch", "safety", 200) in ours
    assert ("undeploy", "safety", 200) in ours
    refused = [l for l in lines if l["key"] == keys.fingerprint(PRODUCT)]
    assert {(l["action"], l["status"]) for l in refused} >= {
        ("deploy", 403),
        ("patch", 403),
        ("undeploy", 403),
    }
    assert all(l["time"].endswith("Z") for l in lines)
    assert [l["action"] for l in lines[:2]] == ["deploy", "deploy"] and lines[0]["key"] == "local"


@pytest.mark.engine
def test_dev_mode_collective_rpc_cannot_change_apps_behind_the_registry(srv):
    """vLLM's /collective_rpc (VLLM_SERVER_DEV_MODE=1) ran xmix_undeploy on the workers and
    left a ghost: the registry listed the app, requests naming it ran without it, DELETE
    answered 500 and POST 409 forever. xmix's worker methods are refused there now."""
    c, base = srv["c"], srv["server"].base
    import httpx

    before = _tokens(_complete(c[RESEARCH], {"apps": ["steer"]}, cache_salt="g"))
    for method in ("xmix_undeploy", "xmix_deploy_abort", "xmix_patch"):
        r = httpx.post(
            base + "/collective_rpc", json={"method": method, "args": ["steer"]}, timeout=60
        )
        assert r.status_code == 403 and "use /xmix/v1/apps" in r.json()["error"]["message"], r.text
    r = httpx.post(base + "/collective_rpc", json={"method": "xmix_describe"}, timeout=60)
    assert r.status_code == 403
    assert _tokens(_complete(c[RESEARCH], {"apps": ["steer"]}, cache_salt="g2")) == before
    # vLLM's own methods still pass
    assert (
        httpx.post(
            base + "/collective_rpc", json={"method": "check_health"}, timeout=60
        ).status_code
        == 200
    )
