"""``xmix serve`` through real HTTP clients (httpx, openai): the control plane, read results in
responses and streams, bad input, and changes while requests are in flight."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

import xmix
from xmix.models.tiny import tiny_model_path

pytestmark = pytest.mark.engine

KEY = "test-key-123"
D = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _apps(tmp):
    g = torch.Generator().manual_seed(7)
    steer = xmix.App("steer")
    steer.write("add", vector=torch.randn(D, generator=g), scale=4.0).layers([1]).submodule("residual.post")
    probe = xmix.App("probe")
    probe.read("probe", weight=torch.randn(D, generator=g) / 16, bias=0.0).layers([2]) \
        .submodule("residual.post").named("p2")
    return steer, probe, [steer.save(tmp / "steer.xmix"), probe.save(tmp / "probe.xmix")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    steer, probe, paths = _apps(tmp)
    port = _free_port()
    model = str(tiny_model_path("tiny-llama"))
    cmd = [sys.executable, "-m", "xmix.cli", "serve", model, "--port", str(port), "--dtype", "float32",
           "--max-model-len", "512", "--api-key", KEY, "--served-model-name", "tiny",
           "--max-num-seqs", "48"]
    for p in paths:
        cmd += ["--app", str(p)]
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            log.close()
            raise RuntimeError("xmix serve died:\n" + (tmp / "serve.log").read_text()[-4000:])
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.time() - t0 < 400, "server did not start"
        time.sleep(2)
    client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    yield dict(base=base, client=client, model=model, tmp=tmp, steer=steer, probe=probe)
    client.close()
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


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
    assert httpx.get(f"{base}/xmix/v1/apps", headers={"Authorization": "Bearer nope"}).status_code == 401
    r = server["client"].get("/xmix/v1/apps")
    assert r.status_code == 200
    assert [a["name"] for a in r.json()["apps"]] == ["steer", "probe"]
    # the data plane is guarded by vLLM itself with the same key
    assert httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401


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
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 6, "temperature": 0, "vllm_xargs": {"xmix": json.dumps({"apps": ["probe"]})}}
    full = server["client"].post("/v1/chat/completions", json=body).json()
    merged = {"positions": [], "values": []}
    text = ""
    with server["client"].stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
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
    tokens), the top level those of choice 0, and a stream with the same seed gives each
    choice the same reads on its own chunks."""
    from transformers import AutoModelForCausalLM

    from xmix.integrations.hf import attach

    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0,
            "seed": 3, "n": 2, "vllm_xargs": {"xmix": json.dumps({"apps": ["probe"]})}}
    full = server["client"].post("/v1/completions", json={**body, "return_token_ids": True})
    assert full.status_code == 200, full.text
    full = full.json()
    choices = sorted(full["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["token_ids"] != choices[1]["token_ids"], "seeded sampling should differ per choice"
    reads = [c["xmix"]["probe"]["p2"] for c in choices]
    model = AutoModelForCausalLM.from_pretrained(server["model"], dtype=torch.float32)
    with attach(model, [server["probe"]]) as att:
        for c, r in zip(choices, reads):
            req = att.request(c["prompt_token_ids"], apps=["probe"])
            req.prefill()
            for t in c["token_ids"][:-1]:  # the last sampled token is never fed back
                req.decode(t)
            want = req.results["probe"]["p2"]
            assert r["positions"] == want["positions"] == list(range(len(c["prompt_token_ids"]) + 5))
            np.testing.assert_allclose(r["values"], want["values"], rtol=1e-4, atol=1e-6)
    assert full["xmix"] == choices[0]["xmix"]

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
    st = client.completions.create(model="tiny", prompt="The river", max_tokens=8, temperature=0,
                                   extra_body={"vllm_xargs": {"xmix": json.dumps({"apps": ["steer"]})}})
    assert van.choices[0].text != st.choices[0].text


def test_metrics_on_vllms_endpoint(server):
    complete(server, control={"apps": ["probe"]})
    complete(server, control={"apps": ["nope"]})
    text = server["client"].get("/metrics").text
    assert any(l.startswith("vllm:xmix_app_requests_total{") and 'app="probe"' in l
               for l in text.splitlines())
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
    checks = {l.split("result=")[1].split('"')[1]: float(l.rsplit(" ", 1)[1])
              for l in text.splitlines() if l.startswith("vllm:xmix_graph_checks_total{")}
    assert checks == {"passed": 0.0, "failed": 0.0, "unverifiable": 0.0}  # no CUDA graph here
    assert "vllm:xmix_graph_fallbacks_total{" in text


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
    tmp = server["tmp"]
    extra = xmix.App("extra")
    extra.read("probe", weight=torch.ones(D) / 64).layers([0]).submodule("residual.pre").named("e")
    data = extra.to_bytes()
    r = c.post("/xmix/v1/apps", content=data, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    assert r.json()["sites"] == ["layers.0.residual.pre"]
    assert c.post("/xmix/v1/apps", content=data).status_code == 409
    # garbage, an app that does not fit, an app with code: refused, nothing deployed
    assert c.post("/xmix/v1/apps", content=b"\x00" * 64).status_code == 400
    assert c.post("/xmix/v1/apps", content=b"").status_code == 400
    wrong = xmix.App("wrong")
    wrong.write("add", vector=torch.ones(D + 2)).layers([0]).submodule("residual.pre")
    r = c.post("/xmix/v1/apps", content=wrong.to_bytes())
    assert r.status_code == 422 and "hidden size" in r.json()["error"]["message"]
    code = xmix.App("code")
    code.write("custom", cpu_library="/tmp/libx.so", cpu_symbol="f").layers([0]).submodule("residual.pre")
    r = c.post("/xmix/v1/apps", content=code.to_bytes())
    assert r.status_code == 400 and "custom kernel" in r.json()["error"]["message"]
    assert c.post("/xmix/v1/apps?mode=sometimes", content=data).status_code == 400
    names = [a["name"] for a in c.get("/xmix/v1/apps").json()["apps"]]
    assert names == ["steer", "probe", "extra"]
    # PATCH
    assert c.patch("/xmix/v1/apps/extra", json={"mode": "all"}).json()["mode"] == "all"
    r = complete(server)
    assert "e" in r.json()["xmix"]["extra"]  # mode all: every request gets it
    assert c.patch("/xmix/v1/apps/extra", json={"params": {"bias": 2.0}}).json()["params"] == {"e.bias": 2.0}
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
    flip.read("probe", weight=torch.ones(D) / 64).layers([1]).submodule("residual.pre").named("f")

    async def one(client, i):
        ctl = [None, {"apps": ["steer"]}, {"apps": ["probe"]}, {"apps": ["steer", "probe"]}][i % 4]
        body = {"model": "tiny", "prompt": f"Story number {i}:", "max_tokens": 24, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
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
        assert (await client.post("/xmix/v1/apps?mode=all", content=flip.to_bytes())).status_code == 201
        await asyncio.sleep(0.3)
        assert (await client.patch("/xmix/v1/apps/steer", json={"mode": "request"})).status_code == 200
        assert (await client.patch("/xmix/v1/apps/probe", json={"params": {"bias": 1.0}})).status_code == 200
        await asyncio.sleep(0.3)
        assert (await client.delete("/xmix/v1/apps/flip")).status_code == 200
        assert (await client.patch("/xmix/v1/apps/probe", json={"params": {"bias": 0.0}})).status_code == 200

    async def main():
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300) as client:
            results = await asyncio.gather(*(one(client, i) for i in range(32)), control(client))
        return results[:32]

    counts = asyncio.run(main())
    assert counts == [24] * 32, counts
