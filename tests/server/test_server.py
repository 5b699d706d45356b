"""``xmix serve`` through real HTTP clients (httpx, openai): the control plane, read results in
responses and streams, bad input, and changes while requests are in flight."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
import torch

import xmix
from serve_util import xmix_serve

pytestmark = pytest.mark.engine

KEY = "test-key-123"
D = 256


def _apps(tmp):
    g = torch.Generator().manual_seed(7)
    steer = xmix.App("steer")
    steer.write("add", vector=torch.randn(D, generator=g), scale=4.0).layers([1]).at(
        "residual.post"
    )
    probe = xmix.App("probe")
    probe.read("probe", weight=torch.randn(D, generator=g) / 16, bias=0.0).layers([2]).at(
        "residual.post"
    ).named("p2")
    return steer, probe, [steer.save(tmp / "steer.xmix"), probe.save(tmp / "probe.xmix")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    steer, probe, paths = _apps(tmp)
    # Compiled (not eager): this module is where compiled serving is tested. Small limits, so
    # the hostile-input tests stay small: app files of 8 MiB, read results of 2 MiB per request.
    env = {"XMIX_MAX_APP_BYTES": str(8 << 20), "XMIX_MAX_RESULT_BYTES": str(2 << 20)}
    args = ["--api-key", KEY, "--xmix-admin-key", KEY, "--max-num-seqs", "48"]
    with (
        xmix_serve(tmp, *args, apps=paths, env=env, eager=False, timeout=400) as s,
        s.client(KEY) as client,
    ):
        yield dict(
            base=s.base,
            client=client,
            model=str(s.model),
            tmp=tmp,
            steer=steer,
            probe=probe,
            proc=s.proc,
            log=s.log,
        )


def complete(s, prompt="Once upon a time", control=None, raw_control=None, **kw):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    if control is not None:
        body["vllm_xargs"] = {"xmix": json.dumps(control)}
    if raw_control is not None:
        body["vllm_xargs"] = {"xmix": raw_control}
    return s["client"].post("/v1/completions", json=body)


def test_control_plane_needs_the_api_key(server):
    base = server["base"]
    assert httpx.get(f"{base}/xmix/v1/apps").status_code == 401
    assert (
        httpx.get(f"{base}/xmix/v1/apps", headers={"Authorization": "Bearer nope"}).status_code
        == 401
    )
    r = server["client"].get("/xmix/v1/apps")
    assert r.status_code == 200
    assert [a["name"] for a in r.json()["apps"]] == ["steer", "probe"]
    # the data plane is guarded by vLLM itself with the same key
    assert (
        httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code
        == 401
    )


def test_results_in_response_match_the_oracle(server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xmix.integrations.hf import attach

    r = complete(server, control={"apps": ["probe"]}, max_tokens=8)
    assert r.status_code == 200, r.text
    body = r.json()
    res = body["xmix"]["probe"]["p2"]
    tok = AutoTokenizer.from_pretrained(server["model"])
    ids = tok.encode("Once upon a time")
    assert res["positions"] == list(range(len(ids) + 7))
    model = AutoModelForCausalLM.from_pretrained(server["model"], dtype=torch.float32)
    with attach(model, [server["probe"]], tokenizer=tok) as att:
        o_toks, o_res = att.generate(ids, 8, apps=["probe"])
    assert tok.decode(o_toks) == body["choices"][0]["text"]
    np.testing.assert_allclose(res["values"], o_res["probe"]["p2"]["values"], rtol=1e-4, atol=1e-6)
    # a request without apps carries no xmix key
    assert "xmix" not in complete(server).json()


def test_streaming_carries_the_same_results(server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6,
        "temperature": 0,
        "vllm_xargs": {"xmix": json.dumps({"apps": ["probe"]})},
    }
    full = server["client"].post("/v1/chat/completions", json=body).json()
    merged = {"positions": [], "values": []}
    text = ""
    with server["client"].stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                text += chunk["choices"][0]["delta"].get("content") or ""
            x = chunk.get("xmix")
            if x:
                merged["positions"] += x["probe"]["p2"]["positions"]
                merged["values"] += x["probe"]["p2"]["values"]
    assert text == full["choices"][0]["message"]["content"]
    assert merged["positions"] == full["xmix"]["probe"]["p2"]["positions"]
    np.testing.assert_allclose(merged["values"], full["xmix"]["probe"]["p2"]["values"], rtol=1e-6)


def test_parallel_sampling_results_per_choice(server):
    """n=2: each choice carries the reads of its own sequence (the HF oracle fed that choice's
    tokens), the top level none (it used to repeat choice 0), and a stream with the same seed
    gives each choice the same reads on its own chunks."""
    from transformers import AutoModelForCausalLM

    from xmix.integrations.hf import attach

    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 3,
        "n": 2,
        "vllm_xargs": {"xmix": json.dumps({"apps": ["probe"]})},
    }
    full = server["client"].post("/v1/completions", json={**body, "return_token_ids": True})
    assert full.status_code == 200, full.text
    full = full.json()
    choices = sorted(full["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["token_ids"] != choices[1]["token_ids"], (
        "seeded sampling should differ per choice"
    )
    reads = [c["xmix"]["probe"]["p2"] for c in choices]
    model = AutoModelForCausalLM.from_pretrained(server["model"], dtype=torch.float32)
    with attach(model, [server["probe"]]) as att:
        for c, r in zip(choices, reads):
            req = att.request(c["prompt_token_ids"], apps=["probe"])
            req.prefill()
            for t in c["token_ids"][:-1]:  # the last sampled token is never fed back
                req.decode(t)
            want = req.results["probe"]["p2"]
            assert (
                r["positions"] == want["positions"] == list(range(len(c["prompt_token_ids"]) + 5))
            )
            np.testing.assert_allclose(r["values"], want["values"], rtol=1e-4, atol=1e-6)
    assert "xmix" not in full  # every choice carries its own: the top level repeats none

    got = {0: {"positions": [], "values": []}, 1: {"positions": [], "values": []}}
    text = {0: "", 1: ""}
    with server["client"].stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices"):
                continue
            assert len(chunk["choices"]) == 1
            i = chunk["choices"][0]["index"]
            text[i] += chunk["choices"][0]["text"]
            x = chunk.get("xmix")
            if x:
                got[i]["positions"] += x["probe"]["p2"]["positions"]
                got[i]["values"] += x["probe"]["p2"]["values"]
    for i in (0, 1):
        assert text[i] == choices[i]["text"]
        assert got[i]["positions"] == reads[i]["positions"]
        np.testing.assert_allclose(got[i]["values"], reads[i]["values"], rtol=1e-6)


def test_openai_client_and_steering(server):
    import openai

    client = openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY)
    van = client.completions.create(model="tiny", prompt="The river", max_tokens=8, temperature=0)
    st = client.completions.create(
        model="tiny",
        prompt="The river",
        max_tokens=8,
        temperature=0,
        extra_body={"vllm_xargs": {"xmix": json.dumps({"apps": ["steer"]})}},
    )
    assert van.choices[0].text != st.choices[0].text


def test_metrics_on_vllms_endpoint(server):
    complete(server, control={"apps": ["probe"]})
    complete(server, control={"apps": ["nope"]})
    text = server["client"].get("/metrics").text
    assert any(
        l.startswith("vllm:xmix_app_requests_total{") and 'app="probe"' in l
        for l in text.splitlines()
    )
    assert "vllm:xmix_rejected_requests_total" in text
    assert "vllm:xmix_apps_deployed" in text


def test_graph_counters_of_the_workers_reach_metrics(server):
    """The workers' CUDA graph counters come to the API server's /metrics through the
    xmix_describe RPC, refreshed in the background when /metrics is read."""
    deadline = time.time() + 30
    while True:
        text = server["client"].get("/metrics").text
        workers = [l for l in text.splitlines() if l.startswith("vllm:xmix_graph_stats_workers{")]
        if workers and workers[0].endswith(" 1.0") or time.time() > deadline:
            break
        time.sleep(0.5)
    assert workers and workers[0].endswith(" 1.0"), workers
    checks = {
        l.split("result=")[1].split('"')[1]: float(l.rsplit(" ", 1)[1])
        for l in text.splitlines()
        if l.startswith("vllm:xmix_graph_checks_total{")
    }
    assert checks == {"passed": 0.0, "failed": 0.0, "unverifiable": 0.0}  # no CUDA graph here
    assert "vllm:xmix_graph_fallbacks_total{" in text


def test_worker_host_time_reaches_metrics(server):
    """xmix's own host time in the worker (step bookkeeping and active site programs) and
    the steps it saw come to /metrics with the graph counters; a request that runs the probe
    adds site time, so both parts move."""

    def host() -> dict[str, float]:
        text = server["client"].get("/metrics").text
        out = {}
        for l in text.splitlines():
            if l.startswith("vllm:xmix_worker_host_seconds_total{"):
                out[l.split('part="')[1].split('"')[0]] = float(l.rsplit(" ", 1)[1])
            elif l.startswith("vllm:xmix_worker_steps_total{"):
                out["steps"] = float(l.rsplit(" ", 1)[1])
        return out

    first = host()
    assert set(first) == {"step", "sites", "steps"}, first
    complete(server, control={"apps": ["probe"]})
    deadline = time.time() + 30
    while True:
        later = host()  # refreshed in the background, at most every 5 s
        if later["sites"] > first["sites"] or time.time() > deadline:
            break
        time.sleep(0.5)
    assert later["steps"] > first["steps"] and later["step"] > first["step"], (first, later)
    assert later["sites"] > first["sites"], (first, later)


def test_bad_requests_are_rejected_and_serving_continues(server):
    cases = [
        ({"apps": ["nope"]}, None, "unknown app"),
        (None, '{"apps": [', "not valid JSON"),
        ({"apps": [1]}, None, "list of app names"),
        ({"apps": ["steer"], "params": {"steer": {"scale": "big"}}}, None, "finite number"),
        ({"apps": ["steer"], "params": {"steer": {"nope": 1.0}}}, None, "unknown parameter"),
    ]
    for control, raw, msg in cases:
        r = complete(server, control=control, raw_control=raw)
        assert r.status_code == 400, (control, raw, r.text)
        assert msg in r.json()["error"]["message"]
    assert complete(server).status_code == 200


def test_deploy_patch_delete_over_http(server):
    c = server["client"]
    extra = xmix.App("extra")
    extra.read("probe", weight=torch.ones(D) / 64).layers([0]).at("residual.pre").named("e")
    data = extra.to_bytes()
    r = c.post("/xmix/v1/apps", content=data, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    assert r.json()["sites"] == ["layers.0.residual.pre"]
    assert c.post("/xmix/v1/apps", content=data).status_code == 409
    # garbage, an app that does not fit, an app with code: refused, nothing deployed
    assert c.post("/xmix/v1/apps", content=b"\x00" * 64).status_code == 400
    assert c.post("/xmix/v1/apps", content=b"").status_code == 400
    wrong = xmix.App("wrong")
    wrong.write("add", vector=torch.ones(D + 2)).layers([0]).at("residual.pre")
    r = c.post("/xmix/v1/apps", content=wrong.to_bytes())
    assert r.status_code == 422 and "hidden size" in r.json()["error"]["message"]
    code = xmix.App("code")
    code.write("custom", cpu_library="/tmp/libx.so", cpu_symbol="f").layers([0]).at("residual.pre")
    r = c.post("/xmix/v1/apps", content=code.to_bytes())
    assert r.status_code == 400 and "custom kernel" in r.json()["error"]["message"]
    assert c.post("/xmix/v1/apps?mode=sometimes", content=data).status_code == 400
    names = [a["name"] for a in c.get("/xmix/v1/apps").json()["apps"]]
    assert names == ["steer", "probe", "extra"]
    # PATCH
    assert c.patch("/xmix/v1/apps/extra", json={"mode": "all"}).json()["mode"] == "all"
    r = complete(server)
    assert "e" in r.json()["xmix"]["extra"]  # mode all: every request gets it
    assert c.patch("/xmix/v1/apps/extra", json={"params": {"bias": 2.0}}).json()["params"] == {
        "e.bias": 2.0
    }
    assert c.patch("/xmix/v1/apps/extra", json={"mode": "maybe"}).status_code == 422
    assert c.patch("/xmix/v1/apps/extra", json={"params": {"bias": "x"}}).status_code == 422
    assert c.patch("/xmix/v1/apps/extra", content=b"{").status_code == 400
    assert c.patch("/xmix/v1/apps/none", json={"mode": "off"}).status_code == 404
    # DELETE
    assert c.delete("/xmix/v1/apps/extra").json() == {"deleted": "extra"}
    assert c.delete("/xmix/v1/apps/extra").status_code == 404
    assert "xmix" not in complete(server).json()


def test_changes_while_requests_are_in_flight(server):
    """32 concurrent streaming requests; the control plane switches, deploys and undeploys
    meanwhile. No request is lost and every one returns all its tokens."""
    base = server["base"]
    headers = {"Authorization": f"Bearer {KEY}"}
    flip = xmix.App("flip")
    flip.read("probe", weight=torch.ones(D) / 64).layers([1]).at("residual.pre").named("f")

    async def one(client, i):
        ctl = [None, {"apps": ["steer"]}, {"apps": ["probe"]}, {"apps": ["steer", "probe"]}][i % 4]
        body = {
            "model": "tiny",
            "prompt": f"Story number {i}:",
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        if ctl:
            body["vllm_xargs"] = {"xmix": json.dumps(ctl)}
        n, finish = 0, None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])
                    if ch.get("usage"):
                        n = ch["usage"]["completion_tokens"]
                    if ch.get("choices") and ch["choices"][0].get("finish_reason"):
                        finish = ch["choices"][0]["finish_reason"]
        return n if finish == "length" else -1

    async def control(client):
        await asyncio.sleep(0.3)
        assert (await client.patch("/xmix/v1/apps/steer", json={"mode": "off"})).status_code == 200
        await asyncio.sleep(0.3)
        assert (
            await client.post("/xmix/v1/apps?mode=all", content=flip.to_bytes())
        ).status_code == 201
        await asyncio.sleep(0.3)
        assert (
            await client.patch("/xmix/v1/apps/steer", json={"mode": "request"})
        ).status_code == 200
        assert (
            await client.patch("/xmix/v1/apps/probe", json={"params": {"bias": 1.0}})
        ).status_code == 200
        await asyncio.sleep(0.3)
        assert (await client.delete("/xmix/v1/apps/flip")).status_code == 200
        assert (
            await client.patch("/xmix/v1/apps/probe", json={"params": {"bias": 0.0}})
        ).status_code == 200

    async def main():
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300) as client:
            results = await asyncio.gather(*(one(client, i) for i in range(32)), control(client))
        return results[:32]

    counts = asyncio.run(main())
    assert counts == [24] * 32, counts


# ------------------------------------------------------------------ issue 11: hostile clients
def _raw_app(spec: dict, tensors: dict | None = None) -> bytes:
    """An app file written by hand (json.dumps writes NaN/Infinity, as a hostile client may)."""
    from safetensors.torch import save

    return save(tensors or {}, metadata={"xmix.spec": json.dumps(spec)})


def _spec(name: str, ops: list, **extra) -> dict:
    return {
        "format": "xmix.app/1",
        "name": name,
        "metadata": {},
        "params": {},
        "token_sets": [],
        "ops": ops,
        **extra,
    }


def _tracebacks(server) -> int:
    return server["log"].read_text().count("Traceback")


def test_patch_is_one_change_over_http(server):
    """Defect 4: a PATCH with a valid parameter and a bad mode answered 422 and the
    parameter had changed anyway. Now nothing is applied unless everything is valid."""
    c = server["client"]
    before = next(a for a in c.get("/xmix/v1/apps").json()["apps"] if a["name"] == "steer")
    for body in (
        {"params": {"scale": 3}, "mode": "bogus"},
        {"params": {"nope": 3}, "mode": "off"},
        {"params": {"scale": 10**400}, "mode": "all"},
    ):
        r = c.patch("/xmix/v1/apps/steer", json=body)
        assert r.status_code == 422, (body, r.text)
    after = next(a for a in c.get("/xmix/v1/apps").json()["apps"] if a["name"] == "steer")
    assert after == before


def test_apps_json_cannot_carry_are_refused_and_listing_keeps_working(server):
    """Defect 4: an app with NaN in its metadata, or a parameter default of Infinity,
    answered 400 but was deployed, and every listing answered 400 from then on."""
    c = server["client"]
    op = {
        "primitive": "read",
        "kernel": "capture",
        "site": "final.post",
        "params": {},
        "artifacts": {},
    }
    for spec in (
        _spec("nanmeta", [op], metadata={"score": float("nan")}),
        _spec("infparam", [op], params={"theta": float("inf")}),
        _spec("bigparam", [op], params={"theta": 10**400}),
    ):
        r = c.post("/xmix/v1/apps", content=_raw_app(spec))
        assert r.status_code == 400, r.text
        listing = c.get("/xmix/v1/apps")
        assert listing.status_code == 200
        assert spec["name"] not in [a["name"] for a in listing.json()["apps"]]


def test_client_errors_are_4xx_never_500(server):
    """Huge ints, deep nesting, a 2 000-term condition, an 1 100-deep gate chain, deeply
    nested PATCH bodies: each answers 4xx with a message, none 500 or a reset, and the
    server keeps serving."""
    c = server["client"]
    statuses = {}
    deep = "[" * 20_000 + "]" * 20_000
    statuses["int 10^400 in params"] = complete(
        server,
        raw_control='{"apps": ["steer"], "params": {"steer": {"scale": 1' + "0" * 400 + "}}}",
    ).status_code
    statuses["control nested 20 000 deep"] = complete(server, raw_control=deep).status_code
    statuses["control nested 100 000 deep"] = complete(
        server, raw_control="[" * 100_000 + "]" * 100_000
    ).status_code
    statuses["vllm_xargs nested"] = c.post(
        "/v1/completions", json={"model": "tiny", "prompt": "x", "vllm_xargs": {"xmix": [[[[1]]]]}}
    ).status_code
    statuses["body nested 100 000 deep"] = c.post(
        "/v1/completions",
        content=b'{"model": "tiny", "prompt": "x", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        headers={"Content-Type": "application/json"},
    ).status_code
    statuses["PATCH nested 30 000 deep"] = c.patch(
        "/xmix/v1/apps/steer", content=b'{"params": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    ).status_code
    statuses["PATCH nested 100 000 deep"] = c.patch(
        "/xmix/v1/apps/steer", content=b"[" * 100_000 + b"]" * 100_000
    ).status_code
    statuses["PATCH int 10^400"] = c.patch(
        "/xmix/v1/apps/steer", content=b'{"params": {"scale": 1' + b"0" * 400 + b"}}"
    ).status_code
    w = {"probe.weight": torch.ones(D) / 64}
    read = {
        "primitive": "read",
        "kernel": "probe",
        "site": "residual.pre",
        "layers": [0],
        "params": {},
        "artifacts": {"weight": "probe.weight"},
    }
    terms = {**read, "name": "g"}
    write = {
        "primitive": "write",
        "kernel": "add",
        "site": "residual.post",
        "layers": [1],
        "params": {},
        "artifacts": {"vector": "probe.weight"},
        "cond": {"expr": " or ".join(["g>0"] * 2000)},
    }
    statuses["2 000-term condition"] = c.post(
        "/xmix/v1/apps", content=_raw_app(_spec("terms", [terms, write]), w)
    ).status_code
    chain = [{**read, "name": "r0"}] + [
        {**read, "name": f"r{i}", "cond": {"gate": f"r{i - 1} >= 0"}} for i in range(1, 1100)
    ]
    statuses["1 100-deep gate chain"] = c.post(
        "/xmix/v1/apps", content=_raw_app(_spec("chain", chain), w)
    ).status_code
    from safetensors.torch import save

    statuses["spec nested 100 000 deep"] = c.post(
        "/xmix/v1/apps", content=save({}, metadata={"xmix.spec": "[" * 100_000 + "]" * 100_000})
    ).status_code
    nested_meta = _spec("nestmeta", [])
    nested_meta["metadata"] = json.loads("[" * 900 + "]" * 900)
    statuses["metadata nested 900 deep"] = c.post(
        "/xmix/v1/apps", content=_raw_app(nested_meta)
    ).status_code
    bad = {k: v for k, v in statuses.items() if not 400 <= v < 500}
    assert not bad, statuses
    assert complete(server).status_code == 200
    assert c.get("/xmix/v1/apps").status_code == 200


def test_a_refused_stream_gets_its_status_before_the_stream(server):
    """A streamed request refused at admission answers 400 (not HTTP 200 and an error
    event), with one log line and no traceback."""
    c = server["client"]
    before = _tracebacks(server)
    lines_before = server["log"].read_text().count("refused at admission")
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        body = {
            "model": "tiny",
            "max_tokens": 4,
            "stream": True,
            "vllm_xargs": {"xmix": json.dumps({"apps": ["nope"]})},
            **body,
        }
        with c.stream("POST", path, json=body) as r:
            r.read()
            assert r.status_code == 400, r.text
            assert "unknown app" in r.json()["error"]["message"]
    time.sleep(0.5)
    assert _tracebacks(server) == before
    assert server["log"].read_text().count("refused at admission") == lines_before + 2


def test_invocations_need_the_api_key_to_use_apps(server):
    """vLLM's SageMaker route (/invocations) is not guarded by --api-key. Requests there may
    still generate, but not use apps without the key."""
    base = server["base"]
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    with_apps = {**body, "vllm_xargs": {"xmix": json.dumps({"apps": ["probe"]})}}
    r = httpx.post(f"{base}/invocations", json=body, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{base}/invocations", json=with_apps, timeout=60)
    assert r.status_code == 401, r.text
    r = httpx.post(
        f"{base}/invocations",
        json=with_apps,
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 200 and "p2" in r.json()["xmix"]["probe"], r.text


def _hwm_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_chunked_app_body_is_cut_off_at_the_limit(server):
    """A chunked body (no Content-Length) is read only up to XMIX_MAX_APP_BYTES (8 MiB
    here): sending 96 MiB raises the API server's peak memory by far less than that."""
    pid = server["proc"].pid
    peak = _hwm_kib(pid)
    sent = []

    def body():
        chunk = b"\0" * (1 << 20)
        for _ in range(96):
            sent.append(1)
            yield chunk

    try:
        r = server["client"].post("/xmix/v1/apps", content=body())
        assert r.status_code == 413, r.text
    except httpx.HTTPError:
        pass  # the server answered 413 and closed the connection while the client wrote
    assert _hwm_kib(pid) - peak < 40 * 1024, (peak, _hwm_kib(pid))
    assert complete(server).status_code == 200


def test_an_app_of_1000_ops_sharing_one_tensor_costs_one_copy(server):
    """A ~460 KB file of 1 000 `affine` ops naming one matrix cost ~1 GB in each of three
    processes (API server, engine core, worker), not released after DELETE. Now the tensor
    is stored once everywhere: deploying and deleting it raises no process's peak memory by
    more than a few tens of MiB."""
    import psutil
    from safetensors.torch import save

    spec = _spec(
        "shared",
        [
            {
                "primitive": "write",
                "kernel": "affine",
                "site": "residual.post",
                "layers": [i % 4],
                "params": {},
                "artifacts": {"matrix": "m", "mu_s": "z", "mu_t": "z"},
            }
            for i in range(1000)
        ],
    )
    data = save({"m": torch.eye(D), "z": torch.zeros(D)}, metadata={"xmix.spec": json.dumps(spec)})
    assert len(data) < 600_000
    procs = [psutil.Process(server["proc"].pid)]
    procs += procs[0].children(recursive=True)
    before = {p.pid: _hwm_kib(p.pid) for p in procs}
    r = server["client"].post("/xmix/v1/apps", content=data)
    assert r.status_code == 201, r.text
    assert server["client"].delete("/xmix/v1/apps/shared").status_code == 200
    grew = {p.pid: _hwm_kib(p.pid) - before[p.pid] for p in procs}
    assert max(grew.values()) < 48 * 1024, grew


def test_read_results_are_bounded(server):
    """Read results never pass XMIX_MAX_RESULT_BYTES (2 MiB here, shared by a request's n
    sequences). What the prompt's positions return is known at admission: above the cap the
    request is refused with a message, streamed or not. Generated positions are cut at the
    cap, with the "!truncated" marker (issue 16; before, the worst case over max_tokens was
    refused)."""
    c = server["client"]
    cap = xmix.App("cap")
    cap.read("capture").at("final.post").named("h")
    assert c.post("/xmix/v1/apps", content=cap.to_bytes()).status_code == 201
    try:
        # accounted: (256 values + 1 position) x 26 bytes a position
        ok = complete(server, control={"apps": ["cap"]}, max_tokens=100)
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["xmix"]["cap"]["h"]["values"][0]) == D
        assert "!truncated" not in ok.json()["xmix"]
        for stream in (False, True):  # 350 prompt positions: over 2 MiB
            r = complete(
                server, prompt=[5] * 350, control={"apps": ["cap"]}, max_tokens=4, stream=stream
            )
            assert r.status_code == 400, r.text
            assert "XMIX_MAX_RESULT_BYTES" in r.json()["error"]["message"]
        # x 4 sequences of 10 + 99 positions: each is cut at its quarter of the cap (EOS is
        # ignored: a sampled EOS before ~80 tokens leaves a sequence under its quarter, as on CI)
        r = complete(
            server,
            control={"apps": ["cap"]},
            max_tokens=100,
            n=4,
            temperature=1.0,
            seed=7,
            ignore_eos=True,
        )
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            res = choice["xmix"]
            assert res["!truncated"].startswith(f"truncated at {(2 << 20) // 4} bytes")
            assert len(res["cap"]["h"]["positions"]) == ((2 << 20) // 4) // (257 * 26)
    finally:
        c.delete("/xmix/v1/apps/cap")


def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"non-JSON constant {name} in the response")

    return json.loads(text, parse_constant=refuse)


def _max_scale(server) -> float:
    from xmix.lang.lowering import WRITE_BOUND

    return WRITE_BOUND / float(server["steer"].ops[0].artifacts["vector"].abs().max())


def test_non_finite_reads_are_null_in_strict_json(server):
    """A read can still overflow (a distance of a stream steered to 1e30 is Inf): values
    that are not finite are sent as null and counted under "nonfinite", in responses and in
    every stream chunk (before: NaN and Infinity in the JSON)."""
    c = server["client"]
    dist = xmix.App("dist")
    dist.read("distance", centroids=torch.zeros(1, D)).layers([2]).at("residual.post").named("d")
    assert c.post("/xmix/v1/apps", content=dist.to_bytes()).status_code == 201
    try:
        ctl = {"apps": ["steer", "dist"], "params": {"steer": {"scale": _max_scale(server)}}}
        r = complete(server, control=ctl, max_tokens=4)
        assert r.status_code == 200, r.text
        d = _strict(r.text)["xmix"]["dist"]["d"]
        assert d["nonfinite"] == sum(v is None for v in d["values"]) > 0
        body = {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "vllm_xargs": {"xmix": json.dumps(ctl)},
        }
        nulls = 0
        with c.stream("POST", "/v1/completions", json=body) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    x = _strict(line[6:]).get("xmix")
                    if x:
                        nulls += x["dist"]["d"].get("nonfinite", 0)
        assert nulls == d["nonfinite"]
    finally:
        c.delete("/xmix/v1/apps/dist")


def test_writes_that_would_overflow_are_refused_and_cannot_poison_other_requests(server):
    """scale=3e38 drove the stream to Inf/NaN; vLLM reuses freed KV blocks without clearing
    them, so later requests that got those blocks, plain ones included, answered
    differently (seen here before the fix). Parameters whose write would pass 1e30 per
    element are now refused (400, naming the range); at the largest allowed scale other
    requests' answers stay exactly the same."""

    def batch(salt):
        async def one(client, i):
            body = {
                "model": "tiny",
                "prompt": f"Bystander {i}:",
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "cache_salt": salt,
                "return_token_ids": True,
            }
            if i % 2:
                body["vllm_xargs"] = {"xmix": json.dumps({"apps": ["probe"]})}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"], r.json().get("xmix")

        async def main():
            async with httpx.AsyncClient(
                base_url=server["base"], timeout=120, headers={"Authorization": f"Bearer {KEY}"}
            ) as client:
                return await asyncio.gather(*(one(client, i) for i in range(8)))

        return asyncio.run(main())

    before = batch("bystanders-1")
    r = complete(server, control={"apps": ["steer"], "params": {"steer": {"scale": 3e38}}})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"], r.text
    for _ in range(3):
        r = complete(
            server,
            prompt="Once upon a time " * 4,
            max_tokens=24,
            control={"apps": ["steer"], "params": {"steer": {"scale": _max_scale(server)}}},
        )
        assert r.status_code == 200, r.text
    assert batch("bystanders-2") == before


def test_soak_live_changes_under_16_streams(server):
    """16 concurrent greedy streams (plain, probe, steer, both) while the control plane
    deploys, re-parameterises, switches and deletes other apps and has deploys and PATCHes
    refused: every stream finishes, untouched answers (tokens and reads) equal a run without
    the changes, no response is a 500, and the engine keeps serving."""
    base = server["base"]
    headers = {"Authorization": f"Bearer {KEY}"}
    ctls = [None, {"apps": ["probe"]}, {"apps": ["steer"]}, {"apps": ["steer", "probe"]}]
    statuses: list[int] = []
    g = torch.Generator().manual_seed(21)
    valid = []
    for i in range(4):
        a = xmix.App(f"soak{i}")
        a.write("add", vector=torch.randn(D, generator=g), scale=1.0).layers([i % 4]).at(
            "residual.post"
        )
        a.read("probe", weight=torch.randn(D, generator=g) / 16).layers([3]).at(
            "residual.post"
        ).named("q")
        valid.append(a.to_bytes())
    overflow = xmix.App("overflow")
    overflow.read("probe", weight=torch.ones(D) / 64).layers([0]).at("residual.pre").named("g")
    for _ in range(3):
        overflow.write("add", vector=torch.ones(D)).layers("all").at("residual.post").cond(
            " or ".join(["g >= 0.5"] * 200)
        )
    refused = [
        overflow.to_bytes(),
        b"\0" * 64,
        _raw_app(_spec("nan", [], metadata={"x": float("nan")})),
    ]

    async def stream(client, i, salt):
        # token ids, not text: the streamed text of this random tiny model (bytes that are
        # not UTF-8) depends on how vLLM groups tokens into chunks
        body = {
            "model": "tiny",
            "prompt": f"Soak story {i}:",
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "cache_salt": salt,
            "return_token_ids": True,
        }
        if ctls[i % 4]:
            body["vllm_xargs"] = {"xmix": json.dumps(ctls[i % 4])}
        tokens, reads = [], []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ch = _strict(line[6:])
                    if ch.get("choices"):
                        tokens += ch["choices"][0].get("token_ids") or []
                    x = ch.get("xmix")
                    if x and "probe" in x:
                        reads += list(
                            zip(x["probe"]["p2"]["positions"], x["probe"]["p2"]["values"])
                        )
        return tokens, reads

    async def changes(client):
        for round_ in range(2):
            for i, data in enumerate(valid):
                r = await client.post("/xmix/v1/apps", content=data)
                statuses.append(r.status_code)
                assert r.status_code == 201, r.text
                for body in ({"params": {"scale": -2.0}}, {"mode": "off"}, {"mode": "request"}):
                    statuses.append(
                        (await client.patch(f"/xmix/v1/apps/soak{i}", json=body)).status_code
                    )
                r = await client.patch(
                    f"/xmix/v1/apps/soak{i}", json={"params": {"scale": 1}, "mode": "x"}
                )
                statuses.append(r.status_code)
                assert r.status_code == 422
                r = await client.post("/xmix/v1/apps", content=refused[(i + round_) % 3])
                statuses.append(r.status_code)
                assert r.status_code in (400, 422), r.text
                # a request that does use the changing app: it must finish, its answer may change
                r = await client.post(
                    "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": "touched",
                        "max_tokens": 8,
                        "vllm_xargs": {"xmix": json.dumps({"apps": [f"soak{i}"]})},
                    },
                )
                statuses.append(r.status_code)
                statuses.append((await client.delete(f"/xmix/v1/apps/soak{i}")).status_code)
                await asyncio.sleep(0.05)

    async def run(salt, with_changes):
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300) as client:
            jobs = [stream(client, i, salt) for i in range(16)]
            if with_changes:
                jobs.append(changes(client))
            out = await asyncio.gather(*jobs)
        return out[:16]

    reference = asyncio.run(run("soak-ref", False))
    soaked = asyncio.run(run("soak-live", True))
    assert 500 not in statuses and len(statuses) > 16 + 40, statuses
    changed = [i for i in range(16) if soaked[i] != reference[i]]
    assert not changed, [(reference[i], soaked[i]) for i in changed]
    assert all(len(t) == 24 for t, _ in soaked) and sum(len(r) for _, r in soaked) > 0
    assert server["proc"].poll() is None
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    assert [a["name"] for a in server["client"].get("/xmix/v1/apps").json()["apps"]] == [
        "steer",
        "probe",
    ]


def test_monitors_stop_and_switch_over_http(server):
    """Monitors served: a stop ends the response with finish_reason "stop" and names its
    trigger under xmix_applied.stopped (non-streamed and streamed: the stream's last chunk
    carries it, nothing after); a trigger in the prompt gives no token; a since(...) write
    names its switch; both are counted per app on /metrics."""
    from transformers import AutoTokenizer

    c = server["client"]
    g = torch.Generator().manual_seed(31)
    mon = xmix.App("mon")
    mon.param("theta", 0.0)
    mon.read("probe", weight=torch.randn(D, generator=g) / 16).layers([1]).at(
        "residual.post"
    ).named("m")
    mon.stop(when="m >= theta and generated")  # the first generated token
    sw = xmix.App("sw")
    sw.read("probe", weight=torch.randn(D, generator=g) / 16).layers([0]).at("residual.post").named(
        "s"
    )
    sw.write("add", vector=torch.randn(D, generator=g), scale=4.0).layers([2]).at(
        "residual.post"
    ).cond(when="since(s >= 0 and last_token)")
    for app in (mon, sw):
        r = c.post("/xmix/v1/apps", content=app.to_bytes())
        assert r.status_code == 201, r.text
    tok = AutoTokenizer.from_pretrained(server["model"])
    try:
        n_prompt = len(tok.encode("Once upon a time"))
        r = complete(server, control={"apps": ["mon"]}, max_tokens=8, return_token_ids=True)
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop" and len(choice["token_ids"]) == 1
        stopped = body["xmix_applied"]["stopped"]
        assert stopped["app"] == "mon" and stopped["read"] == "m"
        assert stopped["position"] == n_prompt and 0.0 < stopped["value"] < 1.0
        assert body["usage"]["completion_tokens"] == 1
        # theta 2: never fires; the answer is the plain one
        plain = complete(server, max_tokens=8).json()
        never = complete(server, control={"apps": ["mon"], "params": {"mon": {"theta": 2.0}}})
        assert never.json()["choices"][0]["text"] == plain["choices"][0]["text"]
        assert "stopped" not in never.json()["xmix_applied"]
        # a trigger in the prompt: no token at all
        on_prompt = xmix.App("mon_prompt")
        on_prompt.read("probe", weight=torch.ones(D) / 64).layers([0]).at("residual.post").named(
            "q"
        )
        on_prompt.stop(when="q >= 0")
        assert c.post("/xmix/v1/apps", content=on_prompt.to_bytes()).status_code == 201
        r = complete(server, control={"apps": ["mon_prompt"]}, return_token_ids=True).json()
        assert r["choices"][0]["token_ids"] == [] and r["choices"][0]["text"] == ""
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["xmix_applied"]["stopped"]["position"] == 0
        # streamed: the chunk that finishes carries the stop; nothing comes after it
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 8,
            "temperature": 0,
            "vllm_xargs": {"xmix": json.dumps({"apps": ["mon"]})},
        }
        full = c.post("/v1/chat/completions", json=chat).json()
        assert full["choices"][0]["finish_reason"] == "stop"
        chunks = []
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        fin = [
            i for i, ch in enumerate(chunks) if (ch.get("choices") or [{}])[0].get("finish_reason")
        ]
        assert len(fin) == 1 and chunks[fin[0]]["choices"][0]["finish_reason"] == "stop"
        assert chunks[fin[0]]["xmix_applied"]["stopped"] == full["xmix_applied"]["stopped"]
        assert all(not ch.get("choices") for ch in chunks[fin[0] + 1 :])
        text = "".join(
            (ch.get("choices") or [{}])[0].get("delta", {}).get("content") or "" for ch in chunks
        )
        assert text == full["choices"][0]["message"]["content"]
        # n = 2 sampled: each choice names its own sequence's stop
        two = complete(server, control={"apps": ["mon"]}, n=2, temperature=1.0, seed=4).json()
        for ch in two["choices"]:
            assert ch["finish_reason"] == "stop"
            assert ch["xmix_monitors"]["stopped"]["position"] == n_prompt
        # streamed, n = 2: the chunk that finishes each choice names that sequence's stop
        finishing = {}
        stream_two = {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": 8,
            "n": 2,
            "temperature": 1.0,
            "seed": 4,
            "stream": True,
            "vllm_xargs": {"xmix": json.dumps({"apps": ["mon"]})},
        }
        with c.stream("POST", "/v1/completions", json=stream_two) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    for ch in chunk.get("choices") or []:
                        if ch.get("finish_reason"):
                            finishing[ch["index"]] = chunk
        assert sorted(finishing) == [0, 1]
        for chunk in finishing.values():
            assert chunk["choices"][0]["finish_reason"] == "stop"
            assert chunk["xmix_monitors"]["stopped"]["position"] == n_prompt
        # a switch
        r = complete(server, control={"apps": ["sw"]}).json()
        (sw_rec,) = r["xmix_applied"]["switched"]
        assert sw_rec["app"] == "sw" and sw_rec["read"] == "s"
        assert sw_rec["position"] == n_prompt - 1  # the last prompt token
        assert r["choices"][0]["text"] != plain["choices"][0]["text"]
        metrics = c.get("/metrics").text.splitlines()

        def count(name, app, read):
            for l in metrics:
                if (
                    l.startswith(f"vllm:{name}_total{{")
                    and f'app="{app}"' in l
                    and f'read="{read}"' in l
                ):
                    return float(l.rsplit(" ", 1)[1])
            return 0.0

        # 2 completions, 1 stream, n=2 twice (non-streamed and streamed)
        assert count("xmix_requests_stopped", "mon", "m") == 7
        assert count("xmix_requests_stopped", "mon_prompt", "q") == 1
        assert count("xmix_requests_switched", "sw", "s") == 1
    finally:
        for name in ("mon", "sw", "mon_prompt"):
            c.delete(f"/xmix/v1/apps/{name}")
